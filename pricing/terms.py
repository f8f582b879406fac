"""Pricing terms: each is the bytes per row (or per segment, per token) of one kind of memory.

Rows are the wave's rows on the busiest context-parallel rank after TP padding ("gathered
rows"). A term that lives on sequence-parallel shards divides its hidden-wide part by
`sp_div` (TP with sequence parallelism, else 1). Widths already carry the TP split (see
`pricing.model.layer_widths`). Every function names its evidence; the numbers come from the
backend's `CoefficientTable`.
"""

from __future__ import annotations

from . import entries, moe_terms
from .coefficients import CoefficientTable
from .geometry import GdnSpec, MixerKind, MlpKind


def boundary_per_row(table: CoefficientTable, widths: dict, *, sp_div: int) -> float:
    """One saved layer boundary (the layer's input) under full recompute.

    rows x H x 2 bytes, or one shard of ceil(rows/TP) rows per rank with sequence parallelism.
    Evidence: docs/memory-model.md#boundaries (the traced TP4 wave's boundary shards; TP1).
    """
    return table.per_row("boundary", widths) / sp_div


def input_gradient_per_row(table: CoefficientTable, widths: dict, *, sp_div: int) -> float:
    """The one input gradient the recomputed layer holds (not one per boundary).

    rows x H x 2 bytes, a shard under SP. Evidence: docs/memory-model.md#input-gradient.
    """
    return table.per_row("input_gradient", widths) / sp_div


def mixer_stage_per_row(table: CoefficientTable, widths: dict, mixer: MixerKind) -> float:
    """The recomputed mixer's workspace over gathered rows (attention or GDN).

    Projection output, LoRA output and sum, core output and its gradient, by the mixer's
    widths. Evidence: docs/memory-model.md#workspace (the traced TP4 decomposition).
    """
    name = "attention_stage" if mixer == MixerKind.ATTENTION else "gdn_stage"
    return table.per_row(name, widths)


def mlp_stage_per_row(table: CoefficientTable, widths: dict, mlp: MlpKind, *, ep_skew: float,
                      local_experts: int = 1, etp: int = 1, sp_div: int = 1) -> float:
    """The recomputed MLP stage over gathered rows.

    Dense: the LoRA-wrapped FC1 stage, 7F, plus the 6F recompile residue (F is per TP
    rank). MoE: per routed row (rows x top-k, times the skew allowance when experts are
    split over EP ranks, and by the expert-TP share of the rows) the largest of the layer's
    backward points (`moe_routed_per_routed_row`, `moe_expert_backward_per_routed_row`, and with
    an expert TP `etp` > 1 under sequence parallelism, `moe_terms.tp_backward_point_per_routed_row`),
    plus the router (per row of the rank's sequence shard: it routes its 1/TP of the rows under
    sequence parallelism, `sp_div`; the TP4+SP anatomy's router tensors are [rows / 4, E]), its
    routing metadata and the shared expert. Evidence: docs/memory-model.md#workspace.
    """
    if mlp == MlpKind.DENSE:
        return table.per_row("mlp_dense_grad_stage", widths)
    return (moe_routed_stage_per_row(table, widths, ep_skew=ep_skew, local_experts=local_experts, etp=etp,
                                     sp_div=sp_div)
            + shared_expert_per_row(table, widths) + moe_norm_inputs_per_row(table, widths))


def moe_routed_stage_per_row(table: CoefficientTable, widths: dict, *, ep_skew: float, local_experts: int = 1,
                             etp: int = 1, sp_div: int = 1) -> float:
    """A recomputed MoE layer's routed rows and router at its backward peak, per gathered row: top_k
    x `ep_skew` routed rows at the largest of points A, B and (expert TP > 1 under SP) C, with
    their routing metadata, plus the router's per-row tensors on the rank's sequence shard
    (`sp_div`). The part of `mlp_stage_per_row` that the MoE layer's TP+SP point
    (`moe_terms.sp_layer_point_per_row`) keeps. Evidence: docs/memory-model.md#moe-routed-points,
    #moe-tp-point."""
    point = max(moe_routed_per_routed_row(table, widths),
                moe_expert_backward_per_routed_row(table, widths, local_experts=local_experts),
                moe_terms.tp_backward_point_per_routed_row(widths, etp=etp))
    routed = widths["top_k"] * ep_skew * (point + moe_routing_metadata_per_routed_row(table))
    return routed + table.per_row("moe_router", widths) / sp_div


