"""Targeted cases: empty step, refusals, ladder, exact counts, greedy vs exact, order."""

from __future__ import annotations

import numpy as np
import pytest
from search_fakes import FakePricer, LinearPricer, grpo_step, make_step, pricers, singles_step

from waveplan.pricing.errors import ConfigError, InfeasibleError, StepError
from waveplan.search import PackerKind, check_plan, make_packer, pack
from waveplan.search.ladder import split_children

PRICERS = pricers()
ALL = list(PackerKind)


@pytest.mark.parametrize("kind", ALL, ids=[k.value for k in ALL])
def test_empty_step_gives_empty_plan(kind):
    step = make_step([])
    res = pack(step, FakePricer(step), budget_bytes=10**10, packer=kind)
    assert res.waves == () and res.lower_bound_waves == 0 and res.proven_optimal
    check_plan(step, FakePricer(step), res, budget_bytes=10**10)


@pytest.mark.parametrize("kind", ALL, ids=[k.value for k in ALL])
def test_request_too_large_alone_is_refused(kind):
    step = singles_step([1000, 9000, 500])
    pricer = LinearPricer(step)
    with pytest.raises(InfeasibleError) as exc:
        pack(step, pricer, budget_bytes=5000, packer=kind)
    msg = str(exc.value)
    assert "'g1r0'" in msg and "9000" in msg and "budget_bytes=5000" in msg


def test_budget_below_fixed_cost_is_refused():
    step = singles_step([10])
    with pytest.raises(InfeasibleError, match="budget_bytes"):
        pack(step, FakePricer(step), budget_bytes=10**6)


def test_unknown_packer_and_bad_units():
    with pytest.raises(ConfigError, match="packer="):
        make_packer("nope")
    step = singles_step([10, 20])
    with pytest.raises(StepError, match="atomic_units"):
        pack(step, LinearPricer(step), budget_bytes=100, atomic_units=[[0, 1], [1]])
    with pytest.raises(StepError, match="out of range"):
        pack(step, LinearPricer(step), budget_bytes=100, atomic_units=[[0, 5]])


def _relative_budget(step, pricer, factor):
    """factor x the largest price of one request alone with its pending gradients."""
    worst = max(pricer.price([np.asarray([i])], first_slots=frozenset({r.slot} if r.grad
                                                                      else ())).admitted_bytes
                for i, r in enumerate(step.requests))
    return int(worst * factor)


@pytest.mark.parametrize("pname,make", PRICERS, ids=[p[0] for p in PRICERS])
def test_ladder_splits_a_unit_that_does_not_fit_flat(pname, make):
    step, pricer = make(make_step([(500, [6000, 6000, 6000, 6000, 6000])], grads=[False]))
    if pname.startswith("fake"):
        pricer = FakePricer(step, retained=0.3, first_cost=0.0, slack=pricer.slack)
    idx = np.arange(5)
    flat = pricer.price([idx]).admitted_bytes
    rungs = {k: pricer.price(list(split_children(step, idx, k))).admitted_bytes
             for k in range(2, 6)}
    k_fit = min(rungs, key=lambda k: (rungs[k], k))
    assert rungs[k_fit] < flat
    budget = (rungs[k_fit] + flat) // 2
    unit = idx.tolist()
    res = pack(step, pricer, budget_bytes=budget, atomic_units=[unit])
    check_plan(step, pricer, res, budget_bytes=budget, atomic_units=[unit])
    assert len(res.waves) == 1 and res.waves[0].is_split
    k = len(res.waves[0].children)
    assert 2 <= k <= k_fit
    assert all(rungs[j] > budget for j in range(2, k))   # lower rungs did not fit
    assert res.stats["split_units"] == 1


def test_ladder_uses_non_power_of_two_rungs():
    step = make_step([(0, [4000] * 6)])
    pricer = FakePricer(step, retained=0.0, first_cost=0.0, slack=0.0)
    idx = np.arange(6)
    prices = {k: pricer.price([c for c in np.array_split(idx, k)]).admitted_bytes
              for k in (1, 2, 3)}
    budget = (prices[2] + prices[3]) // 2   # 3 children fit, 2 do not
    res = pack(step, pricer, budget_bytes=budget, atomic_units=[idx.tolist()])
    check_plan(step, pricer, res, budget_bytes=budget, atomic_units=[idx.tolist()])
    assert len(res.waves[0].children) == 3


