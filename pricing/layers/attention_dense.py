"""An attention layer with a dense MLP: its stage (full recompute: the fitted stage sum raised
to its structural backward points, or at TP1 its FC1 backward) and its retained activations
(the fitted layer, against what it keeps gathered under TP with SP; at TP1 the structural
layer) (docs/memory-model.md#sp-fc2-point, #sp-retained-layer, #tp1-structural).
"""

from __future__ import annotations

from .. import gdn_kernel_terms, layout_terms
from ..geometry import LayerSpec
from ..pipeline import rope_cache_per_row
from .common import (
    fitted_retained,
    fused_attention_mixer,
    mlp_stage,
    norm_point,
    norms,
    sp_layer_release,
)
from .context import LayerContext


def stage(ctx: LayerContext, layer: LayerSpec, *, mixer: float | None = None) -> tuple[float, bool]:
    """The layer's stage workspace per row (`mixer`: the mixer's stage, default the fused-QKV
    attention's), and whether it is a structural point (no layout residual beside it)."""
    t, widths = ctx.table, ctx.widths
    rope_rows = rope_cache_per_row(ctx.geometry, [layer])
    if ctx.fused_point or ctx.fused_retained or ctx.fused_gdn_retained:
        # the fused kernels' points charge the adapters' rank-wide tensors (the LoRA rank's widths)
        widths = ctx.widths_r
    if ctx.full and (ctx.tp1_structural or ctx.fused_point):
        # a plain dense model's TP1 layer at its FC1 backward, or with the fused kernels its
        # recomputed FC1's forward at any TP (layout_terms.tp1_fc1_point_per_row); under CP
        # at least the ring attention's forward merge and backward (layout_terms.ring_attention_point_per_row)
        point = layout_terms.tp1_fc1_point_per_row(t, widths, rope_per_row=rope_rows, at_tp1=True,
                                                   tp=ctx.tp, sequence_parallel=ctx.sp_div > 1)
        if ctx.fused_point:
            # under CP the recomputed attention's saved tensors are the ring's (less qkv + core)
            point -= layout_terms.ring_recomputed_release_per_row(t, widths, cp=ctx.rows_cp)
        ring = (ring_points(ctx, widths) if ctx.fused_point else 0.0)
        return max(point, ring) + ctx.qk_structural_per_row - ctx.cp_release_per_row, False
    if ctx.fused_gdn_point:
        # a GDN hybrid's attention layer recomputed on the fused kernels: the fused dense layer's
        # point with its output gate's tensors, or the gate's backward (gdn_kernel_terms)
        point = gdn_kernel_terms.fused_gated_attention_point_per_row(t, ctx.widths_r)
        return point + ctx.qk_structural_per_row, False
    if ctx.fused_gdn_retained:
        # a GDN hybrid's attention layer retained on the fused kernels: its MLP's backward
        # transient, or its attention's or output gate's where larger (gdn_kernel_terms)
        return gdn_kernel_terms.fused_gated_attention_per_row(t, widths, part="backward"), False
    if ctx.fused_retained:
        # a retained layer's backward transient on the fused kernels (under CP at least the ring's,
        # after the MLP's backward has freed its saved tensors)
        back = layout_terms.fused_retained_layer_per_row(
            t, widths, tp=ctx.tp, sequence_parallel=ctx.sp_div > 1, backward=True)
        return max(back, layout_terms.ring_attention_point_per_row(
            t, widths, cp=ctx.rows_cp, backward=True, kept=ctx.ring_saves, retained=True)), False
    mixer = fused_attention_mixer(ctx) if mixer is None else mixer
    fitted = mixer + mlp_stage(ctx, layer) + norms(ctx)
    if not ctx.full:
        return fitted, False
    # the recomputed layer's backward points the fitted stage misses: the input norm's with
    # replicated norms (TP without SP), the MLP's output projection's with gathered inputs
    fc2 = layout_terms.sp_fc2_point_per_row(t, widths, tp=ctx.tp, rope_per_row=rope_rows,
                                            sequence_parallel=ctx.sp_div > 1)
    points = max(norm_point(ctx, layer), fc2)
    return (max(fitted, points - ctx.cp_release_per_row) if points else fitted), False


