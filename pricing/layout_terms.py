"""Terms that scale with the parallel layout: what TP (with or without sequence parallelism) and
CP leave unsharded, fitted per traced layout class (docs/memory-model.md#layout-residuals).

The structural sharding lives in the per-rank widths (`pricing.model.layer_widths`: F, qkv,
core, vocab divided by TP), the sequence-parallel divisor of hidden-wide terms (`sp_div`) and
the busiest CP rank's rows (`pricing.price.rank_rows`). What that structure misses is measured
by multi-rank CPU traces (bench/results/traces_multirank.jsonl, _dense2.jsonl and _dense3.jsonl:
real Megatron-core layers over gloo, three dense geometries). Nine parts are structural terms
(`cp_attention_release_per_row`: what ring attention no longer keeps under CP;
`head_point_transient`: the final norm's backward runs after the logits are released, which binds
when TP shards the vocabulary and not the norm; `layer_norm_point_per_row`: the recomputed layer's
input-norm backward with replicated norms, TP without SP; `sp_fc2_point_per_row`: the MLP's
output projection's backward with the gathered inputs, TP with SP; `sp_retained_layer_per_row`:
what an SP layer retains gathered without full recompute, and its forward peak;
`sp_head_forward_per_row`: what the full-native head holds at its forward with SP;
`sp_rope_entry_per_row`: the RoPE cache entry's own rows beside the SP structural terms; the
three at TP = 1 for a plain dense model's retained TP1 layers, `structural_at_tp1`, with the q/k
norms whole, `structural_qk_norm_per_row`; `tp1_fc1_point_per_row`: such a model's recomputed TP1
layer at its FC1 backward;
`cp_rope_cache_per_row`: the RoPE cache entry of the whole longest sequence on every CP rank);
the rest is charged as hidden-wide bytes per gathered row:

- `layout_residual` entry, `full`: under full recompute, bytes the busiest rank holds at every
  point beyond the sharded terms (TP without SP: the full-rows all-reduced outputs and input
  gradients around column- and row-parallel layers, and the LoRA adapters' gathered inputs; TP
  with SP: the all-gathered layer input and the head's gathered input). Charged once per wave
  (one layer is materialised at a time under full recompute). Fitted to cover the per-row
  limit too (bench/layout_validation.py: the pending adapter gradients, a constant per wave, are
  not leaned on).
- `retained`: under selective or no recompute, the same per layer (hidden-wide tensors each
  retained layer keeps gathered), charged per layer. In both groups the `tp1-*` keys are the TP1
  structural layer's and point's margin over the calibration cells (docs/memory-model.md#tp1-structural).

Only positive residuals are charged (a traced layout priced over its trace keeps that margin:
never under, see bench/layout_validation.py). A layout class with no entry is not covered:
`pricing.coverage.layout_gaps` names it and the model falls back to the conservative basis.
"""

from __future__ import annotations

from . import entries
from .coefficients import CoefficientTable

ENTRY = "layout_residual"


def layout_key(tp: int, sequence_parallel: bool, cp: int) -> str:
    """The table key of a layout class: 'tp4sp-cp1', 'tp2-cp1', 'tp1-cp2'."""
    return f"tp{tp}{'sp' if sequence_parallel else ''}-cp{cp}"


def traced_layouts(table: CoefficientTable) -> frozenset[str]:
    """Layout classes the table's residual entry covers (its `full` keys); TP1 CP1 always."""
    keys = set(entries.entry(table, ENTRY, {}).get("full", {}))
    return frozenset(keys | {layout_key(1, False, 1)})


def layout_residual_per_row(table: CoefficientTable, widths: dict, *, tp: int, sequence_parallel: bool,
                            cp: int, retained: bool, bare: bool = False) -> float:
    """Hidden-wide bytes per gathered row the layout leaves unsharded beyond the structural terms.

    c x H, c from entry `layout_residual` (group `retained` for selective/no recompute, charged
    per layer; `full` for full recompute, charged once per wave); 0 at TP1 CP1 (but for the
    `tp1-cp1` keys, the TP1 structural layer's and point's margin, #tp1-structural) and for a table
    without the entry. `bare`: for a layer the structural points do not cover (GDN mixer, MoE
    MLP), the group fitted without them (`full_bare` / `retained_bare`, when the table has it). Evidence: the busiest-rank peaks of the multi-rank CPU traces, fitted by
    bench/layout_validation.py on the 2048-token cells of both dense geometries, checked on the
    3072-token cells and across geometries (docs/memory-model.md#layout-residuals).
    """
    entry = entries.entry(table, ENTRY, {})
    name = "retained" if retained else "full"
    group = entry.get(name + "_bare", entry.get(name, {})) if bare else entry.get(name, {})
    return max(0.0, float(group.get(layout_key(tp, sequence_parallel, cp), 0.0))) * widths["H"]


