"""One launcher for the tests that run gloo ranks as separate processes.

Each rank runs `python SCRIPT *args(rank, port, out)` with one OMP thread and writes its result
as JSON to `out` (tmp_path/r{rank}.json); its output goes to a log file (a full pipe cannot
block it). Ranks get `timeout_s` each, generous enough for a cold numba compile on a busy
machine: a rank still running then is killed and the test fails naming the hang.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


def free_port() -> int:
    """A free TCP port on the loopback interface for torch.distributed's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: Path, tmp_path: Path, world: int, args: Callable[[int, int, Path], list[str]],
              timeout_s: float, what: str = "ranks") -> list[dict]:
    """Run `world` ranks of `script` and return their JSON results in rank order; fails the
    test with each failing rank's log tail when a rank hangs or exits non-zero."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logs = [open(tmp_path / f"r{r}.log", "wb") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(script), *args(r, port, tmp_path / f"r{r}.json")],
                              env=env, stdout=logs[r], stderr=subprocess.STDOUT)
             for r in range(world)]
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
    finally:
        for f in logs:
            f.close()
    text = [(tmp_path / f"r{r}.log").read_text(errors="replace")[-3000:] for r in range(world)]
    if any(p.returncode is None or p.returncode < 0 for p in procs):
        pytest.fail(f"{what} hung: a rank did not finish in {timeout_s} s\n" + "\n".join(text))
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{text[r]}"
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(world)]


def warm_script(folder: Path, text: str, *args: str, timeout_s: float) -> Path:
    """Write the rank script `text` to `folder`/worker.py and run it once as `worker.py warm
    *args` in one process (one OMP thread), so that it compiles or loads every kernel it uses
    before ranks start; fails the test with the tail of its stderr if that run fails."""
    script = folder / "worker.py"
    script.write_text(text)
    done = subprocess.run([sys.executable, str(script), "warm", *args], capture_output=True,
                          text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return script
