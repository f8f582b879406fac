"""Lower bounds on the number of waves, over plans whose waves fit the envelope.

Let W_s[p] be the total request weight of subgroup s (prefix group x class), h_s[p] its
header (prompt paid once per wave it appears in) and c_k[p] the presence charge of class k,
all normalised by the capacity (budget - const) at point p.

1. Forced prompt repeats: subgroup s needs at least
       m_s = max(1, max_p ceil(W_s[p] / (1 - h_s[p] - c_k[p])))
   waves, since each wave holding s pays h_s + c_k and holds at most the rest. Class k is
   present in at least M_k = max(max_s m_s, max_p ceil(sum_s (m_s h_s + W_s) / (1 - c_k)))
   waves.
2. Total size per point: waves >= ceil(sum_k (M_k c_k[p] + sum_s (m_s h_s[p] + W_s[p]))),
   the cheapest way each group can pay (at least once, or m_s times).
   Every wave also holds at least one class and one subgroup, so it pays at least
   min_c[p] = min_k c_k[p] and min_h[p] = min_s h_s[p]: with W waves the class mass is
   >= max(sum_k M_k c_k, W min_c) (same for prompts), and each choice of the max gives a
   valid bound W >= mass / (1 - the per-wave floors chosen); the largest is kept.
3. Big atoms: atoms whose own weight exceeds 1/2 at one point cannot share a wave.

The bound is the maximum of these (plus one wave per atom that runs alone: split or
envelope-oversized atoms). It is valid for plans packed against the envelope; exact
re-pricing may merge below it, in which case the search reports the plan's count.

Complexity: O(n P + S P).
"""

from __future__ import annotations

import numpy as np

from .items import FIT_EPS, Items

_ROUND = 1e-9


def _ceil(x: np.ndarray | float) -> np.ndarray:
    return np.ceil(np.asarray(x) - _ROUND)


def lower_bound(items: Items, active: np.ndarray) -> int:
    """Lower bound on waves holding the active atoms (each of which fits alone)."""
    active = np.asarray(active, dtype=np.int64)
    if len(active) == 0:
        return 0
    lim = 1.0 - FIT_EPS
    reqs = np.concatenate([items.atom(int(a)) for a in active]) if items.atom_unit.any() \
        else items.atom_req[items.atom_ptr[active]]
    S = len(items.sub_class)
    K = items.class_hdr.shape[0]
    P = len(items.points)
    W = np.zeros((S, P))
    np.add.at(W, items.sub_of[reqs], items.req_w[reqs])
    present = np.zeros(S, dtype=bool)
    present[items.sub_of[reqs]] = True
    subs = np.flatnonzero(present)
    h = items.sub_hdr[subs]
    ck = items.class_hdr[items.sub_class[subs]]
    room = lim - h - ck
    Ws = W[subs]
    with np.errstate(divide="ignore", invalid="ignore"):
        need = np.where(room > 0, Ws / np.where(room > 0, room, 1.0), np.where(Ws > 0, np.inf, 0))
    need = np.where(np.isfinite(need), need, 1.0)
    m = np.maximum(1.0, _ceil(need).max(axis=1)) if P else np.ones(len(subs))
    per_sub = m[:, None] * h + Ws                       # (S', P)
    per_class = np.zeros((K, P))
    np.add.at(per_class, items.sub_class[subs], per_sub)
    m_max = np.zeros(K)
    np.maximum.at(m_max, items.sub_class[subs], m)
    with np.errstate(divide="ignore", invalid="ignore"):
        room_k = lim - items.class_hdr
        mk = np.where(room_k > 0, per_class / np.where(room_k > 0, room_k, 1.0), 1.0)
    M = np.maximum(m_max, _ceil(mk).max(axis=1) if P else 0.0)
    used = m_max > 0
    M = np.where(used, M, 0.0)
    class_mass = (M[:, None] * items.class_hdr[:len(M)]).sum(axis=0)
    hdr_mass = (m[:, None] * h).sum(axis=0)
    w_mass = Ws.sum(axis=0)
    # every wave holds >= 1 class and >= 1 subgroup: it pays at least the cheapest of each
    min_c = items.class_hdr[used].min(axis=0)
    min_h = h.min(axis=0)
    best = np.zeros(P)
    for hc in (0, 1):
        for cc in (0, 1):
            room = lim - hc * min_h - cc * min_c
            mass = w_mass + (1 - hc) * hdr_mass + (1 - cc) * class_mass
            best = np.maximum(best, np.where(room > 0, mass / np.where(room > 0, room, 1.0), 0))
    lb = int(max(1.0, float(_ceil(best).max()) if P else 1.0, float(M.max())))
    own = items.atom_w[active]
    big = int((own > 0.5).sum(axis=0).max()) if P else 0
    return max(lb, big)
