"""What the search returns: packed waves in run order, the bound and the stats.

`SearchResult` is frozen; it knows nothing of plans or files (the planner wraps each
`PackedWave` in a plan wave). A wave's `price` is the pricer's full exact price of the wave as
it runs (children and `first_slots` included); its `loads` are the group loads that price was
computed from, when the pricer offers them (`contract.LoadsPricer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .contract import WavePrice

if TYPE_CHECKING:
    from waveplan.pricing.price import GroupLoad


@dataclass(frozen=True)
class PackedWave:
    """One wave. `children` holds one array for a flat wave, several for split children
    (sequential sub-forwards sharing one backward); request indices ascending in each.
    `first_slots`: slots whose pending adapter gradients this wave carries. `loads`: one
    group load per (child, class) forward call, or None when the pricer does not give them."""

    children: tuple[np.ndarray, ...]
    first_slots: frozenset[str]
    price: WavePrice
    loads: tuple[GroupLoad, ...] | None = field(default=None, repr=False)

    @property
    def requests(self) -> np.ndarray:
        """All request indices of the wave, ascending."""
        if len(self.children) == 1:
            return self.children[0]
        return np.sort(np.concatenate(self.children))

    @property
    def is_split(self) -> bool:
        return len(self.children) > 1


class Wave(Protocol):
    """What a checker reads of a wave: a `PackedWave`, or a planner's plan wave around one."""

    @property
    def children(self) -> tuple[np.ndarray, ...]: ...

    @property
    def first_slots(self) -> frozenset[str]: ...

    @property
    def price(self) -> WavePrice: ...

    @property
    def loads(self) -> Sequence[GroupLoad] | None: ...


class Waves(Protocol):
    """What a checker reads of a result: a `SearchResult`, or a planner's plan."""

    @property
    def waves(self) -> Sequence[Wave]: ...

    @property
    def lower_bound_waves(self) -> int: ...

    @property
    def proven_optimal(self) -> bool: ...


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
