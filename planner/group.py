"""The data-parallel group's batch planned at once: `plan_group(planner, step, dp, free_bytes)`.

Every rank of a data-parallel group runs the same number of waves (the gradient all-reduce
waits for the slowest), so a rank handed the long tail sets everyone's count. The group plan
assigns the requests to ranks and to waves together:

1. *units*: whole prompt groups (a shared prompt is run once per wave on one rank) or single
   sequences;
2. *starts*: veRL's balance (Karmarkar-Karp on 24576 x s + s^2 with equal counts, by sequence
   and by whole prompt group; `dp_balance`) and the longest-first balance of the predicted
   time (with uneven budgets also in proportion to them), each share planned by the planner; the start with the fewest waves (the maximum over
   ranks), then the least predicted time of the slowest rank, is kept, so the group plan never
   needs more waves than balancing first and planning each share;
3. *waves*: units moved (or, with `equal_counts`, swapped for equal-sized ones) from a rank
   at the maximum wave count to the lightest ranks while the moving rank drops below it and
   the receiver stays under it, until no rank is left at the count (the count falls) or no
   move helps;
4. *time*: every rank planned at exactly that count; units moved from the slowest rank
   (predicted seconds, `pricing.time_model`) to the fastest while the slower of the pair
   gets faster.

Every share is planned with `deterministic=True`, and every choice is ordered by values and
indices, never by the clock or a hash seed: every rank that computes it gets the same plan.
The lower bound: the whole step's bound at the largest budget over the ranks (the ranks'
waves together are a plan of the step), and each unit's own bound (it runs on one rank).
docs/integration.md#5-one-plan-for-the-data-parallel-group.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from waveplan.pricing.errors import ConfigError, InfeasibleError, bad
from waveplan.pricing.step import Step
from waveplan.pricing.time_model import wave_work
from waveplan.pricing.tolerances import REL_GAIN_EPS
from waveplan.search import DEFAULT_PACKER, DEFAULT_SEED, DEFAULT_TIME_BUDGET_MS

from .dp_balance import karmarkar_karp, verl_workload
from .plan import Plan
from .planner import Planner, _as_step, budget_from_free_bytes

GROUP_SCHEMA = 1
DEFAULT_ROUNDS = 48     # trial moves the improvement may price (each plans two shares)
_TRIAL_UNITS = 6        # units of the busiest rank tried per round
_TRIAL_RANKS = 3        # receiving ranks tried per unit
BY_SEQUENCE = "balance-by-sequence"
BY_GROUP = "balance-by-group"


@dataclass(frozen=True)
class GroupPlan:
    """One plan per data-parallel rank, with equal wave counts; request indices in every
    rank's plan are positions in the whole step (`shares[r]` lists rank r's)."""

    ranks: tuple[Plan, ...]
    """Each rank's plan (the plan schema), waves in run order."""
    shares: tuple[tuple[int, ...], ...]
    """Each rank's request indices in the step, ascending."""
    lower_bound_waves: int
    """No group plan of this step over these budgets needs fewer waves."""
    rank_seconds: tuple[float, ...]
    """Each rank's predicted seconds (the sum of its waves', `Planner.time_model`)."""
    baselines: dict = field(compare=False)
    """veRL's balance then each share planned, MAX count: {name: {"waves", "seconds"}}."""
    start: str = ""
    """The start the improvement began from (a baseline's name or a time balance)."""
    keep_groups: bool = True
    """Whether every prompt group sits whole on one rank."""
    objective: str = "waves"
    """What was minimised first: "waves" or "time" (`plan_group`)."""
    planning_ms: float = field(default=0.0, compare=False)
    """Wall time of the group search (timing; dropped where plans are compared)."""
    stats: dict = field(default_factory=dict, compare=False)
    """Counters of the search: shares planned, moves accepted."""

    @property
    def dp(self) -> int:
        return len(self.ranks)

    @property
    def num_waves(self) -> int:
        return self.ranks[0].num_waves

    @property
    def proven_optimal(self) -> bool:
        return self.num_waves <= self.lower_bound_waves

    @property
    def step_seconds(self) -> float:
        """The slowest rank's predicted seconds: the step's."""
        return max(self.rank_seconds)

    def to_dict(self) -> dict:
        return {"schema": GROUP_SCHEMA, "dp": self.dp, "num_waves": self.num_waves,
                "lower_bound_waves": int(self.lower_bound_waves),
                "proven_optimal": bool(self.proven_optimal),
                "keep_groups": bool(self.keep_groups), "start": self.start,
                "objective": self.objective,
                "predicted_seconds": [round(float(t), 6) for t in self.rank_seconds],
                "step_seconds": round(float(self.step_seconds), 6),
                "baselines": {k: {"waves": int(v["waves"]), "seconds": round(float(v["seconds"]), 6)}
                              for k, v in sorted(self.baselines.items())},
                "planning_ms": round(float(self.planning_ms), 3),
                "ranks": [p.to_dict() for p in self.ranks]}

    def to_json(self, *, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=indent)


