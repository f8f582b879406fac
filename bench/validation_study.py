"""Validation study: trace a grid of waves on "cpu-fake", fit the torch-cpu table, report.

    python bench/validation_study.py trace    # append missing cells to traces_cpu_fake.jsonl
    python bench/validation_study.py report   # fit on even cells, validate on odd cells
    python bench/validation_study.py anatomy  # what is live at the peaks of a few cells

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

from waveplan.pricing.atomic_io import write_text_atomic

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
# GDN hybrids: every wave runs as one concatenated row (Megatron's GatedDeltaNet takes no
# packed input), so one GDN segment per wave; 1k..8k tokens, 4 or 8 layers (the pure-torch
# GDN kernel makes these the slow cells: 6-40 s each on this machine's CPU).
HYBRID_WAVES = ([1024], [2048], [512, 512, 1024], [1024] * 4, [4096], [2048, 6144])
HYBRID_MOE_WAVES = ([1024], [2048], [512] * 4, [4096])
# Small dense models, shapes inline (no preset has them): the training-loop example's model
# (examples/train_lora_cpu.py: hidden 128, FFN 384, vocab 512, 4 heads in 2 groups) and two
# larger small ones. At these widths the per-row terms that do not scale with the hidden size
# (rank-wide LoRA tensors, per-head softmax statistics, per-segment tensors) weigh several
# percent, which the full-size cells above cannot constrain.
SMALL_MODELS = (
    # (label, hidden, ffn, vocab, heads, groups)
    ("small-h128", 128, 384, 512, 4, 2),
    ("small-h256", 256, 768, 2048, 8, 4),
    ("small-h512", 512, 1536, 4096, 8, 2),
)
SMALL_WAVES = ([436], [200, 312], [64] * 7, [128, 96, 160, 52], [1024], [100] * 10)


def small_geometry(label: str, num_layers: int) -> dict:
    """The inline geometry (`ModelGeometry.to_dict()` form) of a small model."""
    _, hidden, ffn, vocab, heads, groups = next(m for m in SMALL_MODELS if m[0] == label)
    return {"name": label, "hidden": hidden, "ffn": ffn, "vocab": vocab, "dtype": "bf16",
            "gated_mlp": True, "tied_embeddings": False,
            "layers": [["attention", "dense"]] * num_layers,
            "attention": {"num_heads": heads, "num_kv_groups": groups,
                          "head_dim": hidden // heads, "output_gate": False},
            "gdn": None, "moe": None}


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
        for w, lens in enumerate(HYBRID_WAVES):
            if (w + len(rc)) % 6 == 5:  # drop one wave per combination: 5 per combo
                continue
            # 4 layers = the 3:1 pattern once (3 GDN + 1 attention); 8 = twice
            out.append({"model": "qwen3.8-27b", "num_layers": 4 if i % 3 else 8, "recompute": rc,
                        "lora_rank": RANKS[i % 4], "seq_lens": list(lens)})
            i += 1
    for rc in RECOMPUTES:
        for lens in HYBRID_MOE_WAVES:
            out.append({"model": "qwen3.6-35b-a3b", "num_layers": 4, "recompute": rc,
                        "lora_rank": RANKS[i % 4], "seq_lens": list(lens)})
            i += 1
    for label, *_ in SMALL_MODELS:
        for rc in RECOMPUTES:
            for w, lens in enumerate(SMALL_WAVES):
                if (w + len(rc)) % 3 == 2:  # drop two waves per combination: 4 per combo
                    continue
                layers = 2 + i % 2
                out.append({"model": label, "geometry": small_geometry(label, layers),
                            "num_layers": layers, "recompute": rc, "lora_rank": RANKS[i % 4],
                            "seq_lens": list(lens)})
                i += 1
    return out


def cell_key(cell: dict) -> str:
    key = [cell["model"], cell["num_layers"], cell["recompute"], cell["lora_rank"],
           list(cell["seq_lens"])]
    if "geometry" in cell:  # inline shapes: a changed geometry is a new cell
        key.append(cell["geometry"])
    return json.dumps(key, sort_keys=True)


def cell_model(cell: dict):
    """The geometry `trace_wave` runs: the inline one, else the named preset."""
    if "geometry" in cell:
        from waveplan.pricing.geometry import ModelGeometry

        return ModelGeometry.from_dict(cell["geometry"])
    from waveplan.pricing.presets import load_preset

    return load_preset(cell["model"])


def load_traces(path: Path = TRACES) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


def cmd_trace(args) -> int:
    from waveplan.pricing.measure.trace import trace_wave
    from waveplan.pricing.parallel import Recompute

    done = {cell_key(r["cell"]) for r in load_traces(args.traces)}
    grid = cells()
    todo = [c for c in grid if cell_key(c) not in done]
    print(f"{len(grid)} cells, {len(grid) - len(todo)} cached, {len(todo)} to trace", flush=True)
    args.traces.parent.mkdir(parents=True, exist_ok=True)
    from waveplan.planner.progress import progress_bar

    bar = progress_bar(len(todo), "validation grid", unit="cell")
    for n, cell in enumerate(todo, 1):
        t0 = time.perf_counter()
        res = trace_wave(cell_model(cell), seq_lens=cell["seq_lens"],
                         num_layers=cell["num_layers"], device="cpu-fake",
                         recompute=Recompute(mode=cell["recompute"]),
                         lora_rank=cell["lora_rank"], head="full-native")
        dt = time.perf_counter() - t0
        rec = {"cell": cell, "trace": res.to_dict(), "seconds": round(dt, 2)}
        with args.traces.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec, sort_keys=True) + "\n")
        print(f"[{n}/{len(todo)}] {cell_key(cell)} peak={res.peak_bytes} {dt:.1f}s", flush=True)
        bar.update(1)
    bar.close()
    return 0


def _stats(values: list[float]) -> dict:
    v = sorted(values)
    n = len(v)
    med = v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
    return {"cells": n, "below_trace": sum(1 for o in v if o < 0), "median_over": med,
            "worst_over": v[-1], "min_over": v[0]}


def _line(label: str, st: dict) -> str:
    return (f"{label:34s} cells={st['cells']:3d} below={st['below_trace']:2d} "
            f"median={st['median_over'] * 100:6.2f}% worst={st['worst_over'] * 100:6.2f}% "
            f"min={st['min_over'] * 100:6.2f}%")


def grid_records(path: Path) -> list[dict]:
    """The traced cells of the grid, in grid order (records of other cells are ignored)."""
    order = {cell_key(c): i for i, c in enumerate(cells())}
    records = [r for r in load_traces(path) if cell_key(r["cell"]) in order]
    records.sort(key=lambda r: order[cell_key(r["cell"])])
    return records


def cmd_report(args) -> int:
    from waveplan.pricing.measure import calibrate

    records = grid_records(args.traces)
    if not records:
        print(f"no grid traces in {args.traces}", file=sys.stderr)
        return 2
    fit_set = records[0::2]
    val_set = records[1::2]
    base = calibrate.load_base("te-gpu")
    t0 = time.perf_counter()
    table = calibrate.fit_table(fit_set, base, source_label=f"{args.traces.name} (even cells)")
    fit_seconds = time.perf_counter() - t0
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
                "trace_seconds": rec.get("seconds"),
            })
    RESULTS.mkdir(parents=True, exist_ok=True)
    import csv

    with (RESULTS / "validation_cells.csv").open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()})
    models = sorted({r["model"] for r in rows}, key=lambda m: [c["model"] for c in cells()].index(m))
    counts = {m: {rc: sum(1 for r in rows if r["model"] == m and r["recompute"] == rc)
                  for rc in RECOMPUTES} for m in models}
    seconds = {m: sum(r["trace_seconds"] or 0 for r in rows if r["model"] == m) for m in models}
    lines = [f"validation study: {len(records)} traced cells ({args.traces.name}, device cpu-fake, "
             f"layer counts reduced); fit on the {len(fit_set)} even-index cells, validated on "
             f"the {len(val_set)} odd-index cells (the held-out figures are the 'validate' lines)",
             "cells per model (full/selective/none): " + ", ".join(
                 f"{m} {counts[m]['full']}/{counts[m]['selective']}/{counts[m]['none']}" for m in models),
             "trace seconds per model (one cpu-fake trace each, as recorded): " + ", ".join(
                 f"{m} {seconds[m]:.0f} s" for m in models),
             f"fit: {fit_seconds:.1f} s; factors: " + json.dumps(table_scales(table)),
             "peak: the whole step (decoder, output layer and Megatron's own cross entropy on "
             "full logits) against the trace's peak",
             "decoder-only: the same wave priced with the head's logits terms (per row x vocab) "
             "set to zero, the decoder's final norm kept, against the trace's decoder-only pass "
             "(no output layer and loss; its backward starts from one hidden-size gradient)",
             "over = estimate / measured - 1 (raw, no safety factor); below = cells with over < 0", ""]
    summary = {"cells": len(records), "fit_cells": len(fit_set), "validate_cells": len(val_set),
               "cells_per_model": counts, "trace_seconds": seconds,
               "fit_seconds": round(fit_seconds, 1), "factors": table_scales(table)}
    for split in ("fit", "validate"):
        sub = [r for r in rows if r["split"] == split]
        for what in ("peak", "decoder"):
            st = _stats([r[f"over_{what}"] for r in sub])
            summary[f"{split}_{what}"] = st
            lines.append(_line(f"{split} {what} (all)", st))
            for model in models:
                for rc in RECOMPUTES:
                    part = [r[f"over_{what}"] for r in sub if r["model"] == model and r["recompute"] == rc]
                    if part:
                        st = _stats(part)
                        summary[f"{split}_{what}_{model}_{rc}"] = st
                        lines.append(_line(f"    {model} {rc}", st))
        lines.append("")
    text = "\n".join(lines) + "\n"
    write_text_atomic(RESULTS / "validation_summary.txt", text)
    write_text_atomic(RESULTS / "validation_summary.json", json.dumps(summary, indent=2) + "\n")
    print(text)
    _plot(rows, RESULTS / "validation_scatter.png")
    return 0


# Cells whose anatomy `anatomy` records: the evidence for the structural units of the
# torch-cpu terms (pricing.measure.calibrate.UNITS).
ANATOMY_CELLS = (
    {"model": "qwen3-8b", "num_layers": 2, "recompute": "full", "lora_rank": 16, "seq_lens": [1024]},
    {"model": "qwen3-8b", "num_layers": 2, "recompute": "none", "lora_rank": 16, "seq_lens": [1024]},
    {"model": "llama-3.1-8b", "num_layers": 2, "recompute": "none", "lora_rank": 16, "seq_lens": [1024]},
    {"model": "qwen3-30b-a3b", "num_layers": 2, "recompute": "full", "lora_rank": 16, "seq_lens": [1024]},
    {"model": "qwen3-30b-a3b", "num_layers": 2, "recompute": "none", "lora_rank": 16, "seq_lens": [1024]},
    {"model": "qwen3.8-27b", "num_layers": 4, "recompute": "full", "lora_rank": 16, "seq_lens": [1024]},
    {"model": "qwen3.8-27b", "num_layers": 4, "recompute": "none", "lora_rank": 16, "seq_lens": [1024]},
    {"model": "qwen3.6-35b-a3b", "num_layers": 4, "recompute": "none", "lora_rank": 16, "seq_lens": [1024]},
)


def _anatomy_one(cell: dict) -> list[str]:
    """Trace `cell` on cpu-fake with a tracker that remembers who made each storage: what is
    live at each pass's peak, and, in backward, the live bytes when each layer's output
    gradient arrives and the highest live bytes until the next layer's arrives."""
    import torch

    from waveplan.pricing.measure import trace as T
    from waveplan.pricing.measure.live_anatomy import anatomy_tracker_class, module_stack
    from waveplan.pricing.parallel import Recompute
    from waveplan.pricing.presets import load_preset

    stack: list[str] = []
    trackers: list = []
    base_cls = T._tracker_class()

    class Anatomy(anatomy_tracker_class()):
        """The live-anatomy tracker (labels and peak snapshots) plus backward windows: `mark`
        starts a window at the live bytes now; each window keeps the most live until the next."""

        def __init__(self) -> None:
            super().__init__()
            self.stack = stack
            self.marks: list[list] = []
            self.window = 0
            trackers.append(self)

        def mark(self, name: str) -> None:
            if self.marks:
                self.marks[-1][2] = self.window
            self.marks.append([name, self.current, None])
            self.window = self.current

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.window = max(self.window, self.current)
            return out

    original_run = T._run_step

    def run_step(torch_, model, lens, vocab, dev, packed, full_head, phase):
        hooks = []
        for i, layer in enumerate(model.decoder.layers):
            def on_output(mod, inp, out, i=i):
                o = out[0] if isinstance(out, tuple) else out
                if torch.is_grad_enabled() and o.requires_grad:
                    o.register_hook(lambda g, i=i: trackers[-1].mark(f"L{i} backward starts") or None)
            hooks.append(layer.register_forward_hook(on_output))

        def ph(what, inputs):
            tr = trackers[-1]
            if what == "backward":  # before `phase`, whose reset_peak would re-snapshot
                tr.fwd = (tr_peak(tr), tr.snap)
            elif what == "done":
                tr.mark("end")
                tr.bwd = (tr_peak(tr), tr.snap)
            phase(what, inputs)
            if what == "backward":
                tr.phase = "backward"
                tr.mark("backward starts (head, final norm)")

        try:
            with module_stack(model, stack):
                return original_run(torch_, model, lens, vocab, dev, packed, full_head, ph)
        finally:
            for h in hooks:
                h.remove()

    def tr_peak(tr):
        return sum(n for _, n in tr.snap.values())

    T._tracker_class, T._run_step = (lambda: Anatomy), run_step
    try:
        res = T.trace_wave(load_preset(cell["model"]), seq_lens=cell["seq_lens"],
                           num_layers=cell["num_layers"], device="cpu-fake",
                           recompute=Recompute(mode=cell["recompute"]),
                           lora_rank=cell["lora_rank"], head="full-native")
    finally:
        T._tracker_class, T._run_step = (lambda: base_cls), original_run
    rows = sum(cell["seq_lens"])
    out = [f"== {cell_key(cell)}: {rows} rows",
           f"whole peak {res.peak_bytes / rows:.0f} B/row (forward {res.peak_forward_bytes / rows:.0f}, "
           f"backward {res.peak_backward_bytes / rows:.0f}); decoder-only {res.decoder_peak_bytes / rows:.0f} "
           f"B/row (forward {res.decoder_peak_forward_bytes / rows:.0f}, backward "
           f"{res.decoder_peak_backward_bytes / rows:.0f}); all figures above the pre-step baseline"]
    for tr, label in zip(trackers, ("whole step", "decoder-only"), strict=False):
        for pass_name, (peak, snap) in (("forward", tr.fwd), ("backward", tr.bwd)):
            out.append(f"-- {label}, {pass_name} pass peak {peak / rows:.0f} B/row; live storages "
                       "(B/row; pass made in, module, op, shape, dtype), largest first:")
            out.extend(_snapshot_lines(snap, rows))
        out.append(f"-- {label}, backward windows (B/row): live when the gradient reaches each "
                   "layer's output, and the most live until the next mark")
        for name, start, high in tr.marks[:-1]:
            out.append(f"   {name:36s} start {start / rows:10.0f}  highest {high / rows:10.0f}  "
                       f"above start {(high - start) / rows:9.0f}")
    return out


