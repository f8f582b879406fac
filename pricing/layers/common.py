"""The pieces several layer kinds share: the fitted stage sum's parts, the TP1-fitted retained
layer, the recomputed attention layer's norm point and what a retained SP layer holds less
than its structural term (docs/memory-model.md#workspace, #retained-activations).
"""

from __future__ import annotations

from .. import gdn_terms, layout_terms, terms
from ..geometry import LayerSpec, MixerKind
from ..parallel import RecomputeMode
from ..pipeline import rope_cache_per_row
from .context import LayerContext, RetainedBy, charged_unsharded, keeps_core, table_discount


def attention_mixer(ctx: LayerContext, stage: float) -> float:
    """An attention mixer's stage per row (`stage`: fused-QKV or multi-latent) with its q/k
    norms, less what ring attention releases under full recompute."""
    return stage + (ctx.qk_norm_per_row - (ctx.cp_release_per_row if ctx.full else 0.0))


def fused_attention_mixer(ctx: LayerContext) -> float:
    """The TP1-fitted attention stage per row (`terms.mixer_stage_per_row`) as an attention
    mixer (`attention_mixer`)."""
    return attention_mixer(ctx, terms.mixer_stage_per_row(ctx.table, ctx.widths, MixerKind.ATTENTION))


def mlp_stage(ctx: LayerContext, layer: LayerSpec) -> float:
    """The layer's MLP stage per row (`terms.mlp_stage_per_row`): dense, or the MoE layer's
    routed experts at the busiest EP rank's load and its shared expert."""
    return terms.mlp_stage_per_row(ctx.table, ctx.widths, layer.mlp, ep_skew=ctx.ep_skew,
                                   local_experts=ctx.local_experts,
                                   etp=ctx.etp if ctx.sp_div > 1 else 1, sp_div=ctx.sp_div)


def norms(ctx: LayerContext) -> float:
    """The norms' gathered input and the residual and norm shards per row."""
    return terms.norm_and_residual_per_row(ctx.table, ctx.widths, sp_div=ctx.sp_div)


def norm_point(ctx: LayerContext, layer: LayerSpec) -> float:
    """A recomputed attention layer's input-norm backward with replicated norms (TP without
    SP; `layout_terms.layer_norm_point_per_row`, 0 where it does not apply)."""
    return layout_terms.layer_norm_point_per_row(
        ctx.table, ctx.widths, rope_per_row=rope_cache_per_row(ctx.geometry, [layer]),
        replicated=ctx.tp > 1 and ctx.sp_div == 1)


def fitted_retained(ctx: LayerContext, layer: LayerSpec, *, extra: float) -> float:
    """The TP1-fitted retained layer per row (`terms.retained_layer_per_row`; unsharded where
    `charged_unsharded`), an attention layer's q/k norms less what ring attention releases
    without recompute, the gated attention's undiscounted core under selective recompute, plus
    the features' `extra`. Under full recompute: what a multi-layer chunk re-materialises."""
    t, mode = ctx.table, ctx.mode
    kept = terms.retained_layer_per_row(
        t, ctx.widths_r, layer.mixer, layer.mlp,
        sp_div=1 if charged_unsharded(ctx, layer) else ctx.sp_div,
        selective=mode == RecomputeMode.SELECTIVE, ep_skew=ctx.ep_skew)
    if layer.mixer == MixerKind.ATTENTION:
        kept += ctx.qk_norm_per_row - (ctx.cp_release_per_row if mode == RecomputeMode.NONE else 0.0)
    if keeps_core(ctx, layer) and mode == RecomputeMode.SELECTIVE:
        # selective recompute frees nothing of a gated attention layer (`keeps_core`)
        kept += table_discount(t, ctx.widths)
    if extra:
        kept += extra
    return kept


def sp_layer_release(ctx: LayerContext, layer: LayerSpec) -> float:
    """What a retained attention layer under TP with SP holds less than its structural term
    per row: without recompute what ring attention releases, with selective recompute the
    core-attention discount (none where the layer keeps its core); less the output gate's
    fp32 sigmoid a gated attention layer keeps beside the structural GDN terms
    (docs/memory-model.md#gdn-sp-retained)."""
    less = (ctx.cp_release_per_row if ctx.mode == RecomputeMode.NONE else
            0.0 if keeps_core(ctx, layer) else table_discount(ctx.table, ctx.widths))
    if ctx.retained_by == RetainedBy.STRUCTURAL and keeps_core(ctx, layer):
        less -= gdn_terms.output_gate_per_row(ctx.widths)
    return less
