"""Scatter plot of the multi-rank validation: estimate / traced busiest-rank peak of every cell.

    .venv/bin/python bench/layout_scatter.py    # writes bench/results/layout_scatter.png

Every multi-rank CPU cell (bench/results/traces_multirank.jsonl, traces_multirank_dense2.jsonl,
traces_multirank_dense3.jsonl, traces_multirank_scale.jsonl, traces_multirank_long.jsonl, traces_multirank_gdn.jsonl,
traces_multirank_gdn_heldout.jsonl, traces_multirank_ep.jsonl) priced
as `bench/layout_validation.py` and `bench/moe_validation.py` price it (torch-cpu table, head full-native, safety 1.0, the raw
estimate of the busiest rank): x = the traced peak, y = estimate / trace. One panel per model
kind (dense, MoE, GDN hybrid); colour per layout family (TP, TP+SP, CP, EP), marker per recompute
mode, hollow where the basis is not evidence. Expert-parallel cells are priced at the default
worst-case load (a bound, far over a balanced router) and, for balanced-router cells, also at
the opt-in load 1 (marked 'EP load 1'). Horizontal lines: the trace (1.0) and the targets
(median 1.03, worst 1.10). Needs matplotlib (the `plots` extra). O(cells) pricing calls.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from layout_validation import estimate as dense_estimate  # noqa: E402
from moe_validation import estimate as moe_estimate  # noqa: E402

from waveplan.pricing.coefficients import load_table  # noqa: E402

RESULTS = HERE / "results"
TRACE_FILES = ("traces_multirank.jsonl", "traces_multirank_dense2.jsonl", "traces_multirank_dense3.jsonl",
               "traces_multirank_scale.jsonl",
               "traces_multirank_long.jsonl",
               "traces_multirank_gdn.jsonl", "traces_multirank_gdn_heldout.jsonl",
               "traces_multirank_ep.jsonl")
OUT = RESULTS / "layout_scatter.png"
FAMILIES = ("TP1", "TP", "TP+SP", "CP", "EP worst case", "EP load 1")
COLOURS = {"TP1": "black", "TP": "tab:blue", "TP+SP": "tab:green", "CP": "tab:purple",
           "EP worst case": "tab:red", "EP load 1": "tab:orange"}
MARKERS = {"full": "o", "selective": "s", "none": "^"}


def kind_of(cell: dict) -> str:
    g = cell["geometry"]
    return "GDN hybrid" if g.get("gdn") else "MoE" if g["moe"] else "dense"


def family_of(cell: dict) -> str:
    lay = cell["layout"]
    if lay["ep"] > 1:
        return "EP worst case"
    if lay["cp"] > 1:
        return "CP"
    if lay["tp"] == 1:
        return "TP1"
    return "TP+SP" if lay["sequence_parallel"] else "TP"


def points() -> list[dict]:
    """One point per (cell, load): kind, family, recompute, peak MiB, ratio, basis. Cells found in
    several files (none today) are priced once."""
    table = load_table("torch-cpu")
    seen, out = set(), []
    for name in TRACE_FILES:
        path = RESULTS / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            cell, trace = rec["cell"], rec["trace"]
            key = json.dumps(cell, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            peak = trace["peak_bytes"]
            loads = [None]
            if cell["geometry"]["moe"] and cell["layout"]["ep"] > 1 and cell.get("routing") == "balanced":
                loads.append(1.0)
            for load in loads:
                if cell["geometry"]["moe"]:
                    raw, model = moe_estimate(cell, table, moe_load=load)
                else:
                    raw, model = dense_estimate(cell, table)
                out.append({"kind": kind_of(cell),
                            "family": "EP load 1" if load is not None else family_of(cell),
                            "recompute": cell["recompute"], "peak_mib": peak / 2**20,
                            "ratio": raw / peak, "basis": model.basis})
    return out


def plot(pts: list[dict], path: Path = OUT) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ("dense", "MoE", "GDN hybrid")
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2), sharey=True)
    for ax, kind in zip(axes, kinds, strict=True):
        mine = [p for p in pts if p["kind"] == kind]
        for fam in FAMILIES:
            for mode, marker in MARKERS.items():
                sel = [p for p in mine if p["family"] == fam and p["recompute"] == mode]
                for evidence in (True, False):
                    sub = [p for p in sel if (p["basis"] in ("evidence", "assumed")) == evidence]
                    if not sub:
                        continue
                    ax.scatter([p["peak_mib"] for p in sub], [p["ratio"] for p in sub], s=28,
                               marker=marker, linewidths=1.2,
                               facecolors=COLOURS[fam] if evidence else "none",
                               edgecolors=COLOURS[fam])
        for y, style in ((1.0, "-"), (1.03, "--"), (1.10, ":")):
            ax.axhline(y, color="grey", linestyle=style, linewidth=0.9)
        under = sum(p["ratio"] < 1 for p in mine)
        ax.set_title(f"{kind}: {len(mine)} points, {under} under the trace")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("traced busiest-rank peak (MiB)")
    axes[0].set_ylabel("estimate / trace (torch-cpu, raw)")
    handles = [plt.Line2D([], [], color=COLOURS[f], marker="o", linestyle="", label=f) for f in FAMILIES]
    handles += [plt.Line2D([], [], color="grey", marker=m, linestyle="", label=r) for r, m in MARKERS.items()]
    handles.append(plt.Line2D([], [], color="grey", marker="o", markerfacecolor="none", linestyle="",
                              label="conservative basis"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    fig.suptitle("Multi-rank CPU validation (real Megatron-core over gloo): lines at 1.0, 1.03, 1.10")
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".png.tmp")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    plt.close(fig)


def main() -> int:
    pts = points()
    plot(pts)
    for kind in ("dense", "MoE", "GDN hybrid"):
        for fam in FAMILIES:
            r = sorted(p["ratio"] for p in pts if p["kind"] == kind and p["family"] == fam)
            if r:
                print(f"{kind:10s} {fam:14s} points {len(r):3d} under {sum(x < 1 for x in r):2d} "
                      f"min {r[0]:.3f} median {r[len(r) // 2]:.3f} max {r[-1]:.3f}")
    print(f"wrote {OUT.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
