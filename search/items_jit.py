"""Jitted builders of the packing items (see `items` for the model): subgroups, weights and
the blocks of a step without atomic units. Plain loops, so a 32-request step costs a few
microseconds where the same work in small numpy calls cost a hundred.

All are O(n P) for n requests and P envelope points, plus an O(n log n) sort.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from waveplan.pricing.stable_sort import sorted_ints, stable_argsort, unique_ints

# Weight modes of `weights` (chosen by `items.weight_mode`): what the weights know of the step.
GENERIC_BOUND = 0   # nothing: the envelope's generic two-level bound
LENGTH_FORM = 1     # a length-form step: exactly two-level trees (the step-aware bound)
TOKEN_FORM = 2      # a token-form step: at most one inner node per leaf (the step-aware bound)


class WeightCharges(NamedTuple):
    """What the weights charge, per kept envelope point p and class k (bytes), and what each
    point holds: weights are charges / cap[p]."""

    c0: np.ndarray     # float64[P, K] per packed row
    c1: np.ndarray     # float64[P, K] per logical row
    cseg: np.ndarray   # float64[P, K] per segment (GENERIC_BOUND: the envelope's whole charge)
    cpad: np.ndarray   # float64[P, K] per padding row (GENERIC_BOUND: unused)
    cap: np.ndarray    # float64[P] budget - the point's constant
    multiple: int      # the row multiple each packed sequence is padded to


@njit(cache=True)
def subgroups(group_of, class_of, num_classes):
    """Subgroups s = (prefix group, class), numbered by ascending group x K + class (the
    order of np.unique). Returns (sub_of[n], sub_group[S], sub_class[S], sub_count[S])."""
    n = group_of.shape[0]
    K = max(num_classes, 1)
    key = group_of * K + class_of
    order = stable_argsort(key)
    sub_of = np.empty(n, dtype=np.int64)
    sub_group = np.empty(n, dtype=np.int64)
    sub_class = np.empty(n, dtype=np.int64)
    sub_count = np.zeros(n, dtype=np.int64)
    S = 0
    last = -1
    for j in range(n):
        i = order[j]
        if j == 0 or key[i] != last:
            sub_group[S] = key[i] // K
            sub_class[S] = key[i] % K
            S += 1
            last = key[i]
        sub_of[i] = S - 1
        sub_count[S - 1] += 1
    return sub_of, sub_group[:S].copy(), sub_class[:S].copy(), sub_count[:S].copy()


@njit(cache=True)
def weights(charges, class_of, sub_of, sub_group, sub_class, sub_count, prefix, own, tokens,
            mode):
    """Normalised request weights req_w[n, P] and subgroup headers sub_hdr[S, P].

    `charges`: a `WeightCharges` (c0, c1, cseg, cpad per packed row, logical row, segment and
    padding row). `mode` GENERIC_BOUND: request c0 own + c1 tokens + cseg, header c0 prefix +
    cseg (cseg is then the envelope's whole per-segment charge, cpad unused).
    LENGTH_FORM and TOKEN_FORM, the step-aware bound of `items`:
    - a subgroup whose members are trees of their own (prefix 0, or a single member in a
      length-form step) charges each member its exact tree: c0 rows + c1 tokens + one segment
      + its exact padding rows; no header;
    - otherwise the header holds the prompt, one tree's worst padding (multiple - 1 rows) and,
      in length form, the prompt's node; each member its own rows, tokens and its leaf (two
      segments in token form: at most one inner node per leaf).
    """
    c0, c1, cseg, cpad, cap, multiple = charges
    n = class_of.shape[0]
    P = cap.shape[0]
    S = sub_group.shape[0]
    req_w = np.empty((n, P))
    sub_hdr = np.zeros((S, P))
    alone_tree = np.zeros(S, dtype=np.bool_)
    for s in range(S):
        g = sub_group[s]
        k = sub_class[s]
        if mode != GENERIC_BOUND and (prefix[g] == 0
                                      or (mode == LENGTH_FORM and sub_count[s] == 1)):
            alone_tree[s] = True
            continue
        hseg = 1.0 if mode != TOKEN_FORM else 0.0
        hpad = float(multiple - 1) if mode != GENERIC_BOUND else 0.0
        for p in range(P):
            sub_hdr[s, p] = (c0[p, k] * prefix[g] + cseg[p, k] * hseg + cpad[p, k] * hpad) / cap[p]
    rseg = 2.0 if mode == TOKEN_FORM else 1.0
    for i in range(n):
        k = class_of[i]
        s = sub_of[i]
        if alone_tree[s]:
            rows = prefix[sub_group[s]] + own[i]
            pad = float(-(-rows // multiple) * multiple - rows)
            for p in range(P):
                req_w[i, p] = (c0[p, k] * rows + c1[p, k] * tokens[i] + cseg[p, k]
                               + cpad[p, k] * pad) / cap[p]
        else:
            for p in range(P):
                req_w[i, p] = (c0[p, k] * own[i] + c1[p, k] * tokens[i]
                               + cseg[p, k] * rseg) / cap[p]
    return req_w, sub_hdr


@njit(cache=True)
def alone_loads(req_w, sub_hdr, class_hdr, req_sptr, req_s, class_of):
    """Load of each request alone in a wave. O(n P (1 + subgroups per request))."""
    n, P = req_w.shape
    out = np.empty((n, P))
    for i in range(n):
        k = class_of[i]
        for p in range(P):
            out[i, p] = req_w[i, p] + class_hdr[k, p]
        for j in range(req_sptr[i], req_sptr[i + 1]):
            s = req_s[j]
            for p in range(P):
                out[i, p] += sub_hdr[s, p]
    return out


@njit(cache=True)
def blocks_by_group(active, size, req_w, block_key, req_sptr, req_s, sub_class, sub_hdr,
                    class_hdr):
    """Blocks of a step without atomic units: the active requests of one block key (their
    prefix group, or deepest tree node), in ascending key order, atoms by decreasing size
    (ties: index). Returns the Blocks arrays (ptr, atoms, w, sptr, s, cptr, c, alone, size).
    O(A log A + A P (1 + subgroups per request))."""
    A = active.shape[0]
    P = req_w.shape[1]
    K = class_hdr.shape[0]
    S = sub_hdr.shape[0]
    grp = np.empty(A, dtype=np.int64)
    for j in range(A):
        grp[j] = block_key[active[j]]
    # sort by (key, -size, index): stable sorts of an index-sorted list
    by_index = stable_argsort(active)
    neg = np.empty(A)
    for j in range(A):
        neg[j] = -size[active[by_index[j]]]
    by_size = by_index[stable_argsort(neg)]
    g_sorted = np.empty(A, dtype=np.int64)
    for j in range(A):
        g_sorted[j] = grp[by_size[j]]
    order = by_size[stable_argsort(g_sorted)]
    atoms = np.empty(A, dtype=np.int64)
    ptr = np.zeros(A + 1, dtype=np.int64)
    nb = 0
    last = -1
    for j in range(A):
        a = active[order[j]]
        atoms[j] = a
        g = grp[order[j]]
        if j == 0 or g != last:
            nb += 1
            last = g
        ptr[nb] = j + 1
    ptr = ptr[:nb + 1].copy()
    w = np.zeros((nb, P))
    alone = np.zeros((nb, P))
    sptr = np.zeros(nb + 1, dtype=np.int64)
    cptr = np.zeros(nb + 1, dtype=np.int64)
    s_flat = np.empty(req_s.shape[0], dtype=np.int64)
    c_flat = np.empty(A, dtype=np.int64)
    seen_s = np.zeros(S, dtype=np.bool_)
    seen_c = np.zeros(K, dtype=np.bool_)
    ns = 0
    nc = 0
    for b in range(nb):
        start = ns
        for j in range(ptr[b], ptr[b + 1]):
            a = atoms[j]
            for p in range(P):
                w[b, p] += req_w[a, p]
            for t in range(req_sptr[a], req_sptr[a + 1]):
                s = req_s[t]
                if not seen_s[s]:
                    seen_s[s] = True
                    s_flat[ns] = s
                    ns += 1
        ordered = sorted_ints(s_flat[start:ns])
        for t in range(ns - start):   # a loop, not a slice copy (no shape-check overload to compile)
            s_flat[start + t] = ordered[t]
        for t in range(start, ns):
            s = s_flat[t]
            seen_s[s] = False
            seen_c[sub_class[s]] = True
            for p in range(P):
                alone[b, p] += sub_hdr[s, p]
        for k in range(K):
            if seen_c[k]:
                c_flat[nc] = k
                nc += 1
                seen_c[k] = False
                for p in range(P):
                    alone[b, p] += class_hdr[k, p]
        sptr[b + 1] = ns
        cptr[b + 1] = nc
    bsize = np.zeros(nb)
    for b in range(nb):
        m = -1e300
        for p in range(P):
            alone[b, p] += w[b, p]
            if alone[b, p] > m:
                m = alone[b, p]
        bsize[b] = m if P > 0 else 0.0
    return ptr, atoms, w, sptr, s_flat[:ns].copy(), cptr, c_flat[:nc].copy(), alone, bsize


@njit(cache=True)
def prefix_tree(order, lcp, lengths):
    """The step's radix tree, from its tree order and the adjacent LCPs of that order (the
    LCP-interval tree: one internal node per branching depth). Returns (node_parent[V],
    node_depth[V], leaf_parent[n]): parents are node indices, -1 for the root; leaf_parent is
    each request's deepest node. O(n)."""
    n = order.shape[0]
    node_parent = np.empty(max(n, 1), dtype=np.int64)
    node_depth = np.empty(max(n, 1), dtype=np.int64)
    leaf_parent = np.empty(n, dtype=np.int64)
    st_node = np.empty(n + 1, dtype=np.int64)
    st_depth = np.empty(n + 1, dtype=np.int64)
    st_node[0] = -1
    st_depth[0] = 0
    top = 0
    nn = 0
    for p in range(n):
        left_node = st_node[top]
        left_depth = st_depth[top]
        h = lcp[p] if p < n - 1 else 0
        last = -2
        while h < st_depth[top]:       # close the nodes deeper than this boundary
            last = st_node[top]
            top -= 1
            if h <= st_depth[top]:
                node_parent[last] = st_node[top]
        if h > st_depth[top]:          # open the node shared by this leaf and the next
            v = nn
            nn += 1
            node_depth[v] = h
            if last != -2:
                node_parent[last] = v
            top += 1
            st_node[top] = v
            st_depth[top] = h
        leaf_parent[order[p]] = left_node if left_depth >= h else st_node[top]
    return node_parent[:nn].copy(), node_depth[:nn].copy(), leaf_parent


