"""Exactly priced moves and swaps that empty the lightest wave (`search.swap`), and the
slot-aware greedy rule (`greedy.PEAK_INCREASE`): swaps never leave a wave over the budget,
never add a wave, keep every atom in exactly one wave, roll back what they cannot finish and
are deterministic; AUTO's plans on large steps pass `check_plan` and repeat."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from search_fakes import grpo_step, real_pricer, search_state

from waveplan.search import check_plan, pack
from waveplan.search import packers as P
from waveplan.search.greedy import (
    LIMIT,
    PEAK_INCREASE,
    SPLIT_BLOCKS,
    atom_args,
    block_orders,
    greedy_inputs,
    greedy_run,
)
from waveplan.search.items import blocks_for
from waveplan.search.kernels import build_state
from waveplan.search.reprice import Draft, drafts_from_assign, price_draft, reprice_all
from waveplan.search.swap import empty_by_swaps


def _drafts(s, split_waves: int) -> list[Draft]:
    """The greedy's plan, exactly priced, with its `split_waves` largest waves cut in two
    (a plan with light waves to empty)."""
    assign, nw, _ = P._greedy(s, blocks_for(s.items, s.active))
    drafts = reprice_all(drafts_from_assign(s.items, s.active, assign, nw) + s.fixed,
                         s.items, s.pricer, s.step, s.budget)
    drafts.sort(key=lambda d: (-len(d.atoms), d.atoms[0]))
    out = []
    for i, d in enumerate(drafts):
        if i < split_waves and len(d.atoms) > 1 and not d.fixed:
            h = len(d.atoms) // 2
            for part in (d.atoms[:h], d.atoms[h:]):
                out.append(Draft(list(part)))
                price_draft(out[-1], s.items, s.pricer)
        else:
            out.append(d)
    return out


def _check(s, before: list[Draft], after: list[Draft]) -> None:
    """No more waves; every atom once; every wave's carried price is its exact price and
    within the budget."""
    assert len(after) <= len(before)
    atoms = sorted(a for d in after for a in d.atoms)
    assert atoms == sorted(a for d in before for a in d.atoms)
    for d in after:
        carried = d.price.admitted_bytes
        assert carried <= s.budget
        assert price_draft(Draft(list(d.atoms)), s.items, s.pricer).admitted_bytes == carried


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 50), n=st.sampled_from([24, 40, 64]),
       factor=st.sampled_from([2.5, 4.0]), split=st.integers(0, 3),
       prices=st.integers(1, 400))
def test_swaps_keep_waves_within_budget_and_never_add_one(seed, n, factor, split, prices):
    s = search_state(seed, n, factor)
    before = _drafts(s, split)
    copy = [Draft(list(d.atoms), price=d.price, fixed=d.fixed) for d in before]
    after, spent = empty_by_swaps(copy, s.items, s.pricer, s.budget, prices, lower=1)
    assert 0 <= spent <= prices
    _check(s, before, after)


@pytest.mark.parametrize("seed", [0, 3])
def test_swaps_empty_split_waves_and_repeat(seed):
    """A plan with two waves cut in two gets at least one wave back; the same call on the
    same plan gives the same waves."""
    s = search_state(seed, 64, 4.0)
    before = _drafts(s, 2)
    runs = []
    for _ in range(2):
        copy = [Draft(list(d.atoms), price=d.price, fixed=d.fixed) for d in before]
        after, spent = empty_by_swaps(copy, s.items, s.pricer, s.budget, 2000, lower=1)
        _check(s, before, after)
        runs.append((sorted(tuple(d.atoms) for d in after), spent))
    assert runs[0] == runs[1]
    assert len(runs[0][0]) < len(before)


def test_swaps_roll_back_a_chain_out_of_prices():
    """With one price no wave of a tight plan can be emptied: the plan comes back unchanged."""
    s = search_state(1, 64, 4.0)
    before = _drafts(s, 0)
    copy = [Draft(list(d.atoms), price=d.price, fixed=d.fixed) for d in before]
    after, spent = empty_by_swaps(copy, s.items, s.pricer, s.budget, 1, lower=1)
    assert spent <= 1
    if len(after) == len(before):
        assert sorted(tuple(d.atoms) for d in after) == sorted(tuple(d.atoms) for d in before)
        assert [d.price.admitted_bytes for d in after] == [d.price.admitted_bytes
                                                           for d in before]


@pytest.mark.parametrize("seed", [0, 2])
def test_peak_increase_rule_packs_every_atom_within_the_envelope(seed):
    s = search_state(seed, 128, 4.0)
    blocks = blocks_for(s.items, s.active)
    inputs = greedy_inputs(s.items, blocks)
    order = next(iter(block_orders(blocks, s.items)))
    assign, nw = greedy_run(order, PEAK_INCREASE, SPLIT_BLOCKS, 0, inputs)
    assert nw > 0 and np.all(assign[s.active] >= 0)
    load, _, _ = build_state(assign, nw, s.active, *atom_args(s.items)[0],
                             *atom_args(s.items)[1])
    assert load[:nw].max() <= LIMIT


@pytest.mark.parametrize("ms", [5.0, 200.0])
def test_auto_large_step_plan_is_valid_and_deterministic(ms):
    """AUTO on a 512-request step (peak rule first, ejection chains, exact swaps): the plan
    passes check_plan and the same inputs give the same plan."""
    step, pricer = real_pricer(grpo_step(4, 512))
    worst = max(pricer.admitted([np.asarray([i])], first_slots=frozenset(
        {r.slot} if r.grad else ())) for i, r in enumerate(step.requests))
    budget = int(worst * 4)
    plans = []
    for _ in range(2):
        res = pack(step, pricer, budget_bytes=budget, time_budget_ms=ms, deterministic=True)
        check_plan(step, pricer, res, budget_bytes=budget)
        plans.append([(tuple(np.concatenate(w.children).tolist()), sorted(w.first_slots))
                      for w in res.waves])
    assert plans[0] == plans[1]
