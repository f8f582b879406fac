"""What the time budget buys (docs/faq.md#time-budget): the default rule, clock mode never
worse than the deterministic plan of the same budget, and a larger deterministic budget never
giving more waves. No test here reads a timing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from search_fakes import FakePricer, grpo_step, make_step, real_model, real_pricer

from waveplan.search import PackerKind, check_plan, default_time_budget_ms, pack
from waveplan.search.options import DEFAULT_MS_PER_REQUEST, DEFAULT_TIME_BUDGET_MS
from waveplan.search.packers import not_proven_why

FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def steps(draw):
    groups, slots, grads = [], [], []
    for _ in range(draw(st.integers(1, 10))):
        pre = draw(st.integers(0, 3000))
        members = draw(st.lists(st.integers(1, 6000), min_size=1, max_size=8))
        groups.append((pre, members))
        slots.append(draw(st.sampled_from(["a", "b"])))
        grads.append(draw(st.booleans()))
    return make_step(groups, slots=slots, grads=grads)


def _budget(step, pricer, factor: float) -> int:
    worst = max(pricer.price([np.asarray([i])],
                             first_slots=frozenset({r.slot}) if r.grad else frozenset()
                             ).admitted_bytes for i, r in enumerate(step.requests))
    return int(worst * factor)


def test_the_default_rule():
    assert default_time_budget_ms(1) == DEFAULT_TIME_BUDGET_MS == 20.0
    assert default_time_budget_ms(100) == 20.0
    assert default_time_budget_ms(128) == pytest.approx(25.6)
    assert default_time_budget_ms(2048) == pytest.approx(DEFAULT_MS_PER_REQUEST * 2048)
    assert default_time_budget_ms(2048) == pytest.approx(409.6)
    sizes = [1, 32, 128, 200, 201, 512, 2048, 10000]
    budgets = [default_time_budget_ms(n) for n in sizes]
    assert budgets == sorted(budgets)


def test_no_budget_is_the_default_rule_and_an_explicit_one_wins():
    step = grpo_step(0, 256)
    pricer = FakePricer(step)
    budget = _budget(step, pricer, 3.0)
    plain = pack(step, pricer, budget_bytes=budget, deterministic=True)
    ruled = pack(step, pricer, budget_bytes=budget, deterministic=True,
                 time_budget_ms=default_time_budget_ms(256))
    assert [list(w.requests) for w in plain.waves] == [list(w.requests) for w in ruled.waves]
    timing = ("time_ms", "searches_ms")
    assert {k: v for k, v in plain.stats.items() if k not in timing} == \
        {k: v for k, v in ruled.stats.items() if k not in timing}
    tiny = pack(step, pricer, budget_bytes=budget, deterministic=True, time_budget_ms=0.01)
    assert tiny.stats["greedy_runs"] <= plain.stats["greedy_runs"]


@settings(max_examples=25, **FAST)
@given(step=steps(), factor=st.floats(1.0, 4.0), ms=st.sampled_from([0.05, 0.5, 2.0, 5.0]))
def test_clock_mode_is_never_worse_than_deterministic(step, factor, ms):
    pricer = FakePricer(step)
    budget = _budget(step, pricer, factor)
    det = pack(step, pricer, budget_bytes=budget, time_budget_ms=ms, deterministic=True)
    clock = pack(step, pricer, budget_bytes=budget, time_budget_ms=ms)
    check_plan(step, pricer, clock, budget_bytes=budget)
    assert len(clock.waves) <= len(det.waves)
    assert clock.lower_bound_waves == det.lower_bound_waves


@settings(max_examples=25, **FAST)
@given(step=steps(), factor=st.floats(1.0, 4.0),
       budgets=st.lists(st.sampled_from([0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 20.0]), min_size=2,
                        max_size=2, unique=True))
def test_a_larger_deterministic_budget_never_gives_more_waves(step, factor, budgets):
    pricer = FakePricer(step)
    budget = _budget(step, pricer, factor)
    small, large = sorted(budgets)
    a = pack(step, pricer, budget_bytes=budget, time_budget_ms=small, deterministic=True)
    b = pack(step, pricer, budget_bytes=budget, time_budget_ms=large, deterministic=True)
    assert len(b.waves) <= len(a.waves), (small, len(a.waves), large, len(b.waves))


def test_a_plan_not_proven_says_why():
    if real_model() is None:
        pytest.skip("needs waveplan.pricing's real model")
    reasons = []
    for seed in (1, 3):   # generated steps whose plans stay above their bound at 5 ms
        step, pricer = real_pricer(grpo_step(seed, 128))
        budget = _budget(step, pricer, 4.0)
        for kind in (PackerKind.EXACT, PackerKind.AUTO):
            res = pack(step, pricer, budget_bytes=budget, packer=kind, deterministic=True)
            assert res.proven_optimal == (len(res.waves) <= res.lower_bound_waves)
            if res.proven_optimal:
                assert "not_proven" not in res.stats
            else:
                reasons.append(res.stats["not_proven"])
                assert res.stats["not_proven"] == not_proven_why(res.stats["exact_status"])
    assert reasons
    assert not_proven_why("too-large") == "model size"
    assert not_proven_why("optimal") == "bound"
    assert not_proven_why("unknown") == not_proven_why("not-run") == "time"
    assert not_proven_why("no-time") == "time"


@pytest.mark.parametrize("n,seed", [(128, 1), (512, 0)])   # the multistart's rounds; annealing's
def test_the_clock_left_improves_the_deterministic_plan_and_keeps_it_valid(n, seed):
    """`_spend_the_rest` with a fixed 0.3 s of clock after the deterministic plan of a
    real-priced step it leaves above its bound: rounds run (however fast the machine), the
    plan is never worse and passes every invariant."""
    import time

    from waveplan.search import packers
    from waveplan.search.contract import SearchPricer
    from waveplan.search.options import SearchOptions

    if real_model() is None:
        pytest.skip("needs waveplan.pricing's real model")
    step, pricer = real_pricer(grpo_step(seed, n))
    budget = _budget(step, pricer, 4.0)
    states = []
    det = packers._search(step, SearchPricer.of(pricer), budget,
                          SearchOptions(time_budget_ms=5.0), keep=states)
    s = states[-1]
    assert len(det.waves) > det.lower_bound_waves and s.nw > s.lower   # something to improve
    s.tail_s = 0.0
    end = time.perf_counter() + 0.3
    res = packers._spend_the_rest(s, det, lambda: end)
    check_plan(step, pricer, res, budget_bytes=budget)
    assert len(res.waves) <= len(det.waves)
    assert res.stats["clock_rounds"] >= 1
    assert (res.stats["clock_multistart_iterations"] > 0) == (n < packers.EJECT_MIN_ATOMS)


def test_the_work_is_sized_to_a_share_of_the_budget():
    """The estimates set aside per request and per wave come out of WORK_SHARE of the budget
    (docs/faq.md#time-budget); what is left never goes below 0."""
    from waveplan.search import budget as b

    assert 0.0 < b.WORK_SHARE <= 1.0
    assert b.search_us(10.0, 0, 0) == pytest.approx(b.WORK_SHARE * 1e4)
    assert b.search_us(10.0, 3, 100) == pytest.approx(
        b.WORK_SHARE * 1e4 - 3 * b.POST_US_PER_WAVE
        - 100 * (b.PREP_US_PER_REQUEST + b.POST_US_PER_REQUEST))
    assert b.search_us(0.001, 100, 1000) == 0.0
    assert b.probe_cost_us(512, 512, 30, 8, True) > b.probe_cost_us(512, 512, 30, 8, False) > 0


def _rope_case(n: int, seed: int):
    from waveplan.planner.planner import Planner
    from waveplan.search.contract import SearchPricer

    sys_path_bench()
    from bench_search import bench_case

    planner = Planner.from_model(real_model())
    step, _make, budget = bench_case(n, seed)
    return planner, step, budget, SearchPricer.of(planner._search_view(planner.pricer(step)))


def sys_path_bench():
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[2] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)


