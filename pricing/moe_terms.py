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

    Formula: EP x min(top_k, E / EP) / top_k (1 at EP1): each EP rank sends at most min(top_k, E/EP)
    of a token's choices to one rank's local experts, every rank running a wave of at most `rows`
    rows. Megatron's all-to-all dispatcher has no capacity limit unless
    `moe_expert_capacity_factor` is set. See docs/memory-model.md#expert-parallel.
    """
    local = moe.num_experts // ep
    return ep * min(moe.top_k, local) / moe.top_k


def busiest_rank_load(moe: MoeSpec, ep: int, assumed: float | None = None) -> float:
    """Routed rows of the busiest EP rank over rows x top_k: the price's load factor.

    Formula: `worst_case_load` by default (a bound whatever the router does), or min(`assumed`,
    worst case) where the caller guarantees a bound (`moe_load`: a capacity factor with token
    dropping, a measured load; the basis names it). Balanced routing is `assumed=1`. See
    docs/memory-model.md#expert-parallel.
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
    gathered wave (rows x top_k x load); `tp` is the dispatcher's (expert) TP.

    Formula: 2H x ([EP > 1] / TP + [TP > 1]); 0 at TP1 EP1: the dispatch all-to-all's [routed rows,
    H] bf16 output (a 1/TP share under TP with SP; the combine reuses the space after it is freed) and,
    under TP, the all-gather of the routed rows over TP. Structural, so both tables charge it. See
    docs/memory-model.md#expert-parallel.
    """
    return 2.0 * widths["H"] * ((1.0 / tp if ep > 1 else 0.0) + (1.0 if tp > 1 else 0.0))


def tp_backward_point_per_routed_row(widths: dict, *, etp: int) -> float:
    """A recomputed MoE layer's routed rows at its expert-TP backward point (point C), per
    routed row its expert-TP group runs; 0 at an expert TP of 1 (or without SP: the caller passes 1).

    Terms, when the backward reaches the combine: the experts' concatenated output (2H), its fp32
    copy (4H), the reduce-scatter's fp32 output shard (4H / ETP), the rank's permuted rows of its own
    shard (2H / ETP) and the local experts' FC1 output and activations (10 expert_ffn, 1/ETP wide).

    Formula: 6H + 6H / ETP + 10 expert_ffn. Binds over point A by 6H / ETP; structural (CPU units,
    Megatron's unfused dispatcher), so both tables charge it. See
    docs/memory-model.md#moe-tp-point. O(1).
    """
    if etp <= 1:
        return 0.0
    h = widths["H"]
    return 6.0 * h + 6.0 * h / etp + 10.0 * widths["expert_ffn"]


def permutation_per_routed_row(table: CoefficientTable, widths: dict) -> float:
    """The dispatcher's top-k copies of the hidden rows, per routed row.

    Formula: `moe_permutation` (2 x 2H on the CPU: `permute`'s `index_select` and, with several
    local experts, the `sort_chunks_by_idxs` copy); 0 where the table lacks it (te-gpu: its fitted
    `moe_routed` includes the permutation). See docs/memory-model.md#expert-parallel.
    """
    if not table.kernels.permutation:
        return 0.0
    return table.per_row(PERMUTATION, widths, key="per_routed_row")


def routed_extra_per_row(table: CoefficientTable, widths: dict, *, ep: int, tp: int, load: float) -> float:
    """Per wave row: top_k x load x (permutation copy + dispatch buffer), what the all-to-all
    dispatcher adds on the busiest EP rank beyond a MoE term's own bytes; charged in the MoE
    layer's gradient stage, its forward transients and a retained layer's backward (`pricing.model`).
    See docs/memory-model.md#expert-parallel.
    """
    return widths["top_k"] * load * (permutation_per_routed_row(table, widths)
                                     + dispatch_per_routed_row(widths, ep, tp))


def sp_retained_moe_layer_per_row(widths: dict, *, tp: int, etp: int, routed: float, rope_per_row: float,
                                  forward: bool = False, first: bool = False) -> float:
    """What an attention layer with a MoE MLP retains under TP with sequence parallelism without
    full recompute (selective or none), per gathered row, and (`forward`) its forward peak.

    Terms: the attention's gathered input (2H), its saved tensors (3 qkv + 5 core), the rotary
    frequencies (2 x rope_per_row) and the adapters' intermediates (8 rank); on the rank's shard the
    norms' fp32 inputs, the pre-MLP norm's output and the residual sum (12H / TP); the router's
    per-row tensors (3 experts); per routed row (`routed` = top_k x the EP load x the expert-TP
    share) the local experts' FC1 output and activations (10 expert_ffn); a shared expert's
    (10 shared_ffn). Nothing hidden-wide per routed row: the dispatcher's rows are released after
    the experts' forward. The `first` layer adds the embedding's copy (2H / TP) and the RoPE cache
    entry (rope_per_row); the forward peak at the combine adds point C's hidden-wide tensors, the
    router's fp32 probabilities and a shared expert's output shard.

    Formula: 2H + 12H / TP + 3 qkv + 5 core + 8 rank + 3 experts + 2 x rope_per_row
    + routed x 10 expert_ffn (+ 10 shared_ffn), + 2H / TP + rope_per_row for the `first` layer;
    `forward` adds routed x (6H + 6H / ETP; 6H at ETP1) + 8 experts (+ 2H / TP with a shared
    expert). 0 at TP1. Charged in place of the TP1-fitted retained layer on torch-cpu; te-gpu keeps
    its own retained MoE terms with the layout's credit. See docs/memory-model.md#moe-sp-retained.
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

    Terms: the attention's gathered input (2H), its saved tensors (3 qkv + 5 core), the rotary
    frequencies' bf16 copies and the fp32 RoPE cache entry (3 x rope_per_row), on the rank's shard
    the norms' fp32 inputs, the pre-MLP norm's output and the residual sum (12H / TP), the LoRA
    intermediates (4 rank), the flash log-sum-exp (4 heads per TP rank) and the wave's int64 inputs
    (24 B). The MoE MLP keeps no gathered input: its hidden-wide tensors are its routed rows'.

    Formula: 2H + 12H / TP + 3 qkv + 5 core + 3 x rope_per_row + 4 rank + 4 heads + 24; 0 at
    TP1. Charged with the routed stage in place of the TP1-fitted stage sum and without the layout
    residual, on torch-cpu. See docs/memory-model.md#moe-etp. O(1).
    """
    if tp <= 1:
        return 0.0
    h = widths["H"]
    return (2.0 * h + 12.0 * h / tp + 3.0 * widths["qkv"] + 5.0 * widths["core"] + 3.0 * rope_per_row
            + 4.0 * widths["rank"] + 4.0 * heads + INPUT_IDS_PER_ROW)


def sp_shared_expert_point_per_row(widths: dict, *, tp: int) -> float:
    """A MoE layer's shared expert at the recomputed attention layer's TP+SP MoE backward point
    (`sp_layer_point_per_row`), per gathered row on one TP rank; 0 without one or at TP1 (where
    `terms.shared_expert_per_row` charges it).

    Formula: 2H / TP + 10 shared_ffn: its FC1 output and activations (it has not run its backward
    yet) and its output projection's reduce-scattered output; its gathered input is the routed
    experts' and its LoRA output is released after the forward. Structural (torch-cpu), as
    `gdn_terms.full_gdn_shared_expert_per_row`. See docs/memory-model.md#moe-shared-sp. O(1).
    """
    if tp <= 1 or not widths["shared_ffn"]:
        return 0.0
    return 2.0 * widths["H"] / tp + 10.0 * widths["shared_ffn"]
