"""The clique argument of the wave bound: prompt groups that cannot share a wave whole.

Formula: with N waves at least |C| - N subgroups of a clique C of the conflict graph are split,
each adding at least excess[s, p] = coef[p, k, 0] x priv_s to the step's mass at every
lower-envelope point p; the bound is the least N that this raised mass does not rule out. A
greedy clique from the CLIQUE_STARTS highest-degree subgroups; deterministic.
See docs/architecture.md#the-clique-bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from .layout import _tree_counts
from .stable_sort import sorted_ints, stable_argsort
from .step import Step

CLIQUE_STARTS = 8        # greedy cliques tried, from the vertices of highest degree
MAX_CANDIDATES = 4096    # subgroups kept for the conflict graph (the heaviest first)


@dataclass(frozen=True)
class Cliques:
    """What the bound needs of the conflict graph: the excess (float64[C, P]) of each
    subgroup of the clique found (inf: it cannot be split), and that of the subgroups split
    in every plan (float64[F, P])."""

    clique: np.ndarray
    forced: np.ndarray

    @property
    def size(self) -> int:
        return int(self.clique.shape[0])

    def extra(self, waves: int) -> tuple[bool, np.ndarray]:
        """(possible, mass) for a plan of `waves` waves: whether the clique allows so few
        waves, and the mass per point its forced splits add. O(C log C x P)."""
        P = self.forced.shape[1]
        mass = self.forced.sum(axis=0) if self.forced.shape[0] else np.zeros(P)
        split = self.size - waves
        if split <= 0:
            return True, mass
        part = np.sort(self.clique, axis=0)[:split]
        if not np.isfinite(part).all():
            return False, mass
        return True, mass + part.sum(axis=0)


@njit(cache=True)
def _range_lcp(table, a, b):
    """LCP of the requests at tree positions a < b: the minimum adjacent LCP between."""
    span = b - a
    lev = 0
    while (2 << lev) <= span:
        lev += 1
    return min(table[lev, a], table[lev, b - (1 << lev)])


@njit(cache=True)
def _shared_out(rank, table, order_cls, order_sub, order_pos, S):
    """Per subgroup, the largest LCP across a boundary with another subgroup of its class in
    the class's tree order (requests sorted by (class, position)). O(n log n)."""
    out = np.zeros(S)
    for j in range(order_cls.shape[0] - 1):
        if order_cls[j] != order_cls[j + 1] or order_sub[j] == order_sub[j + 1]:
            continue
        h = _range_lcp(table, order_pos[j], order_pos[j + 1])
        out[order_sub[j]] = max(out[order_sub[j]], h)
        out[order_sub[j + 1]] = max(out[order_sub[j + 1]], h)
    return out


@njit(cache=True)
def _conflicts(rows, stem, cls, coef0, pres, fe_k, budget):
    """adj[s, t]: subgroups s and t cannot both sit whole in one wave; alone[s]: s does not
    fit whole even alone. `rows`: float64[S, P] row part of each subgroup's lower envelope;
    `stem`: shared_out (rows it may share with its class); `coef0`: float64[P, K];
    `pres`: float64[P, K]; `fe_k`: float64[K]. O(S^2 P)."""
    S, P = rows.shape
    adj = np.zeros((S, S), dtype=np.bool_)
    alone = np.zeros(S, dtype=np.bool_)
    for s in range(S):
        ks = cls[s]
        for p in range(P):
            if rows[s, p] + pres[p, ks] + fe_k[ks] > budget:
                alone[s] = True
                break
    for s in range(S):
        ks = cls[s]
        for t in range(s + 1, S):
            kt = cls[t]
            fe = max(fe_k[ks], fe_k[kt])
            for p in range(P):
                v = rows[s, p] + rows[t, p] + pres[p, ks] + fe
                if kt == ks:
                    v -= coef0[p, ks] * min(stem[s], stem[t])
                else:
                    v += pres[p, kt]
                if v > budget:
                    adj[s, t] = True
                    adj[t, s] = True
                    break
    return adj, alone