def shared_expert_per_row(table: CoefficientTable, widths: dict) -> float:
    """A recomputed MoE layer's shared expert at the layer's backward point; 0 without one.

    Its FC1 output and activation (8 x shared_ffn on the CPU: the FC1 output, 4, and two
    activation tensors, `silu` and `add`, 2 each) and its FC2 output (2H, before the MoE layer
    adds it to the routed experts' output). Entry `moe_shared_expert` (`per_row`: shared_ffn and H), charged only
    when the model has a shared expert. Evidence: the decoder-only backward peaks of the
    cpu-fake DeepSeek-V3 and DeepSeek-V2-Lite traces (`L*.mlp.shared_experts`: 8 x shared_ffn
    + 2H exactly; bench/results/moe_anatomy.txt; docs/memory-model.md#moe-routed-points).
    """
    return table.per_row("moe_shared_expert", widths) if widths["shared_ffn"] else 0.0


def moe_norm_inputs_per_row(table: CoefficientTable, widths: dict) -> float:
    """The share of a MoE layer's two RMSNorm fp32 input copies (8H per row on the CPU, live at
    every backward point of the recomputed MoE layer) that its fitted mixer stage does not
    carry.

    The calibrate-fitted `attention_stage` (and `gdn_stage`) carry most of them (between 7.1H
    and 8.7H per row over the attention tensors traced in the MoE cells; the dense MLP stage
    the rest in dense layers); the routed terms, now structural, carry none. Entry
    `moe_norm_inputs` (`per_row`); 0 where a table lacks it (te-gpu: fused norms keep no fp32
    copy). An MLA layer's stage is by-width and carries none of them: `mla_norm_inputs_per_row`
    charges the whole 8H there, and this term (charged to every MoE layer) also covers the
    MLA rope-key copy (0.25H in DeepSeek-V2-Lite) that stage lacks. Evidence: the backward peaks of the cpu-fake Mixtral-8x7B
    trace (8H of norm inputs against a 7.1H excess of the fitted attention stage) and of
    grid-moe-a3b-h512 TP1 (bench/results/moe_anatomy.txt; docs/memory-model.md#moe-routed-points).
    """
    return entries.optional_per_row(table, "moe_norm_inputs", widths)


def moe_routed_per_routed_row(table: CoefficientTable, widths: dict) -> float:
    """A recomputed MoE layer's routed rows when its backward reaches the experts (point A).

    Per routed row, everything the recomputed forward made is live as the gradient of the
    experts' concatenated output arrives: the permuted input rows, each expert's FC2 output
    and their concatenation (3 x 2H), and each expert's FC1 output and activation (4F + 6F,
    F = expert_ffn): 6H + 10F (the all-to-all dispatcher's sort copy is
    `moe_terms.permutation_per_routed_row`, charged beside it). Entry `moe_routed`
    (`per_routed_row`). Evidence: the backward peaks of multi-rank traces (grid-moe-h1024 and
    grid-moe-a3b-h512 at TP1: 8H + 10F with the sort copy) and cpu-fake traces (DeepSeek-V3,
    DeepSeek-V2-Lite: 6H + 10F) hold exactly these tensors (bench/results/moe_anatomy.txt;
    docs/memory-model.md#moe-routed-points).
    """
    return table.per_row("moe_routed", widths, key="per_routed_row")


# point B's units as the cpu-fake Mixtral-8x7B trace holds them (docs/memory-model.md#moe-routed-points),
# charged where a table has no `moe_expert_backward` entry of its own
EXPERT_BACKWARD_UNITS = {"per_routed_row": {"H": 2, "expert_ffn": 10}, "per_expert_row": {"expert_ffn": 14}}


def moe_expert_backward_per_routed_row(table: CoefficientTable, widths: dict, *, local_experts: int) -> float:
    """A recomputed MoE layer's routed rows while one local expert runs its backward (point B).

    By then the hidden-wide copies of point A are released but one (the gradient of the
    permuted input, 2H), every expert's FC1 output and activation are still live (10F), and the
    expert whose backward runs holds its fp32 activation gradients and their casts, 14F per
    row of that expert: rows x top_k / local_experts of them (balanced). Per routed row
    2H + 10F + 14F / local_experts; it binds over point A where F is wide against H (Mixtral:
    F = 3.5H). Entry `moe_expert_backward` (`per_routed_row`, and `per_expert_row` divided by
    the rank's local experts). A table without the entry (te-gpu: no GPU trace of this point)
    is charged the CPU trace's units, `EXPERT_BACKWARD_UNITS`, the only evidence of this point
    there is (not 0); beside te-gpu's fitted point A (4H + 18F) they bind only when a rank holds
    a single expert (14F / local_experts > 8F + 2H). Evidence: the decoder-only backward
    peak of the cpu-fake Mixtral-8x7B trace holds exactly these tensors
    (bench/results/moe_anatomy.txt; docs/memory-model.md#moe-routed-points).
    """
    entry = entries.entry(table, "moe_expert_backward", EXPERT_BACKWARD_UNITS)
    routed = sum(c * widths[w] for w, c in entry.get("per_routed_row", {}).items())
    expert = sum(c * widths[w] for w, c in entry.get("per_expert_row", {}).items())
    return float(routed + expert / max(local_experts, 1))