def rank_budgets(free_bytes, dp: int) -> tuple[int, ...]:
    """Each data-parallel rank's budget: one number for every rank, or a list of `dp` entries,
    each a number or one number per model-parallel rank (the minimum binds)."""
    if isinstance(free_bytes, Sequence | np.ndarray) and not isinstance(free_bytes, str | bytes):
        values = list(free_bytes)
        if len(values) != dp:
            raise bad(ConfigError, "free_bytes", values,
                      f"needs one entry per data-parallel rank (dp={dp}), or one number for all")
        return tuple(budget_from_free_bytes(v) for v in values)
    b = budget_from_free_bytes(free_bytes)
    return (b,) * dp


def _check_dp(dp: object) -> int:
    if isinstance(dp, bool) or not isinstance(dp, int | np.integer) or dp < 1:
        raise bad(ConfigError, "dp", dp, "must be an integer >= 1 (the data-parallel size)")
    return int(dp)


class _Search:
    """The shares being planned: units, per-rank budgets, and a cache of share plans."""

    def __init__(self, planner: Planner, step: Step, budgets: tuple[int, ...], plan_kwargs: dict):
        self.planner = planner
        self.step = step
        self.budgets = budgets
        self.kwargs = plan_kwargs
        self.time = planner.time_model
        self.cache: dict[tuple, Plan | None] = {}
        self.planned = 0

    def plan(self, rank: int, share: tuple[int, ...], num_waves: int | None = None) -> Plan | None:
        """Rank `rank`'s plan of the requests `share` (ascending step indices); None when
        `num_waves` is asked for and not possible."""
        key = (self.budgets[rank], share, num_waves)
        if key not in self.cache:
            sub = Step.from_requests([self.step.requests[i] for i in share])
            self.planned += 1
            try:
                plan = self.planner.plan(sub, self.budgets[rank], num_waves=num_waves, **self.kwargs)
            except InfeasibleError:
                if num_waves is None:
                    raise
                plan = None
            self.cache[key] = plan
        return self.cache[key]

    def seconds(self, plan: Plan, share: tuple[int, ...]) -> float:
        idx = np.asarray(share, dtype=np.int64)
        return float(sum(self.time.wave_seconds(self.step, [idx[c] for c in w.children])
                         for w in plan.waves))


class _State:
    """An assignment of units to ranks with each rank's plan (free, or at exactly `exact`
    waves), its wave count and predicted seconds."""

    def __init__(self, search: _Search, units: list[np.ndarray], assign: list[list[int]],
                 exact: int | None = None):
        self.search = search
        self.units = units
        self.assign = [sorted(a) for a in assign]
        self.exact = exact
        self.plans: list[Plan | None] = []
        self.waves: list[float] = []
        self.secs: list[float] = []
        for r in range(len(assign)):
            self._set(r, self.assign[r])

    def share(self, unit_ids: list[int]) -> tuple[int, ...]:
        if not unit_ids:
            return ()
        return tuple(int(i) for i in np.sort(np.concatenate([self.units[u] for u in unit_ids])))

    def _price(self, r: int, unit_ids: list[int], exact: int | None):
        share = self.share(unit_ids)
        if not share:
            return None, math.inf, math.inf
        plan = self.search.plan(r, share, exact)
        if plan is None:
            return None, math.inf, math.inf
        return plan, plan.num_waves, self.search.seconds(plan, share)

    def _set(self, r: int, unit_ids: list[int]) -> None:
        plan, w, t = self._price(r, unit_ids, self.exact)
        if r < len(self.plans):
            self.plans[r], self.waves[r], self.secs[r] = plan, w, t
        else:
            self.plans.append(plan)
            self.waves.append(w)
            self.secs.append(t)

    @property
    def max_waves(self) -> float:
        return max(self.waves)

    @property
    def score(self) -> tuple[float, float]:
        return self.max_waves, max(self.secs)

    def trial(self, a: int, b: int, out: list[int], into: list[int]):
        """Rank a without `out` and with `into`, rank b the other way: the two ranks' new
        (unit lists, plan, waves, seconds), not applied."""
        ua = sorted(set(self.assign[a]) - set(out) | set(into))
        ub = sorted(set(self.assign[b]) - set(into) | set(out))
        return (ua, *self._price(a, ua, self.exact)), (ub, *self._price(b, ub, self.exact))

    def apply(self, a: int, b: int, ta, tb) -> None:
        for r, (ids, plan, w, t) in ((a, ta), (b, tb)):
            self.assign[r] = ids
            self.plans[r], self.waves[r], self.secs[r] = plan, w, t

    def at(self, exact: int) -> _State:
        return _State(self.search, self.units, self.assign, exact=exact)


