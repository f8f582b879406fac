"""waveplan.planner: the per-step API, plans, learned profiles, reports, replay and the CLI.

    from waveplan.planner import Planner, load_step
    planner = Planner.from_preset("qwen3.8-27b", tp=4, sequence_parallel=True)
    plan = planner.plan(load_step("step.jsonl"), free_bytes=40 * 2**30)

The names below load on first use (PEP 562), so that `waveplan.planner.cli` can decide how to
run the kernels (`cold_start`) before any kernel module is imported.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Request": "waveplan.pricing.step",
    "Step": "waveplan.pricing.step",
    "load_step": "waveplan.pricing.step",
    "Plan": "waveplan.planner.plan",
    "PlanWave": "waveplan.planner.plan",
    "Planner": "waveplan.planner.planner",
    "ProfileStore": "waveplan.planner.profiles",
    "load_profiles": "waveplan.planner.profiles",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
