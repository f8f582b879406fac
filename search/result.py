"""What the search returns: packed waves in run order, the bound and the stats.

`SearchResult` is frozen; it knows nothing of plans or files (the planner turns it into a
plan). `WavePrice` is the pricer's exact price of the wave as it runs (children and
`first_slots` included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class EnvelopeLike(Protocol):
    const: np.ndarray      # float64[P]
    presence: np.ndarray   # float64[P, K]
    coef: np.ndarray       # float64[P, K, 3]


class WavePriceLike(Protocol):
    raw_bytes: int
    admitted_bytes: int
    binding: str
    terms: dict[str, int]
    basis: str


class Pricer(Protocol):
    """The pricer protocol the search codes against (`waveplan.pricing.wave_pricer.WavePricer`)."""

    num_classes: int
    class_of: np.ndarray
    class_slot: tuple[str, ...]
    class_grad: tuple[bool, ...]

    def envelope(self) -> EnvelopeLike: ...

    def price(self, children: Sequence[np.ndarray], *,
              first_slots: frozenset[str] = frozenset()) -> WavePriceLike: ...


@dataclass(frozen=True)
class PackedWave:
    """One wave. `children` holds one array for a flat wave, several for split children
    (sequential sub-forwards sharing one backward); request indices ascending in each.
    `first_slots`: slots whose pending adapter gradients this wave carries."""

    children: tuple[np.ndarray, ...]
    first_slots: frozenset[str]
    price: Any

    @property
    def requests(self) -> np.ndarray:
        """All request indices of the wave, ascending."""
        if len(self.children) == 1:
            return self.children[0]
        return np.sort(np.concatenate(self.children))

    @property
    def is_split(self) -> bool:
        return len(self.children) > 1


@dataclass(frozen=True)
class SearchResult:
    """Waves in run order, the lower bound on the wave count, and whether the plan meets it."""

    waves: tuple[PackedWave, ...]
    lower_bound_waves: int
    proven_optimal: bool
    packer: str
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def num_waves(self) -> int:
        return len(self.waves)
