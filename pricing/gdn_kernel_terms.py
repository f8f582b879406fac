"""Terms of a GDN hybrid's retained layers on the fused GPU kernels (te-gpu): a Gated DeltaNet layer
with a dense MLP and the hybrid's gated attention layer, retained (selective and no recompute) at
TP1 CP1, priced by what FLA's chunked gated delta rule and L2 norm, TE's RMSNorm, fused RoPE,
flash attention and the fused SwiGLU keep, with the plain PyTorch tensors around them (the causal
conv, the gate and beta, the output gate, the LoRA adapters) as Megatron-core allocates them.

The coefficients are the table's `fused_gdn_layer` entry over the layer widths and the GDN widths
`gdn_widths` adds (`key`: key heads x key width, `value_heads`, `key_heads`, per TP rank).
Evidence: docs/memory-model.md#te-gpu-gdn. All functions are O(1) and torch-free.
"""

from __future__ import annotations

from .coefficients import CoefficientTable
from .geometry import GdnSpec, MixerKind
from .layout_terms import FUSED_RETAINED, fused_retained_layer_per_row, tp1_fc1_point_per_row

ENTRY = "fused_gdn_layer"


def gdn_widths(widths: dict, gdn: GdnSpec, *, tp: int) -> dict:
    """`widths` with the GDN mixer's per-rank widths: `key` (key heads x key width), `key_value`
    (value heads x key width: q and k repeated to every value head, as FLA's rule takes them),
    `key_repeated` (`key_value` where the repeat copies, more value than key heads; else 0),
    `state` (value heads x key width x value width: one chunk state per 64 rows at 1/64),
    `value_heads` and `key_heads`, each / TP. O(1)."""
    hk, hv = gdn.num_key_heads / tp, gdn.num_value_heads / tp
    dk, dv = gdn.key_head_dim, gdn.value_head_dim
    return dict(widths, key=hk * dk, key_value=hv * dk,
                key_repeated=hv * dk if gdn.num_value_heads > gdn.num_key_heads else 0.0,
                state=hv * dk * dv, value_heads=hv, key_heads=hk)


def mlp_backward_per_row(table: CoefficientTable, widths: dict) -> float:
    """The fused dense MLP's backward transient in a retained GDN hybrid layer, beside what the
    layer keeps less the SwiGLU output FC2's backward has freed.

    Formula: max(`fused_retained_layer` `backward_per_row` + `backward_replicated` - entry
    `mlp_output_freed` (2F), `fc2_backward`). See docs/memory-model.md#te-gpu-gdn. O(1).
    """
    mlp = (table.per_row(FUSED_RETAINED, widths, key="backward_per_row")
           + table.per_row(FUSED_RETAINED, widths, key="backward_replicated")
           - table.per_row(ENTRY, widths, key="mlp_output_freed"))
    return max(mlp, table.per_row(FUSED_RETAINED, widths, key="fc2_backward"))


def fused_gdn_layer_per_row(table: CoefficientTable, widths: dict, gdn: GdnSpec, *,
                            part: str = "kept") -> float:
    """A GDN layer with a dense MLP retained on the fused kernels at TP1, per row: what it keeps
    (`part` "kept"), its backward transient beside everything kept ("backward") or its own forward
    peak over the layers below it ("forward", its kept tensors included).

    Formula: entry `fused_gdn_layer` `kept`; "backward": max(`backward` - `mlp_freed` (FLA's
    backward runs after the MLP's has freed its saved tensors), `mlp_backward_per_row`);
    "forward": `forward` + `kept`; over `gdn_widths`. 0 without the entry. See
    docs/memory-model.md#te-gpu-gdn. O(1).
    """
    if not table.kernels.fused_gdn:
        return 0.0
    w = gdn_widths(widths, gdn, tp=1)
    kept = table.per_row(ENTRY, w, key="kept")
    if part == "kept":
        return kept
    if part == "backward":
        return max(table.per_row(ENTRY, w, key="backward") - table.per_row(ENTRY, w, key="mlp_freed"),
                   mlp_backward_per_row(table, w))
    return kept + table.per_row(ENTRY, w, key="forward")


