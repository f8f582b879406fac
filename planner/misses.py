"""Misses: an observed peak above a wave's estimate, said loudly and kept so that it can be
reproduced (docs/faq.md#a-wave-missed-its-estimate).

`Planner.observe` returns a `WaveObservation`: the wave's raw and admitted estimate, the peak,
their ratio and the kind of miss (`MissKind`). A miss logs a warning on the `waveplan` logger
(once per signature and kind, per planner) and appends one JSON line (`miss_record`) to the
planner's misses file with everything needed to price the wave again: the model (geometry,
layout, recompute, LoRA, coefficient table, head, safety), the coefficients' version, the
wave's group loads, first slots, the earlier waves' RoPE cache entries, the profile it was
priced with, the priced breakdown, the peak and the versions of waveplan, torch and the
trainer framework. `read_misses` and `reprice` read such a file back (`waveplan misses`).

The estimate a peak is compared with is the wave's own: its price less the earlier waves'
RoPE cache entries (`rope_cache.TERM`), which are allocated before the wave starts and so lie
outside a peak measured above the wave's start (the convention `observe` and the profiles use).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import math
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from waveplan.pricing import rope_cache
from waveplan.pricing.atomic_io import append_line_atomic
from waveplan.pricing.coefficients import CoefficientTable, list_backends, load_table
from waveplan.pricing.compat import StrEnum
from waveplan.pricing.errors import ConfigError, WaveplanError, bad
from waveplan.pricing.frameworks import model_from_dict
from waveplan.pricing.model import PricingModel
from waveplan.pricing.price import Breakdown, GroupLoad, price_groups

from .plan import PlanWave
from .profiles import (
    PROFILE_SCHEMA,
    ProfileAdjust,
    ProfileStore,
    Signature,
    _load_from_dict,
    _load_to_dict,
    wave_mix,
)

MISS_SCHEMA = 1
MISS_KIND = "waveplan-miss"
FAQ = "docs/faq.md#a-wave-missed-its-estimate"
log = logging.getLogger("waveplan")

# the integrations' trainer frameworks, as (module, distribution): recorded when imported
_FRAMEWORKS = (("megatron.core", "megatron-core"), ("verl", "verl"),
               ("transformer_engine", "transformer-engine"), ("transformers", "transformers"),
               ("peft", "peft"))


class MissKind(StrEnum):
    """How an observed peak compares with its wave's estimate."""

    NONE = "none"                    # at or below the raw estimate
    OVER_RAW = "over_raw"            # above the raw estimate, within the admitted bytes: the margin absorbed it
    OVER_ADMITTED = "over_admitted"  # above the admitted bytes: the margin was not enough


def miss_kind(peak_bytes: int, raw_bytes: int, admitted_bytes: int) -> MissKind:
    if peak_bytes > admitted_bytes:
        return MissKind.OVER_ADMITTED
    return MissKind.OVER_RAW if peak_bytes > raw_bytes else MissKind.NONE


def own_estimate(breakdown: Breakdown, safety: float) -> tuple[int, int]:
    """(raw, admitted) bytes of the wave itself: `breakdown` less the earlier waves' RoPE cache
    entries (the exact inverse of `rope_cache.plus_earlier_entries`)."""
    earlier = int(breakdown.terms.get(rope_cache.TERM, 0))
    return (breakdown.raw_bytes - earlier,
            breakdown.admitted_bytes - math.ceil(earlier * safety))


@dataclass(frozen=True)
class WaveObservation:
    """What `Planner.observe` saw for one wave."""

    wave: int
    """The wave's index in its plan."""
    raw_bytes: int
    """The wave's raw estimate (`own_estimate`: without the earlier waves' RoPE cache entries)."""
    admitted_bytes: int
    """The wave's admitted bytes (raw x safety), likewise."""
    peak_bytes: int
    """The observed peak (the largest over ranks)."""
    kind: MissKind
    """none, over_raw or over_admitted (`miss_kind`)."""
    binding: str
    """The binding point of the estimate."""
    basis: str
    """The estimate's basis: evidence, assumed, conservative or profile."""
    record: Path | None = None
    """The misses file the record was appended to (None: no miss, or nowhere to record it)."""

    @property
    def ratio(self) -> float:
        """Peak over the raw estimate."""
        return self.peak_bytes / self.raw_bytes if self.raw_bytes > 0 else math.inf

    @property
    def is_miss(self) -> bool:
        return self.kind is not MissKind.NONE


# --- recording ----------------------------------------------------------------------------------


def shipped_table(table: CoefficientTable) -> bool:
    """Whether `table` is the shipped table of its backend (read from waveplan's own data)."""
    if table.backend not in list_backends() or not table.path:
        return False
    shipped = resources.files("waveplan.pricing") / "data" / "coefficients" / f"{table.backend}.json"
    return Path(table.path) == Path(str(shipped))


