"""Probe: TP1 retained dense layers priced by what they hold (the SP structural terms at TP = 1).

    python bench/tp1_structural_probe.py   # -> bench/results/tp1_structural_probe.txt

The TP1 table's retained layer is fitted (`waveplan calibrate`, 126 cpu-fake cells); on the
multi-rank grid's small shapes it prices TP1 and TP1+CP selective / none 3-13% over
(bench/results/layout_validation.txt), while under TP with SP the structural terms
(`layout_terms.sp_retained_layer_per_row`, `sp_head_forward_per_row`, `sp_rope_entry_per_row`)
price the same layers within 1%. This probe prices the TP1 cells of dense models without full
recompute with those structural terms at TP = 1 (gathered = sharded: the layer's attention and
MLP inputs 4H, the norms' fp32 inputs 8H, 10F, 3 qkv + 5 core, 8 rank, the rotary copies; its
forward 4H + 10H; the head's forward 6 vocab + 8H; the RoPE entry once per wave) in place of the
fitted layer, for dense models with plain attention only, and compares them with the fitted
table on the grid cells and on the real-width calibration cells (traces_cpu_fake.jsonl). It
changes no pricing code: the substitution is made on the module objects of this process only.
O(cells x layers).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import layout_validation as lv  # noqa: E402

from waveplan.pricing import layer_arrays, layout_terms  # noqa: E402
from waveplan.pricing.atomic_io import write_text_atomic  # noqa: E402
from waveplan.pricing.coefficients import load_table  # noqa: E402
from waveplan.pricing.geometry import MixerKind, MlpKind  # noqa: E402
from waveplan.pricing.measure import calibrate  # noqa: E402
from waveplan.pricing.parallel import RecomputeMode  # noqa: E402
from waveplan.pricing.pipeline import rope_cache_per_row  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "tp1_structural_probe.txt"


def _plain_dense(ctx, layer) -> bool:
    g = ctx.geometry
    return (ctx.tp == 1 and ctx.sp_div == 1 and ctx.mode != RecomputeMode.FULL
            and layer.mixer == MixerKind.ATTENTION and layer.mlp == MlpKind.DENSE
            and g.gdn is None and g.moe is None and g.attention is not None
            and g.attention.mla is None and not g.attention.output_gate)


def structural(on: bool) -> None:
    """Substitute (on) or restore the TP1 retained layer, head forward and RoPE entry terms."""
    if not hasattr(structural, "saved"):
        structural.saved = (layer_arrays.retained_layer_per_row, layout_terms.sp_head_forward_per_row,
                            layout_terms.sp_rope_entry_per_row)
    fitted_layer, head_forward, rope_entry = structural.saved
    if not on:
        (layer_arrays.retained_layer_per_row, layout_terms.sp_head_forward_per_row,
         layout_terms.sp_rope_entry_per_row) = structural.saved
        return

    def layer(ctx, index, spec, *, extra, moe_extra):
        if not _plain_dense(ctx, spec):
            return fitted_layer(ctx, index, spec, extra=extra, moe_extra=moe_extra)
        t, w, entry = ctx.table, ctx.widths_r, layout_terms.SP_RETAINED
        kept = (t.per_row(entry, w, key="gathered") + t.per_row(entry, w, key="sharded") + t.per_row(entry, w)
                + 2.0 * rope_cache_per_row(ctx.geometry, [spec]))
        forward = kept + t.per_row(entry, w, key="forward_gathered") + t.per_row(entry, w, key="forward_sharded")
        less = layer_arrays.sp_layer_release_per_row(ctx, spec) - ctx.qk_norm_per_row - extra
        return kept - less, forward - less

    def head(table, widths, *, tp, sequence_parallel):
        if tp > 1 or layout_terms.SP_HEAD not in table.terms:
            return head_forward(table, widths, tp=tp, sequence_parallel=sequence_parallel)
        return table.per_row(layout_terms.SP_HEAD, widths) + table.per_row(layout_terms.SP_HEAD, widths, key="sharded")

    def rope(table, *, rope_per_row, tp, sequence_parallel):
        if tp > 1:
            return rope_entry(table, rope_per_row=rope_per_row, tp=tp, sequence_parallel=sequence_parallel)
        return rope_per_row if layout_terms.SP_POINT in table.terms else 0.0

    layer_arrays.retained_layer_per_row = layer
    layout_terms.sp_head_forward_per_row = head
    layout_terms.sp_rope_entry_per_row = rope


def ratios() -> dict:
    """estimate / trace of the TP1 (and TP1+CP) dense grid cells and the dense calibration
    cells, selective and none, keyed by (suite and class, recompute)."""
    table = load_table("torch-cpu")
    out = defaultdict(list)
    for rec in lv.load_cells() + lv.load_scale_cells() + lv.load_long_cells():
        cell = rec["cell"]
        if lv.mixed(cell) or cell["layout"]["tp"] != 1 or cell["recompute"] == "full":
            continue
        raw, _ = lv.estimate(cell, table)
        out[("grid " + lv.class_of(cell), cell["recompute"])].append(raw / rec["trace"]["peak_bytes"])
    for line in (RESULTS / "traces_cpu_fake.jsonl").read_text().splitlines():
        rec = json.loads(line)
        cell = rec["cell"]
        g = calibrate.cell_geometry(cell)
        if cell["recompute"] == "full" or g.moe is not None or g.gdn is not None:
            continue
        out[("calibration " + g.name, cell["recompute"])].append(
            calibrate.estimate(table, rec)["peak"] / rec["trace"]["peak_bytes"])
    return out


def main() -> int:
    structural(False)
    fitted = ratios()
    structural(True)
    probe = ratios()
    structural(False)
    lines = ["TP1 retained dense layers: the fitted table against the structural terms at TP = 1",
             "(bench/tp1_structural_probe.py; torch-cpu, head full-native, safety 1.0; estimate / trace:",
             "min / median / max; 'grid': the multi-rank grid's dense cells, 'calibration': the",
             "real-width and small cpu-fake cells of traces_cpu_fake.jsonl). No pricing code changed.", "",
             f"{'suite and class':38s} {'recompute':9s} {'cells':>5s}  {'fitted (shipped)':>22s}  {'structural':>22s}"]
    for key in sorted(fitted):
        a, b = fitted[key], probe[key]
        lines.append(f"{key[0]:38s} {key[1]:9s} {len(a):5d}  "
                     f"{min(a):.4f} {np.median(a):.4f} {max(a):.4f}  {min(b):.4f} {np.median(b):.4f} {max(b):.4f}")
    write_text_atomic(OUT, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
