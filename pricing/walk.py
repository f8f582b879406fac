"""The schedule walk: one wave's per-rank memory at every point of a full-recompute (or
retained-activation) forward and backward, jitted with numba. The peak is their maximum.

Schedule (docs/memory-model.md#schedule; the #anchors below are sections of that file):
- every gradient group runs its forward, saving per layer its retained rows (boundaries under
  full recompute) and, after the head, what the loss keeps; no-grad groups run forward only,
  one after another (#nograd-transient);
- then the gradient groups run their backward one after another (#other-groups): the head, then
  layer L-1 down to 0, where the recomputed layer holds its stage workspace, one input
  gradient, the GDN states of its segments (#gdn-states), the boundaries of layers 0..i and
  the adapter gradients of layers >= i if the group carries its slot's pending gradients.
- While group g runs, a group already run holds its pending gradients and a group not yet run
  holds its retained memory; the worst order charges each other group max(gradients,
  retained) (#other-groups, closed form; `brute_force_orders` in the tests checks it).
Groups of a slot that has several gradient groups in the wave (split children) charge that
slot's whole gradient once, in each of them, and none as "already run" (conservative).
"""

from __future__ import annotations

import numpy as np
from numba import njit

NUM_TERMS = 10
TERM_NAMES = ("retained", "workspace", "input_gradient", "pending_gradients", "gdn_states", "head",
              "other_groups", "nograd_transient", "caller", "first_execution")
POINT_NAMES = ("backward", "head-backward", "forward", "head-forward", "nograd-forward", "empty")


@njit(cache=True)
def _start(point, others, caller_bytes, first_exec):
    """A new walk point: the terms every point carries, the rest zero."""
    point[:] = 0.0
    point[6] = others
    point[8] = caller_bytes
    point[9] = first_exec


@njit(cache=True)
def _offer(best, out, point, code, layer, group):
    """Keep the point (and where it is) if it is the highest so far."""
    total = point.sum()
    if total > best[0]:
        best[0] = total
        best[1] = code
        best[2] = layer
        best[3] = group
        out[:] = point


@njit(cache=True)
def walk(retained, workspace, nograd, gdn_state, pending, input_grad, head_ret, head_tr,
         head_const, caller, first_exec, rows, logical, segments, grad, slot, carries):
    """Peak bytes of one wave on one rank.

    retained, workspace, nograd, gdn_state: float64[L] per row (per segment for gdn_state);
    pending: float64[S, L] adapter-gradient bytes per slot and layer; the group arrays
    (rows, logical, segments, grad, slot, carries) have one entry per group.
    Returns (best[4] = peak, point code, layer, group; terms[NUM_TERMS] at the peak).
    Complexity O(groups^2 + groups x L).
    """
    n_layers = retained.shape[0]
    n_groups = rows.shape[0]
    best = np.zeros(4)
    best[1] = 5
    best[2] = -1
    best[3] = -1
    out = np.zeros(NUM_TERMS)
    point = np.zeros(NUM_TERMS)
    if n_groups == 0:
        return best, out

    total_retained = retained.sum()
    cum = np.cumsum(retained)
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

    caller_bytes = caller * logical.sum()

    keep = np.zeros(n_groups)   # retained memory of a grad group not yet run
    done = np.zeros(n_groups)   # pending gradients a grad group leaves after its backward
    for g in range(n_groups):
        if grad[g]:
            keep[g] = rows[g] * (total_retained + head_ret)
            if carries[g] and per_slot[slot[g]] == 1:
                done[g] = suffix[slot[g], 0]
    others_all = 0.0
    for g in range(n_groups):
        if grad[g]:
            others_all += max(keep[g], done[g])

    for g in range(n_groups):
        if not grad[g]:
            # no-grad group: forward only, beside every grad group's retained memory
            ng = 0.0
            for i in range(n_layers):
                ng = max(ng, rows[g] * nograd[i])
            _start(point, others_all, caller_bytes, first_exec)
            point[7] = ng
            point[4] = segments[g] * max_state
            point[5] = rows[g] * head_ret + head_const
            _offer(best, out, point, 4, -1, g)
            continue
        others = others_all - max(keep[g], done[g])
        s = slot[g]
        shared_slot = per_slot[s] > 1
        # forward: layer i runs with boundaries 0..i-1 saved and the layer's own transient
        for i in range(n_layers):
            _start(point, others, caller_bytes, first_exec)
            point[0] = rows[g] * (cum[i] - retained[i])
            point[1] = rows[g] * nograd[i]
            point[4] = segments[g] * gdn_state[i]
            _offer(best, out, point, 2, i, g)
        _start(point, others, caller_bytes, first_exec)
        point[0] = rows[g] * total_retained
        point[5] = rows[g] * head_ret + head_const
        _offer(best, out, point, 3, -1, g)
        # backward of the head
        _start(point, others, caller_bytes, first_exec)
        point[0] = rows[g] * total_retained
        point[2] = rows[g] * input_grad
        point[3] = suffix[s, 0] if (carries[g] and shared_slot) else 0.0
        point[5] = rows[g] * (head_ret + head_tr) + head_const
        _offer(best, out, point, 1, -1, g)
        # backward, layer n-1 down to 0
        for i in range(n_layers - 1, -1, -1):
            _start(point, others, caller_bytes, first_exec)
            point[0] = rows[g] * cum[i]
            point[1] = rows[g] * workspace[i]
            point[2] = rows[g] * input_grad
            if carries[g]:
                point[3] = suffix[s, 0] if shared_slot else suffix[s, i]
            point[4] = segments[g] * gdn_state[i]
            _offer(best, out, point, 0, i, g)
    return best, out