def moe_routing_metadata_per_routed_row(table: CoefficientTable) -> float:
    """The router's per-choice bookkeeping live at a recomputed MoE layer's backward: bytes per
    routed row (the int64 token indices of this layer's and the last recomputed layer's
    permutation, the int64 expert ids, the fp32 gathered probabilities and their copy: 32 B on
    the CPU). Entry `moe_routing_metadata` (`value`); 0 where a table lacks it (te-gpu).
    Evidence: grid-moe-a3b-h512 and grid-moe-h1024 TP1 backward peaks (masked_select, remainder,
    cat: 32 and 28 B per routed row; bench/results/moe_anatomy.txt).
    """
    return entries.optional_scalar(table, "moe_routing_metadata")


def norm_and_residual_per_row(table: CoefficientTable, widths: dict, *, sp_div: int) -> float:
    """Norm input gathered over TP (2H) plus residual and norm-output shards.

    Evidence: docs/memory-model.md#workspace (the gathered norm input 2H, norm shards).
    """
    return table.per_row("norm_gathered", widths) + table.per_row("residual_norm_shards", widths) / sp_div


def mla_norm_inputs_per_row(table: CoefficientTable, widths: dict, *, sp_div: int) -> float:
    """What a recomputed multi-latent-attention layer's two RMSNorms keep beside its MLA stage.

    The input and pre-MLP norms (a plain torch RMSNorm) keep their inputs upcast to fp32 for
    backward, 2 x 4H per row, live at the layer's backward peak. The fused-QKV
    `attention_stage` was fitted on layers that hold them (its coefficient carries them); the
    by-width MLA stage (`feature_terms.mla_stage_per_row`) does not, so this term charges them
    beside it. Hidden-wide: a shard under sequence parallelism. Entry `mla_norm_inputs`; 0 where
    a table lacks it (te-gpu: Transformer Engine's fused norms keep no fp32 copy). Evidence: the
    decoder-only backward peaks of the cpu-fake DeepSeek-V3 and DeepSeek-V2-Lite traces
    (`L*.input_layernorm` and `L*.pre_mlp_layernorm` `_to_copy` float32, 4H each;
    bench/results/moe_anatomy.txt; docs/memory-model.md#moe-routed-points).
    """
    return entries.optional_per_row(table, "mla_norm_inputs", widths) / sp_div


def qk_norm_per_row(table: CoefficientTable, widths: dict) -> float:
    """What an attention layer with query/key norms (Qwen3) keeps of them for backward.

    A plain torch RMSNorm keeps its input upcast to fp32: 4 bytes x (query + key widths) per
    row = 2 x qkv + 2 x core (queries are `core` wide, keys (qkv - core) / 2). Entry `qk_norm`,
    charged to attention layers whose geometry has query/key norms, both as retained activations
    and in the recomputed layer's workspace; 0 (neutral) in te-gpu, whose attention stage was
    sized on GPU traces (docs/memory-model.md#workspace). Evidence: cpu-fake traces (bench/results/validation_anatomy.txt:
    the q_layernorm and k_layernorm fp32 copies of qwen3-8b, absent in llama-3.1-8b).
    """
    return entries.optional_per_row(table, "qk_norm", widths)


