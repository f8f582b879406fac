"""Layout evidence: what each layout adds on its busiest rank, from the multi-rank traces.

    python bench/layouts_evidence.py anatomy   # live storages at the peaks of a few cells
    python bench/layouts_evidence.py analyse   # today's terms, un-gated, against the grid

`anatomy` traces a few cells of bench/multirank_grid.py (`--only LABEL..`, `--waves 0 1`) with the per-rank anatomy
(`multirank.trace_multirank(anatomy=True)`) and writes bench/results/layouts_anatomy.txt: for
the busiest rank, what is live at each pass's peak (bytes per row of the wave, grouped by the
module and aten op that made each storage). `analyse` prices every traced cell of
bench/results/traces_multirank.jsonl three ways: today's model (conservative where no seed
covers the layout), today's terms with the evidence gate lifted (widths divided by TP,
boundaries by TP under SP, rows by CP), and the draft layout rules of docs/layouts-evidence.md
(`draft_estimate`), fitted on the first wave of each class and checked on the second; it
writes bench/results/layouts_evidence.txt. Nothing here changes the pricing code.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ep_grid  # noqa: E402
import multirank_grid as grid  # noqa: E402

from waveplan.pricing.atomic_io import write_text_atomic  # noqa: E402

RESULTS = grid.RESULTS
ANATOMY = RESULTS / "layouts_anatomy.txt"
GROUPS = 25   # live-storage groups listed per peak (`--groups`)
EVIDENCE = RESULTS / "layouts_evidence.txt"

# (label, model, layout kwargs, recompute): wave A (2048 tokens) of the grid
ANATOMY_CELLS = (
    ("TP1", grid.DENSE, {}, "full"),
    ("TP4", grid.DENSE, {"tp": 4}, "full"),
    ("TP4+SP", grid.DENSE, {"tp": 4, "sequence_parallel": True}, "full"),
    ("TP1", grid.DENSE, {}, "none"),
    ("TP4", grid.DENSE, {"tp": 4}, "none"),
    ("TP4+SP", grid.DENSE, {"tp": 4, "sequence_parallel": True}, "none"),
    ("TP8+SP", grid.DENSE, {"tp": 8, "sequence_parallel": True}, "full"),
    ("CP2", grid.DENSE, {"cp": 2}, "full"),
    ("CP2", grid.DENSE, {"cp": 2}, "none"),
    ("CP4", grid.DENSE, {"cp": 4}, "full"),
    ("TP2+SP+CP4", grid.DENSE, {"tp": 2, "sequence_parallel": True, "cp": 4}, "full"),
    ("TP8+SP h1024", grid.DENSE, {"tp": 8, "sequence_parallel": True}, "none"),
    ("TP8+SP h768", grid.DENSE2, {"tp": 8, "sequence_parallel": True}, "none"),
    # what CP adds at TP8+SP beyond the terms, per geometry (docs/layouts-evidence.md section 12)
    ("TP8+SP h768", grid.DENSE2, {"tp": 8, "sequence_parallel": True}, "full"),
    ("TP8+SP+CP2 h1024", grid.DENSE, {"tp": 8, "sequence_parallel": True, "cp": 2}, "full"),
    ("TP8+SP+CP2 h768", grid.DENSE2, {"tp": 8, "sequence_parallel": True, "cp": 2}, "full"),
    # where the SP retained cells peak: the forward (docs/layouts-evidence.md section 14;
    # `--only "TP8+SP h1536" "TP8+SP h1024" "TP2+SP h768" "TP4+SP" --recompute selective none
    # --groups 60 --out bench/results/sp_forward_anatomy.txt`)
    ("TP8+SP h1536", grid.DENSE3, {"tp": 8, "sequence_parallel": True}, "selective"),
    ("TP8+SP h1024", grid.DENSE, {"tp": 8, "sequence_parallel": True}, "selective"),
    ("TP2+SP h768", grid.DENSE2, {"tp": 2, "sequence_parallel": True}, "selective"),
    ("MoE-wide TP1", grid.MOE_WIDE, {}, "full"),
    ("MoE-wide EP2", grid.MOE_WIDE, {"ep": 2}, "full"),
    ("MoE-wide EP4", grid.MOE_WIDE, {"ep": 4}, "full"),
    ("MoE-wide EP2", grid.MOE_WIDE, {"ep": 2}, "none"),
    # retained MoE layers under TP with SP (docs/memory-model.md#moe-sp-retained)
    ("MoE-wide TP4+SP", grid.MOE_WIDE, {"tp": 4, "sequence_parallel": True}, "none"),
    ("MoE-wide TP2+SP", grid.MOE_WIDE, {"tp": 2, "sequence_parallel": True}, "none"),
    ("MoE-a3b TP4+SP", ep_grid.MOE_A3B, {"tp": 4, "sequence_parallel": True}, "none"),
    ("MoE-a3b TP2+SP", ep_grid.MOE_A3B, {"tp": 2, "sequence_parallel": True}, "none"),
    # MoE layers with an expert TP below TP under TP+SP (docs/memory-model.md#moe-etp)
    ("MoE-wide TP4+SP ETP1", grid.MOE_WIDE, {"tp": 4, "sequence_parallel": True, "etp": 1}, "full"),
    ("MoE-wide TP4+SP ETP2", grid.MOE_WIDE, {"tp": 4, "sequence_parallel": True, "etp": 2}, "full"),
    ("MoE-a3b TP4+SP ETP1", ep_grid.MOE_A3B, {"tp": 4, "sequence_parallel": True, "etp": 1}, "full"),
    ("MoE-wide TP2+SP ETP1", grid.MOE_WIDE, {"tp": 2, "sequence_parallel": True, "etp": 1}, "full"),
    ("MoE-a3b TP2+SP ETP1", ep_grid.MOE_A3B, {"tp": 2, "sequence_parallel": True, "etp": 1}, "full"),
    ("MoE-wide TP4+SP ETP1", grid.MOE_WIDE, {"tp": 4, "sequence_parallel": True, "etp": 1}, "none"),
    ("MoE-a3b TP2+SP ETP1", ep_grid.MOE_A3B, {"tp": 2, "sequence_parallel": True, "etp": 1}, "none"),
    # MoE layers under context parallelism (docs/memory-model.md#moe-cp)
    ("MoE-a3b TP2+SP+CP2", ep_grid.MOE_A3B, {"tp": 2, "sequence_parallel": True, "cp": 2}, "full"),
    ("MoE-a3b TP2+SP+CP2", ep_grid.MOE_A3B, {"tp": 2, "sequence_parallel": True, "cp": 2}, "selective"),
    ("MoE-a3b TP2+SP+CP2", ep_grid.MOE_A3B, {"tp": 2, "sequence_parallel": True, "cp": 2}, "none"),
    ("MoE-wide TP2+SP+CP2", grid.MOE_WIDE, {"tp": 2, "sequence_parallel": True, "cp": 2}, "full"),
    ("MoE-a3b TP4+SP+CP2", ep_grid.MOE_A3B, {"tp": 4, "sequence_parallel": True, "cp": 2}, "full"),
    ("MoE-a3b CP2", ep_grid.MOE_A3B, {"cp": 2}, "full"),
    # attention + MoE layers with a shared expert (docs/memory-model.md#moe-shared-sp)
    ("MoE-shared TP1", ep_grid.MOE_SHARED, {}, "full"),
    ("MoE-shared TP2+SP", ep_grid.MOE_SHARED, {"tp": 2, "sequence_parallel": True}, "full"),
    ("MoE-shared TP4+SP", ep_grid.MOE_SHARED, {"tp": 4, "sequence_parallel": True}, "full"),
    ("MoE-shared TP1", ep_grid.MOE_SHARED, {}, "none"),
    ("MoE-shared TP1", ep_grid.MOE_SHARED, {}, "selective"),
    ("MoE-shared TP2+SP", ep_grid.MOE_SHARED, {"tp": 2, "sequence_parallel": True}, "none"),
    ("MoE-shared TP4+SP", ep_grid.MOE_SHARED, {"tp": 4, "sequence_parallel": True}, "none"),
)


def _anatomy_lines(label, model, kwargs, rc, wave: int = 0) -> list[str]:
    from waveplan.pricing.geometry import ModelGeometry
    from waveplan.pricing.measure.multirank import trace_multirank
    from waveplan.pricing.parallel import Recompute

    g = ModelGeometry.from_dict(model)
    waves = grid.WAVES2 if model is grid.DENSE2 else grid.WAVES
    t0 = time.monotonic()
    tr = trace_multirank(g, layout=grid.layout_of(kwargs), seq_lens=list(waves[wave]),
                         num_layers=2, recompute=Recompute(mode=rc), lora_rank=grid.LORA_RANK,
                         anatomy=True, timeout_s=3600)
    b = tr.busiest
    rows = sum(tr.seq_lens)
    out = [f"== {label} {model['name']} recompute {rc}: {rows} rows ({b.rows} on the rank; sequences "
           f"{list(waves[wave])}), "
           f"{tr.world_size} ranks, busiest rank {b.rank}",
           f"   peak {b.peak_bytes / rows:.0f} B/row (forward {b.peak_forward_bytes / rows:.0f}, "
           f"backward {b.peak_backward_bytes / rows:.0f}); decoder-only "
           f"{b.decoder_peak_bytes / rows:.0f} B/row; per wave row, above the baseline"]
    for run, passes in b.anatomy.items():
        for phase, groups in passes.items():
            total = sum(g_[0] for g_ in groups)
            out.append(f"-- {run} pass, {phase} peak {total / rows:.0f} B/row; live storages "
                       "(B/row; made in, module, op, shape, dtype), largest first:")
            for n, ph, where, op, shape, dt in groups[:GROUPS]:
                out.append(f"   {n / rows:9.1f}  {ph:8s} {where:44s} {op:28s} {shape} {dt}")
            if len(groups) > GROUPS:
                rest = sum(g_[0] for g_ in groups[GROUPS:])
                out.append(f"   {rest / rows:9.1f}  (rest: {len(groups) - GROUPS} groups)")
    print(f"{label} {rc}: {time.monotonic() - t0:.0f} s", flush=True)
    return out


def cmd_anatomy(args) -> int:
    global GROUPS
    GROUPS = args.groups
    out = ["anatomy of multi-rank CPU traces (busiest rank): the evidence for the layout terms",
           "of docs/layouts-evidence.md; `python bench/layouts_evidence.py anatomy`", ""]
    for cell in ANATOMY_CELLS:
        if args.only and cell[0] not in args.only:
            continue
        if args.recompute and cell[3] not in args.recompute:
            continue
        for wave in args.waves:
            out.extend(_anatomy_lines(*cell, wave=wave))
            out.append("")
    path = Path(args.out) if args.out else ANATOMY
    write_text_atomic(path, "\n".join(out) + "\n")
    return 0


# --- pricing variants ----------------------------------------------------------------------


@contextlib.contextmanager
def ungated():
    """Today's terms with the evidence gate lifted: `coverage.assess` answers "covered"."""
    import waveplan.pricing.model as pm
    from waveplan.pricing.coverage import Coverage

    original = pm.assess
    pm.assess = lambda geometry, parallel, recompute, table: Coverage(
        parallel=parallel, credit=parallel, gaps=())
    try:
        yield
    finally:
        pm.assess = original


