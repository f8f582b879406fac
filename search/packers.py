"""Entry point of the search: `pack(step, pricer, budget_bytes=...)` and the packer kinds.

Pipeline (AUTO):
1. items and constraints from the envelope (`items`); every atom (atomic unit or request)
   that does not fit the envelope alone is priced exactly alone, and if that is over the
   budget climbs the split ladder (`ladder`); such atoms run alone.
2. lower bound (`bounds`); group-aware greedy (`greedy`), several orders and rules, stopping
   at the bound.
3. only if a gap is left: randomised multistart (`multistart`), then CP-SAT (`exact_cpsat`)
   when the instance passes its size rule and `time_budget_ms >= EXACT_MIN_BUDGET_MS`.
4. exact re-pricing of every wave, repair of any wave over the budget, then (the exact price
   may leave room the envelope did not) merging pairs of waves and emptying the lightest wave
   into the others (`reprice`; GREEDY only merges).
5. pending gradients and run order (`order`).
With `num_waves=N` step 2-3 look for exactly N waves, balanced by moving atoms out of the
most loaded wave (`greedy.balance`).

GREEDY stops after step 2 (no multistart, no exact solve); EXACT goes from the greedy
straight to CP-SAT with at least EXACT_MIN_DET_TIME deterministic seconds (multistart only
when the model breaks the size rule). The baselines
(`baselines`) replace steps 2-4.

Determinism: same input, same plan, unless the wall-clock time budget is hit, which can only
cut the greedy orders or the multistart short (the result may then depend on the machine); with
`deterministic=True` the clock is never read and the iteration count alone decides.
CP-SAT runs with one worker, a fixed seed and a deterministic time limit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
from waveplan.pricing.errors import ConfigError, InfeasibleError

from . import baselines
from .bounds import lower_bound
from .exact_cpsat import fits_size_rule, solve_waves
from .greedy import LIMIT, atom_args, balance, pack_greedy
from .items import Items, atom_size, blocks_for, build_items
from .ladder import run_ladder
from .multistart import iteration_cap, run_multistart
from .order import assign_first_slots
from .reprice import Draft, dissolve_lightest, drafts_from_assign, merge_waves, reprice_all
from .result import PackedWave, SearchResult

EXACT_MIN_BUDGET_MS = 50.0     # AUTO calls CP-SAT only with at least this time budget
EXACT_BUDGET_SHARE = 0.5       # share of the time budget given to CP-SAT (det. seconds)
EXACT_MIN_DET_TIME = 0.2       # EXACT packer: at least this many deterministic seconds
BALANCE_MOVES_PER_ATOM = 2
DISSOLVE_PRICES_PER_WAVE = 2  # exact prices spent on emptying the lightest wave, per wave


class PackerKind(StrEnum):
    AUTO = "auto"
    GREEDY = "greedy"
    EXACT = "exact"
    UNIFORM_WIDTH = "uniform-width"
    FFD = "ffd"
    KK = "kk"


_BASELINES = {PackerKind.UNIFORM_WIDTH: baselines.uniform_width, PackerKind.FFD: baselines.ffd,
              PackerKind.KK: baselines.kk}


@dataclass(frozen=True)
class Packer:
    """A packer of one kind; `pack` has the keyword arguments of the module-level `pack`."""

    kind: PackerKind

    def pack(self, step, pricer, *, budget_bytes: int, time_budget_ms: float = 5.0,
             atomic_units=(), num_waves: int | None = None, seed: int = 0,
             deterministic: bool = False) -> SearchResult:
        return _run(self.kind, step, pricer, budget_bytes=budget_bytes,
                    time_budget_ms=time_budget_ms, atomic_units=atomic_units,
                    num_waves=num_waves, seed=seed, deterministic=deterministic)


def make_packer(kind: PackerKind | str) -> Packer:
    try:
        return Packer(PackerKind(kind))
    except ValueError:
        raise ConfigError(f"packer={kind!r}: must be one of "
                          f"{[k.value for k in PackerKind]}") from None


def pack(step, pricer, *, budget_bytes: int, packer: PackerKind | str = PackerKind.AUTO,
         time_budget_ms: float = 5.0, atomic_units=(), num_waves: int | None = None,
         seed: int = 0, deterministic: bool = False) -> SearchResult:
    """Cut the step's requests into waves that fit `budget_bytes` (admitted bytes per rank),
    in as few waves as possible (or exactly `num_waves`). See the module docstring."""
    return make_packer(packer).pack(step, pricer, budget_bytes=budget_bytes,
                                    time_budget_ms=time_budget_ms, atomic_units=atomic_units,
                                    num_waves=num_waves, seed=seed, deterministic=deterministic)


def _prepare(items: Items, step, pricer, budget: int) -> tuple[list[Draft], np.ndarray]:
    """Atoms over the envelope alone: exact price alone, else the ladder. They run alone."""
    A = items.num_atoms
    if A == 0:
        return [], np.zeros(0, dtype=np.int64)
    over = items.atom_alone.max(axis=1) > LIMIT
    fixed = []
    for a in np.flatnonzero(over):
        children, price = run_ladder(step, pricer, items.atom(int(a)), budget)
        fixed.append(Draft([int(a)], children if len(children) > 1 else None, price,
                           fixed=True))
    return fixed, np.flatnonzero(~over).astype(np.int64)


def _fill_empty(assign: np.ndarray, active: np.ndarray, waves: int, items: Items) -> None:
    """Give every empty wave one atom from the wave holding the most atoms."""
    size = atom_size(items)
    counts = np.bincount(assign[active], minlength=waves)
    for b in np.flatnonzero(counts == 0):
        donor = int(np.argmax(counts))
        atoms = active[assign[active] == donor]
        a = int(atoms[np.lexsort((atoms, size[atoms]))][0])
        assign[a] = b
        counts[donor] -= 1
        counts[b] += 1


def _exact_count(items, blocks, active, n_waves, lower, kind, seed, deadline, max_iters,
                 det_time, stats):
    """Exactly n_waves envelope waves, balanced. Returns assign."""
    A = len(active)
    if n_waves > A:
        raise InfeasibleError(f"num_waves: needs {n_waves} waves for the packable requests but "
                              f"they form only {A} atoms (atomic units count as one)")
    assign, nw, runs = pack_greedy(items, blocks, n_waves, fixed=n_waves)
    stats["greedy_runs"] = runs
    if nw < 0:
        assign, nw, _ = pack_greedy(items, blocks, lower)
        if nw > n_waves and kind != PackerKind.GREEDY:
            assign, nw, it = run_multistart(items, blocks, active, target=n_waves,
                                            best_assign=assign, best_nw=nw, seed=seed,
                                            deadline=deadline, max_iters=max_iters)
            stats["multistart_iterations"] = it
        if nw > n_waves and kind != PackerKind.GREEDY:
            res, rnw, _, st = solve_waves(items, active, best_assign=None, best_nw=-1,
                                          lower=lower, det_time=det_time, seed=seed,
                                          exact_count=n_waves)
            stats["exact_status"] = st
            if res is not None:
                assign, nw = res, rnw
        if nw > n_waves:
            raise InfeasibleError(f"num_waves={n_waves}: no plan with that many waves found "
                                  f"(lower bound {lower}, best found {nw})")
    assign = assign.copy()
    _fill_empty(assign, active, n_waves, items)
    moves = balance(assign, n_waves, active, BALANCE_MOVES_PER_ATOM * A + 8, *atom_args(items),
                    LIMIT)
    stats["balance_moves"] = int(moves)
    return assign


def _run(kind: PackerKind, step, pricer, *, budget_bytes, time_budget_ms, atomic_units,
         num_waves, seed, deterministic) -> SearchResult:
    t0 = time.perf_counter()
    budget = int(budget_bytes)
    n = len(step.requests)
    if num_waves is not None:
        if isinstance(num_waves, bool) or not isinstance(num_waves, int | np.integer) \
                or num_waves < 1:
            raise ConfigError(f"num_waves={num_waves!r}: must be a positive integer or None")
        if num_waves > n:
            raise InfeasibleError(f"num_waves={num_waves}: more waves than the step's {n} "
                                  f"requests")
        if kind in _BASELINES:
            raise ConfigError(f"num_waves={num_waves}: not supported by the {kind.value} "
                              f"baseline packer")
    if time_budget_ms <= 0:
        raise ConfigError(f"time_budget_ms={time_budget_ms!r}: must be positive")
    stats: dict = {"greedy_waves": 0, "greedy_runs": 0, "multistart_iterations": 0,
                   "exact_status": "not-run", "merges": 0, "split_units": 0}
    if n == 0:
        stats["time_ms"] = (time.perf_counter() - t0) * 1e3
        return SearchResult((), 0, True, kind.value, stats)
    deadline = None if deterministic else t0 + time_budget_ms / 1e3
    items = build_items(step, pricer, budget, atomic_units)
    stats["envelope_points"] = len(items.points)
    fixed, active = _prepare(items, step, pricer, budget)
    F = len(fixed)
    stats["split_units"] = sum(1 for d in fixed if d.children is not None)
    lower = lower_bound(items, active)
    max_iters = iteration_cap(time_budget_ms, len(active))
    det_time = (max(time_budget_ms / 1e3, EXACT_MIN_DET_TIME) if kind == PackerKind.EXACT
                else EXACT_BUDGET_SHARE * time_budget_ms / 1e3)
    exact_ok = kind == PackerKind.EXACT or (kind == PackerKind.AUTO
                                            and time_budget_ms >= EXACT_MIN_BUDGET_MS)
    if kind in _BASELINES:
        drafts = _BASELINES[kind](items, step, pricer, budget, active) + fixed
        stats["greedy_waves"] = None
    elif len(active) == 0:
        drafts = list(fixed)
        if num_waves is not None and num_waves != F:
            raise InfeasibleError(f"num_waves={num_waves}: every unit runs alone, "
                                  f"so the plan has exactly {F} waves")
    elif num_waves is not None:
        if num_waves - F < lower:
            raise InfeasibleError(f"num_waves={num_waves}: below the lower bound of "
                                  f"{lower + F} waves")
        blocks = blocks_for(items, active)
        assign = _exact_count(items, blocks, active, num_waves - F, lower, kind, seed,
                              deadline, max_iters, det_time, stats)
        drafts = drafts_from_assign(items, active, assign, num_waves - F) + fixed
        drafts = reprice_all(drafts, items, pricer, step, budget)
        if len(drafts) != num_waves:
            raise InfeasibleError(f"num_waves={num_waves}: exact re-pricing needed "
                                  f"{len(drafts)} waves")
    else:
        blocks = blocks_for(items, active)
        assign, nw, runs = pack_greedy(items, blocks, lower, deadline=deadline)
        stats["greedy_waves"] = nw + F
        stats["greedy_runs"] = runs
        exact_fits = fits_size_rule(len(active), nw - 1, len(items.points))
        if nw > lower and (kind == PackerKind.AUTO or (kind == PackerKind.EXACT
                                                       and not exact_fits)):
            assign, nw, it = run_multistart(items, blocks, active, target=lower,
                                            best_assign=assign, best_nw=nw, seed=seed,
                                            deadline=deadline, max_iters=max_iters)
            stats["multistart_iterations"] = it
        if nw > lower and exact_ok:
            if exact_fits:
                assign, nw, lower, st = solve_waves(items, active, best_assign=assign,
                                                    best_nw=nw, lower=lower,
                                                    det_time=det_time, seed=seed)
                stats["exact_status"] = st
            else:
                stats["exact_status"] = "too-large"
        drafts = drafts_from_assign(items, active, assign, nw) + fixed
        drafts = reprice_all(drafts, items, pricer, step, budget)
        if len(drafts) > 1:
            before = len(drafts)
            drafts, _ = merge_waves(drafts, items, pricer, budget, lower + F)
            if kind != PackerKind.GREEDY:
                drafts, _ = dissolve_lightest(drafts, items, pricer, budget,
                                              DISSOLVE_PRICES_PER_WAVE * len(drafts) + 8)
            stats["merges"] = before - len(drafts)
    drafts = assign_first_slots(drafts, items, pricer, step, budget,
                                allow_new_waves=num_waves is None)
    waves = []
    for d in drafts:
        if d.price.admitted_bytes > budget:   # never leaves the search
            raise AssertionError(f"internal: a wave priced {d.price.admitted_bytes} > {budget}")
        children = tuple(np.sort(c).astype(np.int64) for c in d.parts(items))
        waves.append(PackedWave(children=children, first_slots=frozenset(d.first_slots),
                                price=d.price))
    stats["lower_bound_envelope"] = lower + F
    bound = _valid_lower_bound(pricer, budget, lower + F, F, len(active))
    stats["time_ms"] = (time.perf_counter() - t0) * 1e3
    return SearchResult(tuple(waves), min(bound, len(waves)), len(waves) <= bound, kind.value, stats)


def _valid_lower_bound(pricer, budget: int, envelope_bound: int, num_fixed: int, num_active: int) -> int:
    """The wave count no plan can go below, under exact prices.

    The envelope bound only holds for plans packed against the envelope (exact re-pricing can
    merge below it), so a pricer that offers `lower_bound_waves` (a bound on its exact price,
    see pricing.envelope's lower envelope) is trusted instead. A pricer without one keeps the
    envelope bound. Split units run alone, so each is a wave of its own.
    """
    exact = getattr(pricer, "lower_bound_waves", None)
    if exact is None:
        return envelope_bound
    return max(int(exact(budget)), num_fixed + (1 if num_active else 0))
