"""One entry point for a model's geometry: a preset name or a Hugging Face config path."""

from __future__ import annotations

from pathlib import Path

from .errors import ConfigError, bad
from .geometry import ModelGeometry
from .hf_config import load_hf_config
from .presets import list_presets, load_preset


def load_model(spec: str, *, as_family: str | None = None) -> ModelGeometry:
    """Geometry for `spec`: a preset name, a config.json, or a directory holding one.

    A preset name wins over a relative path of the same name; write `./name` for the path.
    `as_family`: a config's unsupported model_type read as that family
    (`hf_config.load_hf_config`); a preset takes none.
    """
    known = list_presets()
    if isinstance(spec, str) and spec.strip().lower() in known:
        if as_family is not None:
            raise bad(ConfigError, "as_family", as_family,
                      f"applies to a config.json, not to the preset {spec!r}")
        return load_preset(spec)
    path = Path(spec)
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        return load_hf_config(path, as_family=as_family)
    where = "a directory without config.json" if path.is_dir() else "no such file or preset"
    raise bad(ConfigError, "model", spec,
              f"{where}; give a preset ({', '.join(known)}), a config.json, "
              "or a directory holding one")
