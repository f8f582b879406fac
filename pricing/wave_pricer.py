"""A step's pricer for the search: its gradient classes, its envelope, and the exact price of
any wave (flat, or as split children) on its materialised full-sharing layout."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .envelope import Envelope, build_envelope
from .layout import layout, padded_rows
from .model import PricingModel
from .price import Breakdown, GroupLoad, price_groups
from .step import Step

# Raises a group's price to what was learned for it (see waveplan.planner.profiles); identity
# when no profile applies. Called with the group loads and the static breakdown.
Adjust = Callable[[Sequence[GroupLoad], Breakdown], Breakdown]


@dataclass
class WavePricer:
    """Prices subsets of one step. Classes are the step's distinct (slot, grad) pairs, in order
    of first appearance. `adjust` lets the planner apply learned profiles."""

    step: Step
    model: PricingModel
    adjust: Adjust | None = None
    profiled: bool = False
    class_slot: tuple[str, ...] = field(init=False)
    class_grad: tuple[bool, ...] = field(init=False)
    class_of: np.ndarray = field(init=False)
    _envelope: Envelope | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        keys: dict[tuple[str, bool], int] = {}
        class_of = np.empty(len(self.step.requests), dtype=np.int64)
        for i, request in enumerate(self.step.requests):
            self.model.slot_index(request.slot)  # unknown slot: a clear error now
            class_of[i] = keys.setdefault((request.slot, bool(request.grad)), len(keys))
        self.class_of = class_of
        self.class_slot = tuple(k[0] for k in keys)
        self.class_grad = tuple(k[1] for k in keys)

    @classmethod
    def build(cls, step: Step, model: PricingModel, **kwargs) -> WavePricer:
        return cls(step=step, model=model, **kwargs)

    @property
    def num_classes(self) -> int:
        return len(self.class_slot)

    def envelope(self) -> Envelope:
        if self._envelope is None:
            self._envelope = self._cached_envelope(lower=False)
        return self._envelope

    def _cached_envelope(self, *, lower: bool) -> Envelope:
        # an envelope depends only on the model and the class mix: share it across steps
        cache = self.model.arrays.setdefault("envelopes", {})
        key = (self.class_grad, self.class_slot, lower)
        if key not in cache:
            cache[key] = build_envelope(self.model, self.class_grad, self.class_slot, lower=lower)
        return cache[key]

    def lower_bound_waves(self, budget_bytes: float) -> int:
        """A wave count no plan can go below: for every walk point, the step's total lower-envelope
        mass (true full-sharing packed rows per class, logical rows) over the budget. O(P x K)."""
        n = len(self.step.requests)
        if n == 0:
            return 0
        lower = self._cached_envelope(lower=True)
        counts = np.zeros((self.num_classes, 3))
        for k in range(self.num_classes):
            members = np.flatnonzero(self.class_of == k)
            total = layout(self.step, members, shared=True)
            counts[k, 0], counts[k, 1] = total.packed_rows, total.logical_rows
        mass = np.einsum("pkc,kc->p", lower.coef, counts)
        return max(1, int(np.ceil(mass.max() / budget_bytes - 1e-9)))

    def group_loads(self, children: Sequence[np.ndarray]) -> list[GroupLoad]:
        """One load per (child, class): each runs as its own forward call. O(requests)."""
        multiple = self.model.parallel.row_multiple
        loads = []
        for child in children:
            child = np.asarray(child, dtype=np.int64)
            classes = self.class_of[child]
            for k in np.unique(classes):
                members = child[classes == k]
                counts = layout(self.step, members, shared=True)
                padded = padded_rows(counts.sequence_rows, multiple)
                loads.append(GroupLoad(
                    slot=self.class_slot[k], grad=self.class_grad[k],
                    packed_rows=int(counts.packed_rows), padded_rows=int(padded),
                    logical_rows=int(counts.logical_rows),
                    segments=int(counts.segments) + int(padded - counts.packed_rows)))
        return loads

    def price(self, children: Sequence[np.ndarray], *, first_slots: frozenset[str] = frozenset()) -> Breakdown:
        loads = self.group_loads(children)
        breakdown = price_groups(self.model, loads, first_slots=first_slots, profiled=self.profiled)
        if self.adjust is not None:
            breakdown = self.adjust(loads, breakdown)
        return breakdown
