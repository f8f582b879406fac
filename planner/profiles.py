"""Learning from observed peaks: one profile per memory signature, applied through the
`WavePricer.adjust` hook.

A **signature** is what makes two waves comparable: the model geometry's name, the parallel
layout, the recompute setting, the LoRA slot ranks, the head, the coefficient backend, and the
wave's (slot, grad) mix. Each observation keeps the wave's group loads, its static raw price
(without the first-execution allowance: once a signature has run, the allocator is warm) and
the observed peak.

Pricing with a profile (docs/memory-model.md#learned-profiles: profiles are priced by
packed tokens, not by sharing ratio): the learned raw is the static raw x r, where r is the
largest observed/static ratio of the signature. The static model already scales with packed
rows, logical rows and segments, so a profile learned without sharing never prices a shared
wave by its logical tokens (the old rule `bytes_per_token x max(packed, logical / ratio)` did,
56.3 GiB predicted against 6.9 GiB observed).

* r > 1 always applies: the model under-priced, so every wave of the signature is raised.
* r < 1 tightens only inside the trust window: padded rows <= 8x the largest observed and
  sharing (logical / packed) <= 8x the largest observed sharing; outside, the static price
  stands (sharing is extrapolated at most 8x beyond what the profile observed).
* Never below the largest peak observed at equal or smaller size (packed rows, logical rows
  and segments all <=).

Profiles persist as `{"schema": 1, "profiles": [...]}`, written atomically.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from waveplan.pricing.errors import ConfigError, bad
from waveplan.pricing.kernel_set import Framework
from waveplan.pricing.model import PricingModel
from waveplan.pricing.price import Breakdown, GroupLoad
from waveplan.pricing.rope_cache import TERM
from waveplan.pricing.tolerances import ROUNDTRIP_REL_EPS

PROFILE_SCHEMA = 1
TRUST_FACTOR = 8  # at most 8x beyond what a profile observed (docs/memory-model.md#learned-profiles)
_LOAD_FIELDS = ("slot", "grad", "packed_rows", "padded_rows", "logical_rows", "segments")
# written only when known (`GroupLoad.longest_rows`; a load read without it is priced at the bound)
_LOAD_OPTIONAL = ("longest_rows",)


# --- signatures -------------------------------------------------------------------------


@dataclass(frozen=True)
class Signature:
    """What makes two waves' peaks comparable. `config` is the model part (canonical JSON),
    `mix` the wave's distinct (slot, grad) pairs, sorted."""

    config: str
    mix: tuple[tuple[str, bool], ...]

    def to_dict(self) -> dict:
        return {"config": json.loads(self.config), "mix": [[s, g] for s, g in self.mix]}

    @classmethod
    def from_dict(cls, data: object, where: str) -> Signature:
        if not isinstance(data, dict) or not isinstance(data.get("config"), dict) \
                or not isinstance(data.get("mix"), list):
            raise bad(ConfigError, f"{where}.signature", data, "needs a 'config' object and a 'mix' list")
        mix = []
        for pair in data["mix"]:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
                    and isinstance(pair[1], bool)):
                raise bad(ConfigError, f"{where}.signature.mix", pair, "must be [slot, grad]")
            mix.append((pair[0], pair[1]))
        return cls(config=config_key_from_dict(data["config"]), mix=tuple(sorted(set(mix))))


def config_dict(model: PricingModel) -> dict:
    """The model part of a signature: what changes memory per row but not the wave."""
    return {"model": model.geometry.name, "parallel": model.parallel.to_dict(),
            "recompute": model.recompute.to_dict(),
            "lora": {s.name: s.rank for s in model.lora.slots},
            "head": model.head, "backend": model.table.backend,
            **({"fsdp": model.fsdp_layout.to_dict()} if model.framework is Framework.FSDP else {})}


def config_key_from_dict(data: dict) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def config_key(model: PricingModel) -> str:
    return config_key_from_dict(config_dict(model))


def wave_mix(loads: Sequence[GroupLoad]) -> tuple[tuple[str, bool], ...]:
    return tuple(sorted({(g.slot, bool(g.grad)) for g in loads}))


# --- observations and profiles ----------------------------------------------------------


