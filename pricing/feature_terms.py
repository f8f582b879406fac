"""Pricing terms of the model-family features (`geometry.ModelFeatures`, `geometry.MlaSpec`):
docs/memory-model.md#family-features.

Each term is the bytes per row (per routed row for experts) of the extra tensors one feature
creates, on top of the baseline terms (`pricing.terms`); `pricing.model` adds them to the
recomputed layer's workspace, the no-grad forward transient and a retained layer's activations,
and the head terms to the head. Widths are per rank (`pricing.model.layer_widths`); the extra
tensors shard like the tensors they come from. Every term charges the feature's tensors at their
full size, so an estimate does not fall under what the feature adds; `feature_gaps` names the
features outside the traced evidence (basis "conservative", `pricing.coverage.assess`).

Features that add no memory (no term, no gap): sliding windows (flash attention keeps O(rows)
whatever the window); biases (fused in the GEMM, or an out-of-place copy that replaces the GEMM
output at once: `megatron_build._install_expert_bias_fix`); GeGLU (the tanh GELU saves its input,
as SiLU does); tied embeddings; embedding scaling (one [rows, H] copy under the first layer's own
forward transient); leading dense layers of a MoE model (the dense-MLP terms) and shared experts
(the baseline `moe_shared_expert`).
"""

from __future__ import annotations

from .geometry import AttentionSpec, MixerKind, MlpActivation, MlpKind, ModelGeometry, RouterScore

BF16, FP32 = 2, 4


def attention_sinks_per_row(widths: dict, heads_per_rank: float) -> float:
    """Attention sinks (gpt-oss): a learned logit z per head joins each row's softmax.

    Formula: bf16 x core + fp32 x heads per row: the flash stand-in's rescaled copy of the core
    output (sigmoid(lse - z)) and the per-head gate; a fused kernel holds neither, so this bounds
    it. See docs/memory-model.md#family-features.
    """
    return BF16 * widths["core"] + FP32 * heads_per_rank


def mla_stage_per_row(attention: AttentionSpec, *, tp: int) -> float:
    """A recomputed multi-latent-attention layer's attention stage (DeepSeek V2/V3), by its
    true widths, in place of the fused-QKV `attention_stage` (MLA's up projections' outputs are
    split, rotated and released, not kept as one fused output).

    Terms, per row and rank (h = num_heads / TP, dqk = qk_nope + qk_rope, dv = v_head_dim): queries
    and keys (bf16 x h x dqk each), values and output at the CPU flash stand-in's padded width
    (bf16 x h x dqk each) and the output's contiguous copy (bf16 x h x dv), the latent norms' fp32
    inputs and bf16 outputs, replicated over TP ((fp32 + bf16) x (q_lora_rank + kv_lora_rank)).

    Formula: bf16 x h x (4 dqk + dv) + 6 x (q_lora_rank + kv_lora_rank); on a GPU the padding and
    the copy are not held (conservative). See docs/memory-model.md#family-features.
    """
    mla = attention.mla
    heads = attention.num_heads / tp
    return (BF16 * heads * (4 * mla.qk_head_dim + mla.v_head_dim)
            + (FP32 + BF16) * (mla.q_lora_rank + mla.kv_lora_rank))


def sandwich_norms_per_row(widths: dict, *, sp_div: int) -> float:
    """Sandwich norms (Gemma 2, 3): a norm after attention and one after the MLP as well.

    Formula: 2 x (fp32 + bf16) x H / sp_div per row: each keeps its fp32 input for backward (a plain
    torch RMSNorm) and writes a bf16 output; a fused norm keeps only the bf16 input. See
    docs/memory-model.md#family-features.
    """
    return 2 * (FP32 + BF16) * widths["H"] / sp_div


