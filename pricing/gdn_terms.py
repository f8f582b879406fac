"""Terms of a GDN hybrid's layers priced by what they hold (torch-cpu structural units): a Gated
DeltaNet layer with a dense or MoE MLP and a gated attention layer, retained (selective and no
recompute; TP1 and TP > 1, with and without SP) and recomputed (full recompute).

The TP1-fitted retained GDN layer (`terms.retained_layer_per_row`) does not follow TP: its
hidden-wide part is mostly per-head memory. These terms split a layer into the hidden-wide part TP
does not shard and the per-head part it does, as Megatron-core allocates them; `pricing.model`
charges them where the table carries the SP structural terms (`layout_terms.SP_RETAINED`), and
te-gpu keeps its own GDN terms with the layout's credit. Evidence and validation:
docs/memory-model.md#gdn-sp-retained (retained), docs/memory-model.md#gdn-full-point (full
recompute), docs/memory-model.md#gdn-moe-sp-retained (GDN+MoE under TP+SP).

All functions are O(1) and torch-free.
"""

from __future__ import annotations

from . import entries
from .geometry import GdnSpec

BF16, FP32 = 2, 4
# Megatron-core's `torch_chunk_gated_delta_rule` default chunk (rows per chunk of the recurrence)
CHUNK = 64
# the coefficient-table entry naming the chunk a backend's GDN kernel pads a forward call's rows
# to (torch-cpu: 64; a table without it, te-gpu's FLA kernel, pads nothing)
PADDING_ENTRY = "gdn_chunk_padding"


def chunk_of(table) -> int:
    """The chunk the table's GDN kernel pads each forward call's rows to a multiple of (1: none,
    a table without the `gdn_chunk_padding` entry). O(1).
    """
    return int(entries.optional_scalar(table, PADDING_ENTRY, 1))


def gdn_kernel_per_row(gdn: GdnSpec, *, tp: int, chunk: int = CHUNK) -> float:
    """What Megatron-core's torch chunked gated-delta rule (`torch_chunk_gated_delta_rule`) keeps
    for its backward per padded row on one TP rank (hv = value heads / TP, dk, dv their widths,
    C the chunk).

    Terms: the fp32 head-repeated operands (scaled query, beta-weighted key and value, padded key and
    value) and the per-chunk decayed query and key, solved value, decay key and new value
    (8 hv (3 dk + 2 dv)); one [dk, dv] recurrent state per chunk (4 hv dk dv / C); the C-wide
    per-head matrices (24 hv C); the triangular solve's clones (4/3 hv (C^2 - 1)); gates, betas and
    decay sums (16 hv) and each chunk's state decay (4 hv / C).

    Formula: 24 hv dk + 16 hv dv + 4 hv dk dv / C + 24 hv C + 4/3 hv (C^2 - 1) + 16 hv + 4 hv / C.
    Priced per padded row because the rule keeps one state per chunk. See
    docs/memory-model.md#gdn-sp-retained. O(1).
    """
    hv = gdn.num_value_heads / tp
    dk, dv, c = gdn.key_head_dim, gdn.value_head_dim, chunk
    return (FP32 * hv * (6 * dk + 4 * dv) + FP32 * hv * dk * dv / c + 6 * FP32 * hv * c
            + FP32 / 3 * hv * (c * c - 1) + 4 * FP32 * hv + FP32 * hv / c)


