"""Warm-up: compile (or load from the cache) every numba kernel a plan can need, in one go.

`warmup(Planner)` plans a fixed set of tiny steps through the real code paths — length and token
form, two LoRA slots with and without gradients, the greedy packer, the improvement search,
the exact packer (when ortools is installed), the baseline packers, a fixed wave count, an
atomic unit that needs the split ladder, learned profiles — so that every kernel
specialisation a later plan uses exists in this process. It runs under the cache folder's
file lock (`jit_cache.compile_lock`): concurrent cold processes on one node compile once,
the others wait and load.

A cold warm-up first compiles the kernels in parallel (`parallel_compile`: this process
and one worker process per core compile disjoint shares into the cache folder), then runs
the plans, which load them. The planner class is passed in (`Planner.plan` calls
`ensure_warm(Planner)`): this module sits below the planner and imports nothing of it.

`ensure_warm(Planner)` does it once per process; `Planner.plan` calls it before its first plan, so
after the first plan of a process no kernel compiles. A warm-up that completes leaves a marker
in the cache folder, keyed by waveplan's and numba's versions and the stamps of the kernel
modules' files (the same things numba keys its cache entries by); while it is there,
`ensure_warm(Planner)` skips the tiny plans: every kernel is on disk, and a plan loads what it needs
(milliseconds) instead of loading everything up front. `warmup()` always runs them. Cost: one
pass over the tiny steps (~0.2 s once loaded); cold, the compile of every kernel.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import numpy as np

from waveplan.pricing import jit_cache
from waveplan.pricing.compile_clock import CompileClock
from waveplan.pricing.errors import InfeasibleError
from waveplan.pricing.lora import LoraConfig, LoraSlot
from waveplan.pricing.step import Request, Step, bundled_step, load_step

from .cold_start import warm_marker

WARMUP_PRESET = "qwen3-8b"
# a bundled step planned by AUTO and EXACT. Its greedy now meets the envelope bound, so the
# improvement stages (multistart, anneal, eject, CP-SAT) do not run here; their kernels are kept
# in the manifest by hand (planner/data/warmup_kernels.json) and compile in the parallel warm-up
GAP_CASE = ("llama-3.1-8b", {"tp": 2, "recompute": "selective", "lora_rank": 8}, "grpo-8x8", 80)
# a large step (>= packers.EJECT_MIN_ATOMS atoms) with a gap: the multistart, `eliminate`
# inside it and the ejection chains run (deterministic: the budget buys a fixed count)
LARGE_GAP_CASE = ("llama-3.1-8b", {"tp": 2, "recompute": "selective", "lora_rank": 8},
                  "grpo-32x16", 80, 50)
SLOTS = ("a", "b")


@dataclass(frozen=True)
class WarmupReport:
    """What a warm-up did: seconds in all, seconds compiling (0: everything came from the
    cache or was already loaded), kernels compiled, plans run, the cache folder, and the
    packers skipped (the exact packer without ortools)."""

    seconds: float
    compile_s: float
    compiles: int
    jit_s: float
    plans: int
    cache_dir: str
    skipped: tuple[str, ...] = ()
    processes: int = 1          # processes that compiled (1: this one only)
    wait_s: float = 0.0         # seconds waiting for worker processes' compiles (in compile_s)
    plan_compiles: int = 0      # kernels the plans compiled after the parallel compile (0: it
                                # covered every kernel, see `parallel_compile`)
    stale: tuple[str, ...] = ()  # manifest entries that failed to compile (stale manifest)

    def line(self) -> str:
        procs = f" over {self.processes} processes" if self.processes > 1 else ""
        what = (f"compiled {self.compiles} kernels{procs} in {self.compile_s:.2f} s"
                if self.compiles else f"loaded kernels in {self.jit_s:.2f} s (nothing to compile)")
        skipped = f"; skipped {', '.join(self.skipped)}" if self.skipped else ""
        return (f"warm-up: {self.plans} plans, {what}, {self.seconds:.2f} s in all; "
                f"cache {self.cache_dir}{skipped}")


def _requests(token_form: bool, rng: np.random.Generator) -> list[Request]:
    """Three prompts x three completions over two slots, one no-grad request per slot."""
    out = []
    for p in range(3):
        prompt = rng.integers(0, 1000, size=64 + 32 * p).astype(np.int64)
        for c in range(3):
            slot = SLOTS[(p + c) % 2]
            grad = not (p == 2 and c == 2)
            n = 100 + 40 * c + 10 * p
            rid = f"p{p}-c{c}"
            if token_form:
                tokens = np.concatenate([prompt, rng.integers(0, 1000, size=n).astype(np.int64)])
                out.append(Request(id=rid, num_tokens=len(tokens), tokens=tokens, slot=slot, grad=grad))
            else:
                out.append(Request(id=rid, num_tokens=len(prompt) + n, prompt=f"g{p}",
                                   num_prompt_tokens=len(prompt), slot=slot, grad=grad))
    if token_form:
        out.append(Request(id="solo", num_tokens=300, tokens=rng.integers(0, 1000, size=300).astype(np.int64),
                           slot=SLOTS[0]))
    else:
        out.append(Request(id="solo", num_tokens=300, slot=SLOTS[0]))
    return out


def _plans(planner) -> tuple[int, tuple[str, ...]]:
    """Run the representative plans on `planner`; return (plans run, packers skipped)."""
    rng = np.random.default_rng(0)
    length = Step(requests=tuple(_requests(False, rng)))
    tokens = Step(requests=tuple(_requests(True, rng)))
    whole = planner.plan(length, free_bytes=2**50, packer="greedy", deterministic=True)
    alone = max(planner.plan(Step(requests=(r,)), free_bytes=2**50, packer="greedy",
                             deterministic=True).waves[0].admitted_bytes for r in length.requests)
    big = whole.waves[0].admitted_bytes
    budget = int(alone + 0.4 * (big - alone))   # several waves, every request fits alone
    runs = 1 + len(length.requests)
    skipped: set[str] = set()
    for step in (length, tokens):
        count = planner.plan(step, free_bytes=budget, packer="greedy", deterministic=True).num_waves
        for packer in ("auto", "ffd", "kk", "uniform-width", "exact"):
            try:
                planner.plan(step, free_bytes=budget, packer=packer, deterministic=True,
                             time_budget_ms=20)
            except ModuleNotFoundError as exc:   # the exact packer needs ortools
                if exc.name is None or not exc.name.startswith("ortools"):
                    raise
                skipped.add(packer)
            runs += 1
        planner.plan(step, free_bytes=budget, num_waves=count + 1, deterministic=True, time_budget_ms=20)
        # the split ladder: the requests of prompt g0 must share a wave, which does not fit
        # flat under a budget that barely holds the largest request (every rung is priced,
        # whether one fits or not)
        unit = [i for i, r in enumerate(step.requests) if r.id.startswith("p0-")]
        try:
            planner.plan(step, free_bytes=int(alone * 1.02), atomic_units=[unit],
                         deterministic=True, time_budget_ms=20)
        except InfeasibleError:
            pass
        runs += 3
    return runs, tuple(sorted(skipped))


def _run(planner_cls) -> tuple[int, tuple[str, ...]]:
    from waveplan.planner.profiles import ProfileStore

    lora = LoraConfig(slots=(LoraSlot(name=SLOTS[0]), LoraSlot(name=SLOTS[1], rank=64)))
    planner = planner_cls.from_preset(WARMUP_PRESET, lora=lora)
    runs, skipped = _plans(planner)
    # learned profiles: observe a wave of each kind, then plan again through them
    learned = planner_cls.from_model(planner.model, profiles=ProfileStore())
    rng = np.random.default_rng(1)
    step = Step(requests=tuple(_requests(False, rng)))
    plan = learned.plan(step, free_bytes=2**50, packer="greedy", deterministic=True)
    for wave in plan.waves:   # into the store itself: a made-up peak is no miss to report
        learned.profiles.observe(wave.signature, wave.loads, static_raw_bytes=wave.static_raw_bytes,
                                 peak_bytes=math.ceil(1.2 * wave.static_raw_bytes))
    more, _ = _plans(learned)
    # the improvement search past the greedy: multistart (AUTO), CP-SAT (EXACT)
    name, kwargs, step_name, gib = GAP_CASE
    gap = planner_cls.from_preset(name, **kwargs)
    step = load_step(bundled_step(step_name))
    extra = 0
    for packer in ("auto", "exact"):
        try:
            gap.plan(step, free_bytes=gib * 2**30, packer=packer, deterministic=True, time_budget_ms=5)
        except ModuleNotFoundError as exc:   # the exact packer needs ortools
            if exc.name is None or not exc.name.startswith("ortools"):
                raise
            skipped = tuple(sorted(set(skipped) | {packer}))
        extra += 1
    name, kwargs, step_name, gib, budget_ms = LARGE_GAP_CASE
    large = planner_cls.from_preset(name, **kwargs)
    large.plan(load_step(bundled_step(step_name)), free_bytes=gib * 2**30, deterministic=True,
                 time_budget_ms=budget_ms)
    return runs + more + 2 + extra, skipped


def _mark(path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError:
        pass   # a read-only cache: every process warms up in full


_LOCK = threading.Lock()
_STATE = {"done": False, "running": False}


def process_setup() -> None:
    """What numba does once per process on its first dispatch, outside its compiler lock (so
    outside `CompileClock`): `entrypoints.init_all` reads every installed distribution's entry
    points, and `typeof` of the first array imports `numpy.ma`. Done here, before a plan's
    clock starts, so the first plan of a process reports its planning alone
    (docs/faq.md#overhead). Idempotent."""
    import numpy.ma  # noqa: F401 - imported for its side effect
    from numba.core import entrypoints

    entrypoints.init_all()


def warmup(planner_cls, *, force: bool = False, lazy: bool = False) -> WarmupReport | None:
    """Compile or load every kernel a plan can need (see the module docstring), once per
    process unless `force`. `lazy`: skip the plans when the cache folder's warm marker is
    there (checked again once the lock is held: a process that waited for another's compile
    skips them). Returns what it did, or None when nothing was run: the process was already
    warm, is warming up in this very call stack, or (`lazy`) the cache is."""
    import numba

    if numba.config.DISABLE_JIT:   # interpreted kernels (`cold_start`): nothing to compile
        return None
    with _LOCK:
        if _STATE["running"] or (_STATE["done"] and not force):
            return None
        _STATE["running"] = True
    try:
        process_setup()
        marker = warm_marker()
        if lazy and marker.exists():
            _STATE["done"] = True
            return None
        t0 = time.perf_counter()
        parallel = None
        with jit_cache.compile_lock(), CompileClock() as clock:
            if lazy and marker.exists():
                _STATE["done"] = True
                return None
            if not marker.exists():   # cold: compile every kernel at once, the plans load them
                from .parallel_compile import compile_parallel

                parallel = compile_parallel()
            with CompileClock() as plans_clock:
                runs, skipped = _run(planner_cls)
            _mark(marker)
        _STATE["done"] = True
        wait_s = parallel.wait_s if parallel else 0.0
        return WarmupReport(seconds=time.perf_counter() - t0, compile_s=clock.compile_s + wait_s,
                            compiles=clock.compiles + (parallel.compiled_by_workers if parallel else 0),
                            jit_s=clock.jit_s + wait_s, plans=runs,
                            cache_dir=str(jit_cache.cache_dir()), skipped=skipped,
                            processes=parallel.processes if parallel else 1, wait_s=wait_s,
                            plan_compiles=plans_clock.compiles,
                            stale=parallel.stale if parallel else ())
    finally:
        _STATE["running"] = False


def ensure_warm(planner_cls) -> WarmupReport | None:
    """`warmup(lazy=True)` unless this process is warm already; returns what it did (None:
    nothing). O(1) when warm."""
    if not _STATE["done"]:
        return warmup(planner_cls, lazy=True)
    return None
