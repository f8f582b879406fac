"""The bench scripts tests price with (bench/ is not a package): one loader for them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def bench_module(name: str) -> ModuleType:
    """bench/`name`.py, loaded as a module of that name (e.g. layout_validation, whose
    `estimate` prices a cell as its report does). O(import)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