def cp_rope_cache_per_row(rope_per_row: float, *, cp: int) -> float:
    """Bytes per rank row of the RoPE cache entry beyond the rank's own rows under CP.

    What memory: Megatron's `RotaryEmbedding.forward` computes (and keeps, in its lru_cache) the
    frequencies of the whole longest packed sequence, [max_seqlen, rotary dim] in fp32, on every
    rank; context parallelism gives the rank only padded/CP rows of the wave, but positions are
    global, so the entry is not divided by CP. The per-row terms price one entry row per rank
    row (`rope_per_row` = 4 x rotary dim, `pipeline.rope_cache_per_row`: at CP1 the longest
    sequence is at most the wave's rows); a wave of one sequence has CP x rank rows of entry.

    Formula: rope_per_row x (CP - 1) per rank row, the bound (the longest sequence is at most
    the call's padded rows, CP x the rank's rows); 0 at CP1 or without attention. The walk takes
    it back to the call's own longest sequence, rope_per_row x max(0, longest - rank rows)
    (`walk.rope_credit`, `GroupLoad.longest_rows`); a call of unknown longest keeps the bound.
    Charged at every point of the wave (one entry per call, not per layer). Evidence:
    docs/memory-model.md#cp-rope-cache (bench/results/cp_rope_anatomy.txt, TP2+SP+CP4 h1024 full,
    the 3072-token wave against the 2048-token one: `rotary_pos_emb cat` [2048, 64] fp32 against
    [1024, 64], 682.7 against 512 B per rank row, the whole of the busiest rank's per-row growth;
    across the grid the shortfall grows with the longest sequence at exactly rope_per_row x CP
    per rank row, docs/layouts-evidence.md section 12). O(1).
    """
    return rope_per_row * (cp - 1) if cp > 1 else 0.0


NORM_POINT = "layer_norm_point"


def layer_norm_point_per_row(table: CoefficientTable, widths: dict, *, rope_per_row: float,
                             replicated: bool) -> float:
    """The recomputed layer's workspace at its input norm's backward, when the norms are replicated.

    What memory: a layer's backward ends with its input norm's backward. Under TP without SP the
    norms run on every rank over all rows, so at that point the rank holds, beside the saved
    boundaries and the input gradient the walk charges: the norm's fp32 backward intermediates
    (20H bytes per row, as the final norm's), both norms' inputs saved in fp32 (8H), the bf16
    norm output, residual sum and gradient copy (4H), the attention's saved tensors at per-TP-rank
    widths (the qkv projection output, rotated q and k, the contiguous q copy and the output:
    2 qkv + 2 core + 2 k + 2 core + 2 core = 3 qkv + 5 core bytes, k = (qkv - core) / 2) and the
    rotary frequencies gathered per row (2 x `rope_per_row` = 8 x rotary dim bytes). The MLP's
    stage is released by then; the stage terms (fitted at TP1, all TP-sharded but the norms)
    miss this point, which binds from TP2 on.

    Formula: `per_row` of entry `layer_norm_point` (torch-cpu, structural: 32 H + 3 qkv + 5 core)
    + 2 x rope_per_row when `replicated` (credited TP > 1 without SP, full recompute); 0 otherwise
    or for a table without the entry (te-gpu: Transformer Engine's fused norms keep no fp32
    intermediates). The model charges the larger of this and the stage sum. Evidence:
    docs/memory-model.md#layer-norm-point (bench/results/layouts_anatomy.txt, TP4 full: the peak
    is L1.input_layernorm's backward, 42,541 B per row = 32 H + 2,816 B of attention + 512 B of
    rotary rows + boundaries and input gradient, no MLP tensor live). O(1).
    """
    if not replicated or not table.kernels.norm_point:
        return 0.0
    return table.per_row(NORM_POINT, widths) + 2.0 * rope_per_row


SP_POINT = "sp_fc2_point"


