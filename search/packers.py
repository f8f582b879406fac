"""Entry point of the search: `pack(step, pricer, budget_bytes=...)` and the packer kinds.

Pipeline (AUTO):
1. items and constraints from the envelope and the step's trees (`items`; one request per
   gradient slot also weighs the slot's pending gradients, `pending`); every atom (atomic
   unit or request) that does not fit alone is priced exactly alone, and if that is over
   the budget climbs the split ladder (`ladder`); such atoms run alone.
2. lower bounds: the envelope's (`bounds`), the greedy's target, and the bound valid under
   exact prices (the pricer's `lower_bound_waves`), which decides step 4.
3. group-aware greedy (`greedy`), several orders and rules, stopping at the envelope bound;
   only if a gap is left: randomised multistart (`multistart`), then CP-SAT (`exact_cpsat`)
   when the instance passes its size rule and `time_budget_ms >= EXACT_MIN_BUDGET_MS`.
4. exact re-pricing of every wave, repair of any wave over the budget, then, unless the plan
   already meets the valid bound (the exact price may leave room the envelope did not),
   merging pairs of waves and emptying the lightest wave into the others (`reprice`; GREEDY
   only merges).
5. pending gradients and run order (`order`). When that step had to add waves, AUTO and
   EXACT first empty the light waves it left into the others, priced with their pending
   gradients (`order.dissolve_after_order`); if waves were still added, AUTO packs once more
   with room for the pending gradients' upper bound and keeps the better plan.
6. the full price (breakdown) of every wave that leaves the search (`reprice.finalise`);
   inside, exact prices are admitted bytes from the pricer's fast path (`prices`). Should
   the two disagree, the search runs again on full prices only.
With `num_waves=N` step 3 looks for exactly N waves, balanced by moving atoms out of the
most loaded wave (`local.balance`).

GREEDY stops after the greedy (no multistart, no exact solve); EXACT goes from the greedy
straight to CP-SAT with EXACT_PACKER_SHARE of its time budget (multistart only when the model
breaks the size rule); CP-SAT turns its share into model sizes and deterministic seconds
(`exact_cpsat`: calibrated, reproducible), so EXACT stays near its budget. The baselines
(`baselines`) replace steps 3-4.

Time budget (`budget`): it covers the whole search; the exact re-pricing is set aside per
expected wave, the rest goes to the greedy runs, then the multistart.

Determinism: same input, same plan, unless the wall-clock time budget is hit, which can only
cut the greedy orders or the multistart short (the result may then depend on the machine); with
`deterministic=True` the clock is never read and estimated run costs decide how many greedy
runs and multistart iterations the budget buys. CP-SAT runs with one worker, a fixed seed and
a deterministic time limit.

Complexity: dominated by the greedy, O(runs x atoms x waves x points), and by one exact price
per wave (plus the merge and repair tries, bounded per wave).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from waveplan.pricing.errors import ConfigError, InfeasibleError

from . import baselines
from .bounds import lower_bound
from .budget import run_cost_us, runs_within, search_us
from .exact_cpsat import fits_size_rule, solve_waves
from .greedy import LIMIT, atom_args, pack_greedy
from .items import Items, atom_size, blocks_for, build_items
from .ladder import run_ladder
from .local import balance
from .multistart import iteration_cap, run_multistart
from .order import assign_first_slots, dissolve_after_order
from .reprice import (
    Draft,
    dissolve_lightest,
    drafts_from_assign,
    finalise,
    merge_waves,
    reprice_all,
)
from .result import PackedWave, SearchResult

EXACT_MIN_BUDGET_MS = 50.0     # AUTO calls CP-SAT only with at least this time budget
EXACT_BUDGET_SHARE = 0.5       # share of AUTO's time budget given to CP-SAT
EXACT_PACKER_SHARE = 0.8       # share of EXACT's time budget given to CP-SAT
BALANCE_MOVES_PER_ATOM = 2
DISSOLVE_PRICES_PER_WAVE = 6  # exact prices spent on emptying the lightest wave, per wave


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
                 solver_s, stats):
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
                                          lower=lower, budget_s=solver_s, seed=seed,
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
         num_waves, seed, deterministic, reserve: str = "measured") -> SearchResult:
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
                   "exact_status": "not-run", "merges": 0, "split_units": 0, "order_added": 0,
                   "pending_room": reserve}
    if n == 0:
        stats["time_ms"] = (time.perf_counter() - t0) * 1e3
        return SearchResult((), 0, True, kind.value, stats)
    items = build_items(step, pricer, budget, atomic_units, reserve_pending=reserve)
    stats["envelope_points"] = len(items.points)
    fixed, active = _prepare(items, step, pricer, budget)
    F = len(fixed)
    split = [d for d in fixed if d.children is not None]
    stats["split_units"] = len(split)
    lower = lower_bound(items, active)
    # the valid bound first: a plan that meets it needs no exact-price merging
    bound = _valid_lower_bound(pricer, budget, lower + F, split, items)
    # the time budget: set aside the exact re-pricing, then greedy runs and multistart
    left_us = search_us(time_budget_ms, lower + F)
    deadline = None if deterministic else t0 + left_us / 1e6
    P = len(items.points)
    max_runs = max(1, runs_within(left_us, len(active), lower, P)) if deterministic else None
    solver_s = exact_budget_s(kind, time_budget_ms)
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
                              deadline, iteration_cap(left_us, len(active), num_waves, P),
                              solver_s, stats)
        drafts = drafts_from_assign(items, active, assign, num_waves - F) + fixed
        drafts = reprice_all(drafts, items, pricer, step, budget)
        if len(drafts) != num_waves:
            raise InfeasibleError(f"num_waves={num_waves}: exact re-pricing needed "
                                  f"{len(drafts)} waves")
    else:
        blocks = blocks_for(items, active)
        assign, nw, runs = pack_greedy(items, blocks, lower, deadline=deadline,
                                       max_runs=max_runs)
        stats["greedy_waves"] = nw + F
        stats["greedy_runs"] = runs
        exact_fits = fits_size_rule(len(active), nw - 1, P, solver_s)
        if nw > lower and (kind == PackerKind.AUTO or (kind == PackerKind.EXACT
                                                       and not exact_fits)):
            left_us -= runs * run_cost_us(len(active), lower, P)
            if exact_ok and exact_fits:   # CP-SAT follows with its own share
                left_us *= 1.0 - EXACT_BUDGET_SHARE
            max_iters = iteration_cap(left_us, len(active), nw, P)
            assign, nw, it = run_multistart(items, blocks, active, target=lower,
                                            best_assign=assign, best_nw=nw, seed=seed,
                                            deadline=deadline, max_iters=max_iters)
            stats["multistart_iterations"] = it
        if nw > lower and exact_ok:
            if exact_fits:
                assign, nw, lower, st = solve_waves(items, active, best_assign=assign,
                                                    best_nw=nw, lower=lower,
                                                    budget_s=solver_s, seed=seed)
                stats["exact_status"] = st
                # a proof raises the envelope bound (the bound of a pricer without its own)
                bound = _valid_lower_bound(pricer, budget, lower + F, split, items)
            else:
                stats["exact_status"] = "too-large"
        drafts = drafts_from_assign(items, active, assign, nw) + fixed
        drafts = reprice_all(drafts, items, pricer, step, budget)
        # The exact price may leave room the envelope did not: merge and rebalance, unless
        # the plan already meets a bound valid under exact prices (the envelope bound of a
        # pricer without `lower_bound_waves` is not one, so such plans always try).
        floor = bound if hasattr(pricer, "lower_bound_waves") else 1
        if len(drafts) > floor:
            before = len(drafts)
            drafts, _ = merge_waves(drafts, items, pricer, budget, floor)
            if kind != PackerKind.GREEDY and len(drafts) > floor:
                drafts, _ = dissolve_lightest(drafts, items, pricer, budget,
                                              DISSOLVE_PRICES_PER_WAVE * len(drafts) + 8,
                                              floor)
            stats["merges"] = before - len(drafts)
    before_order = len(drafts)
    drafts = assign_first_slots(drafts, items, pricer, step, budget,
                                allow_new_waves=num_waves is None)
    if (len(drafts) > max(bound, before_order) and num_waves is None
            and kind not in _BASELINES and kind != PackerKind.GREEDY):
        # the order step added waves: empty the light ones, pending gradients priced in
        drafts, _ = dissolve_after_order(drafts, items, pricer, budget,
                                         DISSOLVE_PRICES_PER_WAVE * len(drafts) + 8, bound)
    stats["order_added"] = len(drafts) - before_order
    if (reserve == "measured" and kind == PackerKind.AUTO and num_waves is None
            and len(drafts) > max(bound, before_order)):
        # the pending gradients cost waves: pack once more with room for their upper bound
        # (see `pending`) and keep the better plan
        alt = _run(kind, step, pricer, budget_bytes=budget_bytes, time_budget_ms=time_budget_ms,
                   atomic_units=atomic_units, num_waves=num_waves, seed=seed,
                   deterministic=deterministic, reserve="bound")
        if len(alt.waves) < len(drafts):
            return alt
    waves = []
    for d in drafts:
        carried = d.price.admitted_bytes
        price = finalise(d, items, pricer)
        if price.admitted_bytes != carried:
            # the fast path disagrees with the full price (a pricing change it does not
            # know of): plan again on full prices only, so no estimate leaves the search
            return _run(kind, step, _FullPrices(pricer), budget_bytes=budget_bytes,
                        time_budget_ms=time_budget_ms, atomic_units=atomic_units,
                        num_waves=num_waves, seed=seed, deterministic=deterministic,
                        reserve=reserve)
        if price.admitted_bytes > budget:   # never leaves the search
            raise AssertionError(f"internal: a wave priced {price.admitted_bytes} > {budget}")
        children = tuple(np.sort(c).astype(np.int64) for c in d.parts(items))
        waves.append(PackedWave(children=children, first_slots=frozenset(d.first_slots),
                                price=price))
    stats["lower_bound_envelope"] = lower + F
    stats["time_ms"] = (time.perf_counter() - t0) * 1e3
    return SearchResult(tuple(waves), min(bound, len(waves)), len(waves) <= bound, kind.value,
                        stats)


class _FullPrices:
    """A pricer seen without its fast `admitted` path (every exact price is a full one)."""

    def __init__(self, pricer):
        self._pricer = pricer

    def __getattr__(self, name):
        if name == "admitted":
            raise AttributeError(name)
        return getattr(self._pricer, name)


def exact_budget_s(kind: PackerKind, time_budget_ms: float) -> float:
    """Wall seconds of the time budget CP-SAT may use (it converts them into model sizes and
    deterministic seconds, see `exact_cpsat`)."""
    share = EXACT_PACKER_SHARE if kind == PackerKind.EXACT else EXACT_BUDGET_SHARE
    return share * time_budget_ms / 1e3


def _valid_lower_bound(pricer, budget: int, envelope_bound: int, split: list, items) -> int:
    """The wave count no plan can go below, under exact prices.

    The envelope bound only holds for plans packed against the envelope (exact re-pricing can
    merge below it), so a pricer that offers `lower_bound_waves` (a bound on its exact price,
    see `WavePricer.lower_bound_waves`) is trusted instead; a pricer without one keeps the
    envelope bound. A split unit (one that does not fit flat even alone) runs alone, so each
    is a wave of its own, and the pricer bounds the flat waves of the other requests.
    """
    exact = getattr(pricer, "lower_bound_waves", None)
    if exact is None:
        return envelope_bound
    if not split:
        return int(exact(budget))
    taken = np.zeros(items.n, dtype=bool)
    for d in split:
        taken[d.reqs(items)] = True
    rest = np.flatnonzero(~taken)
    if len(rest) == 0:
        return len(split)
    try:
        return len(split) + int(exact(budget, requests=rest))
    except TypeError:   # a pricer that bounds only the whole step
        return len(split) + 1
