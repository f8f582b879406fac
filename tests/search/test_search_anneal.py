"""Annealing against the envelope (`search.anneal`), plain and aimed chains: it keeps every
wave within the envelope and every atom in one wave, never adds a wave, rolls back a plain
chain it cannot finish (an aimed one gives its pool back to the wave, keeping a valid plan),
is deterministic for a seed, and empties a wave the greedy left on a 512-request step."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from search_fakes import check_search_state, greedy_plan

from waveplan.search.anneal import anneal
from waveplan.search.greedy import LIMIT, atom_args
from waveplan.search.items import atom_size


def _run(s, assign, nw, work, seed, target=None, aimed=False):
    a = assign.copy()
    nw2, done = anneal(a, nw, s.active, atom_size(s.items), s.lower if target is None
                       else target, work, seed, *atom_args(s.items), LIMIT, aimed)
    return a, nw2, done


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 40), n=st.sampled_from([24, 64, 128]),
       factor=st.sampled_from([2.0, 4.0]), work=st.integers(1, 20000),
       rng=st.integers(0, 3), aimed=st.booleans())
def test_anneal_keeps_waves_in_the_envelope_and_never_adds_one(seed, n, factor, work, rng,
                                                               aimed):
    s, assign, nw = greedy_plan(seed, n, factor)
    a, nw2, done = _run(s, assign, nw, work, rng, target=1, aimed=aimed)
    assert nw2 <= nw and 0 <= done <= work + nw + 1
    check_search_state(s, a, nw2)
    b, nw3, done3 = _run(s, assign, nw, work, rng, target=1, aimed=aimed)   # same seed, plan
    assert (nw3, done3) == (nw2, done) and np.array_equal(a, b)


def test_anneal_rolls_back_a_chain_out_of_evaluations():
    s, assign, nw = greedy_plan(1, 512)
    a, nw2, _ = _run(s, assign, nw, 10, 0)
    assert nw2 == nw and np.array_equal(a, assign)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 40), work=st.integers(1, 3000), rng=st.integers(0, 3))
def test_aimed_chain_out_of_evaluations_gives_its_pool_back(seed, work, rng):
    """An aimed chain that cannot empty its wave puts the pool back into it: the plan keeps
    its waves, every atom in one of them, every wave within the envelope."""
    s, assign, nw = greedy_plan(seed, 512)
    a, nw2, done = _run(s, assign, nw, work, rng, target=nw - 1, aimed=True)
    assert nw - 1 <= nw2 <= nw and done <= work + nw + 1
    check_search_state(s, a, nw2)


def test_anneal_stops_at_the_target():
    s, assign, nw = greedy_plan(1, 512)
    for aimed in (False, True):
        a, nw2, done = _run(s, assign, nw, 10000, 0, target=nw, aimed=aimed)
        assert (nw2, done) == (nw, 0) and np.array_equal(a, assign)


def test_anneal_empties_a_wave_the_greedy_left():
    """On 512-request GRPO steps the first greedy run leaves a wave that annealing (which
    mixes the gradient slots) empties within 100k evaluations."""
    s, assign, nw = greedy_plan(1, 512)
    for aimed in (False, True):
        a, nw2, done = _run(s, assign, nw, 100_000, 0, aimed=aimed)
        assert s.lower <= nw2 < nw and done <= 100_000 + nw + 1
        check_search_state(s, a, nw2)
