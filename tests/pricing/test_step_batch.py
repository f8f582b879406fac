"""Steps from the user's own batch: `Step.from_token_ids`, `Step.from_lengths`, `Step.from_padded`
(lists, numpy arrays, torch tensors; right- and left-padded 2-D batches; bad input)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waveplan.pricing.errors import StepError
from waveplan.pricing.layout import layout
from waveplan.pricing.step import Request, Step, load_step

torch = pytest.importorskip("torch")

# small alphabets: many shared prefixes, duplicates and prefixes of other rows
rows_strategy = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=9), min_size=1, max_size=12)


def tree_arrays(step: Step) -> tuple:
    return (step.lengths.tolist(), step.group_of.tolist(), step.prefix_rows.tolist(),
            step.rank.tolist(), step.length_at.tolist(), step.lcp_table.tolist())


def pad(rows, sides, width, fill=0):
    """A [B, width] batch: row r starts at column `sides[r]` (0 = right-padded; width - len =
    left-padded), padding `fill` (not a valid guess for the tokens)."""
    ids = np.full((len(rows), width), fill, np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for r, (row, start) in enumerate(zip(rows, sides, strict=True)):
        ids[r, start:start + len(row)] = row
        mask[r, start:start + len(row)] = 1
    return ids, mask


@settings(max_examples=150, deadline=None)
@given(rows=rows_strategy, data=st.data())
def test_from_token_ids_equals_requests_in_every_container(rows, data):
    expected = Step.from_requests(Request.from_tokens(str(i), r) for i, r in enumerate(rows))
    kind = data.draw(st.sampled_from(["list", "numpy", "torch", "int32"]), label="container")
    if kind == "list":
        seqs = rows
    elif kind == "numpy":
        seqs = [np.array(r, np.int64) for r in rows]
    elif kind == "torch":
        seqs = [torch.tensor(r) for r in rows]
    else:
        seqs = [np.array(r, np.int32) for r in rows]
    step = Step.from_token_ids(seqs)
    assert step == expected and step.is_token_form
    assert tree_arrays(step) == tree_arrays(expected)
    # shared prefixes come from the tree: a full-step layout equals the requests' own layout
    everything = range(len(rows))
    assert layout(step, everything).packed_rows == layout(expected, everything).packed_rows


@settings(max_examples=150, deadline=None)
@given(rows=rows_strategy, data=st.data())
def test_from_padded_right_left_or_both_equals_the_unpadded_rows(rows, data):
    width = max(map(len, rows)) + data.draw(st.integers(0, 3), label="extra columns")
    how = data.draw(st.sampled_from(["right", "left", "mixed"]), label="padding")
    sides = [0 if how == "right" else width - len(r) if how == "left" else
             data.draw(st.integers(0, width - len(r))) for r in rows]
    ids, mask = pad(rows, sides, width, fill=data.draw(st.integers(0, 3), label="pad id"))
    as_torch = data.draw(st.booleans(), label="torch")
    if as_torch:
        ids, mask = torch.from_numpy(ids), torch.from_numpy(mask).bool()
    step = Step.from_padded(ids, mask)
    expected = Step.from_token_ids(rows)
    assert step == expected and tree_arrays(step) == tree_arrays(expected)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_from_padded_with_the_response_split_shares_exactly_the_prompts(data):
    """veRL's layout: `prompts` left-padded to P columns, `responses` right-padded to R."""
    prompts = data.draw(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=4), min_size=1,
                                 max_size=4), label="prompts")
    groups = data.draw(st.lists(st.integers(0, len(prompts) - 1), min_size=1, max_size=10), label="rows")
    responses = [data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=5)) for _ in groups]
    width_p = max(map(len, prompts)) + data.draw(st.integers(0, 2))
    width_r = max(map(len, responses)) + data.draw(st.integers(0, 2))
    rows = [prompts[g] + r for g, r in zip(groups, responses, strict=True)]
    sides = [width_p - len(prompts[g]) for g in groups]
    ids, mask = pad(rows, sides, width_p + width_r)
    step = Step.from_padded(torch.from_numpy(ids), torch.from_numpy(mask), response_length=width_r)
    assert not step.is_token_form
    assert step.lengths.tolist() == [len(r) for r in rows]
    assert [r.num_prompt_tokens for r in step.requests] == [len(prompts[g]) for g in groups]
    assert [r.num_completion_tokens for r in step.requests] == list(map(len, responses))
    # rows share a group exactly when their prompts are equal (different keys may hold equal
    # prompt tokens: rows are grouped by content, not by key)
    key = {}
    for i, g in enumerate(groups):
        key.setdefault(tuple(prompts[g]), step.requests[i].prompt)
        assert step.requests[i].prompt == key[tuple(prompts[g])]
    everything = range(len(rows))
    assert layout(step, everything).packed_rows == \
        sum(map(len, key)) + sum(map(len, responses))


