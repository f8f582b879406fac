"""Ejection chains (`search.eject`): they empty light waves by moves and swaps, keep every
wave within the envelope and every atom in one wave, roll back a chain they cannot finish,
and are deterministic; AUTO spends them on large steps within its time budget."""

from __future__ import annotations

import numpy as np
import pytest
from search_fakes import check_search_state, greedy_plan, grpo_step, real_pricer

from waveplan.search import check_plan, pack
from waveplan.search.eject import eject
from waveplan.search.greedy import LIMIT, atom_args
from waveplan.search.items import atom_size
from waveplan.search.local import eliminate


@pytest.mark.parametrize("seed", [2, 4])
def test_eject_empties_a_wave_that_moves_alone_cannot(seed):
    """On 512-request GRPO steps the greedy's plan has no wave `eliminate` can empty (it
    already ran), yet swaps empty one; the result keeps every wave in the envelope and the
    same call gives the same plan."""
    s, assign, nw = greedy_plan(seed, 512)
    moved = assign.copy()
    assert eliminate(moved, nw, s.active, atom_size(s.items), 8, *atom_args(s.items),
                     LIMIT) == nw
    runs = []
    for _ in range(2):
        a = assign.copy()
        nw2, work = eject(a, nw, s.active, atom_size(s.items), s.lower, 16, 250, 4000,
                          *atom_args(s.items), LIMIT)
        runs.append((nw2, work, a))
    nw2, work, a = runs[0]
    assert s.lower <= nw2 < nw and 0 < work <= 4000
    check_search_state(s, a, nw2)
    assert runs[1][0] == nw2 and runs[1][1] == work and np.array_equal(runs[1][2], a)


def test_eject_rolls_back_a_chain_it_cannot_finish():
    """With too few placements for any chain to finish, the plan comes back unchanged."""
    s, assign, nw = greedy_plan(2, 512)
    a = assign.copy()
    nw2, work = eject(a, nw, s.active, atom_size(s.items), s.lower, 16, 3, 3,
                      *atom_args(s.items), LIMIT)
    assert nw2 == nw and work == 3
    assert np.array_equal(a, assign)


def test_eject_stops_at_the_target():
    """No chain starts once the plan has `target` waves."""
    s, assign, nw = greedy_plan(2, 512)
    a = assign.copy()
    assert eject(a, nw, s.active, atom_size(s.items), nw, 16, 250, 4000, *atom_args(s.items),
                 LIMIT) == (nw, 0)
    assert np.array_equal(a, assign)


def test_auto_spends_placements_on_large_steps_only():
    """AUTO gives ejection chains a share of its budget on steps of >= EJECT_MIN_ATOMS atoms,
    more with a larger budget, and the plan still checks; small steps never run them."""
    step, pricer = real_pricer(grpo_step(2, 512))
    worst = max(pricer.admitted([np.asarray([i])], first_slots=frozenset(
        {r.slot} if r.grad else ())) for i, r in enumerate(step.requests))
    budget = int(worst * 4)
    short = pack(step, pricer, budget_bytes=budget, deterministic=True)
    long = pack(step, pricer, budget_bytes=budget, deterministic=True, time_budget_ms=200.0)
    check_plan(step, pricer, short, budget_bytes=budget)
    check_plan(step, pricer, long, budget_bytes=budget)
    assert 0 < short.stats["eject_placements"] < long.stats["eject_placements"]
    small_step, small_pricer = real_pricer(grpo_step(2, 128))
    small = pack(small_step, small_pricer, budget_bytes=budget, deterministic=True,
                 time_budget_ms=200.0)
    assert "eject_placements" not in small.stats