@njit(cache=True)
def _greedy_clique(adj, order, deg, starts):
    S = adj.shape[0]
    best = np.zeros(0, dtype=np.int64)
    clique = np.empty(S, dtype=np.int64)
    ok = np.empty(S, dtype=np.bool_)
    for i in range(min(starts, S)):
        v = order[i]
        if deg[v] + 1 <= best.shape[0]:
            break   # sorted by degree: no later start can beat it
        for u in range(S):
            ok[u] = adj[v, u]
        clique[0] = v
        m = 1
        for u in order:
            if ok[u]:
                clique[m] = u
                m += 1
                for w in range(S):
                    ok[w] = ok[w] and adj[u, w]
        if m > best.shape[0]:
            best = clique[:m].copy()
    return best


def greedy_clique(adj: np.ndarray, starts: int = CLIQUE_STARTS) -> np.ndarray:
    """A large clique of the graph `adj` (bool[S, S], symmetric, no loops): from each of the
    `starts` vertices of highest degree, the vertices in order of degree (ties: lower index)
    adjacent to every vertex taken so far. The largest is kept (ties: the earlier start).
    Deterministic; O(starts x S^2)."""
    S = adj.shape[0]
    if S == 0:
        return np.zeros(0, dtype=np.int64)
    deg = adj.sum(axis=1).astype(np.int64)
    order = np.lexsort((np.arange(S), -deg)).astype(np.int64)
    return _greedy_clique(np.ascontiguousarray(adj), order, deg, int(starts))


def undominated_points(coef0: np.ndarray, coef1: np.ndarray, pres: np.ndarray) -> np.ndarray:
    """Points not dominated coefficient-wise by another (rows, logical rows, presence are
    all >= 0, so a dominated point's value is never the larger). O(P^2 K)."""
    flat = np.concatenate([coef0, coef1, pres], axis=1)
    geq = np.all(flat[:, None, :] >= flat[None, :, :], axis=2)   # geq[q, p]: q >= p
    gt = np.any(flat[:, None, :] > flat[None, :, :], axis=2)
    earlier = np.tri(flat.shape[0], k=-1, dtype=bool)
    return np.flatnonzero(~(geq & (gt | earlier)).any(axis=0))