def test_the_probe_reserve_is_how_far_the_charged_waves_go_over():
    """`earlier.probe_growth` charges a plan's waves, fullest first, the entries of those
    before them: how far the most charged one goes over the budget (0 when all fit)."""
    import numpy as np

    from waveplan.search.earlier import probe_growth

    if real_model() is None:
        pytest.skip("needs waveplan.pricing's real model")
    _planner, step, budget, sp = _rope_case(128, 0)
    n = len(step.requests)
    parts = [[np.arange(i, min(i + 16, n), dtype=np.int64)] for i in range(0, n, 16)]
    admitted = [sp.price(p).admitted_bytes for p in parts]
    waves = list(zip(parts, admitted, strict=True))
    assert probe_growth(sp, waves, 10 * budget) == 0      # room for any entries
    order = sorted(waves, key=lambda w: (-w[1], int(w[0][0][0])))
    extra = sp.earlier.earlier_entries([sp.loads.group_loads(p) for p, _ in order])
    assert extra[0] == 0 and max(extra) > 0
    grown = [sp.earlier.plus_earlier(sp.price(p), e).admitted_bytes - a
             for (p, a), e in zip(order, extra, strict=True)]
    i = max(range(len(order)), key=lambda k: grown[k])
    tight = order[i][1] + grown[i] - 1                   # that wave no longer fits
    g = probe_growth(sp, waves, tight)
    assert g == max(a + d for (_, a), d in zip(order, grown, strict=True)) - tight >= 1
    assert probe_growth(sp, waves[:1], tight) == 0       # one wave: no earlier waves
    # the overflow, not the largest growth: a wave with room asks for no reserve
    assert probe_growth(sp, waves, max(a + d for (_, a), d in zip(order, grown, strict=True))) == 0


@pytest.mark.parametrize("n,seed,searches", [(128, 0, 2), (512, 0, 2), (512, 2, 1)])
def test_a_step_whose_waves_need_the_rope_reserve_is_searched_at_most_twice(n, seed, searches):
    """The planner's search charges the earlier waves' RoPE entries; where the reserve
    measured on the probe plan holds (512 requests, seed 2) one search runs; where the plan's
    charged waves overflow it (128 and 512 seed 0), a second search against it raised by the
    overflow, at least to the largest growth, holds; every wave fits with its entries."""
    if real_model() is None:
        pytest.skip("needs waveplan.pricing's real model")
    planner, step, budget, sp = _rope_case(n, seed)
    plan = planner.plan(step, free_bytes=budget, deterministic=True)
    assert 0 < plan.stats["rope_reserve_bytes"] < sp.earlier.earlier_reserve_bytes()
    assert plan.stats["searches"] == searches
    assert all(w.admitted_bytes <= budget for w in plan.waves)
    assert plan.lower_bound_waves <= plan.num_waves
