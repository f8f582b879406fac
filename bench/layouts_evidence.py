"""Layout evidence: what each layout adds on its busiest rank, from the multi-rank traces.

    python bench/layouts_evidence.py anatomy   # live storages at the peaks of a few cells
    python bench/layouts_evidence.py analyse   # today's terms, un-gated, against the grid

`anatomy` traces a few cells of bench/multirank_grid.py with the per-rank anatomy
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

import multirank_grid as grid  # noqa: E402

RESULTS = grid.RESULTS
ANATOMY = RESULTS / "layouts_anatomy.txt"
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
    ("MoE-wide TP1", grid.MOE_WIDE, {}, "full"),
    ("MoE-wide EP2", grid.MOE_WIDE, {"ep": 2}, "full"),
    ("MoE-wide EP4", grid.MOE_WIDE, {"ep": 4}, "full"),
    ("MoE-wide EP2", grid.MOE_WIDE, {"ep": 2}, "none"),
)


def _anatomy_lines(label, model, kwargs, rc) -> list[str]:
    from waveplan.pricing.geometry import ModelGeometry
    from waveplan.pricing.measure.multirank import trace_multirank
    from waveplan.pricing.parallel import Recompute

    g = ModelGeometry.from_dict(model)
    t0 = time.monotonic()
    tr = trace_multirank(g, layout=grid.layout_of(kwargs), seq_lens=list(grid.WAVES[0]),
                         num_layers=2, recompute=Recompute(mode=rc), lora_rank=grid.LORA_RANK,
                         anatomy=True, timeout_s=3600)
    b = tr.busiest
    rows = sum(tr.seq_lens)
    out = [f"== {label} {model['name']} recompute {rc}: {rows} rows ({b.rows} on the rank), "
           f"{tr.world_size} ranks, busiest rank {b.rank}",
           f"   peak {b.peak_bytes / rows:.0f} B/row (forward {b.peak_forward_bytes / rows:.0f}, "
           f"backward {b.peak_backward_bytes / rows:.0f}); decoder-only "
           f"{b.decoder_peak_bytes / rows:.0f} B/row; per wave row, above the baseline"]
    for run, passes in b.anatomy.items():
        for phase, groups in passes.items():
            total = sum(g_[0] for g_ in groups)
            out.append(f"-- {run} pass, {phase} peak {total / rows:.0f} B/row; live storages "
                       "(B/row; made in, module, op, shape, dtype), largest first:")
            for n, ph, where, op, shape, dt in groups[:25]:
                out.append(f"   {n / rows:9.1f}  {ph:8s} {where:44s} {op:28s} {shape} {dt}")
    print(f"{label} {rc}: {time.monotonic() - t0:.0f} s", flush=True)
    return out


def cmd_anatomy(args) -> int:
    out = ["anatomy of multi-rank CPU traces (busiest rank): the evidence for the layout terms",
           "of docs/layouts-evidence.md; `python bench/layouts_evidence.py anatomy`", ""]
    for cell in ANATOMY_CELLS:
        if args.only and cell[0] not in args.only:
            continue
        out.extend(_anatomy_lines(*cell))
        out.append("")
    path = Path(args.out) if args.out else ANATOMY
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return 0


# --- pricing variants ----------------------------------------------------------------------


@contextlib.contextmanager
def ungated():
    """Today's terms with the evidence gate lifted: `evidence_gaps` answers "covered"."""
    import waveplan.pricing.model as pm

    original = pm.evidence_gaps
    pm.evidence_gaps = lambda *a, **k: []
    try:
        yield
    finally:
        pm.evidence_gaps = original


def ungated_estimate(cell: dict) -> int:
    with ungated():
        return grid.current_estimate(cell)["raw_bytes"]


def cmd_analyse(args) -> int:
    records = grid._load()
    lines = analyse_lines(records)
    EVIDENCE.write_text("\n".join(lines) + "\n", encoding="utf-8")
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
             f"{'class':<16} {'recompute':<9} {'tokens':>6} {'traced MiB':>10} "
             f"{'today':>7} {'ungated':>8}"]
    for _, name, cell, tr, est, ung in rows:
        p = tr["peak_bytes"]
        lines.append(f"{name:<16} {cell['recompute']:<9} {sum(cell['seq_lens']):>6} "
                     f"{p / 2**20:>10.2f} {est['raw_bytes'] / p:>7.3f} {ung / p:>8.3f}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("anatomy")
    a.add_argument("--only", nargs="*", default=None)
    a.add_argument("--out", default=None)
    a.set_defaults(func=cmd_anatomy)
    b = sub.add_parser("analyse")
    b.set_defaults(func=cmd_analyse)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
