"""Planning time against the time budget (`Planner.plan`, clock mode, the default budget rule)
on the search benchmark's generated steps (`bench_search.bench_case`: qwen3-8b, three LoRA
slots) at 32/128/512/2048 requests: the plan's wall time, its `planning_ms`, the budget it
got (`search.default_time_budget_ms`) and the planner's overhead beside the search
(`planning_ms` less `stats["searches_ms"]`, the wall time of the RoPE reserve's probe, of every
search and of the clock's improvement). The stated rule: planning_ms <= budget + 1 ms + 0.025 ms
x requests (docs/faq.md#overhead); results in bench/results/budget_overhead.txt. Kernels are loaded before timing. No assertion on
time.

Run: .venv/bin/pytest bench/bench_budget.py --benchmark-only
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_search import bench_case  # noqa: E402
from search_fakes import real_model  # noqa: E402

from waveplan.planner.planner import Planner  # noqa: E402
from waveplan.search import default_time_budget_ms  # noqa: E402

SIZES = (32, 128, 512, 2048)


@pytest.mark.parametrize("deterministic", [False, True], ids=["clock", "deterministic"])
@pytest.mark.parametrize("n", SIZES)
def test_plan_time_against_budget(benchmark, n, deterministic):
    if real_model() is None:
        pytest.skip("needs waveplan.pricing's real model")
    Planner.warmup()
    planner = Planner.from_model(real_model())
    step, _make, budget = bench_case(n)
    planner.plan(step, free_bytes=budget, deterministic=deterministic)   # caches outside timing
    plans = []

    def run():
        plans.append(planner.plan(step, free_bytes=budget, deterministic=deterministic))

    benchmark.pedantic(run, rounds=5, iterations=1)
    ms = sorted(p.planning_ms for p in plans)
    search = sorted(p.stats["searches_ms"] for p in plans)
    beside = sorted(p.planning_ms - p.stats["searches_ms"] for p in plans)
    benchmark.extra_info.update(
        budget_ms=default_time_budget_ms(n), median_planning_ms=ms[len(ms) // 2],
        median_search_ms=search[len(search) // 2], median_beside_ms=beside[len(beside) // 2],
        searches=plans[-1].stats["searches"],
        waves=sorted(p.num_waves for p in plans), bound=plans[-1].lower_bound_waves,
        rope_reserve_bytes=plans[-1].stats.get("rope_reserve_bytes", 0))
    assert all(p.lower_bound_waves <= p.num_waves for p in plans)