def _units(step: Step, by_group: bool) -> list[np.ndarray]:
    """Whole prompt groups (numbered by first appearance) or single requests."""
    if not by_group:
        return [np.array([i], dtype=np.int64) for i in range(step.num_requests)]
    order = np.argsort(step.group_of, kind="stable")
    bounds = np.flatnonzero(np.diff(step.group_of[order])) + 1
    return [np.sort(g) for g in np.split(order, bounds)]


def _unit_cost(search: _Search, unit: np.ndarray) -> float:
    """A unit's predicted compute seconds run alone in one forward call (no fixed cost)."""
    rows, pairs = wave_work(search.step, [unit])
    tm = search.time
    return tm.scale * (tm.row_flops * rows + tm.pair_flops * pairs) / tm.flops_per_s


def _kk(units: list[np.ndarray], lengths: np.ndarray, dp: int) -> list[list[int]] | None:
    """veRL's balance of the units: Karmarkar-Karp on the sum of their sequences' 24576 x s +
    s^2, equal counts when the units divide evenly."""
    if len(units) < dp:
        return None
    work = [sum(verl_workload(lengths[i]) for i in u) for u in units]
    return karmarkar_karp(work, dp, equal_size=len(units) % dp == 0)


def _lpt(costs: list[float], sizes: list[int], dp: int, cap: int | None,
         weights: Sequence[float] | None = None) -> list[list[int]] | None:
    """Longest first onto the least loaded rank (load over its `weight`, e.g. its budget;
    with `cap`: only ranks with room for the unit's requests); None when a unit finds no
    room."""
    weights = weights or [1.0] * dp
    loads = [0.0] * dp
    room = [cap if cap is not None else math.inf] * dp
    assign: list[list[int]] = [[] for _ in range(dp)]
    for u in sorted(range(len(costs)), key=lambda u: (-costs[u], u)):
        fits = [r for r in range(dp) if room[r] >= sizes[u]]
        if not fits:
            return None
        r = min(fits, key=lambda r: (loads[r] / weights[r], r))
        assign[r].append(u)
        loads[r] += costs[u]
        room[r] -= sizes[u]
    if any(not a for a in assign):
        return None
    return assign


def _equal(assign: list[list[int]], sizes: list[int]) -> bool:
    counts = {sum(sizes[u] for u in a) for a in assign}
    return len(counts) == 1


