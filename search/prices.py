"""Exact prices inside the search: admitted bytes only, the full breakdown at the end.

The search prices many candidate waves exactly (re-pricing, repair, merging, the ladder, the
pending-gradient order) but only compares their admitted bytes with the budget. A pricer that
offers the `AdmittedPricer` capability (`WavePricer`: one jitted call, no breakdown) answers
those; the waves that leave the search are priced in full once (`reprice.finalise`). Any
other pricer is asked for its full price, which is kept. Whether a pricer offers the fast
path is the pricer's decision (see `contract`), resolved once per search.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .contract import SearchPricer, WavePrice


@dataclass(frozen=True, slots=True)
class Admitted:
    """An exact price known by its admitted bytes only; replaced by the full price before
    the wave leaves the search."""

    admitted_bytes: int


def exact_price(pricer: SearchPricer, parts: Sequence[np.ndarray],
                first_slots: frozenset[str] = frozenset()) -> Admitted | WavePrice:
    """The exact price of a wave: an `Admitted` from the pricer's fast `admitted` path when it
    offers one, else the full `pricer.price`."""
    if pricer.fast is None:
        return pricer.price(parts, first_slots=first_slots)
    return Admitted(int(pricer.fast.admitted(parts, first_slots=first_slots)))
