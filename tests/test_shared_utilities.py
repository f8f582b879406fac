"""The shared utilities have one home each (issue 29 item 5); nothing rewrites them in place.

- numeric tolerances: `waveplan.pricing.tolerances` (no bare tolerance literal elsewhere);
- errors: `waveplan.pricing.errors.bad` builds every "field=value: why" message;
- stable sorting in kernels: `waveplan.pricing.stable_sort` (no numba sort overloads in a kernel);
- Python-version shims: `waveplan.pricing.compat`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("pricing", "search", "planner")

# Small float literals that are not tolerances: model constants and zero-division floors.
NOT_TOLERANCES = {
    ("pricing/measure/megatron_build.py", 1e-6),   # RMSNorm epsilon of the built models
    ("pricing/measure/gpu_kernels.py", 1e-6),      # the RMSNorm kernel's epsilon
    ("search/anneal.py", 1e-12),                   # floor of a mean, against division by zero
    ("search/greedy.py", 1e-300),                  # floor of a sum, against division by zero
    ("pricing/measure/fsdp_verl_trace.py", 1e-8),  # veRL's temperature clamp, as veRL writes it
}
# A self-contained LP solver keeps its pivoting tolerances next to its pivots.
OWN_NUMERICS = {"pricing/tolerances.py", "pricing/measure/simplex.py"}


def _modules(skip=()):
    """(path from the root, parsed module) of every module of the three rooms but `skip`."""
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in skip:
                yield rel, ast.parse(path.read_text(), filename=rel)


def test_tolerance_literals_live_in_tolerances():
    found = []
    for rel, tree in _modules(skip=OWN_NUMERICS):
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, float) \
                    and 0 < abs(node.value) <= 1e-6 and (rel, node.value) not in NOT_TOLERANCES:
                found.append(f"{rel}:{node.lineno} {node.value!r}")
    assert not found, "name these in waveplan.pricing.tolerances: " + ", ".join(found)


def _writes_bad_out(call: ast.Call) -> bool:
    """Whether `call` is `SomeError(f"...field={value!r}: why")`: `bad` written out by hand."""
    name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
    if not name.endswith("Error") or not call.args or not isinstance(call.args[0], ast.JoinedStr):
        return False
    parts = call.args[0].values
    for a, b, c in zip(parts, parts[1:], parts[2:], strict=False):
        if isinstance(a, ast.Constant) and str(a.value).endswith("=") \
                and isinstance(b, ast.FormattedValue) and b.conversion == ord("r") \
                and isinstance(c, ast.Constant) and str(c.value).startswith(": "):
            return True
    return False


def test_field_value_errors_go_through_bad():
    found = [f"{rel}:{node.lineno}" for rel, tree in _modules() for node in ast.walk(tree)
             if isinstance(node, ast.Call) and _writes_bad_out(node)]
    assert not found, "use waveplan.pricing.errors.bad(cls, field, value, why): " + ", ".join(found)


def test_detector_finds_a_hand_written_bad():
    call = ast.parse('ConfigError(f"tp={tp!r}: must be positive")').body[0].value
    assert _writes_bad_out(call)
    assert not _writes_bad_out(ast.parse('bad(ConfigError, "tp", tp, "must be positive")').body[0].value)


def _is_njit(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if (target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")) == "njit":
            return True
    return False


def test_kernels_sort_through_stable_sort():
    found = []
    for rel, tree in _modules(skip={"pricing/stable_sort.py"}):
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and _is_njit(fn):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                            and node.value.id == "np" and node.attr in ("argsort", "sort", "unique"):
                        found.append(f"{rel}:{node.lineno} np.{node.attr} in kernel {fn.name}")
    assert not found, "use waveplan.pricing.stable_sort in kernels: " + ", ".join(found)


def test_version_shims_live_in_compat():
    found = []
    for rel, tree in _modules(skip={"pricing/compat.py"}):
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "version_info":
                found.append(f"{rel}:{node.lineno} sys.version_info")
            if isinstance(node, ast.ClassDef) and {getattr(b, "id", getattr(b, "attr", ""))
                                                   for b in node.bases} >= {"str", "Enum"}:
                found.append(f"{rel}:{node.lineno} class {node.name}(str, Enum)")
            if isinstance(node, ast.ImportFrom) and node.module == "enum" \
                    and any(a.name == "StrEnum" for a in node.names):
                found.append(f"{rel}:{node.lineno} from enum import StrEnum")
    assert not found, "use waveplan.pricing.compat: " + ", ".join(found)
