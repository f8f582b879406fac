"""Pricing terms: each is the bytes per row (or per segment, per token) of one kind of memory.

Rows are the wave's rows on the busiest context-parallel rank after TP padding ("gathered
rows"). A term that lives on sequence-parallel shards divides its hidden-wide part by
`sp_div` (TP with sequence parallelism, else 1). Widths already carry the TP split (see
`pricing.model.layer_widths`). Every function names its docs section; the numbers come from
the backend's `CoefficientTable`.
"""

from __future__ import annotations

from . import entries, moe_terms
from .coefficients import CoefficientTable
from .geometry import GdnSpec, MixerKind, MlpKind


def boundary_per_row(table: CoefficientTable, widths: dict, *, sp_div: int) -> float:
    """One saved layer boundary (the layer's input) under full recompute.

    Formula: `boundary` (2H) / sp_div. See docs/memory-model.md#boundaries.
    """
    return table.per_row("boundary", widths) / sp_div


def input_gradient_per_row(table: CoefficientTable, widths: dict, *, sp_div: int) -> float:
    """The one input gradient the recomputed layer holds (not one per boundary).

    Formula: `input_gradient` (2H) / sp_div. See docs/memory-model.md#input-gradient.
    """
    return table.per_row("input_gradient", widths) / sp_div


def mixer_stage_per_row(table: CoefficientTable, widths: dict, mixer: MixerKind) -> float:
    """The recomputed mixer's workspace over gathered rows (attention or GDN).

    Formula: the `attention_stage` or `gdn_stage` entry x widths (projection output, LoRA output and
    sum, core output and its gradient). See docs/memory-model.md#workspace.
    """
    name = "attention_stage" if mixer == MixerKind.ATTENTION else "gdn_stage"
    return table.per_row(name, widths)


def mlp_stage_per_row(table: CoefficientTable, widths: dict, mlp: MlpKind, *, ep_skew: float,
                      local_experts: int = 1, etp: int = 1, sp_div: int = 1) -> float:
    """The recomputed MLP stage over gathered rows.

    Dense: `mlp_dense_grad_stage` (7F FC1 stage + 6F recompile residue, F per TP rank). MoE:
    `moe_routed_stage_per_row` (routed rows at the largest backward point, their metadata and the
    router on the rank's shard) + `shared_expert_per_row` + `moe_norm_inputs_per_row`. See
    docs/memory-model.md#workspace.
    """
    if mlp == MlpKind.DENSE:
        return table.per_row("mlp_dense_grad_stage", widths)
    return (moe_routed_stage_per_row(table, widths, ep_skew=ep_skew, local_experts=local_experts, etp=etp,
                                     sp_div=sp_div)
            + shared_expert_per_row(table, widths) + moe_norm_inputs_per_row(table, widths))


def moe_routed_stage_per_row(table: CoefficientTable, widths: dict, *, ep_skew: float, local_experts: int = 1,
                             etp: int = 1, sp_div: int = 1) -> float:
    """A recomputed MoE layer's routed rows and router at its backward peak, per gathered row.

    Formula: top_k x ep_skew x (max(point A, point B, point C [expert TP > 1 under SP]) + routing
    metadata) + `moe_router` / sp_div. The part of `mlp_stage_per_row` that
    `moe_terms.sp_layer_point_per_row` keeps. See docs/memory-model.md#moe-routed-points and
    docs/memory-model.md#moe-tp-point.
    """
    point = max(moe_routed_per_routed_row(table, widths),
                moe_expert_backward_per_routed_row(table, widths, local_experts=local_experts),
                moe_terms.tp_backward_point_per_routed_row(widths, etp=etp))
    routed = widths["top_k"] * ep_skew * (point + moe_routing_metadata_per_routed_row(table))
    return routed + table.per_row("moe_router", widths) / sp_div


def shared_expert_per_row(table: CoefficientTable, widths: dict) -> float:
    """A recomputed MoE layer's shared expert at the layer's backward point; 0 without one.

    Formula: `moe_shared_expert` (8 shared_ffn + 2H on the CPU: the FC1 output and two activation
    tensors, and the FC2 output before it joins the routed output). See
    docs/memory-model.md#moe-routed-points.
    """
    return table.per_row("moe_shared_expert", widths) if widths["shared_ffn"] else 0.0


