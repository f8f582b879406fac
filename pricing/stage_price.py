"""Price every pipeline stage over a sequence of waves (`pipeline.stage_peaks`), from the waves'
group loads and pending-gradient slots, as `price.price_groups` prices one wave.

Complexity: O(p x W x (groups^2 + groups x L / p) + p x W x k) for W waves on p stages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import ConfigError, bad
from .model import PricingModel
from .pipeline import (
    StageParts,
    StagePeak,
    in_flight,
    peaks_from_parts,
    stage_parts,
    stage_peaks,
    window_lower_bound,
)
from .price import GroupLoad, _group_arrays


def price_stages(model: PricingModel, waves: Sequence[tuple[Sequence[GroupLoad], frozenset[str]]],
                 budgets: Sequence[int], *, profiled: bool = False,
                 max_len: float = math.inf) -> tuple[StagePeak, ...]:
    """Each stage's peak when `waves` (each: its group loads and `first_slots`) run in this
    order through the 1F1B schedule, against its budget (`budgets`: one per stage). The model
    must have PP > 1. `profiled`: no first-execution allowance (as `price_groups`);
    `max_len`: the step's longest packed sequence (bounds each wave's RoPE cache entry)."""
    stages = _stages(model)
    if stages is None:
        raise bad(ConfigError, "parallel.pp", model.parallel.pp, "stage prices need pp > 1")
    if len(budgets) != len(stages):
        raise bad(ConfigError, "budgets", list(budgets), f"needs one budget per stage ({len(stages)})")
    return stage_peaks(stages, *_walk_groups(model, waves, profiled), budgets, model.safety,
                       max_len)


def price_parts(model: PricingModel, waves: Sequence[tuple[Sequence[GroupLoad], frozenset[str]]],
                *, profiled: bool = False, max_len: float = math.inf) -> StageParts:
    """`pipeline.stage_parts` of the waves (`StageParts`: [p, W] arrays), raw bytes, order-free."""
    return stage_parts(_stages(model), *_walk_groups(model, waves, profiled), max_len)


def _stages(model: PricingModel):
    stages = model.charges.stages
    if stages is None:
        raise bad(ConfigError, "parallel.pp", model.parallel.pp, "stage prices need pp > 1")
    return stages


def _walk_groups(model, waves, profiled):
    groups, first_exec = [], []
    for loads, first_slots in waves:
        g = _group_arrays(model, loads, frozenset(first_slots))
        groups.append(g)
        first_exec.append(0.0 if profiled or not g.grad.any() else float(model.charges.first_exec))
    return groups, first_exec


@dataclass(frozen=True)
class StagePricer:
    """A PP > 1 model's stages as the pipeline search reads them (the contract's
    `StagedPricer.stages()`): order-free stage parts of packed waves, their peaks in an order,
    the window bound (docs/memory-model.md#pipeline)."""

    model: PricingModel
    """The pricing model (PP > 1)."""
    grad_rows: float
    """The step's gradient rows per rank (full-sharing packed rows / CP): the window bound's M."""

    @property
    def num_stages(self) -> int:
        """p, the pipeline stages."""
        return self.model.parallel.pp

    @property
    def safety(self) -> float:
        """admitted = raw x safety."""
        return self.model.safety

    def in_flight(self, stage: int, num_waves: int) -> int:
        """Waves stage `stage` holds at once (`pipeline.in_flight`)."""
        return in_flight(self.num_stages, stage, num_waves)

    def longest_sequence(self, step) -> float:
        """The step's longest request in packed rows, padded to the layout's row multiple (a
        bound of every wave's longest sequence). O(requests)."""
        m = self.model.parallel.row_multiple
        longest = max((int(r.num_tokens) for r in step.requests), default=0)
        return float(-(-longest // m) * m)

    def parts(self, waves: Sequence[tuple[Sequence[GroupLoad], frozenset[str]]], *,
              max_len: float = math.inf) -> StageParts:
        """`price_parts` of the waves (each: its group loads and `first_slots`)."""
        return price_parts(self.model, waves, max_len=max_len)

    def peaks(self, parts: StageParts, budgets: Sequence[int]) -> tuple[StagePeak, ...]:
        """Every stage's peak over `parts`' waves in column order (`pipeline.peaks_from_parts`)."""
        return peaks_from_parts(_stages(self.model), parts, budgets, self.safety)

    def window_bound(self, budgets: Sequence[int]) -> int:
        """The window lower bound over all stages (`pipeline.window_lower_bound`). O(p x K)."""
        return max(window_lower_bound(self.grad_rows, st, budgets[st.stage], self.safety)
                   for st in _stages(self.model))
