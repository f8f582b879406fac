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

Determinism and time: one worker, a fixed `random_seed`, and a deterministic time limit
(`max_deterministic_time`), never a wall-clock limit, so the same call gives the same answer
on any machine. The caller gives a wall-clock budget `budget_s`; it is turned into model
sizes and deterministic seconds with constants calibrated on the development machine (2
shared cores; `bench/search_quality.py --calibrate` re-fits them): 318 solves of
generated GRPO and single-request steps (2-100 atoms, 1-40 waves, deterministic limits
0.0005-0.02 s) gave wall = 2.2e-6 x terms + 2.3 x det + 4.6e-3 s (least squares; a model has
atoms x waves x (points + 2) terms), with small models costing 1.4e-5 s per term (median,
2.1e-5 at the 90th percentile) when presolve dominates. The constants below round these up:
- BUILD_S_PER_TERM per term (building in Python plus presolve) and SOLVE_OVERHEAD_S per solve;
- WALL_PER_DET wall seconds per deterministic second of search;
- the deterministic time actually used, not the limit, is charged (a tiny limit can be
  overrun 2.5x), and it is reproducible, so the accounting is too.
`solve_waves` charges every model it builds and every solve against `budget_s` this way and
stops when the estimate runs out: the exact packer stays near its time budget (a slower
machine overruns it in proportion; the plan stays the same). `ortools` is imported lazily
(about 0.4 s the first time, not charged).

Size rule (`fits_size_rule`): the model is built only when atoms x waves <= MAX_CELLS,
atoms x waves x (points + 2) <= MAX_TERMS and, with a budget, its estimated building cost
fits in it.
"""

from __future__ import annotations

import numpy as np

from waveplan.pricing.tolerances import FIT_EPS

from .items import Items

SCALE = 10**8
MAX_CELLS = 4000
MAX_TERMS = 40000
BUILD_S_PER_TERM = 1e-5     # wall seconds per model term: building plus presolve
SOLVE_OVERHEAD_S = 1e-3     # wall seconds of set-up per solve
WALL_PER_DET = 3.0          # wall seconds per deterministic second of search
MIN_DET = 1e-4              # a solve needs room for at least this many deterministic seconds


def model_terms(num_atoms: int, waves: int, points: int) -> int:
    return num_atoms * waves * (points + 2)


def build_cost_s(num_atoms: int, waves: int, points: int) -> float:
    """Estimated wall seconds to build one model and start its solve."""
    return BUILD_S_PER_TERM * model_terms(num_atoms, waves, points) + SOLVE_OVERHEAD_S


def fits_size_rule(num_atoms: int, waves: int, points: int,
                   budget_s: float | None = None) -> bool:
    """The static size rule and, with a budget, room for the model and a minimal solve."""
    cells = num_atoms * waves
    if cells > MAX_CELLS or model_terms(num_atoms, waves, points) > MAX_TERMS:
        return False
    return budget_s is None or (build_cost_s(num_atoms, waves, points)
                                + WALL_PER_DET * MIN_DET <= budget_s)


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
        # the variables of wave b and their weights at every point, as one weighted sum per
        # point (LinearExpr.WeightedSum: building with Python's sum() cost more than solving)
        rows = np.arange(b, A)
        var_b = [x[i][b] for i in rows] + [y[j][b] for j in range(len(subs))] \
            + [z[j][b] for j in range(len(classes))]
        if nonempty:
            m.AddBoolOr(var_b[:len(rows)])
        weights = np.concatenate([W[rows], H, C], axis=0)       # (vars of b, P)
        for p in range(P):
            nz = np.flatnonzero(weights[:, p])
            if len(nz):
                m.Add(cp_model.LinearExpr.WeightedSum([var_b[t] for t in nz],
                                                      weights[nz, p].tolist()) <= SCALE)
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
                best_nw: int, lower: int, budget_s: float, seed: int,
                exact_count: int | None = None) -> tuple[np.ndarray | None, int, int, str]:
    """Improve or prove within an estimated `budget_s` wall seconds (see the module
    docstring). Returns (assign, waves, proven lower bound, status) where status is
    'optimal' (plan == proven bound), 'improved', 'unknown', 'too-large' or 'feasible'.
    With `exact_count`, looks for exactly that many non-empty waves."""
    active = np.asarray(active, dtype=np.int64)
    P = len(items.points)
    A = len(active)
    if exact_count is not None:
        if not fits_size_rule(A, exact_count, P, budget_s):
            return best_assign, best_nw, lower, "too-large"
        det = (budget_s - build_cost_s(A, exact_count, P)) / WALL_PER_DET
        st, assign, nw, _ = _solve(items, active, exact_count, det, seed, True, None)
        if st == "feasible" and float_fits(items, active, assign, nw):
            return assign, nw, lower, "feasible"
        return None, -1, lower, st
    status = "unknown"
    left = float(budget_s)
    B = best_nw - 1
    improved = False
    while B >= lower:
        if not fits_size_rule(A, B, P, left):
            if not fits_size_rule(A, B, P):
                status = "too-large"
            break
        left -= build_cost_s(A, B, P)
        st, assign, nw, used = _solve(items, active, B, left / WALL_PER_DET, seed, False, None)
        left -= WALL_PER_DET * max(used, MIN_DET)
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