def fused_gated_attention_per_row(table: CoefficientTable, widths: dict, *, part: str = "kept") -> float:
    """What a GDN hybrid's (gated) attention layer with a dense MLP holds on the fused kernels at
    TP1 beyond a plain dense layer's fused terms (`layout_terms.fused_retained_layer_per_row`):
    kept (`part` "kept"), beside its FC1 forward point ("forward"), or its whole backward
    transient ("backward").

    Formula: entry `fused_gdn_layer` `gate_per_row` (kept); `attention_forward` (forward);
    "backward": max(`mlp_backward_per_row`, `fused_retained_layer` `attention_backward` and
    `gate_backward` each less `mlp_freed`: the MLP's backward runs first). 0 without the entry.
    See docs/memory-model.md#te-gpu-gdn. O(1).
    """
    if not table.kernels.fused_gdn:
        return 0.0
    if part == "kept":
        return table.per_row(ENTRY, widths, key="gate_per_row")
    if part == "forward":
        return table.per_row(ENTRY, widths, key="attention_forward")
    freed = table.per_row(ENTRY, widths, key="mlp_freed")
    return max(mlp_backward_per_row(table, widths),
               table.per_row(FUSED_RETAINED, widths, key="attention_backward") - freed,
               table.per_row(ENTRY, widths, key="gate_backward") - freed)


POINT_ENTRY = "fused_gdn_point"


def fused_gdn_point_per_row(table: CoefficientTable, widths: dict, gdn: GdnSpec, *,
                            part: str = "point") -> float:
    """A GDN layer with a dense MLP recomputed under full recompute on the fused kernels at TP1,
    per row: its largest point (`part` "point": the recomputed FC1's forward, FLA's backward or
    its recomputed forward) or its checkpointed first forward ("nograd").

    Formula: entry `fused_gdn_point` max(`point`, `backward`, `forward`), or `nograd`, over
    `gdn_widths`. 0 without the entry. See docs/memory-model.md#te-gpu-gdn-full. O(1).
    """
    if not table.kernels.fused_gdn_point:
        return 0.0
    w = gdn_widths(widths, gdn, tp=1)
    keys = ("nograd",) if part == "nograd" else ("point", "backward", "forward")
    return max(table.per_row(POINT_ENTRY, w, key=k) for k in keys)


def fused_gated_attention_point_per_row(table: CoefficientTable, widths: dict) -> float:
    """A GDN hybrid's (gated) attention layer with a dense MLP recomputed under full recompute on
    the fused kernels at TP1, per row: the fused dense layer's point
    (`layout_terms.tp1_fc1_point_per_row`) or the output gate's backward beside the retained
    layer's tensors, whichever is larger, with the gate's kept tensors.

    Formula: max(tp1_fc1_point, fused_retained_layer + `gate_backward`) + `gate_per_row` (entry
    `fused_gdn_layer`'s gate keys). 0 without `fused_gdn_point`. See
    docs/memory-model.md#te-gpu-gdn-full. O(1).
    """
    if not table.kernels.fused_gdn_point:
        return 0.0
    gate = table.per_row(ENTRY, widths, key="gate_per_row")
    point = tp1_fc1_point_per_row(table, widths, rope_per_row=0.0, at_tp1=True)
    kept = fused_retained_layer_per_row(table, widths, tp=1, sequence_parallel=False)
    return max(point, kept + table.per_row(ENTRY, widths, key="gate_backward")) + gate


def kernel_kept_per_row(ctx, layer) -> float:
    """What a GDN hybrid's layer keeps on the fused kernels at TP1 (`fused_gdn_layer_per_row`
    "kept" for a GDN layer; the fused dense layer's kept tensors with the output gate's for an
    attention layer), per row: the floor of a multi-layer recompute chunk's re-materialised
    layers on `LayerContext.fused_gdn_point`. See docs/memory-model.md#te-gpu-gdn-full. O(1).
    """
    t, w = ctx.table, ctx.widths_r
    if layer.mixer == MixerKind.GDN:
        return fused_gdn_layer_per_row(t, w, ctx.geometry.gdn)
    return (fused_retained_layer_per_row(t, w, tp=1, sequence_parallel=False)
            + fused_gated_attention_per_row(t, w) + ctx.qk_structural_per_row)
