"""What one rank's memory model charges, typed: the walk's charges (per layer, per slot, the
head's), the head's parts and the forward parts calibration reads, and under PP > 1 each
stage's charges (docs/memory-model.md#schedule).

Built once per model (`PricingModel.charges`); nothing is cached in it and nothing overwrites
it: under PP > 1 `walk` is the folded per-wave proxy and `layers` the unfolded layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .pipeline import StageCharges
from .walk import WalkCharges


@dataclass(frozen=True)
class HeadParts:
    """The head's and the final norm's charges before they are combined (bytes per row)."""

    logits_retained: float
    """What the loss keeps of the logits for the backward."""
    logits_transient: float
    """The logits' backward transient."""
    norm_saved: float
    """The final norm's saved input."""
    norm_backward: float
    """The final norm's backward transient."""
    layout_residual: float
    """The layout residual and the CP RoPE cache beside the head's backward (full recompute)."""
    logits_at_norm: float
    """The logits still charged at the final norm's backward (0 once released)."""


@dataclass(frozen=True)
class ForwardParts:
    """Per layer (bytes per row), before the walk's no-grad transient takes the larger."""

    nograd: np.ndarray
    """The no-grad forward transient."""
    retained_forward: np.ndarray
    """A retained layer's own forward peak (0 under full recompute)."""


@dataclass(frozen=True, kw_only=True)
class Charges:
    """One rank's charges (`PricingModel.charges`)."""

    walk: WalkCharges
    """What the jitted walk charges a wave (PP > 1: the folded per-wave proxy, `fold_stages`)."""
    head: HeadParts
    """The head's parts (calibration reads them)."""
    forward: ForwardParts
    """The forward parts (calibration reads them)."""
    first_exec: float
    """The first execution's bytes (a gradient wave of a process's first step)."""
    resident: float = 0.0
    """Constant bytes every point of a wave holds above rest: FSDP2's gathered parameters and
    gradient buffers (`fsdp.model`); 0 under Megatron-core."""
    start: float = 0.0
    """Constant bytes of the forward's start, a point before any layer runs: FSDP2's first
    all-gathers, the root's and the first layer's flat outputs beside their unsharded
    parameters (`fsdp.model`, docs/memory-model.md#fsdp-forward-start); 0: no such point
    (Megatron-core). A wave's price is at least start + start_row x rank rows + the caller's."""
    start_row: float = 0.0
    """Bytes per rank row at the forward's start (`start`): the embedding output, the rotary
    tables and a packed-row mask."""
    layers: WalkCharges | None = None
    """PP > 1: every layer's charges, unfolded (None at PP1)."""
    stages: tuple[StageCharges, ...] | None = None
    """PP > 1: each stage's charges (None at PP1)."""
