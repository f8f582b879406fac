"""The wheel installs with plain `pip install` into fresh Python 3.10 and 3.12 virtual
environments (numpy and numba from the package index) and plans the bundled step.

Slow: builds the wheel once, creates a venv per interpreter, and the installed waveplan
compiles its kernels cold (into a cache folder of the test's own)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYENV = Path.home() / ".pyenv" / "versions"
INSTALL_S = 900   # pip downloads numpy + numba (+ llvmlite) per venv
PLAN_S = 900      # a cold numba compile on a busy 2-core machine

pytestmark = pytest.mark.slow


def _interpreter(minor: str) -> Path | None:
    found = sorted(glob.glob(str(PYENV / f"{minor}.*" / "bin" / "python")))
    return Path(found[-1]) if found else None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=INSTALL_S)
    if done.returncode != 0:
        pytest.skip(f"cannot build the wheel (no build backend from the index?): {done.stderr.strip()[-300:]}")
    wheels = list(out.glob("waveplan-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.mark.parametrize("minor", ["3.10", "3.12"])
def test_wheel_installs_and_plans(minor, wheel, tmp_path):
    python = _interpreter(minor)
    if python is None:
        pytest.skip(f"no Python {minor} interpreter under {PYENV}")
    venv = tmp_path / "venv"
    subprocess.run([str(python), "-m", "venv", str(venv)], check=True, timeout=300)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)],
                         capture_output=True, text=True, timeout=INSTALL_S, cwd=tmp_path)
    if pip.returncode != 0:
        text = pip.stderr
        if any(s in text for s in ("No matching distribution", "Could not find a version",
                                   "NewConnectionError", "Network is unreachable", "Temporary failure")):
            pytest.skip(f"pip cannot reach a package index for numpy/numba: {text.strip()[-300:]}")
        pytest.fail(f"pip install of the wheel failed on Python {minor}:\n{text}")
    # compile in the foreground: the installed kernels must compile on this Python (a cold
    # command would otherwise run them interpreted and compile in a detached process)
    env = {**os.environ, "WAVEPLAN_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": "",
           "WAVEPLAN_COLD_COMPILE": "foreground"}
    done = subprocess.run([str(venv / "bin" / "waveplan"), "plan", "grpo-8x8", "--model", "qwen3-8b",
                           "--tp", "1", "--free-gib", "40", "--packer", "greedy"],
                          capture_output=True, text=True, timeout=PLAN_S, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("model qwen3-8b  TP1")
    assert any("waves; lower bound" in line or "1 wave;" in line for line in lines)
    # a cold command's default on this Python: the kernels run interpreted (no compile started)
    cold = {**env, "WAVEPLAN_CACHE_DIR": str(tmp_path / "cold"), "WAVEPLAN_COLD_COMPILE": "never"}
    interpreted = subprocess.run([str(venv / "bin" / "waveplan"), "plan", "grpo-8x8", "--model",
                                  "qwen3-8b", "--tp", "1", "--free-gib", "40", "--packer", "greedy"],
                                 capture_output=True, text=True, timeout=PLAN_S, cwd=tmp_path, env=cold)
    assert interpreted.returncode == 0, interpreted.stderr
    assert "ran them interpreted" in interpreted.stderr
    assert interpreted.stdout.splitlines()[0] == lines[0]
    assert any("lower bound" in line for line in interpreted.stdout.splitlines())
    version = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import sys, waveplan.planner as p; print(sys.version_info[:2], p.__file__)"],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert f"({minor.split('.')[0]}, {minor.split('.')[1]})" in version.stdout
    assert str(venv) in version.stdout   # the installed copy, not the source tree
