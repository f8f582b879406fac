"""One entry point for a model's geometry: a preset name or a Hugging Face config path."""

from __future__ import annotations

from pathlib import Path

from .errors import ConfigError, bad
from .geometry import ModelGeometry
from .hf_config import load_hf_config
from .presets import list_presets, load_preset


def load_model(spec: str) -> ModelGeometry:
    """Geometry for `spec`: a preset name, a config.json, or a directory holding one.

    A preset name wins over a relative path of the same name; write `./name` for the path.
    """
    known = list_presets()
    if isinstance(spec, str) and spec.strip().lower() in known:
        return load_preset(spec)
    path = Path(spec)
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        return load_hf_config(path)
    where = "a directory without config.json" if path.is_dir() else "no such file or preset"
    raise bad(ConfigError, "model", spec,
              f"{where}; give a preset ({', '.join(known)}), a config.json, "
              "or a directory holding one")
