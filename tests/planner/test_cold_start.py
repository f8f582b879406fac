"""The command line's cold start (`waveplan.planner.cold_start`): with no completed warm-up in
the cache folder, `waveplan plan` runs the kernels interpreted and gives the plan
`--deterministic` gives, byte for byte; one detached process compiles the kernels for the next
command, which then runs compiled and compiles nothing. Also the cases that compile instead,
and bad input. Reads no clock: waits are bounded by generous limits only (a cold compile on a
loaded 2-core machine takes minutes)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numba
import pytest

from waveplan.planner import cli, cold_start
from waveplan.pricing import jit_cache

COLD_TIMEOUT_S = 1800
PLAN = ["plan", "grpo-8x8", "--model", "qwen3-8b", "--tp", "1", "--free-gib", "20", "--json"]


def _env(cache: Path, mode: str | None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME", "NUMBA_DISABLE_JIT", cold_start.ENV_MODE)}
    env["WAVEPLAN_CACHE_DIR"] = str(cache)
    if mode is not None:
        env[cold_start.ENV_MODE] = mode
    return env


def _cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "waveplan.planner.cli", *args], env=env,
                          capture_output=True, text=True, timeout=COLD_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _plan(text: str) -> dict:
    plan = json.loads(text)
    plan.pop("planning_ms")
    return plan


@pytest.fixture(scope="module")
def compiled_plan() -> dict:
    """The deterministic plan, planned in this process (its kernels compile: imported)."""
    import waveplan.pricing.wave_pricer  # noqa: F401 - a kernel module: cli.main compiles
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(PLAN + ["--deterministic"]) == 0
    plan = json.loads(out.getvalue())
    plan.pop("planning_ms")
    plan.pop("compile_ms", None)
    return plan


def _marker(cache: Path) -> Path:
    return jit_cache.cache_dir({"WAVEPLAN_CACHE_DIR": str(cache)}) / cold_start.warm_marker().name


@pytest.mark.slow
def test_a_cold_plan_runs_interpreted_and_gives_the_deterministic_plan(tmp_path, compiled_plan):
    cache = tmp_path / "cache"
    done = _cli(PLAN, _env(cache, "never"))
    assert "ran them interpreted" in done.stderr
    assert "WAVEPLAN_COLD_COMPILE=never" in done.stderr
    assert _plan(done.stdout) == compiled_plan       # no --deterministic given: forced
    assert "compile_ms" not in done.stdout
    folder = jit_cache.cache_dir({"WAVEPLAN_CACHE_DIR": str(cache)})
    assert not list(folder.rglob("*.nbi")) and not _marker(cache).exists()   # nothing compiled
    price = _cli(["price", "grpo-8x8", "--model", "qwen3-8b", "--json"], _env(cache, "never"))
    assert "ran them interpreted" in price.stderr and json.loads(price.stdout)


@pytest.mark.slow
def test_the_background_compile_makes_the_next_command_compiled(tmp_path, compiled_plan):
    cache = tmp_path / "cache"
    first = _cli(PLAN, _env(cache, None))            # the default mode: background
    match = re.search(r"compiling them in the background now \(pid (\d+);", first.stderr)
    assert match, first.stderr
    assert _plan(first.stdout) == compiled_plan
    marker = _marker(cache)
    deadline = time.monotonic() + COLD_TIMEOUT_S      # a limit, not a measurement
    while not marker.exists():
        assert time.monotonic() < deadline, "the background compile never finished"
        time.sleep(1)
    with jit_cache.compile_lock(marker.parent):      # its warm-up is over (it marks, then releases)
        pass
    log = (marker.parent / cold_start.LOG_NAME).read_text()
    assert "warm-up:" in log and "compiled" in log
    second = _cli(PLAN + ["--deterministic"], _env(cache, None))
    assert "interpreted" not in second.stderr
    assert _plan(second.stdout) == compiled_plan
    assert "compile_ms" not in second.stdout          # loaded from the cache, compiled nothing


def test_the_decision_compiles_for_other_commands_large_budgets_and_foreground(monkeypatch, tmp_path):
    # this process has compiled kernels already; pretend it has not, to reach each rule
    monkeypatch.setattr(cold_start, "_kernels_imported", lambda: False)
    monkeypatch.setenv("WAVEPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(cold_start.ENV_MODE, raising=False)
    for argv in (["study"], ["-v", "warmup"], ["plan", "--help"], ["plan", "--time-budget-ms", "200"],
                 ["plan", "--time-budget-ms=21"]):
        assert cold_start.prepare(argv).interpreted is False, argv
    monkeypatch.setenv(cold_start.ENV_MODE, "foreground")
    assert cold_start.prepare(["plan"]).interpreted is False
    assert numba.config.DISABLE_JIT is False or numba.config.DISABLE_JIT == 0
    assert not list(tmp_path.rglob(cold_start.LOG_NAME))   # no background compile started


def test_kernels_imported_already_means_compiled(monkeypatch, tmp_path):
    monkeypatch.setenv("WAVEPLAN_CACHE_DIR", str(tmp_path))
    import waveplan.pricing.wave_pricer  # noqa: F401 - a kernel module
    assert cold_start._kernels_imported()
    assert cold_start.prepare(["plan"]).interpreted is False


def test_argument_scan():
    assert cold_start._command(["-v", "plan", "x"]) == "plan"
    assert cold_start._command([]) is None
    assert cold_start._budget_ms(["plan", "--time-budget-ms", "7.5"]) == 7.5
    assert cold_start._budget_ms(["plan", "--time-budget-ms=abc"]) is None
    assert cold_start._budget_ms(["plan"]) is None


def test_kernel_files_are_the_kernel_modules():
    names = {p.name for p in cold_start.kernel_files()}
    assert {"wave_pricer.py", "greedy.py", "stable_sort.py"} <= names
    assert "cold_start.py" not in names and "jit_cache.py" not in names


@pytest.mark.slow
def test_a_cold_command_that_fails_prints_one_line_and_starts_nothing(tmp_path):
    cache = tmp_path / "cache"
    done = subprocess.run([sys.executable, "-m", "waveplan.planner.cli", *PLAN, "--free-gib", "abc"],
                          env=_env(cache, None), capture_output=True, text=True, timeout=COLD_TIMEOUT_S)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "free_gib" in done.stderr
    folder = jit_cache.cache_dir({"WAVEPLAN_CACHE_DIR": str(cache)})
    assert not (folder / cold_start.LOG_NAME).exists()    # no background compile started


def test_a_bad_mode_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv(cold_start.ENV_MODE, "later")
    assert cli.main(["plan"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "WAVEPLAN_COLD_COMPILE" in err and "later" in err


def test_lock_is_held_sees_a_holder(tmp_path):
    assert not jit_cache.lock_is_held(tmp_path)
    with jit_cache.compile_lock(tmp_path):
        assert jit_cache.lock_is_held(tmp_path)
    assert not jit_cache.lock_is_held(tmp_path)


SETUP_BEFORE_THE_CLOCK = """
import sys
from numba.core import entrypoints
from waveplan.planner import Planner
from waveplan.planner.warmup import ensure_warm
assert not entrypoints._already_initialized and "numpy.ma" not in sys.modules
assert ensure_warm(Planner) is None          # the marker is there: no tiny plans
print(entrypoints._already_initialized, "numpy.ma" in sys.modules)
"""


def test_a_warm_process_pays_numbas_one_time_setup_before_the_plans_clock(tmp_path):
    # numba's first dispatch reads every distribution's entry points and imports numpy.ma
    # outside its compiler lock; the warm-up does both, so the first plan's clock leaves them out
    env = _env(tmp_path, None)
    marker = _marker(tmp_path)
    marker.parent.mkdir(parents=True)
    marker.touch()
    done = subprocess.run([sys.executable, "-c", SETUP_BEFORE_THE_CLOCK], env=env,
                          capture_output=True, text=True, timeout=COLD_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "True"]
