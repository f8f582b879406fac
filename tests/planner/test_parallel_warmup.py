"""The parallel warm-up (`waveplan.planner.parallel_compile`): worker processes compile the
manifest's kernels into the shared cache folder, so that the warm-up's plans, and a fresh
process after them, compile nothing; two cold processes started at once compile once; an
unwritable cache folder starts no worker. Counts numba's compile events; reads no clock.
Subprocess timeouts are generous: a cold compile on a loaded 2-core machine takes minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from waveplan.planner import parallel_compile as pc

COLD_TIMEOUT_S = 1800

WARMUP = """
import dataclasses, json
from waveplan.planner import Planner
from waveplan.planner.warmup import warmup
print(json.dumps(dataclasses.asdict(warmup(Planner, force=True))))
"""

# a fresh process after the warm-up: the warm-up's plans and the README's example plan,
# with numba's compile event counted
FRESH = """
import json
from numba.core import event as ev
from waveplan.planner import Planner
from waveplan.planner.warmup import _run
from waveplan.pricing.step import bundled_step, load_step

class Compiles(ev.Listener):
    def __init__(self):
        self.names = []
    def on_start(self, event):
        self.names.append(event.data["dispatcher"].py_func.__qualname__)
    def on_end(self, event):
        pass

seen = Compiles()
with ev.install_listener("numba:compile", seen):
    _run(Planner)
    Planner.from_preset("qwen3.8-27b", tp=4, sequence_parallel=True, recompute="full",
                        lora_rank=16).plan(load_step(bundled_step("grpo-8x8")), free_bytes=40 * 2**30)
print(json.dumps(seen.names))
"""


def _env(cache, workers):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME")}
    return env | {"WAVEPLAN_CACHE_DIR": str(cache), pc.ENV_WORKERS: str(workers)}


def _start(code, env):
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc):
    try:
        out, err = proc.communicate(timeout=COLD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_the_manifest_lists_warmup_kernels():
    kernels = pc.load_manifest()
    names = {f"{k.module}.{k.name}" for k in kernels}
    for known in ("waveplan.pricing.wave_pricer._admitted", "waveplan.search.greedy.greedy_run",
                  "waveplan.search.multistart.multistart_chunk", "waveplan.search.eject.eject"):
        assert known in names
    assert all(k.cpu_s >= 0 for k in kernels)


def test_shares_are_disjoint_cover_every_kernel_and_balance_cost():
    costs = [5.0, 3.6, 3.5, 2.1, 1.5, 1.4, 1.0, 0.6, 0.5, 0.3, 0.3, 0.2]
    kernels = [pc.Kernel("m", f"k{i}", (), c) for i, c in enumerate(costs)]
    for n in (1, 2, 3, 5, 12, 20):
        split = pc.shares(kernels, n)
        assert len(split) == n
        flat = sorted(i for share in split for i in share)
        assert flat == list(range(len(kernels)))
        loads = [sum(costs[i] for i in share) for share in split]
        assert max(loads) - min(loads) <= max(costs)    # longest-first greedy bound
        assert split == pc.shares(kernels, n)            # deterministic


def test_worker_count_follows_the_environment(monkeypatch):
    monkeypatch.setenv(pc.ENV_WORKERS, "3")
    assert pc.worker_count(10) == 3
    assert pc.worker_count(2) == 2          # at most one per kernel
    monkeypatch.setenv(pc.ENV_WORKERS, "0")
    assert pc.worker_count(10) == 1
    monkeypatch.setenv(pc.ENV_WORKERS, "two")
    with pytest.raises(ValueError, match="WAVEPLAN_WARMUP_WORKERS='two'"):
        pc.worker_count(10)


def test_an_unwritable_cache_folder_starts_no_worker(tmp_path, monkeypatch):
    from waveplan.pricing import jit_cache
    from waveplan.pricing.stable_sort import stable_argsort

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert not pc.writable(blocker / "numba")
    assert pc.writable(tmp_path / "cache")
    monkeypatch.setattr(jit_cache, "cache_dir", lambda environ=None: blocker / "numba")
    monkeypatch.setenv(pc.ENV_WORKERS, "2")
    stable_argsort(np.zeros(3, dtype=np.int64))   # compiled (or loaded) here already
    kernel = pc.Kernel("waveplan.pricing.stable_sort", "stable_argsort",
                       tuple(stable_argsort.signatures[0]), 0.1)
    report = pc.compile_parallel([kernel, kernel])
    assert (report.processes, report.compiled_here, report.compiled_by_workers) == (1, 2, 0)
    stale = pc.compile_parallel([pc.Kernel("waveplan.pricing.stable_sort", "gone", (), 0.1)])
    assert stale.stale == ("waveplan.pricing.stable_sort.gone",)


@pytest.mark.slow
def test_two_cold_processes_compile_once_in_parallel_and_a_fresh_one_compiles_nothing(tmp_path):
    env = _env(tmp_path / "cache", workers=2)
    first, second = _start(WARMUP, env), _start(WARMUP, env)
    reports = [_finish(first), _finish(second)]
    compiled = [r for r in reports if r["compiles"] > 0]
    assert len(compiled) == 1, reports    # the other waited on the lock and loaded
    cold = compiled[0]
    assert cold["processes"] == 2 and cold["stale"] == [], cold
    # the manifest covered every kernel the warm-up's plans need: they only loaded
    assert cold["plan_compiles"] == 0, cold
    assert _finish(_start(FRESH, env)) == []


def test_manifest_types_round_trip_through_plain_json():
    from numba.core import types

    from waveplan.search.kernels import Headers

    arr = types.Array(types.float64, 2, "C")
    samples = [types.int64, types.float64, types.boolean,
               types.Array(types.int64, 1, "C", readonly=True), arr,
               types.BaseTuple.from_types([arr, arr], Headers),
               types.BaseTuple.from_types([types.int64, arr])]
    for ty in samples:
        assert pc.decode_type(json.loads(json.dumps(pc.encode_type(ty)))) == ty
    with pytest.raises(TypeError, match="no manifest encoding"):
        pc.encode_type(types.unicode_type)