def post_norms_per_row(widths: dict, *, sp_div: int) -> float:
    """OLMo 2's norms on the attention and MLP outputs (`post_attention_layernorm`,
    `post_feedforward_layernorm`), priced as the two extra norms Gemma's sandwich norms
    measure: 2 x (fp32 + bf16) x H per row. The pre-norms they replace stay charged by the
    baseline terms, so this counts the layer's norms twice. Conservative: no trace.
    See docs/memory-model.md#family-features.
    """
    return sandwich_norms_per_row(widths, sp_div=sp_div)


def residual_scale_per_row(widths: dict, *, sp_div: int) -> float:
    """Granite's `residual_multiplier`: the attention and MLP outputs are scaled before each
    residual add, each a new bf16 [rows, H] tensor beside the unscaled one until the add.

    Formula: 2 x bf16 x H / sp_div per row, charged as held. Conservative: no trace. See
    docs/memory-model.md#family-features.
    """
    return 2 * BF16 * widths["H"] / sp_div


def shared_expert_gate_per_row(widths: dict) -> float:
    """Qwen2-MoE's gated shared expert (sigmoid(gate(x)) x shared_expert(x)): the shared
    expert's output, kept for the product's backward, and the gated product, bf16 [rows, H]
    each, full width (before the TP reduction), and the fp32 gate logit and sigmoid per row:
    2 x bf16 x H + 2 x fp32. Conservative (docs/support-matrix.md#model-families)."""
    return 2 * BF16 * widths["H"] + 2 * FP32


def scales_logits(features) -> bool:
    """Whether the head makes one more [rows, vocab] tensor from the logits (a tanh soft-cap,
    Gemma 2; a division by `logits_scaling`, Granite), priced by `final_softcap_per_row` and
    `final_softcap_chunk_per_row`."""
    return bool(features.final_softcap) or features.logit_scale


def activation_per_ffn_row(activation: MlpActivation) -> float:
    """Extra bytes per F-wide unit of one gated MLP's activation, beyond SwiGLU's.

    Formula: clamped SwiGLU (gpt-oss: the clamped gate and up, two more bf16 F-wide tensors kept for
    backward) 2 x bf16; GeGLU and SwiGLU 0 (the tanh GELU saves its input as SiLU does). See
    docs/memory-model.md#family-features.
    """
    if activation == MlpActivation.CLAMPED_SWIGLU:
        return 2 * BF16
    return 0.0


def router_per_row(widths: dict, features) -> float:
    """Routers beyond a plain softmax top-k (DeepSeek-V3: sigmoid scores, top-k within the best
    groups, a selection bias).

    Formula: 2 x fp32 x experts per row (the biased selection scores and the group-masked scores);
    0 for a softmax router. A router bias adds nothing at the peak. Conservative: no trace. See
    docs/memory-model.md#family-features.
    """
    extra = 0.0
    if features.router_score != RouterScore.SOFTMAX or features.router_groups > 1:
        extra += 2 * FP32 * widths["experts"]
    return extra


def attention_extra_per_row(geometry: ModelGeometry, widths: dict, *, tp: int) -> float:
    """All feature terms of one attention layer's mixer (per gathered row)."""
    f, att = geometry.features, geometry.attention
    extra = 0.0
    if f.attention_sinks:
        extra += attention_sinks_per_row(widths, att.num_heads / tp)
    return extra


def mlp_extra_per_row(geometry: ModelGeometry, widths: dict, mlp: MlpKind, *, ep_skew: float) -> float:
    """All feature terms of one layer's MLP (dense: F-wide; MoE: per routed row x top-k x EP
    skew for the experts, plus the shared expert and the router per row)."""
    f = geometry.features
    act = activation_per_ffn_row(f.mlp_activation)
    if mlp == MlpKind.DENSE:
        return act * widths["F"]
    routed = act * widths["expert_ffn"]
    shared = act * widths["shared_ffn"]
    if f.shared_expert_gate and widths["shared_ffn"]:
        shared += shared_expert_gate_per_row(widths)
    return widths["top_k"] * ep_skew * routed + shared + router_per_row(widths, f)