def _snapshot_lines(snap: dict, rows: int, top: int = 30) -> list[str]:
    totals: dict = {}
    for info, nbytes in snap.values():
        label = info or ("?", "?", "?", (), "?")
        totals[label] = totals.get(label, 0) + nbytes
    items = sorted(totals.items(), key=lambda kv: -kv[1])
    lines = [f"   {n / rows:9.0f}  {ph:8s} {where:52s} {op:36s} {list(shape)} {dt}"
             for (ph, where, op, shape, dt), n in items[:top]]
    rest = sum(n for _, n in items[top:])
    if rest:
        lines.append(f"   {rest / rows:9.0f}  ({len(items) - top} smaller groups)")
    return lines


def cmd_anatomy(args) -> int:
    out = ["anatomy of cpu-fake traces: the evidence for the structural units of the torch-cpu",
           "terms (pricing/measure/calibrate.py UNITS); `python bench/validation_study.py anatomy`", ""]
    for cell in ANATOMY_CELLS:
        t0 = time.perf_counter()
        out.extend(_anatomy_one(cell))
        out.append(f"   ({time.perf_counter() - t0:.1f} s)")
        out.append("")
        print(f"{cell_key(cell)} {time.perf_counter() - t0:.1f} s", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_text_atomic(RESULTS / "validation_anatomy.txt", "\n".join(out) + "\n")
    return 0


def table_scales(table) -> dict:
    return dict(getattr(table, "_fit_scales", {}) or {})


def _plot(rows, path: Path) -> None:
    """Estimate against measured (top) and the over-estimate (bottom), whole peak (left) and
    decoder-only (right); colour by model, o = fit cell, x = held-out cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    colours = {m: f"C{i}" for i, m in enumerate(models)}
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for col, what in enumerate(("peak", "decoder")):
        top, bottom = axes[0, col], axes[1, col]
        for model in models:
            for split, marker in (("fit", "o"), ("validate", "x")):
                sub = [r for r in rows if r["split"] == split and r["model"] == model]
                if not sub:
                    continue
                meas = [r[f"measured_{what}"] / 2**30 for r in sub]
                top.scatter(meas, [r[f"estimate_{what}"] / 2**30 for r in sub], marker=marker,
                            s=22, color=colours[model], facecolors="none" if marker == "o" else None,
                            label=f"{model} ({split})")
                bottom.scatter(meas, [r[f"over_{what}"] * 100 for r in sub], marker=marker, s=22,
                               color=colours[model], facecolors="none" if marker == "o" else None)
        lo = min(min(r[f"measured_{what}"], r[f"estimate_{what}"]) for r in rows) / 2**30
        hi = max(max(r[f"measured_{what}"], r[f"estimate_{what}"]) for r in rows) / 2**30
        top.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        top.set_xscale("log")
        top.set_yscale("log")
        top.set_xlabel("traced peak (GiB, cpu-fake)")
        top.set_ylabel("estimate (GiB, torch-cpu table)")
        top.set_title("whole peak" if what == "peak" else "decoder-only peak")
        bottom.axhline(0, color="k", lw=0.8)
        bottom.set_xscale("log")
        bottom.set_xlabel("traced peak (GiB, cpu-fake)")
        bottom.set_ylabel("estimate / measured - 1 (%)")
    axes[0, 0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("trace", "report", "list", "anatomy"))
    p.add_argument("--traces", type=Path, default=TRACES)
    args = p.parse_args(argv)
    if args.command == "list":
        for i, c in enumerate(cells()):
            print(i, cell_key(c))
        return 0
    if args.command == "anatomy":
        return cmd_anatomy(args)
    return cmd_trace(args) if args.command == "trace" else cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
