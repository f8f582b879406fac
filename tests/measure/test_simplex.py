"""The built-in simplex (`pricing.measure.simplex`): known optima, infeasible and unbounded
programmes, redundant equalities, and random bounded programmes against vertex enumeration."""

from __future__ import annotations

import itertools

import numpy as np

from waveplan.pricing.measure.simplex import simplex


def _lp_case():
    # max x + y st x + 2y <= 4, 3x + y <= 6, x + y >= 1, x - y = 0.4 -> x = 1.6, y = 1.2
    c = np.array([-1.0, -1.0])
    a_ub = np.array([[1.0, 2.0], [3.0, 1.0], [-1.0, -1.0]])
    b_ub = np.array([4.0, 6.0, -1.0])
    a_eq = np.array([[1.0, -1.0]])
    b_eq = np.array([0.4])
    return c, a_ub, b_ub, a_eq, b_eq


def test_simplex_solves_a_small_programme():
    z = simplex(*_lp_case())
    assert z is not None and np.allclose(z, [1.6, 1.2])
    c, a_ub, b_ub, a_eq, _ = _lp_case()
    assert simplex(c, a_ub, b_ub, a_eq, np.array([5.0])) is None  # infeasible


def test_unbounded_programme_has_no_solution():
    # min -x st x - y <= 1: x = y + 1 grows without bound
    assert simplex(np.array([-1.0, 0.0]), np.array([[1.0, -1.0]]), np.array([1.0]),
                   np.zeros((0, 2)), np.zeros(0)) is None


def test_redundant_equalities():
    # x + y = 2 twice over (once scaled): min x + 2y -> x = 2, y = 0
    z = simplex(np.array([1.0, 2.0]), np.zeros((0, 2)), np.zeros(0),
                np.array([[1.0, 1.0], [2.0, 2.0]]), np.array([2.0, 4.0]))
    assert z is not None and np.allclose(z, [2.0, 0.0])


def _by_vertices(c, a_ub, b_ub):
    """min c.z over {a_ub z <= b_ub, z >= 0} (bounded) by enumerating its vertices; None if
    empty."""
    n = c.shape[0]
    rows = np.vstack([a_ub, -np.eye(n)])
    rhs = np.concatenate([b_ub, np.zeros(n)])
    best = None
    for pick in itertools.combinations(range(rows.shape[0]), n):
        a, b = rows[list(pick)], rhs[list(pick)]
        if abs(np.linalg.det(a)) < 1e-9:
            continue
        z = np.linalg.solve(a, b)
        if np.all(rows @ z <= rhs + 1e-9):
            value = float(c @ z)
            best = value if best is None else min(best, value)
    return best


def test_random_bounded_programmes_match_vertex_enumeration():
    rng = np.random.default_rng(7)
    solved = empty = 0
    for _ in range(60):
        n, m = int(rng.integers(2, 4)), int(rng.integers(2, 6))
        a_ub = np.vstack([rng.uniform(-2.0, 2.0, (m, n)), np.eye(n)])  # z <= 5 bounds it
        b_ub = np.concatenate([rng.uniform(-1.0, 3.0, m), np.full(n, 5.0)])
        c = rng.uniform(-1.0, 1.0, n)
        want = _by_vertices(c, a_ub, b_ub)
        got = simplex(c, a_ub, b_ub, np.zeros((0, n)), np.zeros(0))
        if want is None:
            assert got is None
            empty += 1
            continue
        assert got is not None
        assert np.all(a_ub @ got <= b_ub + 1e-7) and np.all(got >= -1e-9)
        assert abs(float(c @ got) - want) <= 1e-7
        solved += 1
    assert solved >= 20 and empty >= 1  # both kinds were exercised