def ungated_estimate(cell: dict) -> int:
    with ungated():
        return grid.current_estimate(cell)["raw_bytes"]


def cmd_analyse(args) -> int:
    records = grid._load()
    lines = analyse_lines(records) + fit_lines(records)
    write_text_atomic(EVIDENCE, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def analyse_lines(records: list[dict]) -> list[str]:
    order = {name: i for i, (name, *_) in enumerate(grid.LAYOUTS)}
    rows = []
    for rec in records:
        cell, tr = rec["cell"], rec["trace"]
        rows.append((order.get(grid.class_of(cell), 99), grid.class_of(cell), cell, tr,
                     grid.current_estimate(cell), ungated_estimate(cell)))
    rows.sort(key=lambda r: (r[0], grid.RECOMPUTES.index(r[2]["recompute"]), sum(r[2]["seq_lens"])))
    lines = ["today's model, gated and un-gated, against the busiest rank (estimate / traced)", "",
             f"{'class':<20} {'recompute':<9} {'tokens':>6} {'traced MiB':>10} "
             f"{'today':>7} {'ungated':>8}"]
    for _, name, cell, tr, est, ung in rows:
        p = tr["peak_bytes"]
        lines.append(f"{name:<20} {cell['recompute']:<9} {sum(cell['seq_lens']):>6} "
                     f"{p / 2**20:>10.2f} {est['raw_bytes'] / p:>7.3f} {ung / p:>8.3f}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("anatomy")
    a.add_argument("--only", nargs="*", default=None)
    a.add_argument("--out", default=None)
    a.add_argument("--recompute", nargs="*", default=None, help="only these recompute modes")
    a.add_argument("--groups", type=int, default=25, help="live-storage groups listed per peak")
    a.add_argument("--waves", nargs="*", type=int, default=[0],
                   help="indices into multirank_grid.WAVES (default: the 2048-token wave)")
    a.set_defaults(func=cmd_anatomy)
    b = sub.add_parser("analyse")
    b.set_defaults(func=cmd_analyse)
    args = parser.parse_args(argv)
    return args.func(args)



# --- per-row peaks and the held-out checks -------------------------------------------------


def per_row_peaks(records: list[dict]) -> dict:
    """(class, recompute, tokens) -> busiest-rank peak per wave row (whole, decoder-only)."""
    out = {}
    for rec in records:
        c, t = rec["cell"], rec["trace"]
        toks = sum(c["seq_lens"])
        out[(grid.class_of(c), c["recompute"], toks)] = (t["peak_bytes"] / toks,
                                                          t["decoder_peak_bytes"] / toks)
    return out


def fit_lines(records: list[dict]) -> list[str]:
    """Held-out checks of the layout scalings (see docs/layouts-evidence.md)."""
    p = per_row_peaks(records)
    a, b = (sum(w) for w in grid.WAVES)
    lines = ["", "1. TP: busiest-rank peak per row = replicated + sharded / TP, fitted on TP2 and TP4",
             "   (wave A, 2048 tokens), checked on TP8 and on wave B (3072 tokens); bytes per row",
             f"   {'layout':<8} {'recompute':<9} {'replicated':>10} {'sharded':>9} {'TP8 fit':>8} "
             f"{'TP8 trace':>9} {'TP8 err':>8} {'wave B err (TP2/4/8)':>22}"]
    for sp in ("", "+SP"):
        for rc in grid.RECOMPUTES:
            y2, y4 = p[(f"TP2{sp}", rc, a)][0], p[(f"TP4{sp}", rc, a)][0]
            sharded = (y2 - y4) * 4
            rep = y4 - sharded / 4
            fit8 = rep + sharded / 8
            y8 = p[(f"TP8{sp}", rc, a)][0]
            errs_b = []
            for tp in (2, 4, 8):
                yb = p[(f"TP{tp}{sp}", rc, b)][0]
                errs_b.append((rep + sharded / tp) / yb - 1)
            lines.append(f"   {'TP' + sp:<8} {rc:<9} {rep:>10.0f} {sharded:>9.0f} {fit8:>8.0f} "
                         f"{y8:>9.0f} {fit8 / y8 - 1:>+8.1%} "
                         + " ".join(f"{e:+.1%}" for e in errs_b))
    lines += ["", "2. CP: busiest-rank peak per row on the rank (wave rows / CP) against TP1's per row",
              f"   {'layout':<12} {'recompute':<9} {'per rank row':>12} {'TP1 per row':>11} {'ratio':>6}"]
    for name, cp in (("CP2", 2), ("CP4", 4), ("TP2+SP+CP2", 2)):
        for rc in grid.RECOMPUTES:
            ref = p[("TP2+SP" if name.startswith("TP2") else "TP1", rc, a)][0]
            y = p[(name, rc, a)][0] * cp
            lines.append(f"   {name:<12} {rc:<9} {y:>12.0f} {ref:>11.0f} {y / ref:>6.3f}"
                         + ("   (reference TP2+SP)" if name.startswith("TP2") else ""))
    lines += ["", "3. EP (MoE-wide: 16 experts, top 4, H 1024): busiest-rank peak per row over TP1's",
              f"   {'layout':<22} {'recompute':<9} {'wave A':>8} {'wave B':>8}   (bytes per row over TP1)"]
    for name in ("EP2", "EP4", "EP2 router", "EP4 router"):
        for rc in grid.RECOMPUTES:
            da = p[(f"MoE-wide {name}", rc, a)][0] - p[("MoE-wide TP1", rc, a)][0]
            db = p[(f"MoE-wide {name}", rc, b)][0] - p[("MoE-wide TP1", rc, b)][0]
            lines.append(f"   {name:<22} {rc:<9} {da:>8.0f} {db:>8.0f}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
