"""Expert-parallel MoE terms: what Megatron's all-to-all token dispatcher allocates per routed
row on the busiest expert-parallel rank, and how many routed rows that rank can receive
(docs/memory-model.md#expert-parallel).

A MoE layer of top-k routing turns a wave's `rows` tokens into rows x top_k *routed rows*.
With EP ranks, each rank holds num_experts / EP local experts and receives, through the
all-to-all, the routed rows every rank of its EP group sends to them. `busiest_rank_load` is
the busiest rank's routed rows over rows x top_k (1 when every rank gets the same share); the
routed-row terms of `pricing.terms` and the two buffers below are charged x top_k x that load.

All functions are O(1) and torch-free.
"""

from __future__ import annotations

from .coefficients import CoefficientTable
from .errors import ConfigError, bad
from .geometry import MoeSpec

# the table entry for the dispatcher's top-k copies (optional: 0 where a table lacks it, e.g.
# te-gpu, whose fitted `moe_routed` already holds the permuted rows of source 002's GPU runs)
PERMUTATION = "moe_permutation"


def worst_case_load(moe: MoeSpec, ep: int) -> float:
    """The largest share of routed rows one EP rank can receive, for any router.

    Each of the EP ranks of the group sends at most min(top_k, E/EP) of a token's top_k
    (distinct) choices to one rank's E/EP local experts, so one rank receives at most
    EP x rows x min(top_k, E/EP) routed rows, when every rank of the group runs a wave of at
    most `rows` rows (the same assumption the multi-rank traces make: every EP rank runs the
    same wave). Over rows x top_k that is EP x min(top_k, E/EP) / top_k; 1 at EP1.
    Evidence: structural (Megatron's all-to-all dispatcher has no capacity limit unless
    `moe_expert_capacity_factor` is set); docs/memory-model.md#expert-parallel.
    """
    local = moe.num_experts // ep
    return ep * min(moe.top_k, local) / moe.top_k


def busiest_rank_load(moe: MoeSpec, ep: int, assumed: float | None = None) -> float:
    """Routed rows of the busiest EP rank over rows x top_k: the price's load factor.

    Default (`assumed` None): `worst_case_load`, a bound whatever the router does, so the
    price is never under a skewed router's busiest rank. `assumed` (opt-in, the caller's
    `moe_load`): a bound the caller guarantees instead, e.g. Megatron's
    `moe_expert_capacity_factor` c with token dropping (each expert then takes at most c x its
    balanced share: load <= c) or a load measured on its own router; it is capped at the worst
    case, and the basis names it (`pricing.model.PricingModel.assumptions`). Balanced routing
    is `assumed=1`. Evidence: bench/results/moe_validation.txt (the traced busiest ranks of
    EP2/EP4 with Megatron's router and with a balanced one).
    """
    worst = worst_case_load(moe, ep)
    if assumed is None:
        return worst
    return min(float(assumed), worst)


def check_peer_row_scale(scale: float) -> None:
    """`peer_row_scale` (`PricingModel`, set by `planner.ep_peers`) must be a finite number >= 1:
    how many times this rank's smallest forward call of a wave its EP peers' largest concurrent
    call holds. The busiest rank's routed rows, a bound over its peers' calls (`worst_case_load`,
    or the caller's `moe_load` x their mean), grow by that factor; the rest of the wave is this
    rank's own."""
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 1.0 <= scale < float("inf"):
        raise bad(ConfigError, "peer_row_scale", scale,
                  "must be a finite number >= 1 (the EP peers' largest concurrent call over this rank's smallest)")


def check_assumed_load(assumed: float | None) -> None:
    """`moe_load` must be None or a finite number >= 1 (the balanced share is the least a
    busiest rank can hold)."""
    if assumed is None:
        return
    if isinstance(assumed, bool) or not isinstance(assumed, int | float) or not 1.0 <= assumed < float("inf"):
        raise bad(ConfigError, "moe_load", assumed,
                  "must be a finite number >= 1 (the busiest EP rank's routed rows over rows x top_k)")


