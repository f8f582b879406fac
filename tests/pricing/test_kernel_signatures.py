"""The jitted kernels' signatures stay readable: no numba kernel in waveplan takes more than
MAX_POSITIONAL positional parameters (related arrays travel as NamedTuple bundles instead,
e.g. `pricing.walk.WalkCharges`, `search.greedy.GreedyInputs`)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from pathlib import Path

from numba.core.dispatcher import Dispatcher

MAX_POSITIONAL = 12
PACKAGES = ("waveplan.pricing", "waveplan.search", "waveplan.planner")
# a module that defines a kernel imports numba; only those are imported (the others may pull
# in torch or megatron, which the scan does not need)
_USES_NUMBA = re.compile(r"^\s*(from numba\b|import numba\b)", re.MULTILINE)


def jitted_kernels() -> dict[str, int]:
    """Every numba dispatcher defined at module level in waveplan -> its number of positional
    parameters. O(modules)."""
    found = {}
    for package in PACKAGES:
        for root in importlib.util.find_spec(package).submodule_search_locations:
            for path in sorted(Path(root).rglob("*.py")):
                if not _USES_NUMBA.search(path.read_text()):
                    continue
                parts = path.relative_to(root).with_suffix("").parts
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                module = importlib.import_module(".".join((package, *parts)))
                for attr, value in vars(module).items():
                    if not (isinstance(value, Dispatcher)
                            and value.py_func.__module__ == module.__name__):
                        continue
                    params = inspect.signature(value.py_func).parameters.values()
                    found[f"{module.__name__}.{attr}"] = sum(
                        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    return found


def test_no_kernel_takes_more_than_twelve_positional_parameters():
    kernels = jitted_kernels()
    # the scan sees the kernels (an empty scan would pass vacuously)
    for known in ("waveplan.pricing.walk.walk", "waveplan.pricing.wave_pricer._admitted",
                  "waveplan.search.greedy.greedy_run", "waveplan.search.kernels.delta",
                  "waveplan.search.multistart.multistart_chunk",
                  "waveplan.search.items_jit.weights"):
        assert known in kernels
    wide = {name: n for name, n in kernels.items() if n > MAX_POSITIONAL}
    assert not wide, f"kernels with more than {MAX_POSITIONAL} positional parameters: {wide}"