@dataclass(frozen=True)
class Size:
    """A wave's totals over its forward calls (children and classes)."""

    packed_rows: int
    padded_rows: int
    logical_rows: int
    segments: int

    @classmethod
    def of(cls, loads: Sequence[GroupLoad]) -> Size:
        return cls(packed_rows=sum(int(g.packed_rows) for g in loads),
                   padded_rows=sum(int(g.padded_rows) for g in loads),
                   logical_rows=sum(int(g.logical_rows) for g in loads),
                   segments=sum(int(g.segments) for g in loads))

    @property
    def sharing(self) -> float:
        """Logical rows per packed row (1.0 without sharing)."""
        return self.logical_rows / self.packed_rows if self.packed_rows else 1.0

    def within(self, other: Size) -> bool:
        """Equal or smaller in packed rows, logical rows and segments."""
        return (self.packed_rows <= other.packed_rows and self.logical_rows <= other.logical_rows
                and self.segments <= other.segments)


@dataclass(frozen=True)
class Observation:
    loads: tuple[GroupLoad, ...]
    static_raw_bytes: int
    peak_bytes: int

    @property
    def size(self) -> Size:
        return Size.of(self.loads)

    @property
    def ratio(self) -> float:
        return self.peak_bytes / self.static_raw_bytes

    def to_dict(self) -> dict:
        return {"loads": [_load_to_dict(g) for g in self.loads],
                "static_raw_bytes": self.static_raw_bytes, "peak_bytes": self.peak_bytes}


@dataclass(frozen=True)
class Profile:
    """What was learned for one signature. `observations` keeps only the peaks that can still
    set a floor (one observed at equal or smaller size with a peak at least as high makes
    another redundant); the aggregates cover every observation ever made."""

    signature: Signature
    ratio: float
    max_padded_rows: int
    max_sharing: float
    count: int
    observations: tuple[Observation, ...]

    def add(self, obs: Observation) -> Profile:
        size = obs.size
        kept = [o for o in self.observations
                if not (size.within(o.size) and obs.peak_bytes >= o.peak_bytes)]
        if not any(o.size.within(size) and o.peak_bytes >= obs.peak_bytes for o in kept):
            kept.append(obs)
        return replace(self, ratio=max(self.ratio, obs.ratio),
                       max_padded_rows=max(self.max_padded_rows, size.padded_rows),
                       max_sharing=max(self.max_sharing, size.sharing), count=self.count + 1,
                       observations=tuple(kept))

    @classmethod
    def first(cls, signature: Signature, obs: Observation) -> Profile:
        size = obs.size
        return cls(signature=signature, ratio=obs.ratio, max_padded_rows=size.padded_rows,
                   max_sharing=size.sharing, count=1, observations=(obs,))

    def floor(self, size: Size) -> int:
        """Largest peak observed at equal or smaller size (0 if none). O(observations)."""
        return max((o.peak_bytes for o in self.observations if o.size.within(size)), default=0)

    def in_trust_window(self, size: Size) -> bool:
        return (size.padded_rows <= TRUST_FACTOR * self.max_padded_rows
                and size.sharing <= TRUST_FACTOR * self.max_sharing)

    def learned_raw(self, static_raw: int, size: Size) -> tuple[int, str]:
        """(learned raw bytes, why) for a wave of this signature whose static raw price
        (without the first-execution allowance) is `static_raw`."""
        if self.ratio > 1.0:
            raw, why = math.ceil(static_raw * self.ratio), f"raised x{self.ratio:.4f}"
        elif self.in_trust_window(size):
            raw, why = math.ceil(static_raw * self.ratio), f"tightened x{self.ratio:.4f}"
        else:
            raw, why = static_raw, "outside the trust window: static price"
        floor = self.floor(size)
        if floor > raw:
            raw, why = floor, f"{why}; floored at a peak seen at equal or smaller size"
        return raw, why

    def to_dict(self) -> dict:
        return {"signature": self.signature.to_dict(), "ratio": self.ratio,
                "max_padded_rows": self.max_padded_rows, "max_sharing": self.max_sharing,
                "count": self.count, "observations": [o.to_dict() for o in self.observations]}


# --- the store --------------------------------------------------------------------------


