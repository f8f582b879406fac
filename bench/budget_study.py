"""What the time budget buys: default (clock) plans against deterministic and long plans.

Long-tailed GRPO steps (`waveplan.planner.study.grpo_step`, the generator of `waveplan study
--generate grpo`) on qwen3-8b TP1 (one LoRA slot, 40 GiB free), 32-384 requests; and the
search benchmark's generated steps (`bench_search.bench_case`: qwen3-8b, three slots, a budget
of 4x the largest single-request price) at 512 and 2048 requests. For each step, planned by
`Planner.plan` in one warm process: the default plan (clock mode, default budget), the
deterministic plan at the same budget, and the 200 ms clock plan; waves, bound, planning_ms.

    .venv/bin/python bench/budget_study.py [--seeds 5] [--out bench/results/budget_study.txt]
    .venv/bin/python bench/budget_study.py --scan [--out bench/results/budget_scan.txt]

`--scan`: the deterministic plans of the large cases at 5-400 ms (waves never rise with the
budget there, `docs/faq.md#time-budget`). `--first`: the first and second default plans of a
fresh process (no warm-up call: the first plan loads its kernels), per case, in a child
process each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from bench_search import bench_case  # noqa: E402
from search_fakes import real_model  # noqa: E402

from waveplan.planner.planner import Planner  # noqa: E402
from waveplan.planner.study import grpo_step  # noqa: E402
from waveplan.pricing.atomic_io import write_text_atomic  # noqa: E402

GIB = 2**30
HEADER = ("waves (lower bound, proven) and planning_ms of Planner.plan: the default plan (clock mode, "
          "default budget; the\nlargest of --repeats plans, their median ms), the deterministic "
          "plan at the same budget, and the clock\nplan at --long-ms; one warm process. Timings "
          "depend on the machine's load (see budget_overhead.txt).")
SMALL = ((4, 8), (8, 8), (16, 8), (32, 8), (48, 8))   # prompts x completions: 32-384 requests
LARGE = (512, 2048)


def _cases(seeds: int):
    qwen = Planner.from_preset("qwen3-8b")
    for prompts, completions in SMALL:
        for seed in range(seeds):
            step = grpo_step(prompts=prompts, completions=completions, seed=seed)
            yield f"grpo-{prompts}x{completions}-s{seed}", qwen, step, 40 * GIB
    big = Planner.from_model(real_model())
    for n in LARGE:
        for seed in range(seeds):
            step, _make, budget = bench_case(n, seed)
            yield f"bench-{n}-s{seed}", big, step, budget


def _row(planner, step, budget, **kw):
    plan = planner.plan(step, free_bytes=budget, **kw)
    return plan.num_waves, plan.lower_bound_waves, plan.proven_optimal, plan.planning_ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="clock plans: repeats (median ms)")
    ap.add_argument("--long-ms", type=float, default=200.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--scan", action="store_true", help="deterministic waves at 5-400 ms")
    ap.add_argument("--first", action="store_true",
                    help="first vs second default plan of a fresh process")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)   # --first's child
    args = ap.parse_args(argv)
    if args.case:
        return _first_child(args.case)
    if args.first:
        return _first(args)
    Planner.warmup()
    if args.scan:
        return _scan(args)
    lines = [HEADER, f"{'case':<18} {'n':>5} | {'default':>16} {'ms':>7} | {'deterministic':>16} "
             f"{'ms':>7} | {f'{args.long_ms:g} ms':>16} {'ms':>7}"]
    worse = far = 0
    for name, planner, step, budget in _cases(args.seeds):
        n = len(step.requests)
        runs = [_row(planner, step, budget) for _ in range(args.repeats)]
        d = _row(planner, step, budget, deterministic=True)
        long_ = _row(planner, step, budget, time_budget_ms=args.long_ms)
        dw = max(r[0] for r in runs)
        worse += dw > d[0]
        far += dw > long_[0] + 1

        def cell(w, lb, pr):
            return f"{w:>4} (lb {lb:>3}{', proven' if pr else ''})"
        lines.append(
            f"{name:<18} {n:>5} | {cell(*runs[0][:3]):>16} "
            f"{statistics.median(r[3] for r in runs):>7.2f} | {cell(*d[:3]):>16} {d[3]:>7.2f} | "
            f"{cell(*long_[:3]):>16} {long_[3]:>7.2f}"
            + ("" if all(r[0] == runs[0][0] for r in runs) else
               f"  (default repeats: {[r[0] for r in runs]})"))
        print(lines[-1], flush=True)
    lines.append(f"default plans worse than deterministic: {worse}; more than one wave over "
                 f"the {args.long_ms:g} ms plan: {far}")
    print(lines[-1])
    if args.out:
        write_text_atomic(Path(args.out), "\n".join(lines) + "\n")
    return 0


SCAN_MS = (5, 10, 20, 50, 100, 200, 400)
FIRST_CASES = ("grpo-32x8-s3", "grpo-48x8-s0", "bench-512-s0", "bench-2048-s0")


def _first_child(case: str) -> int:
    """Two default plans of `case` in this fresh process: waves, planning_ms, jit_ms."""
    for name, planner, step, budget in _cases(5):
        if name == case:
            out = []
            for _ in range(2):
                plan = planner.plan(step, free_bytes=budget)
                out.append(f"{plan.num_waves} waves {plan.planning_ms:.1f} ms "
                           f"(jit {plan.stats['jit_ms']:.0f} ms)")
            print(f"{case:<18} first: {out[0]:<32} second: {out[1]}")
            return 0
    raise SystemExit(f"no case {case}")


def _first(args) -> int:
    import subprocess

    lines = ["first and second default plan of a fresh process (kernels loaded by the first)"]
    for case in FIRST_CASES:
        got = subprocess.run([sys.executable, __file__, "--case", case], check=True,
                             capture_output=True, text=True).stdout.strip()
        lines.append(got)
        print(got, flush=True)
    if args.out:
        write_text_atomic(Path(args.out), "\n".join(lines) + "\n")
    return 0


def _scan(args) -> int:
    lines = [f"{'case':<18} " + " ".join(f"{f'{ms} ms':>8}" for ms in SCAN_MS)
             + "   (deterministic waves / planning_ms)"]
    rising = 0
    for name, planner, step, budget in _cases(args.seeds):
        if len(step.requests) < LARGE[0]:
            continue
        plans = [planner.plan(step, free_bytes=budget, deterministic=True, time_budget_ms=ms)
                 for ms in SCAN_MS]
        waves = [p.num_waves for p in plans]
        rising += any(b > a for a, b in zip(waves, waves[1:], strict=False))
        lines.append(f"{name:<18} " + " ".join(f"{w:>8}" for w in waves) + "   "
                     + " ".join(f"{p.planning_ms:.0f}" for p in plans))
        print(lines[-1], flush=True)
    lines.append(f"cases where a larger deterministic budget gave more waves: {rising}")
    print(lines[-1])
    if args.out:
        write_text_atomic(Path(args.out), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
