"""How the search spends its time budget, in both modes.

The budget covers the whole search. Exact re-pricing, the pending-gradient order and the
final breakdowns cost about POST_US_PER_WAVE per wave (measured on generated GRPO steps of
32-2048 requests with the real pricer); that much is set aside from the start, using the
lower bound for the wave count, and the rest goes to the greedy runs, then the multistart;
on large steps AUTO first sets aside one greedy run's estimate for the wave-by-wave fill
(`fill`, about the cost of a greedy run, when the budget holds two) and up to EJECT_SHARE of
it (at most what one greedy run and the fill leave, `packers`) for annealing against the envelope (`anneal`, counted in evaluations,
ANNEAL_US_PER_EVAL), exactly priced swaps (`swap`, counted in prices, `exact_price_us`) and
the ejection chains (`eject`, counted in placements, `eject_cost_us`).

In both modes (`packers`: clock mode only adds what the clock leaves after it) the number of
greedy runs and multistart iterations comes from
an estimate of their cost, RUN_US_BASE + RUN_US_PER_UNIT x atoms x (waves + points)
microseconds each (a greedy run with its `eliminate`, or a multistart iteration, its share
of the chunked kernel call included). Measured on generated GRPO steps and soak steps of
2-512 atoms, 1-121 waves, 2-6 points: 0.024-0.05 us per unit on large steps (least squares
and medians), 0.07 on the slowest soak steps, about 10 us per iteration on tiny ones; the
constants sit near the slow end, so a deterministic plan rarely overruns its budget
(`bench/search_quality.py --calibrate` re-fits them). The count is the same on any
machine.
"""

from __future__ import annotations

POST_US_PER_WAVE = 60.0
RUN_US_BASE = 10.0
RUN_US_PER_UNIT = 0.06
EJECT_US_PER_UNIT = 0.03    # one placement of `eject`: atoms + waves x points units
ANNEAL_US_PER_EVAL = 0.3   # one evaluation of `anneal` (a wave's load after a change, O(P)):
                           # 0.16-0.39 us measured at 512-2048 atoms on a loaded machine,
                           # 0.15-0.28 scaled to the pace `eject`'s constant assumes
PRICE_US = 30.0             # one exact price of a wave in `swap` (the fast admitted path, ~11 us
                            # at 512-2048 requests; 31-72 us a price in all measured at 512
                            # on a loaded machine) ...
PRICE_US_PER_UNIT = 0.05    # ... plus its share of the candidate estimates: atoms + waves units


def search_us(time_budget_ms: float, waves: int) -> float:
    """Microseconds left for the greedy and the multistart."""
    return max(0.0, 1e3 * time_budget_ms - POST_US_PER_WAVE * max(waves, 0))


def run_cost_us(atoms: int, waves: int, points: int) -> float:
    """Estimated microseconds of one greedy run (with `eliminate`) or multistart iteration."""
    return RUN_US_BASE + RUN_US_PER_UNIT * atoms * (max(waves, 1) + points)


def eject_cost_us(atoms: int, waves: int, points: int) -> float:
    """Estimated microseconds of one placement of the ejection chains (`eject`): a scan of
    the atoms and of every wave's load. Measured 19 ns per unit at 512 atoms and 30-35 at
    2048 (15 and 95-110 us a placement, generated GRPO steps, 8 points); the constant sits
    at the slow end, like the greedy's."""
    return EJECT_US_PER_UNIT * (atoms + max(waves, 1) * points)


def runs_within(us: float, atoms: int, waves: int, points: int) -> int:
    """How many runs of that cost fit in `us` microseconds (0 when none does)."""
    return int(max(0.0, us) // run_cost_us(atoms, waves, points))


def exact_price_us(atoms: int, waves: int) -> float:
    """Estimated microseconds per exact price spent by `swap` (the price and its share of the
    vectorised candidate estimates of one placement)."""
    return PRICE_US + PRICE_US_PER_UNIT * (atoms + max(waves, 1))