def test_ladder_refusal_names_unit_price_and_budget():
    step = make_step([(100, [5000, 5000, 5000])])
    pricer = FakePricer(step, retained=1.0, first_cost=0.0)
    single = pricer.price([np.asarray([0])]).admitted_bytes
    two = pricer.price([np.asarray([0]), np.asarray([1])]).admitted_bytes
    budget = (single + two) // 2    # one request fits, two children never do
    with pytest.raises(InfeasibleError) as exc:
        pack(step, pricer, budget_bytes=budget, atomic_units=[[0, 1, 2]])
    msg = str(exc.value)
    assert "atomic unit ['g0r0', 'g0r1', 'g0r2']" in msg
    assert f"budget_bytes={budget}" in msg and "cheapest price" in msg


def _ffd_trap():
    # sizes 3,3,2,2,2,2 into bins of 7: decreasing-order greedy needs 3, optimum is 2
    step = singles_step([3000, 3000, 2000, 2000, 2000, 2000])
    return step, LinearPricer(step), 7001


def test_greedy_misses_optimum_exact_finds_it():
    step, pricer, budget = _ffd_trap()
    greedy = pack(step, pricer, budget_bytes=budget, packer=PackerKind.GREEDY, deterministic=True)
    check_plan(step, pricer, greedy, budget_bytes=budget)
    assert len(greedy.waves) == 3 and not greedy.proven_optimal
    assert greedy.lower_bound_waves == 2
    exact = pack(step, pricer, budget_bytes=budget, packer=PackerKind.EXACT, deterministic=True)
    check_plan(step, pricer, exact, budget_bytes=budget)
    assert len(exact.waves) == 2 and exact.proven_optimal
    assert exact.stats["exact_status"] == "optimal"


def test_multistart_closes_the_same_gap_deterministically():
    step, pricer, budget = _ffd_trap()
    a = pack(step, pricer, budget_bytes=budget, deterministic=True)
    b = pack(step, pricer, budget_bytes=budget, deterministic=True)
    check_plan(step, pricer, a, budget_bytes=budget)
    assert len(a.waves) == 2 and a.stats["multistart_iterations"] > 0
    assert [[c.tolist() for c in w.children] for w in a.waves] == \
        [[c.tolist() for c in w.children] for w in b.waves]


def test_exact_raises_the_bound_when_it_proves_infeasibility():
    # five items of 0.35: the size bound says 2, but at most two fit a wave -> 3 is optimal
    step = singles_step([3500] * 5)
    pricer = LinearPricer(step)
    res = pack(step, pricer, budget_bytes=10001, packer=PackerKind.EXACT)
    check_plan(step, pricer, res, budget_bytes=10001)
    assert len(res.waves) == 3 and res.lower_bound_waves == 3 and res.proven_optimal
    greedy = pack(step, pricer, budget_bytes=10001, packer=PackerKind.GREEDY)
    assert greedy.lower_bound_waves == 2 and not greedy.proven_optimal


@pytest.mark.parametrize("pname,make", PRICERS, ids=[p[0] for p in PRICERS])
def test_exact_count_balances_and_refuses(pname, make):
    step = grpo_step(3, 64)
    step, pricer = make(step)
    budget = _relative_budget(step, pricer, 3.0)
    base = pack(step, pricer, budget_bytes=budget, deterministic=True)
    lb = base.lower_bound_waves
    for N in (lb, lb + 1, lb + 3, 64):
        res = pack(step, pricer, budget_bytes=budget, num_waves=N, deterministic=True)
        check_plan(step, pricer, res, budget_bytes=budget, num_waves=N)
    res = pack(step, pricer, budget_bytes=budget, num_waves=lb + 3, deterministic=True)
    prices = [w.price.admitted_bytes for w in res.waves]
    assert max(prices) - min(prices) < 0.5 * budget
    with pytest.raises(InfeasibleError, match="num_waves=65"):
        pack(step, pricer, budget_bytes=budget, num_waves=65)
    with pytest.raises(InfeasibleError, match=f"num_waves={lb - 1}"):
        pack(step, pricer, budget_bytes=budget, num_waves=lb - 1)
    with pytest.raises(ConfigError, match="num_waves"):
        pack(step, pricer, budget_bytes=budget, num_waves=0)