def test_from_padded_rows_without_prompt_or_response_share_nothing():
    ids = np.array([[0, 5, 6, 7, 0], [0, 5, 6, 7, 0], [0, 0, 8, 0, 0], [0, 0, 0, 9, 1]])
    mask = (ids > 0).astype(np.int64)
    step = Step.from_padded(ids, mask, response_length=2)
    assert step.to_length_form() == [
        {"id": "0", "prompt": "0", "prompt_tokens": 2, "completion_tokens": 1},
        {"id": "1", "prompt": "0", "prompt_tokens": 2, "completion_tokens": 1},
        {"id": "2", "completion_tokens": 1},   # no response token: the prompt alone
        {"id": "3", "completion_tokens": 2},   # no prompt token: the response alone
    ]


def test_from_lengths_matches_the_step_file(tmp_path):
    step = Step.from_lengths(np.array([4, 0, 4, 8]), torch.tensor([6, 7, 2, 1]), ["p", "x", "p", 3],
                             ["a", "solo", "b", "c"], slots=["default", "other", "default", "default"],
                             grads=[True, False, True, True])
    lines = [{"id": "a", "prompt": "p", "prompt_tokens": 4, "completion_tokens": 6},
             {"id": "solo", "completion_tokens": 7, "slot": "other", "grad": False},
             {"id": "b", "prompt": "p", "prompt_tokens": 4, "completion_tokens": 2},
             {"id": "c", "prompt": "3", "prompt_tokens": 8, "completion_tokens": 1}]
    assert step.to_length_form() == lines
    path = tmp_path / "step.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert load_step(path) == step
    # no groups: nothing shared, the prompt tokens only count as rows
    alone = Step.from_lengths([4, 4], [1, 2])
    assert alone.prefix_rows.tolist() == [0, 0] and alone.lengths.tolist() == [5, 6]
    assert alone.ids == ("0", "1") and alone.slot_names == ("default",)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_from_lengths_groups_share_their_prompt(data):
    n = data.draw(st.integers(1, 12))
    keys = data.draw(st.lists(st.one_of(st.none(), st.integers(0, 3)), min_size=n, max_size=n))
    size = {k: data.draw(st.integers(0, 5)) for k in set(keys) if k is not None}
    prompt = [0 if k is None else size[k] for k in keys]
    completion = data.draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    step = Step.from_lengths(prompt, completion, keys)
    shared = {k for k in size if size[k] > 0}
    assert layout(step, range(n)).packed_rows == sum(size[k] for k in shared) + sum(
        c + (p if k not in shared else 0) for k, p, c in zip(keys, prompt, completion, strict=True))


