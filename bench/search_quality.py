"""Packing quality of the search against its lower bound and the baseline packers.

Over SEEDS seeded GRPO-style steps per size (see bench_search.py for the generator and the
budget rule), reports per size: the fraction of plans proven optimal (waves == lower bound),
the mean waves above the bound, and for each baseline packer (uniform-width, ffd, kk) the mean
waves the search saves and the number of steps where the search used MORE waves than that
baseline (target: 0). The search runs with `deterministic=True` (iteration counts, not the
clock) and the default 5 ms budget, so the table is reproducible.

    .venv/bin/python bench/search_quality.py [--seeds 100] [--sizes 32 64 128 512 2048]

Prints a table and writes bench/results/search_quality.csv.
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128, 512, 2048])
    ap.add_argument("--out", type=Path, default=HERE / "results" / "search_quality.csv")
    args = ap.parse_args(argv)
    run(args.sizes, args.seeds, args.out)


if __name__ == "__main__":
    main()