def plan_group(planner: Planner, step, dp: int, free_bytes, *, keep_groups: bool | None = None,
               equal_counts: bool = False, objective: str = "waves", rounds: int = DEFAULT_ROUNDS,
               time_budget_ms: float = DEFAULT_TIME_BUDGET_MS, packer=DEFAULT_PACKER,
               seed: int = DEFAULT_SEED) -> GroupPlan:
    """Plan the whole `step` over `dp` data-parallel ranks: every rank the same number of
    waves, each fitting its rank (`free_bytes`: a number for all, or one entry per rank,
    itself a number or one per model-parallel rank), the fewest waves, then the least
    predicted seconds of the slowest rank (module docstring).

    `keep_groups`: True keeps every prompt group whole on one rank; False balances single
    sequences; None (default) tries both and keeps groups whole unless splitting one saves a
    wave. `objective`: "waves" (the fewest waves, then the least predicted seconds) or "time"
    (the least predicted seconds of the slowest rank, never above veRL's balance then plan;
    the waves are then not minimised). `equal_counts`: every rank gets the same number of requests (veRL's dispatch cuts the
    batch into equal chunks). `rounds`: trial moves the improvement may price. Shares are
    planned with `deterministic=True` (`time_budget_ms`, `packer`, `seed` as `Planner.plan`).
    Raises ConfigError when the step has fewer units than ranks, InfeasibleError when no start
    gives every rank the same count. O((starts x dp + 2 rounds) x one share's plan)."""
    t0 = time.perf_counter()
    dp = _check_dp(dp)
    step = _as_step(step)
    if keep_groups not in (True, False, None):
        raise bad(ConfigError, "keep_groups", keep_groups, "must be true, false or none")
    if objective not in ("waves", "time"):
        raise bad(ConfigError, "objective", objective, "must be 'waves' or 'time'")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise bad(ConfigError, "rounds", rounds, "must be an integer >= 0")
    budgets = rank_budgets(free_bytes, dp)
    n = step.num_requests
    if equal_counts and n % dp:
        raise bad(ConfigError, "dp", dp, f"equal counts need the step's {n} requests to divide by it")
    search = _Search(planner, step, budgets,
                     dict(time_budget_ms=time_budget_ms, packer=packer, seed=seed, deterministic=True))
    families: list[tuple[bool, list[np.ndarray]]] = []
    grouped = int(step.num_groups) < n
    if keep_groups is not False and grouped:
        families.append((True, _units(step, True)))
    if keep_groups is not True or not grouped:
        families.append((False, _units(step, False)))
    if max(len(u) for _, u in families) < dp:
        raise bad(ConfigError, "dp", dp,
                  f"the step has {n} requests in {step.num_groups} prompt groups: fewer units than ranks")

    # 2. starts: veRL's balance and the time balance, per family
    starts: list[tuple[tuple, str, bool, _State]] = []
    baselines: dict[str, dict] = {}
    for by_group, units in families:
        sizes = [len(u) for u in units]
        costs = [_unit_cost(search, u) for u in units]
        cap = n // dp if equal_counts else None
        named = [(BY_GROUP if by_group and grouped else BY_SEQUENCE, _kk(units, step.lengths, dp)),
                 (f"time-{'group' if by_group else 'sequence'}", _lpt(costs, sizes, dp, cap))]
        if len(set(budgets)) > 1:   # uneven memory: the time balanced in proportion to the budgets
            named.append((f"budget-{'group' if by_group else 'sequence'}",
                          _lpt(costs, sizes, dp, cap, [float(b) for b in budgets])))
        for name, assign in named:
            if assign is None or any(not a for a in assign):
                continue
            if equal_counts and not _equal(assign, sizes):
                continue
            free = _State(search, units, assign)
            exact = free.at(int(free.max_waves))
            if math.isinf(exact.max_waves):   # a rank short of requests for the count
                continue
            if name.startswith("balance"):
                baselines[name] = {"waves": int(exact.max_waves), "seconds": max(exact.secs)}
            # groups kept whole win ties (their prompt is run once)
            starts.append(((exact.max_waves, not by_group, max(exact.secs), len(starts)),
                           name, by_group, free, exact))
    if not starts:
        raise InfeasibleError(f"dp={dp}: no balance of the step gives every rank the same number "
                              f"of waves (a rank holds fewer requests than another rank's waves)")
    rank_by = (lambda s: s[0]) if objective == "waves" else \
        (lambda s: (s[0][2], s[0][0], s[0][1], s[0][3]))
    _, start, by_group, chosen, chosen_exact = min(starts, key=rank_by)
    units = chosen.units
    state = _State(search, units, [list(a) for a in chosen.assign])   # plans come from the cache
    sizes = [len(u) for u in units]
    costs = [_unit_cost(search, u) for u in units]
    lower = _lower_bound(planner, step, units, max(budgets), dp)
    stats = {"wave_moves": 0, "time_moves": 0, "trials": 0}

    # 3. waves: empty the ranks at the maximum count
    budget_left = rounds - rounds // 2   # the wave phase's share; the rest goes to time
    while objective == "waves" and budget_left > 0 and state.max_waves > lower:
        w = state.max_waves
        heavy = max((r for r in range(dp) if state.waves[r] == w), key=lambda r: (state.secs[r], -r))
        at_max = sum(1 for x in state.waves if x == w)
        done = False
        for u, b, into in _moves(state, heavy, sizes, costs, equal_counts, gap=None):
            if budget_left <= 0:
                break
            budget_left -= 1
            stats["trials"] += 1
            ta, tb = state.trial(heavy, b, [u], into)
            if ta[2] < w and tb[2] <= w and len(ta[0]) and len(tb[0]):
                after = at_max - 1 - (state.waves[b] == w) + (tb[2] == w)
                if after < at_max:
                    state.apply(heavy, b, ta, tb)
                    stats["wave_moves"] += 1
                    done = True
                    break
        if not done:
            break
    target = int(state.max_waves)
    exact = state.at(target)
    if target == chosen_exact.max_waves or any(p is None for p in exact.plans):
        # no wave saved (or a rank short of requests for the count): the moves only cost time
        exact, target = chosen_exact, int(chosen_exact.max_waves)
        exact = _State(search, units, [list(a) for a in exact.assign], exact=target)

    budget_left += rounds // 2
    # 4. time: move units off the slowest rank while the slower of the pair gets faster
    while budget_left > 0:
        slow = max(range(dp), key=lambda r: (exact.secs[r], -r))
        done = False
        for u, b, into in _moves(exact, slow, sizes, costs, equal_counts,
                                 gap=lambda b, s=slow: exact.secs[s] - exact.secs[b]):
            if budget_left <= 0:
                break
            budget_left -= 1
            stats["trials"] += 1
            ta, tb = exact.trial(slow, b, [u], into)
            if ta[1] is None or tb[1] is None:
                continue
            if max(ta[3], tb[3]) < exact.secs[slow] * (1 - REL_GAIN_EPS):
                exact.apply(slow, b, ta, tb)
                stats["time_moves"] += 1
                done = True
                break
        if not done:
            break

    shares = tuple(exact.share(a) for a in exact.assign)
    plans = tuple(_globalise(p, s) for p, s in zip(exact.plans, shares, strict=True))
    stats["shares_planned"] = search.planned
    return GroupPlan(ranks=plans, shares=shares, lower_bound_waves=min(lower, target),
                     rank_seconds=tuple(exact.secs), baselines=baselines, start=start,
                     keep_groups=bool(by_group or not grouped), objective=objective,
                     planning_ms=(time.perf_counter() - t0) * 1e3, stats=stats)