def ring_points(ctx: LayerContext, widths: dict) -> float:
    """The larger of the ring attention's forward merge and backward points per row (0 at CP1):
    the backward's transient beside the layer's input, norm output and adapters (as flash's
    `attn_` point has them)."""
    t, cp = ctx.table, ctx.rows_cp
    forward = layout_terms.ring_attention_point_per_row(t, widths, cp=cp, backward=False)
    if not forward:
        return 0.0
    beside = t.per_row(layout_terms.FUSED_RETAINED, widths, key="ring_point")
    return max(forward, layout_terms.ring_attention_point_per_row(t, widths, cp=cp, backward=True)
               + beside)


def sp_retained(ctx: LayerContext, layer: LayerSpec, *, fitted: float) -> tuple[float, float]:
    """What the layer keeps gathered under TP with SP, or at a credited TP1 with the TP1
    structural layer (`layout_terms.sp_retained_layer_per_row`), against the fitted layer
    (`fitted`): its retained activations (the larger) and its forward peak per row (0 without
    the entry)."""
    g, t = ctx.geometry, ctx.table
    less = sp_layer_release(ctx, layer)
    kw = dict(tp=ctx.tp, rope_per_row=rope_cache_per_row(g, [layer]),
              sequence_parallel=ctx.sp_div > 1, at_tp1=ctx.tp1_structural)
    sp_layer = layout_terms.sp_retained_layer_per_row(t, ctx.widths_r, **kw)
    sp_layer = sp_layer - less + ctx.qk_structural_per_row if sp_layer else 0.0
    sp_forward = layout_terms.sp_retained_layer_per_row(t, ctx.widths_r, forward=True, **kw)
    sp_forward = sp_forward - less + ctx.qk_structural_per_row if sp_forward else 0.0
    return max(fitted, sp_layer), sp_forward


def retained(ctx: LayerContext, index: int, layer: LayerSpec, *, extra: float,
             moe_extra: float) -> tuple[float, float]:
    """The layer's retained activations per row and its own structural forward peak (0 without
    one); under full recompute what a multi-layer chunk re-materialises."""
    if ctx.fused_retained or ctx.fused_gdn_retained:
        # what the fused kernels keep, and the layer's own forward peak: its recomputed point;
        # a GDN hybrid's attention layer keeps its output gate's tensors too (gdn_kernel_terms)
        sp = ctx.sp_div > 1
        kept = layout_terms.fused_retained_layer_per_row(ctx.table, ctx.widths_r, tp=ctx.tp,
                                                          sequence_parallel=sp, ring=ctx.ring_saves)
        forward = max(layout_terms.tp1_fc1_point_per_row(ctx.table, ctx.widths_r, rope_per_row=0.0,
                                                         at_tp1=True, tp=ctx.tp, sequence_parallel=sp),
                      layout_terms.ring_attention_point_per_row(ctx.table, ctx.widths_r,
                                                                cp=ctx.rows_cp, backward=False))
        qk = ctx.qk_structural_per_row
        if ctx.fused_gdn_retained:
            # the output gate's tensors, and the layer's input beside its FC1 forward point
            qk += gdn_kernel_terms.fused_gated_attention_per_row(ctx.table, ctx.widths_r)
            forward += gdn_kernel_terms.fused_gated_attention_per_row(ctx.table, ctx.widths_r,
                                                                      part="forward")
        return kept + qk + extra, max(kept, forward) + qk + extra
    if ctx.tp1_structural and not ctx.full:
        # the TP1 structural layer in place of the fitted one (layout_terms.structural_at_tp1)
        kept, forward = sp_retained(ctx, layer, fitted=0.0)
        return kept + extra, forward + extra
    fitted = fitted_retained(ctx, layer, extra=extra)
    if not ctx.full and ctx.sp_div > 1:
        return sp_retained(ctx, layer, fitted=fitted)
    return fitted, 0.0


def residual_covered(ctx: LayerContext, layer: LayerSpec) -> bool:
    """Whether the structural layout terms cover the layer (it takes the layout residual
    fitted with them): at TP1 only beside the TP1 structural layer or point."""
    return ctx.tp1_structural if ctx.tp == 1 else True
