"""Terms that scale with the parallel layout: what TP (with or without sequence parallelism) and
CP leave unsharded (docs/memory-model.md#layout-residuals).

The structural sharding lives in the per-rank widths (`pricing.model.layer_widths`), the
sequence-parallel divisor of hidden-wide terms (`sp_div`) and the busiest CP rank's rows
(`pricing.price.rank_rows`). What that misses is priced here by structural terms (each function
below names the memory it prices) and, beyond them, by the fitted `layout_residual` entry, hidden-wide
bytes per gathered row per traced layout class:

- `full`: under full recompute, what the busiest rank holds at every point beyond the sharded
  terms (TP without SP: full-row all-reduced outputs and gradients, the adapters' gathered
  inputs; TP with SP: the all-gathered layer input and the head's gathered input), once per wave.
- `retained`: under selective or no recompute, the same per retained layer. In both groups the
  `tp1-*` keys are the TP1 structural layer's margin (docs/memory-model.md#tp1-structural).

Only positive residuals are charged (never under). A layout class with no entry is not covered:
`pricing.coverage.layout_gaps` names it and the model falls back to the conservative basis.
"""

from __future__ import annotations

from . import entries
from .coefficients import CoefficientTable
from .kernel_set import KernelSet

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

    Formula: max(0, c) x H, c from entry `layout_residual` (group `retained` per layer, `full` once
    per wave; `bare` picks `full_bare` / `retained_bare`, fitted without the structural points, for a
    GDN mixer or MoE MLP); 0 at TP1 CP1 but for the `tp1-cp1` keys, and without the entry. See
    docs/memory-model.md#layout-residuals.
    """
    entry = entries.entry(table, ENTRY, {})
    name = "retained" if retained else "full"
    group = entry.get(name + "_bare", entry.get(name, {})) if bare else entry.get(name, {})
    return max(0.0, float(group.get(layout_key(tp, sequence_parallel, cp), 0.0))) * widths["H"]


def cp_rope_cache_per_row(rope_per_row: float, *, cp: int) -> float:
    """Bytes per rank row of the RoPE cache entry beyond the rank's own rows under CP.

    Formula: rope_per_row x (CP - 1) per rank row, the bound; 0 at CP1 or without attention.
    Megatron's `RotaryEmbedding.forward` keeps the whole longest sequence's fp32 frequencies on every
    rank (positions are global, so CP does not divide it); the walk takes the bound back to the call's
    own longest sequence (`walk.rope_credit`). See docs/memory-model.md#cp-rope-cache. O(1).
    """
    return rope_per_row * (cp - 1) if cp > 1 else 0.0


NORM_POINT = "layer_norm_point"


def layer_norm_point_per_row(table: CoefficientTable, widths: dict, *, rope_per_row: float,
                             replicated: bool) -> float:
    """The recomputed layer's workspace at its input norm's backward, when the norms are replicated
    (TP without SP).

    Terms: the norm's fp32 backward intermediates (20H), both norms' fp32 inputs (8H), the bf16 norm
    output, residual sum and gradient copy (4H), the attention's saved tensors (3 qkv + 5 core) and
    the rotary frequencies gathered per row (2 x rope_per_row).

    Formula: `layer_norm_point` (32 H + 3 qkv + 5 core) + 2 x rope_per_row when `replicated`; 0
    otherwise or without the entry (te-gpu: fused norms). The model charges the larger of this and the
    stage sum. See docs/memory-model.md#layer-norm-point. O(1).
    """
    if not replicated or not table.kernels.norm_point:
        return 0.0
    return table.per_row(NORM_POINT, widths) + table.kernels.rope_copies * rope_per_row


SP_POINT = "sp_fc2_point"


def sp_fc2_point_per_row(table: CoefficientTable, widths: dict, *, tp: int, rope_per_row: float,
                         sequence_parallel: bool) -> float:
    """The recomputed layer's workspace at the MLP's output projection's backward under SP.

    Terms: the gathered column-parallel inputs and the row-parallel LoRA output before the
    reduce-scatter (8H, not divided by TP); the FC1 output and activations (10F), the attention's
    saved tensors (3 qkv + 5 core) and the rotary frequencies (2 x rope_per_row) per TP rank; the
    norms' and residual's shards (14H / TP).

    Formula: `gathered` (8 H) + `sharded` (14 H) / TP + `per_row` (10 F + 3 qkv + 5 core) of entry
    `sp_fc2_point` + 2 x rope_per_row, when `sequence_parallel` and TP > 1; 0 otherwise or without
    the entry (te-gpu). See docs/memory-model.md#sp-fc2-point. O(1).
    """
    if not sequence_parallel or tp <= 1 or not table.kernels.sp_point:
        return 0.0
    return (table.per_row(SP_POINT, widths, key="gathered") + table.per_row(SP_POINT, widths, key="sharded") / tp
            + table.per_row(SP_POINT, widths) + table.kernels.rope_copies * rope_per_row)


SP_RETAINED = "sp_retained_layer"


def sp_retained_layer_per_row(table: CoefficientTable, widths: dict, *, tp: int, rope_per_row: float,
                              sequence_parallel: bool, forward: bool = False, at_tp1: bool = False) -> float:
    """What a layer retains under selective or no recompute with SP (dense MLP, attention), and
    its forward peak (`forward`).

    Terms: the gathered attention and MLP inputs (4H), per TP rank the FC1 output and activations
    (10F), the attention's saved tensors (3 qkv + 5 core), the norms' fp32 inputs (8H / TP), the
    rotary frequencies (2 x rope_per_row) and the adapters' intermediates (8 rank); the forward peak
    at the output projection adds its full-row LoRA output (4H) and five sharded bf16 tensors (10H / TP).

    Formula: `gathered` (4 H) + `sharded` (8 H) / TP + `per_row` (10 F + 3 qkv + 5 core + 8 rank)
    of entry `sp_retained_layer` + 2 x rope_per_row; `forward` adds `forward_gathered` (4 H) +
    `forward_sharded` (10 H) / TP; when `sequence_parallel` and TP > 1 or `at_tp1` and TP = 1
    (`structural_at_tp1`), else 0 (and without the entry: te-gpu). See
    docs/memory-model.md#sp-retained-layer and docs/memory-model.md#tp1-structural. O(1).
    """
    if not structural_at(tp, sequence_parallel, at_tp1) or not table.kernels.structural:
        return 0.0
    out = (table.per_row(SP_RETAINED, widths, key="gathered")
           + table.per_row(SP_RETAINED, widths, key="sharded") / tp
           + table.per_row(SP_RETAINED, widths) + table.kernels.rope_copies * rope_per_row)
    if forward:
        out += (table.per_row(SP_RETAINED, widths, key="forward_gathered")
                + table.per_row(SP_RETAINED, widths, key="forward_sharded") / tp)
    return out


SP_HEAD = "sp_head_forward"


def sp_head_forward_per_row(table: CoefficientTable, widths: dict, *, tp: int,
                            sequence_parallel: bool, at_tp1: bool = False) -> float:
    """What the full-native head holds at its forward under TP with SP, per gathered row.

    Formula: `per_row` (6 vocab: bf16 logits and the loss's fp32 copy) + `sharded` / TP of entry
    `sp_head_forward` (torch-cpu 8 H: the final norm's fp32 input and bf16 output, the embedding's
    output; te-gpu 4 H: TE's RMSNorm keeps no fp32 copy), when `sequence_parallel` and TP > 1 or
    `at_tp1` and TP = 1; 0 otherwise or without the entry.
    With SP the head's backward holds less than its forward, so the forward binds; the walk charges the
    larger of this and the head's retained bytes. See docs/memory-model.md#sp-head-forward and
    docs/memory-model.md#tp1-structural. O(1).
    """
    if not structural_at(tp, sequence_parallel, at_tp1) or not table.kernels.sp_head:
        return 0.0
    return table.per_row(SP_HEAD, widths) + table.per_row(SP_HEAD, widths, key="sharded") / tp


def sp_rope_entry_per_row(table: CoefficientTable, *, rope_per_row: float, tp: int,
                          sequence_parallel: bool, at_tp1: bool = False) -> float:
    """The RoPE cache entry's rows on the rank, once per wave, where the SP structural terms price
    the layers.

    Formula: rope_per_row (4 x rotary dim, fp32) per rank row, when `sequence_parallel` and TP > 1
    or `at_tp1` and TP = 1 and the table has the structural entries (torch-cpu); else 0. The
    structural terms hold only the frequencies' bf16 copies per layer, and the fitted terms they
    replace absorbed the entry; `cp_rope_cache_per_row` charges only the rows CP adds. See
    docs/memory-model.md#sp-head-forward. O(1).
    """
    if not structural_at(tp, sequence_parallel, at_tp1) or not (table.kernels.sp_point or at_tp1):
        return 0.0
    return rope_per_row


def structural_at(tp: int, sequence_parallel: bool, at_tp1: bool) -> bool:
    """Whether the SP structural terms apply at this TP: under TP > 1 with SP, and at TP = 1 where
    the caller prices the TP1 structural layer (`at_tp1`, `structural_at_tp1`). O(1)."""
    return (sequence_parallel and tp > 1) or (at_tp1 and tp == 1)


def structural_at_tp1(table: CoefficientTable, *, retained: bool, plain_dense: bool) -> bool:
    """Whether a TP1 rank's layers are priced by what they hold (the SP structural terms at TP = 1,
    and `tp1_fc1_point_per_row` under full recompute) rather than by the TP1-fitted layer and stage.

    Formula: True when `plain_dense` (plain attention, no output gate or MLA, dense MLP: the layers
    the structural terms were traced on) and the table has the structural entries for the recompute
    mode (torch-cpu); te-gpu keeps its fitted layer. The fitted layer over-prices small shapes, which
    no positive-only residual can take back. See docs/memory-model.md#tp1-structural. O(1).
    """
    return table.kernels.structural_at_tp1(retained=retained, plain_dense=plain_dense)


TP1_POINT = "tp1_fc1_point"


def tp1_fc1_point_per_row(table: CoefficientTable, widths: dict, *, rope_per_row: float,
                          at_tp1: bool, tp: int = 1, sequence_parallel: bool = False) -> float:
    """The recomputed TP1 layer's workspace at its MLP's FC1 backward (full recompute).

    Formula: `tp1_fc1_point` (14 F: FC1 output, LoRA sum, gradient and SwiGLU tensors; 14 H: the norms'
    fp32 inputs, bf16 outputs and residual sum; 3 qkv + 5 core) + 2 x rope_per_row, when `at_tp1`;
    0 otherwise or without the entry. Charged in place of the fitted stage. The fused kernels'
    entry (te-gpu, `LayerContext.fused_point`: any TP at CP1) prices the recomputed FC1's forward,
    its hidden-wide part by layout: `replicated` without SP, `gathered` + `sharded` / TP with it,
    and no rotary copies (`KernelSet.rope_copies`); the larger of that and the recomputed FC2's
    forward (its row-parallel output full-row before the reduction; the `fc2_` keys) and its
    attention's backward (flash's workspaces beside the saved tensors; the `attn_` keys). See docs/memory-model.md#tp1-structural and
    docs/memory-model.md#gpu-kernel-allocation-models. O(1).
    """
    if not at_tp1 or not table.kernels.tp1_point:
        return 0.0

    def point(prefix: str) -> float:
        # the hidden-wide tensors by layout (fused kernels, `LayerContext.fused_point`): replicated
        # over TP without SP, gathered and sequence-sharded with it; none apart on torch-cpu
        if sequence_parallel and tp > 1:
            hidden = (table.per_row(TP1_POINT, widths, key=prefix + "gathered")
                      + table.per_row(TP1_POINT, widths, key=prefix + "sharded") / tp)
        else:
            hidden = table.per_row(TP1_POINT, widths, key=prefix + "replicated")
        return table.per_row(TP1_POINT, widths, key=prefix + "per_row") + hidden

    # the FC1 point, and where the entry has them the recomputed FC2's forward (`fc2_` keys) and
    # the attention's backward (`attn_` keys)
    return (max(point(""), point("fc2_"), point("attn_"))
            + table.kernels.rope_copies * rope_per_row)


FUSED_RETAINED = "fused_retained_layer"


def fused_retained_layer_per_row(table: CoefficientTable, widths: dict, *, tp: int,
                                 sequence_parallel: bool, backward: bool = False,
                                 ring: bool = False) -> float:
    """What a plain dense layer retained (selective or no recompute) keeps on the fused kernels,
    or (`backward`) the larger transient of its backward (the fused SwiGLU's, FC2's, or flash's
    workspaces).

    Formula: entry `fused_retained_layer`: `per_row` (6F: the FC1 sum the fused SwiGLU saves and
    its output; 3 qkv + 3.0625 core: the attention's saved tensors; 8 rank) + its hidden-wide part
    by layout (`replicated` 8H without SP: the layer's input, residual sum and two norm outputs;
    `gathered` + `sharded` / TP with it); `backward`: the larger of `backward_*` (the MLP's) and
    `fc2_backward` (its incoming and adapter gradients, full-row) and `attention_backward`
    (flash's). Selective recompute of core attention keeps the same tensors
    (its checkpoint saves the inputs flash would). `ring` (no recompute under CP, TE's P2P ring
    attention): less `ring_release` (qkv + core: the ring saves its own k/v buffer, so the qkv
    projection sum and the rotated k go). 0 without the entry. See
    docs/memory-model.md#gpu-kernel-allocation-models. O(1).
    """
    if not table.kernels.fused_retained:
        return 0.0
    pre = "backward_" if backward else ""

    def part(key: str) -> float:
        return table.per_row(FUSED_RETAINED, widths, key=pre + key)

    hidden = (part("gathered") + part("sharded") / tp if sequence_parallel and tp > 1
              else part("replicated"))
    out = part("per_row") + hidden
    if ring and not backward:
        out -= table.per_row(FUSED_RETAINED, widths, key="ring_release")
    if backward:
        out = max(out, table.per_row(FUSED_RETAINED, widths, key="fc2_backward"),
                  table.per_row(FUSED_RETAINED, widths, key="attention_backward"))
    return out


def ring_attention_point_per_row(table: CoefficientTable, widths: dict, *, cp: int,
                                 backward: bool, kept: bool = False,
                                 retained: bool = False) -> float:
    """A plain dense layer's ring attention (CP > 1, TE's P2P kernel `AttnFuncWithCPAndKVP2P`
    with flash-attn's varlen kernel at each step, as `pricing/measure/ring_attention.py` allocates
    it with `flash`) at its forward merge, or (`backward`) its backward's transient.

    Formula: entry `fused_retained_layer`: forward `ring_forward` (its inputs, the qkv sum and the
    rotated q and k, 3 qkv + core; the merged output and log-sum-exp, 2.0625 core; the layer's input
    and norm output, 4H; the adapters' outputs, 6 rank) + CP x `ring_forward_per_cp` (every step's
    received k/v buffer, partial output and log-sum-exp, kept until the merge: 2 qkv + 0.0625 core);
    backward `ring_backward_flash` (the causal step: the recomputed ring's saved tensors 2 qkv +
    2.0625 core; dout, dq, two k/v + gradient buffers, the step's dq/dk/dv, 10 qkv - 4 core;
    flash-attn's fp32 dq_accum, at most 4.8 core, and softmax_d, at most 0.0625 core, over the
    rank's rows; the output's and the residual path's gradients, 2H: 12 qkv + 2.925 core + 2H)
    + `ring_backward_gqa` under GQA (qkv < 3 core: dk/dv expanded to every head, 4 core), less
    `ring_saved` (2 qkv + 2.0625 core) where the layer keeps the ring's saved tensors (`kept`: no
    recompute, already in its retained term) and less `ring_mlp_freed` (6F, the MLP's saved FC1 sum
    and SwiGLU output, freed by the MLP's backward before the attention's) where the layer's
    retained term holds them (`retained`: selective or no recompute); 0 at CP1 or without the keys.
    See docs/memory-model.md#gpu-kernel-allocation-models. O(1).
    """
    if cp <= 1 or not table.kernels.fused_retained:
        return 0.0
    if backward:
        ring = table.per_row(FUSED_RETAINED, widths, key="ring_backward_flash")
        if widths["qkv"] < 3 * widths["core"]:
            ring += table.per_row(FUSED_RETAINED, widths, key="ring_backward_gqa")
        if kept:
            ring -= table.per_row(FUSED_RETAINED, widths, key="ring_saved")
        if retained:
            ring -= table.per_row(FUSED_RETAINED, widths, key="ring_mlp_freed")
        return max(0.0, ring)
    return (table.per_row(FUSED_RETAINED, widths, key="ring_forward")
            + cp * table.per_row(FUSED_RETAINED, widths, key="ring_forward_per_cp"))


def ring_recomputed_release_per_row(table: CoefficientTable, widths: dict, *, cp: int) -> float:
    """What a recomputed layer's attention saves less under CP (full recompute: its recomputed
    forward runs the ring, which saves its own k/v buffer, so the qkv projection sum and the
    rotated k go, as without recompute), off the fused kernels' recomputed points.

    Formula: entry `fused_retained_layer` `ring_release` (qkv + core) when cp > 1; 0 at CP1 or
    without the key. See docs/memory-model.md#gpu-kernel-allocation-models. O(1)."""
    if cp <= 1 or not table.kernels.fused_retained:
        return 0.0
    return table.per_row(FUSED_RETAINED, widths, key="ring_release")


def fused_retained_moe_layer_per_row(table: CoefficientTable, widths: dict, *, routed: float,
                                     forward: bool = False, backward: bool = False, tp: int = 1,
                                     sequence_parallel: bool = False) -> float:
    """What an attention layer with a MoE MLP retained (selective or no recompute) keeps on the
    fused kernels, per gathered row, at TP1 or under TP with SP (expert TP = TP), or (`forward`)
    its own forward peak, or (`backward`) its backward's transient.

    Formula: entry `fused_retained_layer`: `moe_per_row` (the attention's saved tensors 3 qkv +
    3.0625 core, as the dense layer's; the attention's two adapters' rank-wide outputs 4 rank; the
    permuted probabilities fp32 4 top_k) + the part on the rank's own rows by layout,
    `moe_replicated` at TP1 (8H: the layer's input, residual sum and two norm outputs; the router's
    fp32 tensors and bool map, 14 experts; its int64 top-k and permutation indices, 16 top_k),
    `moe_gathered` (2H: the QKV's gathered input) + `moe_sharded` / TP (the same less that input:
    6H + 14 experts + 16 top_k) with SP; + `moe_gpu_router` on the rank's own rows (12 experts:
    TE's fused-permute row_id_map and the aux loss's fp32 scores, which a GPU run may keep and the
    CPU traces do not); + `routed` x `moe_per_routed_row` (the grouped FC1's saved input 2H, the FC1 output the
    fused weighted SwiGLU saves 4 expert_ffn, its output FC2 saves 2 expert_ffn). `forward` adds
    `routed` x `moe_forward_per_routed_row` (the grouped FC2's output and the combine's copy, 4H)
    and the dispatcher's permuted copy (`moe_dispatch_per_routed_row`, 2H, on the rank's own
    routed rows: / TP with SP); with SP also the combine's fp32 copy of the gathered output
    (`moe_sp_forward_per_routed_row`, 4H) and its reduce-scatter's fp32 output on the rank's rows
    (`moe_sp_forward_sharded_per_routed_row`, 4H / TP). `backward`: the larger of the experts'
    (`moe_backward_per_row`: the layer output's and the combine's gradients 4H, the router's fp32
    gradients 8 experts; + `routed` x the largest of `moe_backward_per_routed_row`, FC1's input
    gradient beside the SwiGLU's input gradient, 2H + 4 expert_ffn,
    `moe_backward_swiglu_per_routed_row`, the SwiGLU's incoming and input gradients, 6 expert_ffn,
    and `moe_backward_combine_per_routed_row`, the unpermute's gathered gradient beside its
    unsorted copy, 4H; with SP `moe_sp_backward_per_routed_row`, the gathered gradient in fp32
    beside its bf16 cast or its rank-row fp32 input, 6H) and flash's (`attention_backward`, as
    the dense layer's). The permuted copy is freed after the forward. `routed`: top_k x the
    busiest rank's load. 0 without the entry's keys. See
    docs/memory-model.md#gpu-kernel-allocation-models. O(1).
    """
    if not table.kernels.fused_retained:
        return 0.0
    sp = sequence_parallel and tp > 1

    def part(key: str) -> float:
        return table.per_row(FUSED_RETAINED, widths, key=key)

    if backward:
        return max(fused_moe_experts_backward_per_row(table, widths, routed=routed, sp=sp),
                   part("attention_backward"))
    hidden = part("moe_gathered") + part("moe_sharded") / tp if sp else part("moe_replicated")
    # what a GPU run may keep that the CPU traces do not (fused permute's map, aux-loss scores)
    hidden += part("moe_gpu_router") / (tp if sp else 1)
    out = part("moe_per_row") + hidden + routed * part("moe_per_routed_row")
    if forward:
        # Megatron's all-to-all dispatcher's permuted copy of the rank's own routed rows, which the
        # one-rank tracer's stand-in dispatcher does not make; with SP the combine's fp32 tensors
        out += routed * (part("moe_forward_per_routed_row")
                         + part("moe_dispatch_per_routed_row") / (tp if sp else 1))
        if sp:
            out += routed * (part("moe_sp_forward_per_routed_row")
                             + part("moe_sp_forward_sharded_per_routed_row") / tp)
    return out


def fused_moe_experts_backward_per_row(table: CoefficientTable, widths: dict, *, routed: float,
                                       sp: bool = False) -> float:
    """A retained MoE layer's experts' backward transient on the fused kernels, per row.

    Formula: `moe_backward_per_row` + `routed` x the largest of `moe_backward_per_routed_row`,
    `moe_backward_swiglu_per_routed_row`, `moe_backward_combine_per_routed_row` (and with SP
    `moe_sp_backward_per_routed_row`), as `fused_retained_moe_layer_per_row` charges it. See
    docs/memory-model.md#gpu-kernel-allocation-models. O(1).
    """
    def part(key: str) -> float:
        return table.per_row(FUSED_RETAINED, widths, key=key)

    experts = max(part("moe_backward_per_routed_row"), part("moe_backward_swiglu_per_routed_row"),
                  part("moe_backward_combine_per_routed_row"))
    if sp:
        experts = max(experts, part("moe_sp_backward_per_routed_row"))
    return part("moe_backward_per_row") + routed * experts


def fused_moe_shared_expert_per_row(table: CoefficientTable, widths: dict, *, routed: float,
                                    point: str) -> float:
    """A retained MoE layer's shared expert on the fused kernels at TP1, per row; 0 without one.

    Formula: entry `fused_retained_layer`: "retained" `moe_shared_per_row` (FC1's output, which
    the fused SwiGLU saves: 4 shared_ffn; frozen linears save no input); "forward" (beside the
    retained) `moe_shared_forward_per_row` (its output, 2H, beside the routed experts' forward
    point); "backward" `moe_backward_per_row` + `moe_shared_backward_per_row` (the SwiGLU's
    incoming and input gradients, FC1's input gradient: 6 shared_ffn + 2H) + `routed` x
    `moe_shared_backward_per_routed_row` (the permuted rows' gradient awaiting the dispatcher's
    backward, 2H). See docs/memory-model.md#mla-moe-kernel-models. O(1).
    """
    if not widths["shared_ffn"]:
        return 0.0

    def part(key: str) -> float:
        return table.per_row(FUSED_RETAINED, widths, key=key)

    if point == "retained":
        return part("moe_shared_per_row")
    if point == "forward":
        return part("moe_shared_forward_per_row")
    return (part("moe_backward_per_row") + part("moe_shared_backward_per_row")
            + routed * part("moe_shared_backward_per_routed_row"))


def structural_qk_norm_per_row(widths: dict, kernels: KernelSet) -> float:
    """What an attention layer's query/key norms keep, beside the structural layer terms.

    Formula: plain PyTorch: 2 x qkv + 2 x core bytes per row (the norms' fp32 input copies, per TP
    rank). The TP1-fitted `qk_norm` entry charges only part of this, the rest absorbed by the fitted
    layer; the structural terms absorb nothing, so they take the whole. Fused kernels
    (`KernelSet.fused`): TE's RMSNorm saves its input made contiguous (q and k are strided views of
    the projection output: 2 core + 2 x key width = qkv + core bytes) and one fp32 rstdev per head
    and row (4 / head_dim bytes per element, at most 0.0625 (qkv + core) for heads of 64 or more).
    See docs/memory-model.md#tp1-structural, #gpu-kernel-allocation-models. O(1).
    """
    if kernels.fused:
        return 1.0625 * (widths["qkv"] + widths["core"])
    return 2.0 * widths["qkv"] + 2.0 * widths["core"]


CP_ATTENTION = "cp_attention_release"


def cp_attention_release_per_row(table: CoefficientTable, widths: dict, *, cp: int) -> float:
    """Bytes per rank row an attention layer's saved tensors shrink by under context parallelism.

    Formula: `cp_attention_release` x widths (torch-cpu: 0.95 x (qkv + 3 core)) when cp > 1; 0 at
    CP1 or without the entry (te-gpu). Ring attention copies k/v into its own buffer, so the fused
    qkv output is released (2 qkv + 2 core + 2 k - 2 (k + v) = qkv + 3 core, less the ring's fp32
    log-sum-exps); charged negatively where those tensors are live, plain attention only. See
    docs/memory-model.md#cp-attention-release. O(1).
    """
    if cp <= 1 or not table.kernels.cp_release:
        return 0.0
    return table.per_row(CP_ATTENTION, widths)


def head_point_transient(logits_retained: float, logits_transient: float, norm_backward: float, *,
                         released: bool) -> float:
    """The head point's transient per gathered row beyond the logits it retains.

    Formula: max(logits_transient, norm_backward - logits_retained) when `released` (vocabulary
    sharded over TP, or TE's head), else max(logits_transient, norm_backward). The logits are
    released before the final norm's backward runs; at TP1 the fitted head coefficients were fitted
    with the norm's backward beside the logits. See docs/memory-model.md#head-norm-order. O(1).
    """
    if not released:
        return max(logits_transient, norm_backward)
    return max(logits_transient, norm_backward - logits_retained)


def flash_fp32_excess_per_row(widths: dict, head_dim: int) -> tuple[float, float]:
    """What flash-attn 2's fp32 tensors of a plain attention layer hold beyond the bounds the
    fused kernel terms charge per row: (kept, backward transient).

    Formula: kept = core x max(0, 4 / d - 1/16) (the log-sum-exp, 4 bytes per head, bounded by
    0.0625 core); backward = the same for softmax_d + core x max(0, 4 x rounded(d) / d - 4.8)
    (the dq accumulator, 4 x heads x rounded(d), bounded by 4.8 core; rounded:
    `fsdp.terms.flash_head_rounded`); 0 for d >= 64 with rounded(d) <= 1.2 d. See
    docs/memory-model.md#gpu-kernel-allocation-models. O(1).
    """
    from .fsdp.terms import flash_head_rounded

    core, d = widths["core"], float(head_dim)
    lse = core * max(0.0, 4.0 / d - 1.0 / 16.0)
    acc = core * max(0.0, 4.0 * flash_head_rounded(head_dim) / d - 4.8)
    return lse, lse + acc
