"""End-to-end planning speed: `Planner.plan` on the bundled grpo-8x8 step (64 requests,
8 prompts x 8 completions) on qwen3.8-27b, TP4 with SP, full recompute, 40 GiB free per rank.
Warm (after JIT). Target: median <= 2 ms (the existing planner takes ~190 ms).

Run: .venv/bin/pytest bench/bench_planner.py --benchmark-only
"""

import pytest

from waveplan.planner import Planner, load_step
from waveplan.pricing.step import bundled_step

GIB = 2**30


@pytest.fixture(scope="module")
def setup():
    planner = Planner.from_preset("qwen3.8-27b", tp=4, sequence_parallel=True, recompute="full")
    step = load_step(bundled_step("grpo-8x8"))
    planner.plan(step, free_bytes=40 * GIB)  # JIT outside the timing
    return planner, step


def test_plan_grpo_8x8(benchmark, setup):
    planner, step = setup
    plan = benchmark(planner.plan, step, free_bytes=40 * GIB)
    assert plan.proven_optimal


def test_plan_grpo_8x8_with_profiles(benchmark, setup):
    """Same, with a learned profile for every wave (the adjust hook on every price)."""
    planner, step = setup
    planner = Planner.from_model(planner.model)
    for wave in planner.plan(step, free_bytes=40 * GIB).waves:
        planner.observe(wave, peak_bytes=0.93 * wave.static_raw_bytes)
    plan = benchmark(planner.plan, step, free_bytes=40 * GIB)
    assert all(w.breakdown.basis == "profile" for w in plan.waves)
