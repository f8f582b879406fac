"""Pipeline plans: waves, lower bound, stage peaks and planning time of Qwen3-32B (its preset)
on the bundled GRPO 32x16 step (512 requests) at 40 GiB, TP4 + SP, PP1 / PP2 / PP4.

    python bench/pipeline_plans.py          # prints the table, writes results/pipeline_plans.txt

Each plan runs once to warm (kernels compiled or loaded), then `REPEATS` times; the planning
time is the median of those (the plan's own `planning_ms`: search and pricing, not the JIT).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from waveplan.pricing.atomic_io import write_text_atomic

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "pipeline_plans.txt"
GIB = 2**30
REPEATS = 5
LAYOUTS = (1, 2, 4)


def rows() -> list[str]:
    from waveplan.planner import Planner
    from waveplan.pricing.step import bundled_step, load_step

    step = load_step(bundled_step("grpo-32x16"))
    lines = [f"# qwen3-32b, grpo-32x16 ({len(step.requests)} requests), 40 GiB, TP4 SP, "
             f"full recompute, auto packer, deterministic; planning: median of {REPEATS} warm runs",
             f"{'layout':<8} {'waves':>5} {'bound':>5} {'proven':>6} {'plan ms':>8}  "
             f"stage peaks GiB (binding waves)"]
    for pp in LAYOUTS:
        planner = Planner.from_preset("qwen3-32b", tp=4, pp=pp, sequence_parallel=True)
        plan = planner.plan(step, 40 * GIB, deterministic=True)
        times = []
        for _ in range(REPEATS):
            plan = planner.plan(step, 40 * GIB, deterministic=True)
            times.append(plan.planning_ms)
        stages = " / ".join(f"{s['peak_bytes'] / GIB:.2f} {s['window']}" for s in plan.stages) or "-"
        lines.append(f"PP{pp:<6} {plan.num_waves:>5} {plan.lower_bound_waves:>5} "
                     f"{str(plan.proven_optimal):>6} {statistics.median(times):>8.1f}  {stages}")
    return lines


def main() -> int:
    text = "\n".join(rows()) + "\n"
    write_text_atomic(OUT, text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