class ProfileStore:
    """All profiles, keyed by signature. Mutable: `observe` adds to it."""

    def __init__(self, profiles: Iterable[Profile] = ()) -> None:
        self._profiles: dict[Signature, Profile] = {}
        for profile in profiles:
            self._profiles[profile.signature] = profile

    def __len__(self) -> int:
        return len(self._profiles)

    def __iter__(self):
        return iter(self.profiles())

    def profiles(self) -> list[Profile]:
        """Profiles in a stable order (by signature)."""
        return [self._profiles[k] for k in sorted(self._profiles, key=lambda s: (s.config, s.mix))]

    def get(self, signature: Signature) -> Profile | None:
        return self._profiles.get(signature)

    def observe(self, signature: Signature, loads: Sequence[GroupLoad], *, static_raw_bytes: int,
                peak_bytes: int) -> Profile:
        if static_raw_bytes <= 0:
            raise bad(ConfigError, "static_raw_bytes", static_raw_bytes, "must be > 0")
        obs = Observation(loads=tuple(loads), static_raw_bytes=int(static_raw_bytes),
                          peak_bytes=int(peak_bytes))
        old = self._profiles.get(signature)
        profile = Profile.first(signature, obs) if old is None else old.add(obs)
        self._profiles[signature] = profile
        return profile

    def max_ratio(self, config: str) -> float:
        """Largest ratio over the profiles of one model configuration (1.0 if none)."""
        return max((p.ratio for s, p in self._profiles.items() if s.config == config), default=1.0)

    def to_dict(self) -> dict:
        return {"schema": PROFILE_SCHEMA, "profiles": [p.to_dict() for p in self.profiles()]}

    @classmethod
    def from_dict(cls, data: object, *, where: str = "profiles") -> ProfileStore:
        """Validate and load; every problem is a ConfigError naming `where` and the field."""
        if not isinstance(data, dict):
            raise bad(ConfigError, where, type(data).__name__, "must be a JSON object")
        if data.get("schema") != PROFILE_SCHEMA:
            raise bad(ConfigError, f"{where}.schema", data.get("schema"),
                      f"unsupported profile schema (expected {PROFILE_SCHEMA})")
        entries = data.get("profiles")
        if not isinstance(entries, list):
            raise bad(ConfigError, f"{where}.profiles", entries, "must be a list")
        return cls(_profile_from_dict(e, f"{where}.profiles[{i}]") for i, e in enumerate(entries))


def _number(where: str, value: object, *, integer: bool, positive: bool = True) -> float | int:
    ok = not isinstance(value, bool) and isinstance(value, int if integer else int | float)
    if not ok or not math.isfinite(value) or (value <= 0 if positive else value < 0):
        raise bad(ConfigError, where, value,
                  f"must be a finite {'integer' if integer else 'number'} {'> 0' if positive else '>= 0'}")
    return value


def _load_to_dict(load: GroupLoad) -> dict:
    out = {f: getattr(load, f) for f in _LOAD_FIELDS}
    out.update({f: getattr(load, f) for f in _LOAD_OPTIONAL if getattr(load, f) is not None})
    return out


def _load_from_dict(data: object, where: str) -> GroupLoad:
    if not isinstance(data, dict) or not set(_LOAD_FIELDS) <= set(data) <= set(_LOAD_FIELDS + _LOAD_OPTIONAL):
        raise bad(ConfigError, where, data, f"must have exactly the fields {', '.join(_LOAD_FIELDS)}"
                  f" (and optionally {', '.join(_LOAD_OPTIONAL)})")
    if not isinstance(data["slot"], str) or not isinstance(data["grad"], bool):
        raise bad(ConfigError, where, data, "slot must be a string and grad a boolean")
    for name in _LOAD_FIELDS[2:] + tuple(f for f in _LOAD_OPTIONAL if f in data):
        _number(f"{where}.{name}", data[name], integer=True, positive=False)
    return GroupLoad(**data)