def sp_fc2_point_per_row(table: CoefficientTable, widths: dict, *, tp: int, rope_per_row: float,
                         sequence_parallel: bool) -> float:
    """The recomputed layer's workspace at the MLP's output projection's backward under SP.

    What memory: with sequence parallelism the layer's column-parallel inputs are all-gathered
    and kept for their weight gradients (the attention's and the MLP's input, 2H bytes per
    gathered row each), and the row-parallel LoRA adapter's output is full-row before the
    reduce-scatter (its matmul and scale outputs, 4H): 8H per gathered row, not divided by TP.
    Beside them, at per-TP-rank widths: the MLP's FC1 output and activations (10F bytes: the
    2F-wide FC1 output, its LoRA sum, and the F-wide gate, up and product), the attention's
    saved tensors (3 qkv + 5 core, as `layer_norm_point_per_row`), the rotary frequencies
    gathered per row (2 x `rope_per_row` = 8 x rotary dim bytes), and the hidden-wide norms'
    shards (two fp32 norm inputs 8H, bf16 norm output, residual and reduce-scatter output 6H:
    14H / TP; the walk charges the input gradient). At TP1 the stage's own FC1 backward binds
    (the FC1 gradient beside these; the fitted stage), from TP2 with SP this point does.

    Formula: `gathered` (8 H) + `sharded` (14 H) / TP + `per_row` (10 F + 3 qkv + 5 core) of entry
    `sp_fc2_point` (torch-cpu, structural) + 2 x rope_per_row, when `sequence_parallel` and TP > 1
    (dense MLP layers with attention; the model charges the larger of this and the stage sum, less
    the CP attention release under CP); 0 otherwise or without the entry (te-gpu). Evidence:
    docs/memory-model.md#sp-fc2-point (bench/results/layouts_anatomy.txt, TP4+SP and TP8+SP full:
    23,978 and 16,481 B per row, every storage of the formula live at the backward peak). O(1).
    """
    if not sequence_parallel or tp <= 1 or not table.kernels.sp_point:
        return 0.0
    return (table.per_row(SP_POINT, widths, key="gathered") + table.per_row(SP_POINT, widths, key="sharded") / tp
            + table.per_row(SP_POINT, widths) + 2.0 * rope_per_row)


SP_RETAINED = "sp_retained_layer"


def sp_retained_layer_per_row(table: CoefficientTable, widths: dict, *, tp: int, rope_per_row: float,
                              sequence_parallel: bool, forward: bool = False, at_tp1: bool = False) -> float:
    """What a layer retains under selective or no recompute with SP (dense MLP, attention), and
    its forward peak (`forward`).

    What memory: the layer keeps its all-gathered attention and MLP inputs for the
    column-parallel weight gradients (2H bytes per gathered row each, not divided by TP), and at
    per-TP-rank widths the FC1 output and activations (10F), the attention's saved tensors
    (3 qkv + 5 core, as `layer_norm_point_per_row`), the two norms' fp32 inputs (8H / TP), the
    rotary frequencies gathered per row (2 x `rope_per_row`) and the LoRA adapters' rank-wide
    intermediates (8 x rank). Its forward peaks at the MLP's output projection, whose row-parallel
    LoRA output is full-row before the reduce-scatter (4H per gathered row) beside five
    sequence-sharded bf16 tensors (10H / TP): the reduce-scatter output, the attention's residual
    sum, the pre-MLP norm's output, the layer's input and the embedding's output (the RoPE cache
    entry beside them is the wave's, `sp_rope_entry_per_row`).

    Formula: `gathered` (4 H) + `sharded` (8 H) / TP + `per_row` (10 F + 3 qkv + 5 core + 8 rank)
    of entry `sp_retained_layer` (torch-cpu, structural) + 2 x rope_per_row; `forward` adds
    `forward_gathered` (4 H) + `forward_sharded` (10 H) / TP;
    when `sequence_parallel` and TP > 1, or `at_tp1` and TP = 1 (the TP1 structural layer, where
    the gathered and the sharded rows are both the rank's own: `structural_at_tp1`),
    else 0 (and without the entry: te-gpu). Under SP the model charges the larger of this and the
    fitted retained layer, at TP1 this in its place (less the CP attention release under no
    recompute, less the selective discount under selective recompute). Evidence:
    docs/memory-model.md#sp-retained-layer (TP8+SP none at both geometries: 10,688 B per layer per
    row at h1024, 8,640 at h768, every storage of the formula live at the peak) and
    #tp1-structural. O(1).
    """
    if not structural_at(tp, sequence_parallel, at_tp1) or not table.kernels.structural:
        return 0.0
    out = (table.per_row(SP_RETAINED, widths, key="gathered")
           + table.per_row(SP_RETAINED, widths, key="sharded") / tp
           + table.per_row(SP_RETAINED, widths) + 2.0 * rope_per_row)
    if forward:
        out += (table.per_row(SP_RETAINED, widths, key="forward_gathered")
                + table.per_row(SP_RETAINED, widths, key="forward_sharded") / tp)
    return out


