"""The schedule walk: one wave's per-rank bytes at every point of its forward and backward
(jitted with numba); the peak is their maximum.

Points: every gradient group's forward (layer 0 to L-1, then the head), every no-grad group's
forward, then every gradient group's backward (the head, then layer L-1 down to 0); every other
group charges max(its pending gradients, its retained memory) (the worst order), a GDN call its
chunk padding rows, a CP call its RoPE entries less `rope_credit`; with `mlp_points` each layer
has an MLP point beside its attention point in each pass (#fsdp-moe-points). See
docs/memory-model.md#schedule (#other-groups, #pending-gradients, #gdn-sp-retained,
#cp-rope-cache).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

# A walk point record: float64[NUM_TERMS], one column per term (TERM_NAMES order).
NUM_TERMS = 10
TERM_NAMES = ("retained", "workspace", "input_gradient", "pending_gradients", "gdn_states", "head",
              "other_groups", "nograd_transient", "caller", "first_execution")
(TERM_RETAINED, TERM_WORKSPACE, TERM_INPUT_GRADIENT, TERM_PENDING_GRADIENTS, TERM_GDN_STATES,
 TERM_HEAD, TERM_OTHER_GROUPS, TERM_NOGRAD_TRANSIENT, TERM_CALLER,
 TERM_FIRST_EXECUTION) = range(NUM_TERMS)

# Point codes: which part of the schedule a point is (POINT_NAMES order).
POINT_NAMES = ("backward", "head-backward", "forward", "head-forward", "nograd-forward", "empty")
(POINT_BACKWARD, POINT_HEAD_BACKWARD, POINT_FORWARD, POINT_HEAD_FORWARD, POINT_NOGRAD_FORWARD,
 POINT_EMPTY) = range(len(POINT_NAMES))

# Rows of `WalkCharges.mlp_points`, float64[MLP_ROWS, L] (L = 0: the layer points are not split).
MLP_ROWS = 10
(MLP_NOGRAD, MLP_WORKSPACE, MLP_KEPT, MLP_FORWARD, MLP_BACKWARD, LAYER_BACKWARD, MLP_RECOMPUTE,
 MLP_RECOMPUTE_CONST, ATTN_BACKWARD_SEGMENT, OWN_PENDING_LATE) = range(MLP_ROWS)
NO_MLP_POINTS = np.zeros((MLP_ROWS, 0))
"""The default `mlp_points`: every layer priced at one point per pass (Megatron-core)."""

# The peak record `walk` returns, float64[4]: bytes, point code, layer (-1: none), group (-1).
PEAK_BYTES, PEAK_POINT, PEAK_LAYER, PEAK_GROUP = range(4)


class WalkCharges(NamedTuple):
    """What the walk charges (`Charges.walk`, built by `PricingModel`): bytes per
    row of each layer, per segment, per slot's adapter gradients, and of the head."""

    retained: np.ndarray    # float64[L] per row, saved by a layer's forward for the backward
    workspace: np.ndarray   # float64[L] per row, the recomputed layer's backward workspace
    nograd: np.ndarray      # float64[L] per row, a layer's forward transient
    gdn_state: np.ndarray   # float64[L] per segment, a GDN layer's recurrent states
    pending: np.ndarray     # float64[S, L] adapter-gradient bytes per model slot and layer
    input_grad: float       # per row, the gradient flowing into a layer's backward
    head_retained: float    # per row, what the loss keeps for the backward
    head_transient: float   # per row, the head's backward transient
    head_const: float       # the head's constant bytes
    caller: float           # per logical row, the caller's own tensors
    pad_retained: np.ndarray  # float64[L] per padding row of a forward call, kept by layer i
    pad_point: np.ndarray   # float64[L] per padding row of a forward call at layer i's own points
    chunk: float            # a forward call's rows padded to a multiple of this (<= 1: none)
    rope_cp: float = 0.0    # per rank row: the CP RoPE cache bound the arrays above carry
    rope_entry: float = 0.0  # per row of a call's longest sequence: one RoPE cache entry row
    rope_kept: bool = False  # the bound is in retained[0] and nograd[0] (else every point's
    #                          workspace, no-grad transient and head transient: full recompute)
    head_forward: float = 0.0  # per row, what the head holds at its forward when more than
    #                            head_retained (`layout_terms.sp_head_forward_per_row`; 0: none)
    mlp_points: np.ndarray = NO_MLP_POINTS  # float64[MLP_ROWS, L], or [MLP_ROWS, 0]: none.
    #   Given, each layer has an MLP point beside its attention point in each pass: nograd and
    #   workspace are then the attention's, MLP_NOGRAD / MLP_WORKSPACE the MLP's per row,
    #   MLP_FORWARD / MLP_BACKWARD constant bytes at the layer's MLP point of that pass only,
    #   MLP_KEPT constant bytes layer i keeps from its forward MLP point to its backward one,
    #   LAYER_BACKWARD constant bytes (may be < 0) at both of layer i's backward points;
    #   MLP_RECOMPUTE (per row) and MLP_RECOMPUTE_CONST price a third backward point, the
    #   recomputed MLP's forward before its backward (all zero: below the attention's point);
    #   ATTN_BACKWARD_SEGMENT bytes per segment at layer i's attention backward point only
    #   (flash-attn's accumulator rows, #fsdp-flash-steps; gdn_state is at every point);
    #   OWN_PENDING_LATE the share of layer i's own pending gradients not yet made at its
    #   backward points (FSDP2's reduce-scatter makes them after), credited where the call is
    #   its slot's only gradient call (#fsdp-own-shard)
    #   (docs/memory-model.md#fsdp-moe-points)


