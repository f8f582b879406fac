"""Layout grid: multi-rank CPU traces of every layout class, beside today's estimates.

    python bench/multirank_grid.py trace     # trace the cells missing from traces_multirank.jsonl
    python bench/multirank_grid.py report    # the table: busiest-rank peak vs current estimate
    python bench/multirank_grid.py trace --grid scale --recompute full   # both dense shapes at 8192 tokens
    python bench/multirank_grid.py trace --grid long --only TP8+SP+CP4 --recompute full   # one 12288-token sequence

`trace` runs each layout's cells in one set of rank processes
(`waveplan.pricing.measure.multirank.trace_multirank_batch`) and appends one record per cell
(`{"cell", "trace"}`, the form `waveplan calibrate` reads) to
bench/results/traces_multirank.jsonl, then rewrites the file sorted by cell key, so the file's
content depends only on the cells traced. A cell already in the file is skipped: the command
can be re-run after an interruption. `report` never traces; it prices each cell with today's
model (`WavePricer` on a step of the cell's sequences, the torch-cpu table fitted to
single-rank CPU traces, head full-native, adapter gradients of 2 bytes as the trace holds
them, no safety factor: the raw estimate) and writes bench/results/traces_multirank.txt.

Shapes (inline, no preset has them): a dense model (hidden 1024, FFN 2816, 16 heads in 8
KV groups, vocabulary 8192, 2 layers: KV groups divide TP up to 8), a MoE model (hidden
512, 8 experts, top 2, expert FFN 512, 8 heads in 4 groups, vocabulary 8192, 2 layers: its
head binds under full recompute) and a wider MoE model whose layers bind (hidden 1024, 16
experts, top 4, expert FFN 512, 16 heads in 8 groups, vocabulary 2048); two waves each (2048
and 3072 tokens) for the held-out half of a fit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from waveplan.pricing.atomic_io import write_text_atomic

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

RESULTS = Path(__file__).resolve().parent / "results"
TRACES = RESULTS / "traces_multirank.jsonl"
SUMMARY = RESULTS / "traces_multirank.txt"

DENSE = {"name": "grid-dense-h1024", "hidden": 1024, "ffn": 2816, "vocab": 8192, "dtype": "bf16",
         "gated_mlp": True, "tied_embeddings": False, "layers": [["attention", "dense"]] * 2,
         "attention": {"num_heads": 16, "num_kv_groups": 8, "head_dim": 64, "output_gate": False},
         "gdn": None, "moe": None}
MOE = {"name": "grid-moe-h512", "hidden": 512, "ffn": 0, "vocab": 8192, "dtype": "bf16",
       "gated_mlp": True, "tied_embeddings": False, "layers": [["attention", "moe"]] * 2,
       "attention": {"num_heads": 8, "num_kv_groups": 4, "head_dim": 64, "output_gate": False},
       "gdn": None, "moe": {"num_experts": 8, "top_k": 2, "expert_ffn": 512, "shared_expert_ffn": 0}}
# a MoE model whose layers, not its head, bind (the one above is head-bound under full
# recompute: its expert terms show only without recompute)
MOE_WIDE = {"name": "grid-moe-h1024", "hidden": 1024, "ffn": 0, "vocab": 2048, "dtype": "bf16",
            "gated_mlp": True, "tied_embeddings": False, "layers": [["attention", "moe"]] * 2,
            "attention": {"num_heads": 16, "num_kv_groups": 8, "head_dim": 64,
                          "output_gate": False},
            "gdn": None,
            "moe": {"num_experts": 16, "top_k": 4, "expert_ffn": 512, "shared_expert_ffn": 0}}
# a second dense geometry, the held-out shape of the layout residuals (bench/layout_validation.py):
# another hidden, head width, GQA ratio (multi-head: 8 KV groups of 8 heads, against 2 heads per
# group above), FFN ratio (2.67 against 2.75) and vocabulary; one wave, a subset of recomputes
DENSE2 = {"name": "grid-dense-h768", "hidden": 768, "ffn": 2048, "vocab": 4096, "dtype": "bf16",
          "gated_mlp": True, "tied_embeddings": False, "layers": [["attention", "dense"]] * 2,
          "attention": {"num_heads": 8, "num_kv_groups": 8, "head_dim": 96, "output_gate": False},
          "gdn": None, "moe": None}
# a third dense geometry, held out of every fit (`--grid dense3`, traces_multirank_dense3.jsonl):
# shaped like Qwen3's attention (head width 128, the query projection wider than the hidden:
# 16 x 128 = 2048 over 1536, 8 KV groups of 2 heads), FFN 2.67 H, another vocabulary
DENSE3 = {"name": "grid-dense-h1536", "hidden": 1536, "ffn": 4096, "vocab": 6144, "dtype": "bf16",
          "gated_mlp": True, "tied_embeddings": False, "layers": [["attention", "dense"]] * 2,
          "attention": {"num_heads": 16, "num_kv_groups": 8, "head_dim": 128, "output_gate": False},
          "gdn": None, "moe": None}
WAVES = ((1024, 640, 384), (2048, 512, 256, 256))
WAVES2 = ((1280, 512, 256),)
RECOMPUTES = ("full", "selective", "none")
LORA_RANK = 16

# (class, model, layout kwargs, routing, recomputes): one set of rank processes each
LAYOUTS = (
    ("TP1", DENSE, {}, "balanced", RECOMPUTES),
    ("TP2", DENSE, {"tp": 2}, "balanced", RECOMPUTES),
    ("TP2+SP", DENSE, {"tp": 2, "sequence_parallel": True}, "balanced", RECOMPUTES),
    ("TP4", DENSE, {"tp": 4}, "balanced", RECOMPUTES),
    ("TP4+SP", DENSE, {"tp": 4, "sequence_parallel": True}, "balanced", RECOMPUTES),
    ("TP8", DENSE, {"tp": 8}, "balanced", RECOMPUTES),
    ("TP8+SP", DENSE, {"tp": 8, "sequence_parallel": True}, "balanced", RECOMPUTES),
    ("CP2", DENSE, {"cp": 2}, "balanced", RECOMPUTES),
    ("CP4", DENSE, {"cp": 4}, "balanced", RECOMPUTES),
    ("TP2+SP+CP2", DENSE, {"tp": 2, "sequence_parallel": True, "cp": 2}, "balanced", RECOMPUTES),
    ("TP4+SP+CP2", DENSE, {"tp": 4, "sequence_parallel": True, "cp": 2}, "balanced", RECOMPUTES),
    ("TP2+SP+CP4", DENSE, {"tp": 2, "sequence_parallel": True, "cp": 4}, "balanced", RECOMPUTES),
    ("TP4+SP+CP4", DENSE, {"tp": 4, "sequence_parallel": True, "cp": 4}, "balanced", RECOMPUTES),
    ("TP8+SP+CP2", DENSE, {"tp": 8, "sequence_parallel": True, "cp": 2}, "balanced", RECOMPUTES),
    ("TP8+SP+CP4", DENSE, {"tp": 8, "sequence_parallel": True, "cp": 4}, "balanced", RECOMPUTES),
    ("MoE TP1", MOE, {}, "balanced", RECOMPUTES),
    ("MoE EP2", MOE, {"ep": 2}, "balanced", RECOMPUTES),
    ("MoE EP4", MOE, {"ep": 4}, "balanced", RECOMPUTES),
    ("MoE EP2 router", MOE, {"ep": 2}, "router", ("full",)),
    ("MoE EP4 router", MOE, {"ep": 4}, "router", ("full",)),
    ("MoE-wide TP1", MOE_WIDE, {}, "balanced", RECOMPUTES),
    ("MoE-wide EP2", MOE_WIDE, {"ep": 2}, "balanced", RECOMPUTES),
    ("MoE-wide EP4", MOE_WIDE, {"ep": 4}, "balanced", RECOMPUTES),
    ("MoE-wide EP2 router", MOE_WIDE, {"ep": 2}, "router", RECOMPUTES),
    ("MoE-wide EP4 router", MOE_WIDE, {"ep": 4}, "router", RECOMPUTES),
    ("MoE-wide TP2+SP+EP2", MOE_WIDE, {"tp": 2, "sequence_parallel": True, "ep": 2}, "balanced",
     RECOMPUTES),
)

# the second geometry's grid (`--grid dense2`, traces_multirank_dense2.jsonl)
LAYOUTS2 = tuple((name, DENSE2, kwargs, "balanced", RECOMPUTES) for name, model, kwargs, _, _ in LAYOUTS
                 if model is DENSE)
TRACES2 = RESULTS / "traces_multirank_dense2.jsonl"
LAYOUTS3 = tuple((name, DENSE3, kwargs, "balanced", RECOMPUTES) for name, model, kwargs, _, _ in LAYOUTS
                 if model is DENSE)
WAVES3 = ((1024, 640, 384),)
TRACES3 = RESULTS / "traces_multirank_dense3.jsonl"

# the scale grid (`--grid scale`, traces_multirank_scale.jsonl): the dense geometries' layout
# classes at one wave of 8192 tokens (the third geometry where its fit cell alone set a residual:
# `--only TP8+SP+CP4 --recompute full`), 4x the fit wave, where the per-wave constants (adapter
# gradients, the head's workspace) weigh a quarter of what they weigh at 2048: the per-row
# limit of the layout residuals' fit (bench/layout_validation.py) is taken here
WAVES_SCALE = ((4096, 2048, 1024, 512, 512),)
LAYOUTS_SCALE = tuple((name, shape, kwargs, "balanced", RECOMPUTES) for shape in (DENSE, DENSE2, DENSE3)
                      for name, model, kwargs, _, _ in LAYOUTS if model is DENSE)
TRACES_SCALE = RESULTS / "traces_multirank_scale.jsonl"
# the long grid (`--grid long`, traces_multirank_long.jsonl): one sequence of 12288 tokens, 6x
# the fit wave, on the scale grid's classes: a wave of one sequence holds every per-sequence
# tensor (the RoPE cache entry, the attention's per-sequence outputs, the ring's chunks) at its
# largest; fit cells of the layout residuals where traced (bench/layout_validation.py)
WAVES_LONG = ((12288,),)
TRACES_LONG = RESULTS / "traces_multirank_long.jsonl"
GRIDS = {"main": (LAYOUTS, WAVES, TRACES), "dense2": (LAYOUTS2, WAVES2, TRACES2),
         "dense3": (LAYOUTS3, WAVES3, TRACES3),
         "scale": (LAYOUTS_SCALE, WAVES_SCALE, TRACES_SCALE), "long": (LAYOUTS_SCALE, WAVES_LONG, TRACES_LONG)}


def cell_key(cell: dict) -> str:
    return json.dumps([cell["model"], cell["layout"], cell.get("routing", "none"),
                       cell["recompute"], cell["seq_lens"], cell["lora_rank"]], sort_keys=True)


def _load(path: Path = TRACES) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write(records: list[dict], path: Path = TRACES) -> None:
    records = sorted(records, key=lambda r: cell_key(r["cell"]))
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
    write_text_atomic(path, text)


def layout_of(kwargs: dict):
    from waveplan.pricing.parallel import ParallelLayout

    return ParallelLayout(**kwargs)


def class_of(cell: dict) -> str:
    lay = cell["layout"]
    parts = []
    if lay["tp"] > 1 or lay["cp"] == 1 and lay["ep"] == 1:
        parts.append(f"TP{lay['tp']}" + ("+SP" if lay["sequence_parallel"] else ""))
    if lay["cp"] > 1:
        parts.append(f"CP{lay['cp']}")
    if lay["ep"] > 1:
        parts.append(f"EP{lay['ep']}")
    if lay.get("etp") is not None:
        parts.append(f"ETP{lay['etp']}")
    name = "+".join(parts)
    if cell.get("routing") == "router":
        name += " router"
    if not cell["geometry"]["moe"]:
        return name
    return ("MoE-wide " if cell["geometry"]["name"] == MOE_WIDE["name"] else "MoE ") + name


# --- current estimate ----------------------------------------------------------------------


def current_estimate(cell: dict, *, table: str = "torch-cpu", head: str = "full-native",
                     geometry=None, moe_load: float | None = None) -> dict:
    """Today's raw estimate of a cell's busiest rank: `WavePricer` prices the cell's
    sequences as one first gradient wave (the `table`, default torch-cpu; `head`, default
    full-native; 2-byte adapter gradients, safety 1.0, no first-execution allowance) of
    `geometry` (default the cell's inline one), under EP at the default worst-case routing load
    or the `moe_load` given. Returns raw bytes, basis and reasons."""
    import dataclasses

    import numpy as np

    from waveplan.pricing.coefficients import load_table
    from waveplan.pricing.geometry import ModelGeometry
    from waveplan.pricing.lora import LoraConfig, LoraSlot
    from waveplan.pricing.model import PricingModel
    from waveplan.pricing.parallel import ParallelLayout, Recompute
    from waveplan.pricing.step import Request, Step
    from waveplan.pricing.wave_pricer import WavePricer

    g = geometry if geometry is not None else ModelGeometry.from_dict(cell["geometry"])
    g = dataclasses.replace(g, layers=g.layers[:cell["num_layers"]])
    lay = dict(cell["layout"])
    layout = ParallelLayout(**lay)
    model = PricingModel(geometry=g, parallel=layout, recompute=Recompute(mode=cell["recompute"]),
                         lora=LoraConfig(slots=(LoraSlot(rank=cell["lora_rank"]),), grad_bytes=2),
                         table=load_table(table), head=head, safety=1.0, moe_load=moe_load)
    step = Step.from_requests([Request(id=f"r{i}", num_tokens=int(n))
                               for i, n in enumerate(cell["seq_lens"])])
    pricer = WavePricer.build(step, model, profiled=True)
    b = pricer.price([np.arange(len(step.requests))], first_slots=frozenset({"default"}))
    return {"raw_bytes": b.raw_bytes, "basis": b.basis, "reasons": list(b.reasons),
            "binding": b.binding}


# --- trace ---------------------------------------------------------------------------------


def planned(grid: str = "main") -> list[tuple[str, dict, dict, str, list[dict]]]:
    """(class, model, layout kwargs, routing, cells) of the grid (a key of `GRIDS`), in order."""
    from waveplan.pricing.geometry import ModelGeometry
    from waveplan.pricing.measure.multirank import padded_lens, rank_world

    out = []
    layouts, waves, _ = GRIDS[grid]
    for name, model, kwargs, routing, recomputes in layouts:
        layout = layout_of(kwargs)
        g = ModelGeometry.from_dict(model)
        layout.validate_for(g)
        cells = []
        for rc in recomputes:
            for wave in waves:
                cells.append({"model": model["name"], "geometry": model, "num_layers": 2,
                              "recompute": rc, "lora_rank": LORA_RANK,
                              "seq_lens": list(padded_lens(wave, layout)),
                              "layout": rank_world(layout).to_dict(),
                              "routing": routing if model["moe"] else "none"})
        out.append((name, model, kwargs, routing, cells))
    return out


def cmd_trace(args) -> int:
    from waveplan.pricing.geometry import ModelGeometry
    from waveplan.pricing.measure.multirank import TraceJob, trace_multirank_batch, trace_record
    from waveplan.pricing.parallel import Recompute

    path = Path(args.traces or GRIDS[args.grid][2])
    records = _load(path)
    have = {cell_key(r["cell"]) for r in records}
    grid = planned(args.grid)
    # the parent prices before it spawns: numba compiles (or loads its cache) here, never
    # while the rank processes share the CPUs
    for *_, cells in grid:
        for cell in cells:
            current_estimate(cell)
    from waveplan.planner.progress import progress_bar

    def wanted(cell: dict) -> bool:
        return cell_key(cell) not in have and (not args.recompute or cell["recompute"] in args.recompute)

    t_all = time.monotonic()
    total = sum(1 for name, *_, cells in grid if not (args.only and name not in args.only)
                for c in cells if wanted(c))
    bar = progress_bar(total, "multi-rank grid", unit="cell")
    for name, model, kwargs, routing, cells in grid:
        if args.only and name not in args.only:
            continue
        todo = [c for c in cells if wanted(c)]
        if not todo:
            continue
        g = ModelGeometry.from_dict(model)
        jobs = [TraceJob(seq_lens=tuple(c["seq_lens"]), recompute=Recompute(mode=c["recompute"]),
                         lora_rank=c["lora_rank"]) for c in todo]
        t0 = time.monotonic()
        traces = trace_multirank_batch(g, layout=layout_of(kwargs), jobs=jobs, num_layers=2,
                                       routing=routing, timeout_s=args.timeout)
        for cell, tr in zip(todo, traces, strict=True):
            rec = trace_record(tr, g)
            assert cell_key(rec["cell"]) == cell_key(cell), (rec["cell"], cell)
            records.append(rec)
        _write(records, path)
        print(f"{name}: {len(todo)} cells, {tr.world_size} ranks, "
              f"{time.monotonic() - t0:.0f} s", flush=True)
        bar.update(len(todo))
    bar.close()
    print(f"grid traced in {time.monotonic() - t_all:.0f} s")
    return 0


# --- report --------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / 2**20:9.2f}"


def report_lines(records: list[dict]) -> list[str]:
    order = {name: i for i, (name, *_) in enumerate(LAYOUTS)}
    rows = []
    for rec in records:
        cell, tr = rec["cell"], rec["trace"]
        est = current_estimate(cell)
        rows.append((order.get(class_of(cell), 99), class_of(cell), cell, tr, est))
    rows.sort(key=lambda r: (r[0], RECOMPUTES.index(r[2]["recompute"]), sum(r[2]["seq_lens"])))
    lines = ["Multi-rank CPU traces (bench/results/traces_multirank.jsonl) beside today's raw",
             "estimate of the busiest rank (WavePricer, torch-cpu table, head full-native, safety 1.0).",
             "Peaks are bytes above weights, buffers and inputs; MiB = 2**20 bytes.",
             "ratio = estimate / traced busiest-rank peak (< 1: under the peak).", "",
             f"{'class':<20} {'recompute':<9} {'tokens':>6} {'ranks':>5} {'busiest':>7} "
             f"{'traced MiB':>10} {'spread':>6} {'estimate':>10} {'ratio':>7}  basis"]
    by_class: dict[str, list[float]] = {}
    for _, name, cell, tr, est in rows:
        peaks = [r["peak_bytes"] for r in tr["ranks"]]
        spread = max(peaks) / min(peaks) - 1
        ratio = est["raw_bytes"] / tr["peak_bytes"]
        by_class.setdefault(name, []).append(ratio)
        lines.append(f"{name:<20} {cell['recompute']:<9} {sum(cell['seq_lens']):>6} "
                     f"{tr['world_size']:>5} {tr['busiest_rank']:>7} {_mib(tr['peak_bytes']):>10} "
                     f"{spread:>6.1%} {_mib(est['raw_bytes']):>10} {ratio:>7.3f}  {est['basis']}")
    lines += ["", "per class: cells, cells under the trace, estimate / traced (min, median, max)"]
    for name in sorted(by_class, key=lambda n: order.get(n, 99)):
        v = sorted(by_class[name])
        under = sum(1 for x in v if x < 1)
        lines.append(f"  {name:<20} {len(v):>3} {under:>3}  {v[0]:.3f}  {v[len(v) // 2]:.3f}  "
                     f"{v[-1]:.3f}")
    reasons = sorted({r for *_, est in rows for r in est["reasons"]})
    if reasons:
        lines += ["", "conservative reasons (pricing.coverage.assess):"]
        lines += [f"  - {r}" for r in reasons]
    return lines


def cmd_report(args) -> int:
    records = _load()
    if not records:
        print(f"no traces in {TRACES}; run `trace` first", file=sys.stderr)
        return 1
    lines = report_lines(records)
    write_text_atomic(SUMMARY, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trace")
    t.add_argument("--only", nargs="*", default=None, help="layout classes to trace (default all)")
    t.add_argument("--timeout", type=float, default=3600.0)
    t.add_argument("--recompute", nargs="*", default=None, choices=RECOMPUTES,
                   help="recompute modes to trace (default all)")
    t.add_argument("--grid", choices=tuple(GRIDS), default="main",
                   help="main: every layout class on three shapes; dense2: the second dense geometry; "
                        "scale: both dense geometries at 8192 tokens (the residual fit's per-row limit); "
                        "long: both dense geometries, one 12288-token sequence")
    t.add_argument("--traces", default=None,
                   help="the JSONL file to complete (default: the grid's file in bench/results)")
    t.set_defaults(func=cmd_trace)
    r = sub.add_parser("report")
    r.set_defaults(func=cmd_report)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