SP_HEAD = "sp_head_forward"


def sp_head_forward_per_row(table: CoefficientTable, widths: dict, *, tp: int,
                            sequence_parallel: bool, at_tp1: bool = False) -> float:
    """What the full-native head holds at its forward under TP with SP, per gathered row.

    What memory: the output layer's bf16 logits (2 x vocab / TP) and the fp32 copy the loss makes
    of them (4 x vocab / TP), both live when the loss runs; beside them the sequence-sharded
    hidden-wide tensors: the final norm's fp32 input (4H / TP, kept for its backward) and bf16
    output (2H / TP), and the embedding's output (2H / TP, kept to the end of the step); the
    RoPE cache entry beside them is the wave's (`sp_rope_entry_per_row`). The TP1-fitted head (`terms.head_per_row`, 3.77 x vocab retained)
    meets the forward only at the head's backward point; with SP the backward holds less than
    the forward (the logits' gradient replaces their bf16 copy, the norm's output is released),
    so the forward binds and is priced here. The walk charges the larger of this and the head's
    retained bytes at the head's forward point (`walk.WalkCharges.head_forward`).

    Formula: `per_row` (6 vocab) + `sharded` (8 H) / TP of entry `sp_head_forward` (torch-cpu,
    structural), when `sequence_parallel` and TP > 1, or `at_tp1` and TP = 1 (beside the TP1
    structural layer, `structural_at_tp1`); 0 otherwise or
    without the entry (te-gpu). Evidence: docs/memory-model.md#sp-head-forward (every TP+SP
    cell of the three dense geometries peaks in the forward, at the head's forward at TP2/4 and
    at TP8 where the vocabulary is wide; bench/results/sp_forward_anatomy.txt) and #tp1-structural. O(1).
    """
    if not structural_at(tp, sequence_parallel, at_tp1) or not table.kernels.sp_head:
        return 0.0
    return table.per_row(SP_HEAD, widths) + table.per_row(SP_HEAD, widths, key="sharded") / tp


def sp_rope_entry_per_row(table: CoefficientTable, *, rope_per_row: float, tp: int,
                          sequence_parallel: bool, at_tp1: bool = False) -> float:
    """The RoPE cache entry's rows on the rank, once per wave, where the SP structural terms price
    the layers.

    What memory: Megatron's `RotaryEmbedding.forward` keeps the frequencies of the call's longest
    packed sequence, [max_seqlen, rotary dim] fp32 (`rope_per_row` = 4 x rotary dim bytes per row,
    `pipeline.rope_cache_per_row`), live from the first layer's forward to the end of the step.
    The SP structural terms (`sp_fc2_point_per_row`, `sp_retained_layer_per_row`,
    `sp_head_forward_per_row`) hold the gathered bf16 copies of the frequencies per layer, not the
    fp32 entry; the TP1-fitted layer terms they replace absorbed it, and
    `cp_rope_cache_per_row` charges only the rows CP adds beyond the rank's own.

    Formula: rope_per_row per rank row (at CP1 a bound: the longest sequence has at most the
    call's rows), when `sequence_parallel` and TP > 1, or `at_tp1` and TP = 1 (beside the TP1
    structural layer), and the table has the structural entries (torch-cpu); else 0. Under full recompute for a model of dense attention layers only: the
    MoE TP+SP and GDN structural full-recompute points carry the entry's rows themselves. Charged as the CP RoPE cache is (`layer_arrays.wave_rope_cache_per_row`:
    layer 0's retained memory and forward without full recompute, every point under it).
    Evidence: docs/memory-model.md#sp-head-forward (`rotary_pos_emb cat` fp32, live at the
    forward and backward peaks of every TP+SP cell, bench/results/sp_forward_anatomy.txt and
    cp_tp8_anatomy.txt; the full-recompute TP+SP+CP residuals it had stood for). O(1).
    """
    if not structural_at(tp, sequence_parallel, at_tp1) or not table.kernels.sp_point:
        return 0.0
    return rope_per_row