def chunk_padding_rows(rows, chunk: float = CHUNK):
    """Rows the torch chunked gated-delta rule pads one forward call's gathered rows with (a
    number, or elementwise over an array of forward calls' rows).

    Formula: ceil(rows / C) x C - rows (at most C - 1). Megatron-core's GatedDeltaNet takes no
    packed sequences, so a wave runs as one causal row and the padding is per forward call; the
    kernel's tensors (`gdn_kernel_per_row`) run on the padded rows (FLA's GPU kernel pads nothing).
    See docs/memory-model.md#gdn-sp-retained. O(1).
    """
    if chunk <= 1:
        return 0.0
    return -(-rows // chunk) * chunk - rows


def gdn_mixer_retained_per_row(gdn: GdnSpec, *, tp: int, chunk: int = CHUNK) -> float:
    """What a GDN mixer keeps for its backward, per gathered row on one TP rank, as Megatron-core's
    torch chunked gated-delta rule allocates it (hv = value heads / TP, hk = key heads / TP,
    conv = 2 hk dk + hv dv the conv channels).

    Terms: the chunked rule's tensors (`gdn_kernel_per_row`); the gated output norm (16 hv dv); the
    causal conv's input and output (bf16, 4 conv); the l2-normalised query and key (bf16, 4 hk dk);
    per-head scalars (12 hv + 4 hk). The projections' LoRA outputs are the caller's.

    Formula: 24 hv dk + 32 hv dv + 4 hv dk dv / C + 24 hv C + 4/3 hv (C^2 - 1) + 4 conv + 4 hk dk
    + 28 hv + 4 hv / C + 4 hk. Every per-head tensor divides by TP. See
    docs/memory-model.md#gdn-sp-retained. O(1).
    """
    hv, hk = gdn.num_value_heads / tp, gdn.num_key_heads / tp
    dk, dv = gdn.key_head_dim, gdn.value_head_dim
    conv = 2 * hk * dk + hv * dv
    # the chunked rule's own tensors, then the gated norm, the conv, the l2-normed query and key
    return (gdn_kernel_per_row(gdn, tp=tp, chunk=chunk) + 4 * FP32 * hv * dv + 2 * BF16 * conv
            + 2 * BF16 * hk * dk + 3 * FP32 * hv + FP32 * hk)


def tp_retained_gdn_layer_per_row(widths: dict, gdn: GdnSpec, *, tp: int, sp_div: int) -> float:
    """What a GDN layer with a dense MLP retains without full recompute, per gathered row on one TP
    rank (TP1 included).

    Terms: the column-parallel in_proj's and linear_fc1's inputs (2H each, all rows on every rank:
    gathered and kept under SP), the two norms' fp32 inputs (8H / sp_div), the MLP's FC1 output and
    activations (10F per rank), the four adapters' rank-wide outputs (8 rank) and the mixer's
    per-head tensors (`gdn_mixer_retained_per_row`).

    Formula: 4H + 8H / sp_div + 10F + 8 rank + gdn_mixer_retained_per_row. Charged in place of the
    TP1-fitted retained GDN layer, whose hidden-wide coefficient is per-head memory TP shards. See
    docs/memory-model.md#gdn-sp-retained. O(1).
    """
    h = widths["H"]
    return (4.0 * h + 8.0 * h / sp_div + 10.0 * widths["F"] + 8.0 * widths["rank"]
            + gdn_mixer_retained_per_row(gdn, tp=tp))



def retained_gdn_moe_layer_per_row(widths: dict, gdn: GdnSpec, *, routed: float) -> float:
    """What a GDN layer with a MoE MLP retains without full recompute at TP1, per row.

    Terms: the two norms' fp32 inputs and bf16 outputs (12H), the adapters' outputs (8 rank), the
    mixer's per-head tensors (`gdn_mixer_retained_per_row`), per routed row (`routed` = top_k x the
    EP load) every local expert's FC1 output and activations (10 expert_ffn), the shared expert's
    (10 shared_ffn) and the router's probabilities and routing maps (12 experts). The dispatcher's
    permuted rows are released after the experts' forward.

    Formula: 12H + 8 rank + gdn_mixer_retained_per_row + routed x 10 expert_ffn + 10 shared_ffn
    + 12 experts. Charged in place of the TP1-fitted GDN layer with the fitted MoE MLP at TP1 CP1.
    See docs/memory-model.md#gdn-sp-retained. O(1).
    """
    h = widths["H"]
    return (12.0 * h + 8.0 * widths["rank"] + gdn_mixer_retained_per_row(gdn, tp=1)
            + routed * 10.0 * widths["expert_ffn"] + 10.0 * widths["shared_ffn"] + 12.0 * widths["experts"])


def sp_retained_gdn_moe_layer_per_row(widths: dict, gdn: GdnSpec, *, tp: int, etp: int, routed: float,
                                      forward: bool = False) -> float:
    """What a GDN layer with a MoE MLP retains without full recompute under TP with sequence
    parallelism, per gathered row on one TP rank, and (`forward`) its forward peak at the MoE
    combine.

    Terms: the in_proj's gathered input (2H), on the rank's shard the norms' fp32 inputs and the
    pre-MLP norm's bf16 output (10H / TP), the mixer's per-head tensors at per-TP-rank heads, the
    adapters' outputs (8 rank), per routed row its expert-TP group runs (`routed` = top_k x the EP
    load x the expert-TP share) the local experts' FC1 output and activations (10 expert_ffn, 1/ETP
    wide), the shared expert's (10 shared_ffn) and the router's maps (12 experts). At the combine it
    also holds, per routed row, the experts' output and its fp32 copies (6H + 6H / ETP), the router's
    fp32 probabilities (8 experts) and the shared expert's output shard (2H / TP). The layer's
    output and the embedding's copy are the caller's (`forward_inputs_per_row`).

    Formula: 2H + 10H / TP + 8 rank + gdn_mixer_retained_per_row(tp) + routed x 10 expert_ffn
    + 10 shared_ffn + 12 experts; `forward` adds routed x (6H + 6H / ETP; 6H at ETP1) + 8 experts
    (+ 2H / TP with a shared expert). Charged in place of the TP1-fitted layer on torch-cpu. See
    docs/memory-model.md#gdn-moe-sp-retained. O(1).
    """
    h = widths["H"]
    out = (2.0 * h + 10.0 * h / tp + 8.0 * widths["rank"] + gdn_mixer_retained_per_row(gdn, tp=tp)
           + routed * 10.0 * widths["expert_ffn"] + 10.0 * widths["shared_ffn"] + 12.0 * widths["experts"])
    if forward:
        out += routed * (6.0 * h + (6.0 * h / etp if etp > 1 else 0.0)) + 8.0 * widths["experts"]
        if widths["shared_ffn"]:
            out += 2.0 * h / tp
    return out


def forward_inputs_per_row(widths: dict, *, sp_div: int) -> float:
    """What a retained layer's forward holds beside its own tensors and the layers below it, per
    gathered row, where the structural GDN layer terms price the layers.

    Terms: the layer's input (the residual its second add reads, 2H / sp_div) and the embedding's
    output copy (2H / sp_div). Neither is retained for the backward, so the layer terms leave them
    out; they bind where a layer's forward is the step's peak (a MoE combine on a small vocabulary).

    Formula: 4H / sp_div. See docs/memory-model.md#gdn-sp-retained. O(1).
    """
    return 4.0 * widths["H"] / sp_div

def output_gate_per_row(widths: dict) -> float:
    """The fp32 sigmoid a gated attention layer keeps of its output gate, per gathered row.

    Formula: 4 x core (per-TP-rank width). The SP retained layer
    (`layout_terms.sp_retained_layer_per_row`, traced on ungated attention) leaves it out; the same
    multiply saves the core output, so selective recompute frees nothing of a gated layer. See
    docs/memory-model.md#gdn-sp-retained. O(1).
    """
    return FP32 * widths["core"]


def rope_cache_entry_per_row(rope_per_row: float) -> float:
    """The RoPE cache entry of the wave's longest sequence at CP1, per rank row, where the
    structural hybrid layer terms price the layers.

    Formula: rope_per_row (4 x rotary dim, fp32) per row, once per wave. Megatron's
    `RotaryEmbedding.forward` keeps it from the first layer's forward to the end of the step; the
    fitted layers these terms replace absorbed it. See docs/memory-model.md#gdn-sp-retained. O(1).
    """
    return rope_per_row


def final_norm_backward_per_row(widths: dict, *, sp_div: int) -> float:
    """The decoder's final norm's backward intermediates per gathered row, where the structural
    hybrid layer terms price the layers.

    Formula: 20 H / sp_div (a plain torch RMSNorm's fp32 products, quotient and power of its
    [rows, H] input). Charged at what it allocates, not the table's fitted `final_norm_backward`,
    whose fit the fitted layers absorbed; beside these layers the logits are released before it at
    TP1 as at TP > 1. See docs/memory-model.md#gdn-sp-retained. O(1).
    """
    return 20.0 * widths["H"] / sp_div


# the wave's int64 inputs live through the step (token ids, labels, packed positions: 3 x 8 B)
INPUT_IDS_PER_ROW = 24.0


def full_gdn_held_per_row(widths: dict, gdn: GdnSpec, *, tp: int, sp_div: int) -> float:
    """What a GDN layer recomputed under full recompute holds at every point of its backward,
    per gathered row on one TP rank (common to the `full_gdn_*_point_per_row` terms).

    Terms: the recomputed mixer's saved tensors (`gdn_mixer_retained_per_row`), the in and out
    projections' LoRA outputs (4 rank), the in_proj's input (2H, gathered under SP), the two norms'
    fp32 inputs and the residual sum (10H / sp_div) and the wave's int64 inputs (24 B). The walk
    adds boundaries, input gradient, pending gradients, GDN states and padding rows.

    Formula: gdn_mixer_retained_per_row + 4 rank + 2H + 10H / sp_div + 24. See
    docs/memory-model.md#gdn-full-point. O(1).
    """
    h = widths["H"]
    return (gdn_mixer_retained_per_row(gdn, tp=tp) + 4.0 * widths["rank"] + 2.0 * h + 10.0 * h / sp_div
            + INPUT_IDS_PER_ROW)


def full_gdn_norm_point_per_row(widths: dict, gdn: GdnSpec, *, tp: int, sp_div: int,
                                rope_per_row: float) -> float:
    """A GDN layer recomputed under full recompute at its input norm's backward, the layer's last
    point, per gathered row (the MLP's tensors are released by then; the mixer's are not).

    Formula: full_gdn_held_per_row + 20H / sp_div (the norm's fp32 backward intermediates) +
    rope_per_row. See docs/memory-model.md#gdn-full-point. O(1).
    """
    return (full_gdn_held_per_row(widths, gdn, tp=tp, sp_div=sp_div) + 20.0 * widths["H"] / sp_div
            + rope_per_row)


def full_gdn_dense_point_per_row(widths: dict, gdn: GdnSpec, *, tp: int, sp_div: int,
                                 rope_per_row: float) -> float:
    """A GDN layer with a dense MLP recomputed under full recompute, at its backward peak, per
    gathered row on one TP rank: in place of the TP1-fitted stage sum and the `full_bare` residual.

    Terms: held (`full_gdn_held_per_row`) + rope_per_row, plus the largest of
    - after FC2's backward: the FC1 input (2H) and adapters (4 rank), the FC1 output and
      activations (8F) and the activation gradients (6F);
    - in FC2's backward: 2H + 4 rank + 10F, the full-row LoRA output (4H), the output projection's
      output (2H / sp_div) and under SP the pre-MLP norm's shard (2H / TP), as
      `layout_terms.sp_fc2_point_per_row`;
    - the input norm's backward (20H / sp_div, `full_gdn_norm_point_per_row`).

    Formula: held + rope + max(2H + 4 rank + 14F, 2H + 4 rank + 10F + 4H + 2H / sp_div
    + 2H [SP] / TP, 20H / sp_div). See docs/memory-model.md#gdn-full-point. O(1).
    """
    h, f = widths["H"], widths["F"]
    # the FC1 input (gathered under SP) with the FC1 and FC2 adapters' rank-wide outputs
    fc1_input = 2.0 * h + 4.0 * widths["rank"]
    after_fc2 = fc1_input + 14.0 * f
    # in FC2's backward: its full-row LoRA output, its output (the reduce-scatter's shard under
    # SP) and, under SP, the pre-MLP norm's output shard beside its gathered copy
    in_fc2 = fc1_input + 10.0 * f + 4.0 * h + 2.0 * h / sp_div + (2.0 * h / sp_div if sp_div > 1 else 0.0)
    held = full_gdn_held_per_row(widths, gdn, tp=tp, sp_div=sp_div) + rope_per_row
    return held + max(after_fc2, in_fc2, 20.0 * h / sp_div)


def full_gdn_moe_point_per_row(widths: dict, gdn: GdnSpec, *, tp: int, sp_div: int,
                               rope_per_row: float) -> float:
    """A GDN layer with a MoE MLP recomputed under full recompute at its MoE backward point, per
    gathered row on one TP rank, less the routed rows, the router and a shared expert (the caller's:
    `terms.moe_routed_stage_per_row`, `moe_terms.sp_shared_expert_point_per_row`).

    Formula: full_gdn_held_per_row + 4H / sp_div + rope_per_row (the pre-MLP norm's output and a
    second residual sum live at the MoE backward). See docs/memory-model.md#gdn-full-point. O(1).
    """
    return (full_gdn_held_per_row(widths, gdn, tp=tp, sp_div=sp_div) + 4.0 * widths["H"] / sp_div
            + rope_per_row)


def full_gdn_shared_expert_per_row(widths: dict, *, sp_div: int) -> float:
    """A MoE MLP's shared expert at a recomputed GDN layer's MoE backward point
    (`full_gdn_moe_point_per_row`), per gathered row on one TP rank; 0 without one.

    Formula: 2H / sp_div + 10 shared_ffn (its FC1 output and activations, and its output projection's
    output on the rank's shard; it has not run its backward yet). The same as an attention layer's
    (`moe_terms.sp_shared_expert_point_per_row`). See docs/memory-model.md#gdn-full-point. O(1).
    """
    if not widths["shared_ffn"]:
        return 0.0
    return 2.0 * widths["H"] / sp_div + 10.0 * widths["shared_ffn"]
