"""Jitted helpers of `reprice`: envelope loads of whole waves and merge candidates."""

from __future__ import annotations

import numpy as np
from numba import njit

from waveplan.pricing.stable_sort import stable_argsort


@njit(cache=True)
def wave_loads_jit(req, ptr, req_w, req_sptr, req_s, sub_class, sub_hdr, class_hdr):
    """Normalised envelope load (W, P) of the flat waves req[ptr[w]:ptr[w+1]]: request
    weights, plus each subgroup's and class's header once per wave. O(n P)."""
    W = ptr.shape[0] - 1
    P = req_w.shape[1]
    S = sub_hdr.shape[0]
    K = class_hdr.shape[0]
    loads = np.zeros((W, P))
    seen_s = -np.ones(S, dtype=np.int64)
    seen_k = -np.ones(K, dtype=np.int64)
    for w in range(W):
        for j in range(ptr[w], ptr[w + 1]):
            i = req[j]
            for p in range(P):
                loads[w, p] += req_w[i, p]
            for t in range(req_sptr[i], req_sptr[i + 1]):
                s = req_s[t]
                if seen_s[s] != w:
                    seen_s[s] = w
                    for p in range(P):
                        loads[w, p] += sub_hdr[s, p]
                    k = sub_class[s]
                    if seen_k[k] != w:
                        seen_k[k] = w
                        for p in range(P):
                            loads[w, p] += class_hdr[k, p]
    return loads


@njit(cache=True)
def merge_candidates(loads, const, cap, ratio, budget):
    """Pairs (i < j) whose estimated exact price after merging, the envelope of the summed
    loads x the smaller exact/envelope ratio of the two, is within budget; cheapest estimate
    first (ties: i, then j). Returns int64[C, 2]. O(W^2 P)."""
    W, P = loads.shape
    est = np.empty(W * (W - 1) // 2 if W > 1 else 0)
    pi = np.empty(est.shape[0], dtype=np.int64)
    pj = np.empty(est.shape[0], dtype=np.int64)
    c = 0
    for i in range(W):
        for j in range(i + 1, W):
            r = min(ratio[i], ratio[j])
            m = -1e300
            for p in range(P):
                v = const[p] + (loads[i, p] + loads[j, p]) * cap[p]
                if v > m:
                    m = v
            e = m * r
            if e <= budget:
                est[c] = e
                pi[c] = i
                pj[c] = j
                c += 1
    order = stable_argsort(est[:c])
    out = np.empty((c, 2), dtype=np.int64)
    for t in range(c):
        out[t, 0] = pi[order[t]]
        out[t, 1] = pj[order[t]]
    return out
