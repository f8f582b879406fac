"""How the search spends its time budget, in both modes (docs/faq.md#time-budget).

The deterministic work is sized, by the cost estimates below, to WORK_SHARE of the budget,
so it keeps the budget on a machine up to 1/WORK_SHARE times slower than the estimates;
clock mode spends the measured rest (`packers._spend_the_rest`). Of that share: the items
and bounds (PREP_US_PER_REQUEST a request), the exact re-pricing, merges, pending-gradient
order and full prices (POST_US_PER_WAVE a wave of the lower bound plus POST_US_PER_REQUEST a
request) are set aside first, and, where the RoPE reserve's probe ran, its estimate
(`probe_cost_us`); the rest goes to the greedy runs, then the multistart; on large steps AUTO
first sets aside the wave-by-wave fill (`fill`, `fill_cost_us`; it runs at any budget, like the
first greedy run) and up to EJECT_SHARE of it (at most what one greedy run and the fill leave,
`packers`) for annealing against the envelope (`anneal`, counted in evaluations,
ANNEAL_US_PER_EVAL), exactly priced swaps (`swap`, counted in prices, `exact_price_us`) and
the ejection chains (`eject`, counted in placements, `eject_cost_us`).

The number of greedy runs and multistart iterations comes from an estimate of their cost,
RUN_US_BASE + RUN_US_PER_UNIT x atoms x (waves + points) microseconds each (a greedy run with
its `eliminate`, or a multistart iteration, its share of the chunked kernel call included;
`bench/search_quality.py --calibrate` re-fits them). The counts are the same on any machine.
The constants sit at the slow end of the stages' times measured on generated GRPO steps of
128-2048 requests on the 2-core development machine shared by other jobs (bench/results/
budget_overhead.txt gives the load and the figures).
"""

from __future__ import annotations

WORK_SHARE = 0.5           # the deterministic work is sized, by the estimates below, to this
                           # share of the time budget (docs/faq.md#time-budget) ...
MIN_SEARCH_MS = 0.01       # ... the search's share after a probe, at least (one greedy run)
PREP_US_PER_REQUEST = 5.0  # stages 1-2 (items, bounds), per request
POST_US_PER_WAVE = 100.0   # stages 4-6 (exact prices, merges, order, full prices): per wave ...
POST_US_PER_REQUEST = 25.0  # ... and per request
FILL_US_PER_UNIT = 0.15    # `fill`: atoms x waves units
RUN_US_BASE = 10.0
RUN_US_PER_UNIT = 0.06
EJECT_US_PER_UNIT = 0.03    # one placement of `eject`: atoms + waves x points units
ANNEAL_US_PER_EVAL = 0.8   # one evaluation of `anneal` (a wave's load after a change, O(P))
PRICE_US = 30.0             # one exact price of a wave in `swap` (the fast admitted path, ~11 us
                            # at 512-2048 requests; 31-72 us a price in all measured at 512
                            # on a loaded machine) ...
PRICE_US_PER_UNIT = 0.05    # ... plus its share of the candidate estimates: atoms + waves units


def search_us(time_budget_ms: float, waves: int, requests: int = 0) -> float:
    """Microseconds left for the greedy and what follows it: WORK_SHARE of the budget less
    the items and bounds (per request) and the exact re-pricing and full prices (per wave)."""
    return max(0.0, WORK_SHARE * 1e3 * time_budget_ms
               - (PREP_US_PER_REQUEST + POST_US_PER_REQUEST) * max(requests, 0)
               - POST_US_PER_WAVE * max(waves, 0))


def fill_cost_us(atoms: int, waves: int) -> float:
    """Estimated microseconds of `fill` and its `eliminate`: every wave walks the atoms left."""
    return FILL_US_PER_UNIT * atoms * max(waves, 1)


def probe_cost_us(requests: int, atoms: int, waves: int, points: int, fills: bool) -> float:
    """Estimated microseconds of the RoPE reserve's probe plan (`packers._probe`): items and
    bounds, one greedy run, the fill when it runs, one exact price per wave."""
    return (PREP_US_PER_REQUEST * requests + run_cost_us(atoms, waves, points)
            + (fill_cost_us(atoms, waves) if fills else 0.0) + PRICE_US * max(waves, 1))


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
