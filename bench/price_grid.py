"""The price grid: every preset x layout x recompute x backend x head on the bundled steps,
and the plans of the bundled steps and bench cases, as one JSON file (the refactor check).

    .venv/bin/python bench/price_grid.py OUT.json [--quick]

Each cell records the model's basis and reasons (or the one-line error of an invalid
configuration) and, per bundled step, the whole step priced as one first wave (raw and
admitted bytes, terms, binding point, basis), its second half as two split children of a
later wave, the admitted fast path, the envelope's digest and the lower bound at a budget
of half the wave. The plans are `Plan.to_json` without the timings, deterministic. Two runs
of the same code give byte-identical files; a change that keeps every price gives the same
file too (diff before and after). `--quick` keeps one step and the chunked head.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

PRESETS_ORDER = None  # every bundled preset
# (name, tp, sp, cp, pp, ep, etp); EP and ETP layouts only on MoE presets
LAYOUTS = (
    ("TP1", 1, False, 1, 1, 1, None), ("TP2", 2, False, 1, 1, 1, None),
    ("TP2+SP", 2, True, 1, 1, 1, None), ("TP4", 4, False, 1, 1, 1, None),
    ("TP4+SP", 4, True, 1, 1, 1, None), ("TP8+SP", 8, True, 1, 1, 1, None),
    ("CP2", 1, False, 2, 1, 1, None), ("TP4+SP+CP2", 4, True, 2, 1, 1, None),
    ("TP8+SP+CP2", 8, True, 2, 1, 1, None), ("PP2", 1, False, 1, 2, 1, None),
    ("TP4+SP+PP2", 4, True, 1, 2, 1, None),
)
MOE_LAYOUTS = (
    ("EP2", 1, False, 1, 1, 2, None), ("EP4", 1, False, 1, 1, 4, None),
    ("TP4+SP+EP2", 4, True, 1, 1, 2, None), ("TP2+SP+ETP1", 2, True, 1, 1, 1, 1),
    ("TP4+SP+ETP1", 4, True, 1, 1, 1, 1), ("TP4+SP+ETP2", 4, True, 1, 1, 1, 2),
    ("TP2+SP+EP2+ETP1", 2, True, 1, 1, 2, 1), ("TP4+SP+EP2+ETP1", 4, True, 1, 1, 2, 1),
    ("EP2+PP2", 1, False, 1, 2, 2, None),
)
RECOMPUTE = ("full", "selective", "none")
BACKENDS = ("te-gpu", "torch-cpu")
HEADS = ("chunked:512", "full-native", "full-te")
STEPS = ("grpo-8x8", "grpo-32x16", "sft-64")
GIB = 2**30


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        if a is None:
            h.update(b"none")
        else:
            h.update(np.ascontiguousarray(np.asarray(a, dtype=np.float64)).tobytes())
    return h.hexdigest()[:16]


def _prices(model, step) -> dict:
    from waveplan.pricing.wave_pricer import WavePricer

    pricer = WavePricer.build(step, model)
    n = len(step.requests)
    first = frozenset(r.slot for r in step.requests if r.grad)
    whole = pricer.price([np.arange(n)], first_slots=first)
    half = np.arange(n // 2, n)
    children = [half[: len(half) // 2], half[len(half) // 2:]]
    split = pricer.price(children, first_slots=frozenset())
    env = pricer.envelope()
    out = {"whole": whole.to_dict(), "split": split.to_dict(),
           "envelope": _digest([env.const, env.presence, env.coef, env.pad, env.seg, env.pending]),
           "bound": int(pricer.lower_bound_waves(max(whole.admitted_bytes / 2, 1.0)))}
    if model.parallel.pp == 1:
        out["admitted"] = float(pricer.admitted([np.arange(n)], first_slots=first))
    return out


def cells(quick: bool):
    from waveplan.pricing.presets import list_presets, load_preset

    heads = HEADS[:1] if quick else HEADS
    for preset in list_presets():
        geometry = load_preset(preset)
        layouts = LAYOUTS + (MOE_LAYOUTS if geometry.moe is not None else ())
        for layout in layouts:
            for mode in RECOMPUTE:
                for backend in BACKENDS:
                    for head in heads:
                        yield preset, geometry, layout, mode, backend, head


def price_grid(quick: bool = False) -> dict:
    from waveplan.pricing.errors import WaveplanError
    from waveplan.pricing.lora import LoraConfig, LoraSlot
    from waveplan.pricing.model import PricingModel
    from waveplan.pricing.parallel import ParallelLayout, Recompute
    from waveplan.pricing.step import bundled_step, load_step

    steps = {name: load_step(bundled_step(name)) for name in (STEPS[:1] if quick else STEPS)}
    grid = {}
    for preset, geometry, layout, mode, backend, head in cells(quick):
        name, tp, sp, cp, pp, ep, etp = layout
        key = f"{preset}|{name}|{mode}|{backend}|{head}"
        try:
            model = PricingModel.build(
                geometry, parallel=ParallelLayout(tp=tp, sequence_parallel=sp, cp=cp, pp=pp,
                                                  ep=ep, etp=etp),
                recompute=Recompute(mode=mode), lora=LoraConfig(slots=(LoraSlot(rank=16),)),
                backend=backend, head=head)
        except WaveplanError as exc:
            grid[key] = {"invalid": str(exc)}
            continue
        cell = {"basis": model.basis, "reasons": list(model.reasons),
                "credit": model.credit.to_dict()}
        for step_name, step in steps.items():
            if head != HEADS[0] and step_name != STEPS[0]:
                continue   # the other heads on the first step only
            try:
                cell[step_name] = _prices(model, step)
            except WaveplanError as exc:
                cell[step_name] = {"error": str(exc)}
        grid[key] = cell
    return grid


def _strip(plan_json: str) -> dict:
    doc = json.loads(plan_json)
    for k in ("planning_ms", "compile_ms"):
        doc.pop(k, None)
    return doc


def plans(quick: bool = False) -> dict:
    from waveplan.planner import Planner
    from waveplan.pricing.step import bundled_step, load_step

    configs = (
        ("qwen3.8-27b TP4+SP full", "qwen3.8-27b", dict(tp=4, sequence_parallel=True), 40),
        ("qwen3-8b TP1 selective", "qwen3-8b", dict(recompute="selective"), 40),
        ("qwen3-32b TP4+SP PP2", "qwen3-32b", dict(tp=4, pp=2, sequence_parallel=True), 40),
        ("qwen3-30b-a3b EP2", "qwen3-30b-a3b", dict(ep=2), 40),
        ("qwen3.6-35b-a3b TP2+SP none", "qwen3.6-35b-a3b",
         dict(tp=2, sequence_parallel=True, recompute="none"), 60),
    )
    if quick:
        configs = configs[:1]
    out = {}
    for label, preset, kw, gib in configs:
        planner = Planner.from_preset(preset, **kw)
        for step_name in STEPS:
            step = load_step(bundled_step(step_name))
            try:
                plan = planner.plan(step, gib * GIB, deterministic=True)
                out[f"{label}|{step_name}"] = _strip(plan.to_json())
            except Exception as exc:  # noqa: BLE001 - an infeasible plan is recorded as such
                out[f"{label}|{step_name}"] = {"error": f"{type(exc).__name__}: {exc}"}
    # the bench cases (bench/pipeline_plans.py): qwen3-32b, grpo-32x16, TP4+SP, PP1/2/4
    step = load_step(bundled_step("grpo-32x16"))
    for pp in (1, 2, 4) if not quick else (1,):
        planner = Planner.from_preset("qwen3-32b", tp=4, pp=pp, sequence_parallel=True)
        out[f"pipeline_plans PP{pp}"] = _strip(planner.plan(step, 40 * GIB, deterministic=True).to_json())
    return out


def search_cases(quick: bool = False) -> dict:
    """bench/bench_search.py's generated steps, packed deterministically."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_search import bench_case

    from waveplan.search import SearchOptions, pack

    out = {}
    for n in (32, 128) if quick else (32, 64, 128, 512):
        step, make, budget = bench_case(n)
        result = pack(step, make(), budget_bytes=budget, options=SearchOptions(deterministic=True))
        out[str(n)] = {"waves": [[int(i) for c in w.children for i in c] for w in result.waves],
                       "children": [[len(c) for c in w.children] for w in result.waves],
                       "admitted": [float(w.price.admitted_bytes) for w in result.waves],
                       "bound": int(result.lower_bound_waves)}
    return out


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    quick = "--quick" in argv
    from waveplan.pricing.atomic_io import write_text_atomic

    doc = {"grid": price_grid(quick), "plans": plans(quick), "search": search_cases(quick)}
    invalid = sum(1 for c in doc["grid"].values() if "invalid" in c)
    print(f"{len(doc['grid'])} cells ({invalid} invalid), {len(doc['plans'])} plans, "
          f"{len(doc['search'])} search cases", file=sys.stderr)
    write_text_atomic(argv[0], json.dumps(doc, indent=0, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
