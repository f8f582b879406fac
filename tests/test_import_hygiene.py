"""The memory model, the search and the planner import no heavy optional dependency.

torch and megatron-core (the `megatron` extra), OR-Tools (`solver`) and matplotlib (`plot`)
load only inside the functions that use them; everything that runs a model lives in
`waveplan.pricing.measure`. Each check runs in a fresh interpreter, so modules imported by
other tests cannot hide an eager import.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "megatron", "ortools", "matplotlib")

_LOADED = f"""
import json, sys
print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
"""


def _heavy_after(code: str) -> list[str]:
    """The heavy top-level packages in sys.modules after running `code` in a fresh Python."""
    out = subprocess.run([sys.executable, "-c", code + _LOADED], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_packages_import_nothing_heavy():
    assert _heavy_after("import waveplan.pricing, waveplan.search, waveplan.planner") == []


def test_cli_imports_nothing_heavy():
    assert _heavy_after("import waveplan.planner.cli") == []


def test_every_module_outside_measure_imports_nothing_heavy():
    code = """
import importlib, pkgutil
import waveplan.pricing, waveplan.search, waveplan.planner
names = []
for pkg in (waveplan.pricing, waveplan.search, waveplan.planner):
    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.ispkg:
            importlib.import_module(f"{pkg.__name__}.{info.name}")
            names.append(info.name)
assert {"price", "packers", "planner", "cli"} <= set(names), names
"""
    assert _heavy_after(code) == []


def test_measure_package_itself_imports_nothing_heavy():
    assert _heavy_after("import waveplan.pricing.measure") == []


@pytest.mark.slow
@pytest.mark.megatron
def test_measure_modules_import_with_the_megatron_extra():
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("megatron") is None:
        pytest.skip("needs torch and megatron-core (the megatron extra)")
    code = """
import importlib, pkgutil
import waveplan.pricing.measure as measure
names = [info.name for info in pkgutil.iter_modules(measure.__path__)]
for name in names:
    importlib.import_module(f"waveplan.pricing.measure.{name}")
assert {"trace", "training_wave", "megatron_build", "megatron_shim", "live_geometry",
        "calibrate", "thd", "simplex"} <= set(names), names
"""
    assert "torch" in _heavy_after(code)
