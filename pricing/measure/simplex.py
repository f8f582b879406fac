"""A small dense linear-programme solver: the two-phase tableau simplex method, numpy only.

`simplex(c, a_ub, b_ub, a_eq, b_eq)` minimises c.z subject to a_ub z <= b_ub, a_eq z = b_eq,
z >= 0. Each inequality row gets a slack; rows with a negative right-hand side are negated,
and those rows and the equalities get an artificial variable. Phase 1 minimises the sum of
the artificials (infeasible if it stays above zero), pivots the ones left in the basis out
where it can (a row where it cannot is redundant and is dropped) and drops their columns;
phase 2 minimises c.z from that basis. Pivot column by Dantzig's
rule (most negative reduced cost), pivot row by the minimum ratio; after more than 50
degenerate pivots in a row, Bland's rule (lowest index) instead, which cannot cycle.

Complexity: the tableau has m + 1 rows and up to n + 2m + 1 columns (m = rows of a_ub and
a_eq, n = variables); each pivot is one dense rank-one update, O(m (n + m)) time, and the
tableau O(m (n + m)) memory. The number of pivots is typically a small multiple of m but
exponential in the worst case, so each phase stops after `max_iter` pivots.

It serves `calibrate.solve_lp` when OR-Tools' GLOP is not installed (no scipy dependency).
"""

from __future__ import annotations

import numpy as np


def simplex(c: np.ndarray, a_ub: np.ndarray, b_ub: np.ndarray, a_eq: np.ndarray,
            b_eq: np.ndarray, *, max_iter: int = 50_000) -> np.ndarray | None:
    """min c.z subject to a_ub z <= b_ub, a_eq z = b_eq, z >= 0 (see the module doc).

    The optimal z, or None if the programme is infeasible, unbounded, or not solved in
    `max_iter` pivots per phase."""
    m_ub, n = a_ub.shape
    m_eq = a_eq.shape[0]
    m = m_ub + m_eq
    # rows: [a_ub | I_slack] z = b_ub, [a_eq | 0] z = b_eq; flip rows with negative rhs
    a = np.zeros((m, n + m_ub))
    a[:m_ub, :n] = a_ub
    a[:m_ub, n:] = np.eye(m_ub)
    a[m_ub:, :n] = a_eq
    b = np.concatenate([b_ub, b_eq]).astype(np.float64)
    neg = b < 0
    a[neg] *= -1
    b[neg] *= -1
    # artificial variables where the slack cannot start the basis
    need = np.flatnonzero(neg | (np.arange(m) >= m_ub))
    width = n + m_ub + need.size
    tab = np.zeros((m + 1, width + 1))
    tab[:m, :n + m_ub] = a
    tab[need, n + m_ub + np.arange(need.size)] = 1.0
    tab[:m, -1] = b
    basis = np.empty(m, dtype=np.int64)
    basis[:] = n + np.arange(m)
    basis[need] = n + m_ub + np.arange(need.size)
    # phase 1: minimise the artificials
    tab[-1, :] = 0.0
    tab[-1, n + m_ub:width] = 1.0
    for r in need:
        tab[-1] -= tab[r]
    if not _pivot_loop(tab, basis, width, max_iter):
        return None
    if tab[-1, -1] < -1e-7:
        return None
    # drive remaining artificials out of the basis where possible, then drop their columns
    for r in range(m):
        if basis[r] >= n + m_ub:
            cols = np.flatnonzero(np.abs(tab[r, :n + m_ub]) > 1e-9)
            if cols.size:
                _pivot(tab, basis, r, int(cols[0]))
    keep = basis < n + m_ub
    tab = np.concatenate([tab[:m][keep], tab[-1:]], axis=0)
    basis = basis[keep]
    tab = np.concatenate([tab[:, :n + m_ub], tab[:, -1:]], axis=1)
    # phase 2
    tab[-1, :] = 0.0
    tab[-1, :n] = c
    for r, j in enumerate(basis):
        if tab[-1, j] != 0.0:
            tab[-1] -= tab[-1, j] * tab[r]
    if not _pivot_loop(tab, basis, n + m_ub, max_iter):
        return None
    z = np.zeros(n + m_ub)
    z[basis] = tab[:-1, -1]
    return z[:n]


def _pivot(tab: np.ndarray, basis: np.ndarray, r: int, j: int) -> None:
    tab[r] /= tab[r, j]
    col = tab[:, j].copy()
    col[r] = 0.0
    tab -= np.outer(col, tab[r])
    basis[r] = j


def _pivot_loop(tab: np.ndarray, basis: np.ndarray, width: int, max_iter: int) -> bool:
    """Pivot until optimal (True) or unbounded / out of iterations (False)."""
    eps = 1e-10
    degenerate = 0
    for _ in range(max_iter):
        reduced = tab[-1, :width]
        if degenerate > 50:   # Bland: the first improving column, the first tied row
            cand = np.flatnonzero(reduced < -eps)
            if cand.size == 0:
                return True
            j = int(cand[0])
        else:
            j = int(np.argmin(reduced))
            if reduced[j] >= -eps:
                return True
        colj = tab[:-1, j]
        pos = colj > eps
        if not pos.any():
            return False
        ratio = np.full(colj.shape, np.inf)
        ratio[pos] = tab[:-1, -1][pos] / colj[pos]
        best = ratio.min()
        ties = np.flatnonzero(ratio <= best + 1e-12)
        r = int(ties[np.argmin(basis[ties])]) if degenerate > 50 else int(ties[0])
        degenerate = degenerate + 1 if best <= 1e-12 else 0
        _pivot(tab, basis, r, j)
    return False