def table_digest(table: CoefficientTable) -> str:
    """The coefficients' version: sha256 of the table's canonical JSON (backend and terms)."""
    text = json.dumps(table.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@functools.cache
def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def versions() -> dict:
    """waveplan, Python, numpy, torch (the imported one, else the installed one) and each
    trainer framework this process imported. Imports nothing."""
    import numpy as np

    torch = sys.modules.get("torch")
    return {"waveplan": _dist_version("waveplan"), "python": platform.python_version(),
            "numpy": np.__version__,
            "torch": getattr(torch, "__version__", None) if torch else _dist_version("torch"),
            "framework": {dist: _dist_version(dist) for module, dist in _FRAMEWORKS
                          if module in sys.modules}}


def miss_record(model: PricingModel, wave: PlanWave, obs: WaveObservation) -> dict:
    """The JSON record of a miss: everything `reprice` needs, and the versions. O(model)."""
    terms = wave.breakdown.terms
    return {
        "kind": MISS_KIND, "schema": MISS_SCHEMA,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "miss": obs.kind.value, "peak_bytes": obs.peak_bytes, "raw_bytes": obs.raw_bytes,
        "admitted_bytes": obs.admitted_bytes, "ratio": obs.ratio,
        "wave": {"index": wave.index, "requests": list(wave.request_ids),
                 "budget_bytes": int(wave.budget_bytes)},
        "signature": wave.signature.to_dict(),
        "model": model.to_dict(),
        "coefficients": {"backend": model.table.backend, "path": model.table.path,
                         "shipped": shipped_table(model.table), "sha256": table_digest(model.table)},
        "loads": [_load_to_dict(g) for g in wave.loads],
        "first_slots": sorted(wave.first_slots),
        "earlier_bytes": None if (earlier := terms.get(rope_cache.TERM)) is None else int(earlier),
        "profile": None if wave.profile is None else wave.profile.to_dict(),
        "estimate": {**wave.breakdown.to_dict(), "terms": {k: int(v) for k, v in terms.items()}},
        "versions": versions(),
    }


def class_label(signature: dict) -> str:
    """A signature in words: model, layout, recompute and the wave's (slot, grad) mix."""
    c = signature.get("config", {}) if isinstance(signature, dict) else {}
    p = c.get("parallel", {}) if isinstance(c.get("parallel"), dict) else {}
    layout = f"TP{p.get('tp', '?')}" + (" SP" if p.get("sequence_parallel") else "")
    layout += "".join(f" {k.upper()}{p[k]}" for k in ("cp", "pp", "ep", "etp") if p.get(k, 1) not in (1, None))
    recompute = c.get("recompute", {}).get("mode", "?") if isinstance(c.get("recompute"), dict) else "?"
    mix = ",".join(f"{s}:{'grad' if g else 'nograd'}" for s, g in signature.get("mix", ()))
    return f"{c.get('model', '?')} {layout} {recompute} recompute [{mix}]"


def _gib(value: float) -> str:
    return f"{value / 2**30:.3f} GiB"


class MissLog:
    """A planner's misses: where they are recorded and which (signature, kind) has warned."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = None if path is None else Path(path)
        self._warned: set[tuple[Signature, MissKind]] = set()

    def observe(self, model: PricingModel, wave: PlanWave, peak_bytes: int) -> WaveObservation:
        """Classify `peak_bytes` against `wave`'s estimate; record and warn on a miss. A record
        that cannot be written is warned about and training goes on. O(model) on a miss."""
        raw, admitted = own_estimate(wave.breakdown, model.safety)
        obs = WaveObservation(wave=wave.index, raw_bytes=raw, admitted_bytes=admitted,
                              peak_bytes=int(peak_bytes), kind=miss_kind(peak_bytes, raw, admitted),
                              binding=wave.breakdown.binding, basis=wave.breakdown.basis)
        if not obs.is_miss:
            return obs
        failed = None
        if self.path is not None:
            try:
                line = json.dumps(miss_record(model, wave, obs), sort_keys=True, separators=(",", ":"))
                append_line_atomic(self.path, line)
                obs = dataclasses.replace(obs, record=self.path)
            except (OSError, TypeError, ValueError) as exc:   # a miss never stops training
                failed = f"could not append it to {self.path}: {exc}"
        key = (wave.signature, obs.kind)
        if failed is None and key in self._warned:
            return obs
        self._warned.add(key)
        log.warning(self.message(obs, class_label(wave.signature.to_dict()), failed))
        return obs

    def message(self, obs: WaveObservation, label: str, failed: str | None) -> str:
        if obs.kind is MissKind.OVER_ADMITTED:
            what = (f"above its admitted {_gib(obs.admitted_bytes)}: the safety margin was not "
                    f"enough, the next such wave may run out of memory")
        else:
            what = f"within its admitted {_gib(obs.admitted_bytes)}: the safety margin absorbed it"
        if failed is not None:
            where = f"not recorded: {failed}"
        elif self.path is None:
            where = "not recorded: the planner has no misses_path (nor a profiles_path beside which to keep one)"
        else:
            where = f"recorded in {self.path}"
        return (f"waveplan miss: wave {obs.wave} ({label}) peaked at {_gib(obs.peak_bytes)}, "
                f"{obs.ratio:.4f}x its raw estimate {_gib(obs.raw_bytes)}, {what}; binding point "
                f"{obs.binding}, basis {obs.basis}; {where} (what to do and how to send it: {FAQ}); "
                f"further {obs.kind.value} misses of this signature are recorded without a warning")


def default_misses_path(profiles_path: Path | None) -> Path | None:
    """Beside the profiles file: `<profiles stem>.misses.jsonl` in its folder."""
    return None if profiles_path is None else profiles_path.with_name(f"{profiles_path.stem}.misses.jsonl")


def observe_waves(planner, waves: Sequence[PlanWave], peaks: Sequence) -> tuple[WaveObservation | None, ...]:
    """The trainer integrations' path: each wave's measured peak (bytes; a number or one per
    rank) through `planner.observe`, in order; a peak of None or 0 (not measured) is skipped
    (None in its place). Misses are warned about and recorded by `observe`; filter them with
    `misses`. O(waves)."""
    waves, peaks = list(waves), list(peaks)
    if len(peaks) != len(waves):
        raise bad(ConfigError, "peaks", f"<{len(peaks)} values>", f"needs one peak per wave ({len(waves)})")
    out = []
    for wave, peak in zip(waves, peaks, strict=True):
        skip = peak is None or (isinstance(peak, int | float) and not isinstance(peak, bool) and peak == 0)
        out.append(None if skip else planner.observe(wave, peak_bytes=peak))
    return tuple(out)


def misses(observations: Sequence[WaveObservation | None]) -> tuple[WaveObservation, ...]:
    """The misses among `observations`."""
    return tuple(o for o in observations if o is not None and o.is_miss)


# --- reading and re-pricing ------------------------------------------------------------------


@dataclass(frozen=True)
class MissRecord:
    """One valid line of a misses file."""

    line: int
    """The line number in the file (from 1)."""
    data: dict
    """The record as written (`miss_record`)."""
    signature: Signature
    """The wave's signature."""
    loads: tuple[GroupLoad, ...]
    """The wave's group loads."""
    kind: MissKind
    """The kind of miss when it was observed."""

    @property
    def ratio(self) -> float:
        return self.data["peak_bytes"] / self.data["raw_bytes"]

    @property
    def label(self) -> str:
        return class_label(self.data["signature"])


_FIELDS = ("miss", "peak_bytes", "raw_bytes", "admitted_bytes", "wave", "signature", "model",
           "coefficients", "loads", "first_slots", "earlier_bytes", "profile", "estimate", "versions")


def _count(field: str, value: object, *, positive: bool = True) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (1 if positive else 0):
        raise bad(ConfigError, field, value, f"must be an integer {'> 0' if positive else '>= 0'}")
    return value


def parse_record(text: str) -> MissRecord:
    """Validate one line (line number 0: the caller sets it). ConfigError names the field."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"not valid JSON (truncated or corrupt?): {exc.msg} at column {exc.colno}") from None
    if not isinstance(data, dict):
        raise bad(ConfigError, "record", type(data).__name__, "must be a JSON object")
    if data.get("kind") != MISS_KIND:
        raise bad(ConfigError, "kind", data.get("kind"), f"not a waveplan miss record (expected {MISS_KIND!r})")
    if data.get("schema") != MISS_SCHEMA:
        raise bad(ConfigError, "schema", data.get("schema"), f"this waveplan reads miss schema {MISS_SCHEMA} only")
    missing = [f for f in _FIELDS if f not in data]
    if missing:
        raise bad(ConfigError, missing[0], None, "missing field")
    try:
        kind = MissKind(data["miss"])
    except ValueError:
        raise bad(ConfigError, "miss", data["miss"], "must be over_raw or over_admitted") from None
    if kind is MissKind.NONE:
        raise bad(ConfigError, "miss", data["miss"], "a record is only written for a miss")
    for name in ("peak_bytes", "raw_bytes", "admitted_bytes"):
        _count(name, data[name])
    if data["earlier_bytes"] is not None:
        _count("earlier_bytes", data["earlier_bytes"], positive=False)
    estimate = data["estimate"]
    if not isinstance(estimate, dict) or not isinstance(estimate.get("terms"), dict):
        raise bad(ConfigError, "estimate", type(estimate).__name__, "must be an object with 'terms'")
    for name in ("raw_bytes", "admitted_bytes"):
        _count(f"estimate.{name}", estimate.get(name))
    if not isinstance(data["wave"], dict):
        raise bad(ConfigError, "wave", data["wave"], "must be an object")
    if not isinstance(data["coefficients"], dict):
        raise bad(ConfigError, "coefficients", data["coefficients"], "must be an object")
    signature = Signature.from_dict(data["signature"], "record")
    if not isinstance(data["loads"], list) or not data["loads"]:
        raise bad(ConfigError, "loads", data["loads"], "must be a non-empty list")
    loads = tuple(_load_from_dict(g, f"loads[{k}]") for k, g in enumerate(data["loads"]))
    if wave_mix(loads) != signature.mix:
        raise bad(ConfigError, "loads", [list(m) for m in wave_mix(loads)], "mix differs from the signature's")
    slots = data["first_slots"]
    if not isinstance(slots, list) or not all(isinstance(s, str) for s in slots):
        raise bad(ConfigError, "first_slots", slots, "must be a list of slot names")
    if data["profile"] is not None and not isinstance(data["profile"], dict):
        raise bad(ConfigError, "profile", type(data["profile"]).__name__, "must be an object or null")
    return MissRecord(line=0, data=data, signature=signature, loads=loads, kind=kind)


def read_misses(path: str | Path) -> tuple[list[MissRecord], list[tuple[int, str]]]:
    """(valid records, (line number, one line naming the file, line and field) per bad
    record). A file that cannot be read at all raises ConfigError. O(file)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise bad(ConfigError, "misses", str(path), f"cannot read: {exc}") from None
    records, bad_lines = [], []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(dataclasses.replace(parse_record(line), line=n))
        except (WaveplanError, TypeError, ValueError) as exc:
            bad_lines.append((n, f"{path} line {n}: {exc}"))
    return records, bad_lines


@dataclass(frozen=True)
class Repriced:
    """A record priced again with today's model."""

    breakdown: Breakdown
    """The full estimate, as the record's `estimate` (earlier waves' entries included)."""
    raw_bytes: int
    """The wave's own raw estimate (`own_estimate`)."""
    admitted_bytes: int
    """The wave's own admitted bytes."""
    kind: MissKind
    """The record's peak against today's estimate."""
    coefficients: str
    """Which coefficient table priced it."""
    same_table: bool
    """Whether that table is the one recorded (same sha256)."""

    def same_estimate(self, record: MissRecord) -> bool:
        """Whether today's estimate is the recorded one (every field of the breakdown)."""
        return self.breakdown.to_dict() == {**record.data["estimate"],
                                             "reasons": list(record.data["estimate"].get("reasons", []))}


def reprice(record: MissRecord, *, backend: str | None = None) -> Repriced:
    """Price the record's wave with today's model: the recorded configuration, today's code,
    and the coefficient table `backend` names, else today's shipped table of the recorded
    backend (when the record's came shipped), else the recorded table. Then the recorded
    profile and earlier waves' RoPE cache entries, as the planner priced it. ConfigError
    names the field of a record that cannot be priced. O(model + loads)."""
    data = record.data
    try:
        model = model_from_dict(data["model"])
    except WaveplanError as exc:
        raise ConfigError(f"model: {exc}") from None
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ConfigError(f"model: cannot be rebuilt: {type(exc).__name__}: {exc}") from None
    recorded = data["coefficients"]
    shipped = recorded.get("shipped") is True and model.table.backend in list_backends()
    if backend is not None:
        table, source = load_table(backend), backend
    elif shipped:
        table, source = load_table(model.table.backend), f"today's shipped {model.table.backend}"
    else:
        table, source = model.table, f"the recorded table ({recorded.get('path') or model.table.backend})"
    if table is not model.table:
        model = dataclasses.replace(model, table=table)
    loads = record.loads
    breakdown = price_groups(model, loads, first_slots=frozenset(data["first_slots"]))
    store = ProfileStore() if data["profile"] is None else \
        ProfileStore.from_dict({"schema": PROFILE_SCHEMA, "profiles": [data["profile"]]}, where="profile")
    breakdown = ProfileAdjust(store=store, config=record.signature.config, safety=model.safety)(loads, breakdown)
    if data["earlier_bytes"] is not None:
        breakdown = rope_cache.plus_earlier_entries(breakdown, data["earlier_bytes"], model.safety)
    raw, admitted = own_estimate(breakdown, model.safety)
    return Repriced(breakdown=breakdown, raw_bytes=raw, admitted_bytes=admitted,
                    kind=miss_kind(data["peak_bytes"], raw, admitted), coefficients=source,
                    same_table=table_digest(table) == recorded.get("sha256"))
