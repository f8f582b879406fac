"""Price one wave: group loads in, raw and admitted bytes with their breakdown out."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError, bad
from .geometry import MixerKind
from .model import PricingModel
from .walk import (
    LAYER_BACKWARD,
    PEAK_BYTES,
    PEAK_LAYER,
    PEAK_POINT,
    POINT_BACKWARD,
    POINT_HEAD_BACKWARD,
    POINT_HEAD_FORWARD,
    POINT_NAMES,
    POINT_NOGRAD_FORWARD,
    TERM_NAMES,
    WalkGroups,
    walk,
)


@dataclass(frozen=True, kw_only=True)
class GroupLoad:
    """One forward call of a wave: the requests of one (slot, grad) class, or one split child.

    `padded_rows` are the packed rows after each packed sequence is padded to the layout's row
    multiple; `segments`: tree nodes plus one root per padding row (docs/memory-model.md#layouts).
    `longest_rows`: the padded rows of the call's longest packed sequence (what the RoPE cache
    entry holds under CP, docs/memory-model.md#cp-rope-cache); None when unknown: priced as if
    the call were one sequence (the bound).
    """

    slot: str = "default"
    grad: bool = True
    packed_rows: int
    padded_rows: int
    logical_rows: int
    segments: int
    longest_rows: int | None = None

    def __post_init__(self) -> None:
        for name in ("packed_rows", "padded_rows", "logical_rows", "segments"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
                raise bad(ConfigError, f"group.{name}", value, "must be an integer >= 0")
        if self.padded_rows < self.packed_rows:
            raise bad(ConfigError, "group.padded_rows", self.padded_rows,
                      f"must be >= packed_rows={self.packed_rows}")
        longest = self.longest_rows
        if longest is not None and (isinstance(longest, bool) or not isinstance(longest, int | np.integer)
                                    or not 0 <= longest <= self.padded_rows):
            raise bad(ConfigError, "group.longest_rows", longest,
                      f"must be an integer in [0, padded_rows={self.padded_rows}] or null")


@dataclass(frozen=True)
class Breakdown:
    raw_bytes: int
    admitted_bytes: int
    terms: dict[str, int]
    binding: str
    basis: str
    reasons: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"raw_bytes": self.raw_bytes, "admitted_bytes": self.admitted_bytes,
                "terms": dict(self.terms), "binding": self.binding, "basis": self.basis,
                "reasons": list(self.reasons)}


def rank_rows(model: PricingModel, padded_rows: int) -> int:
    """Gathered rows on the busiest context-parallel rank.

    Megatron's load-balanced split pads each sequence to 2*CP chunks and gives rank r chunks r
    and 2*CP-1-r, so every rank holds padded/CP rows. A conservative model charges every rank
    the whole wave (docs/memory-model.md#layouts: dividing holds only on the traced layouts).
    """
    return -(-padded_rows // model.rows_cp)


def _group_arrays(model: PricingModel, groups: Sequence[GroupLoad],
                  first_slots: frozenset[str]) -> WalkGroups:
    """The walk's view of the groups: rank rows, logical rows, segments, grad, slot index,
    whether each carries its slot's pending gradients, and its longest sequence. O(groups)."""
    n = len(groups)
    rows = np.empty(n)
    logical = np.empty(n)
    segments = np.empty(n)
    grad = np.empty(n, dtype=np.bool_)
    slot = np.empty(n, dtype=np.int64)
    carries = np.empty(n, dtype=np.bool_)
    longest = np.empty(n)
    for k, group in enumerate(groups):
        rows[k] = rank_rows(model, int(group.padded_rows))
        # unknown: the whole call as one sequence (CP x its rank rows: no RoPE credit)
        longest[k] = rows[k] * model.rows_cp if group.longest_rows is None else group.longest_rows
        logical[k] = group.logical_rows
        segments[k] = group.segments
        grad[k] = group.grad
        slot[k] = model.slot_index(group.slot)
        carries[k] = group.grad and group.slot in first_slots
    return WalkGroups(rows, logical, segments, grad, slot, carries, longest)


def price_groups(model: PricingModel, groups: Sequence[GroupLoad], *,
                 first_slots: frozenset[str] = frozenset(), profiled: bool = False) -> Breakdown:
    """Price one wave whose forward calls are `groups` (classes, or split children).

    `first_slots`: slots whose pending adapter gradients this wave allocates (its first gradient
    wave in the step, docs/memory-model.md#pending-gradients). `profiled`: a profile exists, so the first-execution
    allowance is not charged. Complexity O(groups^2 + groups x layers), jitted.
    """
    for name in first_slots:
        model.slot_index(name)
    walk_groups = _group_arrays(model, groups, first_slots)
    first_exec = 0.0 if profiled or not walk_groups.grad.any() else model.charges.first_exec
    # constant bytes every point holds (FSDP2's gathered parameters, `fsdp.model`), carried by
    # the walk beside the first-execution allowance and reported under their own name
    resident = float(model.charges.resident) if walk_groups.rows.size else 0.0
    best, values = walk(model.charges.walk, first_exec + resident, walk_groups)
    raw = int(math.ceil(best[PEAK_BYTES]))
    code, layer = int(best[PEAK_POINT]), int(best[PEAK_LAYER])
    terms = {name: int(math.ceil(v)) for name, v in zip(TERM_NAMES, values, strict=True)}
    start = forward_start(model, walk_groups)
    if start > best[PEAK_BYTES]:
        # FSDP2's first all-gathers bind before any layer runs (`Charges.start`)
        raw = int(math.ceil(start))
        caller = model.charges.walk.caller * float(walk_groups.logical.sum())
        terms = dict.fromkeys(TERM_NAMES, 0)
        terms["caller"] = int(math.ceil(caller))
        terms["retained"] = int(math.ceil(model.charges.start_row * float(walk_groups.rows.sum())))
        terms["gathered_parameters"] = int(math.ceil(model.charges.start))
        return Breakdown(raw_bytes=raw, admitted_bytes=int(math.ceil(raw * model.safety)),
                         terms=terms, binding="forward-start", basis=model.basis,
                         reasons=model.reasons)
    if resident:
        # at the head's points the head constant takes back the layers FSDP has resharded there
        held = resident + (model.charges.walk.head_const if code in (POINT_HEAD_FORWARD, POINT_HEAD_BACKWARD,
                                                       POINT_NOGRAD_FORWARD) else 0.0)
        mlp = model.charges.walk.mlp_points
        if code == POINT_BACKWARD and mlp.shape[1]:   # a layer's own gathered-parameter bytes
            step = float(mlp[LAYER_BACKWARD, layer])
            held += step
            terms["workspace"] = int(math.ceil(values[TERM_NAMES.index("workspace")] - step))
        terms["first_execution"] = int(math.ceil(values[TERM_NAMES.index("first_execution")] - resident))
        terms["head"] = int(math.ceil(values[TERM_NAMES.index("head")] - (held - resident)))
        terms["gathered_parameters"] = int(math.ceil(held))
    return Breakdown(
        raw_bytes=raw,
        admitted_bytes=int(math.ceil(raw * model.safety)),
        terms=terms,
        binding=_binding_name(model, code, layer),
        basis=model.basis,
        reasons=model.reasons,
    )


def forward_start(model: PricingModel, groups: WalkGroups) -> float:
    """The forward's start (`Charges.start`): its constant, its bytes per rank row and the
    caller's; 0 where the model has no such point (Megatron-core) or the wave is empty. O(groups)."""
    c = model.charges
    if not c.start or not groups.rows.size:
        return 0.0
    return (float(c.start) + float(c.start_row) * float(groups.rows.sum())
            + c.walk.caller * float(groups.logical.sum()))


def _binding_name(model: PricingModel, code: int, layer: int) -> str:
    name = POINT_NAMES[code]
    if layer >= 0:
        kind = model.geometry.layers[layer]
        mixer = "attention" if kind.mixer == MixerKind.ATTENTION else "gdn"
        return f"{name}:layer{layer}:{mixer}/{kind.mlp.value}"
    return name
