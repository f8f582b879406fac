"""Prefix-tree layouts equal a brute-force trie; both step forms agree; padding and CP rules."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waveplan.pricing.errors import ConfigError, StepError
from waveplan.pricing.layout import (
    LayoutCounts,
    busiest_cp_rank_rows,
    layout,
    num_padding_rows,
    padded_rows,
    padding_segments,
)
from waveplan.pricing.step import Request, Step, bundled_step, load_step, materialize_tokens


def trie_counts(seqs: list[tuple[int, ...]]) -> tuple[int, int, list[int]]:
    """(packed rows, segments, sequence rows largest first) of a plain trie."""
    nodes: set[tuple[int, ...]] = set()
    children: dict[tuple[int, ...], set] = defaultdict(set)
    for s in seqs:
        for d in range(1, len(s) + 1):
            nodes.add(s[:d])
            children[s[:d - 1]].add(s[:d])
    ends = set(seqs)
    segments = sum(1 for v in nodes if v in ends or len(children[v]) >= 2)
    per_root: dict[int, int] = defaultdict(int)
    for v in nodes:
        per_root[v[0]] += 1
    return len(nodes), segments, sorted(per_root.values(), reverse=True)


def token_step(seqs) -> Step:
    return Step.from_requests(Request.from_tokens(f"r{i}", s) for i, s in enumerate(seqs))


# Small alphabets and lengths: many duplicates, prefixes of others and shared branches.
token_lists = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=7), min_size=1, max_size=14)


@settings(max_examples=300, deadline=None)
@given(seqs=token_lists, data=st.data())
def test_token_layout_equals_brute_force_trie(seqs, data):
    step = token_step(seqs)
    subset = data.draw(st.lists(st.integers(0, len(seqs) - 1), unique=True), label="subset")
    counts = layout(step, subset)
    chosen = [tuple(seqs[i]) for i in subset]
    if not chosen:
        assert counts == LayoutCounts(num_requests=0, logical_rows=0, packed_rows=0, segments=0,
                                      sequence_rows=np.zeros(0, np.int64))
        return
    packed, segments, rows = trie_counts(chosen)
    assert counts.num_requests == len(subset)
    assert counts.logical_rows == sum(map(len, chosen))
    assert counts.packed_rows == packed
    assert counts.segments == segments
    assert counts.sequence_rows.tolist() == rows
    unshared = layout(step, subset, shared=False)
    assert unshared.packed_rows == unshared.logical_rows == counts.logical_rows
    assert unshared.segments == unshared.num_sequences == len(subset)
    assert sorted(unshared.sequence_rows.tolist(), reverse=True) == sorted(map(len, chosen), reverse=True)


def _lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=200, deadline=None)
@given(seqs=token_lists)
def test_token_groups_hang_under_the_deepest_shared_node(seqs):
    step = token_step(seqs)
    n = len(seqs)
    deepest = [max((_lcp(seqs[i], seqs[j]) for j in range(n) if j != i), default=0) for i in range(n)]
    for i in range(n):
        g = step.group_of[i]
        assert step.prefix_rows[g] == deepest[i]
        assert step.own_rows[i] == len(seqs[i]) - deepest[i] >= 0
        for j in range(n):
            same = step.group_of[j] == g
            expected = deepest[i] > 0 and deepest[j] == deepest[i] and _lcp(seqs[i], seqs[j]) >= deepest[i]
            assert same == (expected or i == j)
    assert sorted(set(step.group_of.tolist())) == list(range(step.num_groups))
    # Numbered by first appearance.
    firsts = [int(np.flatnonzero(step.group_of == g)[0]) for g in range(step.num_groups)]
    assert firsts == sorted(firsts)


@st.composite
def length_steps(draw) -> Step:
    requests = []
    for g in range(draw(st.integers(1, 5))):
        if draw(st.booleans()):
            requests.append(Request(id=f"solo{g}", num_tokens=draw(st.integers(1, 30))))
            continue
        prompt = draw(st.integers(1, 20))
        for c in range(draw(st.integers(1, 5))):
            requests.append(Request(id=f"g{g}c{c}", prompt=f"p{g}", num_prompt_tokens=prompt,
                                    num_tokens=prompt + draw(st.integers(1, 20))))
    order = draw(st.permutations(range(len(requests))))
    return Step.from_requests([requests[i] for i in order])


@settings(max_examples=200, deadline=None)
@given(step=length_steps(), data=st.data(), seed=st.integers(0, 2**16))
def test_length_and_token_forms_agree(step, data, seed):
    tokens = materialize_tokens(step, vocab_size=50, seed=seed)
    assert tokens.is_token_form and not step.is_token_form
    assert [r.num_tokens for r in tokens.requests] == [r.num_tokens for r in step.requests]
    subset = data.draw(st.lists(st.integers(0, step.num_requests - 1), unique=True), label="subset")
    assert layout(step, subset) == layout(tokens, subset)
    assert layout(step, subset, shared=False) == layout(tokens, subset, shared=False)
    chosen = [tuple(tokens.requests[i].tokens.tolist()) for i in subset]
    if chosen:
        assert layout(step, subset).packed_rows == trie_counts(chosen)[0]


def test_small_tree_by_hand():
    # [1,2,3] twice (a duplicate), its extension [1,2,3,4,5], a branch [1,2,7], another root [9].
    step = token_step([[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3], [1, 2, 7], [9]])
    full = layout(step, range(5))
    assert (full.logical_rows, full.packed_rows, full.segments) == (15, 7, 5)
    assert full.sequence_rows.tolist() == [6, 1]
    assert layout(step, [0, 2]).packed_rows == 3 and layout(step, [0, 2]).segments == 1
    assert layout(step, [1, 3]).segments == 3  # branch node + two leaves
    assert step.group_of.tolist() == [0, 0, 0, 1, 2]
    assert step.prefix_rows.tolist() == [3, 2, 0]
    assert step.own_rows.tolist() == [0, 2, 0, 1, 1]


def test_bundled_grpo_step_counts():
    step = load_step(bundled_step("grpo-8x8"))
    full = layout(step, np.arange(64))
    prompts = {r.prompt: r.num_prompt_tokens for r in step.requests}
    assert full.logical_rows == step.num_logical_rows
    assert full.packed_rows == full.logical_rows - 7 * sum(prompts.values())
    assert full.segments == 64 + 8 and full.num_sequences == 8
    assert layout(step, [0]).segments == 1  # a lone member is one unbranched path
    assert layout(step, [0, 1]).segments == 3


def test_indices_errors_and_types():
    step = token_step([[1], [2], [3]])
    with pytest.raises(StepError, match=r"indices\[1\]=5: out of range"):
        layout(step, [0, 5])
    with pytest.raises(StepError, match=r"indices=2: request listed twice"):
        layout(step, [2, 0, 2])
    with pytest.raises(StepError, match=r"out of range"):
        layout(step, [-1])
    assert layout(step, np.array([2, 0], np.int32)).packed_rows == 2
    assert layout(step, np.array([True, False, True])) == layout(step, [0, 2])
    with pytest.raises(StepError, match=r"mask needs one entry per request"):
        layout(step, np.array([True, False]))
    counts = layout(step, range(3))
    assert not counts.sequence_rows.flags.writeable
    assert counts.to_dict()["packed_rows"] == 3
    assert hash(counts) == hash(layout(step, [2, 1, 0]))


def test_padding():
    rows = [5, 8, 1]
    assert padded_rows(rows, 4) == 8 + 8 + 4
    assert num_padding_rows(rows, 4) == 6
    assert padding_segments(rows, 4) == 6  # each pad token is a root segment (docs/memory-model.md#layouts)
    assert padded_rows(rows, 1) == 14 and num_padding_rows([], 4) == 0
    with pytest.raises(ConfigError, match="multiple=0"):
        padded_rows(rows, 0)


def test_busiest_cp_rank_rows():
    # docs/memory-model.md#layouts: the 4k pair ran unshared, two 4,096-row sequences: 4,096 per CP2 rank.
    assert busiest_cp_rank_rows([4096, 4096], cp=2, tp=1, sequence_parallel=False) == 4096
    # CP1: the packed rows, padded to TP under sequence parallelism only.
    assert busiest_cp_rank_rows([10, 3], cp=1, tp=1, sequence_parallel=False) == 13
    assert busiest_cp_rank_rows([10, 3], cp=1, tp=4, sequence_parallel=True) == 12 + 4
    # CP2 x TP4 with SP: each sequence padded to 16, split in 4 chunks, 2 per rank.
    assert busiest_cp_rank_rows([100], cp=2, tp=4, sequence_parallel=True) == 112 // 2
    assert busiest_cp_rank_rows([100, 1], cp=4, tp=1, sequence_parallel=False) == (104 + 8) // 4
    with pytest.raises(ConfigError, match="sequence_parallel"):
        busiest_cp_rank_rows([8], cp=2, tp=1, sequence_parallel=True)
