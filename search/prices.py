"""Exact prices inside the search: admitted bytes only, the full breakdown at the end.

The search prices many candidate waves exactly (re-pricing, repair, merging, the ladder, the
pending-gradient order) but only compares their admitted bytes with the budget. A pricer that
offers `admitted(children, first_slots=...)` (`WavePricer`: one jitted call, no breakdown)
answers those; the waves that leave the search are priced in full once
(`reprice.finalise`). Any other pricer is asked for its full price, which is kept.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Admitted:
    """An exact price known by its admitted bytes only; replaced by the full price before
    the wave leaves the search."""

    admitted_bytes: int


def exact_price(pricer, parts, first_slots: frozenset[str] = frozenset()):
    """The exact price of a wave: an `Admitted` from the pricer's fast `admitted` path when it
    has one, else the full `pricer.price`."""
    fast = getattr(pricer, "admitted", None)
    if fast is None or getattr(pricer, "adjust", None) is not None:   # profiles: full anyway
        return pricer.price(parts, first_slots=first_slots)
    return Admitted(int(fast(parts, first_slots=first_slots)))