def layer_extra_per_row(geometry: ModelGeometry, widths: dict, layer, *, tp: int, sp_div: int,
                        ep_skew: float) -> float:
    """One decoder layer's feature terms (0.0 for the baseline families)."""
    extra = 0.0
    if layer.mixer == MixerKind.ATTENTION:
        extra += attention_extra_per_row(geometry, widths, tp=tp)
    extra += mlp_extra_per_row(geometry, widths, layer.mlp, ep_skew=ep_skew)
    if geometry.features.sandwich_norms:
        extra += sandwich_norms_per_row(widths, sp_div=sp_div)
    if geometry.features.post_norms:
        extra += post_norms_per_row(widths, sp_div=sp_div)
    if geometry.features.residual_scale:
        extra += residual_scale_per_row(widths, sp_div=sp_div)
    return extra


def final_softcap_per_row(widths: dict) -> tuple[float, float]:
    """(retained, transient) bytes per row of final-logit soft-capping (Gemma 2:
    cap x tanh(logits / cap)) on a full-logits head.

    Formula: (bf16 x vocab/TP, 0): the tanh output kept for backward beside the capped logits; the
    scaled logits and the gradients through the scale and the tanh stay below the loss's own peak.
    See docs/memory-model.md#family-features.
    """
    return BF16 * widths["vocab"], 0.0


def final_softcap_chunk_per_row(widths: dict) -> float:
    """Final-logit soft-capping in a chunked head: the tanh output and the scaled logits of the
    chunk, 2 x bf16 x vocab/TP per chunk row. Conservative (the chunked head is not traced); see
    docs/memory-model.md#family-features.
    """
    return 2 * BF16 * widths["vocab"]


def feature_gaps(geometry: ModelGeometry) -> list[str]:
    """Why a geometry's features lie outside the traced evidence (empty for the baseline)."""
    f, att = geometry.features, geometry.attention
    gaps = []
    if att is not None and att.mla is not None:
        gaps.append("multi-latent attention (its stage priced by true widths as cpu-fake traces "
                    "hold it; DeepSeek's cpu-fake cells 0.9-1.6% over the torch-cpu table; no GPU "
                    "trace)")
    if f.attention_softcap:
        gaps.append("attention logit soft-capping (priced as flash attention's in-kernel cap; an "
                    "unfused attention's [heads, s, s] scores are not priced)")
    if f.mlp_activation == MlpActivation.CLAMPED_SWIGLU:
        gaps.append("clamped-swiglu MoE (gpt-oss; traced on cpu-fake with its biases and sinks: "
                    "cells 1.0-4.6% over the torch-cpu table; no GPU trace)")
    if geometry.moe is not None and (f.router_score != RouterScore.SOFTMAX or f.router_groups > 1):
        gaps.append("group-limited sigmoid routing (no trace: two more fp32 score tensors charged)")
    if f.residual_scale:
        gaps.append("residual multiplier (no trace: two scaled bf16 [rows, H] copies per layer charged)")
    if f.logit_scale:
        gaps.append("logits scaling (no trace: one more bf16 [rows, vocab] charged, as a soft-cap's)")
    if f.post_norms:
        gaps.append("post-norms (no trace: charged as two extra sandwich norms per layer)")
    if f.shared_expert_gate and geometry.moe is not None and geometry.moe.shared_expert_ffn:
        gaps.append("gated shared expert (its output and the gated product charged; cpu-fake "
                    "traced above the 3% decoder target; no GPU trace)")
    if f.nope_layers:
        gaps.append(f"{f.nope_layers} NoPE layers priced as RoPE layers (an upper bound; traced "
                    "with RoPE on every layer only)")
    if f.read_as:
        gaps.append(f"model_type {f.read_as!r} read as another family by explicit opt-in "
                    "(--as-family): only that family's fields are read")
    return gaps
