"""A multi-latent attention layer (dense or MoE MLP): its mixer's stage by its true widths with
its norms' fp32 inputs, the rest as the attention layer with that MLP prices it
(docs/memory-model.md#family-features).
"""

from __future__ import annotations

from .. import feature_terms, terms
from ..geometry import LayerSpec, MlpKind
from . import attention_dense, attention_moe
from .common import attention_mixer
from .context import LayerContext


def mixer(ctx: LayerContext) -> float:
    """The MLA stage per row (`feature_terms.mla_stage_per_row`) with its norms' inputs, as an
    attention mixer."""
    return attention_mixer(ctx, feature_terms.mla_stage_per_row(ctx.geometry.attention, tp=ctx.tp)
                           + terms.mla_norm_inputs_per_row(ctx.table, ctx.widths, sp_div=ctx.sp_div))


def _with_mlp(layer: LayerSpec):
    return attention_dense if layer.mlp == MlpKind.DENSE else attention_moe


def stage(ctx: LayerContext, layer: LayerSpec) -> tuple[float, bool]:
    """The layer's stage workspace per row, and whether it is a structural point."""
    return _with_mlp(layer).stage(ctx, layer, mixer=mixer(ctx))


def retained(ctx: LayerContext, index: int, layer: LayerSpec, *, extra: float,
             moe_extra: float) -> tuple[float, float]:
    """The layer's retained activations per row and its own structural forward peak."""
    return _with_mlp(layer).retained(ctx, index, layer, extra=extra, moe_extra=moe_extra)


def residual_covered(ctx: LayerContext, layer: LayerSpec) -> bool:
    """Whether the structural layout terms cover the layer."""
    return _with_mlp(layer).residual_covered(ctx, layer)