def test_first_gradient_wave_gets_most_room_and_runs_first():
    # waves {4000 a, 3000 b} and {2500 b, 2000 a}: the roomier one carries a's gradients
    from waveplan.search.contract import SearchPricer
    from waveplan.search.items import build_items
    from waveplan.search.order import assign_first_slots
    from waveplan.search.reprice import Draft, price_draft

    step = make_step([(0, [4000]), (0, [2000]), (0, [3000]), (0, [2500])],
                     slots=["a", "a", "b", "b"], grads=[True, True, False, False])
    pricer = LinearPricer(step, first_cost=1000)
    seen = SearchPricer.of(pricer)   # the pricer as the search's stages take it
    budget = 7001
    items = build_items(step, pricer, budget, reserve_pending=None)
    drafts = [Draft([0, 2]), Draft([1, 3])]
    for d in drafts:
        price_draft(d, items, seen)
    waves = assign_first_slots(drafts, items, seen, step, budget)
    assert [w.atoms for w in waves] == [[1, 3], [0, 2]]
    assert waves[0].first_slots == frozenset({"a"}) and not waves[1].first_slots
    assert waves[0].price.admitted_bytes == 5500
    # and the search leaves room for them from the start: two waves, a's first
    res = pack(step, pricer, budget_bytes=budget)
    check_plan(step, pricer, res, budget_bytes=budget)
    assert len(res.waves) == 2 and res.waves[0].first_slots == frozenset({"a"})


def test_first_gradient_wave_repair_picks_a_wave_that_can_carry():
    step = make_step([(0, [6000]), (0, [2000]), (0, [5000])], slots=["a", "a", "b"],
                     grads=[True, True, False])
    pricer = LinearPricer(step, first_cost=1500)
    res = pack(step, pricer, budget_bytes=7001)
    check_plan(step, pricer, res, budget_bytes=7001)
    assert res.waves[0].children[0].tolist() == [1]


def test_pending_gradients_repair_moves_requests_out():
    # every wave is full; the pending gradients force requests out into another wave
    step = singles_step([3000, 3000, 3000, 3000])
    pricer = LinearPricer(step, first_cost=900)
    res = pack(step, pricer, budget_bytes=6001)
    check_plan(step, pricer, res, budget_bytes=6001)
    assert res.waves[0].first_slots == frozenset({"a"})
    assert len(res.waves[0].children[0]) == 1
    assert len(res.waves) == 3


def test_pending_gradients_that_fit_nowhere_are_refused():
    step = singles_step([3000])
    pricer = LinearPricer(step, first_cost=5000)
    with pytest.raises(InfeasibleError, match="pending adapter gradients"):
        pack(step, pricer, budget_bytes=6001)


@pytest.mark.parametrize("pname,make", PRICERS, ids=[p[0] for p in PRICERS])
def test_same_input_same_plan(pname, make):
    step = grpo_step(11, 128)
    step, pricer = make(step)
    plans = []
    for _ in range(2):
        res = pack(step, pricer, budget_bytes=_relative_budget(step, pricer, 1.7), seed=5,
                   deterministic=True)
        plans.append([(sorted(w.first_slots), [c.tolist() for c in w.children])
                      for w in res.waves])
    assert plans[0] == plans[1]


def test_prompts_are_kept_together_when_they_fit():
    step = grpo_step(0, 64)
    pricer = FakePricer(step)
    res = pack(step, pricer, budget_bytes=int(4e10))
    groups_per_wave = [len(set(step.group_of[w.requests].tolist())) for w in res.waves]
    spread = sum(len({i for i, w in enumerate(res.waves) if g in set(step.group_of[w.requests])})
                 for g in range(len(step.prefix_rows)))
    assert spread == len(step.prefix_rows)   # no prompt is paid twice
    assert sum(groups_per_wave) == len(step.prefix_rows)
