"""Soak: a seeded random loop over steps, presets, parallel layouts, budgets and plan options.

Every case must either give a plan that passes `check_plan` and is deterministic (planned twice
with `deterministic=True`: the same JSON except planning_ms), or raise a documented
`WaveplanError`. Anything else is a failure (recorded with its reproducer arguments).

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
from waveplan.pricing.errors import WaveplanError
from waveplan.pricing.step import Request, Step
from waveplan.search import PackedWave, SearchResult, check_plan

GIB = 2**30
PRESETS = ("qwen3-8b", "llama-3.1-8b", "qwen3.8-27b", "qwen3-30b-a3b", "qwen3.6-35b-a3b")
LAYOUTS = ((1, 1, 1, 1, False), (2, 1, 1, 1, True), (4, 1, 1, 1, True), (8, 1, 1, 1, True),
           (2, 2, 1, 1, True), (1, 1, 2, 1, False), (2, 1, 2, 1, False), (4, 2, 1, 1, True),
           (1, 1, 1, 2, False), (2, 1, 1, 4, True), (3, 1, 1, 1, False))  # tp, cp, pp, ep, sp
PACKERS = ("auto", "auto", "auto", "greedy", "exact", "ffd", "kk", "uniform-width")


@dataclass
class Stats:
    cases: int = 0
    plans: int = 0
    documented_errors: int = 0
    worst_ms: float = 0.0
    worst_case: str = ""
    failures: list[str] = field(default_factory=list)


def _as_result(plan) -> SearchResult:
    waves = tuple(PackedWave(children=tuple(np.asarray(c) for c in w.children),
                             first_slots=w.first_slots, price=w.breakdown) for w in plan.waves)
    return SearchResult(waves, plan.lower_bound_waves, plan.proven_optimal, plan.packer)


def _random_step(rng: random.Random) -> Step:
    n = rng.choice((1, 2, 3, 5, 8, 13, 24, 40, 64, 100))
    slots = ["default"] if rng.random() < 0.7 else ["default", "b", "c"][: rng.randint(1, 3)]
    long_tail = rng.random() < 0.3
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


def _planner(key: tuple) -> Planner:
    if key not in _PLANNERS:
        preset, (tp, cp, pp, ep, sp), recompute, rank = key
        try:
            _PLANNERS[key] = Planner.from_preset(preset, tp=tp, cp=cp, pp=pp, ep=ep, sequence_parallel=sp,
                                                 recompute=recompute, lora_rank=rank)
        except WaveplanError as exc:
            _PLANNERS[key] = exc
    value = _PLANNERS[key]
    if isinstance(value, Exception):
        raise value
    return value


def one_case(rng: random.Random, stats: Stats) -> None:
    key = (rng.choice(PRESETS), rng.choice(LAYOUTS), rng.choice(("full", "full", "selective", "none")),
           rng.choice((8, 16, 64)))
    case_seed = rng.randrange(2**31)
    crng = random.Random(case_seed)
    budget = crng.choice((crng.uniform(1, 8), crng.uniform(8, 40), crng.uniform(40, 140))) * GIB
    packer = crng.choice(PACKERS)
    desc = f"key={key} case_seed={case_seed} budget={budget / GIB:.2f}GiB packer={packer}"
    stats.cases += 1
    try:
        planner = _planner(key)
        step = _random_step(crng)
        n = len(step.requests)
        kwargs = dict(packer=packer, time_budget_ms=crng.choice((1.0, 5.0, 20.0)), seed=crng.randrange(100),
                      deterministic=True)
        if crng.random() < 0.2 and n >= 2:
            size = crng.randint(2, min(4, n))
            kwargs["atomic_units"] = [sorted(crng.sample(range(n), size))]
        if crng.random() < 0.2:
            kwargs["num_waves"] = crng.randint(1, max(1, min(n, 8)))
        t0 = time.perf_counter()
        plan = planner.plan(step, budget, **kwargs)
        ms = (time.perf_counter() - t0) * 1e3
        again = planner.plan(step, budget, **kwargs)
    except WaveplanError:
        stats.documented_errors += 1
        return
    except Exception:
        stats.failures.append(f"{desc}: {traceback.format_exc(limit=3)}")
        return
    stats.plans += 1
    if ms > stats.worst_ms:
        stats.worst_ms, stats.worst_case = ms, f"{desc} n={n} kwargs={kwargs}"
    try:
        check_plan(step, planner.pricer(step), _as_result(plan), budget_bytes=plan.budget_bytes,
                   atomic_units=kwargs.get("atomic_units", ()), num_waves=kwargs.get("num_waves"))
        a, b = plan.to_dict(), again.to_dict()
        a.pop("planning_ms")
        b.pop("planning_ms")
        assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True), "not deterministic"
    except AssertionError as exc:
        stats.failures.append(f"{desc} kwargs={kwargs}: {exc}")


def soak(*, cases: int | None = None, seed: int = 0, time_limit_s: float = 300.0) -> Stats:
    rng = random.Random(seed)
    stats = Stats()
    warm = _planner(("qwen3-8b", (1, 1, 1, 1, False), "full", 16))  # JIT compile outside the timings
    warm.plan(Step.from_requests([Request(id="w", num_tokens=64)]), 40 * GIB, deterministic=True)
    t_end = time.monotonic() + time_limit_s
    while (cases is None or stats.cases < cases) and time.monotonic() < t_end:
        one_case(rng, stats)
    return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--cases", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    stats = soak(cases=args.cases, seed=args.seed, time_limit_s=args.minutes * 60)
    elapsed = time.monotonic() - t0
    lines = [f"soak seed={args.seed}: {stats.cases} cases in {elapsed:.0f} s "
             f"({stats.plans} plans checked, {stats.documented_errors} documented WaveplanErrors, "
             f"{len(stats.failures)} failures)",
             f"worst planning time: {stats.worst_ms:.1f} ms ({stats.worst_case})"]
    lines += [f"FAILURE: {f}" for f in stats.failures[:20]]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 1 if stats.failures else 0


if __name__ == "__main__":
    sys.exit(main())
