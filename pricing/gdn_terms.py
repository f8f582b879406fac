"""Terms of a GDN hybrid's layers retained under TP (selective and no recompute): what a Gated
DeltaNet layer with a dense MLP and a gated attention layer keep for their backward on one TP rank,
with and without sequence parallelism, and at TP1 (docs/memory-model.md#gdn-sp-retained).

The TP1-fitted retained GDN layer (`terms.retained_layer_per_row`, 44.5 H + per-width units in
torch-cpu) carries a hidden-wide part that is really per-head memory: it divides by TP only under SP
(so without SP it is over, 1.07-1.19 of the GDN grid's traces) and under SP it misses the gathered
inputs the layer keeps (so it is under, 0.97-0.99). The anatomy of the GDN grid
(bench/results/gdn_retained_anatomy.txt) shows the layer's memory splits exactly into a hidden-wide
part that TP does not shard and a per-head part that it does (223.8, 112.0 and 56.1 H per row at
TP1, TP2 and TP4); these terms price both parts from what Megatron-core allocates. The chunked
kernel's padding of each forward call's rows to a multiple of its chunk (`gdn_kernel_per_row`,
`chunk_padding_rows`) is charged by the walk at any TP and recompute mode, and the final norm's
backward at what it allocates (`final_norm_backward_per_row`); a second GDN geometry, on which
nothing here was read, checks them (bench/gdn_grid.py --heldout). Structural, in CPU
units (Megatron-core's torch chunked gated-delta rule, plain torch norms): `pricing.model` charges
them where the table carries the other SP structural terms (`layout_terms.SP_RETAINED`: torch-cpu);
te-gpu keeps its own retained GDN terms with the layout's credit. At TP1 CP1 they replace the
TP1-fitted layer too (fitted to the 27B's head ratios: 1.059 of the held-out geometry's TP1 cells,
1.003-1.004 with these terms), with the head's logits released before the final norm's backward
(`final_norm_backward_per_row`). Under full recompute the
recomputed GDN layer's backward point (`full_gdn_dense_point_per_row`, `full_gdn_moe_point_per_row`:
the recomputed mixer's saved tensors, the layer's hidden-wide storages and the larger of its MLP's
and input norm's backward points) replaces the TP1-fitted GDN stage on the same tables, at TP1
and TP > 1 (docs/memory-model.md#gdn-full-point). A GDN layer with a MoE MLP retained under TP
with SP is priced by what it holds too (`sp_retained_gdn_moe_layer_per_row`,
docs/memory-model.md#gdn-moe-sp-retained).

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
    a table without the `gdn_chunk_padding` entry). O(1)."""
    return int(entries.optional_scalar(table, PADDING_ENTRY, 1))


def gdn_kernel_per_row(gdn: GdnSpec, *, tp: int, chunk: int = CHUNK) -> float:
    """What Megatron-core's torch chunked gated-delta rule (`torch_chunk_gated_delta_rule`) keeps
    for its backward per row of its padded input, on one TP rank: the part of
    `gdn_mixer_retained_per_row` that runs on the rows padded to a multiple of the chunk.

    What memory, per rank (hv = value heads / TP, dk, dv their widths, C the chunk): the fp32
    operands, head-repeated to hv heads (the scaled query, the beta-weighted key and value, the
    padded key and value: 4 hv (3 dk + 2 dv)), per chunk the decayed query and key, the intra-chunk
    solved value, the cumulative-decay key and the new value (4 hv (3 dk + 2 dv)), the recurrent
    states (one [dk, dv] per chunk, the zero initial state included: 4 hv dk dv / C), the C-wide
    per-head matrices (24 hv C), the triangular solve's row and block clones (4/3 hv (C^2 - 1)),
    the padded gates, betas and decay sums (16 hv) and each chunk's state decay (4 hv / C).

    Formula: 24 hv dk + 16 hv dv + 4 hv dk dv / C + 24 hv C + 4/3 hv (C^2 - 1) + 16 hv + 4 hv / C.
    A wave of n chunks keeps n recurrent states (the anatomy's 31 updated states and the zero
    initial state at 2048 rows, TP4: one state per C rows, the initial one included), so the rule
    keeps this per padded row less 28,672 B per value head and wave (the last chunk's unsaved
    key decay and products). Evidence: docs/memory-model.md#gdn-sp-retained (`python
    bench/gdn_kernel_saved.py`: the rule's saved tensors alone, bf16 inputs, dk = dv = 128, each
    further chunk 841,988 B per value head, the formula's 64 rows; bench/results/
    gdn_retained_anatomy.txt, TP4: `add [1, 3, 128, 128]` 31 x and `zeros [1, 3, 128, 128]` once
    at 2048 rows). O(1).
    """
    hv = gdn.num_value_heads / tp
    dk, dv, c = gdn.key_head_dim, gdn.value_head_dim, chunk
    return (FP32 * hv * (6 * dk + 4 * dv) + FP32 * hv * dk * dv / c + 6 * FP32 * hv * c
            + FP32 / 3 * hv * (c * c - 1) + 4 * FP32 * hv + FP32 * hv / c)