@njit(cache=True)
def _graph(idx, class_of, K, tree, coef, keep, pres, fe_k, budget, max_cand, starts):
    """`find_cliques` in one jitted call: the subgroups of the requests `idx` (ordered by
    (group, class)), their stems, private rows and own trees, the conflict graph of the
    candidates over the points `keep`, and the greedy clique. `tree`: the step's (group_of,
    rank, lcp_table, length_at, prefix_rows). Returns the excess (float64[., P]) of the
    clique's members and of the subgroups split in every plan."""
    group_of, rank, table, length_at, prefix_rows = tree
    P = coef.shape[0]
    n = idx.shape[0]
    cls = np.empty(n, dtype=np.int64)
    key = np.empty(n, dtype=np.int64)
    for i in range(n):
        cls[i] = class_of[idx[i]]
        key[i] = group_of[idx[i]] * K + cls[i]
    o = stable_argsort(key)
    sub = np.empty(n, dtype=np.int64)
    members = np.empty(n, dtype=np.int64)
    ptr = np.zeros(n + 1, dtype=np.int64)
    sub_key = np.empty(n, dtype=np.int64)
    S = np.int64(0)   # typed, not Literal[int]: _shared_out compiles once
    for j in range(n):
        i = o[j]
        if j == 0 or key[i] != key[o[j - 1]]:
            sub_key[S] = key[i]
            S += 1
            ptr[S] = ptr[S - 1]
        sub[i] = S - 1
        members[j] = idx[i]
        ptr[S] += 1
    pos = np.empty(n, dtype=np.int64)
    key2 = np.empty(n, dtype=np.int64)
    N = rank.shape[0]
    for i in range(n):
        pos[i] = rank[idx[i]]
        key2[i] = cls[i] * N + pos[i]
    o2 = stable_argsort(key2)
    stem = _shared_out(rank, table, cls[o2], sub[o2], pos[o2], S)
    # candidates: a subgroup that can be split and pays no private rows adds nothing
    cand = np.empty(S, dtype=np.int64)
    priv = np.zeros(S)
    m = 0
    for t in range(S):
        priv[t] = max(prefix_rows[sub_key[t] // K] - stem[t], 0.0)
        if priv[t] > 0 or ptr[t + 1] - ptr[t] == 1:
            cand[m] = t
            m += 1
    cand = cand[:m]
    Pk = keep.shape[0]
    load = np.zeros((m, Pk))
    heavy = np.zeros(m)
    shared = np.bool_(True)   # typed, not Literal[bool]: _tree_counts compiles once
    for u in range(m):
        t = cand[u]
        k = sub_key[t] % K
        _, logical, packed, _, _ = _tree_counts(rank, table, length_at,
                                                members[ptr[t]:ptr[t + 1]].copy(), shared)
        for q in range(Pk):
            load[u, q] = coef[keep[q], k, 0] * packed + coef[keep[q], k, 1] * logical
            heavy[u] = max(heavy[u], load[u, q])
    if m > max_cand:   # the heaviest ones (ties: the lower index), in index order
        top = sorted_ints(stable_argsort(-heavy)[:max_cand])
        cand = cand[top]
        load = load[top]
        m = max_cand
    c = np.empty(m, dtype=np.int64)
    st = np.empty(m)
    single = np.empty(m, dtype=np.bool_)
    for u in range(m):
        c[u] = sub_key[cand[u]] % K
        st[u] = stem[cand[u]]
        single[u] = ptr[cand[u] + 1] - ptr[cand[u]] == 1
    coef0 = np.empty((Pk, K))
    pres_k = np.empty((Pk, K))
    for q in range(Pk):
        for k in range(K):
            coef0[q, k] = coef[keep[q], k, 0]
            pres_k[q, k] = pres[keep[q], k]
    adj, alone = _conflicts(load, st, c, coef0, pres_k, fe_k, budget)
    excess = np.empty((m, P))
    for u in range(m):
        for p in range(P):
            excess[u, p] = np.inf if single[u] else coef[p, c[u], 0] * priv[cand[u]]
    rest = np.empty(m, dtype=np.int64)
    nf = 0
    nr = 0
    forced = np.empty(m, dtype=np.int64)
    for u in range(m):
        if not alone[u]:
            rest[nr] = u
            nr += 1
        elif not single[u]:
            forced[nf] = u
            nf += 1
    sub_adj = np.zeros((nr, nr), dtype=np.bool_)
    deg = np.zeros(nr, dtype=np.int64)
    for i in range(nr):
        for j in range(nr):
            sub_adj[i, j] = adj[rest[i], rest[j]]
            if sub_adj[i, j]:
                deg[i] += 1
    order = stable_argsort(-deg)   # ties: the lower index
    clique = _greedy_clique(sub_adj, order, deg, starts)
    out_c = np.empty((clique.shape[0], P))
    for i in range(clique.shape[0]):   # loops, not row copies (no shape-check overload to compile)
        for p in range(P):
            out_c[i, p] = excess[rest[clique[i]], p]
    out_f = np.empty((nf, P))
    for i in range(nf):
        for p in range(P):
            out_f[i, p] = excess[forced[i], p]
    return out_c, out_f


def find_cliques(step: Step, class_of: np.ndarray, idx: np.ndarray, coef: np.ndarray,
                 pres: np.ndarray, grad: np.ndarray, budget: float, fe: float,
                 keep: np.ndarray | None = None) -> Cliques:
    """The clique of conflicting subgroups and the subgroups split in every plan, for the
    requests `idx` of the step (the module docstring), against the lower envelope
    (`coef`: float64[P, K, >=2], `pres`: float64[P, K]) and the first-execution allowance
    `fe` of gradient classes. `keep`: the points tested for conflicts
    (`undominated_points`, which the caller may cache; None: computed here). One jitted
    call (`_graph`)."""
    P, K = pres.shape
    idx = np.asarray(idx, dtype=np.int64)
    if len(idx) < 2 or P == 0:
        return Cliques(np.zeros((0, P)), np.zeros((0, P)))
    if keep is None:
        keep = undominated_points(coef[:, :, 0], coef[:, :, 1], pres)
    fe_k = np.where(np.asarray(grad, dtype=bool), float(fe), 0.0)
    tree = (step.group_of, step.rank, step.lcp_table, step.length_at, step.prefix_rows)
    clique, forced = _graph(idx, np.asarray(class_of, dtype=np.int64), K, tree,
                            np.ascontiguousarray(coef, dtype=np.float64),
                            np.asarray(keep, dtype=np.int64),
                            np.ascontiguousarray(pres, dtype=np.float64), fe_k,
                            float(budget), MAX_CANDIDATES, CLIQUE_STARTS)
    return Cliques(clique, forced)
