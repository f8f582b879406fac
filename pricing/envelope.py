"""The affine envelope: the schedule walk's points as linear functions of a wave's counts.

For each walk point p: a constant, a presence charge per gradient class (paid once if the class
has a request in the wave), and per class coefficients on packed rows, logical rows and
segments, all in admitted bytes. "max of affine <= budget" is a set of linear constraints, so
the search can pack with it as vector bin packing.

Validity (tested on random waves): for a flat wave without pending gradients, the envelope at
the search's two-level counts (each prefix group pays its prefix once per class, segments =
groups + members) is never below the exact admitted price. The bounds used:
- padded rows <= packed rows + (multiple - 1) x packed sequences, and sequences <= segments;
- true radix-tree segments <= 2 x the two-level count (at most one inner node per leaf), plus
  one root per padding row;
- pending gradients are not in the envelope: the search prices the wave that carries them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .model import PricingModel

# Absorbs the integer rounding of raw and admitted bytes.
_ROUNDING_MARGIN = 4.0


@dataclass(frozen=True)
class Envelope:
    const: np.ndarray     # float64[P]
    presence: np.ndarray  # float64[P, K]
    coef: np.ndarray      # float64[P, K, 3]: per packed row, per logical row, per segment

    @property
    def num_points(self) -> int:
        return int(self.const.shape[0])

    def value(self, present: np.ndarray, counts: np.ndarray) -> float:
        """max over points; `present`: bool[K]; `counts`: float[K, 3]. O(P x K)."""
        vals = self.const + self.presence @ present.astype(np.float64) + np.einsum(
            "pkc,kc->p", self.coef, counts)
        return float(vals.max()) if vals.size else 0.0


def build_envelope(model: PricingModel, class_grad: Sequence[bool], class_slot: Sequence[str]) -> Envelope:
    """Envelope over gradient classes (one forward call each). O(K^2 x L) to build, then pruned
    of points dominated coefficient-wise by another point."""
    a = model.arrays
    k_classes = len(class_grad)
    ret, ws, ng, gdn = a["retained"], a["workspace"], a["nograd"], a["gdn_state"]
    cum = np.cumsum(ret)
    total = float(ret.sum()) if ret.size else 0.0
    keep = total + a["head_retained"]  # per row of a grad group not yet run
    ig, head_ret, head_tr, head_c = a["input_grad"], a["head_retained"], a["head_transient"], a["head_const"]
    max_state = float(gdn.max()) if gdn.size else 0.0
    max_ng = float(ng.max()) if ng.size else 0.0

    rows_pts: list[np.ndarray] = []   # per point: row coefficient of each class
    seg_pts: list[np.ndarray] = []
    pres_pts: list[np.ndarray] = []

    def add(running: int, row_c: float, seg_c: float, pres_c: float) -> None:
        rows = np.array([keep if (class_grad[h] and h != running) else 0.0 for h in range(k_classes)])
        rows[running] = row_c
        seg = np.zeros(k_classes)
        seg[running] = seg_c
        pres = np.zeros(k_classes)
        pres[running] = pres_c
        rows_pts.append(rows)
        seg_pts.append(seg)
        pres_pts.append(pres)

    for g in range(k_classes):
        if not class_grad[g]:
            add(g, max_ng + head_ret, max_state, head_c)
            continue
        for i in range(ret.shape[0]):
            add(g, cum[i] - ret[i] + ng[i], gdn[i], 0.0)
            add(g, cum[i] + ws[i] + ig, gdn[i], 0.0)
        add(g, total + head_ret, 0.0, head_c)
        add(g, total + head_ret + head_tr + ig, 0.0, head_c)

    if not rows_pts:
        empty = np.zeros((0, k_classes))
        return Envelope(np.zeros(0), empty, np.zeros((0, k_classes, 3)))
    row_c = np.array(rows_pts)
    seg_c = np.array(seg_pts)
    pres_c = np.array(pres_pts)
    multiple = model.parallel.row_multiple
    cp_div = 1 if model.conservative else model.parallel.cp
    coef = np.zeros((row_c.shape[0], k_classes, 3))
    coef[:, :, 0] = row_c / cp_div
    coef[:, :, 1] = a["caller"]
    coef[:, :, 2] = row_c * (multiple - 1) / cp_div + seg_c * (multiple + 1)
    const = np.full(row_c.shape[0], a["first_exec"])
    keep_idx = _undominated(const, pres_c, coef)
    s = model.safety
    return Envelope(const=const[keep_idx] * s + _ROUNDING_MARGIN, presence=pres_c[keep_idx] * s,
                    coef=coef[keep_idx] * s)


def _undominated(const: np.ndarray, pres: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """Indices of points not dominated (<= in every coefficient) by another point. O(P^2)."""
    flat = np.concatenate([const[:, None], pres, coef.reshape(coef.shape[0], -1)], axis=1)
    keep = []
    for p in range(flat.shape[0]):
        dominated = False
        for q in range(flat.shape[0]):
            if q != p and np.all(flat[q] >= flat[p]) and (np.any(flat[q] > flat[p]) or q < p):
                dominated = True
                break
        if not dominated:
            keep.append(p)
    return np.array(keep, dtype=np.int64)
