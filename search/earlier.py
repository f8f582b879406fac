"""The entries a plan's earlier waves leave beside each wave, honoured by the search (PP1).

A pricer that offers `contract.EarlierEntriesPricer` says that a wave's price grows with what
the waves run before it left (Megatron's RoPE cache: `pricing.rope_cache`), a charge no
wave priced alone can see. `with_earlier_entries` wraps one search: it orders the waves
(`roomiest_last`), charges each the entries of the waves before it (`plus_earlier`), and when
a wave no longer fits, searches again against the budget less a reserve: the largest admitted
growth seen, raised until every wave fits (RESERVE_TRIES searches), then the pricer's
`earlier_reserve_bytes`, which always holds. The first reserve is measured on a probe plan
(the search's greedy and fill stages at the whole budget, fast-path prices, `packers._probe`)
instead of a first full search: how far its fullest-first waves, charged, go over the budget
(`probe_growth`); a wave with room needs no reserve, so this is tighter than the largest
growth. A step whose waves need a reserve is then searched once, twice when the plan's
charged waves still overflow (the reserve raised by that overflow, at least to the largest
growth), before the loop above.
The result's lower bound and `proven_optimal` are those of the budget the final search packed
against (the reserve set aside), and `stats["rope_reserve_bytes"]` says how much that was.
Evidence: docs/memory-model.md#rope-cache-earlier-waves. O(tries x search).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from waveplan.pricing.errors import InfeasibleError
from waveplan.pricing.price import Breakdown

from .contract import SearchPricer
from .result import SearchResult

RESERVE_TRIES = 3    # searches against a growing reserve before the pricer's bound
_ZERO = Breakdown(raw_bytes=0, admitted_bytes=0, terms={}, binding="", basis="")   # growth alone


def roomiest_last(waves: Sequence) -> tuple:
    """The waves in a run order where the entries earlier waves leave (which only grow along
    the order) meet the most room: the waves up to the last that carries pending gradients
    keep their places (each slot's first gradient wave runs before its others); the rest run
    fullest first (admitted bytes descending, then smallest request index). O(W log W)."""
    waves = tuple(waves)
    fixed = max((i + 1 for i, w in enumerate(waves) if w.first_slots), default=0)
    rest = sorted(waves[fixed:], key=lambda w: (-w.price.admitted_bytes, int(w.requests[0])))
    return waves[:fixed] + tuple(rest)


def charge(pricer: SearchPricer, result: SearchResult) -> SearchResult:
    """`result` in `roomiest_last` order, each wave's price raised by the entries the waves
    before it leave (no check against the budget). O(W log W + calls)."""
    earlier = pricer.earlier
    if earlier is None or len(result.waves) < 2:
        return result
    waves = roomiest_last(result.waves)
    extra = earlier.earlier_entries([w.loads for w in waves])
    waves = tuple(dataclasses.replace(w, price=earlier.plus_earlier(w.price, e))
                  for w, e in zip(waves, extra, strict=True))
    return dataclasses.replace(result, waves=waves)


def fits(result: SearchResult, budget: int) -> bool:
    return all(w.price.admitted_bytes <= budget for w in result.waves)


def probe_growth(pricer: SearchPricer, waves: Sequence[tuple[Sequence, int]],
                 budget: int) -> int:
    """The reserve a probe plan asks for: its waves (parts, admitted bytes) run fullest first
    (`roomiest_last` without pending gradients), each charged the entries of those before it;
    how far the most charged one goes over `budget` (0 when all fit). A full wave's growth
    decides it, not the lightest wave's, which has room for its entries. O(W log W + calls)."""
    earlier = pricer.earlier
    if earlier is None or pricer.loads is None or len(waves) < 2:
        return 0
    order = sorted(waves, key=lambda w: (-w[1], int(min(int(p.min()) for p in w[0]))))
    extra = earlier.earlier_entries([pricer.loads.group_loads(parts) for parts, _ in order])
    growth = [earlier.plus_earlier(_ZERO, e).admitted_bytes for e in extra]
    return max(0, max(a + g for (_, a), g in zip(order, growth, strict=True)) - budget)


def with_earlier_entries(search: Callable[[int], SearchResult], pricer: SearchPricer,
                         budget: int, probe: Callable[[], int] | None = None
                         ) -> tuple[SearchResult, int]:
    """The plan of `search(packed_budget)` with the earlier waves' entries charged, searched
    again against a growing reserve while a wave does not fit (module docstring). `probe`: the
    first reserve (`probe_growth` of a probe plan), searched against at once. Returns
    (result, the budget it was packed against). InfeasibleError naming the reserve when the
    budget leaves no room beside it."""
    earlier = pricer.earlier
    if earlier is None or not earlier.earlier_reserve_bytes():
        return search(budget), budget
    reserve = probe() if probe is not None else 0
    if reserve >= budget:
        reserve = 0
    result = _search_within(search, budget, reserve)
    if len(result.waves) < 2:
        return (_note(result, reserve) if reserve else result), budget - reserve
    for attempt in range(RESERVE_TRIES + 1):
        charged = charge(pricer, result)
        if fits(charged, budget):
            return _note(charged, reserve), budget - reserve
        growth = max(w.price.admitted_bytes - old.price.admitted_bytes
                     for w, old in zip(charged.waves, roomiest_last(result.waves), strict=True))
        over = max(w.price.admitted_bytes for w in charged.waves) - budget
        if attempt == 0 and probe is not None:    # the probe's reserve raised by the overflow, at least to the growth
            reserve = max(reserve + max(1, over), growth)
        elif attempt < RESERVE_TRIES - 1:
            reserve = max(reserve + 1, growth)
        else:
            reserve = int(earlier.earlier_reserve_bytes())
        result = _search_within(search, budget, reserve)
        if len(result.waves) < 2:
            return _note(result, reserve), budget - reserve
    raise AssertionError("internal: the RoPE cache reserve did not hold")


def _search_within(search: Callable[[int], SearchResult], budget: int,
                   reserve: int) -> SearchResult:
    """`search(budget - reserve)`, its InfeasibleError naming the reserve."""
    if not reserve:
        return search(budget)
    why = (f"{reserve} bytes set aside for the RoPE cache entries the step's earlier waves "
           f"leave, docs/memory-model.md#rope-cache-earlier-waves")
    if reserve >= budget:
        raise InfeasibleError(f"budget_bytes={budget}: no room left beside {why}")
    try:
        return search(budget - reserve)
    except InfeasibleError as exc:
        raise InfeasibleError(f"{exc} (with {why})") from None


def _note(result: SearchResult, reserve: int) -> SearchResult:
    return dataclasses.replace(result, stats=dict(result.stats, rope_reserve_bytes=reserve))
