"""Packing quality of the search against its lower bound and the baseline packers.

Over SEEDS seeded GRPO-style steps per size (see bench_search.py for the generator and the
budget rule), reports per size: the fraction of plans proven optimal (waves == lower bound),
the mean waves above the bound, and for each baseline packer (uniform-width, ffd, kk) the mean
waves the search saves and the number of steps where the search used MORE waves than that
baseline (target: 0). The search runs with `deterministic=True` (iteration counts, not the
clock) and the default 5 ms budget, so the table is reproducible.

    .venv/bin/python bench/search_quality.py [--seeds 100] [--sizes 32 64 128 512 2048]

Prints a table and writes bench/results/search_quality.csv.

    .venv/bin/python bench/search_quality.py --calibrate

re-fits, on this machine, the cost models the deterministic mode uses instead of the clock
(`waveplan.search.budget`: microseconds per greedy run / multistart iteration, and
`waveplan.search.exact_cpsat`: wall seconds per model term and per deterministic second of
CP-SAT) and prints them next to the constants in the code.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from bench_search import FACTOR, bench_case  # noqa: E402

from waveplan.search import PackerKind, pack  # noqa: E402

BASELINES = (PackerKind.UNIFORM_WIDTH, PackerKind.FFD, PackerKind.KK)


def run(sizes, seeds, out: Path) -> list[dict]:
    rows = []
    for n in sizes:
        stats = {"optimal": 0, "above": 0, "waves": 0, "bound": 0}
        save = {b: 0 for b in BASELINES}
        worse = {b: 0 for b in BASELINES}
        pricer_name = ""
        for seed in range(seeds):
            step, make, budget = bench_case(n, seed)
            res = pack(step, make(), budget_bytes=budget, deterministic=True)
            pricer_name = type(make()).__name__
            w = len(res.waves)
            stats["optimal"] += int(res.proven_optimal)
            stats["above"] += w - res.lower_bound_waves
            stats["waves"] += w
            stats["bound"] += res.lower_bound_waves
            for b in BASELINES:
                bw = len(pack(step, make(), budget_bytes=budget, packer=b).waves)
                save[b] += bw - w
                worse[b] += int(w > bw)
        row = {"requests": n, "steps": seeds, "pricer": pricer_name, "budget_factor": FACTOR,
               "mean_waves": stats["waves"] / seeds, "mean_bound": stats["bound"] / seeds,
               "proven_optimal": stats["optimal"] / seeds,
               "mean_waves_above_bound": stats["above"] / seeds}
        for b in BASELINES:
            row[f"saved_vs_{b.value}"] = save[b] / seeds
            row[f"worse_than_{b.value}"] = worse[b]
        rows.append(row)
        print_row(row, header=len(rows) == 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


def print_row(row: dict, header: bool) -> None:
    if header:
        print(f"{'n':>5} {'waves':>7} {'bound':>7} {'optimal':>8} {'above':>6} "
              + " ".join(f"{'save/' + b.value:>18} {'worse':>5}" for b in BASELINES))
    print(f"{row['requests']:>5} {row['mean_waves']:>7.2f} {row['mean_bound']:>7.2f} "
          f"{row['proven_optimal']:>8.2f} {row['mean_waves_above_bound']:>6.2f} "
          + " ".join(f"{row['saved_vs_' + b.value]:>18.2f} {row['worse_than_' + b.value]:>5d}"
                     for b in BASELINES), flush=True)


def calibrate() -> None:
    """Fit the deterministic mode's cost models on generated steps (see the module doc)."""
    import time

    import numpy as np

    from waveplan.search import budget, exact_cpsat
    from waveplan.search.bounds import lower_bound
    from waveplan.search.contract import SearchPricer
    from waveplan.search.greedy import pack_greedy
    from waveplan.search.items import blocks_for, build_items
    from waveplan.search.multistart import run_multistart
    from waveplan.search.packers import _prepare

    runs, solves = [], []
    for n in (8, 16, 32, 64, 100, 128, 256, 512):
        for seed in range(3):
            for factor in (1.5, 4.0, 8.0):
                step, make, budget_bytes = bench_case(n, seed)
                pricer = SearchPricer.of(make())   # as the search's stages take it
                budget_bytes = int(budget_bytes * factor / FACTOR)
                items = build_items(step, pricer, budget_bytes)
                _, active = _prepare(items, step, pricer, budget_bytes)
                if len(active) < 2:
                    continue
                blocks = blocks_for(items, active)
                lo = lower_bound(items, active)
                assign, nw, _ = pack_greedy(items, blocks, lo)
                P = len(items.points)
                t = time.perf_counter()
                _, _, it = run_multistart(items, blocks, active, target=0, best_assign=assign,
                                          best_nw=nw, seed=0, deadline=None, max_iters=24)
                runs.append((len(active) * (nw + P), (time.perf_counter() - t) / it * 1e6))
                B = max(nw - 1, 1)
                if n > 100 or not exact_cpsat.fits_size_rule(len(active), B, P):
                    continue
                for det in (0.0005, 0.003, 0.02):
                    t = time.perf_counter()
                    used = exact_cpsat._solve(items, active, B, det, 0, False, None)[3]
                    solves.append((exact_cpsat.model_terms(len(active), B, P), used,
                                   time.perf_counter() - t))
    r = np.asarray(runs)
    slope, base = np.polyfit(r[:, 0], r[:, 1], 1)
    print(f"greedy run / multistart iteration: {base:.1f} + {slope:.4f} x atoms x (waves + "
          f"points) us (least squares, {len(r)} steps); code: {budget.RUN_US_BASE} + "
          f"{budget.RUN_US_PER_UNIT}")
    c = np.asarray(solves)
    x = np.c_[c[:, 0], c[:, 1], np.ones(len(c))]
    per_term, per_det, const = np.linalg.lstsq(x, c[:, 2], rcond=None)[0]
    print(f"CP-SAT wall: {per_term:.2e} s/term + {per_det:.2f} s/det + {const * 1e3:.1f} ms "
          f"(least squares, {len(c)} solves); code: {exact_cpsat.BUILD_S_PER_TERM:.0e} s/term,"
          f" {exact_cpsat.WALL_PER_DET} s/det, {exact_cpsat.SOLVE_OVERHEAD_S * 1e3:.0f} ms")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128, 512, 2048])
    ap.add_argument("--out", type=Path, default=HERE / "results" / "search_quality.csv")
    ap.add_argument("--calibrate", action="store_true",
                    help="re-fit the deterministic mode's cost models instead")
    args = ap.parse_args(argv)
    if args.calibrate:
        calibrate()
        return
    run(args.sizes, args.seeds, args.out)


if __name__ == "__main__":
    main()