def dispatch_per_routed_row(widths: dict, ep: int, tp: int = 1) -> float:
    """The token dispatcher's receive buffers on the busiest rank, per routed row of the
    gathered wave (rows x top_k x load). `tp` is the dispatcher's tensor-parallel size, the
    expert TP (`ParallelLayout.expert_tp`, Megatron's default TP); with an expert TP below TP
    the caller's load carries the ETP / TP share of the rows (`pricing.model`).

    At EP > 1 the dispatch all-to-all writes the routed rows this rank receives into a new
    [routed rows, H] bf16 tensor (`new_empty` in the anatomy), live beside the permuted input
    and its regrouping by local expert; the combine's all-to-all back reuses that much only
    after the dispatch buffer is freed (never both at the traced peaks): 2H bytes per routed
    row. Under TP (Megatron's MoE needs sequence parallelism there) each TP rank routes its
    1/TP shard of the rows, so that buffer is 2H / TP per gathered routed row, and the
    dispatcher then all-gathers the routed rows over TP (`gather_from_sequence_parallel_region`):
    2H more per gathered routed row. So 2H x ([EP > 1] / TP + [TP > 1]); 0 at TP1 EP1.
    Evidence: multi-rank CPU traces of the wide MoE shape: balanced EP2 and EP4 hold exactly
    rows x top_k x 2H more than TP1 at every recompute mode, both waves
    (bench/results/layouts_anatomy.txt); TP2+SP+EP2 holds about 1H per routed row more than that
    structure without the TP term (bench/results/moe_validation.txt)
    (docs/memory-model.md#expert-parallel). Structural, so both tables charge it.
    """
    return 2.0 * widths["H"] * ((1.0 / tp if ep > 1 else 0.0) + (1.0 if tp > 1 else 0.0))


def tp_backward_point_per_routed_row(widths: dict, *, etp: int) -> float:
    """A recomputed MoE layer's routed rows at its expert-TP backward point (point C), per
    routed row its expert-TP group runs; 0 at an expert TP of 1 (or without sequence
    parallelism: the caller passes 1).

    Under TP with SP each rank routes its 1/TP sequence shard; the all-to-all dispatcher
    all-gathers the routed rows over the expert-TP group (ETP ranks; Megatron's default ETP = TP)
    and its combine reduce-scatters the experts' output back over that group in the router's
    dtype (`reduce_scatter_to_sequence_parallel_region(hidden_states.to(probs.dtype))`). When
    the backward reaches the combine the rank holds, per routed row of the group: the experts'
    concatenated output (2H), its fp32 copy (4H), the reduce-scatter's fp32 output shard
    (4H / ETP), this rank's permuted rows of its own sequence shard (`permute`'s
    `index_select`, 2H / ETP) and every local expert's FC1 output and activation (10
    expert_ffn, already 1/ETP wide: `pricing.model.layer_widths`): 6H + 6H / ETP + 10
    expert_ffn. The dispatcher's gather and sort copies (`dispatch_per_routed_row`,
    `permutation_per_routed_row`) are live beside it, as at point A. Point A's permuted rows
    and the experts' FC2 outputs (4H) are released by then, so this point binds over point A
    (6H + 10 expert_ffn) by 6H / ETP per routed row; the walk takes the largest point
    (`pricing.terms.mlp_stage_per_row`), so it only raises a price where it binds. At ETP 1
    there is no gather and no reduce-scatter: the layer is a TP1 MoE layer on the rank's own
    shard (points A and B). Structural (CPU units, as Megatron's unfused dispatcher allocates
    them), so both tables charge it: no GPU trace measures a MoE layer under TP (with a bf16
    router the fp32 copy shrinks; the bound stays). Evidence: the busiest rank's backward
    peaks of grid-moe-h1024 (top 4) and grid-moe-a3b-h512 (top 8) at TP4+SP (`L*.mlp _to_copy`
    fp32 [routed rows, H], `cat`, `empty_like` fp32 [routed rows / 4, H], `index_select`
    [routed rows / 4, H], expert FC1 [.., 2F / 4]; bench/results/moe_tp_sp_anatomy.txt,
    docs/memory-model.md#moe-tp-point). O(1).
    """
    if etp <= 1:
        return 0.0
    h = widths["H"]
    return 6.0 * h + 6.0 * h / etp + 10.0 * widths["expert_ffn"]