def chunk_padding_rows(rows, chunk: float = CHUNK):
    """Rows the torch chunked gated-delta rule pads one forward call's gathered rows with (a
    number, or elementwise over an array of forward calls' rows).

    What memory: `torch_chunk_gated_delta_rule` pads the sequence dimension of its [b, s] input
    to a multiple of the chunk (`pad_size = (chunk - s % chunk) % chunk`) and runs every kernel
    tensor (`gdn_kernel_per_row`) on the padded rows. Megatron-core 0.16.1's GatedDeltaNet
    refuses packed sequences (`packed_seq_params` raises), so a wave's sequences run
    concatenated as one causal row (b = 1, s = the forward call's gathered rows: the tracers
    run GDN hybrids so) and the padding is per forward call, not per sequence; at most C - 1
    rows. (The FLA kernel a GPU runs masks its last chunk instead: no padded rows.)

    Formula: ceil(rows / C) x C - rows. Evidence: docs/memory-model.md#gdn-sp-retained (the
    held-out GDN cells of 1540 tokens, 60 rows of padding: 0.55 H per row under without it at
    TP2+SP). O(1).
    """
    if chunk <= 1:
        return 0.0
    return -(-rows // chunk) * chunk - rows


def gdn_mixer_retained_per_row(gdn: GdnSpec, *, tp: int, chunk: int = CHUNK) -> float:
    """What a GDN mixer keeps for its backward, per gathered row on one TP rank, as Megatron-core's
    torch chunked gated-delta rule allocates it (`megatron.core.ssm.gated_delta_net`).

    What memory, per rank (hv = value heads / TP, hk = key heads / TP, dk, dv their widths,
    C the chunk, conv = 2 hk dk + hv dv the conv channels): the kernel's fp32 operands, head-repeated
    to hv heads: the scaled query and the beta-weighted key and value (4 hv (2 dk + dv)), the padded
    key and value (4 hv (dk + dv)), per chunk the decayed query and key (8 hv dk), the intra-chunk
    solved value, the cumulative-decay key and the new value (4 hv (dk + 2 dv)), and one [dk, dv]
    recurrent state per chunk (4 hv dk dv / C); the C-wide per-head matrices (the decay mask's
    exp, tril and sum, the key products and their masked copies: 24 hv C) and the triangular
    solve's row and block clones (sum over i < C of 4 hv (i + i^2) / C = 4/3 hv (C^2 - 1)); the
    gated output norm (the gate's fp32 copy and SiLU, the norm's fp32 input, bf16 output and the
    bf16 product: 16 hv dv); the causal conv's input and output (bf16, 4 conv); the
    l2-normalised query and key before the head repeat (bf16, 4 hk dk); per-head scalars (gates,
    betas, decay sums, norm statistics, each chunk's state decay: at most 28 hv + 4 hv / C + 4 hk);
    the in and out projections' LoRA outputs (4 rank, charged by the caller, which knows the rank). The input projection's output
    is split and copied, not kept.

    Formula: 24 hv dk + 32 hv dv + 4 hv dk dv / C + 24 hv C + 4/3 hv (C^2 - 1) + 4 conv + 4 hk dk
    + 28 hv + 4 hv / C + 4 hk (`gdn_kernel_per_row` and what runs on the unpadded rows). Evidence:
    docs/memory-model.md#gdn-sp-retained (bench/results/gdn_retained_anatomy.txt,
    grid-gdn-h1024 no recompute, L0.self_attention at the whole step's backward peak: 194,563 B
    per row at TP1 against 194,897 B of the formula, 0.2 % over; its per-head tensors halve at TP2
    and quarter at TP4). O(1).
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

    What memory: the two norms' fp32 inputs (8H, on the rank's sequence shard under SP: 8H / TP),
    the inputs of the column-parallel in_proj and linear_fc1 (the norms' bf16 outputs, 2H each: all
    rows on every rank without SP; all-gathered and kept for the weight gradients with SP, not
    divided by TP either way), the MLP's FC1 output and activations at per-TP-rank width (10F: the
    2F-wide FC1 output and its LoRA sum, the F-wide gate, up and product), the four adapters'
    rank-wide outputs (8 rank) and the GDN mixer's per-head tensors
    (`gdn_mixer_retained_per_row`, all divided by TP).

    Formula: 4H + 8H / sp_div + 10F + 8 rank + gdn_mixer_retained_per_row (F per rank, rank the
    largest slot rank). Charged in place of the TP1-fitted retained GDN layer (whose 44.5 H
    hidden-wide coefficient is mostly per-head memory TP shards, and which is fitted to the 27B's
    head ratios: 1.059 of the held-out geometry's TP1 cells) where the table carries the SP
    structural terms, at TP > 1 and at TP1 CP1. Evidence: docs/memory-model.md#gdn-sp-retained
    (bench/results/gdn_retained_anatomy.txt: L0's hidden-wide storages 12H at TP1, TP2 and TP4;
    4H gathered + 8H / TP at TP2+SP and TP4+SP; the rest 223.8 / 112.0 / 56.1 H per row at TP1 /
    TP2 / TP4, with or without SP; TP1 cells of both GDN geometries 1.003-1.004, the real-width
    qwen3.8-27b cpu-fake cells 1.003-1.005). O(1).
    """
    h = widths["H"]
    return (4.0 * h + 8.0 * h / sp_div + 10.0 * widths["F"] + 8.0 * widths["rank"]
            + gdn_mixer_retained_per_row(gdn, tp=tp))



def retained_gdn_moe_layer_per_row(widths: dict, gdn: GdnSpec, *, routed: float) -> float:
    """What a GDN layer with a MoE MLP retains without full recompute at TP1, per row.

    What memory: the two norms' fp32 inputs (8H) and bf16 outputs (the in_proj's input and the
    MoE MLP's input, which the router and the dispatcher read: 2H each), the GDN mixer's per-head
    tensors (`gdn_mixer_retained_per_row`), the adapters' rank-wide outputs (8 rank), per routed
    row (`routed` = top_k x the EP load) every local expert's FC1 output and activations
    (10 expert_ffn), the shared expert's FC1 output and activations (10 shared_ffn: 8 traced, the
    dense MLP's count with the product charged), and the router's fp32 probabilities, routing map
    and its transpose (12 experts bytes). The dispatcher's permuted rows are released after the
    experts' forward: nothing hidden-wide per routed row.

    Formula: 12H + 8 rank + gdn_mixer_retained_per_row + routed x 10 expert_ffn + 10 shared_ffn
    + 12 experts. Charged in place of the TP1-fitted retained GDN layer with the fitted MoE MLP
    (`terms.retained_layer_per_row`, whose MoE part carries 1 H per routed row that this layer
    does not hold) where the table carries the SP structural terms (torch-cpu), at TP1 CP1.
    Evidence: docs/memory-model.md#gdn-sp-retained (bench/results/gdn_moe_retained_anatomy.txt: the
    GDN grid's GDN+MoE shape, grid-gdn-moe-h1024, TP1 none and selective, 2048 rows: L0 at the
    backward peak 219,451 B per row, 12.00 H hidden-wide and 202.31 H the rest: experts' `mm`
    [512, 512] and `add`, `mul`, `silu` [512, 256] x 4 routed rows, shared `mm` [2048, 512],
    `add`, `silu` [2048, 1, 256], router `_softmax`, `scatter`, `clone` 64 B each; the term
    220,305 B, 0.4 % over; bench/results/validation_anatomy.txt, qwen3.6-35b-a3b none at 1024
    rows: 597,208 B per GDN+MoE layer against 601,794 of the term). O(1).
    """
    h = widths["H"]
    return (12.0 * h + 8.0 * widths["rank"] + gdn_mixer_retained_per_row(gdn, tp=1)
            + routed * 10.0 * widths["expert_ffn"] + 10.0 * widths["shared_ffn"] + 12.0 * widths["experts"])


def sp_retained_gdn_moe_layer_per_row(widths: dict, gdn: GdnSpec, *, tp: int, etp: int, routed: float,
                                      forward: bool = False) -> float:
    """What a GDN layer with a MoE MLP retains without full recompute under TP with sequence
    parallelism, per gathered row on one TP rank, and (`forward`) its forward peak at the MoE
    combine.

    What memory: the in_proj's all-gathered input (the input norm's bf16 output, kept for the
    column-parallel weight gradient: 2H per gathered row, not divided by TP); on the rank's
    sequence shard the two norms' fp32 inputs (8H / TP) and the pre-MLP norm's bf16 output, which
    the router and the dispatcher read (2H / TP); the GDN mixer's per-head tensors at per-TP-rank
    heads (`gdn_mixer_retained_per_row`); the in and out projections' and the shared expert's
    adapters' rank-wide outputs (8 rank); per routed row its expert-TP group runs (`routed` =
    top_k x the EP load x the expert-TP share) every local expert's FC1 output and activations
    (10 expert_ffn, 1/ETP wide); the shared expert's FC1 output and activations at per-TP-rank
    width (10 shared_ffn: 8 traced); the router's fp32 probabilities and routing maps (12 experts
    bytes, charged per gathered row: they are on the shard). Nothing hidden-wide per routed row:
    the dispatcher's gathered and sorted rows are released after the experts' forward (as in an
    attention layer's, `moe_terms.sp_retained_moe_layer_per_row`). The layer's output (the
    residual the next layer reads) and the embedding's copy are the caller's
    (`forward_inputs_per_row`). At its forward peak, the MoE combine, it also holds, per routed
    row, the experts' concatenated output (2H), its fp32 copy (4H), the reduce-scatter's fp32
    output shard (4H / ETP) and the rank's permuted rows of its own shard (2H / ETP), the
    router's fp32 probabilities (8 experts) and the shared expert's reduce-scattered output
    (2H / TP); the dispatcher's TP gather and sort copies are the caller's
    (`moe_terms.routed_extra_per_row`), as for an attention layer.

    Formula: 2H + 10H / TP + 8 rank + gdn_mixer_retained_per_row(tp) + routed x 10 expert_ffn
    + 10 shared_ffn + 12 experts (at TP1 `retained_gdn_moe_layer_per_row`'s 12H + ...); `forward`
    adds routed x (6H + 6H / ETP; 6H at ETP1) + 8 experts (+ 2H / TP with a shared expert).
    Structural, in CPU units: `pricing.model` charges it in place of the TP1-fitted layer where
    the table carries the SP structural terms (torch-cpu); te-gpu keeps its fitted retained GDN
    layer charged unsharded with the layout's credit. Evidence:
    docs/memory-model.md#gdn-moe-sp-retained (bench/results/gdn_moe_sp_retained_anatomy.txt:
    grid-gdn-moe-h1024 TP2+SP and TP4+SP none and selective, 2048 rows, L0 at the backward peak
    110,791.5 and 56,462.0 B per row against 111,336 and 56,852 of the term, 2H gathered
    (`in_proj` `empty`) and 10H / TP on the shard; the forward peak at L1's combine:
    `L1.mlp` `_to_copy` [8192, 1024] fp32, `empty_like` [4096, 1024] fp32, `index_select`
    [4096, 1024], `L1.mlp.experts` `cat` [8192, 1024] at TP2+SP). O(1).
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

    What memory: the layer's input (the layer below's output: the bf16 residual its second add
    reads, 2H, on the rank's shard under SP) and the embedding's output copy (`model` `clone`,
    2H / sp_div, live through the step). Neither is retained for the backward (a layer's norm
    keeps its own fp32 copy), so the structural layer terms leave them out; the TP1-fitted
    forward and layer terms absorbed them. They bind where a layer's forward is the step's peak
    (a MoE MLP's combine on a small vocabulary).

    Formula: 4H / sp_div. Evidence: docs/memory-model.md#gdn-sp-retained (the GDN+MoE shape
    grid-gdn-moe-h1024, TP1 none, 2048 rows: at the forward peak, in L1's MoE, L0 holds 14.00 H
    hidden-wide against its 12.00 H at the backward peak, and `model` `clone` [2048, 1, 1024]
    2.00 H outside the layers, bench/results/gdn_moe_retained_anatomy.txt; without them that cell
    is priced at 0.989 of its peak, 0.983 with the TP1-fitted layer). O(1).
    """
    return 4.0 * widths["H"] / sp_div

def output_gate_per_row(widths: dict) -> float:
    """The fp32 sigmoid a gated attention layer keeps of its output gate, per gathered row.

    What memory: Qwen3.5/3.8's attention multiplies its core output by sigmoid(gate); the gate is
    computed in fp32 ([rows, core / TP] fp32, 4 core bytes at per-TP-rank width) and saved for the
    multiply's backward. The SP retained layer (`layout_terms.sp_retained_layer_per_row`, traced on
    ungated attention) leaves it out; the gate's bf16 half is already in its 3 qkv (qkv counts the
    gate). The same multiply saves the core output, so selective recompute of core attention frees
    nothing of a gated layer (`pricing.model` charges no selective discount there at TP > 1).

    Formula: 4 x core (per-TP-rank width). Evidence: docs/memory-model.md#gdn-sp-retained
    (bench/results/gdn_retained_anatomy.txt: `L1.self_attention sigmoid` [rows, 1024 / TP] float32
    at TP1, TP2 and TP4, [2048, 512] at TP2+SP; the L1 storages of selective and no recompute equal
    to 0.03 H per row). O(1).
    """
    return FP32 * widths["core"]


def rope_cache_entry_per_row(rope_per_row: float) -> float:
    """The RoPE cache entry of the wave's longest sequence at CP1, per rank row, where the
    structural hybrid layer terms price the layers.

    What memory: Megatron's `RotaryEmbedding.forward` keeps the frequencies of the longest packed
    sequence, [max_seqlen, rotary dim] fp32 (`rope_per_row` = 4 x rotary dim bytes per row,
    `pipeline.rope_cache_per_row`), live from the first layer's forward to the end of the step.
    The TP1-fitted layer terms absorb it (`layout_terms.cp_rope_cache_per_row` charges only the
    rows CP adds); `tp_retained_gdn_layer_per_row` replaces a fitted layer by what the layer itself
    holds, so the entry is charged once per wave beside it (the longest sequence is at most the
    wave's rows: a GDN hybrid's wave runs as one causal row).

    Formula: rope_per_row per row, once per wave (layer 0's retained memory). Evidence:
    docs/memory-model.md#gdn-sp-retained (bench/results/gdn_retained_anatomy.txt: `rotary_pos_emb
    cat` [2048, 128] float32, 512 B per row, live at every peak of every cell). O(1).
    """
    return rope_per_row


def final_norm_backward_per_row(widths: dict, *, sp_div: int) -> float:
    """The decoder's final norm's backward intermediates per gathered row, where the structural
    hybrid layer terms price the layers.

    What memory: a plain torch RMSNorm's backward (Megatron-core's torch norm on the CPU) makes
    fp32 intermediates of its [rows, H] input: three products (12H), the quotient (4H) and the
    power (4H), on the rank's sequence shard under SP. The torch-cpu table fits this point at
    0.9858 of that unit (`final_norm_backward`, 19.72 H, fitted on TP1 cells whose fitted layers
    absorb the 0.28 H); `tp_retained_gdn_layer_per_row` replaces those layers by what they hold,
    so the norm is charged what it allocates beside them. At TP1 the fitted head point also keeps
    the logits beside the norm's backward (`layout_terms.head_point_transient`, released=False),
    which covered what the fitted layers fall short of; beside these layers `pricing.model`
    releases them at TP1 as at TP > 1, as the anatomy shows (the logits are freed by the loss's
    backward before the norm's backward runs).

    Formula: 20 H / sp_div. Evidence: docs/memory-model.md#gdn-sp-retained
    (bench/results/gdn_heldout_anatomy.txt, grid-gdn-h768 TP4 none at its backward peak: `mul`
    [1540, 1, 768] fp32 9216 B per row, `div` and `pow` 3072 each, 20 H; with the fitted 19.72 H
    that cell was 0.06 H per row under; bench/results/gdn_retained_anatomy.txt: 26 H hidden-wide
    outside the layers on every cell without SP, 6.5 H at TP4+SP; at TP1's backward peak 26 H and
    the 0.52 H RoPE entry outside the layers, no logits: 7.5 H per row over, 1.026 of the GDN grid's
    TP1 cells, with them charged). O(1).
    """
    return 20.0 * widths["H"] / sp_div


# the wave's int64 inputs live through the step (token ids, labels, packed positions: 3 x 8 B)
INPUT_IDS_PER_ROW = 24.0


def full_gdn_held_per_row(widths: dict, gdn: GdnSpec, *, tp: int, sp_div: int) -> float:
    """What a GDN layer recomputed under full recompute holds at every point of its backward,
    per gathered row on one TP rank (the part common to `full_gdn_dense_point_per_row`,
    `full_gdn_moe_point_per_row` and `full_gdn_norm_point_per_row`).

    What memory: the recomputed mixer's saved tensors (`gdn_mixer_retained_per_row`, at per-TP-rank
    heads: they stay live through the layer's whole backward, its input norm's included), the
    in and out projections' LoRA outputs ([rows, rank] bf16 each: 4 rank), the in_proj's input
    (the input norm's bf16 output: all rows on every rank without SP, all-gathered and kept for the
    weight gradient with SP, 2H either way), the two norms' fp32 inputs and the residual sum
    (8H + 2H, on the rank's shard under SP) and the wave's int64 inputs (24 B). The walk adds the
    boundaries, the input gradient, the pending adapter gradients, the GDN states and the kernel's
    padding rows (`pad_point`).

    Formula: gdn_mixer_retained_per_row + 4 rank + 2H + 10H / sp_div + 24. Evidence:
    docs/memory-model.md#gdn-full-point (bench/results/gdn_full_anatomy.txt: grid-gdn-h1024 TP1
    and TP4+SP full, the layer's per-head storages equal to the retained mixer's to 0.2 %;
    bench/results/gdn_heldout_anatomy.txt, grid-gdn-h768 TP4 full: the mixer's tensors live at the
    input norm's backward). O(1).
    """
    h = widths["H"]
    return (gdn_mixer_retained_per_row(gdn, tp=tp) + 4.0 * widths["rank"] + 2.0 * h + 10.0 * h / sp_div
            + INPUT_IDS_PER_ROW)


def full_gdn_norm_point_per_row(widths: dict, gdn: GdnSpec, *, tp: int, sp_div: int,
                                rope_per_row: float) -> float:
    """A GDN layer recomputed under full recompute at its input norm's backward, the layer's last
    point, per gathered row (the MLP's tensors are released by then; the mixer's are not).

    What memory: what the layer holds throughout (`full_gdn_held_per_row`), the norm's fp32
    backward intermediates (three products, a quotient and a power of [rows, H]: 20H, on the
    rank's shard under SP, replicated on every TP rank without it) and the RoPE cache entry of the
    wave's longest sequence (`rope_per_row`, live from the first layer's forward on).

    Formula: full_gdn_held_per_row + 20H / sp_div + rope_per_row. Evidence:
    docs/memory-model.md#gdn-full-point (bench/results/gdn_heldout_anatomy.txt, grid-gdn-h768 TP4
    full at its backward peak: `mul` [1540, 1, 768] fp32 9216 B per row, `div` and `pow` 3072
    each, beside L0's 12H and per-head storages 44.28 H: the mixer's). O(1).
    """
    return (full_gdn_held_per_row(widths, gdn, tp=tp, sp_div=sp_div) + 20.0 * widths["H"] / sp_div
            + rope_per_row)


def full_gdn_dense_point_per_row(widths: dict, gdn: GdnSpec, *, tp: int, sp_div: int,
                                 rope_per_row: float) -> float:
    """A GDN layer with a dense MLP recomputed under full recompute, at its backward peak, per
    gathered row on one TP rank (the larger of its MLP's backward and its input norm's backward):
    in place of the TP1-fitted stage sum and the `full_bare` layout residual.

    What memory: what the layer holds throughout (`full_gdn_held_per_row`) and the RoPE cache
    entry (`rope_per_row`), and at the MLP's backward the FC1 input (the pre-MLP norm's bf16
    output, 2H: all rows, gathered under SP), the FC1 and FC2 adapters' rank-wide outputs
    (4 rank) and the FC1 output and activations at per-TP-rank width, either
    - after the output projection's backward: the 2F-wide FC1 output and its LoRA sum, the SiLU and
      the product's input (8F) and the gradients of the activation from the base and LoRA paths
      and their sum (6F): 14F; or
    - during it: the FC1 output and activations (10F), the row-parallel LoRA output at full rows
      (its matmul and scale outputs, 4H), the output projection's output (the reduce-scatter
      output under SP: 2H / sp_div) and under SP the pre-MLP norm's output shard (2H / TP), as
      `layout_terms.sp_fc2_point_per_row`;
    or, at the input norm's backward, `full_gdn_norm_point_per_row`.

    Formula: held + rope + max(2H + 4 rank + 14F, 2H + 4 rank + 10F + 4H + 2H / sp_div
    + 2H [SP] / TP, 20H / sp_div). Evidence: docs/memory-model.md#gdn-full-point
    (bench/results/gdn_full_anatomy.txt: grid-gdn-h1024 TP1, TP2 and TP2+SP full peak after FC2's
    backward, 8F saved and 6F of gradients beside the mixer, the FC1 input and 12H hidden-wide on
    all rows (TP1, TP2) or 12H / TP on the shard (TP2+SP); TP4+SP full in FC2's backward, 8H
    gathered, 14H / TP, 10F; bench/results/gdn_heldout_anatomy.txt:
    grid-gdn-h768 TP4 full at the input norm's backward; qwen3.8-27b at real width, 4 layers, full,
    2048 rows, ranks 8 and 64 (`bench/validation_study.py` anatomy): layer 2's `in_proj`,
    `out_proj` and `linear_fc1` [2048, rank] outputs at its backward peak). O(1).
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
    gathered row on one TP rank: every tensor but the routed rows, the router and a shared expert
    (which the caller adds: `terms.moe_routed_stage_per_row`, `moe_terms.sp_shared_expert_point_per_row`),
    as `moe_terms.sp_layer_point_per_row` is for an attention layer.

    What memory: what the layer holds throughout (`full_gdn_held_per_row`), the pre-MLP norm's bf16
    output (2H / sp_div: the MoE MLP keeps no gathered input, its hidden-wide tensors are its
    routed rows'), a second residual sum made by the layer's forward pass (2H / sp_div, live at
    the MoE backward, as it is not at a dense MLP's) and the RoPE cache entry (`rope_per_row`).

    Formula: full_gdn_held_per_row + 4H / sp_div + rope_per_row. Evidence:
    docs/memory-model.md#gdn-full-point (bench/results/gdn_full_anatomy.txt, grid-gdn-moe-h1024
    full at layer 0's MoE backward: hidden-wide 16H per row at TP1, 2H gathered (`in_proj`
    `empty`) and 14H / TP on the rank's shard at TP2+SP and TP4+SP, two `L0` `add` among them;
    the mixer's per-head storages). O(1).
    """
    return (full_gdn_held_per_row(widths, gdn, tp=tp, sp_div=sp_div) + 4.0 * widths["H"] / sp_div
            + rope_per_row)


def full_gdn_shared_expert_per_row(widths: dict, *, sp_div: int) -> float:
    """A MoE MLP's shared expert at a recomputed GDN layer's MoE backward point
    (`full_gdn_moe_point_per_row`), per gathered row on one TP rank; 0 without one.

    What memory: the shared expert (a dense MLP of TP-sharded width `shared_ffn`, on the gathered
    rows) has not run its backward yet at the routed experts' backward: it holds its FC1 output
    and activations (the 2 shared_ffn-wide FC1 output, the gate's SiLU and the product's input:
    8 shared_ffn traced; 10 shared_ffn charged, the dense MLP's count with the product) and its
    output projection's output, reduce-scattered to the rank's shard under SP (2H / sp_div). Its
    gathered input is the routed experts' (`index_select`, in the routed stage), and its
    row-parallel LoRA output is released after the forward's reduce-scatter. An attention layer's
    shared expert, traced since (`moe_terms.sp_shared_expert_point_per_row`,
    docs/memory-model.md#moe-shared-sp), holds the same: 2H / TP + 10 shared_ffn.

    Formula: 2H / sp_div + 10 shared_ffn. Evidence: docs/memory-model.md#gdn-full-point
    (bench/results/gdn_full_anatomy.txt, grid-gdn-moe-h1024 full at layer 0's backward peak:
    `shared_experts.linear_fc2` `empty` [512, 1, 1024], `linear_fc1` `mm` [2048, 128], `add` and
    `silu` [2048, 1, 64] at TP4+SP, 1,024 B per row; 2,048 at TP2+SP). O(1).
    """
    if not widths["shared_ffn"]:
        return 0.0
    return 2.0 * widths["H"] / sp_div + 10.0 * widths["shared_ffn"]
