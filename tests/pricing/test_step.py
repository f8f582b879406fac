"""Requests, steps, step files (every error names file:line:field) and the bundled steps."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from waveplan.pricing.errors import StepError, WaveplanError
from waveplan.pricing.layout import layout
from waveplan.pricing.step import (
    Request,
    Step,
    bundled_step,
    list_bundled_steps,
    load_step,
    materialize_tokens,
    step_from_tree_form,
)

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "step.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- requests and steps in code -----------------------------------------------------------


def test_request_fields_and_defaults():
    r = Request(id="g0-c1", num_tokens=10, prompt="g0", num_prompt_tokens=4)
    assert (r.slot, r.grad, r.tokens, r.num_completion_tokens) == ("default", True, None, 6)
    t = Request.from_tokens("x", [5, 6, 7], slot="b", grad=False)
    assert t.num_tokens == 3 and t.tokens.dtype == np.int64 and not t.tokens.flags.writeable
    # tokens are not part of equality or hashing
    assert t == Request.from_tokens("x", [1, 2, 3], slot="b", grad=False)
    assert hash(t) == hash(Request.from_tokens("x", [1, 2, 3], slot="b", grad=False))
    mine = np.array([1, 2], np.int64)
    Request.from_tokens("y", mine)
    assert mine.flags.writeable  # the caller's array is copied, not frozen


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"id": "", "num_tokens": 3}, r"id=''"),
    ({"id": "a", "num_tokens": 0}, r"'a'.*num_tokens=0"),
    ({"id": "a", "num_tokens": 2.5}, r"num_tokens=2.5"),
    ({"id": "a", "num_tokens": True}, r"num_tokens=True"),
    ({"id": "a", "num_tokens": 5, "prompt": "p", "num_prompt_tokens": 5}, r"num_prompt_tokens=5.*completion"),
    ({"id": "a", "num_tokens": 5, "prompt": "p", "num_prompt_tokens": 0}, r"num_prompt_tokens=0"),
    ({"id": "a", "num_tokens": 5, "num_prompt_tokens": 2}, r"num_prompt_tokens=2.*without a prompt"),
    ({"id": "a", "num_tokens": 5, "prompt": ""}, r"prompt=''"),
    ({"id": "a", "num_tokens": 2, "tokens": [1, 2], "prompt": "p", "num_prompt_tokens": 1}, r"prompt='p'.*not both"),
    ({"id": "a", "num_tokens": 3, "tokens": [1, 2]}, r"tokens=.*num_tokens=3"),
    ({"id": "a", "num_tokens": 2, "tokens": [1.0, 2.0]}, r"tokens=.*integer"),
    ({"id": "a", "num_tokens": 2, "tokens": [1, -2]}, r"tokens=-2"),
    ({"id": "a", "num_tokens": 2, "slot": ""}, r"slot=''"),
    ({"id": "a", "num_tokens": 2, "grad": "yes"}, r"grad='yes'"),
])
def test_request_errors_name_field_and_value(kwargs, match):
    with pytest.raises(StepError, match=match):
        Request(**kwargs)


def test_step_validation():
    a = Request(id="a", num_tokens=5, prompt="p", num_prompt_tokens=2)
    with pytest.raises(StepError, match=r"requests\[1\].id='a': duplicate id \(first at requests\[0\]\)"):
        Step.from_requests([a, a])
    b = Request(id="b", num_tokens=5, prompt="p", num_prompt_tokens=3)
    with pytest.raises(StepError, match=r"requests\[1\].num_prompt_tokens=3: prompt 'p' has 2"):
        Step.from_requests([a, b])
    with pytest.raises(StepError, match=r"mixes token-form and length-form"):
        Step.from_requests([a, Request.from_tokens("t", [1])])
    with pytest.raises(StepError, match=r"at least one request"):
        Step.from_requests([])
    with pytest.raises(StepError, match=r"must be a Request"):
        Step.from_requests([a, {"id": "x"}])
    assert isinstance(StepError("x"), WaveplanError)


def test_length_form_groups_and_arrays():
    step = Step.from_requests([
        Request(id="a", num_tokens=10, prompt="p", num_prompt_tokens=4),
        Request(id="solo", num_tokens=7, slot="other", grad=False),
        Request(id="b", num_tokens=6, prompt="p", num_prompt_tokens=4),
        Request(id="c", num_tokens=9, prompt="q", num_prompt_tokens=8),
    ])
    assert step.group_of.tolist() == [0, 1, 0, 2]
    assert step.prefix_rows.tolist() == [4, 0, 8]  # a request without a key: prefix 0
    assert step.own_rows.tolist() == [6, 7, 2, 1]
    assert step.slot_names == ("default", "other") and step.slots.tolist() == [0, 1, 0, 0]
    assert step.grads.tolist() == [True, False, True, True]
    assert step.lengths.tolist() == [10, 7, 6, 9] and step.num_logical_rows == 32
    assert (step.num_requests, step.num_groups, step.ids) == (4, 3, ("a", "solo", "b", "c"))
    for name in ("group_of", "prefix_rows", "own_rows", "slots", "grads", "lengths"):
        assert not getattr(step, name).flags.writeable
    assert step.to_length_form() == [
        {"id": "a", "prompt": "p", "prompt_tokens": 4, "completion_tokens": 6},
        {"id": "solo", "completion_tokens": 7, "slot": "other", "grad": False},
        {"id": "b", "prompt": "p", "prompt_tokens": 4, "completion_tokens": 2},
        {"id": "c", "prompt": "q", "prompt_tokens": 8, "completion_tokens": 1},
    ]


def test_length_form_round_trip(tmp_path):
    step = load_step(bundled_step("grpo-8x8"))
    path = write(tmp_path, *(json.dumps(line) for line in step.to_length_form()))
    assert load_step(path) == step


def test_token_form_to_length_form_never_shares_more(tmp_path):
    step = Step.from_requests(Request.from_tokens(f"r{i}", s) for i, s in enumerate(
        [[1, 2, 3], [1, 2, 3], [1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 5, 7], [8, 9]]))
    lines = step.to_length_form()
    again = load_step(write(tmp_path, *(json.dumps(x) for x in lines)))
    assert again.lengths.tolist() == step.lengths.tolist()
    full = layout(step, range(6))
    assert layout(again, range(6)).packed_rows >= full.packed_rows
    assert full.packed_rows == 7 + 2


# Nested shared prompts, a duplicate pair, a request that is a prefix of others, one that
# shares nothing, two slots and a no-grad request.
NESTED = [[1, 2, 3], [1, 2, 3], [1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 5, 7], [8, 9], [1, 2, 5, 6, 0, 4],
          [1, 2]]


def _nested_step() -> Step:
    return Step.from_requests(
        Request.from_tokens(f"r{i}", s, slot="b" if i % 3 == 2 else "default", grad=i != 5)
        for i, s in enumerate(NESTED))


def _tree_arrays(step: Step) -> dict:
    names = ("lengths", "group_of", "prefix_rows", "own_rows", "slots", "grads", "rank",
             "lcp_table", "length_at")
    return {name: getattr(step, name).tolist() for name in names} | {"slot_names": step.slot_names}


def test_token_form_tree_round_trip_keeps_the_tree():
    step = _nested_step()
    lines = json.loads(json.dumps(step.to_tree_form()))
    assert lines[0] == {"id": "r0", "num_tokens": 3, "tree_position": 1, "shared_tokens": 2}
    assert lines[5] == {"id": "r5", "num_tokens": 2, "tree_position": 7, "shared_tokens": 0,
                        "slot": "b", "grad": False}
    again = step_from_tree_form(lines)
    assert again.is_token_form and again.ids == step.ids and again.requests == step.requests
    assert _tree_arrays(again) == _tree_arrays(step)
    assert again.to_tree_form() == lines
    for subset in ([0, 1], [2, 3, 6], [3, 4, 6, 7], range(8)):
        a, b = layout(step, list(subset)), layout(again, list(subset))
        assert (a.packed_rows, a.segments, a.sequence_rows.tolist()) == \
            (b.packed_rows, b.segments, b.sequence_rows.tolist())


def test_tree_form_round_trip_of_a_bundled_step_in_token_form():
    step = materialize_tokens(load_step(bundled_step("grpo-8x8")))
    again = step_from_tree_form(json.loads(json.dumps(step.to_tree_form())))
    assert _tree_arrays(again) == _tree_arrays(step)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda ls: ls.clear(), r"requests=\[\]"),
    (lambda ls: ls[1].update(tree_position=ls[0]["tree_position"]), r"requests\[1\].tree_position=1: .*distinct"),
    (lambda ls: ls[0].update(num_tokens=0), r"requests\[0\].num_tokens=0"),
    (lambda ls: ls[2].update(shared_tokens=9), r"requests\[2\].shared_tokens=9: exceeds"),
    (lambda ls: ls[0].pop("shared_tokens"), r"requests\[0\].shared_tokens=None: missing field"),
    (lambda ls: ls[0].update(tokens=[1]), r"requests\[0\].tokens=\[1\]: unknown field"),
    # r0 and r1 are equal: swapping their places puts equal requests out of request order
    (lambda ls: ls[0].update(tree_position=2, shared_tokens=3) or ls[1].update(tree_position=1, shared_tokens=2),
     r"describe no prefix tree"),
])
def test_tree_form_errors_name_the_field(edit, match):
    lines = _nested_step().to_tree_form()
    edit(lines)
    with pytest.raises(StepError, match=match):
        step_from_tree_form(lines)


# --- step files ---------------------------------------------------------------------------


def test_load_both_forms(tmp_path):
    path = write(tmp_path,
                 '{"id": "a", "tokens": [1, 2, 3], "slot": "s1"}',
                 "",
                 '{"id": "b", "tokens": [1, 2, 4], "grad": false}')
    step = load_step(path)
    assert step.is_token_form and step.ids == ("a", "b")
    assert step.requests[0].slot == "s1" and step.requests[1].grad is False
    assert layout(step, [0, 1]).packed_rows == 4
    path = write(tmp_path, '{"id": "g0-c0", "prompt": "g0", "prompt_tokens": 20, "completion_tokens": 5}',
                 '{"id": "x", "completion_tokens": 9}')
    step = load_step(path)
    assert not step.is_token_form
    assert step.requests[0] == Request(id="g0-c0", num_tokens=25, prompt="g0", num_prompt_tokens=20)
    assert step.requests[1] == Request(id="x", num_tokens=9)


GOOD = '{"id": "ok", "prompt": "g", "prompt_tokens": 4, "completion_tokens": 2}'
GOOD_T = '{"id": "ok", "tokens": [1, 2]}'


@pytest.mark.parametrize(("lines", "line", "needle"), [
    ([GOOD, '{"id": "a", '], 2, "invalid JSON"),
    ([GOOD, "[1, 2]"], 2, "JSON object"),
    (['{"tokens": [1]}'], 1, "id: missing field"),
    (['{"id": "a", "tokens": [1], "colour": 3}'], 1, "colour=3: unknown field"),
    (['{"id": 7, "tokens": [1]}'], 1, "id=7"),
    (['{"id": "", "tokens": [1]}'], 1, "id=''"),
    ([GOOD_T, '{"id": "a", "tokens": "12"}'], 2, "tokens='12'"),
    (['{"id": "a", "tokens": []}'], 1, "tokens=[]"),
    (['{"id": "a", "tokens": [1, "2"]}'], 1, "tokens[1]='2'"),
    (['{"id": "a", "tokens": [1, true]}'], 1, "tokens[1]=True"),
    (['{"id": "a", "tokens": [1, 2.0]}'], 1, "tokens[1]=2.0"),
    (['{"id": "a", "tokens": [-1]}'], 1, "tokens[0]=-1"),
    (['{"id": "a", "tokens": [1], "slot": 3}'], 1, "slot=3"),
    (['{"id": "a", "tokens": [1], "grad": "no"}'], 1, "grad='no'"),
    ([GOOD, '{"id": "a", "prompt": "g", "prompt_tokens": "4", "completion_tokens": 2}'], 2, "prompt_tokens='4'"),
    ([GOOD, '{"id": "a", "prompt": "g", "prompt_tokens": 0, "completion_tokens": 2}'], 2, "prompt_tokens=0"),
    ([GOOD, '{"id": "a", "prompt": "g", "prompt_tokens": -3, "completion_tokens": 2}'], 2, "prompt_tokens=-3"),
    ([GOOD, '{"id": "a", "prompt": "g", "prompt_tokens": 4, "completion_tokens": -1}'], 2, "completion_tokens=-1"),
    ([GOOD, '{"id": "a", "completion_tokens": 1.5}'], 2, "completion_tokens=1.5"),
    ([GOOD, '{"id": "a", "prompt": 5, "prompt_tokens": 4, "completion_tokens": 2}'], 2, "prompt=5"),
    ([GOOD, '{"id": "a", "prompt": "g", "completion_tokens": 2}'], 2, "prompt_tokens: missing field"),
    ([GOOD, '{"id": "a", "prompt_tokens": 3, "completion_tokens": 2}'], 2, "prompt: missing field"),
    ([GOOD, '{"id": "a", "prompt": "g", "prompt_tokens": 4}'], 2, "completion_tokens: missing field"),
    ([GOOD, '{"id": "a", "tokens": [1], "prompt": "g"}'], 2, "prompt='g'"),
    ([GOOD, '{"id": "a", "tokens": [1]}'], 2, "tokens: token form, but line 1 is length form"),
    ([GOOD_T, '{"id": "a", "completion_tokens": 3}'], 2, "completion_tokens: length form"),
    ([GOOD, "", GOOD], 3, "id='ok': duplicate id (first on line 1)"),
    ([GOOD, '{"id": "a", "prompt": "g", "prompt_tokens": 5, "completion_tokens": 2}'], 2,
     "prompt_tokens=5: prompt 'g' has 4 tokens on line 1"),
])
def test_step_file_errors_name_file_line_and_field(tmp_path, lines, line, needle):
    path = write(tmp_path, *lines)
    with pytest.raises(StepError) as info:
        load_step(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert needle in message, message
    assert "\n" not in message


def test_step_file_errors_without_a_line(tmp_path):
    with pytest.raises(StepError, match=r"cannot read step file"):
        load_step(tmp_path / "missing.jsonl")
    with pytest.raises(StepError, match=r"no requests"):
        load_step(write(tmp_path, "", "  "))


# --- bundled steps and their generator ----------------------------------------------------


def test_bundled_steps():
    assert list_bundled_steps() == ["grpo-32x16", "grpo-8x8", "sft-64"]
    assert bundled_step("grpo-8x8.jsonl") == bundled_step("grpo-8x8")
    with pytest.raises(StepError, match=r"step='nope'.*grpo-8x8"):
        bundled_step("nope")
    grpo = load_step(bundled_step("grpo-8x8"))
    assert (grpo.num_requests, grpo.num_groups) == (64, 8)
    assert abs(grpo.num_logical_rows - 280_000) < 0.01 * 280_000
    assert 256 <= grpo.prefix_rows.min() and grpo.prefix_rows.max() <= 4096
    assert 64 <= grpo.own_rows.min() and grpo.own_rows.max() <= 8192
    big = load_step(bundled_step("grpo-32x16"))
    assert (big.num_requests, big.num_groups) == (512, 32)
    sft = load_step(bundled_step("sft-64"))
    full = layout(sft, range(64))
    assert (sft.num_requests, full.packed_rows, full.segments) == (64, full.logical_rows, 64)


def test_bundled_steps_match_their_generator(tmp_path):
    spec = importlib.util.spec_from_file_location("make_steps", ROOT / "bench" / "make_steps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for path in module.write(tmp_path):
        assert path.read_text() == bundled_step(path.stem).read_text(), path.name


def test_materialize_tokens():
    step = load_step(bundled_step("grpo-8x8"))
    tokens = materialize_tokens(step, seed=3)
    assert materialize_tokens(tokens) is tokens
    assert tokens.ids == step.ids
    again = materialize_tokens(step, seed=3)
    assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(tokens.requests, again.requests, strict=True))
    assert layout(tokens, range(64)) == layout(step, range(64))
    with pytest.raises(StepError, match=r"vocab_size=4"):
        materialize_tokens(step, vocab_size=4)