class WalkGroups(NamedTuple):
    """A wave's forward calls (groups), one entry per group in every array."""

    rows: np.ndarray        # float64: rows on the busiest rank
    logical: np.ndarray     # float64: logical rows
    segments: np.ndarray    # float64: segments (tree nodes plus padding roots)
    grad: np.ndarray        # bool: a gradient group
    slot: np.ndarray        # int64: its model slot index
    carries: np.ndarray     # bool: it carries its slot's pending adapter gradients
    longest: np.ndarray     # float64: padded rows of its longest packed sequence (all ranks)


@njit(cache=True)
def rope_credit(charges, rows, longest):
    """What the CP RoPE cache bound in the arrays (`rope_cp` per rank row, a wave-long entry)
    over-charges a forward call whose longest padded sequence is `longest` rows.

    Formula: max(0, rope_cp x rows - rope_entry x max(0, longest - rows)), at most rope_cp x rows
    (longest <= CP x rows): the entry holds `longest` rows on every rank and the per-row terms price
    `rows` of them. See docs/memory-model.md#cp-rope-cache. O(1).
    """
    if charges.rope_cp <= 0.0:
        return 0.0
    bound = charges.rope_cp * rows
    held = charges.rope_entry * max(0.0, longest - rows)
    return max(0.0, bound - held)


# `_start` and `_offer` are inlined into `walk`: it passes them literal point codes, for which
# numba would otherwise compile one specialisation each (about a second apiece, cold).
@njit(cache=True, inline="always")
def _start(point, others, caller_bytes, first_exec):
    """A new walk point: the terms every point carries, the rest zero."""
    point[:] = 0.0
    point[TERM_OTHER_GROUPS] = others
    point[TERM_CALLER] = caller_bytes
    point[TERM_FIRST_EXECUTION] = first_exec


@njit(cache=True, inline="always")
def _offer(best, out, point, code, layer, group):
    """Keep the point (and where it is) if it is the highest so far."""
    total = point.sum()
    if total > best[PEAK_BYTES]:
        best[PEAK_BYTES] = total
        best[PEAK_POINT] = code
        best[PEAK_LAYER] = layer
        best[PEAK_GROUP] = group
        for t in range(point.shape[0]):   # a loop, not `out[:] = point`: numba's slice copy
            out[t] = point[t]               # compiles a shape check with string formatting (seconds)