def _moves(state: _State, a: int, sizes: list[int], costs: list[float], equal_counts: bool, gap):
    """Trial moves off rank `a`: (unit, receiving rank, units coming back). Receivers: the
    lightest ranks (fewest waves, then least seconds). Without `gap` (the wave phase): `a`'s
    heaviest units, moved, then swapped for the receiver's lightest unit. With `gap` (the
    seconds between `a` and the receiver): the moves and swaps whose predicted shift of
    seconds is nearest half the gap (and below the gap). With `equal_counts` only swaps of
    units of the same size; a rank never gives its last unit away."""
    dp = len(state.assign)
    receivers = sorted((r for r in range(dp) if r != a),
                       key=lambda r: (state.waves[r], state.secs[r], r))[:_TRIAL_RANKS]
    mine = state.assign[a]
    for b in receivers:
        theirs = state.assign[b]
        if gap is None:
            moves = [] if equal_counts or len(mine) < 2 else \
                [(u, None) for u in sorted(mine, key=lambda u: (-costs[u], u))[:_TRIAL_UNITS]]
            swaps = []
            for u in sorted(mine, key=lambda u: (-costs[u], u))[:_TRIAL_UNITS]:
                same = [v for v in theirs if costs[v] < costs[u]
                        and (not equal_counts or sizes[v] == sizes[u])]
                if same:
                    swaps.append((u, min(same, key=lambda v: (costs[v], v))))
            trials = moves + swaps
        else:
            half = gap(b) / 2
            if half <= 0:
                continue
            shifts = [] if equal_counts or len(mine) < 2 else \
                [(abs(costs[u] - half), u, None) for u in mine if costs[u] < 2 * half]
            for u in sorted(mine, key=lambda u: (-costs[u], u))[:2 * _TRIAL_UNITS]:
                for v in theirs:
                    d = costs[u] - costs[v]
                    if 0 < d < 2 * half and (not equal_counts or sizes[v] == sizes[u]):
                        shifts.append((abs(d - half), u, v))
            trials = [(u, v) for _, u, v in sorted(shifts, key=lambda x: (x[0], x[1], -1 if x[2] is None else x[2]))]
            trials = trials[:_TRIAL_UNITS]
        for u, v in trials:
            yield u, b, [] if v is None else [v]


def _lower_bound(planner: Planner, step: Step, units: list[np.ndarray], budget: int, dp: int) -> int:
    """max(ceil(the step's bound / dp), each unit's own bound), at the largest rank budget:
    the ranks' waves together are a plan of the step, and a unit runs on one rank."""
    pricer = planner.pricer(step)
    whole = pricer.lower_bound_waves(budget)
    lower = max(1, math.ceil(whole / dp))
    heavy = sorted(range(len(units)), key=lambda u: (-int(step.lengths[units[u]].sum()), u))[:8]
    for u in heavy:
        if len(units[u]) > 1:
            lower = max(lower, pricer.lower_bound_waves(budget, units[u]))
    return lower


def _globalise(plan: Plan, share: tuple[int, ...]) -> Plan:
    """A share's plan with its request indices as positions in the whole step."""
    idx = np.asarray(share, dtype=np.int64)
    waves = tuple(replace(w, wave=replace(w.wave, children=tuple(idx[c] for c in w.wave.children)))
                  for w in plan.waves)
    return replace(plan, waves=waves)
