"""Calibration tables: per-stage workspace coefficients keyed by execution backend.

A table is JSON data shipped in `pricing/data/coefficients/<backend>.json` (or any file a user
fits with `waveplan calibrate`). Every entry carries its `source`. The walk's structure is the
same for every backend; only these numbers differ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path

from . import entries
from .errors import ConfigError, bad
from .kernel_set import KERNEL_MODELS, KernelSet
from .tolerances import ROUNDING_RAISE

DEFAULT_BACKEND = "te-gpu"   # Transformer Engine on GPU: the shipped table a model prices with

# Widths a per-row coefficient may multiply (see `pricing.model.layer_widths`).
WIDTHS = ("H", "F", "qkv", "core", "in_proj", "conv", "value", "expert_ffn", "shared_ffn",
          "experts", "vocab", "rank",
          # multi-latent attention's own widths (`layers.mla.mla_widths`, `fused_mla_layer` only)
          "qk", "heads", "qk_acc", "latent", "rope")

REQUIRED_TERMS = entries.REQUIRED
# The optional entries a table fitted on plain CPU kernels adds (the fused GPU table omits them
# all), and what the pricing charges without them (`pricing.entries`, the one registry).
OPTIONAL_TERMS = {name: default for name, default in entries.OPTIONAL.items()
                  if name != "layout_residual"}
_COEF_KEYS = ("per_row", "per_routed_row", "per_expert_row")
_SCALAR_KEYS = ("value", "per_row_vocab", "retained_per_row_vocab", "transient_per_row_vocab")


@dataclass(frozen=True)
class CoefficientTable:
    backend: str
    terms: dict  # name -> entry (dicts of width -> bytes, scalars, and "source")
    path: str = ""

    def __post_init__(self) -> None:
        missing = entries.missing_required(self.terms)
        if missing:
            raise bad(ConfigError, f"coefficients[{self.backend}]", missing[0], "missing term")
        for name, entry in self.terms.items():
            if not isinstance(entry, dict) or not entry.get("source"):
                raise bad(ConfigError, f"coefficients[{self.backend}].{name}.source", None,
                          "every entry must say where its numbers come from")
            for key in _COEF_KEYS:
                for width, value in entry.get(key, {}).items():
                    if width not in WIDTHS:
                        raise bad(ConfigError, f"coefficients[{self.backend}].{name}.{key}", width,
                                  f"unknown width; known: {', '.join(WIDTHS)}")
                    _check_number(f"coefficients[{self.backend}].{name}.{key}.{width}", value)
            for key in _SCALAR_KEYS:
                if key in entry:
                    _check_number(f"coefficients[{self.backend}].{name}.{key}", entry[key])
        for kernel in self.terms.get("kernel_models", {}).get("kernels", ()):
            if kernel not in KERNEL_MODELS:
                raise bad(ConfigError, f"coefficients[{self.backend}].kernel_models.kernels", kernel,
                          f"unknown kernel model; known: {', '.join(KERNEL_MODELS)}")

    @cached_property
    def kernels(self) -> KernelSet:
        """The kernel set this table prices (`KernelSet.of`), read once."""
        return KernelSet.of(self)

    def per_row(self, name: str, widths: dict[str, float], key: str = "per_row") -> float:
        """Bytes per row of term `name`: the sum of its coefficients times the given widths."""
        return float(sum(c * widths[w] for w, c in self.terms[name].get(key, {}).items()))

    def scalar(self, name: str, key: str = "value") -> float:
        return float(self.terms[name][key])

    def source(self, name: str) -> str:
        return self.terms[name]["source"]

    def to_dict(self) -> dict:
        return {"backend": self.backend, "terms": self.terms}


def _check_number(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise bad(ConfigError, field, value, "must be a number >= 0")


def list_backends() -> list[str]:
    root = resources.files("waveplan.pricing") / "data" / "coefficients"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_table(backend: str = DEFAULT_BACKEND) -> CoefficientTable:
    """A shipped table by backend name, or a table file by path."""
    if backend.endswith(".json") or "/" in backend:
        path = Path(backend)
        try:
            text = path.read_text()
        except OSError as exc:
            raise bad(ConfigError, "backend", backend, f"cannot read table file: {exc.strerror}") from None
    else:
        if backend not in list_backends():
            raise bad(ConfigError, "backend", backend, f"unknown backend; known: {', '.join(list_backends())}")
        res = resources.files("waveplan.pricing") / "data" / "coefficients" / f"{backend}.json"
        text, path = res.read_text(), Path(str(res))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad(ConfigError, "backend", backend, f"table is not valid JSON (line {exc.lineno})") from None
    return table_from_dict(data, path=str(path))


def table_from_dict(data: dict, *, path: str = "") -> CoefficientTable:
    if not isinstance(data, dict) or "backend" not in data or not isinstance(data.get("terms"), dict):
        raise bad(ConfigError, "coefficients", path or "<dict>", "needs 'backend' and a 'terms' object")
    return CoefficientTable(backend=str(data["backend"]), terms=data["terms"], path=path)


def covering_after_rounding(scales: dict[str, float], build, ratios_of, *, margin: float,
                            field: str, value: object, why: str):
    """(table, scales, ratios): the table `build(scales)`, raised uniformly until every ratio
    `ratios_of(table)` (estimate / measured) is at least 1 + margin after its coefficients were
    rounded to 6 significant digits. Formula: scales x (1 + margin) / lowest ratio x
    ROUNDING_RAISE, at most 5 times (one covers a rounding error); the table records its scales
    (`_fit_scales`, 4 digits). Shared by `measure.calibrate.fit_table`,
    `fsdp.calibrate.fit_traces` and `planner.profile_fit`."""
    table = build(scales)
    for _ in range(5):
        ratios = ratios_of(table)
        if min(ratios) >= 1.0 + margin:
            object.__setattr__(table, "_fit_scales", {g: round(s, 4) for g, s in scales.items()})
            return table, scales, ratios
        raise_by = (1.0 + margin) / min(ratios) * ROUNDING_RAISE
        scales = {g: s * raise_by for g, s in scales.items()}
        table = build(scales)
    raise bad(ConfigError, field, value, why)  # pragma: no cover - one raise covers a rounding error


FIT_BISECTIONS = 24   # factor resolution ~ FACTOR_MAX / 2^24
FIT_PASSES = 3        # rounds of group-by-group lowering


def covering_scales(groups, ratios_of, *, margin: float, factor_max: float, refuse):
    """(group factors, s0): the least uniform factor s0 with every ratio `ratios_of(scales)`
    (estimate / measured) >= 1 + margin, then each group lowered in turn (bisection) as far as
    every ratio stays covered, never below min(1, s0), while the mean ratio falls. `refuse(ratios)`
    raises when even `factor_max` does not cover. Shared by `planner.profile_fit` and
    `fsdp.calibrate`. Deterministic. O(FIT_PASSES x groups x FIT_BISECTIONS) calls."""
    import statistics

    from .tolerances import REL_GAIN_EPS

    need = 1.0 + margin

    def covers(scales):
        return min(ratios_of(scales)) >= need

    def uniform(x):
        return {g: x for g in groups}

    if not covers(uniform(factor_max)):
        refuse(ratios_of(uniform(factor_max)))
    lo, hi = 0.0, factor_max
    for _ in range(FIT_BISECTIONS):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if covers(uniform(mid)) else (mid, hi)
    s0 = hi
    floor = min(1.0, s0)
    scales = uniform(max(1.0, s0))
    best = statistics.fmean(ratios_of(scales))
    for _ in range(FIT_PASSES):
        moved = False
        for g in groups:
            if scales[g] <= floor:
                continue
            trial = dict(scales, **{g: floor})
            if not covers(trial):
                lo, hi = floor, scales[g]
                for _ in range(FIT_BISECTIONS):
                    mid = (lo + hi) / 2
                    trial[g] = mid
                    lo, hi = (lo, mid) if covers(trial) else (mid, hi)
                trial[g] = hi
            value = statistics.fmean(ratios_of(trial))
            if value < best * (1 - REL_GAIN_EPS):
                scales, best, moved = trial, value, True
        if not moved:
            break
    return scales, s0