@njit(cache=True)
def walk(charges, first_exec, groups):
    """Peak bytes of one wave on one rank.

    `charges`: a `WalkCharges` (the model's bytes per row, layer and slot); `first_exec`: the
    first-execution allowance every point carries (the caller passes 0 when it does not apply);
    `groups`: a `WalkGroups` (the wave's forward calls).
    Returns (best[4], the peak record: PEAK_BYTES, PEAK_POINT, PEAK_LAYER, PEAK_GROUP;
    terms[NUM_TERMS] at the peak). Complexity O(groups^2 + groups x L).
    """
    retained = charges.retained
    workspace = charges.workspace
    nograd = charges.nograd
    gdn_state = charges.gdn_state
    pending = charges.pending
    input_grad = charges.input_grad
    head_ret = charges.head_retained
    head_tr = charges.head_transient
    head_const = charges.head_const
    head_fwd = max(head_ret, charges.head_forward)   # the head's forward point (#sp-head-forward)
    pad_ret = charges.pad_retained
    pad_point = charges.pad_point
    chunk = charges.chunk
    rows = groups.rows
    segments = groups.segments
    grad = groups.grad
    slot = groups.slot
    carries = groups.carries
    kept = charges.rope_kept
    mlp = charges.mlp_points
    split = mlp.shape[1] > 0
    n_layers = retained.shape[0]
    n_groups = rows.shape[0]
    best = np.zeros(4)
    best[PEAK_POINT] = POINT_EMPTY
    best[PEAK_LAYER] = -1
    best[PEAK_GROUP] = -1
    out = np.zeros(NUM_TERMS)
    point = np.zeros(NUM_TERMS)
    if n_groups == 0:
        return best, out

    total_retained = retained.sum()
    cum = np.cumsum(retained)
    # the MLP points' kept constants: before layer i's forward MLP point, through layer i's
    cum_kept = np.zeros(n_layers)
    total_kept = 0.0
    if split:
        cum_kept = np.cumsum(mlp[MLP_KEPT])
        total_kept = cum_kept[n_layers - 1] if n_layers > 0 else 0.0
    total_pad = pad_ret.sum()
    cum_pad = np.cumsum(pad_ret)
    pad = np.zeros(n_groups)   # each forward call's padding rows (a GDN kernel's chunk)
    if chunk > 1.0:
        for g in range(n_groups):
            pad[g] = np.ceil(rows[g] / chunk) * chunk - rows[g]
    max_state = gdn_state.max() if n_layers > 0 else 0.0
    n_slots = pending.shape[0]
    suffix = np.zeros((n_slots, n_layers + 1))
    for s in range(n_slots):
        for i in range(n_layers - 1, -1, -1):
            suffix[s, i] = suffix[s, i + 1] + pending[s, i]
    per_slot = np.zeros(n_slots, dtype=np.int64)
    for g in range(n_groups):
        if grad[g]:
            per_slot[slot[g]] += 1

    caller_bytes = charges.caller * groups.logical.sum()

    # the CP RoPE cache bound the arrays carry, less what each call's longest sequence holds
    # (`rope_credit`): taken off where the arrays carry the bound (`rope_kept`: in retained[0]
    # and nograd[0]; else in every layer's workspace and no-grad transient and the head's)
    credit = np.zeros(n_groups)
    for g in range(n_groups):
        credit[g] = rope_credit(charges, rows[g], groups.longest[g])

    keep = np.zeros(n_groups)   # retained memory of a grad group not yet run
    done = np.zeros(n_groups)   # pending gradients a grad group leaves after its backward
    for g in range(n_groups):
        if grad[g]:
            keep[g] = rows[g] * (total_retained + head_ret) + pad[g] * total_pad
            if split:
                keep[g] += total_kept
            if kept:
                keep[g] -= credit[g]
            if carries[g] and per_slot[slot[g]] == 1:
                done[g] = suffix[slot[g], 0]
    others_all = 0.0
    for g in range(n_groups):
        if grad[g]:
            others_all += max(keep[g], done[g])
    # every call keeps its own RoPE cache entry (its longest sequence's rows, on every rank) to the
    # end of the step; a call's own entry is in its per-row terms, the other calls' are not
    entries = 0.0
    for g in range(n_groups):
        entries += charges.rope_entry * groups.longest[g]

    for g in range(n_groups):
        if not grad[g]:
            # no-grad group: forward only, beside every grad group's retained memory
            ng = 0.0
            for i in range(n_layers):
                ng = max(ng, rows[g] * nograd[i] + pad[g] * pad_point[i]
                         - (credit[g] if (i == 0 or not kept) else 0.0))
                if split:   # the MLP's point: its transient and constants
                    ng = max(ng, rows[g] * mlp[MLP_NOGRAD, i] + mlp[MLP_FORWARD, i] + mlp[MLP_KEPT, i]
                             + pad[g] * pad_point[i] - (credit[g] if (i == 0 or not kept) else 0.0))
            _start(point, others_all + entries - charges.rope_entry * groups.longest[g],
                   caller_bytes, first_exec)
            point[TERM_NOGRAD_TRANSIENT] = ng
            point[TERM_GDN_STATES] = segments[g] * max_state
            point[TERM_HEAD] = rows[g] * head_fwd + head_const
            _offer(best, out, point, POINT_NOGRAD_FORWARD, -1, g)
            continue
        others = others_all - max(keep[g], done[g]) + entries - charges.rope_entry * groups.longest[g]
        s = slot[g]
        shared_slot = per_slot[s] > 1
        # forward: layer i runs with boundaries 0..i-1 saved and the layer's own transient
        for i in range(n_layers):
            _start(point, others, caller_bytes, first_exec)
            point[TERM_RETAINED] = rows[g] * (cum[i] - retained[i]) + pad[g] * (cum_pad[i] - pad_ret[i])
            point[TERM_WORKSPACE] = rows[g] * nograd[i] + pad[g] * pad_point[i]
            if kept and i > 0:
                point[TERM_RETAINED] -= credit[g]
            else:
                point[TERM_WORKSPACE] -= credit[g]
            point[TERM_GDN_STATES] = segments[g] * gdn_state[i]
            if split:
                point[TERM_RETAINED] += cum_kept[i] - mlp[MLP_KEPT, i]
            _offer(best, out, point, POINT_FORWARD, i, g)
            if split:   # the layer's MLP: its own kept constant from here on
                point[TERM_RETAINED] += mlp[MLP_KEPT, i]
                point[TERM_WORKSPACE] += (rows[g] * (mlp[MLP_NOGRAD, i] - nograd[i])
                                          + mlp[MLP_FORWARD, i])
                _offer(best, out, point, POINT_FORWARD, i, g)
        _start(point, others, caller_bytes, first_exec)
        point[TERM_RETAINED] = (rows[g] * total_retained + pad[g] * total_pad - (credit[g] if kept else 0.0)
                                + total_kept)
        point[TERM_HEAD] = rows[g] * head_fwd + head_const
        _offer(best, out, point, POINT_HEAD_FORWARD, -1, g)
        # backward of the head
        _start(point, others, caller_bytes, first_exec)
        point[TERM_RETAINED] = rows[g] * total_retained + pad[g] * total_pad + total_kept
        point[TERM_INPUT_GRADIENT] = rows[g] * input_grad
        point[TERM_PENDING_GRADIENTS] = suffix[s, 0] if (carries[g] and shared_slot) else 0.0
        point[TERM_HEAD] = rows[g] * (head_ret + head_tr) + head_const
        if kept:
            point[TERM_RETAINED] -= credit[g]
        else:
            point[TERM_HEAD] -= credit[g]
        _offer(best, out, point, POINT_HEAD_BACKWARD, -1, g)
        # backward, layer n-1 down to 0
        for i in range(n_layers - 1, -1, -1):
            _start(point, others, caller_bytes, first_exec)
            point[TERM_RETAINED] = rows[g] * cum[i] + pad[g] * cum_pad[i]
            point[TERM_WORKSPACE] = rows[g] * workspace[i] + pad[g] * pad_point[i]
            if kept:
                point[TERM_RETAINED] -= credit[g]
            else:
                point[TERM_WORKSPACE] -= credit[g]
            point[TERM_INPUT_GRADIENT] = rows[g] * input_grad
            if carries[g]:
                point[TERM_PENDING_GRADIENTS] = suffix[s, 0] if shared_slot else suffix[s, i]
                if split and not shared_slot:   # its own not yet made (`OWN_PENDING_LATE`)
                    point[TERM_PENDING_GRADIENTS] -= mlp[OWN_PENDING_LATE, i] * pending[s, i]
            point[TERM_GDN_STATES] = segments[g] * gdn_state[i]
            if split:   # the MLP's backward first, then the attention's without its constants
                point[TERM_WORKSPACE] += mlp[LAYER_BACKWARD, i]
                point[TERM_RETAINED] += cum_kept[i]
                ws = point[TERM_WORKSPACE]
                point[TERM_WORKSPACE] += rows[g] * (mlp[MLP_WORKSPACE, i] - workspace[i]) + mlp[MLP_BACKWARD, i]
                _offer(best, out, point, POINT_BACKWARD, i, g)
                # the recomputed MLP's forward, before its backward's gradients
                point[TERM_WORKSPACE] = (ws + rows[g] * (mlp[MLP_RECOMPUTE, i] - workspace[i])
                                         + mlp[MLP_RECOMPUTE_CONST, i])
                _offer(best, out, point, POINT_BACKWARD, i, g)
                point[TERM_RETAINED] -= mlp[MLP_KEPT, i]
                point[TERM_WORKSPACE] = ws
                point[TERM_GDN_STATES] += segments[g] * mlp[ATTN_BACKWARD_SEGMENT, i]
            _offer(best, out, point, POINT_BACKWARD, i, g)
    return best, out
