"""An attention layer with a MoE MLP: its stage (full recompute under TP with SP: the MoE
backward point; else the fitted stage sum, raised to the input norm's backward with replicated
norms) and its retained activations (under TP with SP on the structural kernel set, the
retained MoE layer; on the fused kernels at TP1 and under TP with SP, what they keep)
(docs/memory-model.md#moe-tp-point, #moe-sp-retained, #gpu-kernel-allocation-models).
"""

from __future__ import annotations

from .. import layout_terms, moe_terms, terms
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
    g, t, widths = ctx.geometry, ctx.table, ctx.widths
    if ctx.fused_moe_retained:
        # a retained layer's backward transient on the fused kernels: the experts', flash's or
        # (at TP1) the shared expert's
        routed = g.moe.top_k * ctx.ep_skew
        return max(layout_terms.fused_retained_moe_layer_per_row(t, widths, routed=routed,
                                                                 backward=True, **_fused_layout(ctx)),
                   layout_terms.fused_moe_shared_expert_per_row(t, widths, routed=routed,
                                                                point="backward")), False
    mixer = fused_attention_mixer(ctx) if mixer is None else mixer
    if ctx.full and ctx.sp_div > 1 and ctx.kernels.sp_point:
        # the MoE backward point under TP with SP (moe_terms); the attention's own backward
        # (mixer, norms) comes after
        point = (moe_terms.sp_layer_point_per_row(ctx.widths_r, tp=ctx.tp,
                                                   rope_per_row=rope_cache_per_row(g, [layer]),
                                                   heads=g.attention.num_heads / ctx.tp)
                 + ctx.qk_norm_per_row - ctx.cp_release_per_row
                 + moe_terms.sp_shared_expert_point_per_row(widths, tp=ctx.tp)
                 + terms.moe_routed_stage_per_row(t, widths, ep_skew=ctx.ep_skew,
                                                  local_experts=ctx.local_experts,
                                                  etp=ctx.etp, sp_div=ctx.sp_div))
        return max(point, mixer + norms(ctx)), True
    fitted = mixer + mlp_stage(ctx, layer) + norms(ctx)
    if not ctx.full:
        return fitted, False
    points = max(norm_point(ctx, layer), 0.0)
    return (max(fitted, points - ctx.cp_release_per_row) if points else fitted), False


def retained(ctx: LayerContext, index: int, layer: LayerSpec, *, extra: float,
             moe_extra: float) -> tuple[float, float]:
    """The layer's retained activations per row and its own structural forward peak (0 without
    one; `index` 0 also holds the embedding's output); under full recompute what a multi-layer
    chunk re-materialises."""
    if ctx.fused_moe_retained:
        # what the fused kernels keep (TE's grouped GEMM, the fused weighted SwiGLU), at TP1 and
        # under TP with SP; a shared expert's at TP1 (under TP with SP such a model keeps the fitted terms)
        routed = ctx.geometry.moe.top_k * ctx.ep_skew
        lay = _fused_layout(ctx)
        shared = layout_terms.fused_moe_shared_expert_per_row(ctx.table, ctx.widths_r, routed=routed,
                                                              point="retained")
        kept = layout_terms.fused_retained_moe_layer_per_row(ctx.table, ctx.widths_r, routed=routed,
                                                             **lay) + shared
        forward = (layout_terms.fused_retained_moe_layer_per_row(ctx.table, ctx.widths_r,
                                                                 routed=routed, forward=True, **lay)
                   + shared + layout_terms.fused_moe_shared_expert_per_row(
                       ctx.table, ctx.widths_r, routed=routed, point="forward"))
        # its forward point charges the dispatcher's permuted rows itself; beside it under EP the
        # combine's all-to-all output (`moe_extra` at TP1: 2H per routed row), while the routed
        # rows' all-gather over TP (`moe_extra` under TP with SP) is freed before the combine
        qk = ctx.qk_structural_per_row
        return kept + qk + extra, forward + qk + extra + (moe_extra if ctx.tp == 1 else 0.0)
    if not ctx.full and ctx.sp_div > 1 and ctx.kernels.structural:
        g = ctx.geometry
        less = sp_layer_release(ctx, layer)
        kw = dict(tp=ctx.tp, etp=ctx.etp, routed=g.moe.top_k * ctx.ep_skew,
                  rope_per_row=rope_cache_per_row(g, [layer]), first=index == 0)
        kept = (moe_terms.sp_retained_moe_layer_per_row(ctx.widths_r, **kw)
                - less + ctx.qk_structural_per_row + extra)
        forward = (moe_terms.sp_retained_moe_layer_per_row(ctx.widths_r, forward=True, **kw)
                   - less + ctx.qk_structural_per_row + extra + moe_extra)
        return kept, forward
    return fitted_retained(ctx, layer, extra=extra), 0.0


def _fused_layout(ctx: LayerContext) -> dict:
    """The layout arguments of the fused MoE layer's terms: the credited TP and its SP."""
    return {"tp": ctx.tp, "sequence_parallel": ctx.sp_div > 1}


def residual_covered(ctx: LayerContext, layer: LayerSpec) -> bool:
    """Whether the structural layout terms cover the layer: under TP with SP, at its MoE
    backward point (full recompute) or as a retained MoE layer (the structural kernel set)."""
    if ctx.tp == 1:
        return ctx.tp1_structural
    return ctx.sp_div > 1 and (ctx.full or ctx.kernels.structural)
