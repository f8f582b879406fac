"""Exact packing of small instances with CP-SAT (OR-Tools), to prove or improve a plan.

Model for B waves: x[a,b] (atom a in wave b), y[s,b] (subgroup s present), z[k,b] (class k
present); sum_b x[a,b] = 1; x[a,b] -> y[s,b] for the subgroups of a; y[s,b] -> z[k,b]; per wave
and point: sum_a W[a,p] x + sum_s H[s,p] y + sum_k C[k,p] z <= SCALE. Weights are the
normalised envelope loads rounded *down* to integers (a relaxation), so INFEASIBLE proves that
no B-wave envelope plan exists; a solution is kept only if it also fits in floating point.
Symmetry: atom i (in decreasing size) may only use waves 0..i. With `nonempty` every wave
holds an atom (exact wave counts).

`solve_waves` asks for B = best - 1, best - 2, ... down to the lower bound, so each answer
either improves the plan or proves the current one optimal.

Determinism: one worker, a fixed `random_seed`, and a deterministic time limit
(`max_deterministic_time`), never a wall-clock limit. `ortools` is imported lazily (about
0.4 s the first time).

Size rule (`fits_size_rule`): the model is built only when
atoms x waves <= MAX_CELLS and atoms x waves x (points + 2) <= MAX_TERMS; larger models could
not be solved within the planning budget.

Complexity: model size O(B (A + S + K) P); solving is exponential in the worst case, bounded
by the deterministic time limit.
"""

from __future__ import annotations

import numpy as np

from .items import FIT_EPS, Items

SCALE = 10**8
MAX_CELLS = 4000
MAX_TERMS = 40000


def fits_size_rule(num_atoms: int, waves: int, points: int) -> bool:
    cells = num_atoms * waves
    return cells <= MAX_CELLS and cells * (points + 2) <= MAX_TERMS


def _solve(items: Items, active: np.ndarray, B: int, det_time: float, seed: int,
           nonempty: bool, hint: np.ndarray | None):
    from ortools.sat.python import cp_model

    active = np.asarray(active, dtype=np.int64)
    size = items.atom_alone[active].max(axis=1)
    order = active[np.lexsort((active, -size))]
    A = len(order)
    P = len(items.points)
    subs = np.unique(np.concatenate([items.atom_s[items.atom_sptr[a]:items.atom_sptr[a + 1]]
                                     for a in order]))
    classes = np.unique(items.sub_class[subs])
    W = np.floor(items.atom_w[order] * SCALE).astype(np.int64)
    H = np.floor(items.sub_hdr[subs] * SCALE).astype(np.int64)
    C = np.floor(items.class_hdr[classes] * SCALE).astype(np.int64)
    sidx = {int(s): j for j, s in enumerate(subs)}
    cidx = {int(k): j for j, k in enumerate(classes)}
    m = cp_model.CpModel()
    x = [[m.NewBoolVar(f"x{i}_{b}") if b <= i else None for b in range(B)] for i in range(A)]
    y = [[m.NewBoolVar(f"y{j}_{b}") for b in range(B)] for j in range(len(subs))]
    z = [[m.NewBoolVar(f"z{j}_{b}") for b in range(B)] for j in range(len(classes))]
    for i in range(A):
        m.AddExactlyOne([v for v in x[i] if v is not None])
        a = order[i]
        for s in items.atom_s[items.atom_sptr[a]:items.atom_sptr[a + 1]]:
            for b in range(min(i + 1, B)):
                m.AddImplication(x[i][b], y[sidx[int(s)]][b])
    for j, s in enumerate(subs):
        kj = cidx[int(items.sub_class[s])]
        for b in range(B):
            m.AddImplication(y[j][b], z[kj][b])
    for b in range(B):
        xs = [(i, x[i][b]) for i in range(A) if x[i][b] is not None]
        if nonempty:
            m.AddBoolOr([v for _, v in xs])
        for p in range(P):
            terms = [int(W[i, p]) * v for i, v in xs if W[i, p]]
            terms += [int(H[j, p]) * y[j][b] for j in range(len(subs)) if H[j, p]]
            terms += [int(C[j, p]) * z[j][b] for j in range(len(classes)) if C[j, p]]
            if terms:
                m.Add(sum(terms) <= SCALE)
    if hint is not None:
        for i in range(A):
            hb = int(hint[order[i]])
            for b in range(min(i + 1, B)):
                m.AddHint(x[i][b], hb == b)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = int(seed) % (2**31 - 1)
    solver.parameters.max_deterministic_time = float(det_time)
    status = solver.Solve(m)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        assign = -np.ones(items.num_atoms, dtype=np.int64)
        for i in range(A):
            for b in range(min(i + 1, B)):
                if solver.BooleanValue(x[i][b]):
                    assign[order[i]] = b
        used = np.unique(assign[active])
        remap = -np.ones(B, dtype=np.int64)
        remap[used] = np.arange(len(used))
        assign[active] = remap[assign[active]]
        return "feasible", assign, len(used), solver.deterministic_time
    if status == cp_model.INFEASIBLE:
        return "infeasible", None, 0, solver.deterministic_time
    return "unknown", None, 0, solver.deterministic_time


def float_fits(items: Items, active: np.ndarray, assign: np.ndarray, waves: int) -> bool:
    for b in range(waves):
        atoms = active[assign[active] == b]
        if len(atoms) == 0:
            continue
        reqs = np.concatenate([items.atom(int(a)) for a in atoms])
        if items.load_of(reqs).max() > 1.0 - FIT_EPS:
            return False
    return True


def solve_waves(items: Items, active: np.ndarray, *, best_assign: np.ndarray | None,
                best_nw: int, lower: int, det_time: float, seed: int,
                exact_count: int | None = None) -> tuple[np.ndarray | None, int, int, str]:
    """Improve or prove. Returns (assign, waves, proven lower bound, status) where status is
    'optimal' (plan == proven bound), 'improved', 'unknown', 'too-large' or 'feasible'.
    With `exact_count`, looks for exactly that many non-empty waves."""
    active = np.asarray(active, dtype=np.int64)
    P = len(items.points)
    A = len(active)
    if exact_count is not None:
        if not fits_size_rule(A, exact_count, P):
            return best_assign, best_nw, lower, "too-large"
        st, assign, nw, _ = _solve(items, active, exact_count, det_time, seed, True, None)
        if st == "feasible" and float_fits(items, active, assign, nw):
            return assign, nw, lower, "feasible"
        return None, -1, lower, st
    status = "unknown"
    left = det_time
    B = best_nw - 1
    improved = False
    while B >= lower and left > 1e-3:
        if not fits_size_rule(A, B, P):
            return best_assign, best_nw, lower, "improved" if improved else "too-large"
        st, assign, nw, used = _solve(items, active, B, left, seed, False, None)
        left -= max(used, 1e-3)
        if st == "feasible" and float_fits(items, active, assign, nw):
            best_assign, best_nw, improved = assign, nw, True
            B = nw - 1
            continue
        if st == "infeasible":
            lower = B + 1
            status = "optimal"
        break
    if best_nw <= lower:
        status = "optimal"
    elif improved:
        status = "improved"
    return best_assign, best_nw, lower, status
