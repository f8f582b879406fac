"""A multi-latent attention layer (dense or MoE MLP): its mixer's stage by its true widths with
its norms' fp32 inputs, the rest as the attention layer with that MLP prices it
(docs/memory-model.md#family-features); with the fused kernels (te-gpu) at TP1 CP1, a layer with
a dense MLP by what the kernels keep and hold at its points (docs/memory-model.md#mla-kernel-models),
a retained layer with a MoE MLP (EP1) by MLA's and the retained MoE layer's kernel terms composed
(docs/memory-model.md#mla-moe-kernel-models).
"""

from __future__ import annotations

from .. import feature_terms, layout_terms, terms
from ..coefficients import CoefficientTable
from ..geometry import LayerSpec, MlpKind
from . import attention_dense, attention_moe
from .common import attention_mixer
from .context import LayerContext

ENTRY = "fused_mla_layer"


def mixer(ctx: LayerContext) -> float:
    """The MLA stage per row (`feature_terms.mla_stage_per_row`) with its norms' inputs, as an
    attention mixer."""
    return attention_mixer(ctx, feature_terms.mla_stage_per_row(ctx.geometry.attention, tp=ctx.tp)
                           + terms.mla_norm_inputs_per_row(ctx.table, ctx.widths, sp_div=ctx.sp_div))


def _with_mlp(layer: LayerSpec):
    return attention_dense if layer.mlp == MlpKind.DENSE else attention_moe


def on_kernels(ctx: LayerContext, layer: LayerSpec) -> bool:
    """Whether the layer is priced by the fused kernels' MLA terms (`LayerContext.fused_mla`:
    a dense MLP, or a MoE MLP retained on the kernel models, `fused_moe_retained`)."""
    return ctx.fused_mla and (layer.mlp == MlpKind.DENSE or ctx.fused_moe_retained)


def mla_widths(ctx: LayerContext) -> dict:
    """`ctx.widths_r` with multi-latent attention's own widths on the rank: `qk` heads x
    qk_head_dim, `core` heads x v_head_dim (already), `heads`, `qk_acc` heads x flash-attn's
    rounded head (its dq accumulator's width), `latent` the q and kv latent ranks, `rope` the
    rope head width. O(1)."""
    # the one place it is written; lazy, as pricing.fsdp imports the layers
    from ..fsdp.terms import flash_head_rounded

    att = ctx.geometry.attention
    mla = att.mla
    heads = att.num_heads / ctx.tp
    return dict(ctx.widths_r, qk=heads * mla.qk_head_dim, heads=heads,
                qk_acc=heads * flash_head_rounded(mla.qk_head_dim),
                latent=float(mla.q_lora_rank + mla.kv_lora_rank), rope=float(mla.qk_rope_head_dim))


def kernel_layer_per_row(table: CoefficientTable, widths: dict, *, point: str) -> float:
    """A dense-MLP MLA layer on the fused kernels (TP1 CP1), bytes per row.

    Formula: entry `fused_mla_layer` x `mla_widths`: `attention` (what the attention saves: q and
    k 4 qk, v and the output 4 core, the fp32 log-sum-exp 4 heads, the latent norms' inputs and
    outputs 4 latent, the unfused RoPE's cos and sin 8 rope) + by `point`:
    "retained" `per_row` (6F + 14 rank + 8H); "forward" the larger of `fc1_point` and `fc2_point`
    (the recomputed FC1's or FC2's forward); "recomputed" the larger of those and `attn_point` +
    `attention_backward` (flash's dq, dk, dv, output gradient, fp32 dq_accum and softmax_d);
    "backward" (a retained layer's transient, without `attention`) the larger of the MLP's
    (`fused_retained_layer` backward_per_row + backward_replicated, fc2_backward) and
    `attention_backward` + `retained_attention_backward`. See
    docs/memory-model.md#mla-kernel-models. O(1).
    """
    def part(key: str, entry: str = ENTRY) -> float:
        return table.per_row(entry, widths, key=key)

    flash = part("attention_backward")
    if point == "backward":
        mlp = (part("backward_per_row", layout_terms.FUSED_RETAINED)
               + part("backward_replicated", layout_terms.FUSED_RETAINED))
        return max(mlp, part("fc2_backward", layout_terms.FUSED_RETAINED),
                   flash + part("retained_attention_backward"))
    saved = part("attention")
    if point == "retained":
        return saved + part("per_row")
    forward = max(part("fc1_point"), part("fc2_point"))
    if point == "forward":
        return saved + forward
    return saved + max(forward, part("attn_point") + flash)


