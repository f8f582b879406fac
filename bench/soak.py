"""Soak: a seeded random loop over steps, presets, parallel layouts, budgets and plan options.

Every case must either give a plan that passes `check_plan` and is deterministic (planned twice
with `deterministic=True`: the same JSON except planning_ms), or raise a documented
`WaveplanError`. Anything else is a failure (recorded with its reproducer arguments).

The draws are weighted so that most cases plan: layouts valid for the preset, every step slot
with an adapter, budgets 1..20 times a budget at which every request fits alone. A minority (see the P_*
constants) draws invalid layouts, absolute budgets, unknown slots and `num_waves` with a
baseline packer, which end in documented errors.

    .venv/bin/python bench/soak.py --minutes 5 --out bench/results/soak.txt
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from waveplan.planner import Planner
from waveplan.planner.planner import MAX_BUDGET_BYTES
from waveplan.pricing.atomic_io import write_text_atomic
from waveplan.pricing.errors import WaveplanError
from waveplan.pricing.lora import LoraConfig, LoraSlot
from waveplan.pricing.step import Request, Step
from waveplan.search import check_plan

GIB = 2**30
PRESETS = ("qwen3-8b", "llama-3.1-8b", "qwen3.8-27b", "qwen3-30b-a3b", "qwen3.6-35b-a3b")
LAYOUTS = ((1, 1, 1, 1, False), (2, 1, 1, 1, True), (4, 1, 1, 1, True), (8, 1, 1, 1, True),
           (2, 2, 1, 1, True), (1, 1, 2, 1, False), (2, 1, 2, 1, False), (4, 2, 1, 1, True),
           (1, 1, 1, 2, False), (2, 1, 1, 4, True), (3, 1, 1, 1, False))  # tp, cp, pp, ep, sp
PACKERS = ("auto", "auto", "auto", "greedy", "exact", "ffd", "kk", "uniform-width")
BASELINES = ("ffd", "kk", "uniform-width")  # no num_waves: a documented ConfigError
SLOTS = ("default", "b", "c")  # every planner has these LoRA slots
# Most cases should plan: the minority below is drawn on purpose to end in documented errors.
P_INVALID_LAYOUT = 0.08      # any layout of LAYOUTS, valid for the preset or not
P_ABSOLUTE_BUDGET = 0.08     # 10 MiB..8 GiB regardless of the step (often infeasible)
P_UNKNOWN_SLOT = 0.02        # a request in a slot without an adapter
P_BASELINE_NUM_WAVES = 0.1   # num_waves kept with a baseline packer
P_LONG_TAIL = 0.15           # completions around e^8.5 tokens, up to 200k


@dataclass
class Stats:
    cases: int = 0
    plans: int = 0
    documented_errors: int = 0
    errors_by_class: dict[str, int] = field(default_factory=dict)
    invalid_layouts: int = 0
    worst_ms: float = 0.0
    worst_case: str = ""
    failures: list[str] = field(default_factory=list)


def _random_step(rng: random.Random) -> Step:
    n = rng.choice((1, 2, 3, 5, 8, 13, 24, 40, 64, 100))
    slots = ["default"] if rng.random() < 0.7 else list(SLOTS[: rng.randint(1, 3)])
    if rng.random() < P_UNKNOWN_SLOT:
        slots.append("unknown")
    long_tail = rng.random() < P_LONG_TAIL
    if rng.random() < 0.15:  # token form
        reqs = []
        base = [rng.randrange(1000) for _ in range(rng.choice((16, 256, 2048)))]
        for i in range(n):
            keep = rng.randint(0, len(base))
            extra = [rng.randrange(1000) for _ in range(rng.randint(1, 1024))]
            reqs.append(Request.from_tokens(f"t{i}", np.asarray(base[:keep] + extra, dtype=np.int64),
                                            slot=rng.choice(slots), grad=rng.random() < 0.9))
        return Step.from_requests(reqs)
    prompts: dict[str, int] = {}
    reqs = []
    for i in range(n):
        completion = int(rng.lognormvariate(7.0 if not long_tail else 8.5, 1.0)) + 1
        completion = min(completion, 200_000)
        if rng.random() < 0.6:
            key = f"p{rng.randrange(max(1, n // 4))}"
            plen = prompts.setdefault(key, rng.randint(1, 8192))
            reqs.append(Request(id=f"r{i}", num_tokens=plen + completion, prompt=key,
                                num_prompt_tokens=plen, slot=rng.choice(slots), grad=rng.random() < 0.9))
        else:
            reqs.append(Request(id=f"r{i}", num_tokens=completion, slot=rng.choice(slots),
                                grad=rng.random() < 0.9))
    return Step.from_requests(reqs)


_PLANNERS: dict[tuple, Planner | Exception] = {}
_FIXED: dict[tuple, int] = {}
_VALID: dict[str, list[tuple]] = {}


def _planner(key: tuple) -> Planner:
    if key not in _PLANNERS:
        preset, (tp, cp, pp, ep, sp), recompute, rank = key
        lora = LoraConfig(slots=tuple(LoraSlot(name=s, rank=rank) for s in SLOTS))
        try:
            _PLANNERS[key] = Planner.from_preset(preset, tp=tp, cp=cp, pp=pp, ep=ep, sequence_parallel=sp,
                                                 recompute=recompute, lora=lora)
        except WaveplanError as exc:
            _PLANNERS[key] = exc
    value = _PLANNERS[key]
    if isinstance(value, Exception):
        raise value
    return value


def _valid_layouts(preset: str) -> list[tuple]:
    """The layouts of LAYOUTS that the preset accepts (validity does not depend on recompute or
    LoRA)."""
    if preset not in _VALID:
        ok = []
        for layout in LAYOUTS:
            try:
                _planner((preset, layout, "full", 16))
            except WaveplanError:
                continue
            ok.append(layout)
        _VALID[preset] = ok
    return _VALID[preset]


def _fixed_cost(key: tuple) -> int:
    """Admitted bytes of the cheapest wave: one 1-token gradient request with its pending
    gradients."""
    if key not in _FIXED:
        planner = _planner(key)
        step = Step.from_requests([Request(id="x", num_tokens=1)])
        _FIXED[key] = planner.pricer(step).price([np.asarray([0])],
                                                 first_slots=frozenset({"default"})).admitted_bytes
    return _FIXED[key]


def _base_budget(key: tuple, planner: Planner, step: Step) -> int:
    """A budget at which (nearly always) every request fits alone: the largest exact price of
    the three longest requests alone, pending gradients included, and the fixed cost. Budgets
    are drawn as multiples of it, so that most cases can plan."""
    pricer = planner.pricer(step)
    worst = _fixed_cost(key)
    for i in np.argsort(-step.lengths, kind="stable")[:3]:
        r = step.requests[int(i)]
        fs = frozenset({r.slot}) if r.grad else frozenset()
        worst = max(worst, pricer.price([np.asarray([int(i)])], first_slots=fs).admitted_bytes)
    return worst


def one_case(rng: random.Random, stats: Stats) -> None:
    preset = rng.choice(PRESETS)
    invalid_layout = rng.random() < P_INVALID_LAYOUT
    layout = rng.choice(LAYOUTS if invalid_layout else _valid_layouts(preset))
    key = (preset, layout, rng.choice(("full", "full", "selective", "none")), rng.choice((8, 16, 64)))
    case_seed = rng.randrange(2**31)
    crng = random.Random(case_seed)
    absolute = crng.random() < P_ABSOLUTE_BUDGET
    factor = crng.choice((crng.uniform(1.0, 1.5), crng.uniform(1.5, 4), crng.uniform(4, 20)))
    packer = crng.choice(PACKERS)
    stats.cases += 1
    budget = crng.uniform(0.01, 8) * GIB
    desc = f"key={key} case_seed={case_seed} budget={budget / GIB:.2f}GiB packer={packer}"
    try:
        planner = _planner(key)
        step = _random_step(crng)
        if not absolute:
            budget = min(float(MAX_BUDGET_BYTES), _base_budget(key, planner, step) * factor)
            desc = (f"key={key} case_seed={case_seed} budget={budget / GIB:.2f}GiB "
                    f"(x{factor:.2f}) packer={packer}")
        n = len(step.requests)
        kwargs = dict(packer=packer, time_budget_ms=crng.choice((1.0, 5.0, 20.0)), seed=crng.randrange(100),
                      deterministic=True)
        if crng.random() < 0.2 and n >= 2:
            size = crng.randint(2, min(4, n))
            kwargs["atomic_units"] = [sorted(crng.sample(range(n), size))]
        if crng.random() < 0.2 and (packer not in BASELINES or crng.random() < P_BASELINE_NUM_WAVES):
            kwargs["num_waves"] = crng.randint(1, max(1, min(n, 8)))
        t0 = time.perf_counter()
        plan = planner.plan(step, budget, **kwargs)
        ms = (time.perf_counter() - t0) * 1e3
        again = planner.plan(step, budget, **kwargs)
    except WaveplanError as exc:
        stats.documented_errors += 1
        name = type(exc).__name__
        stats.errors_by_class[name] = stats.errors_by_class.get(name, 0) + 1
        if invalid_layout and layout not in _valid_layouts(preset):
            stats.invalid_layouts += 1
        return
    except Exception:
        stats.failures.append(f"{desc}: {traceback.format_exc(limit=3)}")
        return
    stats.plans += 1
    if ms > stats.worst_ms:
        stats.worst_ms, stats.worst_case = ms, f"{desc} n={n} kwargs={kwargs}"
    try:
        check_plan(step, planner.pricer(step), plan, budget_bytes=plan.budget_bytes,
                   atomic_units=kwargs.get("atomic_units", ()), num_waves=kwargs.get("num_waves"))
        a, b = plan.to_dict(), again.to_dict()
        a.pop("planning_ms")
        b.pop("planning_ms")
        a.pop("compile_ms", None)
        b.pop("compile_ms", None)
        assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True), "not deterministic"
    except AssertionError as exc:
        stats.failures.append(f"{desc} kwargs={kwargs}: {exc}")


def soak(*, cases: int | None = None, seed: int = 0, time_limit_s: float | None = 300.0) -> Stats:
    """Run `cases` random cases (None: no count limit) or until `time_limit_s` have passed
    (None: no time limit); at least one of the two must be given. With a count and no time
    limit, the cases run are the same on any machine (tests use that)."""
    if cases is None and time_limit_s is None:
        raise ValueError("soak: give cases or time_limit_s (or both)")
    rng = random.Random(seed)
    stats = Stats()
    warm = _planner(("qwen3-8b", (1, 1, 1, 1, False), "full", 16))  # JIT compile outside the timings
    warm.plan(Step.from_requests([Request(id="w", num_tokens=64)]), 40 * GIB, deterministic=True)
    t_end = None if time_limit_s is None else time.monotonic() + time_limit_s
    while (cases is None or stats.cases < cases) and (t_end is None or time.monotonic() < t_end):
        one_case(rng, stats)
    return stats


def _warm_up() -> None:
    """Import OR-Tools and load the numba kernels once, so the worst planning time is a
    planning time, not the process's one-time start-up (a new configuration's first plan
    still builds its pricer and envelope, and counts)."""
    planner = Planner.from_preset("qwen3-8b")
    step = Step.from_requests([Request(id=f"w{i}", num_tokens=512 * (i + 1), prompt=f"p{i % 2}",
                                       num_prompt_tokens=256) for i in range(6)])
    for packer in ("exact", "auto"):
        planner.plan(step, 3 * GIB, packer=packer, deterministic=True)
    try:  # the exact packer imports CP-SAT lazily, only when a gap is left
        from ortools.sat.python import cp_model
    except ImportError:
        return
    model = cp_model.CpModel()
    model.Add(model.NewIntVar(0, 1, "x") >= 1)
    cp_model.CpSolver().Solve(model)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--cases", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    _warm_up()
    t0 = time.monotonic()
    stats = soak(cases=args.cases, seed=args.seed, time_limit_s=args.minutes * 60)
    elapsed = time.monotonic() - t0
    lines = [f"soak seed={args.seed}: {stats.cases} cases in {elapsed:.0f} s "
             f"({stats.plans} plans checked, {stats.documented_errors} documented WaveplanErrors, "
             f"{len(stats.failures)} failures)",
             "documented errors by class: " + (", ".join(
                 f"{k} {v}" for k, v in sorted(stats.errors_by_class.items())) or "none")
             + f" ({stats.invalid_layouts} of them from invalid layouts)",
             f"worst planning time: {stats.worst_ms:.1f} ms ({stats.worst_case})"]
    lines += [f"FAILURE: {f}" for f in stats.failures[:20]]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(args.out), text)
    return 1 if stats.failures else 0


if __name__ == "__main__":
    sys.exit(main())
