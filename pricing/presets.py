"""Bundled geometries of public models, stored as package data in `data/presets/*.json`.

Each file is `ModelGeometry.to_dict()` with two conveniences: `layers` may be written as
`{"repeat": N, "pattern": [[mixer, mlp], ...]}` (or a list of such blocks, concatenated, for
models whose first layers differ), and a free-text `source` says where the numbers come from
(kept in `geometry.extra["source"]`).
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

from .errors import ConfigError, bad
from .geometry import ModelGeometry

_SUFFIX = ".json"


def _preset_dir():
    return resources.files("waveplan.pricing").joinpath("data", "presets")


def list_presets() -> list[str]:
    """Names of the bundled presets, sorted."""
    return sorted(entry.name[: -len(_SUFFIX)] for entry in _preset_dir().iterdir()
                  if entry.name.endswith(_SUFFIX))


def expand_layers(layers: object) -> list:
    """Expand the compact `{"repeat": N, "pattern": [...]}` form, or a list of such blocks; a
    plain list of layers passes through."""
    if isinstance(layers, list) and layers and all(isinstance(block, dict) for block in layers):
        return [layer for block in layers for layer in expand_layers(block)]
    if not isinstance(layers, dict):
        return layers  # type: ignore[return-value]  # validated by ModelGeometry.from_dict
    unknown = sorted(set(layers) - {"repeat", "pattern"})
    if unknown:
        raise bad(ConfigError, "model.layers", unknown[0], "unknown key; expected repeat, pattern")
    repeat, pattern = layers.get("repeat"), layers.get("pattern")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat <= 0:
        raise bad(ConfigError, "model.layers.repeat", repeat, "must be a positive integer")
    if not isinstance(pattern, list) or not pattern:
        raise bad(ConfigError, "model.layers.pattern", pattern, "must be a non-empty list")
    return pattern * repeat


def geometry_from_preset_dict(data: dict) -> ModelGeometry:
    """Build a geometry from a preset file's content (compact layers and `source` allowed)."""
    data = dict(data)
    source = data.pop("source", None)
    if "layers" in data:
        data["layers"] = expand_layers(data["layers"])
    geometry = ModelGeometry.from_dict(data)
    return dataclasses.replace(geometry, extra={"source": source} if source else {})


def load_preset(name: str) -> ModelGeometry:
    """The bundled geometry called `name` (case-insensitive)."""
    known = list_presets()
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in known:
        raise bad(ConfigError, "preset", name, f"unknown preset; known: {', '.join(known)}")
    text = _preset_dir().joinpath(key + _SUFFIX).read_text(encoding="utf-8")
    return geometry_from_preset_dict(json.loads(text))
