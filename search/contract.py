"""The contract between the search and what it reads: the pricer, the step and the envelope.

Required of every pricer: `Pricer` (its gradient classes, its envelope, the full exact price
of a wave). Optional capabilities are small runtime-checkable protocols of their own; a
pricer offers one by having its methods in its class, and the search resolves them once per
search into a `SearchPricer` (an isinstance check on a runtime protocol costs microseconds,
as much as one fast exact price, so it is never asked per price; the answer is cached per
pricer class):
- `AdmittedPricer.admitted`: a wave's exact admitted bytes without the breakdown. A pricer
  offers it only where it is exact *and* cheaper than `price`: the planner's pricer with
  learned profiles does not (a profile prices from the full breakdown), so the search then
  keeps the full prices it computes. The search never asks why.
- `PendingPricer.pending_bytes`: an upper bound of what a slot's pending adapter gradients add
  to a wave (without it the search measures them, see `pending`).
- `BoundedPricer.lower_bound_waves`: a wave count no plan goes below under exact prices, for
  the step or a subset of its requests (without it the search keeps the envelope bound, which
  holds only for plans packed against the envelope).
- `LoadsPricer`: a wave's group loads (`group_loads`) and its full price from them
  (`price_loads`): the waves leaving the search carry their loads, computed once.
- `EarlierEntriesPricer`: a plan-level charge, what the waves run before a wave leave beside
  it (Megatron's RoPE cache); the search orders the waves, charges it and packs against a
  reserve while a wave does not fit (`earlier`).
- `StagedPricer.stages`: a pipeline-parallel model's stages (`StageView`), which the
  pipeline search packs against (`search.pipeline`); None at PP1.
`waveplan.pricing.wave_pricer.WavePricer` offers every capability. The required protocols are
runtime-checkable as well, so that a test can hold a double against them; the search never
dispatches on them.

Steps and envelopes: `SearchStep` and `SearchEnvelope` are what the search needs of any; the
real `waveplan.pricing.step.Step` and `waveplan.pricing.envelope.Envelope` give more (the
step's form and prefix tree, the parts of the segment charge), which the items use for
tighter weights when they get those types (`items`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from waveplan.pricing.price import GroupLoad


# --- what the search reads of a step and an envelope -----------------------------------------


class SearchRequest(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...


@runtime_checkable
class SearchStep(Protocol):
    """A step as every packer reads it: requests, and prefix groups as arrays. A real
    `waveplan.pricing.step.Step` also says its form and its prefix-tree order, which the items
    turn into tighter weights (`items.weight_mode`)."""

    @property
    def requests(self) -> Sequence[SearchRequest]: ...

    @property
    def group_of(self) -> np.ndarray: ...       # int64[n] prefix group of each request

    @property
    def prefix_rows(self) -> np.ndarray: ...    # int64[G] shared rows of each group

    @property
    def own_rows(self) -> np.ndarray: ...       # int64[n] rows of each request past its group


@runtime_checkable
class SearchEnvelope(Protocol):
    """Peak points, each affine in a wave's packed rows, logical rows and segments per class.
    A real `waveplan.pricing.envelope.Envelope` may also split its segment charge into its
    parts (padding row, true segment), which makes the items step-aware."""

    @property
    def const(self) -> np.ndarray: ...      # float64[P]

    @property
    def presence(self) -> np.ndarray: ...   # float64[P, K]

    @property
    def coef(self) -> np.ndarray: ...       # float64[P, K, 3]


# --- the pricer -------------------------------------------------------------------------------


class WavePrice(Protocol):
    """A wave's full exact price (`waveplan.pricing.price.Breakdown`)."""

    @property
    def raw_bytes(self) -> int: ...

    @property
    def admitted_bytes(self) -> int: ...

    @property
    def binding(self) -> str: ...

    @property
    def terms(self) -> dict[str, int]: ...

    @property
    def basis(self) -> str: ...


@runtime_checkable
class Pricer(Protocol):
    """What the search needs of every pricer. Classes are the step's (slot, grad) pairs."""

    @property
    def num_classes(self) -> int: ...

    @property
    def class_of(self) -> np.ndarray: ...          # int64[n] class of each request

    @property
    def class_slot(self) -> tuple[str, ...]: ...

    @property
    def class_grad(self) -> tuple[bool, ...]: ...

    def envelope(self) -> SearchEnvelope:
        """An upper bound of the exact price of every flat wave without pending gradients."""
        ...

    def price(self, children: Sequence[np.ndarray], *,
              first_slots: frozenset[str] = frozenset()) -> WavePrice:
        """The exact price of a wave: one array of request indices per child (one for a flat
        wave), carrying the pending adapter gradients of `first_slots`."""
        ...


@runtime_checkable
class AdmittedPricer(Protocol):
    def admitted(self, children: Sequence[np.ndarray], *,
                 first_slots: frozenset[str] = frozenset()) -> int:
        """`price(children, first_slots=...).admitted_bytes`, without the breakdown."""
        ...


@runtime_checkable
class PendingPricer(Protocol):
    def pending_bytes(self, slot: str) -> float:
        """An upper bound of what carrying `slot`'s pending adapter gradients adds to any
        wave's admitted bytes."""
        ...