def _profile_from_dict(data: object, where: str) -> Profile:
    if not isinstance(data, dict):
        raise bad(ConfigError, where, type(data).__name__, "must be a JSON object")
    signature = Signature.from_dict(data.get("signature"), where)
    observations = data.get("observations")
    if not isinstance(observations, list) or not observations:
        raise bad(ConfigError, f"{where}.observations", observations, "must be a non-empty list")
    obs = []
    for i, o in enumerate(observations):
        w = f"{where}.observations[{i}]"
        if not isinstance(o, dict) or not isinstance(o.get("loads"), list) or not o["loads"]:
            raise bad(ConfigError, w, o, "needs a non-empty 'loads' list")
        loads = tuple(_load_from_dict(g, f"{w}.loads[{k}]") for k, g in enumerate(o["loads"]))
        if wave_mix(loads) != signature.mix:
            raise bad(ConfigError, f"{w}.loads", [list(m) for m in wave_mix(loads)],
                      "mix differs from the signature's")
        obs.append(Observation(loads=loads,
                               static_raw_bytes=_number(f"{w}.static_raw_bytes", o.get("static_raw_bytes"), integer=True),
                               peak_bytes=_number(f"{w}.peak_bytes", o.get("peak_bytes"), integer=True)))
    profile = Profile(
        signature=signature,
        ratio=float(_number(f"{where}.ratio", data.get("ratio"), integer=False)),
        max_padded_rows=_number(f"{where}.max_padded_rows", data.get("max_padded_rows"), integer=True, positive=False),
        max_sharing=float(_number(f"{where}.max_sharing", data.get("max_sharing"), integer=False)),
        count=_number(f"{where}.count", data.get("count"), integer=True),
        observations=tuple(obs))
    # The aggregates cover every observation: a file that says less is inconsistent.
    if any(o.ratio > profile.ratio * (1 + ROUNDTRIP_REL_EPS) for o in obs) \
            or any(o.size.padded_rows > profile.max_padded_rows for o in obs) \
            or any(o.size.sharing > profile.max_sharing * (1 + ROUNDTRIP_REL_EPS) for o in obs) \
            or profile.count < len(obs):
        raise bad(ConfigError, where, "aggregates", "ratio/max_padded_rows/max_sharing/count "
                  "must cover the stored observations")
    return profile


def load_profiles(path: str | Path) -> ProfileStore:
    """Read a profile file. An unreadable, truncated or invalid file raises a ConfigError that
    names the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise bad(ConfigError, "profiles", str(path), f"cannot read profile file: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad(ConfigError, "profiles", str(path),
                  f"not valid JSON (truncated or corrupt?): {exc.msg} at line {exc.lineno}") from None
    try:
        return ProfileStore.from_dict(data, where=str(path))
    except (TypeError, ValueError) as exc:  # ConfigError included; GroupLoad errors too
        if isinstance(exc, ConfigError) and str(path) in str(exc):
            raise
        raise bad(ConfigError, "profiles", str(path), f"invalid profile file: {exc}") from None


# --- the pricer hook --------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileAdjust:
    """`WavePricer.adjust`: prices a wave with the profile of its signature, if any.

    With a profile the first-execution allowance is dropped (it is a constant the walk adds
    at every peak point, so subtracting it leaves the binding point unchanged), the learned
    raw replaces the static one, and the breakdown gains a `profile` term (learned minus
    static, may be negative); its basis is "profile". O(observations of the signature).
    """

    store: ProfileStore
    config: str
    safety: float

    def signature(self, loads: Sequence[GroupLoad]) -> Signature:
        return Signature(config=self.config, mix=wave_mix(loads))

    def __call__(self, loads: Sequence[GroupLoad], breakdown: Breakdown) -> Breakdown:
        profile = self.store.get(self.signature(loads))
        if profile is None:
            return breakdown
        terms = dict(breakdown.terms)
        static = breakdown.raw_bytes - terms.get("first_execution", 0)
        terms["first_execution"] = 0
        learned, why = profile.learned_raw(static, Size.of(loads))
        terms["profile"] = learned - static
        return Breakdown(raw_bytes=learned, admitted_bytes=math.ceil(learned * self.safety),
                         terms=terms, binding=breakdown.binding, basis="profile",
                         reasons=breakdown.reasons + (f"profile ({profile.count} observations): {why}",))


def static_raw_without_first_exec(breakdown: Breakdown) -> int:
    """The static raw price the profiles compare peaks against: without the first-execution
    allowance (or the profile's own term), and without the earlier waves' RoPE cache entries
    (`rope_cache.TERM`: an observed peak is measured above what was allocated before the wave,
    them included; a profile's price is charged them beside it, unscaled)."""
    earlier = breakdown.terms.get(TERM, 0)
    if breakdown.basis == "profile":
        return breakdown.raw_bytes - breakdown.terms.get("profile", 0) - earlier
    return breakdown.raw_bytes - breakdown.terms.get("first_execution", 0) - earlier
