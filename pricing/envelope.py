"""The affine envelope: the schedule walk's points as linear functions of a wave's counts.

Formula: at point p, const[p] + sum over classes k present (presence[p, k] + coef[p, k] . (packed
rows, logical rows, segments)), in admitted bytes; coef[..., 2] = (multiple - 1) x pad + 2 x seg.
An upper bound of the exact admitted price of a flat wave without pending gradients, so the
search packs against it as vector bin packing. See docs/architecture.md#the-envelope.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .model import PricingModel
from .tolerances import ENVELOPE_ROUNDING_BYTES, LOWER_ENVELOPE_MARGIN
from .walk import (
    ATTN_BACKWARD_SEGMENT,
    LAYER_BACKWARD,
    MLP_BACKWARD,
    MLP_FORWARD,
    MLP_KEPT,
    MLP_NOGRAD,
    MLP_RECOMPUTE,
    MLP_RECOMPUTE_CONST,
    MLP_WORKSPACE,
    OWN_PENDING_LATE,
)


@dataclass(frozen=True)
class Envelope:
    const: np.ndarray     # float64[P]
    presence: np.ndarray  # float64[P, K]
    coef: np.ndarray      # float64[P, K, 3]: per packed row, per logical row, per segment
    # the parts of coef[..., 2] (None when unknown, e.g. a scaled copy): per padding row and
    # per true segment, and the row multiple each packed sequence is padded to
    pad: np.ndarray | None = None   # float64[P, K]
    seg: np.ndarray | None = None   # float64[P, K]
    multiple: int = 1
    # lower envelope only: what the point's running class adds when its wave carries that
    # class's slot's pending adapter gradients (its adapter gradients of the layers >= the
    # point's layer, backward points only), float64[P, K]
    pending: np.ndarray | None = None

    @property
    def num_points(self) -> int:
        return int(self.const.shape[0])

    def value(self, present: np.ndarray, counts: np.ndarray) -> float:
        """max over points; `present`: bool[K]; `counts`: float[K, 3]. O(P x K)."""
        vals = self.const + self.presence @ present.astype(np.float64) + np.einsum(
            "pkc,kc->p", self.coef, counts)
        return float(vals.max()) if vals.size else 0.0


def build_envelope(model: PricingModel, class_grad: Sequence[bool], class_slot: Sequence[str], *,
                   lower: bool = False) -> Envelope:
    """Envelope over gradient classes (one forward call each). O(K^2 x L) to build, then pruned
    of points dominated coefficient-wise by another point.

    `lower=True` gives the matching lower envelope in true packed rows (see below), used to
    bound the number of waves of any plan from below."""
    a = model.charges.walk
    k_classes = len(class_grad)
    ret, ws, ng, gdn = a.retained, a.workspace, a.nograd, a.gdn_state
    cum = np.cumsum(ret)
    total = float(ret.sum()) if ret.size else 0.0
    keep = total + a.head_retained  # per row of a grad group not yet run
    ig, head_ret, head_tr, head_c = a.input_grad, a.head_retained, a.head_transient, a.head_const
    head_fwd = max(head_ret, a.head_forward)   # the head's forward point (walk.WalkCharges)
    max_state = float(gdn.max()) if gdn.size else 0.0
    max_ng = float(ng.max()) if ng.size else 0.0
    # a GDN kernel's padding rows, at most chunk - 1 per forward call (gdn_terms), as presence:
    # kept like retained rows (pad_ret), and pad_point more at the layer's own points; the lower
    # envelope leaves them out (they are >= 0)
    most_pad = max(float(a.chunk) - 1.0, 0.0) if not lower else 0.0
    pad_ret, pad_point = a.pad_retained, a.pad_point
    cum_pad = np.cumsum(pad_ret)
    total_pad = float(pad_ret.sum()) if pad_ret.size else 0.0
    # split layer points (`walk.WalkCharges.mlp_points`): the MLP's points, the kept constants
    mlp = a.mlp_points
    split = mlp.shape[1] > 0
    kept_c = mlp[MLP_KEPT] if split else np.zeros(ret.shape[0])
    cum_kept = np.cumsum(kept_c)
    total_kept = float(kept_c.sum())
    layer_bwd = mlp[LAYER_BACKWARD] if split else np.zeros(ret.shape[0])
    # per segment at a layer's attention backward point only (`walk.WalkCharges.mlp_points`)
    attn_seg = mlp[ATTN_BACKWARD_SEGMENT] if split else np.zeros(ret.shape[0])

    # Each point: the running class, its row / segment / presence coefficients.
    running, row_own, seg_own, pres_own, pend_own = [], [], [], [], []
    for g in range(k_classes):
        if not class_grad[g]:
            running.append(np.array([g]))
            row_own.append(np.array([max_ng + head_fwd]))
            seg_own.append(np.array([max_state]))
            pres_own.append(np.array([head_c + most_pad * (float(pad_point.max()) if ng.size else 0.0)]))
            pend_own.append(np.zeros(1))
            if split:   # the MLP's no-grad point: at most its largest transient and constants
                running.append(np.array([g]))
                row_own.append(np.array([float(mlp[MLP_NOGRAD].max()) + head_fwd]))
                seg_own.append(np.array([max_state]))
                pres_own.append(np.array([head_c + most_pad * float(pad_point.max())
                                          + float((mlp[MLP_FORWARD] + kept_c).max())]))
                pend_own.append(np.zeros(1))
            continue
        n = ret.shape[0]
        running.append(np.full(2 * n + 2 + (3 * n if split else 0), g))
        row_own.append(np.concatenate([cum - ret + ng, cum + ws + ig,
                                       [total + head_fwd, total + head_ret + head_tr + ig]]))
        seg_own.append(np.concatenate([gdn, gdn + attn_seg, [0.0, 0.0]]))
        pres_own.append(np.concatenate([most_pad * (cum_pad - pad_ret + pad_point) + cum_kept - kept_c,
                                        most_pad * (cum_pad + pad_point) + cum_kept - kept_c + layer_bwd,
                                        [head_c + most_pad * total_pad + total_kept] * 2]))
        grads = a.pending[model.slot_index(class_slot[g])]
        suffix = np.cumsum(grads[::-1])[::-1] if grads.size else np.zeros(n)
        if split:   # a lone call's own layer's not yet made (`walk.WalkCharges.mlp_points`)
            suffix = suffix - mlp[OWN_PENDING_LATE] * grads
        pend_own.append(np.concatenate([np.zeros(n), suffix, [0.0, 0.0]]))
        if split:   # each layer's MLP points (`walk.WalkCharges.mlp_points`)
            row_own.append(np.concatenate([cum - ret + mlp[MLP_NOGRAD], cum + mlp[MLP_WORKSPACE] + ig,
                                           cum + mlp[MLP_RECOMPUTE] + ig]))
            seg_own.append(np.concatenate([gdn, gdn, gdn]))
            pres_own.append(np.concatenate([most_pad * (cum_pad - pad_ret + pad_point) + cum_kept
                                            + mlp[MLP_FORWARD],
                                            most_pad * (cum_pad + pad_point) + cum_kept + mlp[MLP_BACKWARD]
                                            + layer_bwd,
                                            most_pad * (cum_pad + pad_point) + cum_kept
                                            + mlp[MLP_RECOMPUTE_CONST] + layer_bwd]))
            pend_own.append(np.concatenate([np.zeros(n), suffix, suffix]))
    if not running:
        empty = np.zeros((0, k_classes))
        return Envelope(np.zeros(0), empty, np.zeros((0, k_classes, 3)), empty, empty,
                        model.parallel.row_multiple)
    run = np.concatenate(running)
    num_points = run.shape[0]
    cols = np.arange(num_points)
    # other gradient classes hold their retained memory (the worst order, no pending gradients)
    row_c = np.tile(np.where(np.asarray(class_grad, dtype=bool), keep, 0.0), (num_points, 1))
    row_c[cols, run] = np.concatenate(row_own)
    seg_c = np.zeros((num_points, k_classes))
    seg_c[cols, run] = np.concatenate(seg_own)
    # ... and their padding rows' (at most chunk - 1 per forward call)
    pres_c = np.tile(np.where(np.asarray(class_grad, dtype=bool), most_pad * total_pad + total_kept, 0.0),
                     (num_points, 1))
    pres_c[cols, run] = np.concatenate(pres_own)
    if lower:
        # Valid below the exact price of any flat wave in which some class is present: rows
        # are at least packed/CP, pads and segments are dropped (>= 0), and so is the
        # first-execution charge (it needs a gradient group; the caller adds it where it
        # applies). The presence charge (the head constant at a class's head points) is paid
        # whenever the class is present, so it is kept. Packed rows are subadditive over a
        # partition of the step, so summing this over waves bounds the wave count from below.
        # A wave whose single group of class k carries its slot's pending gradients also
        # holds, at k's backward point of layer i, the adapter gradients of layers >= i.
        # The walk credits each call the CP RoPE cache bound its longest sequence does not
        # hold (`walk.rope_credit`, at most rope_cp per rank row): taken off every row charge.
        row_c = np.maximum(row_c - a.rope_cp, 0.0)
        coef = np.zeros((row_c.shape[0], k_classes, 3))
        coef[:, :, 0] = row_c / model.rows_cp
        coef[:, :, 1] = a.caller
        pend = np.zeros((num_points, k_classes))
        pend[cols, run] = np.concatenate(pend_own)
        s = model.safety * (1.0 - LOWER_ENVELOPE_MARGIN)
        return Envelope(const=np.zeros(row_c.shape[0]), presence=pres_c * s, coef=coef * s,
                        pending=pend * s)
    # the other calls' RoPE cache entries (`walk`: each call keeps its longest sequence's rows,
    # at most its padded rows = rows_cp x its rank rows)
    others = np.ones((num_points, k_classes), dtype=bool)
    others[cols, run] = False
    row_c = row_c + np.where(others, a.rope_entry * model.rows_cp, 0.0)
    const, row_c, seg_c, pres_c = _first_execution_points(row_c, seg_c, pres_c, run,
                                                          class_grad, float(model.charges.first_exec))
    # the resident bytes (FSDP2's gathered parameters) every point of any wave holds, as the
    # walk charges them (`price.price_groups`), no-gradient waves included
    if model.charges.resident:
        const = const + float(model.charges.resident)
    if model.charges.start:   # the forward's start (`price.forward_start`): one more point
        const = np.append(const, float(model.charges.start))
        row_c = np.vstack([row_c, np.full((1, k_classes), float(model.charges.start_row))])
        seg_c = np.vstack([seg_c, np.zeros((1, k_classes))])
        pres_c = np.vstack([pres_c, np.zeros((1, k_classes))])
    multiple = model.parallel.row_multiple
    cp_div = model.rows_cp
    coef = np.zeros((row_c.shape[0], k_classes, 3))
    coef[:, :, 0] = row_c / cp_div
    coef[:, :, 1] = a.caller
    pad = row_c / cp_div + seg_c       # a padding row: one more row, one more root segment
    coef[:, :, 2] = pad * (multiple - 1) + 2.0 * seg_c
    keep_idx = _undominated(const, pres_c, coef, pad, seg_c)
    s = model.safety
    return Envelope(const=const[keep_idx] * s + ENVELOPE_ROUNDING_BYTES,
                    presence=pres_c[keep_idx] * s, coef=coef[keep_idx] * s,
                    pad=pad[keep_idx] * s, seg=seg_c[keep_idx] * s, multiple=int(multiple))


def _first_execution_points(row_c: np.ndarray, seg_c: np.ndarray, pres_c: np.ndarray,
                            run: np.ndarray, class_grad: Sequence[bool], first_exec: float):
    """The first-execution allowance, paid once by a wave with a gradient group: a constant
    at a gradient class's points (they bind only when that class runs); a no-gradient
    class's point becomes one copy per gradient class k that charges it as k's presence, so
    their max pays it exactly when some gradient class shares the wave. (A constant there
    refused no-gradient waves that fit; the uncharged original is dominated by its copies
    and pruned, unless the step has no gradient class.) Returns const, rows, segments and
    presence per point; O(P x K)."""
    grad = np.asarray(class_grad, dtype=bool)
    own_grad = grad[run]
    const = np.where(own_grad, first_exec, 0.0)
    grad_cols = np.flatnonzero(grad)
    ng_points = np.flatnonzero(~own_grad)
    if grad_cols.size == 0 or ng_points.size == 0:
        return const, row_c, seg_c, pres_c
    rep = np.repeat(ng_points, grad_cols.size)
    extra = pres_c[rep].copy()
    extra[np.arange(rep.size), np.tile(grad_cols, ng_points.size)] += first_exec
    return (np.concatenate([const, np.zeros(rep.size)]), np.concatenate([row_c, row_c[rep]]),
            np.concatenate([seg_c, seg_c[rep]]), np.concatenate([pres_c, extra]))


def _undominated(const: np.ndarray, pres: np.ndarray, coef: np.ndarray,
                 *extra: np.ndarray) -> np.ndarray:
    """Indices of points not dominated (<= in every coefficient) by another point; of equal
    points the first is kept. O(P^2 x dims), vectorised."""
    flat = np.concatenate([const[:, None], pres, coef.reshape(coef.shape[0], -1), *extra],
                          axis=1)
    geq = np.all(flat[:, None, :] >= flat[None, :, :], axis=2)  # geq[q, p]: q dominates p
    gt = np.any(flat[:, None, :] > flat[None, :, :], axis=2)
    earlier = np.tri(flat.shape[0], k=-1, dtype=bool)           # earlier[q, p]: q < p
    dominated = (geq & (gt | earlier)).any(axis=0)
    return np.flatnonzero(~dominated)
