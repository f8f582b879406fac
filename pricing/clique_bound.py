"""The clique argument of the wave bound: prompt groups that cannot share a wave whole.

A subgroup s is the requests of one prefix group (`Step.group_of`) and one class (the
pricer's (slot, grad) pairs), of the requests bounded. Every member of s passes through the
group's node (depth prefix_rows[g] tokens); the part of that stem no request of the class
outside s shares, its private rows
    priv_s = prefix_rows[g] - max LCP(member of s, class-k request outside s)
(an upper estimate of that LCP: the largest LCP across a boundary between s and another
subgroup in the class's tree order), is a set of tree nodes on the paths of s's members
only. Class k's packed rows summed over the waves of a plan count each node once per wave
that touches it, so every subgroup spread over t_s waves adds (t_s - 1) priv_s packed rows
to the step's own (full-sharing) total: at each lower-envelope point p at least
    excess[s, p] = coef[p, k, 0] priv_s
per extra wave (`WavePricer._wave_bound` adds this mass to the step's).

Conflicts. Any wave holding two subgroups whole prices at least, at every point p, the
lower envelope of their union: their rows (class k's packed rows of s and t together are at
least packed_s + packed_t - the stem they can share, min(shared_out_s, shared_out_t), since
every node both trees hold lies on s's stem above shared_out_s, and t's likewise), the
presence charge of each class present and the first-execution allowance when one holds a
gradient request. Where that exceeds the budget at some point, s and t conflict: no wave
holds both whole. A subgroup that does not fit whole even alone is split in every plan.

Bound. In a plan of N waves at most N members of a clique C of the conflict graph are whole
(two cannot share a wave), so at least |C| - N are split and the mass rises, at each point,
by the sum of the |C| - N smallest excesses of C (a one-request subgroup cannot be split:
infinite excess; more than N of them in C make N waves impossible). The raised mass is
nonincreasing in N, so the least N whose raised bound does not exceed N is a valid bound,
found by counting up from the plain bound (`WavePricer.lower_bound_waves`).

The clique is greedy: from each of the CLIQUE_STARTS vertices of highest degree, add the
vertices in order of degree (ties by index) that conflict with every member so far; the
largest clique found is kept (ties: the earliest start). Deterministic.

Complexity: O(n log n) for the subgroups and their stems, one tree count per subgroup
(O(n log n) in all), O(S'^2 P') for the conflict graph over the S' candidate subgroups (those
whose excess is positive or that cannot be split) and the P' undominated points, and
O(CLIQUE_STARTS x S'^2) for the cliques.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from .layout import _tree_counts
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
def _subgroup_rows(rank, table, length_at, members, ptr):
    """Per subgroup (rows of the CSR members/ptr): packed and logical rows of its own tree.
    O(n log n)."""
    S = ptr.shape[0] - 1
    out = np.zeros((S, 2))
    for s in range(S):
        _, logical, packed, _, _ = _tree_counts(rank, table, length_at,
                                                members[ptr[s]:ptr[s + 1]].copy(), True)
        out[s, 0] = packed
        out[s, 1] = logical
    return out


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


def find_cliques(step: Step, class_of: np.ndarray, idx: np.ndarray, coef: np.ndarray,
                 pres: np.ndarray, grad: np.ndarray, budget: float, fe: float,
                 keep: np.ndarray | None = None) -> Cliques:
    """The clique of conflicting subgroups and the subgroups split in every plan, for the
    requests `idx` of the step (the module docstring), against the lower envelope
    (`coef`: float64[P, K, >=2], `pres`: float64[P, K]) and the first-execution allowance
    `fe` of gradient classes. `keep`: the points tested for conflicts
    (`undominated_points`, which the caller may cache; None: computed here)."""
    P, K = pres.shape
    idx = np.asarray(idx, dtype=np.int64)
    empty = Cliques(np.zeros((0, P)), np.zeros((0, P)))
    if len(idx) < 2 or P == 0:
        return empty
    cls = class_of[idx]
    key = step.group_of[idx] * K + cls
    keys, sub = np.unique(key, return_inverse=True)
    S = len(keys)
    sub_cls = keys % K
    sub_grp = keys // K
    by_sub = np.argsort(sub, kind="stable")
    ptr = np.zeros(S + 1, dtype=np.int64)
    np.cumsum(np.bincount(sub, minlength=S), out=ptr[1:])
    count = np.diff(ptr)
    pos = step.rank[idx]
    order = np.lexsort((pos, cls))
    stem = _shared_out(step.rank, step.lcp_table, cls[order], sub[order], pos[order], S)
    priv = np.maximum(step.prefix_rows[sub_grp] - stem, 0.0)
    # candidates: a subgroup that can be split and pays no private rows adds nothing
    cand = np.flatnonzero((priv > 0) | (count == 1))
    if len(cand) == 0:
        return empty
    if keep is None:
        keep = undominated_points(coef[:, :, 0], coef[:, :, 1], pres)
    coef0, coef1, pres_k = coef[keep, :, 0], coef[keep, :, 1], pres[keep]
    rows = _subgroup_rows(step.rank, step.lcp_table, step.length_at,
                          idx[by_sub], ptr)[cand]
    c = sub_cls[cand]
    load = coef0[:, c].T * rows[:, 0:1] + coef1[:, c].T * rows[:, 1:2]     # [S', P']
    if len(cand) > MAX_CANDIDATES:   # the heaviest ones (ties: lower index)
        top = np.lexsort((cand, -load.max(axis=1)))[:MAX_CANDIDATES]
        top.sort()
        cand, c, load = cand[top], c[top], load[top]
    fe_k = np.where(np.asarray(grad, dtype=bool), fe, 0.0)
    adj, alone = _conflicts(np.ascontiguousarray(load), np.ascontiguousarray(stem[cand]), c,
                            np.ascontiguousarray(coef0), np.ascontiguousarray(pres_k), fe_k,
                            float(budget))
    excess = coef[:, c, 0].T * priv[cand][:, None]                        # all P points
    excess[count[cand] == 1] = np.inf
    forced = alone & (count[cand] > 1)
    rest = np.flatnonzero(~alone)
    clique = rest[greedy_clique(adj[np.ix_(rest, rest)])]
    return Cliques(excess[clique], excess[forced])
