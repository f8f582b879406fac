"""What a retained GDN hybrid layer holds under TP (selective and no recompute): the anatomy of the
GDN grid's cells (bench/gdn_grid.py's shape, wave A, 2048 tokens) on the busiest rank, every live
storage at the whole step's forward and backward peaks, summed per layer
(docs/memory-model.md#gdn-sp-retained).

    python bench/gdn_retained_anatomy.py [--only TP1 TP2 ...] [--recompute none selective] [--json F]
    python bench/gdn_retained_anatomy.py --heldout --only TP4 --recompute none full
                     # the held-out shape (bench/gdn_grid.py HELDOUT), its 1540-token wave
                     # (bench/results/gdn_heldout_anatomy.txt)
    python bench/gdn_retained_anatomy.py --only TP1 TP2 TP2+SP TP4+SP --recompute full --moe \
        --out bench/results/gdn_full_anatomy.txt
                     # full recompute, and the GDN+MoE hybrid (bench/gdn_grid.py GDN_MOE) at
                     # TP1, TP2+SP and TP4+SP (docs/memory-model.md#gdn-full-point)
    python bench/gdn_retained_anatomy.py --only --moe --moe-layouts TP1 --recompute none selective \
        --out bench/results/gdn_moe_retained_anatomy.txt
                     # the GDN+MoE hybrid alone at TP1, retaining its activations
                     # (docs/memory-model.md#gdn-sp-retained)
    python bench/gdn_retained_anatomy.py --only --moe --moe-layouts TP2+SP TP4+SP --recompute none selective \
        --out bench/results/gdn_moe_sp_retained_anatomy.txt
                     # ... and under TP+SP (docs/memory-model.md#gdn-moe-sp-retained)

Writes bench/results/gdn_retained_anatomy.txt: per cell and peak, the bytes per gathered row of
each decoder layer (L0 = GDN + dense MLP, L1 = gated attention + dense MLP) and of the rest, then
every group of storages (made in, module, op, shape, dtype), largest first. One multi-rank cell
takes minutes on two cores; the rank processes trace both recompute modes of a layout at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gdn_grid  # noqa: E402
import multirank_grid as grid  # noqa: E402

from waveplan.pricing.atomic_io import write_text_atomic  # noqa: E402

OUT = grid.RESULTS / "gdn_retained_anatomy.txt"
HELDOUT_OUT = grid.RESULTS / "gdn_heldout_anatomy.txt"
LAYOUTS = {"TP1": {}, "TP2": {"tp": 2}, "TP2+SP": {"tp": 2, "sequence_parallel": True},
           "TP4": {"tp": 4}, "TP4+SP": {"tp": 4, "sequence_parallel": True}}


# the layouts the GDN+MoE hybrid is traced at (bench/gdn_grid.py LAYOUTS)
MOE_LAYOUTS = ("TP1", "TP2+SP", "TP4+SP")


def _layer(module: str) -> str:
    """'L0.self_attention.in_proj' -> 'L0'; anything outside a decoder layer -> 'other'."""
    head = module.split(".", 1)[0]
    return head if head[:1] == "L" and head[1:].isdigit() else "other"


def trace(label: str, recomputes, wave: int = 0, model: dict | None = None, waves=None) -> list[dict]:
    from waveplan.pricing.geometry import ModelGeometry
    from waveplan.pricing.measure.multirank import TraceJob, trace_multirank_batch
    from waveplan.pricing.parallel import Recompute

    model = model or gdn_grid.GDN
    g = ModelGeometry.from_dict(model)
    lens = tuple((waves or grid.WAVES)[wave])
    jobs = [TraceJob(seq_lens=lens, recompute=Recompute(mode=rc), lora_rank=grid.LORA_RANK)
            for rc in recomputes]
    t0 = time.monotonic()
    traces = trace_multirank_batch(g, layout=grid.layout_of(LAYOUTS[label]), jobs=jobs, num_layers=2,
                                   anatomy=True, anatomy_top=100000, timeout_s=3600)
    print(f"{label} {list(recomputes)}: {time.monotonic() - t0:.0f} s", flush=True)
    out = []
    for rc, tr in zip(recomputes, traces, strict=True):
        b = tr.busiest
        out.append({"label": label, "model": model["name"], "hidden": model["hidden"],
                    "recompute": rc, "rows": sum(tr.seq_lens), "rank_rows": b.rows,
                    "rank": b.rank, "peak_forward": b.peak_forward_bytes, "peak_backward": b.peak_backward_bytes,
                    "anatomy": b.anatomy["full"]})
    return out


def lines_of(rec: dict) -> list[str]:
    rows = rec["rows"]
    out = [f"== {rec['label']} {rec['model']} recompute {rec['recompute']}: {rows} gathered rows "
           f"({rec['rank_rows']} on the rank), busiest rank {rec['rank']}; peak forward "
           f"{rec['peak_forward'] / rows:.1f}, backward {rec['peak_backward'] / rows:.1f} B per gathered row"]
    h = rec["hidden"]
    for phase, groups in rec["anatomy"].items():
        per: dict[str, float] = {}
        split: dict[tuple[str, str], float] = {}
        for n, _ph, where, _op, shape, _dt in groups:
            per[_layer(where)] = per.get(_layer(where), 0) + n
            # hidden-wide [rows, (1,) H] storages: on all gathered rows, or on the rank's shard
            kind = ("hidden, all rows" if shape and shape[0] == rows else "hidden, shard") \
                if len(shape) >= 2 and shape[-1] == h and shape[0] <= rows else "per head / F / other"
            split[(_layer(where), kind)] = split.get((_layer(where), kind), 0) + n
        out.append(f"-- {phase} peak {sum(per.values()) / rows:.1f} B/row: "
                   + ", ".join(f"{k} {v / rows:.1f}" for k, v in sorted(per.items())))
        out.append("   in H per gathered row: " + "; ".join(
            f"{k[0]} {k[1]} {v / rows / h:.2f}" for k, v in sorted(split.items())))
        small: dict[str, float] = {}
        for n, ph, where, op, shape, dt in groups:
            if n / rows < 8:
                small[_layer(where)] = small.get(_layer(where), 0) + n
                continue
            out.append(f"   {n / rows:9.1f}  {ph:8s} {where:40s} {op:22s} {shape} {dt}")
        out.append("   " + ", ".join(f"{k} {v / rows:.1f}" for k, v in sorted(small.items()))
                   + " (groups under 8 B/row each)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=list(LAYOUTS))
    ap.add_argument("--recompute", nargs="*", default=["none", "selective"])
    ap.add_argument("--json", default=None, help="also write the records as JSON here")
    ap.add_argument("--out", default=None)
    ap.add_argument("--heldout", action="store_true", help="the held-out shape, its first wave")
    ap.add_argument("--moe", action="store_true",
                    help="also the GDN+MoE hybrid (gdn_grid.GDN_MOE) at its traced layouts (TP1, TP2+SP, TP4+SP)")
    ap.add_argument("--moe-layouts", nargs="*", default=list(MOE_LAYOUTS),
                    help="the GDN+MoE hybrid's layouts with --moe (default: every traced one)")
    args = ap.parse_args(argv)
    model, waves = (gdn_grid.HELDOUT, gdn_grid.HELDOUT_WAVES) if args.heldout else (gdn_grid.GDN, grid.WAVES)
    args.out = args.out or str(HELDOUT_OUT if args.heldout else OUT)
    recs = [r for label in args.only for r in trace(label, args.recompute, model=model, waves=waves)]
    if args.moe:
        recs += [r for label in args.moe_layouts for r in trace(label, args.recompute, model=gdn_grid.GDN_MOE)]
    if args.json:
        write_text_atomic(Path(args.json), json.dumps(recs))
    names = " and ".join(([model["name"]] if args.only else []) + ([gdn_grid.GDN_MOE["name"]] if args.moe else []))
    text = [f"anatomy of {names}'s cells (busiest rank, whole step, wave "
            f"{list(waves[0])}): bench/gdn_retained_anatomy.py; B per gathered row; "
            "docs/memory-model.md#gdn-sp-retained" + (", #gdn-full-point" if args.moe else ""), ""]
    for r in recs:
        text += lines_of(r) + [""]
    write_text_atomic(Path(args.out), "\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