def permutation_per_routed_row(table: CoefficientTable, widths: dict) -> float:
    """The dispatcher's top-k copies of the hidden rows, per routed row.

    Megatron's all-to-all dispatcher copies each token once per choice (`permute`:
    `index_select`, [rows x top_k, H]) and, with several local experts, sorts those copies by
    local expert (`sort_chunks_by_idxs`: a `cat` of the same size), then un-sorts the experts'
    output the same way in the combine: 2 x 2H bytes per routed row live in the recomputed
    MoE stage. Entry `moe_permutation` (`per_routed_row`); 0 where the table lacks it (te-gpu:
    its `moe_routed` was fitted to GPU runs that include the permutation, source 002).
    Evidence: bench/results/layouts_anatomy.txt (MoE-wide TP1: `L0.mlp index_select` and
    `L0.mlp cat`, 2H per routed row each); the single-rank tracer's stand-in dispatcher
    (`measure.trace._BalancedDispatcher`) makes neither sort copy, one reason the torch-cpu
    table fitted on its cells priced the real dispatcher 21 % under
    (docs/memory-model.md#expert-parallel).
    """
    if not table.kernels.permutation:
        return 0.0
    return table.per_row(PERMUTATION, widths, key="per_routed_row")


def routed_extra_per_row(table: CoefficientTable, widths: dict, *, ep: int, tp: int, load: float) -> float:
    """Per wave row: top_k x load x (permutation copy + dispatch buffer), what the all-to-all
    dispatcher adds on the busiest EP rank beyond a MoE term's own bytes; charged in the MoE
    layer's gradient stage, its forward transients and a retained layer's backward (`pricing.model`).
    Evidence: its two terms' (docs/memory-model.md#expert-parallel)."""
    return widths["top_k"] * load * (permutation_per_routed_row(table, widths)
                                     + dispatch_per_routed_row(widths, ep, tp))


