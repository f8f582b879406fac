"""waveplan.planner: the per-step API, plans, learned profiles, reports, replay and the CLI.

    from waveplan.planner import Planner, load_step
    planner = Planner.from_preset("qwen3.8-27b", tp=4, sequence_parallel=True)
    plan = planner.plan(load_step("step.jsonl"), free_bytes=40 * 2**30)
"""

from waveplan.pricing.step import Request, Step, load_step

from .plan import Plan, PlanWave
from .planner import Planner
from .profiles import ProfileStore, load_profiles

__all__ = ["Plan", "PlanWave", "Planner", "ProfileStore", "Request", "Step", "load_profiles",
           "load_step"]
