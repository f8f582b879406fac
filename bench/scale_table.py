"""Waves of the search at scale: per generated step (`bench_search.bench_case(n, seed)`), the
wave count at the default 5 ms and at 200 ms (both deterministic), the bound the search
reports, and the slot balance of the 5 ms plan (per wave, the smaller gradient slot's rows
over the larger's, averaged over the waves holding gradient rows of some slot).

    .venv/bin/python bench/scale_table.py [--sizes 512 2048] [--seeds 5] [--budgets 5 200]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from bench_search import bench_case  # noqa: E402

from waveplan.search import pack  # noqa: E402


def slot_balance(step, pricer, waves) -> float:
    """Mean over waves of min/max gradient rows per slot (slots of the pricer's classes)."""
    slots = sorted({s for s, g in zip(pricer.class_slot, pricer.class_grad, strict=True) if g})
    if len(slots) < 2:
        return 1.0
    code = np.asarray([slots.index(pricer.class_slot[k]) if pricer.class_grad[k] else -1
                       for k in range(pricer.num_classes)])[np.asarray(pricer.class_of)]
    rows = np.asarray([r.num_tokens for r in step.requests], dtype=np.float64)
    vals = []
    for w in waves:
        reqs = np.concatenate(w.children)
        per = np.asarray([rows[reqs][code[reqs] == s].sum() for s in range(len(slots))])
        if per.max() > 0:
            vals.append(per.min() / per.max())
    return float(np.mean(vals)) if vals else 1.0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[512])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--budgets", type=float, nargs="+", default=[5.0, 200.0])
    a = ap.parse_args(argv)
    print("n,seed," + ",".join(f"waves_{b:g}ms" for b in a.budgets) + ",bound,slot_balance")
    for n in a.sizes:
        sums = np.zeros(len(a.budgets))
        for seed in range(a.seeds):
            step, make, budget = bench_case(n, seed)
            waves, bal, bound = [], 0.0, 0
            for i, ms in enumerate(a.budgets):
                pricer = make()
                res = pack(step, pricer, budget_bytes=budget, time_budget_ms=ms,
                           deterministic=True)
                waves.append(len(res.waves))
                if i == 0:
                    bal = slot_balance(step, pricer, res.waves)
                bound = max(bound, res.lower_bound_waves)
            sums += waves
            print(f"{n},{seed}," + ",".join(map(str, waves)) + f",{bound},{bal:.3f}",
                  flush=True)
        print(f"{n},mean," + ",".join(f"{s / a.seeds:.1f}" for s in sums) + ",,", flush=True)


if __name__ == "__main__":
    main()