@runtime_checkable
class BoundedPricer(Protocol):
    def lower_bound_waves(self, budget_bytes: float,
                          requests: np.ndarray | None = None) -> int:
        """A wave count no plan of flat waves within the budget goes below, under exact
        prices, for the whole step or for `requests`."""
        ...


@runtime_checkable
class LoadsPricer(Protocol):
    def group_loads(self, children: Sequence[np.ndarray]) -> Sequence[GroupLoad]:
        """One load per forward call of the wave (child, class)."""
        ...

    def price_loads(self, loads: Sequence[GroupLoad], *,
                    first_slots: frozenset[str] = frozenset()) -> WavePrice:
        """`price(children, ...)` of the wave whose `group_loads(children)` are `loads`."""
        ...


@runtime_checkable
class EarlierEntriesPricer(Protocol):
    """What prices the RoPE cache entries a plan's earlier waves leave (`pricing.rope_cache`):
    the search charges them in run order (`earlier`), `check_plan` re-checks them."""

    def earlier_reserve_bytes(self) -> int:
        """Admitted bytes that always cover the entries beside any wave of the step (0: its
        waves leave none, nothing to charge)."""
        ...

    def earlier_entries(self, waves: Sequence[Sequence[GroupLoad]]) -> list[float]:
        """Per wave in run order (given by its group loads), the bytes the waves before it left."""
        ...

    def plus_earlier(self, price: WavePrice, extra: float) -> WavePrice:
        """`price` with `extra` bytes of them live beside the wave."""
        ...


@runtime_checkable
class StagedPricer(Protocol):
    """A pricer of a pipeline-parallel model (PP > 1): its stages, as the pipeline search packs
    against them (`search.pipeline`)."""

    def stages(self) -> StageView | None:
        """The model's stages (None at PP1)."""
        ...


class StageView(Protocol):
    """What the pipeline search reads of a model's stages (`pricing.stage_price.StagePricer`)."""

    @property
    def num_stages(self) -> int: ...

    @property
    def safety(self) -> float: ...

    def in_flight(self, stage: int, num_waves: int) -> int: ...

    def longest_sequence(self, step) -> float: ...

    def parts(self, waves, *, max_len: float): ...

    def peaks(self, parts, budgets: Sequence[int]) -> tuple: ...

    def window_bound(self, budgets: Sequence[int]) -> int: ...


@dataclass(frozen=True, slots=True)
class SearchPricer:
    """The pricer as one search sees it: the pricer, and each optional capability it offers
    (None where it does not), resolved once. Itself a `Pricer` (it forwards the required
    members), so the search's stages take it where they take a pricer."""

    pricer: Pricer
    fast: AdmittedPricer | None = None
    pending: PendingPricer | None = None
    bounded: BoundedPricer | None = None
    loads: LoadsPricer | None = None
    earlier: EarlierEntriesPricer | None = None
    staged: StagedPricer | None = None

    @classmethod
    def of(cls, pricer: Pricer | SearchPricer) -> SearchPricer:
        """The pricer with the capabilities its class offers. O(1) after a class's first."""
        if isinstance(pricer, SearchPricer):
            return pricer
        fast, pending, bounded, loads, earlier, staged = _capabilities(type(pricer))
        return cls(pricer, fast=cast(AdmittedPricer, pricer) if fast else None,
                   pending=cast(PendingPricer, pricer) if pending else None,
                   bounded=cast(BoundedPricer, pricer) if bounded else None,
                   loads=cast(LoadsPricer, pricer) if loads else None,
                   earlier=cast(EarlierEntriesPricer, pricer) if earlier and loads else None,
                   staged=cast(StagedPricer, pricer) if staged else None)

    def stages(self) -> StageView | None:
        """The pricer's pipeline stages (`StagedPricer`), None at PP1 or without the capability."""
        return self.staged.stages() if self.staged is not None else None

    def full_prices_only(self) -> SearchPricer:
        """The same pricer seen without its fast admitted path (every exact price is full)."""
        return replace(self, fast=None)

    @property
    def num_classes(self) -> int:
        return self.pricer.num_classes

    @property
    def class_of(self) -> np.ndarray:
        return self.pricer.class_of

    @property
    def class_slot(self) -> tuple[str, ...]:
        return self.pricer.class_slot

    @property
    def class_grad(self) -> tuple[bool, ...]:
        return self.pricer.class_grad

    def envelope(self) -> SearchEnvelope:
        return self.pricer.envelope()

    def price(self, children: Sequence[np.ndarray], *,
              first_slots: frozenset[str] = frozenset()) -> WavePrice:
        return self.pricer.price(children, first_slots=first_slots)


@cache
def _capabilities(cls: type) -> tuple[bool, bool, bool, bool, bool, bool]:
    """Which optional capabilities a pricer class offers: (admitted, pending, bounded, loads,
    earlier, staged)."""
    return (issubclass(cls, AdmittedPricer), issubclass(cls, PendingPricer),
            issubclass(cls, BoundedPricer), issubclass(cls, LoadsPricer),
            issubclass(cls, EarlierEntriesPricer), issubclass(cls, StagedPricer))
