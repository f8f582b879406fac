"""A GDN layer with a MoE MLP: its stage (full recompute at CP1 on the structural kernel set,
at TP1 or under SP: its backward peak by what it holds; else the fitted stage sum) and its
retained activations (on the structural kernel set under TP with SP or at TP1 by what it holds,
else the fitted layer) (docs/memory-model.md#gdn-moe-tp, #gdn-moe-sp-retained).
"""

from __future__ import annotations

from .. import gdn_terms, terms
from ..geometry import LayerSpec
from ..pipeline import rope_cache_per_row
from .common import fitted_retained
from .context import LayerContext, RetainedBy
from .gdn_dense import fitted_stage


def stage(ctx: LayerContext, layer: LayerSpec) -> tuple[float, bool]:
    """The layer's stage workspace per row, and whether it is a structural point (no layout
    residual beside it)."""
    if ctx.gdn_backward_point and (ctx.sp_div > 1 or ctx.tp == 1) and ctx.kernels.sp_point:
        g, t, widths, sp_div = ctx.geometry, ctx.table, ctx.widths, ctx.sp_div
        kw = dict(tp=ctx.tp, sp_div=sp_div, rope_per_row=rope_cache_per_row(g, g.layers))
        point = (gdn_terms.full_gdn_moe_point_per_row(ctx.widths_r, g.gdn, **kw)
                 + gdn_terms.full_gdn_shared_expert_per_row(widths, sp_div=sp_div)
                 + terms.moe_routed_stage_per_row(t, widths, ep_skew=ctx.ep_skew,
                                                  local_experts=ctx.local_experts,
                                                  etp=ctx.etp, sp_div=sp_div))
        return max(point, gdn_terms.full_gdn_norm_point_per_row(ctx.widths_r, g.gdn, **kw)), True
    return fitted_stage(ctx, layer), False


def retained(ctx: LayerContext, index: int, layer: LayerSpec, *, extra: float,
             moe_extra: float) -> tuple[float, float]:
    """The layer's retained activations per row and its forward peak (the MoE combine, with
    the dispatcher's copies `moe_extra`; 0 where the fitted layer prices it)."""
    g = ctx.geometry
    if ctx.retained_by == RetainedBy.STRUCTURAL and ctx.sp_div > 1:
        kw = dict(tp=ctx.tp, etp=ctx.etp, routed=g.moe.top_k * ctx.ep_skew)
        kept = gdn_terms.sp_retained_gdn_moe_layer_per_row(ctx.widths_r, g.gdn, **kw) + extra
        forward = (gdn_terms.sp_retained_gdn_moe_layer_per_row(ctx.widths_r, g.gdn, forward=True, **kw)
                   + extra + moe_extra)
        return kept, forward
    if ctx.retained_by == RetainedBy.STRUCTURAL and ctx.tp == 1:
        kept = gdn_terms.retained_gdn_moe_layer_per_row(ctx.widths_r, g.gdn,
                                                        routed=g.moe.top_k * ctx.ep_skew)
        return (kept + extra if extra else kept), 0.0
    return fitted_retained(ctx, layer, extra=extra), 0.0


def residual_covered(ctx: LayerContext, layer: LayerSpec) -> bool:
    """Whether the structural layout terms cover the layer: priced by what it holds under SP."""
    if ctx.tp == 1:
        return ctx.tp1_structural
    return ctx.retained_by == RetainedBy.STRUCTURAL and ctx.sp_div > 1
