"""The memory terms of a Hugging Face transformers decoder trained with PEFT LoRA under FSDP2:
bytes per row of the packed micro-batch, per (row x attention row) for the packed-row masks and
eager scores, and the constant bytes of gathered parameters and gradient-reduce buffers.

Every term counts the tensors transformers' modeling code (llama, qwen2, qwen3, mistral and
the families priced on their basis), PEFT's LoRA layers, torch's CPU SDPA kernel and FSDP2 keep
at a point of the schedule; flash_attention_2's are read from flash-attn's varlen kernels.
Each formula's tensors are listed in docs/memory-model.md#fsdp2-with-hugging-face-transformers
(anchors: #fsdp-layer, #fsdp-head, #fsdp-constants, #fsdp-attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import entries
from ..geometry import MlpKind, ModelGeometry

BF16 = 2
FP32 = 4
INT64 = 8
# flash-attn 2's varlen backward pads each sequence's accumulator rows by 128
# (`mha_varlen_bwd`: dq_accum [total_q + 128 x batch, heads, head_dim_rounded] in fp32)
FLASH_ROW_PAD = 128


@dataclass(frozen=True)
class Widths:
    """The widths the terms multiply (one rank: FSDP shards no activation)."""

    H: float    # hidden
    F: float    # MLP width (dense), or top_k x expert width (MoE: a routed row's bound)
    Q: float    # query width: heads x head_dim
    KV: float   # key (= value) width: kv heads x head_dim
    nh: float   # query heads
    hd: float   # head dim
    V: float    # vocabulary
    r: float    # LoRA rank
    experts: float  # routed experts (0: dense)
    top_k: float = 0.0  # experts per routed row (0: dense)


def widths(geometry: ModelGeometry, rank: int) -> Widths:
    """The widths of `geometry` with LoRA rank `rank`. O(1)."""
    att = geometry.attention
    moe = geometry.moe
    f = geometry.ffn
    if moe is not None:
        f = max(f, moe.top_k * moe.expert_ffn + moe.shared_expert_ffn)
    return Widths(H=geometry.hidden, F=f, Q=att.num_heads * att.head_dim,
                  KV=att.num_kv_groups * att.head_dim, nh=att.num_heads, hd=att.head_dim,
                  V=geometry.vocab, r=rank, experts=moe.num_experts if moe else 0.0,
                  top_k=moe.top_k if moe else 0.0)


def layer_retained_per_row(w: Widths, *, checkpointing: bool, qk_norm: bool, attn: str) -> float:
    """What one decoder layer's forward keeps for its backward, per row (#fsdp-layer).

    Checkpointing: the layer's input hidden states (bf16). Without: every tensor autograd
    saves in the layer: the two RMSNorms' fp32 input copies (2 x 4H) and outputs (2 x 2H), the
    rotated query and key (2Q + 2KV) and the value (2KV), the attention output (the output
    projection's input, 2Q) and its fp32 log-sum-exp (4 nh), gate and up outputs, SiLU and
    product (4 x 2F), and the seven LoRA adapters' A outputs (7 x 2r) with the norms' fp32
    rsqrt (8); qk-norm adds the fp32 copies of q and k its norms keep (4Q + 4KV); eager keeps
    the key and value repeated to every query head (4Q) in place of the rotated key and the value
    (4KV), but for one key/value head, whose repeat is a view (set 7's qwen3_moe anatomy).
    Docs: docs/memory-model.md#fsdp-layer."""
    if checkpointing:
        return BF16 * w.H
    out = 8 * w.F + 12 * w.H + 4 * w.Q + 4 * w.KV + 14 * w.r + FP32 * w.nh + 8
    if qk_norm:
        out += 4 * w.Q + 4 * w.KV
    if attn == "eager" and w.KV > w.hd:
        out += 4 * w.Q - 4 * w.KV
    if w.experts:
        out += moe_per_row(w)
    return out


def layer_forward_per_row(w: Widths, *, qk_norm: bool) -> tuple[float, float]:
    """A layer's forward transient above what it keeps, per row (#fsdp-layer): the larger of the
    MLP's (norm copies 8H, gate, up, SiLU and product 8F, LoRA A outputs 6r, output 2H) and the
    attention's (norm copies 8H, q/k/v and rotated copies 4Q + 6KV, output and LSE 2Q + 4nh,
    projection 2H; qk-norm 6Q + 6KV), as (MLP, attention). Docs: docs/memory-model.md#fsdp-layer."""
    mlp = 10 * w.H + 8 * w.F + 6 * w.r + (moe_per_row(w) if w.experts else 0.0)
    att = 10 * w.H + 6 * w.Q + 6 * w.KV + FP32 * w.nh + 6 * w.r
    if qk_norm:
        att += 6 * w.Q + 6 * w.KV
    return mlp, att


def layer_backward_per_row(w: Widths, *, checkpointing: bool, qk_norm: bool,
                           attn: str) -> tuple[float, float]:
    """A layer's backward workspace per row beside its own input gradient (#fsdp-layer): with
    checkpointing the recomputed layer's saved tensors plus the gradients in flight, at the
    larger of the MLP's backward (12F + 12H + 4Q + 4KV + 12r + 4nh; qk-norm's fp32 copies and
    rsqrt 4Q + 4KV + 4 heads) and the attention's
    (8H + 8Q + 4KV + 8nh + 12r; eager 6H + 6Q + 8r + 4nh; qk-norm 6Q + 6KV, eager's 4Q + 4KV + 4
    heads); without, the gradients in flight only (the saved tensors are in
    `layer_retained_per_row`): the MLP's 6F + 6H + 6r or the attention's 6Q + 6KV + 4H + 4nh +
    6r. flash_attention_2's attention branch is `flash_attention_backward_per_row`.
    Returns (MLP, attention): the S x S terms sit at the attention's point only. Docs: docs/memory-model.md#fsdp-layer."""
    if checkpointing:
        mlp = 12 * w.F + 12 * w.H + 4 * w.Q + 4 * w.KV + 12 * w.r + FP32 * w.nh
        # eager: the norm's fp32 input and output, the rotated q, one repeated k/v, the scores'
        # matmul gradient (6H + 6Q), LoRA A outputs; sdpa's kernel backward adds q/k/v gradients
        if attn == "eager":
            att = 6 * w.H + 6 * w.Q + 8 * w.r + FP32 * w.nh
        else:
            att = 8 * w.H + 8 * w.Q + 4 * w.KV + 8 * w.nh + 12 * w.r
        if qk_norm:
            # eager's softmax backward: the recomputed q/k norms' fp32 inputs and rsqrt (set 4's
            # gemma3_text anatomy); sdpa's kernel backward also holds their outputs
            att += (4 * w.Q + 4 * w.KV + FP32 * (w.nh + w.KV / w.hd) if attn == "eager"
                    else 6 * w.Q + 6 * w.KV)
            # the recomputed q/k norms' fp32 inputs and rsqrt stay to the attention's backward
            # (set 10's qwen3 flash cells, bound at the MLP: 3.9% under without them)
            mlp += 4 * w.Q + 4 * w.KV + FP32 * (w.nh + w.KV / w.hd)
    else:
        mlp = 6 * w.F + 6 * w.H + 6 * w.r
        att = 6 * w.Q + 6 * w.KV + 4 * w.H + FP32 * w.nh + 6 * w.r
        if qk_norm:
            att += 4 * w.Q + 4 * w.KV
    if attn == "flash":
        att = flash_attention_backward_per_row(w, checkpointing=checkpointing, qk_norm=qk_norm)
    if w.experts:
        mlp += moe_per_row(w)
    return mlp, att


def flash_head_rounded(d: int) -> int:
    """flash-attn 2's head_size_rounded (`mha_varlen_bwd`'s dq accumulator width): d rounded up
    to a multiple of 8, then of 32 up to 192, else 256. Docs: docs/memory-model.md#fsdp-attention."""
    d8 = -(-int(d) // 8) * 8
    return -(-d8 // 32) * 32 if d8 <= 192 else 256


def flash_accumulator_width(w: Widths) -> float:
    """The fp32 dq accumulator's bytes per row: nh x head_size_rounded x 4 (4Q when the head
    dim is a multiple of 32). Docs: docs/memory-model.md#fsdp-attention."""
    return FP32 * w.nh * flash_head_rounded(int(w.hd))


def flash_backward_per_row(w: Widths) -> float:
    """What flash-attn 2's backward allocates per row (#fsdp-attention; `mha_varlen_bwd` /
    `mha_bwd`): dq, dk, dv (2Q + 4KV), the fp32 dq accumulator [total_q + 128 b, nh,
    head_size_rounded] (`flash_accumulator_width`) and softmax sums [nh, total_q + 128 b] (4nh),
    under GQA dk and dv expanded to every query head [total_k, nh, hd] (4Q); the 128 rows a
    sequence are `flash_per_sequence`. Docs: docs/memory-model.md#fsdp-attention."""
    gqa = 4 * w.Q if w.KV < w.Q else 0.0
    return 2 * w.Q + 4 * w.KV + flash_accumulator_width(w) + FP32 * w.nh + gqa


def flash_attention_backward_per_row(w: Widths, *, checkpointing: bool, qk_norm: bool) -> float:
    """The attention's backward workspace per row under flash_attention_2 (#fsdp-attention):
    `flash_backward_per_row` and the output gradient (2Q), plus, with checkpointing, what the
    recomputed attention keeps: the input norm's fp32 input and bf16 output (6H), the rotated q
    and k and the value flash-attn saves as they are (transformers' rotary output is already in
    flash's [b, s, h, d] layout: `_prepare_from_posids`' `.contiguous()` copies nothing; 2Q +
    4KV), its output and fp32 log-sum-exp (2Q + 4nh), the norm's rsqrt (4) and LoRA A outputs (6r);
    without, the residual's gradients (4H) and LoRA A outputs (6r). qk-norm adds sdpa's charge
    for its copies. Docs: docs/memory-model.md#fsdp-attention."""
    att = flash_backward_per_row(w) + 2 * w.Q + 6 * w.r
    if checkpointing:
        att += 6 * w.H + 4 * w.Q + 4 * w.KV + FP32 * w.nh + 4
        if qk_norm:
            att += 6 * w.Q + 6 * w.KV
    else:
        att += 4 * w.H
        if qk_norm:
            att += 4 * w.Q + 4 * w.KV
    return att


def flash_per_sequence(w: Widths) -> float:
    """flash-attn varlen backward's 128 accumulator rows per sequence (`total_q + 128 x batch`
    in dq_accum and softmax_d): 128 x (`flash_accumulator_width` + 4nh) bytes per packed
    sequence, at the attention's backward point only (#fsdp-flash-steps). Docs: docs/memory-model.md#fsdp-attention."""
    return 128.0 * (flash_accumulator_width(w) + FP32 * w.nh)


def flash_head_credit(w: Widths) -> float:
    """What the head's backward point holds below its charges, per row, for transformers' loss
    without Ulysses under every attention (flash's anatomy, and set 1's sdpa one: the head's peak is
    the same program; #fsdp-attention): at its peak (log_softmax's backward: its kept output, NLL's and its own
    fp32 gradients, 12V) the gradient into the last layer (2H, charged there by the walk) is not
    made yet; it is made after the fp32 gradients are freed (beside the bf16 logits' gradient,
    2V), so the credit holds while that moment and the final norm's backward (about 18H) stay
    below the peak: vocabularies of at least 2H (every released model), else 0.
    Docs: docs/memory-model.md#fsdp-flash-steps."""
    return BF16 * w.H if w.V >= 2 * w.H else 0.0


def flash_scalars(layers: int) -> float:
    """flash_attention_2's constant bytes beside a wave (#fsdp-attention): each layer's saved
    `rng_state` (int64 [2], 16 bytes; every layer's without checkpointing, a bound with it) and
    the loss and its backward's seed (fp32 scalars, 8), which the slack of sdpa's S x S terms
    covered. Docs: docs/memory-model.md#fsdp-flash-steps."""
    return 16.0 * layers + 8.0


def sandwich_backward_per_row(w: Widths, *, checkpointing: bool) -> float:
    """Gemma's post-feedforward norm with checkpointing, under flash_attention_2 or eager: its
    fp32 backward temporaries run beside the recomputed MLP's kept tensors before the MLP's
    gradients are in flight, a moment sdpa's S x S attention point covers (#fsdp-attention,
    #fsdp-families). 6H per row, fitted: set 10's gemma2 flash cells needed 4.5H.
    Docs: docs/memory-model.md#fsdp-attention."""
    return 6 * w.H if checkpointing else 0.0


def flash_fused_qkv_per_row(w: Widths, *, checkpointing: bool,
                            packed: bool = False) -> tuple[float, float]:
    """(kept per layer, at a layer's backward) per row for a fused q/k/v projection (phi3) under
    flash_attention_2 (#fsdp-attention): on a one-sequence row transformers hands flash-attn the
    value as a strided view of the fused output, which flash-attn saves, keeping the whole
    output (2Q + 2KV above the value), none on packed rows (`packed`: varlen copies the value);
    without checkpointing less the three LoRA A outputs `layer_retained_per_row` counts that
    phi3's four adapters (fused qkv and gate_up) do not make (6r; set 24's anatomy); with
    checkpointing 4Q + 4KV at the backward points, fitted: set 10's and set 15's one-sequence
    phi3 cells needed 728 bytes a row (4Q + 4KV = 768) once flash's accumulator rows left the
    MLP's point. Docs: docs/memory-model.md#fsdp-flash-steps."""
    if checkpointing:
        return 0.0, 4 * w.Q + 4 * w.KV
    return (0.0 if packed else 2 * w.Q + 2 * w.KV) - 6 * w.r, 0.0


def sandwich_mlp_backward_per_row(w: Widths, *, checkpointing: bool) -> float:
    """Gemma's post-feedforward norm with checkpointing under flash_attention_2 or eager: what its
    fp32 backward holds at the MLP's backward point above the MLP's charge, per row. Formula:
    max(0, 20H - 4F): its fp32 products and temporaries (20H above its kept input) run beside the
    recomputed MLP's kept tensors (8F) before the MLP's gradients (4F more, in the MLP's charge)
    exist (anatomies of sets 8, 15, 24 and 27). Docs: docs/memory-model.md#fsdp-own-shard."""
    return max(0.0, 20 * w.H - 4 * w.F) if checkpointing else 0.0


def flash_sandwich_mlp_per_row(w: Widths, *, checkpointing: bool) -> float:
    """Gemma's post-feedforward norm under flash_attention_2 with checkpointing: what its fp32
    backward holds at the MLP's backward point above `sandwich_backward_per_row` (negative:
    less), per row. Formula: max(0, 20H - 4F) - 6H. Its backward is the MLP's first: its fp32
    products and temporaries (20H above its kept input, anatomies of sets 15, 24 and 27) run
    beside the recomputed MLP's kept tensors (8F) before the MLP's gradients (4F more, which
    the MLP's charge counts) exist, and are freed before those gradients are made; so the
    point holds the larger of the two moments: 20H - 4F above the MLP's charge, or nothing
    (set 27's gemma2, F = 4H: its peak at that norm's backward, 4H above the MLP's charge).
    Docs: docs/memory-model.md#fsdp-flash-steps."""
    return (sandwich_mlp_backward_per_row(w, checkpointing=True)
            - sandwich_backward_per_row(w, checkpointing=True)) if checkpointing else 0.0


def moe_per_row(w: Widths) -> float:
    """A routed row's extra tensors in a transformers MoE block, a bound (no trace): the router's
    fp32 logits, probabilities and their gradient (12 x experts) and each routed copy's gathered
    input and weighted output in bf16 (4 x top_k x H). Docs: docs/memory-model.md#fsdp2-with-hugging-face-transformers."""
    return 3 * FP32 * w.experts + 4 * w.top_k * w.H


def moe_recompute_per_row(w: Widths, *, fp32_weights: bool = False) -> float:
    """A routed row's tensors at a checkpointed MoE layer's recompute point (#fsdp-moe-points),
    transformers' grouped-mm experts as the recompute stops after their last saved tensor and
    the backward starts: the gathered input and the down projection's output (bf16, 4 x top_k
    x H), the weighted output's gradient and its un-permuting scatter (zeros and result; 6 x
    top_k x H in bf16, 12 x top_k x H where the routing weights stay fp32, as Mixtral's:
    `fp32_weights`), the gate-up output, the activation and the product (8F), the router's
    fp32 tensors (12 x experts) and the sort's int64 indices (48 x top_k); in place of
    `moe_per_row` and the MLP's 12F at that point. Docs: docs/memory-model.md#fsdp-moe-points."""
    out_grads = (3 * FP32 if fp32_weights else 3 * BF16) * w.top_k * w.H
    return 4 * w.top_k * w.H + out_grads + 8 * w.F + 3 * FP32 * w.experts + 6 * INT64 * w.top_k


def moe_backward_per_row(w: Widths, *, fp32_weights: bool = False) -> float:
    """A routed row's tensors at a checkpointed MoE layer's MLP backward point (#fsdp-moe-points):
    the down stack's gradient made beside its input gradient, the product's gradient (2F). By
    then the weighted output's gradient and its scatter (`moe_recompute_per_row`'s 6 x top_k x H,
    12 x top_k x H with fp32 routing weights) are freed, and the down projection's output gave
    way to its gradient (2 x top_k x H each); the gate-up stack's later moment holds 4F less.
    Docs: docs/memory-model.md#fsdp-moe-points."""
    out_grads = (3 * FP32 if fp32_weights else 3 * BF16) * w.top_k * w.H
    return moe_recompute_per_row(w, fp32_weights=fp32_weights) - out_grads + 2 * w.F


def moe_kept_backward_per_row(w: Widths, *, fp32_weights: bool = False) -> tuple[float, float]:
    """A routed row's backward tensors at a MoE layer's MLP backward without checkpointing,
    beside what the layer keeps, at its two moments (#fsdp-moe-points): (first, the weighted
    output's gradient and its un-permuting scatter, 6 x top_k x H bf16, 12 x top_k x H with fp32
    routing weights; then the down stack's, the product's gradient, 2F, the down projection's
    output given way to its gradient), each with the router's fp32 gradients (12 x experts);
    the gate-up stack's moment holds 6F less than the down stack's.
    Docs: docs/memory-model.md#fsdp-moe-points."""
    out_grads = (3 * FP32 if fp32_weights else 3 * BF16) * w.top_k * w.H
    router = 3 * FP32 * w.experts
    return out_grads + router, 2 * w.F + router


def recompute_repeated_kv_per_row(w: Widths, *, attn: str) -> float:
    """What a recomputed attention keeps above the MLP backward terms' 4KV under GQA, per row
    (#fsdp-moe-points): k and v repeated to every query head (`repeat_kv`), 4Q in place of 4KV.
    sdpa on a masked call (transformers hands the kernel no GQA there; set 8's qwen3_moe
    anatomy); eager always, its matmuls keep the repeats, but with one key/value head the
    repeat is a view (set 22's qwen3_moe anatomy: 1.3% under without them).
    Docs: docs/memory-model.md#fsdp-moe-points."""
    if w.KV >= w.Q or (attn == "eager" and w.KV <= w.hd):
        return 0.0
    return 4 * w.Q - 4 * w.KV if attn in ("sdpa", "eager") else 0.0


def rotary_per_row(w: Widths) -> float:
    """The rotary cos and sin (bf16, head_dim wide), computed once per forward and kept by every
    layer's recompute (#fsdp-layer). Docs: docs/memory-model.md#fsdp-layer."""
    return 2 * BF16 * w.hd


def input_gradient_per_row(w: Widths) -> float:
    """The gradient flowing into a layer's backward (bf16 hidden). Docs: docs/memory-model.md#fsdp-layer."""
    return BF16 * w.H


def head_per_row(w: Widths, *, final_softcap: bool) -> tuple[float, float, float]:
    """(retained, backward transient, forward point) per row of transformers' ForCausalLMLoss on
    all logits (#fsdp-head): the final norm keeps its fp32 input copy (4H + 4); the loss keeps
    log_softmax's fp32 output (4V); at the forward the bf16 logits (2V), their fp32 upcast (4V)
    and log_softmax's output (4V) are live; the backward holds NLL's fp32 gradient (4V) and
    log_softmax's (4V) beside the kept output. A final logit softcap (Gemma 2) keeps two more
    fp32 copies (tanh input and output, 8V) and adds them at both points. Docs: docs/memory-model.md#fsdp-head."""
    norm = FP32 * w.H + FP32
    retained = FP32 * w.V + norm
    transient = 8 * w.V
    forward = 10 * w.V + norm
    if final_softcap:
        retained += 8 * w.V
        transient += 4 * w.V
        forward += 8 * w.V
    return retained, transient, forward


CALLER_PER_ROW = 5 * INT64
"""input_ids, position_ids, labels, the loss's shifted labels and their flat view (int64)."""


def attention_quadratic(w: Widths, *, attn: str, checkpointing: bool) -> tuple[float, float, float]:
    """Bytes per (row x attention row) of one packed forward call (#fsdp-attention):
    (held at every point, kept per layer, at a layer's points). sdpa: transformers'
    block-causal bool mask (1 byte), held from the model's forward to its backward, and the
    kernel's converted float mask at a layer's points (2 bytes). eager: the bf16 additive mask
    (2), and per head at a layer's points the scores, their fp32 softmax input, output and
    gradient (12 nh, recomputed under checkpointing); without checkpointing each layer keeps the
    fp32 softmax output and the bf16 probabilities (6 nh) and its backward adds the gradient's
    fp32 copy and softmax's backward output beside them as they are released (6 nh). flash: none (varlen kernels take cu_seqlens, no mask). Docs: docs/memory-model.md#fsdp-attention."""
    if attn == "sdpa":
        return 1.0, 0.0, 2.0
    if attn == "eager":
        return (2.0, 0.0, 12 * w.nh) if checkpointing else (2.0, 6 * w.nh, 6 * w.nh)
    return 0.0, 0.0, 0.0


def sdpa_masked_retained_per_row(w: Widths, *, checkpointing: bool) -> float:
    """What a layer keeps per row beyond `layer_retained_per_row` when transformers' sdpa runs
    with a packed-row mask, without checkpointing (#fsdp-attention): with a mask transformers
    hands the kernel no GQA (`use_gqa_in_sdpa`) but repeats the key and value to every query
    head (`repeat_kv`), and the kernel keeps the repeats (4Q) in place of the rotated key and
    the value (4KV). One key/value head repeats as a view (its expand and reshape copy nothing),
    nor does a model without GQA. With checkpointing the recomputed layer's backward terms hold
    them. Docs: docs/memory-model.md#fsdp-attention."""
    if checkpointing or w.KV >= w.Q or w.KV <= w.hd:
        return 0.0
    return 4 * w.Q - 4 * w.KV


def sdpa_mask_held_to_backward(*, attn: str, checkpointing: bool) -> bool:
    """Whether transformers' packed-row mask lives from the model's forward to its backward
    (#fsdp-attention): under checkpointing every layer's recompute takes it as an input;
    without checkpointing sdpa's bool mask and eager's additive one die when the decoder's
    forward returns (sdpa's kernel keeps its own converted copy per layer,
    `ulysses.kept_mask_per_row`; eager's `add` saves neither input: set 4's gemma3_text
    anatomy), so they are charged at the layers' forward points only. Docs:
    docs/memory-model.md#fsdp-attention."""
    return checkpointing or attn not in ("sdpa", "eager")


def recompute_kept_quadratic(w: Widths, *, attn: str, checkpointing: bool) -> float:
    """Bytes per (row x attention row) the recomputed attention keeps for its backward while
    the layer's MLP recomputes and runs its backward (checkpointing only; without, they are in
    `attention_quadratic`'s kept term): eager's fp32 softmax output and bf16 probabilities per
    head (6 nh), sdpa's converted float mask the CPU kernel saves (2). Charged at a split
    layer's MLP points (#fsdp-moe-points). Docs: docs/memory-model.md#fsdp-moe-points."""
    if not checkpointing:
        return 0.0
    if attn == "eager":
        return 6 * w.nh
    if attn == "sdpa":
        return 2.0
    return 0.0


def sdpa_recompute_backward_per_row(w: Widths, *, masked: bool, qk_norm: bool) -> float:
    """What a checkpointed layer's sdpa kernel backward holds per row (#fsdp-attention): the
    rotated query, the output, its gradient and the query's (8Q), the key and value as the
    kernel took them and their gradients, the fp32 log-sum-exp (4 nh), the recomputed input
    norm's fp32 input, output and rsqrt (6H + 4) and the q/k/v LoRA A outputs (6r); on a masked
    call under GQA transformers repeats k and v to every query head (`repeat_kv`): kept as
    copies (4Q; a view for one key/value head, 4KV) and their gradients Q-wide (4Q), else 4KV
    each (set 26's llama anatomy: the whole point to the byte); qk-norm adds the recomputed
    norms' copies (6Q + 6KV). Docs: docs/memory-model.md#fsdp-attention."""
    gqa = masked and w.KV < w.Q
    kept = 4 * w.Q if gqa and w.KV > w.hd else 4 * w.KV
    grads = 4 * w.Q if gqa else 4 * w.KV
    out = 8 * w.Q + kept + grads + FP32 * w.nh + 6 * w.H + FP32 + 6 * w.r
    if qk_norm:
        out += 6 * w.Q + 6 * w.KV
    return out


def sdpa_recompute_repeats_per_row(w: Widths, *, masked: bool) -> float:
    """What a checkpointed layer's recomputed sdpa attention keeps per row through its MLP's
    backward above the MLP backward term's 4KV: on a masked call under GQA the key and value
    repeated to every query head (4Q - 4KV; none for one key/value head, a view), as
    `recompute_repeated_kv_per_row` at a MoE layer's recompute point (set 26's llama anatomy).
    Docs: docs/memory-model.md#fsdp-attention."""
    return 4 * w.Q - 4 * w.KV if masked and w.hd < w.KV < w.Q else 0.0


def qk_norm_backward_per_row(w: Widths, *, checkpointing: bool) -> float:
    """A qk-norm layer's query-norm backward, per row (#fsdp-attention): after the attention
    kernel's backward the norm runs its backward in fp32, six Q-wide fp32 tensors at once (the
    upcast gradient, the products with the normalized input and with rsqrt, pow's and the mean's
    gradients, the fp32 input: 24Q), beside the gradient into the q/k/v projections' input (2H)
    and the rsqrt (4 nh); with checkpointing also the recomputed input norm's fp32 input, output
    and rsqrt (6H + 4) and the q/k/v LoRA A outputs (6r); without, beside the layer's kept
    tensors, which hold the fp32 input (20Q). Set 26's qwen3 one-sequence anatomy (8.8% under
    without it). Docs: docs/memory-model.md#fsdp-attention."""
    if checkpointing:
        return 24 * w.Q + 8 * w.H + FP32 * w.nh + 6 * w.r + FP32
    return 20 * w.Q + 2 * w.H + FP32 * w.nh


def eager_forward_quadratic(w: Widths) -> float:
    """Bytes per (row x attention row) at an eager layer's forward point beyond what earlier
    layers keep (#fsdp-attention): as `softmax(dtype=float32)` runs, the masked bf16 scores, their
    fp32 copy and the fp32 softmax output (10 nh) are live; the bf16 probabilities are made after
    the copy dies, the matmul and soft-cap temporaries before them die one op later (set 4's
    Gemma anatomies). A family's own kept soft-cap output (`FamilyAdds.kept_q`) adds to it.
    Docs: docs/memory-model.md#fsdp-attention."""
    return 10 * w.nh


def eager_attention_kept_per_row(w: Widths, *, qk_norm: bool) -> float:
    """What a layer without checkpointing still keeps per row as its eager attention's softmax
    backward runs (#fsdp-attention): its MLP, pre-MLP norm, output projection and sandwich norms
    have run their backward and released theirs; left are the input norm's fp32 input, bf16
    output and rsqrt (6H + 4), the rotated query and the repeated key the scores' matmul saved
    (2Q + 2Q; one key/value head repeats as a view, 2Q + 2KV), the q/k/v LoRA A outputs (6r)
    and, with qk-norm, its fp32 inputs and rsqrt (4Q + 4KV + 4 nh + 4 kv heads); its fp32
    softmax output is in `attention_quadratic`'s kept term (set 4's gemma3_text anatomy).
    Docs: docs/memory-model.md#fsdp-attention."""
    out = 6 * w.H + FP32 + 2 * w.Q + (2 * w.Q if w.KV > w.hd else 2 * w.KV) + 6 * w.r
    if qk_norm:
        out += 4 * w.Q + 4 * w.KV + FP32 * (w.nh + w.KV / w.hd)
    return out


def eager_softmax_backward_per_row(w: Widths) -> float:
    """What an eager attention's softmax backward holds per row beside the S x S terms and the
    layer's input gradient, without checkpointing (#fsdp-attention): the repeated value's
    gradient from the probabilities' matmul (2Q); the query/key/value gradients come after the
    S x S gradients are released (`layer_backward_per_row`). Docs: docs/memory-model.md#fsdp-attention."""
    return BF16 * w.Q


# --- parameters (counts; FSDP2 gathers them in bf16) ---------------------------------------


def layer_param_counts(geometry: ModelGeometry, layer: int) -> tuple[int, int]:
    """(base, LoRA on every linear) parameters of one HF decoder layer: q/k/v/o projections
    (with Qwen2's q/k/v biases), the gated (or plain) MLP or the experts and router, the norms
    (with qk-norm's and sandwich norms'); PEFT's all-linear LoRA adapts every nn.Linear
    (not fused 3-D expert weights): A (r x in) and B (out x r) each. The LoRA rank enters as 1
    here: multiply the second entry by the rank. O(1). Docs: docs/memory-model.md#fsdp-constants."""
    g = geometry
    att = g.attention
    h = g.hidden
    q = att.num_heads * att.head_dim
    kv = att.num_kv_groups * att.head_dim
    base = h * q + 2 * h * kv + q * h + 2 * h
    lora = attention_lora_count(g, fused_qkv=False)
    if g.features.qkv_bias:
        base += q + 2 * kv
    if g.qk_norm:
        base += 2 * att.head_dim
    if g.features.sandwich_norms:
        base += 2 * h
    spec = g.layers[layer]
    if spec.mlp == MlpKind.MOE and g.moe is not None:
        moe = g.moe
        n_mat = 3 if g.gated_mlp else 2
        base += moe.num_experts * n_mat * h * moe.expert_ffn + h * moe.num_experts
        lora += h + moe.num_experts
        if moe.shared_expert_ffn:
            base += n_mat * h * moe.shared_expert_ffn
            lora += (n_mat - 1) * (h + moe.shared_expert_ffn) + (moe.shared_expert_ffn + h)
    else:
        f = g.ffn
        n_mat = 3 if g.gated_mlp else 2
        base += n_mat * h * f
        lora += (n_mat - 1) * (h + f) + (f + h)
    return base, lora


def root_param_count(geometry: ModelGeometry) -> int:
    """The root FSDP group's parameters: the embedding, the final norm and (untied) the head. Docs: docs/memory-model.md#fsdp-constants."""
    g = geometry
    return g.vocab * g.hidden * (1 if g.tied_embeddings else 2) + g.hidden


def attention_lora_count(geometry: ModelGeometry, *, fused_qkv: bool) -> int:
    """LoRA parameters per unit of rank on one layer's attention projections (A and B each): q, k,
    v and o, or (`fused_qkv`, phi3) one qkv and o. O(1). Docs: docs/memory-model.md#fsdp-constants."""
    att = geometry.attention
    h = geometry.hidden
    q = att.num_heads * att.head_dim
    kv = att.num_kv_groups * att.head_dim
    if fused_qkv:
        return (h + q + 2 * kv) + (q + h)
    return (h + q) + 2 * (h + kv) + (q + h)


def shard(count: float, fsdp: int) -> float:
    """One rank's share of `count` parameters under FSDP2 (dim-0 chunks, padded). Docs: docs/memory-model.md#fsdp-constants."""
    return math.ceil(count / fsdp)


# --- families beyond Llama's shape (#fsdp-families) -----------------------------------------


def moe_lora_stacks(geometry: ModelGeometry) -> tuple[float, float]:
    """(gate_up, down) bytes of one MoE layer's expert stacks as PEFT LoRA runs them: PEFT's
    all-linear targets transformers 5's fused 3-D expert parameters (`target_parameters`,
    `ParamWrapper`) and folds the adapter in on every forward, W + s lhs @ rhs by one
    `baddbmm`: a full-size bf16 copy of each stack, which the grouped matmul keeps for its
    backward; the backward adds that copy's gradient, one stack at a time (#fsdp-families).
    Docs: docs/memory-model.md#fsdp-families."""
    moe = geometry.moe
    if moe is None:
        return 0.0, 0.0
    up = BF16 * moe.num_experts * (2 if geometry.gated_mlp else 1) * moe.expert_ffn * geometry.hidden
    down = BF16 * moe.num_experts * moe.expert_ffn * geometry.hidden
    return float(up), float(down)


def moe_lora_param_count(geometry: ModelGeometry) -> int:
    """LoRA parameters per unit of rank PEFT's all-linear adds to one MoE layer beyond the
    attention's: the expert stacks' (gate_up: A 2E x H, B 2F_e x 2E; down: A E x F_e, B H x E)
    and the router's (A H, B E) (#fsdp-families). Docs: docs/memory-model.md#fsdp-families."""
    moe = geometry.moe
    if moe is None:
        return 0
    h, e, fe = geometry.hidden, moe.num_experts, moe.expert_ffn
    n_up = 2 if geometry.gated_mlp else 1
    return n_up * e * (h + n_up * fe) + moe_down_lora_param_count(geometry) + (h + e)


def moe_stack_padding(geometry: ModelGeometry, fsdp: int) -> int:
    """The elements FSDP2's all-gather output adds to one MoE layer's expert stacks: it shards
    every parameter on dim 0 padded to a multiple of the shard group, and a stack's dim 0 is its
    experts, so E experts gather as ceil(E / N) x N (set 6's qwen3_moe, 6 experts at FSDP4: its
    flat all-gather output, live at the head's backward, 26% above the layer's parameters;
    #fsdp-moe-points). 0 for a dense model. Docs: docs/memory-model.md#fsdp-moe-points."""
    moe = geometry.moe
    if moe is None:
        return 0
    extra = -(-moe.num_experts // fsdp) * fsdp - moe.num_experts
    n_up = 2 if geometry.gated_mlp else 1
    return extra * (n_up + 1) * moe.expert_ffn * geometry.hidden


def moe_down_lora_param_count(geometry: ModelGeometry) -> int:
    """The down stack's LoRA parameters per unit of rank (A E x F_e, B H x E; 0 for a dense model):
    the only adapters of a MoE layer with gradients at its MLP backward point
    (#fsdp-moe-points). Docs: docs/memory-model.md#fsdp-moe-points."""
    moe = geometry.moe
    return 0 if moe is None else moe.num_experts * (moe.expert_ffn + geometry.hidden)


@dataclass(frozen=True)
class FamilyAdds:
    """What a family's modeling code holds beyond the Llama-shaped terms, per row and per
    (row x attention row) (#fsdp-families)."""

    retained: float = 0.0       # per row, kept by each layer without checkpointing
    forward: float = 0.0        # per row, at a layer's forward points
    backward: float = 0.0       # per row, at a layer's backward points
    masks: int = 1              # packed-row masks made per forward (one per attention kind)
    kept_q: float = 0.0         # per (row x attention row), kept by each layer without checkpointing
    point_q: float = 0.0        # per (row x attention row), at the attention's points
    recompute_q: float = 0.0    # per (row x attention row), kept by the recomputed attention to the MLP's backward
    mlp_backward: float = 0.0   # per row, at the MLP's backward point only


def family_adds(geometry: ModelGeometry, w: Widths, *, checkpointing: bool, attn: str) -> FamilyAdds:
    """A family's additions (#fsdp-families): Gemma's two extra (post) RMSNorms, each keeping
    its fp32 input (4H + 4; their backward's fp32 temporaries come before the MLP's gradients
    are in flight); one packed-row mask per attention kind (sliding and full layers: two);
    Gemma 2's attention soft-cap under eager (without checkpointing the tanh output kept, 2 nh,
    its backward after the softmax's S x S gradients are freed: nothing at the point; with checkpointing
    the recomputed tanh output beside the softmax's backward, 2 nh: the forward's soft-cap
    temporaries die before its softmax, within the base terms), and the recomputed tanh output
    kept through the MLP's backward beside `recompute_kept_quadratic`'s, 2 nh; under eager with
    checkpointing the post-feedforward norm's fp32 backward temporaries beside the recomputed
    MLP at its backward point (`sandwich_mlp_backward_per_row`: the attention's S x S point no
    longer covers that moment), under flash 6H at both of a layer's backward points
    (#fsdp-attention). Docs: docs/memory-model.md#fsdp-families."""
    f = geometry.features
    retained = forward = backward = 0.0
    kept_q = point_q = recompute_q = 0.0
    mlp_backward = 0.0
    if f.sandwich_norms:
        norms = 2 * (FP32 * w.H + FP32)
        retained += norms
        forward += norms
        backward += norms
        if attn == "eager":
            mlp_backward += sandwich_mlp_backward_per_row(w, checkpointing=checkpointing)
        elif attn == "flash":
            backward += sandwich_backward_per_row(w, checkpointing=checkpointing)
    kinds = set(f.sliding_layers(geometry.num_layers)) if attn != "flash" else {False}
    if attn == "eager" and f.attention_softcap:
        kept_q += 0.0 if checkpointing else 2 * w.nh
        point_q += 2 * w.nh if checkpointing else 0.0
        recompute_q += 2 * w.nh if checkpointing else 0.0
    return FamilyAdds(retained=retained, forward=forward, backward=backward, masks=len(kinds),
                      kept_q=kept_q, point_q=point_q, recompute_q=recompute_q, mlp_backward=mlp_backward)


def final_softcap_per_row(w: Widths) -> tuple[float, float, float]:
    """(retained, backward transient, forward point) per row that a final logit soft-cap adds
    as transformers' Gemma 2 runs it on the bf16 logits (#fsdp-families): division, tanh and
    product outputs (2V each), the tanh output kept for its backward; at the forward two of them
    live beside the logits (4V); its backward runs after log_softmax's has released more than it
    makes (nothing at the head's backward point). Docs: docs/memory-model.md#fsdp-families."""
    return BF16 * w.V, 0.0, 2 * BF16 * w.V


# --- calibration factors (#fsdp-calibration) ------------------------------------------------

CALIBRATION_GROUPS = ("fsdp_layer", "fsdp_attention", "fsdp_head", "fsdp_constants")
"""The optional table entries (`pricing.entries`) whose `value` scales a group of the terms:
decoder-layer bytes per row, packed-row S x S bytes, head bytes per row, constants."""


def calibration_factors(table) -> dict[str, float]:
    """The table's factor of every group (1 where it carries none: the derived terms).
    Docs: docs/memory-model.md#fsdp-calibration."""
    return {g: float(entries.entry(table, g, {"value": 1.0})["value"]) for g in CALIBRATION_GROUPS}
