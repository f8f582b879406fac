"""The TP1 structural layer and point against the TP1-fitted layer and stage they replaced
(docs/memory-model.md#tp1-structural).

    python bench/tp1_structural.py   # -> bench/results/tp1_structural.txt

A plain dense model's retained layers at TP1 (CP too) on torch-cpu are priced by the SP structural
terms at TP = 1 (`layout_terms.structural_at_tp1`): the layer's inputs, norms' fp32 inputs, FC1
output and activations, attention's saved tensors, LoRA intermediates and rotary copies
(`sp_retained_layer_per_row`, its forward too), the head's forward (`sp_head_forward_per_row`),
the RoPE entry once per wave (`sp_rope_entry_per_row`); under full recompute the recomputed
layer's FC1 backward (`tp1_fc1_point_per_row`) in place of the fitted stage; the q/k norms whole
(`structural_qk_norm_per_row`) and the TP1 residual (`layout_residual` tp1-cp1, per layer retained
and per wave full, and at least as large tp1-cp2 / tp1-cp4: bench/layout_validation.py fit). This report prices the TP1
cells of the multi-rank grid (three dense geometries; 2048, 3072, 8192 tokens and one 12288-token
sequence) and the real-width and small calibration cells (traces_cpu_fake.jsonl) three ways:
'fitted' (the table without `sp_head_forward`: the TP1-fitted layer and stage, as shipped
before), 'no residual' (the structural terms with the TP1 residual at 0) and 'shipped'. O(cells x layers).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import layout_validation as lv  # noqa: E402

from waveplan.pricing import layout_terms  # noqa: E402
from waveplan.pricing.atomic_io import write_text_atomic  # noqa: E402
from waveplan.pricing.coefficients import CoefficientTable, load_table  # noqa: E402
from waveplan.pricing.measure import calibrate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "tp1_structural.txt"


def tables() -> dict[str, CoefficientTable]:
    """The three pricings: the TP1-fitted layer, the structural layer without and with the TP1 residual."""
    shipped = load_table("torch-cpu")
    fitted = dataclasses.replace(shipped, terms={k: v for k, v in shipped.terms.items() if k != layout_terms.SP_HEAD})
    entry = shipped.terms[layout_terms.ENTRY]
    groups = {g: {k: (0.0 if k.startswith("tp1-") else v) for k, v in entry[g].items()} for g in ("full", "retained")}
    bare = dataclasses.replace(shipped, terms=dict(shipped.terms, **{layout_terms.ENTRY: dict(entry, **groups)}))
    return {"fitted": fitted, "no residual": bare, "shipped": shipped}


def ratios(table: CoefficientTable) -> dict:
    """estimate / trace of the TP1 (and TP1+CP) dense grid cells and the TP1 calibration cells,
    every recompute mode, keyed by (suite and class, recompute)."""
    out = defaultdict(list)
    for rec in lv.load_cells() + lv.load_scale_cells() + lv.load_long_cells():
        cell = rec["cell"]
        if lv.mixed(cell) or cell["layout"]["tp"] != 1:
            continue
        raw, _ = lv.estimate(cell, table)
        out[("grid " + lv.class_of(cell), cell["recompute"])].append(raw / rec["trace"]["peak_bytes"])
    for rec in lv.tp1_calibration_cells():
        g = calibrate.cell_geometry(rec["cell"])
        out[("calibration " + g.name, rec["cell"]["recompute"])].append(
            calibrate.estimate(table, rec)["peak"] / rec["trace"]["peak_bytes"])
    return out


def main() -> int:
    priced = tables()
    got = {name: ratios(t) for name, t in priced.items()}
    head = "  ".join(f"{name:>22s}" for name in got)
    lines = ["TP1 dense layers: the TP1-fitted layer and stage, the structural layer and FC1-backward point",
             "at TP = 1 without and with the TP1 residual (bench/tp1_structural.py; torch-cpu, head full-native, safety 1.0;",
             "estimate / trace: min / median / max; 'grid': the multi-rank grid's dense TP1 cells, three",
             "geometries, every wave; 'calibration': the real-width and small cpu-fake cells of",
             "traces_cpu_fake.jsonl). TP1 residual (H per layer retained, per wave full): " + json.dumps(
                 {g: {k: v for k, v in priced["shipped"].terms[layout_terms.ENTRY][g].items()
                      if k.startswith("tp1-")} for g in ("full", "retained")}), "",
             f"{'suite and class':38s} {'recompute':9s} {'cells':>5s}  {head}"]
    for key in sorted(got["shipped"]):
        row = []
        for name in got:
            r = got[name][key]
            row.append(f"{min(r):.4f} {np.median(r):.4f} {max(r):.4f}")
        lines.append(f"{key[0]:38s} {key[1]:9s} {len(got['shipped'][key]):5d}  " + "  ".join(row))
    write_text_atomic(OUT, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
