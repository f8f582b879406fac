"""The RoPE cache entries a step's earlier waves leave behind (PP1).

Megatron's `RotaryEmbedding.forward` is an `lru_cache(maxsize=32)` keyed by the forward call's
longest packed sequence (`max_seqlen`): every call that brings a new length computes
[max_seqlen, rotary dim] fp32 frequencies on every rank and the cache keeps them for the
process's life (at most 32 entries, the least recently used evicted). A wave's own calls are
priced with their entries (the per-row terms, `walk.rope_credit`, the walk's `other_groups`);
what a per-wave price cannot see is the entries the step's *earlier* waves left. This module
prices them from the plan's run order, so the planner can charge them beside each wave.
Evidence: docs/memory-model.md#rope-cache-earlier-waves. Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from .pipeline import ROPE_CACHE_ENTRIES
from .price import Breakdown, GroupLoad

CACHE_ENTRIES = ROPE_CACHE_ENTRIES   # Megatron's lru_cache(maxsize=32) on RotaryEmbedding.forward
TERM = "rope_cache_earlier_waves"   # the breakdown's term for them


def entry_rows(load: GroupLoad) -> int:
    """The cache key (and the entry's rows) of one forward call: its longest packed
    sequence's padded rows, or its padded rows when unknown (the call as one sequence)."""
    return int(load.padded_rows if load.longest_rows is None else load.longest_rows)


def earlier_slots(instances: int) -> int:
    """How many entries of earlier lengths the cache can hold beside a wave whose calls fill
    `instances` entries each (`pipeline.rope_cache_instances`: 1, or one per MLA layer): 32 with
    one instance (as before: the wave's own entry not taken off), else 32 - instances + 1.
    See docs/memory-model.md#mla-rope-caches. O(1)."""
    return CACHE_ENTRIES - max(1, min(instances, CACHE_ENTRIES)) + 1


def earlier_wave_entries(entry_per_row: float, waves: Sequence[Sequence[GroupLoad]],
                         instances: int = 1) -> list[float]:
    """Bytes of RoPE cache entries live beside each wave (in run order) that the step's
    earlier waves left: `entry_per_row` (4 x rotary dim) x the rows of every distinct length
    an earlier wave's call brought that none of the wave's own calls shares (a call whose
    length is cached reuses the entry its own terms already price), the `CACHE_ENTRIES`
    largest of them at most (the cache never holds more: keeping the largest, not the most
    recent, bounds it from above). With `instances` entries per length (MLA: one per layer),
    each length brings up to that many, `earlier_slots(instances)` entries in all, the largest
    lengths first. 0 for the first wave. O(calls x log calls)."""
    if entry_per_row <= 0.0:
        return [0.0] * len(waves)
    out = []
    seen: set[int] = set()
    for loads in waves:
        own = {entry_rows(g) for g in loads}
        others = sorted((n for n in seen if n not in own), reverse=True)
        slots, held = earlier_slots(instances), 0.0
        for n in others:
            take = min(instances, slots)
            if take <= 0:
                break
            held += take * float(n)
            slots -= take
        out.append(entry_per_row * held)
        seen |= own
    return out


def reserve_bound(entry_per_row: float, longest_rows: int, instances: int = 1) -> float:
    """The most the earlier waves' entries can hold beside any wave of a step whose forward
    calls' longest sequence is at most `longest_rows`: `earlier_slots(instances)` entries of
    it. O(1)."""
    return entry_per_row * earlier_slots(instances) * float(longest_rows)


def reserve_bytes(entry_per_row: float, step_loads: Sequence[GroupLoad], safety: float,
                  instances: int = 1) -> int:
    """Admitted bytes that always cover the earlier waves' entries beside any wave of a step
    whose calls, run together as one wave, are `step_loads` (a call's longest sequence is at
    most the step's as one wave: its trees whole): `reserve_bound` of their longest, the
    rounding of `plus_earlier_entries` (ceil(extra) <= bound + 1) included, x `safety`,
    rounded up. O(loads)."""
    longest = max((entry_rows(g) for g in step_loads), default=0)
    return math.ceil(safety * (reserve_bound(entry_per_row, longest, instances) + 1.0))


def plus_earlier_entries(price: Breakdown, extra: float, safety: float) -> Breakdown:
    """`price` with `extra` bytes of earlier waves' entries live beside the whole wave (so at
    its peak): raw bytes and the term `TERM` raised by ceil(extra), admitted bytes by that x
    `safety`, rounded up. O(terms)."""
    extra_bytes = math.ceil(extra)
    terms = dict(price.terms)
    terms[TERM] = extra_bytes
    return dataclasses.replace(price, raw_bytes=price.raw_bytes + extra_bytes, terms=terms,
                               admitted_bytes=price.admitted_bytes + math.ceil(extra_bytes * safety))
