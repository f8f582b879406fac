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


# --- the import graph: no cycle, and every import in the room order ---------------------------

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
_FOLDERS = {"planner": "waveplan.planner", "search": "waveplan.search", "pricing": "waveplan.pricing"}


def _modules() -> dict[str, object]:
    """Every module file of the three rooms: dotted name -> path."""
    out = {}
    for folder, package in _FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def _imports(name: str, path, modules: dict) -> set[str]:
    """The waveplan modules `name` imports anywhere in its file (module level or inside a
    function): `from pkg import mod` names the submodule when there is one."""
    import ast

    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _room(name: str) -> str:
    if name.startswith("waveplan.pricing.measure"):
        return "measure"
    return name.split(".")[1]


# what each room may import (planner -> search -> pricing; pricing.measure -> pricing)
_ALLOWED = {"pricing": {"pricing"}, "measure": {"measure", "pricing"},
            "search": {"search", "pricing"}, "planner": {"planner", "search", "pricing", "measure"}}


def test_no_import_against_the_room_order():
    graph = _graph()
    bad = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                 if _room(b) not in _ALLOWED[_room(a)])
    assert bad == [], bad


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycle():
    """Package `__init__` modules re-export their room's API; a module importing its own
    package's `__init__` is the only edge left out (the package imports it, not the reverse)."""
    graph = _graph()
    for name, targets in graph.items():
        graph[name] = {t for t in targets if not (t in _FOLDERS.values() or t.endswith(".measure")
                                                  or t.endswith(".integrations"))
                       or not name.startswith(t + ".")}
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
