"""The basis each layout x recompute mode x model kind gets (docs/support-matrix.md).

    .venv/bin/python bench/basis_matrix.py

Prints a Markdown table: per layout class and recompute mode, for a dense model (qwen3-8b), an
MoE model (qwen3-30b-a3b), a GDN hybrid (qwen3.8-27b) and a GDN hybrid with MoE MLPs
(qwen3.6-35b-a3b), on the default te-gpu table: "evidence", or "conservative" with
the traced layout whose sharding it is credited (`pricing.coverage.credit_layout`), or "invalid"
when the model cannot take the layout (heads not divisible by TP).
"""

from __future__ import annotations

from waveplan.pricing.errors import ConfigError
from waveplan.pricing.model import PricingModel
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.presets import load_preset

KINDS = (("dense", "qwen3-8b"), ("MoE", "qwen3-30b-a3b"), ("GDN hybrid", "qwen3.8-27b"),
         ("GDN+MoE hybrid", "qwen3.6-35b-a3b"))
LAYOUTS = ((1, False, 1, 1), (2, False, 1, 1), (2, True, 1, 1), (4, False, 1, 1), (4, True, 1, 1),
           (8, False, 1, 1), (8, True, 1, 1), (1, False, 2, 1), (1, False, 4, 1), (2, True, 2, 1),
           (4, True, 2, 1), (2, True, 4, 1), (4, True, 4, 1), (8, True, 2, 1), (8, True, 4, 1),
           (4, True, 1, 2), (1, False, 1, 2))
# expert TP below TP (Megatron's expert_tensor_parallel_size), with and without EP: (tp, sp, ep, etp);
# only MoE layers have experts ("-" for the other kinds)
EXPERT_LAYOUTS = ((2, True, 1, 1), (4, True, 1, 1), (4, True, 1, 2), (4, True, 2, 1), (4, True, 2, 2))


def cell(preset: str, tp: int, sp: bool, cp: int, pp: int, mode: str, ep: int = 1, etp: int | None = None) -> str:
    try:
        m = PricingModel.build(load_preset(preset), parallel=ParallelLayout(
            tp=tp, sequence_parallel=sp, cp=cp, pp=pp, ep=ep, etp=etp), recompute=Recompute(mode=mode))
    except ConfigError:
        return "invalid"
    if m.basis == "evidence":
        return "evidence"
    c = m.credit
    credit = f"TP{c.tp}{'+SP' if c.sequence_parallel else ''}{f' CP{c.cp}' if c.cp > 1 else ''}"
    if m.layout_gaps:
        return f"conservative (as {credit})"
    # no layout gap: pipeline stages, or an untraced expert TP (its experts on every gathered routed row)
    return "conservative (stages)" if pp > 1 else f"conservative (as {credit}, every routed row)"


def main() -> None:
    print("| layout | recompute | " + " | ".join(k for k, _ in KINDS) + " |")
    print("|---|---|" + "---|" * len(KINDS))
    for tp, sp, cp, pp in LAYOUTS:
        name = f"TP{tp}{'+SP' if sp else ''}{f' CP{cp}' if cp > 1 else ''}{f' PP{pp}' if pp > 1 else ''}"
        for mode in ("full", "selective", "none"):
            print(f"| {name} | {mode} | " + " | ".join(cell(p, tp, sp, cp, pp, mode) for _, p in KINDS) + " |")
    for tp, sp, ep, etp in EXPERT_LAYOUTS:
        name = f"TP{tp}{'+SP' if sp else ''}{f' EP{ep}' if ep > 1 else ''} ETP{etp}"
        for mode in ("full", "selective", "none"):
            print(f"| {name} | {mode} | " + " | ".join(cell(p, tp, sp, 1, 1, mode, ep, etp) if "MoE" in kind else "-"
                                                      for kind, p in KINDS) + " |")


if __name__ == "__main__":
    main()