def sp_retained_moe_layer_per_row(widths: dict, *, tp: int, etp: int, routed: float, rope_per_row: float,
                                  forward: bool = False, first: bool = False) -> float:
    """What an attention layer with a MoE MLP retains under TP with sequence parallelism without
    full recompute (selective or none), per gathered row, and (`forward`) its forward peak.

    What memory: the attention keeps its all-gathered input for the column-parallel weight
    gradients (2H per gathered row, not divided by TP) and, at per-TP-rank widths, its saved
    tensors (3 qkv + 5 core, as `layout_terms.sp_retained_layer_per_row`), the rotary frequencies
    gathered per row (2 x `rope_per_row`) and the LoRA adapters' rank-wide intermediates
    (8 x rank); on the rank's sequence shard, the two norms' fp32 inputs (8H / TP) and the
    pre-MLP norm's output and the residual sum (4H / TP: `pre_mlp_layernorm`, `L* add`; the small
    router, LoRA and routing groups the anatomy lists below them fit in it). Once per wave (`first`,
    the first layer): the layer's input (2H / TP, the embedding's `clone`) and the RoPE cache
    entry of the wave's longest sequence (`rotary_pos_emb` `cat`, [longest, rotary dim] fp32, one
    entry row per rank row: `rope_per_row`, the bound for a sequence as long as the rank's rows;
    under CP `layout_terms.cp_rope_cache_per_row` charges the rest of a wave-long entry, as the
    full-recompute point `sp_layer_point_per_row` does). The MoE MLP keeps, per routed row its
    expert-TP group runs (`routed` = top_k x the EP load x the expert-TP share), every local
    expert's FC1 output and activations (10 expert_ffn, already 1/ETP wide), and nothing
    hidden-wide: the dispatcher's gathered and sorted rows are released after the experts'
    forward (unlike a dense SP layer, whose MLP keeps its gathered input); the router's
    per-row tensors (its fp32 probabilities and routing maps, about 3 x experts bytes) come
    with it. Its forward peaks at the combine, over the retained layer: the experts'
    concatenated output (2H), its fp32 copy (4H), the dispatcher's TP gather and sort copies
    (`dispatch_per_routed_row`, `permutation_per_routed_row`, charged by the caller), the
    reduce-scatter's fp32 output shard (4H / ETP) and the rank's permuted rows of its own shard
    (2H / ETP): 6H + 6H / ETP per routed row (point C's hidden-wide tensors, in the forward;
    `tp_backward_point_per_routed_row`), plus the router's fp32 probabilities (8 x experts).
    A shared expert keeps its FC1 output and activations (8 shared_ffn traced, 10 charged, at
    per-TP-rank width) and nothing hidden-wide (its gathered input is the routed experts'
    `index_select`, released with them); at the forward peak its output projection's
    reduce-scattered output is live (2H / TP). (Was a dense SP MLP's 2H + 10 shared_ffn retained
    and 4H + 4H / TP at the forward peak, untraced: docs/memory-model.md#moe-shared-sp.)

    Formula: 2H + 12H / TP + 3 qkv + 5 core + 8 rank + 3 experts + 2 x rope_per_row
    + routed x 10 expert_ffn (+ 10 shared_ffn with a shared expert), + 2H / TP + rope_per_row
    for the `first` layer; `forward` adds routed x (6H + 6H / ETP; 6H at ETP1) + 8 experts (+ 2H
    / TP with a shared expert). 0 at TP1. Structural, in CPU units (torch
    norms' fp32 inputs, Megatron's unfused dispatcher): `pricing.model` charges it, in place of
    the TP1-fitted retained layer, where the table carries the other SP structural terms
    (`layout_terms.SP_RETAINED`: torch-cpu); te-gpu keeps its own retained MoE terms (8H + 6
    expert_ffn per routed row, a bound no GPU trace has measured) with the layout's credit. The
    basis stays conservative (no GPU trace of a retained MoE layer). Evidence:
    docs/memory-model.md#moe-sp-retained (bench/results/moe_sp_retained_anatomy.txt: the
    forward peaks of grid-moe-a3b-h512 and grid-moe-h1024 at TP2+SP and TP4+SP, no recompute,
    at L1.mlp's combine with L0 retained; the RoPE cache entry: #moe-cp,
    bench/results/moe_cp_anatomy.txt, every retained peak holds it, and without it the layer at
    TP2+SP+CP2 selective had no margin left for a wave of one sequence; the shared expert:
    bench/results/moe_shared_retained_anatomy.txt, grid-moe-shared-h1024 TP2+SP and TP4+SP none).
    O(1).
    """
    if tp <= 1:
        return 0.0
    h = widths["H"]
    out = (2.0 * h + (12.0 + 2.0 * first) * h / tp + 3.0 * widths["qkv"] + 5.0 * widths["core"] + 8.0 * widths["rank"]
           + 3.0 * widths["experts"] + (2.0 + first) * rope_per_row + routed * 10.0 * widths["expert_ffn"])
    shared = widths["shared_ffn"] > 0
    if shared:
        out += 10.0 * widths["shared_ffn"]
    if forward:
        out += routed * (6.0 * h + (6.0 * h / etp if etp > 1 else 0.0)) + 8.0 * widths["experts"]
        if shared:
            out += 2.0 * h / tp
    return out


# the wave's int64 inputs live through the step (token ids, labels, packed positions): 3 x 8 B per row
INPUT_IDS_PER_ROW = 24.0


