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

Complexity: O(n P + S P), jitted.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from waveplan.pricing.tolerances import CEIL_SLACK, FIT_EPS

from .items import Items


@njit(cache=True)
def _ceil(x):
    return np.ceil(x - CEIL_SLACK)


@njit(cache=True)
def _bound(reqs, req_sptr, req_s, class_of, sub_class, req_w, sub_hdr, class_hdr,
           atom_w_active, lim):
    """The bound of the module docstring for the requests `reqs` (those of the active atoms)
    and the active atoms' own weights. A request counts towards every subgroup it holds
    (nested prompts of a tree step: W_s is then the weight of the requests under s).
    O(n P (1 + subgroups per request) + S P)."""
    S = sub_hdr.shape[0]
    K = class_hdr.shape[0]
    P = req_w.shape[1]
    W = np.zeros((S, P))
    present = np.zeros(S, dtype=np.bool_)
    per_class = np.zeros((K, P))
    w_mass = np.zeros(P)
    for i in reqs:
        k = class_of[i]
        for p in range(P):
            per_class[k, p] += req_w[i, p]
            w_mass[p] += req_w[i, p]
        for t in range(req_sptr[i], req_sptr[i + 1]):
            s = req_s[t]
            present[s] = True
            for p in range(P):
                W[s, p] += req_w[i, p]
    m_max = np.zeros(K)
    hdr_mass = np.zeros(P)
    min_h = np.full(P, np.inf)
    for s in range(S):
        if not present[s]:
            continue
        k = sub_class[s]
        ms = 1.0
        for p in range(P):
            room = lim - sub_hdr[s, p] - class_hdr[k, p]
            if room > 0:
                need = W[s, p] / room
            else:
                need = 1.0   # cannot happen for atoms that fit alone; keep the bound trivial
            ms = max(ms, _ceil(need))
        m_max[k] = max(m_max[k], ms)
        for p in range(P):
            per_class[k, p] += ms * sub_hdr[s, p]
            hdr_mass[p] += ms * sub_hdr[s, p]
            min_h[p] = min(min_h[p], sub_hdr[s, p])
    M = np.zeros(K)
    class_mass = np.zeros(P)
    min_c = np.full(P, np.inf)
    lb = 1.0
    for k in range(K):
        if m_max[k] <= 0:
            continue
        Mk = m_max[k]
        for p in range(P):
            room = lim - class_hdr[k, p]
            Mk = max(Mk, _ceil(per_class[k, p] / room) if room > 0 else 1.0)
        M[k] = Mk
        lb = max(lb, Mk)
        for p in range(P):
            class_mass[p] += Mk * class_hdr[k, p]
            min_c[p] = min(min_c[p], class_hdr[k, p])
    for p in range(P):
        best = 0.0
        for hc in range(2):
            for cc in range(2):
                room = lim - hc * min_h[p] - cc * min_c[p]
                mass = w_mass[p] + (1 - hc) * hdr_mass[p] + (1 - cc) * class_mass[p]
                if room > 0:
                    best = max(best, mass / room)
        lb = max(lb, _ceil(best))
    big = 0
    for p in range(P):
        c = 0
        for j in range(atom_w_active.shape[0]):
            if atom_w_active[j, p] > 0.5:
                c += 1
        big = max(big, c)
    return max(lb, float(big))


def lower_bound(items: Items, active: np.ndarray) -> int:
    """Lower bound on waves holding the active atoms (each of which fits alone)."""
    active = np.asarray(active, dtype=np.int64)
    if len(active) == 0:
        return 0
    reqs = np.concatenate([items.atom(int(a)) for a in active]) if items.atom_unit.any() \
        else items.atom_req[items.atom_ptr[active]]
    return int(_bound(reqs, items.req_sptr, items.req_s, items.class_of, items.sub_class,
                      items.req_w, items.sub_hdr, items.class_hdr, items.atom_w[active],
                      1.0 - FIT_EPS))
