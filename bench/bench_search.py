"""Speed of the whole search (`waveplan.search.pack`: envelope, items, bounds, greedy, and the
exact re-pricing of every wave, pending gradients and order included) on generated GRPO-style
steps (prompts of 200-2000 tokens, 8 completions of 50-4000 each, slots a/b, ~15% no-grad
prompts). The pricer is the real `WavePricer` (qwen3-8b, TP1) when `waveplan.pricing`
provides it, else the test double; the budget is 4x the largest single-request price (with
its pending gradients), a few groups per wave. JIT compiled before timing.

Targets (median): 32 -> 0.5 ms, 64 -> 1 ms, 128 -> 2 ms, 512 -> 10 ms, 2048 -> 50 ms.

Run: .venv/bin/pytest bench/bench_search.py --benchmark-only
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from search_fakes import FakePricer, grpo_step, real_model, real_pricer  # noqa: E402

from waveplan.search import pack  # noqa: E402

SIZES = (32, 64, 128, 512, 2048)
FACTOR = 4.0


def bench_case(n: int, seed: int = 0):
    """(step, pricer factory, budget) for one generated step."""
    fake = grpo_step(seed, n)
    if real_model() is not None:
        step, pricer = real_pricer(fake)

        def make():
            from waveplan.pricing.wave_pricer import WavePricer
            return WavePricer.build(step, real_model())
    else:
        step, pricer = fake, FakePricer(fake)

        def make():
            return FakePricer(step)
    worst = max(pricer.price([np.asarray([i])], first_slots=frozenset({r.slot} if r.grad
                                                                      else ())).admitted_bytes
                for i, r in enumerate(step.requests))
    return step, make, int(worst * FACTOR)


@pytest.mark.parametrize("n", SIZES)
def test_search_speed(benchmark, n):
    step, make, budget = bench_case(n)
    pack(step, make(), budget_bytes=budget)   # JIT and caches outside the timing
    result = benchmark(lambda: pack(step, make(), budget_bytes=budget))
    benchmark.extra_info.update(waves=len(result.waves), bound=result.lower_bound_waves,
                                pricer=type(make()).__name__)
    assert result.lower_bound_waves <= len(result.waves)