@njit(cache=True)
def tree_subgroups(leaf_parent, node_parent, num_nodes, class_of, num_classes, max_depth):
    """Subgroups (node, class) of a tree step: the nodes on a request's root path, for the
    request's class; at most `max_depth` of them, those nearest the root (the most shared),
    the deeper ones being charged to the request itself (`tree_weights`). A request hanging
    from the root gets a node of its own (index num_nodes + request). Returns (req_sptr,
    req_s, sub_node, sub_class, kept, skipped): `kept` is each request's deepest node kept,
    `skipped` how many nodes below it were folded into the request. Subgroups are numbered by
    ascending node x K + class, each request's list ascending.
    O(total path length + n log n)."""
    n = class_of.shape[0]
    K = max(num_classes, 1)
    kept = np.empty(n, dtype=np.int64)
    skipped = np.zeros(n, dtype=np.int64)
    ptr = np.zeros(n + 1, dtype=np.int64)
    for i in range(n):
        v = leaf_parent[i]
        if v < 0:
            kept[i] = num_nodes + i
            ptr[i + 1] = ptr[i] + 1
            continue
        d = 0
        while v >= 0:
            d += 1
            v = node_parent[v]
        skipped[i] = max(0, d - max_depth)
        v = leaf_parent[i]
        for _ in range(skipped[i]):
            v = node_parent[v]
        kept[i] = v
        ptr[i + 1] = ptr[i] + d - skipped[i]
    keys = np.empty(ptr[n], dtype=np.int64)
    for i in range(n):
        k = class_of[i]
        v = kept[i]
        t = ptr[i]
        while v >= 0:
            keys[t] = v * K + k
            t += 1
            v = node_parent[v] if v < num_nodes else -1
    uniq = unique_ints(keys)
    req_s = np.searchsorted(uniq, keys).astype(np.int64)
    for i in range(n):
        ordered = sorted_ints(req_s[ptr[i]:ptr[i + 1]])
        for t in range(ordered.shape[0]):   # a loop, not a slice copy (compile time)
            req_s[ptr[i] + t] = ordered[t]
    return ptr, req_s, uniq // K, uniq % K, kept, skipped


