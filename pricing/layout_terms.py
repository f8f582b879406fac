"""Terms that scale with the parallel layout: what TP (with or without sequence parallelism) and
CP leave unsharded, fitted per traced layout class (docs/memory-model.md#layout-residuals).

The structural sharding lives in the per-rank widths (`pricing.model.layer_widths`: F, qkv,
core, vocab divided by TP), the sequence-parallel divisor of hidden-wide terms (`sp_div`) and
the busiest CP rank's rows (`pricing.price.rank_rows`). What that structure misses is measured
by multi-rank CPU traces (bench/results/traces_multirank.jsonl: real Megatron-core layers over
gloo, one dense geometry) and charged here as hidden-wide bytes per gathered row:

- `layout_residual` entry, `full`: under full recompute, bytes the busiest rank holds at every
  point beyond the sharded terms (TP without SP: the full-rows all-reduced outputs and input
  gradients around column- and row-parallel layers, and the LoRA adapters' gathered inputs; TP
  with SP: the all-gathered layer input and the head's gathered input). Charged once per wave
  (one layer is materialised at a time under full recompute).
- `retained`: under selective or no recompute, the same per layer (hidden-wide tensors each
  retained layer keeps gathered), charged per layer.

Only positive residuals are charged (a traced layout priced over its trace keeps that margin:
never under, see bench/layout_validation.py). A layout class with no entry is not covered:
`pricing.model.layout_gaps` names it and the model falls back to the conservative basis.
"""

from __future__ import annotations

from .coefficients import CoefficientTable

ENTRY = "layout_residual"


def layout_key(tp: int, sequence_parallel: bool, cp: int) -> str:
    """The table key of a layout class: 'tp4sp-cp1', 'tp2-cp1', 'tp1-cp2'."""
    return f"tp{tp}{'sp' if sequence_parallel else ''}-cp{cp}"


def traced_layouts(table: CoefficientTable) -> frozenset[str]:
    """Layout classes the table's residual entry covers (its `full` keys); TP1 CP1 always."""
    keys = set(table.terms.get(ENTRY, {}).get("full", {}))
    return frozenset(keys | {layout_key(1, False, 1)})


def layout_residual_per_row(table: CoefficientTable, widths: dict, *, tp: int, sequence_parallel: bool,
                            cp: int, retained: bool) -> float:
    """Hidden-wide bytes per gathered row the layout leaves unsharded beyond the structural terms.

    c x H, c from entry `layout_residual` (group `retained` for selective/no recompute, charged
    per layer; `full` for full recompute, charged once per wave); 0 at TP1 CP1 and for a table
    without the entry. Evidence: the busiest-rank peaks of the multi-rank CPU traces, fitted by
    bench/layout_validation.py on the 2048-token cells (docs/memory-model.md#layout-residuals).
    """
    group = table.terms.get(ENTRY, {}).get("retained" if retained else "full", {})
    return max(0.0, float(group.get(layout_key(tp, sequence_parallel, cp), 0.0))) * widths["H"]
