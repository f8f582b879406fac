"""Entry point of the search: `pack(step, pricer, budget_bytes=...)` and the packer kinds.

The options (packer, time budget, atomic units, wave count, seed, determinism) are one
`SearchOptions` (`options`); the pricer is read through its contract (`contract`), its
optional capabilities resolved once per search. Each step below is a named stage of
`_search`: `_bound` (1-2), `_pack` (3-4: `_greedy`, `_improve`, `_exact`, `_merge`, or
`_pack_exact_count`, a baseline), `_order` and `_retry_with_bound_room` (5), `_finish` (6).

Pipeline (AUTO):
1. items and constraints from the envelope and the step's trees (`items`; one request per
   gradient slot also weighs the slot's pending gradients, `pending`); every atom (atomic
   unit or request) that does not fit alone is priced exactly alone, and if that is over
   the budget climbs the split ladder (`ladder`); such atoms run alone.
2. lower bounds: the envelope's (`bounds`), the greedy's target, and the bound valid under
   exact prices (the pricer's `BoundedPricer.lower_bound_waves`), which decides step 4.
3. group-aware greedy (`greedy`), several orders and rules (on steps of >= EJECT_MIN_ATOMS
   atoms the slot-aware PEAK_INCREASE rule first), stopping at the envelope bound; only if a
   gap is left: on steps of >= EJECT_MIN_ATOMS atoms (AUTO) waves filled one at a time so
   that the gradient slots mix (`fill`, kept when it has fewer waves), randomised multistart
   (`multistart`), annealing that empties the lightest
   wave by moves and swaps that mix the gradient slots (`anneal`, aimed chains from
   ANNEAL_AIMED_MIN_EVALS evaluations on) and ejection chains that empty light waves by
   moves and swaps (`eject`; both AUTO, steps of >= EJECT_MIN_ATOMS atoms), then CP-SAT (`exact_cpsat`) when the instance passes its size rule and
   `time_budget_ms >= EXACT_MIN_BUDGET_MS`.
4. exact re-pricing of every wave, repair of any wave over the budget, then, unless the plan
   already meets the valid bound (the exact price may leave room the envelope did not),
   merging pairs of waves and emptying the lightest wave into the others (`reprice`; GREEDY
   only merges), and on large AUTO steps emptying it by exactly priced moves and swaps
   (`swap`, touched waves re-priced only).
5. pending gradients and run order (`order`). When that step had to add waves, AUTO and
   EXACT first empty the light waves it left into the others, priced with their pending
   gradients (`order.dissolve_after_order`); if waves were still added, AUTO packs once more
   with room for the pending gradients' upper bound and keeps the better plan.
6. the full price (breakdown) of every wave that leaves the search (`reprice.finalise`);
   inside, exact prices are admitted bytes from the pricer's fast path (`prices`). Should
   the two disagree, the search runs again on full prices only. Each wave carries the group
   loads its full price was computed from when the pricer gives them.
With `num_waves=N` step 3 looks for exactly N waves, balanced by moving atoms out of the
most loaded wave (`local.balance`).

GREEDY stops after the greedy (no multistart, no exact solve); EXACT goes from the greedy
straight to CP-SAT with EXACT_PACKER_SHARE of its time budget (multistart only when the model
breaks the size rule); CP-SAT turns its share into model sizes and deterministic seconds
(`exact_cpsat`: calibrated, reproducible), so EXACT stays near its budget. The baselines
(`baselines`) replace steps 3-4.

Time budget (`budget`): the deterministic work is sized to `budget.WORK_SHARE` of it by
estimate; the items, bounds and exact re-pricing are set aside per request and per expected
wave (and the RoPE reserve's probe, `_probe`), the rest goes to the greedy runs, then the
multistart; on large steps AUTO runs `fill` at any budget (its estimate set aside), then gives
up to EJECT_SHARE of the rest (at most what one greedy run and the fill leave): ANNEAL_SHARE of
that for `anneal` (evaluations), SWAP_SHARE for `swap` (exact prices), the rest for the
ejection chains (placements), each counted by estimate in both modes (`budget`).

Determinism and the clock: the stages above run the work the budget buys by estimated cost
(greedy runs, multistart iterations, evaluations, placements, exact prices), in both modes,
so the same input gives the same plan on any machine. `deterministic=True` stops there and
never reads the clock. In clock mode (the default) the wall time left of the budget after it
improves the envelope plan further (`_spend_the_rest`: annealing or the multistart in rounds),
and the better plan is kept: never more waves than the deterministic plan of the same budget,
but the extra may depend on the machine. CP-SAT runs with one worker, a fixed seed and a
deterministic time limit. No `time_budget_ms`: `options.default_time_budget_ms` of the step.

Complexity: dominated by the greedy, O(runs x atoms x waves x points), and by one exact price
per wave (plus the merge and repair tries, bounded per wave).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from waveplan.pricing.compile_clock import CompileClock
from waveplan.pricing.errors import ConfigError, InfeasibleError, bad

from . import baselines
from .anneal import anneal
from .bounds import lower_bound
from .budget import (
    ANNEAL_US_PER_EVAL,
    MIN_SEARCH_MS,
    WORK_SHARE,
    eject_cost_us,
    exact_price_us,
    fill_cost_us,
    probe_cost_us,
    run_cost_us,
    runs_within,
    search_us,
)
from .contract import Pricer, SearchPricer, SearchStep
from .earlier import charge, fits, probe_growth, with_earlier_entries
from .eject import eject
from .exact_cpsat import fits_size_rule, solve_waves
from .fill import fill_plan
from .greedy import ELIMINATE_CANDIDATES, LIMIT, atom_args, pack_greedy
from .items import Blocks, Items, atom_size, blocks_for, build_items
from .ladder import run_ladder
from .local import balance, eliminate
from .multistart import CHUNK as MULTISTART_CHUNK
from .multistart import iteration_cap, run_multistart
from .options import (
    BASELINE_KINDS,
    DEFAULT_PACKER,
    DEFAULT_SEED,
    PackerKind,
    SearchOptions,
    default_time_budget_ms,
    packer_kind,
)
from .order import assign_first_slots, dissolve_after_order
from .pipeline import pack_pipeline
from .reprice import (
    Draft,
    dissolve_lightest,
    drafts_from_assign,
    finalise,
    merge_waves,
    reprice_all,
)
from .result import PackedWave, SearchResult
from .swap import empty_by_swaps

EXACT_MIN_BUDGET_MS = 50.0     # AUTO calls CP-SAT only with at least this time budget
EXACT_BUDGET_SHARE = 0.5       # share of AUTO's time budget given to CP-SAT
EXACT_PACKER_SHARE = 0.8       # share of EXACT's time budget given to CP-SAT
BALANCE_MOVES_PER_ATOM = 2
DISSOLVE_PRICES_PER_WAVE = 6  # exact prices spent on emptying the lightest wave, per wave
EJECT_MIN_ATOMS = 256         # AUTO runs ejection chains (`eject`) on steps of this many atoms
EJECT_SHARE = 0.9             # ... giving them up to this share of the greedy's time, and at
                              # most what one greedy run leaves of it
CLOCK_ROUND_MS = 2.0          # clock mode: the improvement after the deterministic plan runs
                              # in rounds, the first this long (`_spend_the_rest`) ...
CLOCK_MIN_SLOWDOWN = 0.25     # ... each sized by the pace the last one measured, within
CLOCK_MAX_SLOWDOWN = 20.0     # these bounds of the estimates' (`budget`)
EJECT_MIN_STEPS = 50          # placements per chain, at least
EJECT_CHAINS = 8              # ... else the budget's placements over this many chains
EJECT_CANDIDATES = 16         # light waves tried per round
ANNEAL_SHARE = 0.8            # ... of which this share goes to annealing against the
                              # envelope (`anneal`, in evaluations) ...
ANNEAL_AIMED_MIN_EVALS = 50000   # `anneal` runs aimed chains from this many evaluations on
SWAP_SHARE = 0.1              # ... and this share buys exact prices for emptying the
                              # lightest wave by moves and swaps (`swap`); the rest: `eject`

_BASELINES = {PackerKind.UNIFORM_WIDTH: baselines.uniform_width, PackerKind.FFD: baselines.ffd,
              PackerKind.KK: baselines.kk}
assert set(_BASELINES) == BASELINE_KINDS


@dataclass(frozen=True)
class Packer:
    """A packer of one kind; `pack` has the keyword arguments of the module-level `pack`."""

    kind: PackerKind

    def pack(self, step: SearchStep, pricer: Pricer, *, budget_bytes: int,
             time_budget_ms: float | None = None, atomic_units=(),
             num_waves: int | None = None, seed: int = DEFAULT_SEED,
             deterministic: bool = False) -> SearchResult:
        options = SearchOptions(packer=self.kind, time_budget_ms=time_budget_ms,
                                atomic_units=atomic_units, num_waves=num_waves, seed=seed,
                                deterministic=deterministic)
        return _run(step, pricer, int(budget_bytes), options)


def make_packer(kind: PackerKind | str) -> Packer:
    return Packer(packer_kind(kind))


def pack(step: SearchStep, pricer: Pricer, *, budget_bytes: int,
         options: SearchOptions | None = None, packer: PackerKind | str = DEFAULT_PACKER,
         time_budget_ms: float | None = None, atomic_units=(),
         num_waves: int | None = None, seed: int = DEFAULT_SEED,
         deterministic: bool = False) -> SearchResult:
    """Cut the step's requests into waves that fit `budget_bytes` (admitted bytes per rank),
    in as few waves as possible (or exactly `num_waves`). The search options come either as
    `options` or as the keyword arguments of `SearchOptions`, not both. See the module
    docstring."""
    keywords = SearchOptions(packer=packer, time_budget_ms=time_budget_ms,
                             atomic_units=atomic_units, num_waves=num_waves, seed=seed,
                             deterministic=deterministic)
    if options is None:
        options = keywords
    elif keywords != SearchOptions():
        raise bad(ConfigError, "options", options,
                  "give the search options either as `options` or as keyword arguments, "
                  "not both")
    return _run(step, pricer, int(budget_bytes), options)


def _run(step: SearchStep, pricer: Pricer, budget: int, options: SearchOptions) -> SearchResult:
    """One search; a pipeline (PP > 1) is packed against its in-flight window (`pipeline`).
    At PP1 the earlier waves' entries are charged when asked (`earlier`), and in clock mode the plan of
    the deterministic search at the same budget is improved while the clock allows
    (`_spend_the_rest`), so it is never worse."""
    if options.time_budget_ms is None:
        options = dataclasses.replace(
            options, time_budget_ms=default_time_budget_ms(len(step.requests)))
    sp = SearchPricer.of(pricer)
    stages = sp.stages()
    if stages is not None:
        return _with_budget(pack_pipeline(step, sp, budget, options, _search, stages), options)
    t0 = time.perf_counter() if not options.deterministic else 0.0
    states: list[_Search] = []
    spent = [0, 0.0]   # searches run, and their wall ms (stats: what the planner adds beside)

    def search(packed_budget: int) -> SearchResult:
        states.clear()
        start = time.perf_counter()
        try:
            return _search(step, sp, packed_budget, probed[0], keep=states)
        finally:
            spent[0] += 1
            spent[1] += (time.perf_counter() - start) * 1e3

    # the clock leaves out the time inside numba's compiler (a process's first plan loads
    # its kernels from the cache there): the first plan gets the clock later ones get
    probed = [options]   # the searches' options: the budget less the probe's estimate

    def probe() -> int:
        start = time.perf_counter()
        try:
            growth, cost_us = _probe(step, sp, budget, options)
            probed[0] = dataclasses.replace(options, time_budget_ms=max(
                options.time_budget_ms - cost_us / (1e3 * WORK_SHARE), MIN_SEARCH_MS))
            return growth
        finally:
            spent[1] += (time.perf_counter() - start) * 1e3

    with CompileClock() as jit:
        if options.earlier_entries:
            result, _ = with_earlier_entries(search, sp, budget, probe)
        else:
            result = search(budget)
        if not (options.deterministic or not states):
            start = time.perf_counter()
            result = _spend_the_rest(states[-1], result,
                                     lambda: t0 + options.time_budget_ms / 1e3 + jit.jit_s)
            spent[1] += (time.perf_counter() - start) * 1e3
    result = dataclasses.replace(result, stats={**result.stats, "searches": spent[0],
                                                "searches_ms": spent[1]})
    return _with_budget(result, options)


def _with_budget(result: SearchResult, options: SearchOptions) -> SearchResult:
    """The result with the time budget it was given in its stats (`time_budget_ms`)."""
    return dataclasses.replace(result, stats={**result.stats,
                                              "time_budget_ms": options.time_budget_ms})


# --- one search, in stages ---------------------------------------------------------------------


@dataclass
class _Search:
    """What the stages of one search share: its inputs, the packing items, the atoms that
    run alone, the bounds, the time budget, and the stats it reports."""

    step: SearchStep
    pricer: SearchPricer
    budget: int
    options: SearchOptions
    reserve: str             # room for the pending gradients: "measured" or "bound"
    t0: float                # perf_counter at the start
    stats: dict
    items: Items
    fixed: list[Draft]       # atoms over the envelope alone: they run alone (`_prepare`)
    active: np.ndarray       # the other atoms, packed together
    split: list[Draft]       # the fixed atoms that run as split children
    lower: int               # envelope bound of the active atoms (CP-SAT may raise it)
    bound: int               # bound valid under exact prices, fixed atoms included
    left_us: float           # microseconds for the greedy and the multistart
    eject_us: float          # microseconds for the ejection chains (AUTO, large steps)
    swap_prices: int         # exact prices for the moves and swaps of `swap` (same steps)
    anneal_evals: int        # evaluations for `anneal` (same steps)
    fill_us: float           # microseconds for `fill` (same steps, at any budget)
    solver_s: float          # CP-SAT's share of the time budget, wall seconds
    exact_ok: bool           # CP-SAT may run (EXACT, or AUTO with a large enough budget)
    assign: np.ndarray | None = None   # the envelope plan of stage 3 (AUTO, no wave count)
    nw: int = 0                        # ... and its wave count
    tail_s: float = 0.0      # wall seconds from that plan to the result (`_spend_the_rest`)

    @property
    def kind(self) -> PackerKind:
        return self.options.packer

    @property
    def num_fixed(self) -> int:
        return len(self.fixed)

    @property
    def num_points(self) -> int:
        return len(self.items.points)


def _search(step: SearchStep, pricer: SearchPricer, budget: int, options: SearchOptions,
            reserve: str = "measured", keep: list | None = None) -> SearchResult:
    """One search (see the module docstring): bound, pack, order, then either the retry with
    room for the pending gradients' upper bound, or the full prices of the waves. Its work
    is the deterministic mode's in both modes (the clock is read for the stats only).
    `keep`: the state of the search whose result is returned is appended last. O(greedy
    runs x atoms x waves x points + exact prices, bounded per wave)."""
    t0 = time.perf_counter()
    n = len(step.requests)
    num_waves = options.num_waves
    if num_waves is not None and num_waves > n:
        raise InfeasibleError(f"num_waves={num_waves}: more waves than the step's {n} "
                              f"requests")
    stats: dict = {"greedy_waves": 0, "greedy_runs": 0, "multistart_iterations": 0,
                   "exact_status": "not-run", "merges": 0, "split_units": 0, "order_added": 0,
                   "pending_room": reserve}
    if n == 0:
        stats["time_ms"] = (time.perf_counter() - t0) * 1e3
        return SearchResult((), 0, True, options.packer.value, stats)
    s = _bound(step, pricer, budget, options, reserve, t0, stats)
    drafts = _pack(s)
    drafts, before_order = _order(s, drafts)
    retry = _retry_with_bound_room(s, drafts, before_order, keep)
    if retry is not None:
        return retry
    result = _finish(s, drafts, keep)
    if keep is not None and result.stats is s.stats:
        keep.append(s)
    return result


def _probe(step: SearchStep, pricer: SearchPricer, budget: int,
           options: SearchOptions) -> tuple[int, float]:
    """The RoPE reserve measured on a probe plan (`earlier.probe_growth`): the search's first
    stages at `budget` (one greedy run, then on steps of >= EJECT_MIN_ATOMS atoms the fill,
    whose slot-mixed waves leave the entries a finished plan leaves), fast-path prices, the
    same at any time budget; and
    the probe's estimated cost (`budget.probe_cost_us`), which the search's share of the time
    budget pays. (0, 0) for a step without requests. O(greedy run + fill + one exact price per
    wave)."""
    if not step.requests or options.packer in BASELINE_KINDS:
        return 0, 0.0
    s = _bound(step, pricer, budget, options, "measured", time.perf_counter(),
               {"greedy_waves": 0, "greedy_runs": 0})
    if s.bound <= 1:   # a one-wave plan may exist: it carries no earlier waves' entries
        return 0, 0.0
    # the same probe at every time budget (the reserve never changes with it)
    A, P, fills = len(s.active), s.num_points, len(s.active) >= EJECT_MIN_ATOMS
    if A:
        s.left_us = 0.0   # one greedy run
        s.fill_us = 1.0 if fills else 0.0
        blocks = blocks_for(s.items, s.active)
        assign, nw, _ = _greedy(s, blocks)
        assign, nw = _fill(s, blocks, assign, nw)
        drafts = drafts_from_assign(s.items, s.active, assign, nw) + s.fixed
    else:
        drafts = list(s.fixed)
    drafts = reprice_all(drafts, s.items, pricer, step, budget)
    growth = probe_growth(pricer, [(d.parts(s.items), d.price.admitted_bytes) for d in drafts],
                          budget)
    return growth, probe_cost_us(len(step.requests), A, s.lower, P, fills)


def _bound(step: SearchStep, pricer: SearchPricer, budget: int, options: SearchOptions,
           reserve: str, t0: float, stats: dict) -> _Search:
    """Stages 1-2: the items, the atoms that run alone (`_prepare`), the envelope bound, the
    bound valid under exact prices (it decides whether exact-price merging is tried), and the
    time budget: the exact re-pricing set aside, the rest for the greedy and the multistart.
    O(n P) plus one exact price (or ladder) per atom over the envelope alone."""
    items = build_items(step, pricer, budget, options.atomic_units, reserve_pending=reserve)
    stats["envelope_points"] = len(items.points)
    fixed, active = _prepare(items, step, pricer, budget)
    F = len(fixed)
    split = [d for d in fixed if d.children is not None]
    stats["split_units"] = len(split)
    lower = lower_bound(items, active)
    # the valid bound first: a plan that meets it needs no exact-price merging
    bound = _valid_lower_bound(pricer, budget, lower + F, split, items)
    kind, ms = options.packer, options.time_budget_ms
    left_us = search_us(ms, lower + F, len(step.requests))
    eject_us = 0.0
    swap_prices = anneal_evals = 0
    fill_us = 0.0
    if (kind == PackerKind.AUTO and options.num_waves is None
            and len(active) >= EJECT_MIN_ATOMS):
        one_run = run_cost_us(len(active), lower, len(items.points))
        # the greedy's first run comes first, then the fill (`fill`), at any budget: like the
        # first run, part of the work every plan does (its slot-mixed waves save waves, and
        # so exact prices, on large steps)
        fill_us = fill_cost_us(len(active), lower)
        eject_us = max(0.0, min(EJECT_SHARE * left_us, left_us - one_run - fill_us))
        left_us = max(0.0, left_us - eject_us - fill_us)
        swap_prices = int(SWAP_SHARE * eject_us // exact_price_us(len(active), lower + F))
        anneal_evals = int(ANNEAL_SHARE * eject_us / ANNEAL_US_PER_EVAL)
        eject_us *= 1.0 - SWAP_SHARE - ANNEAL_SHARE
    return _Search(step=step, pricer=pricer, budget=budget, options=options, reserve=reserve,
                   t0=t0, stats=stats, items=items, fixed=fixed, active=active, split=split,
                   lower=lower, bound=bound, left_us=left_us, eject_us=eject_us,
                   swap_prices=swap_prices, anneal_evals=anneal_evals, fill_us=fill_us,
                   solver_s=exact_budget_s(kind, ms),
                   exact_ok=kind == PackerKind.EXACT or (kind == PackerKind.AUTO
                                                         and ms >= EXACT_MIN_BUDGET_MS))


def _prepare(items: Items, step: SearchStep, pricer: SearchPricer,
             budget: int) -> tuple[list[Draft], np.ndarray]:
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


def _pack(s: _Search) -> list[Draft]:
    """Stages 3-4: the drafts, exactly priced, by packer and constraint: a baseline packer,
    the atoms that run alone only, exactly `num_waves` waves, or as few waves as possible."""
    if s.kind in BASELINE_KINDS:
        s.stats["greedy_waves"] = None
        return _BASELINES[s.kind](s.items, s.step, s.pricer, s.budget, s.active) + s.fixed
    num_waves = s.options.num_waves
    if len(s.active) == 0:
        if num_waves is not None and num_waves != s.num_fixed:
            raise InfeasibleError(f"num_waves={num_waves}: every unit runs alone, "
                                  f"so the plan has exactly {s.num_fixed} waves")
        return list(s.fixed)
    if num_waves is not None:
        return _pack_exact_count(s, num_waves)
    blocks = blocks_for(s.items, s.active)
    assign, nw, runs = _greedy(s, blocks)
    assign, nw = _fill(s, blocks, assign, nw)
    exact_fits = fits_size_rule(len(s.active), nw - 1, s.num_points, s.solver_s)
    assign, nw = _improve(s, blocks, assign, nw, runs, exact_fits)
    assign, nw = _anneal(s, assign, nw)
    assign, nw = _eject(s, assign, nw)
    assign, nw = _exact(s, assign, nw, exact_fits)
    s.assign, s.nw, s.tail_s = assign, nw, time.perf_counter()
    drafts = drafts_from_assign(s.items, s.active, assign, nw) + s.fixed
    drafts = reprice_all(drafts, s.items, s.pricer, s.step, s.budget)
    return _merge(s, drafts)


def _greedy(s: _Search, blocks: Blocks) -> tuple[np.ndarray, int, int]:
    """Group-aware greedy runs (`greedy`) against the envelope, stopping at its bound, within
    the run count the time budget buys (`budget.runs_within`). Returns (assign, waves, runs)."""
    max_runs = max(1, runs_within(s.left_us, len(s.active), s.lower, s.num_points))
    assign, nw, runs = pack_greedy(s.items, blocks, s.lower, max_runs=max_runs,
                                   peak_first=len(s.active) >= EJECT_MIN_ATOMS,
                                   keep_first=s.fill_us > 0.0)
    s.stats["greedy_waves"] = nw + s.num_fixed
    s.stats["greedy_runs"] = runs
    return assign, nw, runs


def _fill(s: _Search, blocks: Blocks, assign: np.ndarray, nw: int) -> tuple[np.ndarray, int]:
    """Waves filled one at a time so that the gradient slots mix (`fill`), then `eliminate`,
    on large AUTO steps (`fill_us`, at any budget), when the greedy left a gap to the
    envelope bound; kept only when it has fewer waves than the
    greedy's plan (ties keep the greedy's). Deterministic; the same work in both modes.
    Returns (assign, waves)."""
    if s.fill_us <= 0.0 or nw <= s.lower:
        return assign, nw
    fa, fnw, evals = fill_plan(s.items, blocks, s.active)
    if fnw > max(s.lower, 1):
        fnw = eliminate(fa, fnw, s.active, atom_size(s.items), np.int64(ELIMINATE_CANDIDATES),
                        *atom_args(s.items), LIMIT)
    s.stats["fill_waves"] = fnw + s.num_fixed
    s.stats["fill_evals"] = int(evals)
    if fnw < nw:
        return fa, fnw
    return assign, nw


def _improve(s: _Search, blocks: Blocks, assign: np.ndarray, nw: int, runs: int,
             exact_fits: bool) -> tuple[np.ndarray, int]:
    """Randomised multistart (`multistart`) when a gap to the envelope bound is left: AUTO,
    or EXACT when CP-SAT cannot take the model. It gets what the greedy runs left of the
    time budget (half of it when CP-SAT follows). Returns (assign, waves)."""
    kind = s.kind
    if not (nw > s.lower and (kind == PackerKind.AUTO or (kind == PackerKind.EXACT
                                                          and not exact_fits))):
        return assign, nw
    A, P = len(s.active), s.num_points
    left_us = s.left_us - runs * run_cost_us(A, s.lower, P)
    if s.exact_ok and exact_fits:   # CP-SAT follows with its own share
        left_us *= 1.0 - EXACT_BUDGET_SHARE
    max_iters = iteration_cap(left_us, A, nw, P)
    assign, nw, it = run_multistart(s.items, blocks, s.active, target=s.lower,
                                    best_assign=assign, best_nw=nw, seed=s.options.seed,
                                    deadline=None, max_iters=max_iters)
    s.stats["multistart_iterations"] = it
    return assign, nw


def _eject(s: _Search, assign: np.ndarray, nw: int) -> tuple[np.ndarray, int]:
    """Ejection chains (`eject`) empty light waves by moves and swaps against the envelope,
    when a gap to the envelope bound is left, within the placements `eject_us` buys by
    estimate. Returns (assign, waves)."""
    if s.eject_us <= 0.0 or nw <= s.lower:
        return assign, nw
    A, P = len(s.active), s.num_points
    us = s.eject_us
    work = int(us // eject_cost_us(A, nw, P))
    if work <= 0:
        return assign, nw
    steps = max(EJECT_MIN_STEPS, work // EJECT_CHAINS)
    assign = assign.copy()
    nw2, done = eject(assign, nw, s.active, atom_size(s.items), s.lower, EJECT_CANDIDATES,
                      steps, work, *atom_args(s.items), LIMIT)
    s.stats["eject_placements"] = int(done)
    s.stats["eject_waves"] = nw - nw2
    return assign, nw2


def _anneal(s: _Search, assign: np.ndarray, nw: int) -> tuple[np.ndarray, int]:
    """Annealing against the envelope (`anneal`: the lightest wave to a pool, moves and swaps
    that mix the gradient slots) while a gap to the envelope bound is left, within the
    evaluations its share of the budget buys by estimate (`anneal_evals`; the same count in
    both modes, seeded by the options' seed). Returns (assign, waves)."""
    if s.anneal_evals <= 0 or nw <= s.lower:
        return assign, nw
    assign = assign.copy()
    nw2, done = anneal(assign, nw, s.active, atom_size(s.items), s.lower, s.anneal_evals,
                       s.options.seed, *atom_args(s.items), LIMIT,
                       s.anneal_evals >= ANNEAL_AIMED_MIN_EVALS)
    s.stats["anneal_evals"] = int(done)
    s.stats["anneal_waves"] = nw - nw2
    return assign, nw2


def _exact(s: _Search, assign: np.ndarray, nw: int, exact_fits: bool) -> tuple[np.ndarray, int]:
    """CP-SAT (`exact_cpsat`) when a gap is left and it may run: it proves or improves the
    plan within its share of the time budget, and its proof raises the envelope bound (and
    so the valid bound of a pricer without its own). Returns (assign, waves)."""
    if not (nw > s.lower and s.exact_ok):
        return assign, nw
    if not exact_fits:   # too large for the model, or for building it within its share
        big = not fits_size_rule(len(s.active), nw - 1, s.num_points)
        s.stats["exact_status"] = "too-large" if big else "no-time"
        return assign, nw
    assign, nw, s.lower, st = solve_waves(s.items, s.active, best_assign=assign, best_nw=nw,
                                          lower=s.lower, budget_s=s.solver_s,
                                          seed=s.options.seed)
    s.stats["exact_status"] = st
    s.bound = _valid_lower_bound(s.pricer, s.budget, s.lower + s.num_fixed, s.split, s.items)
    return assign, nw


def _merge(s: _Search, drafts: list[Draft]) -> list[Draft]:
    """The exact price may leave room the envelope did not: merge pairs of waves and (not
    GREEDY) empty the lightest wave into the others (`reprice`), unless the plan already
    meets a bound valid under exact prices (the envelope bound of a pricer without
    `BoundedPricer` is not one, so such plans always try)."""
    floor = s.bound if s.pricer.bounded is not None else 1
    if len(drafts) <= floor:
        return drafts
    before = len(drafts)
    drafts, _ = merge_waves(drafts, s.items, s.pricer, s.budget, floor)
    if s.kind != PackerKind.GREEDY and len(drafts) > floor:
        drafts, _ = dissolve_lightest(drafts, s.items, s.pricer, s.budget,
                                      DISSOLVE_PRICES_PER_WAVE * len(drafts) + 8, floor)
    if s.swap_prices > 0 and len(drafts) > floor:
        drafts, spent = empty_by_swaps(drafts, s.items, s.pricer, s.budget, s.swap_prices,
                                       floor)
        s.stats["swap_prices"] = spent
    s.stats["merges"] = before - len(drafts)
    return drafts


def _pack_exact_count(s: _Search, num_waves: int) -> list[Draft]:
    """Exactly `num_waves` waves (the fixed atoms among them): the greedy, then the
    multistart and CP-SAT if it needs more waves (not GREEDY), every empty wave given an atom,
    balanced by moving atoms out of the most loaded wave (`local.balance`), exactly priced.
    InfeasibleError when no such plan is found or the exact prices need another count."""
    F, items, active, lower = s.num_fixed, s.items, s.active, s.lower
    if num_waves - F < lower:
        raise InfeasibleError(f"num_waves={num_waves}: below the lower bound of "
                              f"{lower + F} waves")
    n_waves = num_waves - F
    A = len(active)
    if n_waves > A:
        raise InfeasibleError(f"num_waves: needs {n_waves} waves for the packable requests but "
                              f"they form only {A} atoms (atomic units count as one)")
    blocks = blocks_for(items, active)
    assign, nw, runs = pack_greedy(items, blocks, n_waves, fixed=n_waves)
    s.stats["greedy_runs"] = runs
    if nw < 0:
        assign, nw, _ = pack_greedy(items, blocks, lower)
        if nw > n_waves and s.kind != PackerKind.GREEDY:
            max_iters = iteration_cap(s.left_us, A, num_waves, s.num_points)
            assign, nw, it = run_multistart(items, blocks, active, target=n_waves,
                                            best_assign=assign, best_nw=nw,
                                            seed=s.options.seed, deadline=None,
                                            max_iters=max_iters)
            s.stats["multistart_iterations"] = it
        if nw > n_waves and s.kind != PackerKind.GREEDY:
            res, rnw, _, st = solve_waves(items, active, best_assign=None, best_nw=-1,
                                          lower=lower, budget_s=s.solver_s,
                                          seed=s.options.seed, exact_count=n_waves)
            s.stats["exact_status"] = st
            if res is not None:
                assign, nw = res, rnw
        if nw > n_waves:
            raise InfeasibleError(f"num_waves={n_waves}: no plan with that many waves found "
                                  f"(lower bound {lower}, best found {nw})")
    assign = assign.copy()
    _fill_empty(assign, active, n_waves, items)
    moves = balance(assign, n_waves, active, BALANCE_MOVES_PER_ATOM * A + 8, *atom_args(items),
                    LIMIT)
    s.stats["balance_moves"] = int(moves)
    drafts = drafts_from_assign(items, active, assign, n_waves) + s.fixed
    drafts = reprice_all(drafts, items, s.pricer, s.step, s.budget)
    if len(drafts) != num_waves:
        raise InfeasibleError(f"num_waves={num_waves}: exact re-pricing needed "
                              f"{len(drafts)} waves")
    return drafts


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


def _order(s: _Search, drafts: list[Draft]) -> tuple[list[Draft], int]:
    """Stage 5: which wave carries each slot's pending gradients, and the run order
    (`order`); when that added waves (AUTO, EXACT, no `num_waves`), the light waves it left
    are emptied into the others, pending gradients priced in. Returns (drafts in run order,
    the wave count before)."""
    num_waves = s.options.num_waves
    before_order = len(drafts)
    drafts = assign_first_slots(drafts, s.items, s.pricer, s.step, s.budget,
                                allow_new_waves=num_waves is None)
    if (len(drafts) > max(s.bound, before_order) and num_waves is None
            and s.kind not in BASELINE_KINDS and s.kind != PackerKind.GREEDY):
        # the order step added waves: empty the light ones, pending gradients priced in
        drafts, _ = dissolve_after_order(drafts, s.items, s.pricer, s.budget,
                                         DISSOLVE_PRICES_PER_WAVE * len(drafts) + 8, s.bound)
    s.stats["order_added"] = len(drafts) - before_order
    return drafts, before_order


def _retry_with_bound_room(s: _Search, drafts: list[Draft], before_order: int,
                           keep: list | None = None) -> SearchResult | None:
    """AUTO with room measured for the pending gradients, when they still cost waves: the
    whole search once more with room for their upper bound (see `pending`); its result when
    it has fewer waves, else None (keep these drafts)."""
    if not (s.reserve == "measured" and s.kind == PackerKind.AUTO
            and s.options.num_waves is None and len(drafts) > max(s.bound, before_order)):
        return None
    alt = _search(s.step, s.pricer, s.budget, s.options, reserve="bound", keep=keep)
    return alt if len(alt.waves) < len(drafts) else None


def _finish(s: _Search, drafts: list[Draft], keep: list | None = None) -> SearchResult:
    """Stage 6: every wave's full price (with its breakdown and, when the pricer gives them,
    its group loads; `reprice.finalise`), and the result. Should a full price disagree with
    the fast admitted path (a pricing change the fast path does not know of), the search
    runs again on full prices only, so no estimate leaves the search."""
    waves: list[PackedWave] = []
    for d in drafts:
        carried = d.price.admitted_bytes
        wave = finalise(d, s.items, s.pricer)
        if wave.price.admitted_bytes != carried:
            return _search(s.step, s.pricer.full_prices_only(), s.budget, s.options,
                           reserve=s.reserve, keep=keep)
        if wave.price.admitted_bytes > s.budget:   # never leaves the search
            raise AssertionError(f"internal: a wave priced {wave.price.admitted_bytes} > "
                                 f"{s.budget}")
        waves.append(wave)
    s.stats["lower_bound_envelope"] = s.lower + s.num_fixed
    if len(waves) > s.bound:
        s.stats["not_proven"] = not_proven_why(s.stats["exact_status"])
    now = time.perf_counter()
    s.stats["time_ms"] = (now - s.t0) * 1e3
    if s.assign is not None:
        s.tail_s = now - s.tail_s
    return SearchResult(tuple(waves), min(s.bound, len(waves)), len(waves) <= s.bound,
                        s.kind.value, s.stats)


def _spend_the_rest(s: _Search, result: SearchResult,
                    deadline: Callable[[], float]) -> SearchResult:
    """Clock mode: `result` is the deterministic plan at this budget (its earlier waves'
    entries charged); the clock left before `deadline()` (less the time the last search took
    from its envelope plan to its result, which a better envelope plan must pay again) goes
    to improving that envelope plan, in rounds: `anneal` (a new seed each round, from the
    best plan so far) on steps of >= EJECT_MIN_ATOMS atoms, the multistart (chunks the
    deterministic search did not run) below. The first round is CLOCK_ROUND_MS long, each
    next one as long as all before it (longer chains empty more waves), sized by the pace
    the rounds before measured (`budget`'s estimates x that slowdown), so the clock is
    overrun by one round's misestimate at most. An envelope plan with fewer waves is finished as the search finishes its own and
    kept when it has fewer waves than `result` and still fits with the entries; so the plan
    is never worse than the deterministic one. O(rounds x round + one finish)."""
    if not (s.kind == PackerKind.AUTO and s.options.num_waves is None and s.assign is not None
            and len(result.waves) > result.lower_bound_waves and s.nw > s.lower):
        return result
    A, P = len(s.active), s.num_points
    assign, nw = s.assign.copy(), s.nw
    rounds, evals, iters = 0, 0, 0
    blocks, chunk = None, 0
    slow = 1.0                      # measured wall time over the estimate, last round
    began = time.perf_counter()
    while nw > s.lower:
        now = time.perf_counter()
        left_s = deadline() - now - s.tail_s
        if left_s <= CLOCK_ROUND_MS / 2e3:
            break
        round_us = min(left_s, max(CLOCK_ROUND_MS / 1e3, now - began)) * 1e6 / slow
        rounds += 1
        if A >= EJECT_MIN_ATOMS:
            n_evals = max(1, int(round_us / ANNEAL_US_PER_EVAL))
            nw, done = anneal(assign, nw, s.active, atom_size(s.items), s.lower, n_evals,
                              s.options.seed + rounds, *atom_args(s.items), LIMIT,
                              n_evals >= ANNEAL_AIMED_MIN_EVALS)
            evals += int(done)
            est_us = max(int(done), 1) * ANNEAL_US_PER_EVAL
        else:
            if blocks is None:
                blocks = blocks_for(s.items, s.active)
                chunk = -(-s.stats.get("multistart_iterations", 0) // MULTISTART_CHUNK)
            cap = max(1, iteration_cap(round_us, A, nw, P))
            got, gnw, it = run_multistart(s.items, blocks, s.active, target=s.lower,
                                          best_assign=assign, best_nw=nw, seed=s.options.seed,
                                          deadline=None, max_iters=cap, first_chunk=chunk)
            chunk += -(-it // MULTISTART_CHUNK)
            iters += it
            est_us = max(it, 1) * run_cost_us(A, nw, P)
            if got is not None:
                assign, nw = got, gnw
        slow = min(max((time.perf_counter() - now) * 1e6 / est_us, CLOCK_MIN_SLOWDOWN),
                   CLOCK_MAX_SLOWDOWN)
    stats = dict(result.stats, clock_rounds=rounds, clock_anneal_evals=evals,
                 clock_multistart_iterations=iters)
    if nw >= s.nw:
        return dataclasses.replace(result, stats=stats)
    t = dataclasses.replace(s, stats=dict(s.stats), assign=None)
    drafts = drafts_from_assign(t.items, t.active, assign, nw) + t.fixed
    drafts = _merge(t, reprice_all(drafts, t.items, t.pricer, t.step, t.budget))
    drafts, _ = _order(t, drafts)
    better = _finish(t, drafts)
    if s.options.earlier_entries:
        better = charge(t.pricer, better)
    stats["clock_envelope_waves"] = nw + t.num_fixed
    if len(better.waves) < len(result.waves) and fits(better, t.budget + _reserve(result)):
        return dataclasses.replace(better, stats=dict(better.stats, **{
            k: v for k, v in stats.items() if k.startswith("clock_") or k == "rope_reserve_bytes"}))
    return dataclasses.replace(result, stats=stats)


def not_proven_why(exact_status: str) -> str:
    """Why a plan above its bound is not proven optimal, from CP-SAT's status: "model size"
    (the instance breaks its size rule at any budget), "bound" (no envelope plan has fewer
    waves: the bound under exact prices may be loose), else "time" (the budget ran out
    first, or could not build the model: "no-time", "unknown", "not-run")."""
    if exact_status == "too-large":
        return "model size"
    if exact_status == "optimal":
        return "bound"
    return "time"


def _reserve(result: SearchResult) -> int:
    return int(result.stats.get("rope_reserve_bytes", 0))


def exact_budget_s(kind: PackerKind, time_budget_ms: float) -> float:
    """Wall seconds of the time budget CP-SAT may use (it converts them into model sizes and
    deterministic seconds, see `exact_cpsat`)."""
    share = EXACT_PACKER_SHARE if kind == PackerKind.EXACT else EXACT_BUDGET_SHARE
    return share * time_budget_ms / 1e3


def _valid_lower_bound(pricer: SearchPricer, budget: int, envelope_bound: int, split: list,
                       items: Items) -> int:
    """The wave count no plan can go below, under exact prices.

    The envelope bound only holds for plans packed against the envelope (exact re-pricing can
    merge below it), so a pricer that offers `BoundedPricer` (a bound on its exact price,
    see `WavePricer.lower_bound_waves`) is trusted instead; a pricer without one keeps the
    envelope bound. A split unit (one that does not fit flat even alone) runs alone, so each
    is a wave of its own, and the pricer bounds the flat waves of the other requests.
    """
    if pricer.bounded is None:
        return envelope_bound
    if not split:
        return int(pricer.bounded.lower_bound_waves(budget))
    taken = np.zeros(items.n, dtype=bool)
    for d in split:
        taken[d.reqs(items)] = True
    rest = np.flatnonzero(~taken)
    if len(rest) == 0:
        return len(split)
    return len(split) + int(pricer.bounded.lower_bound_waves(budget, requests=rest))