@njit(cache=True)
def tree_weights(charges, class_of, kept, node_parent, node_depth, num_nodes, sub_node,
                 sub_class, lengths, tokens):
    """Weights of a tree step (token form with nested sharing): packed rows exact (up to the
    nodes folded into requests), at most (multiple - 1) padding rows per packed sequence (a
    top-level node's tree), exact padding for a request alone in its tree, and at most two
    segments per request (a wave's subtree has one leaf per request and fewer branch nodes:
    a node on a single request's path is no segment, so nodes are not charged).
    - node header (node v, class k): c0 x the rows of v's edge (depth - parent's depth) +
      (multiple - 1) padding rows when v hangs from the root; a request's own node (it hangs
      from the root): c0 x its rows + its exact padding rows;
    - request: c0 x its rows below its deepest kept node (`tree_subgroups`) + c1 x tokens +
      two segments (one when it is alone in its tree).
    `charges`: a `WeightCharges`. Returns (req_w[n, P], sub_hdr[S, P]). O((n + S) P)."""
    c0, c1, cseg, cpad, cap, multiple = charges
    n = class_of.shape[0]
    P = cap.shape[0]
    S = sub_node.shape[0]
    req_w = np.empty((n, P))
    sub_hdr = np.empty((S, P))
    for s in range(S):
        v = sub_node[s]
        k = sub_class[s]
        if v >= num_nodes:                 # a request alone in its tree: exact
            i = v - num_nodes
            rows = lengths[i]
            pad = float(-(-rows // multiple) * multiple - rows)
            for p in range(P):
                sub_hdr[s, p] = (c0[p, k] * rows + cpad[p, k] * pad) / cap[p]
            continue
        parent = node_parent[v]
        edge = node_depth[v] - (node_depth[parent] if parent >= 0 else 0)
        hpad = float(multiple - 1) if parent < 0 else 0.0
        for p in range(P):
            sub_hdr[s, p] = (c0[p, k] * edge + cpad[p, k] * hpad) / cap[p]
    for i in range(n):
        k = class_of[i]
        u = kept[i]
        own = lengths[i] - node_depth[u] if u < num_nodes else 0
        segs = 2.0 if u < num_nodes else 1.0
        for p in range(P):
            req_w[i, p] = (c0[p, k] * own + c1[p, k] * tokens[i] + cseg[p, k] * segs) / cap[p]
    return req_w, sub_hdr
