"""A GDN layer with a dense MLP: its stage (full recompute at CP1 on the structural kernel set:
its backward peak by what it holds; else the fitted stage sum) and its retained activations
(by what it holds on the structural kernel set or, at TP1 CP1, on the fused kernels; else the
fitted layer); at TP1 CP1 under full recompute on the fused kernels its largest point
(docs/memory-model.md#gdn-full-point, #gdn-sp-retained, #te-gpu-gdn, #te-gpu-gdn-full).
"""

from __future__ import annotations

from .. import gdn_kernel_terms, gdn_terms, terms
from ..geometry import LayerSpec, MixerKind
from ..pipeline import rope_cache_per_row
from .common import fitted_retained, mlp_stage, norms
from .context import LayerContext, RetainedBy


def fitted_stage(ctx: LayerContext, layer: LayerSpec) -> float:
    """The fitted stage sum per row: the GDN stage, the MLP's, the norms'."""
    return (terms.mixer_stage_per_row(ctx.table, ctx.widths, MixerKind.GDN)
            + mlp_stage(ctx, layer) + norms(ctx))


def stage(ctx: LayerContext, layer: LayerSpec) -> tuple[float, bool]:
    """The layer's stage workspace per row, and whether it is a structural point (no layout
    residual beside it)."""
    if ctx.fused_gdn_retained:
        # retained on the fused kernels: its backward transient, FLA's or its fused MLP's
        # (gdn_kernel_terms)
        return gdn_kernel_terms.fused_gdn_layer_per_row(ctx.table, ctx.widths_r, ctx.geometry.gdn,
                                                        part="backward"), False
    if ctx.fused_gdn_point:
        # recomputed on the fused kernels: its largest point (gdn_kernel_terms)
        return gdn_kernel_terms.fused_gdn_point_per_row(ctx.table, ctx.widths_r, ctx.geometry.gdn), False
    if ctx.gdn_backward_point:
        g = ctx.geometry
        return gdn_terms.full_gdn_dense_point_per_row(
            ctx.widths_r, g.gdn, tp=ctx.tp, sp_div=ctx.sp_div,
            rope_per_row=rope_cache_per_row(g, g.layers)), True
    return fitted_stage(ctx, layer), False


def retained(ctx: LayerContext, index: int, layer: LayerSpec, *, extra: float,
             moe_extra: float) -> tuple[float, float]:
    """The layer's retained activations per row (no structural forward peak of its own);
    under full recompute what a multi-layer chunk re-materialises."""
    if ctx.fused_gdn_retained:
        # what FLA's and the fused kernels keep, and the layer's own forward peak (gdn_kernel_terms)
        kw = dict(table=ctx.table, widths=ctx.widths_r, gdn=ctx.geometry.gdn)
        return (gdn_kernel_terms.fused_gdn_layer_per_row(**kw) + extra,
                gdn_kernel_terms.fused_gdn_layer_per_row(**kw, part="forward") + extra)
    if ctx.retained_by == RetainedBy.STRUCTURAL:
        # by what it holds: its hidden-wide inputs and the chunked kernel's per-head tensors
        kept = gdn_terms.tp_retained_gdn_layer_per_row(ctx.widths_r, ctx.geometry.gdn, tp=ctx.tp,
                                                       sp_div=ctx.sp_div)
        return (kept + extra if extra else kept), 0.0
    return fitted_retained(ctx, layer, extra=extra), 0.0


def residual_covered(ctx: LayerContext, layer: LayerSpec) -> bool:
    """Whether the structural layout terms cover the layer: priced by what it holds."""
    if ctx.tp == 1:
        return ctx.tp1_structural
    return ctx.retained_by == RetainedBy.STRUCTURAL