def structural_at(tp: int, sequence_parallel: bool, at_tp1: bool) -> bool:
    """Whether the SP structural terms apply at this TP: under TP > 1 with SP, and at TP = 1 where
    the caller prices the TP1 structural layer (`at_tp1`, `structural_at_tp1`). O(1)."""
    return (sequence_parallel and tp > 1) or (at_tp1 and tp == 1)


def structural_at_tp1(table: CoefficientTable, *, retained: bool, plain_dense: bool) -> bool:
    """Whether a TP1 rank's layers are priced by what they hold: retained layers by the SP
    structural terms at TP = 1 (the TP1 structural layer), recomputed layers at their FC1
    backward (`tp1_fc1_point_per_row`), rather than by the TP1-fitted layer and stage.

    What memory: at TP1 every tensor the SP structural terms name gathered or sequence-sharded
    is the rank's own rows, so `sp_retained_layer_per_row` (its forward too),
    `sp_head_forward_per_row` and `sp_rope_entry_per_row` at TP = 1 price what a retained TP1
    layer, the head's forward and the RoPE entry hold. The fitted layer (`terms.retained_layer_per_row`,
    fitted on real widths with the head beside it) over-prices small shapes by 3-13%; the
    structural layer prices the same cells within 2-3%, with `structural_qk_norm_per_row` for
    query/key norms and the TP1 residual (`layout_residual` key tp1-cp1, group `retained`) over
    the calibration cells' per-row constants.

    Formula: True when `plain_dense` (every layer plain attention, no output gate or MLA, with a
    dense MLP: the layers the structural terms were traced on) and the table has the structural
    entries (torch-cpu: `sp_retained_layer` and `sp_head_forward` when `retained` (selective or
    no recompute), `tp1_fc1_point` and `sp_head_forward` under full recompute); te-gpu keeps its
    fitted layer. Evidence: docs/memory-model.md#tp1-structural (bench/results/tp1_structural.txt:
    the grid's TP1 and TP1+CP cells and the real-width calibration cells). O(1).
    """
    return table.kernels.structural_at_tp1(retained=retained, plain_dense=plain_dense)


TP1_POINT = "tp1_fc1_point"


def tp1_fc1_point_per_row(table: CoefficientTable, widths: dict, *, rope_per_row: float,
                          at_tp1: bool) -> float:
    """The recomputed TP1 layer's workspace at its MLP's FC1 backward (full recompute).

    What memory: under full recompute a TP1 layer's backward peaks in its MLP, at FC1's backward:
    the FC1 output with its LoRA sum and its gradient (4F each), the SwiGLU's gate activation,
    product and the product's gradient (2F each): 14F; both norms' fp32 inputs (8H), their bf16
    outputs and the attention's residual sum (6H): 14H; the attention's saved tensors (3 qkv +
    5 core, as `layer_norm_point_per_row`) and the rotary frequencies' bf16 copies (2 x
    `rope_per_row`). The walk charges the boundaries, the input gradient and the RoPE entry
    (`sp_rope_entry_per_row` at TP1) beside it.

    Formula: `per_row` of entry `tp1_fc1_point` (torch-cpu, structural: 14 F + 14 H + 3 qkv +
    5 core) + 2 x rope_per_row, when `at_tp1` (`structural_at_tp1` under full recompute); 0
    otherwise or without the entry (te-gpu). The model charges it in place of the fitted stage
    (with the q/k norms whole, `structural_qk_norm_per_row`, less the CP attention release).
    Evidence: docs/memory-model.md#tp1-structural (bench/results/layouts_anatomy.txt, TP1 full
    h1024: 72,060 B per row at L1's FC1 backward, every storage of the formula live). O(1).
    """
    if not at_tp1 or not table.kernels.tp1_point:
        return 0.0
    return table.per_row(TP1_POINT, widths) + 2.0 * rope_per_row