def nograd_stage_per_row(table: CoefficientTable, widths: dict, mlp: MlpKind, *, ep_skew: float,
                         local_experts: int = 1) -> float:
    """A no-grad group's forward transient; groups run one after another.

    Dense: 6F + 6H per row (docs/memory-model.md#nograd-transient). MoE: `moe_nograd` where a table has it (per
    routed row x top-k x EP skew, plus per row: on the CPU the permuted rows, the experts'
    outputs and their concatenation, 3 x 2H per routed row, and the router's fp32
    probabilities; bench/results/validation_anatomy.txt); otherwise (te-gpu: nothing measures
    it) the full gradient-stage MoE workspace plus 6H (conservative).
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

    2 x (value heads/TP) x dk x dv x 4 bytes + (kernel - 1) x conv width/TP x 4 bytes; about
    4.3 MB for Qwen3.6-35B-A3B. Evidence: docs/memory-model.md#gdn-states (3.9 MB/segment measured).
    """
    state = table.scalar("gdn_state_bytes")
    heads = gdn.num_value_heads // tp
    return (2 * heads * gdn.key_head_dim * gdn.value_head_dim * state
            + (gdn.conv_kernel - 1) * (gdn.conv_width // tp) * state)


def retained_layer_per_row(table: CoefficientTable, widths: dict, mixer: MixerKind, mlp: MlpKind,
                           *, sp_div: int, selective: bool, ep_skew: float) -> float:
    """Activations one layer keeps for backward without full recompute (selective or none).

    Hidden-wide tensors live on sequence-parallel shards; a selective core-attention
    recompute drops the saved core output copy. Evidence: docs/memory-model.md#retained-activations
    (dense CP2, busiest CP rank's layout); MoE parts are structural (nothing measures them).
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

    Entry `retained_backward`: dense layers `per_row` x widths (the MLP's gradient tensors,
    4F on the CPU, plus rank-wide LoRA gradients); MoE layers `per_routed_row` x top-k x the EP
    skew (2H per routed row: the permuted rows' gradient) plus the same rank part. A table
    without the entry charges the recomputed layer's full stage workspace `stage` (te-gpu:
    nothing measures this transient on a GPU, so the full-recompute stage is the neutral bound).
    Evidence: the per-layer backward windows of cpu-fake no-recompute traces
    (bench/results/validation_anatomy.txt: 4F + 480 B for qwen3-8b, 4F + 672 B for the
    qwen3.8-27b hybrid's attention and GDN layers alike, 2H per routed row + 672 B for
    qwen3-30b-a3b). `per_row` may hold F (dense layers), shared_ffn (MoE layers) and rank.
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

    The layer's own activations build up as it runs, so at its peak (the MLP, last) it holds
    `value` x its retained bytes, plus the MLP's forward transient: `per_row` x widths for a
    dense MLP (F) and, for MoE, `per_routed_row` x top-k x EP skew plus `per_row` (experts,
    shared_ffn): on the CPU the permuted rows, the experts' outputs and their concatenation,
    3 x 2H per routed row. The walk charges the larger of this and the no-grad transient
    (`pricing.model`). Entry `retained_forward`; a table without it charges the no-grad
    transient alone (te-gpu: no GPU forward peak is measured; the head binds). Evidence:
    cpu-fake traces (bench/results/validation_anatomy.txt: the no-recompute decoder-only peak
    of qwen3-30b-a3b at the last layer's expert concatenation; dense layers peak at the final
    norm with every layer's activations live).
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

    Saved: what the final norm keeps for its backward from the head's forward until its own
    backward (a plain torch RMSNorm keeps its input upcast to fp32, 4H). Backward transient:
    its fp32 backward intermediates (about 20H on the CPU), which run after the head's
    backward has released the logits, so the walk charges the larger of this and the head's
    transient (`pricing.model`). Hidden-wide: a shard under sequence parallelism. Entries
    `final_norm` and `final_norm_backward`; 0 (neutral) in te-gpu, whose head terms were sized
    to cover the traced peaks. Evidence: cpu-fake traces (bench/results/validation_anatomy.txt:
    the final norm's fp32 input copy live at the head peak; the no-recompute decoder-only peak
    at the final norm's backward).
    """
    saved = entries.optional_per_row(table, "final_norm", widths)
    backward = entries.optional_per_row(table, "final_norm_backward", widths)
    return saved / sp_div, backward / sp_div


def head_per_row(table: CoefficientTable, widths: dict, head: str) -> tuple[float, float]:
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
    return (table.scalar(entry, "retained_per_row_vocab") * widths["vocab"] + beside,
            table.scalar(entry, "transient_per_row_vocab") * widths["vocab"])


def head_chunk_bytes(table: CoefficientTable, widths: dict, chunk_rows: int) -> float:
    """Transient of one logits chunk of `chunk_rows` rows (bf16 logits, fp32 upcast, fp32
    softmax/gradient, bf16 gradient); docs/memory-model.md#head-modes (512 rows by default)."""
    return chunk_rows * table.scalar("head_chunk", "per_row_vocab") * widths["vocab"]


def caller_per_logical_token(table: CoefficientTable) -> float:
    """Head buffers and the caller's loss memory per logical token: 6 KiB (docs/memory-model.md#caller).

    Kept live through the whole wave (conservative: its peak was measured, not its lifetime).
    """
    return table.scalar("caller_per_logical_token")


def first_execution_bytes(table: CoefficientTable) -> float:
    """A wave's first-execution transients while no profile is learned (docs/memory-model.md#first-execution)."""
    return table.scalar("first_execution")