def moe_kernel_layer_per_row(ctx: LayerContext, widths: dict, *, point: str) -> float:
    """A retained MLA layer with a MoE MLP on the fused kernels (TP1 CP1 EP1), bytes per row.

    Formula: the retained plain-attention MoE layer with its attention swapped for MLA's:
    "retained" `fused_retained_moe_layer_per_row` + (`kernel_layer_per_row` "retained" -
    `fused_retained_layer_per_row`: MLA's kept tensors and adapters in place of the plain
    attention's, the dense MLP's 6F + 4 rank cancelling) + the shared expert's
    `fused_moe_shared_expert_per_row` "retained"; "forward" that + the MoE forward point's additions
    (the experts' output, the combine's copy, the dispatcher's permuted copy) + the shared expert's
    "forward"; "backward" (without the kept tensors) the larger of the experts'
    (`fused_moe_experts_backward_per_row`), the shared expert's "backward" and MLA's
    (`attention_backward` + `retained_attention_backward`). `routed`: top_k x the busiest
    rank's load. See docs/memory-model.md#mla-moe-kernel-models. O(1).
    """
    t = ctx.table
    routed = ctx.geometry.moe.top_k * ctx.ep_skew

    def shared(at: str) -> float:
        return layout_terms.fused_moe_shared_expert_per_row(t, widths, routed=routed, point=at)

    if point == "backward":
        return max(layout_terms.fused_moe_experts_backward_per_row(t, widths, routed=routed),
                   t.per_row(ENTRY, widths, key="attention_backward")
                   + t.per_row(ENTRY, widths, key="retained_attention_backward"),
                   shared("backward"))
    moe_kept = layout_terms.fused_retained_moe_layer_per_row(t, widths, routed=routed)
    kept = (moe_kept + kernel_layer_per_row(t, widths, point="retained")
            - layout_terms.fused_retained_layer_per_row(t, widths, tp=1, sequence_parallel=False)
            + shared("retained"))
    if point == "retained":
        return kept
    forward = layout_terms.fused_retained_moe_layer_per_row(t, widths, routed=routed, forward=True)
    return kept + forward - moe_kept + shared("forward")


def stage(ctx: LayerContext, layer: LayerSpec) -> tuple[float, bool]:
    """The layer's stage workspace per row, and whether it is a structural point."""
    if on_kernels(ctx, layer) and layer.mlp == MlpKind.MOE:
        # a retained layer's backward transient: the experts', the shared expert's or MLA's
        return moe_kernel_layer_per_row(ctx, mla_widths(ctx), point="backward"), False
    if on_kernels(ctx, layer):
        # recomputed at its largest point, or a retained layer's backward transient
        point = "recomputed" if ctx.full else "backward"
        return kernel_layer_per_row(ctx.table, mla_widths(ctx), point=point), False
    return _with_mlp(layer).stage(ctx, layer, mixer=mixer(ctx))


def retained(ctx: LayerContext, index: int, layer: LayerSpec, *, extra: float,
             moe_extra: float) -> tuple[float, float]:
    """The layer's retained activations per row and its own structural forward peak."""
    if on_kernels(ctx, layer) and layer.mlp == MlpKind.MOE:
        # beside its forward point at TP1 the combine's all-to-all output (`moe_extra`), as the
        # plain-attention MoE layer's
        widths = mla_widths(ctx)
        kept = moe_kernel_layer_per_row(ctx, widths, point="retained")
        forward = moe_kernel_layer_per_row(ctx, widths, point="forward")
        return kept + extra, forward + extra + moe_extra
    if on_kernels(ctx, layer):
        widths = mla_widths(ctx)
        kept = kernel_layer_per_row(ctx.table, widths, point="retained")
        forward = kernel_layer_per_row(ctx.table, widths, point="forward")
        return kept + extra, max(kept, forward) + extra
    return _with_mlp(layer).retained(ctx, index, layer, extra=extra, moe_extra=moe_extra)


def residual_covered(ctx: LayerContext, layer: LayerSpec) -> bool:
    """Whether the structural layout terms cover the layer."""
    return _with_mlp(layer).residual_covered(ctx, layer)
