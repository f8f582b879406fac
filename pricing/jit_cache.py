"""Where numba keeps waveplan's compiled kernels: one folder for the library, the CLI, the tests
and `make`, so that each compiles a kernel once, not once per tool.

The folder, first rule that applies:

1. `WAVEPLAN_CACHE_DIR` (waveplan's cache root): `$WAVEPLAN_CACHE_DIR/<version>/numba`;
2. `NUMBA_CACHE_DIR`, when set in the environment: used as it is;
3. `$XDG_CACHE_HOME/waveplan/<version>/numba`, by default `~/.cache/waveplan/<version>/numba`.

`<version>` is the installed waveplan's version. numba also keys each entry by the source
file's path and stamp, so several checkouts share the folder without mixing their kernels.

numba picks a kernel's cache folder when `@njit(cache=True)` decorates it (the locator is made
then, from `numba.config.CACHE_DIR`), not when numba is imported. `use()` therefore sets
`numba.config.CACHE_DIR` itself, which works even when numba was imported before waveplan, and
`NUMBA_CACHE_DIR` in the environment, so that numba's own re-reads of its environment and any
child process (e.g. torch.distributed ranks) agree. `waveplan.pricing` calls `use()` before
any kernel module is imported; `waveplan.search` imports `waveplan.pricing` first.
"""

from __future__ import annotations

import contextlib
import os
from importlib import metadata
from pathlib import Path

ENV_ROOT = "WAVEPLAN_CACHE_DIR"
ENV_NUMBA = "NUMBA_CACHE_DIR"


def waveplan_version() -> str:
    """The installed distribution's version ("unknown" when waveplan is not installed)."""
    try:
        return metadata.version("waveplan")
    except metadata.PackageNotFoundError:
        return "unknown"


def cache_dir(environ: os._Environ | dict | None = None) -> Path:
    """The numba cache folder the rules above give for `environ` (default: this process's
    environment). Reads only; creates nothing. O(1)."""
    env = os.environ if environ is None else environ
    root = env.get(ENV_ROOT)
    if root:
        return Path(root).expanduser() / waveplan_version() / "numba"
    if env.get(ENV_NUMBA):
        return Path(env[ENV_NUMBA]).expanduser()
    xdg = env.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path("~").expanduser() / ".cache"
    return base / "waveplan" / waveplan_version() / "numba"


def use() -> Path:
    """Point numba (config and environment) at `cache_dir()` and return it. Kernels decorated
    after this call cache there. Idempotent."""
    import numba

    path = str(cache_dir())
    os.environ[ENV_NUMBA] = path
    numba.config.CACHE_DIR = path
    return Path(path)


LOCK_NAME = ".compile.lock"


@contextlib.contextmanager
def compile_lock(path: Path | None = None):
    """Hold an exclusive file lock on the cache folder (`path`, default `cache_dir()`) while
    kernels are compiled into it: concurrent cold processes on one node then compile once, the
    others wait here and load what the first one wrote. `fcntl.flock` is released by the kernel
    when the holder exits or dies, so a crashed compile never blocks the node. Where `fcntl` is
    missing (Windows) or the folder cannot be written, runs unlocked. O(1) plus the wait."""
    folder = cache_dir() if path is None else Path(path)
    try:
        import fcntl

        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / LOCK_NAME, "a+b")  # noqa: SIM115 - closed below
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        yield
    finally:
        handle.close()  # closing releases the lock


def lock_is_held(path: Path | None = None) -> bool:
    """Whether another process holds the cache folder's compile lock now (`compile_lock`): a
    non-blocking try, released at once. False where `fcntl` is missing or the folder cannot
    be written. O(1)."""
    folder = cache_dir() if path is None else Path(path)
    try:
        import fcntl

        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / LOCK_NAME, "a+b") as handle:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False   # closing releases it
    except (ImportError, OSError):
        return False