@pytest.mark.parametrize(("call", "match"), [
    (lambda: Step.from_token_ids([]), r"sequences=\[\]: a step needs at least one"),
    (lambda: Step.from_token_ids("abc"), r"sequences='str'"),
    (lambda: Step.from_token_ids([[1, 2], []]), r"sequences\[1\]=\[\]: must hold at least one"),
    (lambda: Step.from_token_ids([[1, -2]]), r"sequences\[0\]=-2: token ids must be >= 0"),
    (lambda: Step.from_token_ids([[1.5, 2.0]]), r"sequences\[0\]='<float64 array.*integers"),
    (lambda: Step.from_token_ids([[[1, 2]]]), r"sequences\[0\]=.*shape \(1, 2\).*1-D"),
    (lambda: Step.from_token_ids([[1], [2]], ids=["a"]), r"ids='<1 values>': needs one value per request \(2\)"),
    (lambda: Step.from_token_ids([[1], [2]], ids="ab"), r"ids='ab'.*not one string"),
    (lambda: Step.from_token_ids([[1], [2]], ids=["a", "a"]), r"requests\[1\].id='a': duplicate"),
    (lambda: Step.from_token_ids([[1], [2]], ids=["a", 7]), r"ids\[1\]=7: must be a non-empty str"),
    (lambda: Step.from_token_ids([[1]], slots=""), r"slots='': must be a non-empty string"),
    (lambda: Step.from_token_ids([[1]], grads=["yes"]), r"grads\[0\]='yes': must be true or false"),
    (lambda: Step.from_lengths([1, 2], [3]), r"prompt_lengths='<2 values>': needs one value per request \(1\)"),
    (lambda: Step.from_lengths([1], [0]), r"completion_lengths\[0\]=0: must be an integer >= 1"),
    (lambda: Step.from_lengths([-1], [2]), r"prompt_lengths\[0\]=-1: must be an integer >= 0"),
    (lambda: Step.from_lengths([2, 3], [1, 1], ["g", "g"]),
     r"prompt_lengths\[1\]=3: group 'g' has 2 prompt tokens at prompt_lengths\[0\]"),
    (lambda: Step.from_lengths([2, 2], [1, 1], [1, "1"]), r"groups\[1\]='1': prints as '1' like"),
    (lambda: Step.from_lengths([2], [1], [[1]]), r"groups\[0\]=\[1\]: must be a hashable key"),
    (lambda: Step.from_lengths([2], [1], [True]), r"groups\[0\]=True"),
    (lambda: Step.from_lengths([2], [1.0]), r"completion_lengths='<float64"),
    (lambda: Step.from_padded([[1, 2]], [[1, 1, 0]]), r"attention_mask=.*shape of input_ids \(1, 2\)"),
    (lambda: Step.from_padded([[1, 2, 3]], [[1, 0, 1]]), r"attention_mask\[0\]=\[1, 0, 1\]: must be one contiguous"),
    (lambda: Step.from_padded([[1, 2]], [[0, 0]]), r"attention_mask\[0\]='<all 0>'"),
    (lambda: Step.from_padded([[1, 2]], [[2, 1]]), r"attention_mask\[0, 0\]=2: must be 0 or 1"),
    (lambda: Step.from_padded([[1, -2]], [[1, 1]]), r"input_ids\[0, 1\]=-2: token ids must be >= 0"),
    (lambda: Step.from_padded([1, 2], [1, 1]), r"input_ids='<int64 array of shape \(2,\)>'.*2-D"),
    (lambda: Step.from_padded([[1, 2]], [[1, 1]], response_length=2), r"response_length=2: must be an integer in \[1, 1\]"),
    (lambda: Step.from_padded([[1, 2]], [[1, 1]], response_length=1.0), r"response_length=1.0"),
    (lambda: Step.from_padded(torch.nested.nested_tensor([torch.tensor([1]), torch.tensor([2, 3])], layout=torch.jagged),
                              [[1, 1]]), r"tensor='<nested tensor>'"),
])
def test_bad_batches_name_field_and_value(call, match):
    with pytest.raises(StepError, match=match):
        call()