def sp_layer_point_per_row(widths: dict, *, tp: int, rope_per_row: float, heads: float) -> float:
    """A recomputed attention layer with a MoE MLP under TP with sequence parallelism, at its MoE
    backward point (A, B or C): every tensor but the routed rows, the router and a shared expert,
    per gathered row.

    What memory: the attention's all-gathered input, kept for its column-parallel weight
    gradient (`linear_qkv` `empty`, 2H per gathered row, not divided by TP); at per-TP-rank
    widths the attention's saved tensors (the projection output with its LoRA sum, the rotated
    queries and keys, the core's input copy and output: 3 qkv + 5 core, as
    `layout_terms.sp_fc2_point_per_row`) and the rotary frequencies gathered per row (bf16 copies
    for queries and keys, 2 x `rope_per_row`); on the rank's sequence shard the two norms' fp32
    inputs (8H / TP) and the pre-MLP norm's bf16 output and the residual sum (4H / TP); the RoPE
    cache entry of the wave's longest sequence (`rotary_pos_emb` `cat`, fp32: `rope_per_row` per
    row, the bound for a sequence as long as the wave); the attention's LoRA intermediates
    ([rows, rank] bf16 for the QKV and output projections: 4 x rank); the flash core's fp32
    log-sum-exp (4 x `heads`, the attention heads per TP rank); the wave's int64 inputs (token ids,
    labels, packed positions: `INPUT_IDS_PER_ROW`, 24 B). Unlike a dense MLP at its
    output projection (`sp_fc2_point_per_row`: 8H + 14H / TP), the MoE MLP keeps no gathered input
    and no full-row output: its hidden-wide tensors are its routed rows' (points A, B, C and the
    dispatcher's copies, charged per routed row). The walk adds the input gradient, the
    boundaries and the pending adapter gradients.

    Formula: 2H + 12H / TP + 3 qkv + 5 core + 3 x rope_per_row + 4 x rank + 4 x heads + 24; 0 at
    TP1. `pricing.model`
    charges it with the routed stage (`terms.moe_routed_stage_per_row`) in place of the TP1-fitted
    stage sum (attention stage, gathered norm input and shards, `moe_norm_inputs`) and without the
    layout residual, where the table carries the SP structural terms (torch-cpu); te-gpu keeps its
    fitted stages. Structural. Evidence: the busiest rank's backward peaks of grid-moe-h1024 and
    grid-moe-a3b-h512 at TP4+SP with ETP1 (every storage of the formula live; 2048-token wave of
    h1024: 8,576 B per row of the 8,704 charged, the rest the RoPE cache bound) and ETP4
    (bench/results/moe_etp_anatomy.txt, moe_tp_sp_anatomy.txt; docs/memory-model.md#moe-etp). O(1).
    """
    if tp <= 1:
        return 0.0
    h = widths["H"]
    return (2.0 * h + 12.0 * h / tp + 3.0 * widths["qkv"] + 5.0 * widths["core"] + 3.0 * rope_per_row
            + 4.0 * widths["rank"] + 4.0 * heads + INPUT_IDS_PER_ROW)


def sp_shared_expert_point_per_row(widths: dict, *, tp: int) -> float:
    """A MoE layer's shared expert at the recomputed attention layer's TP+SP MoE backward point
    (`sp_layer_point_per_row`), per gathered row on one TP rank; 0 without one or at TP1 (where
    `terms.shared_expert_per_row`, in the fitted MLP stage, charges it).

    What memory: the shared expert (a dense MLP of TP-sharded width `shared_ffn`, on the gathered
    rows) has not run its backward yet when the routed experts run theirs: it holds its FC1 output
    (2 shared_ffn-wide, 4 shared_ffn), the gate's SiLU and the product's input (2 shared_ffn each):
    8 shared_ffn traced, 10 shared_ffn charged (the dense MLP's count with the product); and its
    output projection's output, reduce-scattered to the rank's sequence shard (2H / TP). Its
    gathered input is the routed experts' (`index_select`, in the routed stage) and its
    row-parallel LoRA output is released after the forward's reduce-scatter; nothing else of it
    is hidden-wide. (Was the untraced bound 8H + 10 shared_ffn: a dense SP MLP at its output
    projection plus its FC2 output, 7-8H per row over.)

    Formula: 2H / TP + 10 shared_ffn. Structural, in CPU units (like the other MoE SP terms,
    charged where the table carries them: torch-cpu). Evidence: docs/memory-model.md#moe-shared-sp
    (bench/results/moe_shared_anatomy.txt, grid-moe-shared-h1024 full recompute, the busiest
    rank's backward peak at L0's routed experts: `shared_experts.linear_fc2` `empty`
    [512, 1, 1024], `linear_fc1` `mm` [2048, 512], `add` and `silu` [2048, 1, 256] at TP4+SP:
    2,560 B per row (3,072 charged, 10,752 by the bound); 5,120 at TP2+SP; as the GDN layer's
    `gdn_terms.full_gdn_shared_expert_per_row`, docs/memory-model.md#gdn-full-point). O(1).
    """
    if tp <= 1 or not widths["shared_ffn"]:
        return 0.0
    return 2.0 * widths["H"] / tp + 10.0 * widths["shared_ffn"]
