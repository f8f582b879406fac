"""Packing against the pipeline's in-flight window (PP > 1, `waveplan.pricing.pipeline`).

Under 1F1B stage s holds up to k_s = p - s consecutive waves, so the waves' order matters and
a stage's peak is its highest schedule point (`pricing.stage_price.price_stages`). The search
here:
1. packs as at PP1 (`packers._search`) against the per-wave proxy price of the model (each
   stage's layers with k_s copies of the wave in flight, `pipeline.fold_stages`): a plan whose
   waves are alike then fits every window;
2. orders the waves (the waves that carry pending gradients stay first, in their order, so
   the pending-gradient rule holds): the search's run order if every window fits, else a
   heavy/light alternation by the first stage's retained part, else `fill_windows` (each
   next wave the heaviest whose newest windows fit); the order whose worst stage is lowest
   is kept. Each wave's retained part and peak per stage do not depend on the order, so
   they are priced once per pack (`stage_price.price_parts`) and orders cost arithmetic;
3. checks every stage's schedule points exactly against its budget (per stage:
   `SearchOptions.stage_budgets`); if a stage is over, packs
   again with the per-wave budget scaled down by the worst stage's overshoot (at most
   MAX_SHRINKS times, or until a request no longer fits alone), then tries one request per
   wave, then raises InfeasibleError naming the stage.
The plan's lower bound is the window bound (`pipeline.window_lower_bound`): every backward
point, beside the retained parts of the waves after it, is within the budget, and the step's
gradient rows keep at least their packed rows' bytes. The search's own bound holds for the proxy price only (a plan
may mix a wave over the proxy with light ones), so it is kept in the stats only.
Complexity: one PP1 search per try, plus O(p x W x (groups^2 + groups x L / p)) per order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from waveplan.pricing.errors import ConfigError, InfeasibleError, WaveplanError, bad
from waveplan.pricing.pipeline import StagePeak

from .contract import SearchPricer, StageView
from .options import BASELINE_KINDS, PackerKind
from .result import PackedWave, SearchResult

MAX_SHRINKS = 8   # packs with a smaller per-wave budget before giving up


def _overshoot(peaks: Sequence[StagePeak]) -> float:
    return max(p.peak_bytes / max(p.budget_bytes, 1) for p in peaks)


def alternate(waves: Sequence[PackedWave], weight: Sequence[float]) -> list[int]:
    """Run order: the waves that carry pending gradients first (in their order), then the
    others heaviest, lightest, next heaviest, ... O(W log W)."""
    first = [i for i, w in enumerate(waves) if w.first_slots]
    rest = sorted((i for i, w in enumerate(waves) if not w.first_slots),
                  key=lambda i: (-weight[i], i))
    out, lo, hi = list(first), 0, len(rest) - 1
    while lo <= hi:
        out.append(rest[lo])
        lo += 1
        if lo <= hi:
            out.append(rest[hi])
            hi -= 1
    return out


def fill_windows(waves: Sequence[PackedWave], kept: np.ndarray, peak: np.ndarray,
                 windows: Sequence[int], room: np.ndarray) -> list[int]:
    """Run order built wave by wave: the waves that carry pending gradients first (in their
    order), then each time the heaviest wave (by its largest share of a stage's room) whose
    newest window fits every stage's `room` (raw bytes), else the one whose window is
    lowest. O(W^2 x p x k)."""
    order = [i for i, w in enumerate(waves) if w.first_slots]
    rest = [i for i, w in enumerate(waves) if not w.first_slots]
    share = (kept / room[:, None]).max(axis=0)
    rest.sort(key=lambda i: (-share[i], i))
    while rest:
        best, best_cost = rest[0], np.inf
        for c in rest:
            cost = 0.0
            for s, k in enumerate(windows):
                tail = order[len(order) - k + 1:] if k > 1 else []
                idx = tail + [c]
                v = kept[s, idx].sum() + (peak[s, idx] - kept[s, idx]).max()
                cost = max(cost, v / room[s])
            if cost <= 1.0:
                best = c
                break
            if cost < best_cost:
                best, best_cost = c, cost
        order.append(best)
        rest.remove(best)
    return order


def best_order(stages: StageView, waves: Sequence[PackedWave], budgets: Sequence[int],
               max_len: float = math.inf) -> tuple[list[PackedWave], tuple[StagePeak, ...]]:
    """The waves in the best of three orders (the search's, the heavy/light alternation,
    `fill_windows`) and its stage peaks. O(p x W x (groups^2 + groups x L/p) + W^2 x p x k)."""
    waves = list(waves)
    parts = stages.parts([(w.loads, w.first_slots) for w in waves], max_len=max_len)
    kept, peak = parts.kept, parts.peak
    best, best_peaks = list(range(len(waves))), None
    orders = [best]
    if len(waves) > 2:
        windows = [stages.in_flight(s, len(waves)) for s in range(stages.num_stages)]
        room = np.asarray(budgets, dtype=np.float64) / stages.safety
        orders += [alternate(waves, kept[0]), fill_windows(waves, kept, peak, windows, room)]
    for order in orders:
        peaks = stages.peaks(parts.take(order), budgets)
        if best_peaks is None or _overshoot(peaks) < _overshoot(best_peaks):
            best, best_peaks = order, peaks
        if all(p.fits for p in peaks):
            break
    return [waves[i] for i in best], best_peaks


def pack_pipeline(step, pricer: SearchPricer, budget: int, options,
                  search: Callable[..., SearchResult], stages: StageView) -> SearchResult:
    """Waves and their order such that every stage's window fits its budget (the module
    docstring): `options.stage_budgets` (one per stage), else `budget` for every stage. The
    per-wave proxy packs against `budget` (the minimum over every rank), which no stage
    budget may be below."""
    pp = stages.num_stages
    budgets = options.stage_budgets or (int(budget),) * pp
    if len(budgets) != pp:
        raise bad(ConfigError, "stage_budgets", list(budgets),
                  f"needs one budget per pipeline stage ({pp})")
    first = per_wave = min(int(budget), *budgets)
    longest = stages.longest_sequence(step)

    def done(result, waves, peaks, tries):
        bound = min(max(stages.window_bound(budgets), 1), max(len(waves), 1))
        stats = dict(result.stats, stages=[p.to_dict() for p in peaks],
                     pipeline_wave_budget=per_wave, pipeline_shrinks=tries,
                     lower_bound_search=int(result.lower_bound_waves))
        return replace(result, waves=tuple(waves), lower_bound_waves=bound,
                       proven_optimal=len(waves) <= bound, stats=stats)

    worst = None
    for tries in range(MAX_SHRINKS + 1):
        try:
            result = search(step, pricer, per_wave, options)
        except InfeasibleError:
            if tries == 0:
                raise
            break   # a shrunk per-wave budget below what a request needs alone
        waves, peaks = best_order(stages, result.waves, budgets, longest)
        if all(p.fits for p in peaks):
            return done(result, waves, peaks, tries)
        worst = max(peaks, key=lambda p: p.peak_bytes / max(p.budget_bytes, 1))
        per_wave = min(per_wave - 1, math.floor(per_wave / _overshoot(peaks)))
    # the last resort: one request per wave at the first per-wave budget (the schedule's
    # cross-wave holdings can make a pack whose waves each fit alone miss a stage budget);
    # a baseline packer takes no wave count, so the search's greedy cuts those waves
    n = len(step.requests)
    if options.num_waves is None and not options.atomic_units and n > 1:
        per_wave = first
        packer = PackerKind.GREEDY if options.packer in BASELINE_KINDS else options.packer
        try:
            result = search(step, pricer, first, replace(options, num_waves=n, packer=packer))
        except WaveplanError:
            result = None
        if result is not None:
            waves, peaks = best_order(stages, result.waves, budgets, longest)
            if all(p.fits for p in peaks):   # one request per wave: the packer asked for
                return done(replace(result, packer=options.packer.value), waves, peaks,
                            MAX_SHRINKS + 1)
    raise InfeasibleError(f"pipeline stage {worst.stage}: window of waves {list(worst.window)} "
                          f"peaks at {worst.peak_bytes} bytes > budget {worst.budget_bytes} "
                          f"after {MAX_SHRINKS} smaller per-wave budgets and one request per wave")
