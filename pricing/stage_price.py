"""Price every pipeline stage over a sequence of waves (`pipeline.stage_peaks`), from the waves'
group loads and pending-gradient slots, as `price.price_groups` prices one wave.

Complexity: O(p x W x (groups^2 + groups x L / p) + p x W x k) for W waves on p stages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .errors import ConfigError, bad
from .model import PricingModel
from .pipeline import StageParts, StagePeak, stage_parts, stage_peaks
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
    stages = model.arrays.get("stages")
    if stages is None:
        raise bad(ConfigError, "parallel.pp", model.parallel.pp, "stage prices need pp > 1")
    return stages


def _walk_groups(model, waves, profiled):
    groups, first_exec = [], []
    for loads, first_slots in waves:
        g = _group_arrays(model, loads, frozenset(first_slots))
        groups.append(g)
        first_exec.append(0.0 if profiled or not g.grad.any() else float(model.arrays["first_exec"]))
    return groups, first_exec
