"""Validation study: trace a grid of waves on "cpu-fake", fit the torch-cpu table, report.

    python bench/validation_study.py trace    # append missing cells to traces_cpu_fake.jsonl
    python bench/validation_study.py report   # fit on even cells, validate on odd cells

`trace` is cached: a cell whose key is already in the JSONL file is skipped, so the command
can be re-run after an interruption. `report` never traces.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

RESULTS = Path(__file__).resolve().parent / "results"
TRACES = RESULTS / "traces_cpu_fake.jsonl"

RANKS = (8, 16, 32, 64)
RECOMPUTES = ("full", "selective", "none")
# (seq_lens) — 1..16 sequences, 1k..16k tokens in total
DENSE_WAVES = (
    [1024], [4096], [2048, 2048], [1024] * 4, [512] * 8, [1024] * 16,
    [8192, 8192], [16384], [3000, 1000, 500, 4000],
)
MOE_WAVES = ([1024], [2048], [512] * 4, [1024] * 4, [256] * 16)
HYBRID_WAVES = ([1024], [512, 512, 1024])


def cells() -> list[dict]:
    """The grid, in a fixed order (the fit/validation split uses the index)."""
    out: list[dict] = []
    i = 0
    for model in ("qwen3-8b", "llama-3.1-8b"):
        for rc in RECOMPUTES:
            for w, lens in enumerate(DENSE_WAVES):
                if (w + len(rc)) % 9 == 8:  # drop one wave per combination: 8 per combo
                    continue
                out.append({"model": model, "num_layers": 2 + i % 3, "recompute": rc,
                            "lora_rank": RANKS[i % 4], "seq_lens": list(lens)})
                i += 1
    for rc in RECOMPUTES:
        for lens in MOE_WAVES:
            out.append({"model": "qwen3-30b-a3b", "num_layers": 2, "recompute": rc,
                        "lora_rank": RANKS[i % 4], "seq_lens": list(lens)})
            i += 1
    for rc in RECOMPUTES:
        for lens in HYBRID_WAVES:
            out.append({"model": "qwen3.8-27b", "num_layers": 4, "recompute": rc,
                        "lora_rank": RANKS[i % 4], "seq_lens": list(lens)})
            i += 1
    return out


def cell_key(cell: dict) -> str:
    return json.dumps([cell["model"], cell["num_layers"], cell["recompute"], cell["lora_rank"],
                       list(cell["seq_lens"])])


def load_traces(path: Path = TRACES) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


def cmd_trace(args) -> int:
    from waveplan.pricing.parallel import Recompute
    from waveplan.pricing.presets import load_preset
    from waveplan.pricing.trace import trace_wave

    done = {cell_key(r["cell"]) for r in load_traces(args.traces)}
    grid = cells()
    todo = [c for c in grid if cell_key(c) not in done]
    print(f"{len(grid)} cells, {len(grid) - len(todo)} cached, {len(todo)} to trace", flush=True)
    args.traces.parent.mkdir(parents=True, exist_ok=True)
    for n, cell in enumerate(todo, 1):
        t0 = time.perf_counter()
        res = trace_wave(load_preset(cell["model"]), seq_lens=cell["seq_lens"],
                         num_layers=cell["num_layers"], device="cpu-fake",
                         recompute=Recompute(mode=cell["recompute"]),
                         lora_rank=cell["lora_rank"], head="full-native")
        dt = time.perf_counter() - t0
        rec = {"cell": cell, "trace": res.to_dict(), "seconds": round(dt, 2)}
        with args.traces.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec, sort_keys=True) + "\n")
        print(f"[{n}/{len(todo)}] {cell_key(cell)} peak={res.peak_bytes} {dt:.1f}s", flush=True)
    return 0


def cmd_report(args) -> int:
    from waveplan.pricing import calibrate

    records = load_traces(args.traces)
    if not records:
        print(f"no traces in {args.traces}", file=sys.stderr)
        return 2
    order = {cell_key(c): i for i, c in enumerate(cells())}
    records.sort(key=lambda r: order.get(cell_key(r["cell"]), len(order)))
    fit_set = records[0::2]
    val_set = records[1::2]
    base = calibrate.load_base("te-gpu")
    table = calibrate.fit_table(fit_set, base, source_label=f"{args.traces.name} (even cells)")
    rows = []
    for split, recs in (("fit", fit_set), ("validate", val_set)):
        for rec in recs:
            est = calibrate.estimate(table, rec)
            tr = rec["trace"]
            c = rec["cell"]
            rows.append({
                "split": split, "model": c["model"], "num_layers": c["num_layers"],
                "recompute": c["recompute"], "lora_rank": c["lora_rank"],
                "num_seqs": len(c["seq_lens"]), "tokens": sum(c["seq_lens"]),
                "measured_peak": tr["peak_bytes"], "estimate_peak": est["peak"],
                "over_peak": est["peak"] / tr["peak_bytes"] - 1,
                "measured_decoder": tr["decoder_peak_bytes"], "estimate_decoder": est["decoder"],
                "over_decoder": est["decoder"] / tr["decoder_peak_bytes"] - 1,
            })
    RESULTS.mkdir(parents=True, exist_ok=True)
    import csv

    with (RESULTS / "validation_cells.csv").open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()})
    lines = [f"validation study: {len(records)} traced cells ({args.traces.name}); fit on "
             f"{len(fit_set)} even-index cells, validated on {len(val_set)} odd-index cells",
             "fitted scales: " + json.dumps(table_scales(table)),
             "decoder-only estimate: the same wave priced with the head's per-row terms "
             "(head_*) set to zero; compared with the trace's decoder-only pass", ""]
    summary = {}
    for split in ("fit", "validate"):
        sub = [r for r in rows if r["split"] == split]
        for what in ("peak", "decoder"):
            over = sorted(r[f"over_{what}"] for r in sub)
            below = sum(1 for o in over if o < 0)
            med = over[len(over) // 2] if len(over) % 2 else (over[len(over) // 2 - 1] + over[len(over) // 2]) / 2
            stats = {"cells": len(sub), "below_trace": below, "median_over": med,
                     "worst_over": max(over), "min_over": min(over)}
            summary[f"{split}_{what}"] = stats
            lines.append(f"{split:9s} {what:8s} cells={len(sub):3d} below={below:2d} "
                         f"median_over={med * 100:6.2f}% worst_over={max(over) * 100:6.2f}% "
                         f"min_over={min(over) * 100:6.2f}%")
        for model in sorted({r["model"] for r in sub}):
            m = sorted(r["over_peak"] for r in sub if r["model"] == model)
            lines.append(f"    {model:14s} n={len(m):2d} peak over: median={m[len(m) // 2] * 100:6.2f}% "
                         f"worst={m[-1] * 100:6.2f}% min={m[0] * 100:6.2f}%")
    text = "\n".join(lines) + "\n"
    (RESULTS / "validation_summary.txt").write_text(text, encoding="utf-8")
    (RESULTS / "validation_summary.json").write_text(json.dumps(summary, indent=2) + "\n",
                                                     encoding="utf-8")
    print(text)
    _plot(rows, RESULTS / "validation_scatter.png")
    return 0


def table_scales(table) -> dict:
    return dict(getattr(table, "_fit_scales", {}) or {})


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, what in zip(axes, ("peak", "decoder"), strict=True):
        for split, marker in (("fit", "o"), ("validate", "x")):
            sub = [r for r in rows if r["split"] == split]
            ax.scatter([r[f"measured_{what}"] / 2**30 for r in sub],
                       [r[f"estimate_{what}"] / 2**30 for r in sub], marker=marker, label=split, s=18)
        hi = max(max(r[f"measured_{what}"], r[f"estimate_{what}"]) for r in rows) / 2**30
        ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="estimate = measured")
        ax.set_xlabel("traced peak (GiB, cpu-fake)")
        ax.set_ylabel("estimate (GiB, torch-cpu table)")
        ax.set_title("whole peak" if what == "peak" else "decoder-only peak")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("trace", "report", "list"))
    p.add_argument("--traces", type=Path, default=TRACES)
    args = p.parse_args(argv)
    if args.command == "list":
        for i, c in enumerate(cells()):
            print(i, cell_key(c))
        return 0
    return cmd_trace(args) if args.command == "trace" else cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
