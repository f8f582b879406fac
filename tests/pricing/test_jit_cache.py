"""One numba cache folder for the library, the CLI and the tests (`waveplan.pricing.jit_cache`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from waveplan.pricing.jit_cache import cache_dir, cache_key, waveplan_version

# Prints numba's cache folder and the folder of every cached waveplan kernel, after `imports`.
PROBE = """
import json, os, sys
{imports}
import numba
from numba.core.registry import CPUDispatcher
kernels = {{}}
for name, module in list(sys.modules.items()):
    if name.startswith("waveplan"):
        for value in vars(module).values():
            if isinstance(value, CPUDispatcher) and value.__module__ == name:
                kernels[name + "." + value.__name__] = os.path.dirname(value._cache._cache_path)
print(json.dumps({{"config": numba.config.CACHE_DIR, "env": os.environ.get("NUMBA_CACHE_DIR"),
                   "kernels": kernels}}))
"""

# The CLI's import path, with numba imported first (its config is then read before waveplan's:
# `main` builds its parser, which imports every command's modules); and a library user's.
CLI = "import numba\nfrom waveplan.planner.cli import build_parser\nbuild_parser()"
LIBRARY = ("import waveplan.pricing.walk, waveplan.pricing.layout, waveplan.search\n"
           "from waveplan.planner import Planner")


def _probe(imports: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_CACHE_DIR", "WAVEPLAN_CACHE_DIR", "XDG_CACHE_HOME")}
    return env | extra


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["xdg", "waveplan", "numba"])
def test_cli_and_library_resolve_the_same_cache_dir(tmp_path, setting):
    version = cache_key()
    env, expected = {
        "xdg": (_clean_env(XDG_CACHE_HOME=str(tmp_path / "xdg")),
                tmp_path / "xdg" / "waveplan" / version / "numba"),
        "waveplan": (_clean_env(WAVEPLAN_CACHE_DIR=str(tmp_path / "w"), XDG_CACHE_HOME=str(tmp_path / "x")),
                     tmp_path / "w" / version / "numba"),
        "numba": (_clean_env(NUMBA_CACHE_DIR=str(tmp_path / "n"), XDG_CACHE_HOME=str(tmp_path / "x")),
                  tmp_path / "n"),
    }[setting]
    cli, library = _probe(CLI, env), _probe(LIBRARY, env)
    for seen in (cli, library):
        assert seen["config"] == seen["env"] == str(expected)
        assert len(seen["kernels"]) >= 20, seen["kernels"]
        assert set(seen["kernels"].values()) == {str(expected)}, seen["kernels"]
    shared = cli["kernels"].keys() & library["kernels"].keys()
    assert len(shared) >= 20
    assert {k: cli["kernels"][k] for k in shared} == {k: library["kernels"][k] for k in shared}


def test_rules_in_order(tmp_path):
    version = cache_key()
    home = Path("~").expanduser()
    assert cache_dir({}) == home / ".cache" / "waveplan" / version / "numba"
    assert cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/waveplan") / version / "numba"
    assert cache_dir({"XDG_CACHE_HOME": "/x", "NUMBA_CACHE_DIR": "/n"}) == Path("/n")
    assert cache_dir({"WAVEPLAN_CACHE_DIR": "/w", "NUMBA_CACHE_DIR": "/n"}) == Path("/w") / version / "numba"
    assert cache_dir({"WAVEPLAN_CACHE_DIR": "", "XDG_CACHE_HOME": ""}) == home / ".cache" / "waveplan" / version / "numba"
    assert version.startswith(metadata.version("waveplan") + "-") and version == cache_key()
    assert waveplan_version() == metadata.version("waveplan")


def test_the_compile_lock_excludes_another_process_until_released(tmp_path):
    from waveplan.pricing.jit_cache import LOCK_NAME, compile_lock

    probe = ("import fcntl, sys\n"
             f"f = open({str(tmp_path / LOCK_NAME)!r}, 'a+b')\n"
             "try:\n    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
             "except BlockingIOError:\n    sys.exit(3)\n")
    with compile_lock(tmp_path):
        held = subprocess.run([sys.executable, "-c", probe], check=False)
    free = subprocess.run([sys.executable, "-c", probe], check=False)
    assert (held.returncode, free.returncode) == (3, 0)



def test_a_changed_kernel_file_moves_the_cache_folder(tmp_path, monkeypatch):
    """numba keys a cached kernel by its own file's stamp only: `_admitted` (wave_pricer.py)
    inlines `walk` (walk.py), so a folder kept across a change of walk.py would load a stale
    `_admitted`. The folder's key covers every kernel file's stamp."""
    from waveplan.pricing import jit_cache

    assert {"walk.py", "wave_pricer.py", "layout.py"} <= {p.name for p in jit_cache.kernel_files()}
    files = [tmp_path / "walk.py", tmp_path / "wave_pricer.py"]
    for f in files:
        f.write_text("@njit(cache=True)\ndef k():\n    return 1\n")
    monkeypatch.setattr(jit_cache, "kernel_files", lambda: tuple(files))
    key = jit_cache.cache_key.__wrapped__
    before = key()
    assert before.startswith(waveplan_version() + "-") and key() == before
    st = files[0].stat()
    os.utime(files[0], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert key() != before
    files[0].write_text("@njit(cache=True)\ndef k():\n    return 22\n")
    assert key() != before
