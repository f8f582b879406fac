"""A plan: the waves of one step in run order, each with its exact priced breakdown.

`Plan.to_dict()` is the stable, documented form (schema 1); `to_json()` sorts keys so that the
same inputs give byte-identical JSON except the timings `planning_ms` and `compile_ms` (the
latter present only when the plan compiled kernels: the first plan of a cold process).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from waveplan.pricing.price import Breakdown, GroupLoad
from waveplan.search import PackedWave

from .profiles import Profile, Signature, Size

PLAN_SCHEMA = 1


@dataclass(frozen=True)
class PlanWave:
    """One wave as it runs: the search's `PackedWave` (children as request indices, one array
    for a flat wave; first_slots; the priced breakdown; the group loads) with its place in the
    plan, its request ids, and what `Planner.observe` learns from (`loads`, `signature`,
    `static_raw_bytes`) and the profile it was priced with (`profile`: the signature's at plan
    time, None without one; a miss record keeps it)."""

    index: int
    wave: PackedWave = field(repr=False)
    request_ids: tuple[str, ...]
    child_ids: tuple[tuple[str, ...], ...]
    budget_bytes: int
    signature: Signature = field(repr=False)
    static_raw_bytes: int = field(repr=False)
    profile: Profile | None = field(default=None, repr=False, compare=False)
    # (packed rows, causal attention pairs): what `Planner.observe(seconds=...)` learns from
    work: tuple[int, int] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, index: int, wave: PackedWave, ids: tuple[str, ...], *, budget_bytes: int,
           signature: Signature, static_raw_bytes: int, profile: Profile | None = None,
           work: tuple[int, int] | None = None) -> PlanWave:
        """The plan wave around `wave`; `ids` are the step's request ids. O(requests)."""
        return cls(index=index, wave=wave,
                   request_ids=tuple(ids[j] for j in wave.requests),
                   child_ids=tuple(tuple(ids[j] for j in c) for c in wave.children),
                   budget_bytes=budget_bytes, signature=signature,
                   static_raw_bytes=static_raw_bytes, profile=profile, work=work)

    @property
    def children(self) -> tuple[np.ndarray, ...]:
        return self.wave.children

    @property
    def first_slots(self) -> frozenset[str]:
        return self.wave.first_slots

    @property
    def breakdown(self) -> Breakdown:
        return self.wave.price

    @property
    def basis(self) -> str:
        """The price's basis (evidence, conservative, assumed, profile), as the JSON's `basis`."""
        return self.wave.price.basis

    @property
    def price(self) -> Breakdown:
        """The breakdown, by the name `PackedWave` gives it (so `check_plan` reads a plan)."""
        return self.wave.price

    @property
    def loads(self) -> tuple[GroupLoad, ...]:
        return self.wave.loads

    @property
    def is_split(self) -> bool:
        return self.wave.is_split

    @property
    def request_indices(self) -> tuple[int, ...]:
        """Positions in the step of the wave's requests, ascending (aligned with
        `request_ids`): the wave's micro-batch index list."""
        return tuple(int(j) for j in np.sort(np.concatenate(self.children)))

    @property
    def child_indices(self) -> tuple[tuple[int, ...], ...]:
        """Positions in the step of each child's requests (aligned with `child_ids`)."""
        return tuple(tuple(int(j) for j in c) for c in self.children)

    @property
    def size(self) -> Size:
        return Size.of(self.loads)

    @property
    def raw_bytes(self) -> int:
        return self.breakdown.raw_bytes

    @property
    def admitted_bytes(self) -> int:
        return self.breakdown.admitted_bytes

    def to_dict(self) -> dict:
        size = self.size
        b = self.breakdown
        return {
            "index": self.index, "requests": list(self.request_ids),
            "packed_tokens": size.packed_rows, "logical_tokens": size.logical_rows,
            "segments": size.segments, "raw_bytes": int(b.raw_bytes),
            "admitted_bytes": int(b.admitted_bytes), "budget_bytes": int(self.budget_bytes),
            "binding": b.binding, "basis": b.basis, "first_slots": sorted(self.first_slots),
            "terms": {k: int(v) for k, v in b.terms.items()},
            "children": [list(c) for c in self.child_ids] if self.is_split else [],
            "request_indices": list(self.request_indices),
            "child_indices": [list(c) for c in self.child_indices] if self.is_split else [],
        }


@dataclass(frozen=True)
class Plan:
    """Waves in run order, the lower bound on their count and whether the plan meets it."""

    waves: tuple[PlanWave, ...]
    packer: str
    planning_ms: float
    lower_bound_waves: int
    proven_optimal: bool
    budget_bytes: int
    stats: dict = field(default_factory=dict, compare=False, repr=False)
    # ms this plan spent compiling kernels (the first plan of a cold process; 0 once warm):
    # timing like planning_ms, in the JSON only when > 0
    compile_ms: float = field(default=0.0, compare=False)

    @property
    def num_waves(self) -> int:
        return len(self.waves)

    def __len__(self) -> int:
        return len(self.waves)

    def __iter__(self):
        return iter(self.waves)

    def __getitem__(self, i: int) -> PlanWave:
        return self.waves[i]

    @property
    def stages(self) -> list[dict]:
        """One entry per pipeline stage (PP > 1; empty otherwise): its layers, waves in flight,
        `peak_bytes` (the priced peak over the schedule), the binding `window` of waves and
        its budget (`waveplan.pricing.pipeline.StagePeak`)."""
        return list(self.stats.get("stages", ()))

    def to_dict(self) -> dict:
        out = {"schema": PLAN_SCHEMA, "packer": self.packer,
               "planning_ms": round(float(self.planning_ms), 3),
               "lower_bound_waves": int(self.lower_bound_waves),
               "proven_optimal": bool(self.proven_optimal),
               "waves": [w.to_dict() for w in self.waves]}
        if self.stages:
            out["stages"] = self.stages
        if self.compile_ms > 0:   # timing, like planning_ms: ignored where plans are compared
            out["compile_ms"] = round(float(self.compile_ms), 3)
        return out

    def to_json(self, *, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=indent)