def moe_norm_inputs_per_row(table: CoefficientTable, widths: dict) -> float:
    """The share of a MoE layer's two RMSNorm fp32 input copies (8H per row on the CPU) that its
    fitted mixer stage does not carry.

    Formula: `moe_norm_inputs` x widths; 0 where a table lacks it (te-gpu: fused norms keep no fp32
    copy). The fitted `attention_stage` and `gdn_stage` carry most of the copies and the structural
    routed terms none; beside the by-width MLA stage it also covers the MLA rope-key copy. See
    docs/memory-model.md#moe-routed-points.
    """
    return entries.optional_per_row(table, "moe_norm_inputs", widths)


def moe_routed_per_routed_row(table: CoefficientTable, widths: dict) -> float:
    """A recomputed MoE layer's routed rows when its backward reaches the experts (point A).

    Formula: `moe_routed` per routed row, 6H + 10F (F = expert_ffn): the permuted input rows, each
    expert's FC2 output and their concatenation (3 x 2H) and each expert's FC1 output and activation
    (10F); the dispatcher's sort copy is `moe_terms.permutation_per_routed_row`. See
    docs/memory-model.md#moe-routed-points.
    """
    return table.per_row("moe_routed", widths, key="per_routed_row")


# point B's units as the cpu-fake Mixtral-8x7B trace holds them (docs/memory-model.md#moe-routed-points),
# charged where a table has no `moe_expert_backward` entry of its own
EXPERT_BACKWARD_UNITS = {"per_routed_row": {"H": 2, "expert_ffn": 10}, "per_expert_row": {"expert_ffn": 14}}


def moe_expert_backward_per_routed_row(table: CoefficientTable, widths: dict, *, local_experts: int) -> float:
    """A recomputed MoE layer's routed rows while one local expert runs its backward (point B).

    Formula: 2H + 10F + 14F / local_experts per routed row (the permuted input's gradient, every
    expert's FC1 output and activation, and the running expert's fp32 activation gradients and
    casts). Entry `moe_expert_backward`; a table without it is charged the CPU trace's units,
    `EXPERT_BACKWARD_UNITS` (the only evidence of this point, not 0). It binds over point A where F
    is wide against H. See docs/memory-model.md#moe-routed-points.
    """
    entry = entries.entry(table, "moe_expert_backward", EXPERT_BACKWARD_UNITS)
    routed = sum(c * widths[w] for w, c in entry.get("per_routed_row", {}).items())
    expert = sum(c * widths[w] for w, c in entry.get("per_expert_row", {}).items())
    return float(routed + expert / max(local_experts, 1))


def moe_routing_metadata_per_routed_row(table: CoefficientTable) -> float:
    """The router's per-choice bookkeeping live at a recomputed MoE layer's backward, bytes per
    routed row.

    Formula: `moe_routing_metadata` (32 B on the CPU: int64 token indices of this and the last
    recomputed layer's permutation, int64 expert ids, fp32 gathered probabilities and their copy);
    0 where a table lacks it (te-gpu). See docs/memory-model.md#moe-routed-points.
    """
    return entries.optional_scalar(table, "moe_routing_metadata")


def norm_and_residual_per_row(table: CoefficientTable, widths: dict, *, sp_div: int) -> float:
    """Norm input gathered over TP (2H) plus residual and norm-output shards.

    Formula: `norm_gathered` + `residual_norm_shards` / sp_div. See docs/memory-model.md#workspace.
    """
    return table.per_row("norm_gathered", widths) + table.per_row("residual_norm_shards", widths) / sp_div


def mla_norm_inputs_per_row(table: CoefficientTable, widths: dict, *, sp_div: int) -> float:
    """What a recomputed multi-latent-attention layer's two RMSNorms keep beside its MLA stage.

    Formula: `mla_norm_inputs` (2 x 4H, the inputs upcast to fp32) / sp_div; 0 where a table lacks
    it (te-gpu: fused norms keep no fp32 copy). The fused-QKV `attention_stage` carries them in its
    fit; the by-width MLA stage (`feature_terms.mla_stage_per_row`) does not. See
    docs/memory-model.md#moe-routed-points.
    """
    return entries.optional_per_row(table, "mla_norm_inputs", widths) / sp_div


def qk_norm_per_row(table: CoefficientTable, widths: dict) -> float:
    """What an attention layer with query/key norms (Qwen3) keeps of them for backward.

    Formula: `qk_norm`, 4 bytes x (query + key widths) = 2 qkv + 2 core (a plain torch RMSNorm's fp32
    input copy), charged as retained activations and in the recomputed workspace; 0 (neutral) in
    te-gpu, whose attention stage was sized on GPU traces. See docs/memory-model.md#workspace.
    """
    return entries.optional_per_row(table, "qk_norm", widths)