def structural_qk_norm_per_row(widths: dict) -> float:
    """What an attention layer's query/key norms keep, beside the structural layer terms.

    What memory: a plain torch RMSNorm keeps its input upcast to fp32 for its backward: 4 bytes x
    (query + key widths) per row at per-TP-rank widths = 2 x qkv + 2 x core (queries are `core`
    wide, keys (qkv - core) / 2). The TP1-fitted `qk_norm` entry scales this by its fit (0.88 on
    torch-cpu), the rest absorbed by the fitted layer it sits beside; the structural terms absorb
    nothing, so they take the whole.

    Formula: 2 x qkv + 2 x core bytes per row. Evidence: docs/memory-model.md#tp1-structural
    (the q_layernorm and k_layernorm fp32 copies of qwen3-8b, bench/results/validation_anatomy.txt;
    with the fitted 0.88 the TP1 structural layer fell 0.47-0.57 H per layer under qwen3-8b's
    selective and none calibration cells, 0.9948-0.9974; with the whole, 0.01-0.15 H over,
    1.0001-1.0009 before the TP1 residual, bench/results/tp1_structural.txt). O(1).
    """
    return 2.0 * widths["qkv"] + 2.0 * widths["core"]


CP_ATTENTION = "cp_attention_release"


def cp_attention_release_per_row(table: CoefficientTable, widths: dict, *, cp: int) -> float:
    """Bytes per rank row an attention layer's saved tensors shrink by under context parallelism.

    What memory: a single-rank attention keeps, for its backward, the fused qkv projection output
    (v is a view of it), the rotated q and k, the per-sequence contiguous q copy and the output.
    Ring attention (Transformer Engine's p2p CP, `measure.ring_attention`) copies its k/v into its
    own send buffer, so the projection output is released, and keeps only q, one k/v buffer, the
    output and the log-sum-exp. The difference, per rank row at per-TP-rank widths, is
    2 qkv + 2 core + 2 k - 2 (k + v) = qkv + 3 core bytes (bf16), less the ring's fp32 log-sum-exps.

    Formula: `per_row` x widths of entry `cp_attention_release` (torch-cpu: 0.95 x (qkv + 3 core),
    the scale below the structural 1 covers the log-sum-exps) when cp > 1; 0 at CP1 or for a table
    without the entry (te-gpu: Transformer Engine's own attention keeps no such copies at CP1, so
    there is nothing to release). Charged negatively where the attention's saved tensors are live:
    the recomputed layer's workspace (full recompute) and each layer's retained activations (no
    recompute); selective recompute of core attention retains none of them. Only plain attention
    (the traced kind) gets it: an output gate is a view of the projection output and keeps it
    alive, and multi-latent attention projects differently (`pricing.model` passes 0 for both).
    Evidence: docs/memory-model.md#cp-attention-release (CP2/CP4/TP2+SP+CP2 against TP1/TP2+SP,
    two dense geometries). O(1).
    """
    if cp <= 1 or not table.kernels.cp_release:
        return 0.0
    return table.per_row(CP_ATTENTION, widths)


def head_point_transient(logits_retained: float, logits_transient: float, norm_backward: float, *,
                         released: bool) -> float:
    """The head point's transient per gathered row beyond the logits it retains.

    What memory: the loss's backward (logits retained plus their gradient, `logits_transient`) and
    the final norm's backward (`norm_backward`) run one after the other; the logits are released
    before the norm's backward starts. With the vocabulary sharded over TP, and for TE's head at any
    TP (`released`; its head terms are structural, docs/memory-model.md#head-full-te) the head
    point is therefore norm_saved + max(logits_retained + logits_transient, norm_backward),
    written as the logits retained plus max(logits_transient, norm_backward - logits_retained):
    without SP the hidden-wide norm backward is replicated on every rank while the logits shrink
    by TP, so the norm's backward binds with no logits live beside it. At TP1 the norm's backward
    stays charged beside the logits, max(logits_transient, norm_backward): the torch-cpu table's
    head coefficients were fitted (`waveplan calibrate`, 126 TP1 cells) with that point, and 9 of
    its small cells (hidden 128-512, vocabulary 512) fall up to 0.7% under without it (their peak
    is the head's forward, 6 x vocab bytes, which the fitted 3.77 x vocab retained does not reach
    alone); a chunked head retains nothing, so both forms agree.
    Evidence: docs/memory-model.md#head-norm-order (bench/results/layouts_anatomy.txt, TP4 none:
    the peak is the final norm's fp32 backward, no logits live; TP2/4/8 without SP, selective and
    none, over by 9-14% before, 1.4-2.8% after). O(1).
    """
    if not released:
        return max(logits_transient, norm_backward)
    return max(logits_transient, norm_backward - logits_retained)
