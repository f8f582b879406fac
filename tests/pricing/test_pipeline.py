"""Pipeline parallelism: stage split, window sums, the per-stage model and packing against it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from waveplan.planner.planner import Planner
from waveplan.pricing.pipeline import (
    StageParts,
    in_flight,
    schedule_points,
    stage_bounds,
    window_peak,
)
from waveplan.pricing.stage_price import price_stages
from waveplan.pricing.step import bundled_step, load_step
from waveplan.search.invariants import check_plan

GIB = 2**30


def test_stage_bounds_even_split_and_in_flight():
    assert stage_bounds(64, 4) == ((0, 16), (16, 32), (32, 48), (48, 64))
    assert stage_bounds(10, 3) == ((0, 3), (3, 6), (6, 10))
    assert [in_flight(4, s, 10) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight(4, 0, 2) == 2


def test_window_peak_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n, k = int(rng.integers(1, 8)), int(rng.integers(1, 5))
        kept = rng.random(n)
        peak = kept + rng.random(n)
        got, at = window_peak(kept, peak, k)
        kk = min(k, n)
        want = max(kept[i:i + kk].sum() + (peak[i:i + kk] - kept[i:i + kk]).max()
                   for i in range(n - kk + 1))
        assert got == pytest.approx(want)
        assert kept[at:at + kk].sum() + (peak[at:at + kk] - kept[at:at + kk]).max() == pytest.approx(got)


def test_pipeline_model_keeps_tp_credit_and_says_conservative():
    pp1 = Planner.from_preset("qwen3-32b", tp=4, sequence_parallel=True).model
    pp4 = Planner.from_preset("qwen3-32b", tp=4, pp=4, sequence_parallel=True).model
    assert pp1.basis == "evidence"
    assert pp4.basis == "conservative" and not pp4.conservative
    assert any("validated on CPU pipeline traces only" in g for g in pp4.gaps)
    stages = pp4.charges.stages
    assert [(s.lo, s.hi, s.window) for s in stages] == [(0, 16, 4), (16, 32, 3), (32, 48, 2),
                                                        (48, 64, 1)]
    # the stages' layers together are PP1's: under full recompute the received activation is
    # the stage's first layer's checkpointed input, already its boundary
    boundary = pp1.charges.walk.retained[1]
    total = sum(s.charges.retained.sum() for s in stages)
    assert total == pytest.approx(pp1.charges.walk.retained.sum())
    assert [s.charges.head_const > 0 for s in stages] == [False, False, False, True]
    # the schedule's gradients: received on every stage but the last, sent on every but the first
    assert [s.grad_in_per_row / boundary for s in stages] == [1, 1, 1, 0]
    assert [s.held_per_row / boundary for s in stages] == [1, 2, 2, 1]
    assert [s.held_backward_per_row / boundary for s in stages] == [0, 1, 1, 1]
    selective = Planner.from_preset("qwen3-32b", tp=4, pp=4, sequence_parallel=True,
                                    recompute="selective").model
    got = [s.charges.retained[0] - selective.charges.layers.retained[s.lo]
           for s in selective.charges.stages]
    assert got == pytest.approx([0.0] + [boundary] * 3)


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_plan_fits_every_window(pp):
    planner = Planner.from_preset("qwen3-32b", tp=4, pp=pp, sequence_parallel=True)
    step = load_step(bundled_step("grpo-8x8"))
    budget = 20 * GIB
    plan = planner.plan(step, free_bytes=budget, deterministic=True)
    pricer = planner.pricer(step)
    check_plan(step, pricer, plan, budget_bytes=budget)
    peaks = price_stages(planner.model, [(w.loads, w.first_slots) for w in plan.waves],
                         [budget] * pp, max_len=pricer.stages().longest_sequence(step))
    assert [p.to_dict() for p in peaks] == plan.stages
    assert len(plan.stages) == pp and all(p.fits for p in peaks)
    assert plan.to_dict()["stages"] == plan.stages
    assert 1 <= plan.lower_bound_waves <= plan.num_waves
    # the bound holds at the tightest budgets this plan fits: each stage's own peak
    tight = [p.peak_bytes for p in peaks]
    assert pricer.stages().window_bound(tight) <= plan.num_waves


def test_window_is_an_upper_bound_of_every_1f1b_point():
    """Brute force over every in-flight set a 1F1B stage can hold (consecutive waves, at most
    k, one of them active): the window sum bounds each."""
    rng = np.random.default_rng(1)
    kept = rng.random(7)
    peak = kept + rng.random(7)
    for k in (1, 2, 3, 4):
        bound, _ = window_peak(kept, peak, k)
        for i, m in itertools.product(range(7), range(1, k + 1)):
            live = range(i, min(i + m, 7))
            for a in live:
                point = sum(kept[j] for j in live if j != a) + peak[a]
                assert point <= bound + 1e-12


def _one_f_one_b(n: int, k: int) -> list[tuple[str, int]]:
    """The operations of a 1F1B stage that holds up to k waves in flight, in order."""
    warm = min(k - 1, n)
    ops = [("F", j) for j in range(warm)]
    f, b = warm, 0
    while f < n:
        ops += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    return ops + [("B", i) for i in range(b, n)]


def test_schedule_points_are_the_worst_1f1b_operation():
    """A simulation of the 1F1B schedule: at each operation the in-flight waves but the active
    one keep their retained part, the active one is at its forward or backward peak, the
    gradients of the last backward are still held, the adapter gradients of every carrier
    whose backward ran are live (and accumulate after it), and every other wave whose forward
    ran keeps its RoPE cache entry. The stage's price is the worst operation's, with
    the waves in flight then; it is never above the window bound without held gradients."""
    rng = np.random.default_rng(2)
    for trial in range(200):
        n, k = int(rng.integers(1, 8)), int(rng.integers(1, 5))
        kept, held, left = rng.random(n), rng.random(n) * 0.5, np.zeros(n)
        peak = kept + rng.random(n) * 3
        fwd = kept + (peak - kept) * rng.random(n)
        left[0] = rng.random()  # the carrier runs first
        rope = rng.random(n) * 0.2
        worst, ran, done, last, at = -1.0, [], [], None, None
        for op, w in _one_f_one_b(n, k):
            if op == "F":
                ran.append(w)
            live = [j for j in ran if j not in done]
            assert len(live) <= k
            point = sum(kept[j] for j in live if j != w) + (peak[w] if op == "B" else fwd[w])
            point += (held[last] * (0.5 if op == "B" else 1.0) if last is not None else 0.0)
            point += sum(left[j] for j in done) + (0.1 * left[0] if op == "B" and done else 0.0)
            point += sum(rope[j] for j in ran if j != w)
            if point > worst + 1e-12:
                worst, at = point, (min(live), max(live))
            if op == "B":
                done.append(w)
                last = w
        parts = StageParts(*(a[None, :] for a in (kept, peak, fwd, held, held * 0.5, left,
                                                   0.1 * left, rope)))
        points = schedule_points(parts, 0, min(k, n))
        best = max(points, key=lambda p: p[0])
        assert best[0] == pytest.approx(worst), trial
        assert (best[1], best[2]) == at or best[0] == pytest.approx(worst)
        no_held = StageParts(*(a[None, :] for a in (kept, peak, peak, 0 * held, 0 * held,
                                                    0 * left, 0 * left, 0 * rope)))
        plain = max(p[0] for p in schedule_points(no_held, 0, min(k, n)))
        assert plain <= window_peak(kept, peak, k)[0] + 1e-12


def test_pp1_plan_has_no_stages():
    planner = Planner.from_preset("qwen3-32b", tp=4, sequence_parallel=True)
    plan = planner.plan(load_step(bundled_step("grpo-8x8")), free_bytes=20 * GIB,
                        deterministic=True)
    assert plan.stages == [] and "stages" not in plan.to_dict()


def test_stage_budgets_check_each_stage_against_its_own():
    planner = Planner.from_preset("qwen3-32b", tp=4, pp=4, sequence_parallel=True)
    step = load_step(bundled_step("grpo-8x8"))
    budgets = [18 * GIB, 20 * GIB, 22 * GIB, 24 * GIB]
    plan = planner.plan(step, 30 * GIB, deterministic=True, stage_free_bytes=budgets)
    assert [s["budget_bytes"] for s in plan.stages] == budgets
    assert all(s["peak_bytes"] <= s["budget_bytes"] for s in plan.stages)
    assert plan.budget_bytes == 18 * GIB   # each wave: the smallest budget
    # a stage given one budget per rank takes the smallest
    same = planner.plan(step, 30 * GIB, deterministic=True,
                        stage_free_bytes=[[18 * GIB, 19 * GIB], 20 * GIB, 22 * GIB, 24 * GIB])
    assert same.stages == plan.stages
    with pytest.raises(Exception, match="stage_free_bytes"):
        planner.plan(step, 30 * GIB, stage_free_bytes=budgets[:3])
    pp1 = Planner.from_preset("qwen3-32b", tp=4, sequence_parallel=True)
    with pytest.raises(Exception, match="stage_free_bytes"):
        pp1.plan(step, 30 * GIB, stage_free_bytes=[20 * GIB])


def test_interleaved_schedule_fails_closed_with_its_reason(capsys):
    from waveplan.planner.cli import main
    from waveplan.pricing.errors import ConfigError
    from waveplan.pricing.pipeline import check_schedule

    check_schedule(1, 4)
    with pytest.raises(ConfigError, match=r"virtual_stages=2: the interleaved pipeline schedule "
                                          r"is not priced.* = 11 micro-batches"):
        check_schedule(2, 4)
    assert main(["plan", "grpo-8x8", "--model", "qwen3-32b", "--tp", "4", "--sp", "--pp", "4",
                 "--virtual-stages", "2", "--free", "40"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "virtual_stages=2" in err[0] and "interleaved" in err[0], err