def nograd_stage_per_row(table: CoefficientTable, widths: dict, mlp: MlpKind, *, ep_skew: float,
                         local_experts: int = 1) -> float:
    """A no-grad group's forward transient; groups run one after another.

    Formula: dense `mlp_dense_nograd` (6F + 6H); MoE `moe_nograd` per routed row x top_k x ep_skew
    plus per row (the permuted rows, experts' outputs and concatenation, the router's
    probabilities), or, where a table lacks it (te-gpu), the gradient-stage MoE workspace + 6H
    (conservative). See docs/memory-model.md#nograd-transient.
    """
    if mlp == MlpKind.DENSE:
        return table.per_row("mlp_dense_nograd", widths)
    if table.kernels.moe_nograd:
        return (widths["top_k"] * ep_skew * table.per_row("moe_nograd", widths, key="per_routed_row")
                + table.per_row("moe_nograd", widths))
    return mlp_stage_per_row(table, widths, mlp, ep_skew=ep_skew, local_experts=local_experts) + 6 * widths["H"]


def gdn_state_per_segment(table: CoefficientTable, gdn: GdnSpec, *, tp: int) -> float:
    """One GDN layer's recurrent state per segment: initial and final fp32 states plus the conv
    history, for the layer being recomputed.

    Formula: 2 x (value heads / TP) x dk x dv x 4 + (kernel - 1) x conv width / TP x 4 bytes. See
    docs/memory-model.md#gdn-states.
    """
    state = table.scalar("gdn_state_bytes")
    heads = gdn.num_value_heads // tp
    return (2 * heads * gdn.key_head_dim * gdn.value_head_dim * state
            + (gdn.conv_kernel - 1) * (gdn.conv_width // tp) * state)


def retained_layer_per_row(table: CoefficientTable, widths: dict, mixer: MixerKind, mlp: MlpKind,
                           *, sp_div: int, selective: bool, ep_skew: float) -> float:
    """Activations one layer keeps for backward without full recompute (selective or none).

    Formula: the `retained_attention_layer` or `retained_gdn_layer` entry x widths, its H part
    / sp_div; a MoE MLP replaces the F part by `retained_moe_mlp` (per routed row x top_k x ep_skew,
    plus per row); selective attention subtracts `selective_core_attn_discount` (the saved core
    output copy). See docs/memory-model.md#retained-activations.
    """
    name = "retained_attention_layer" if mixer == MixerKind.ATTENTION else "retained_gdn_layer"
    coef = dict(table.terms[name]["per_row"])
    hidden_part = coef.pop("H", 0) * widths["H"] / sp_div
    other = sum(c * widths[w] for w, c in coef.items())
    if mlp == MlpKind.MOE:
        # replace the dense FFN part by the MoE retained activations
        other -= coef.get("F", 0) * widths["F"]
        other += (widths["top_k"] * ep_skew * table.per_row("retained_moe_mlp", widths, key="per_routed_row")
                  + table.per_row("retained_moe_mlp", widths))
    if selective and mixer == MixerKind.ATTENTION:
        other -= table.per_row("selective_core_attn_discount", widths)
    return hidden_part + other


def retained_backward_per_row(table: CoefficientTable, widths: dict, mlp: MlpKind, *, ep_skew: float,
                              stage: float) -> float:
    """Backward transient of a layer whose activations are retained (selective or no recompute),
    over the retained activations it frees as its backward runs.

    Formula: `retained_backward` rank part + F part (dense) or per routed row x top_k x ep_skew +
    shared_ffn part (MoE); a table without the entry (te-gpu) charges the full-recompute stage
    workspace `stage`, the neutral bound. See docs/memory-model.md#retained-activations.
    """
    if not table.kernels.retained_backward:
        return stage
    coef = table.terms["retained_backward"].get("per_row", {})
    rank_part = coef.get("rank", 0.0) * widths["rank"]
    if mlp == MlpKind.DENSE:
        return rank_part + coef.get("F", 0.0) * widths["F"]
    routed = widths["top_k"] * ep_skew * table.per_row("retained_backward", widths, key="per_routed_row")
    return rank_part + routed + coef.get("shared_ffn", 0.0) * widths["shared_ffn"]


def retained_forward_per_row(table: CoefficientTable, widths: dict, mlp: MlpKind, *, ep_skew: float,
                             layer_retained: float) -> float:
    """A layer's forward peak under selective or no recompute, over the retained activations
    of the layers below it.

    Formula: `retained_forward` value x the layer's retained bytes + the MLP's forward transient
    (dense: per_row F; MoE: per routed row x top_k x ep_skew + experts and shared_ffn parts). The
    walk charges the larger of this and the no-grad transient; 0 where a table lacks the entry
    (te-gpu). See docs/memory-model.md#retained-activations.
    """
    if not table.kernels.retained_forward:
        return 0.0
    entry = table.terms["retained_forward"]
    coef = entry.get("per_row", {})
    own = entry.get("value", 0.0) * layer_retained
    if mlp == MlpKind.DENSE:
        return own + coef.get("F", 0.0) * widths["F"]
    routed = widths["top_k"] * ep_skew * table.per_row("retained_forward", widths, key="per_routed_row")
    return own + routed + coef.get("experts", 0.0) * widths["experts"] \
        + coef.get("shared_ffn", 0.0) * widths["shared_ffn"]


def final_norm_per_row(table: CoefficientTable, widths: dict, *, sp_div: int) -> tuple[float, float]:
    """(saved, backward transient) bytes per row of the decoder's final norm.

    Formula: (`final_norm` (its fp32 input copy, 4H), `final_norm_backward` (its fp32 backward
    intermediates)) / sp_div; 0 (neutral) in te-gpu, whose head terms cover the traced peaks. The
    backward runs after the head's has released the logits, so the walk charges the larger of it
    and the head's transient. See docs/memory-model.md#head-norm-order.
    """
    saved = entries.optional_per_row(table, "final_norm", widths)
    backward = entries.optional_per_row(table, "final_norm_backward", widths)
    return saved / sp_div, backward / sp_div


def head_per_row(table: CoefficientTable, widths: dict, head: str, *,
                 margins: bool = False) -> tuple[float, float]:
    """(retained, transient) bytes per gathered row of the output head and loss, by head mode.

    `full-native`: Megatron's cross entropy keeps bf16 logits and an fp32 copy, 6 x vocab/TP
    bytes, plus the bf16 gradient in backward. `full-te`: TE's fused cross entropy
    writes the gradient in place, 2 x vocab/TP (docs/memory-model.md#head-modes), and the entry's
    optional `per_row` widths add what lives beside the logits per gathered row (the head's
    input, which the output layer saves, and the fp32 loss and per-row statistics;
    docs/memory-model.md#head-full-te). `chunked:N`: none is retained; the chunk's transient is
    `head_chunk_bytes`.
    """
    if head == "full-native":
        entry = "head_full_native"
    elif head == "full-te":
        entry = "head_full_te"
    else:
        return 0.0, 0.0
    beside = table.per_row(entry, widths) if head == "full-te" else 0.0
    # `margins`: the entry's `gdn` values where it has them (te-gpu: the seeds' head, whose margin
    # the fitted GDN layers need; KernelSet.priced_by_models)
    coef = table.terms[entry].get("gdn", table.terms[entry]) if margins else table.terms[entry]
    return (float(coef["retained_per_row_vocab"]) * widths["vocab"] + beside,
            float(coef["transient_per_row_vocab"]) * widths["vocab"])


def head_chunk_bytes(table: CoefficientTable, widths: dict, chunk_rows: int) -> float:
    """Transient of one logits chunk of `chunk_rows` rows (bf16 logits, fp32 upcast, fp32
    softmax/gradient, bf16 gradient); docs/memory-model.md#head-modes (512 rows by default)."""
    return chunk_rows * table.scalar("head_chunk", "per_row_vocab") * widths["vocab"]


def caller_per_logical_token(table: CoefficientTable, head_kind: str, *,
                             every_head: bool = False) -> float:
    """Head buffers and the caller's loss memory per logical token: 6 KiB (docs/memory-model.md#caller).

    Kept live through the whole wave (conservative: its peak was measured, not its lifetime).
    Charged with the head kinds the entry's optional `heads` names (every kind without it): the
    te-gpu measurement is the chunked head's, whose logits and loss the caller computes; the
    full heads' logits and loss are Megatron's own, priced by the head terms. `every_head`: charged
    with every head kind (`KernelSet.caller_by_heads` false: GDN or MoE layers on te-gpu).
    """
    heads = table.terms["caller_per_logical_token"].get("heads")
    if heads is not None and head_kind not in heads and not every_head:
        return 0.0
    return table.scalar("caller_per_logical_token")


def first_execution_bytes(table: CoefficientTable) -> float:
    """A wave's first-execution transients while no profile is learned (docs/memory-model.md#first-execution)."""
    return table.scalar("first_execution")
