"""Where numba keeps waveplan's compiled kernels: one folder for the library, the CLI, the tests
and `make`, so that each compiles a kernel once, not once per tool.

The folder, first rule that applies:

1. `WAVEPLAN_CACHE_DIR` (waveplan's cache root): `$WAVEPLAN_CACHE_DIR/<key>/numba`;
2. `NUMBA_CACHE_DIR`, when set in the environment: used as it is;
3. `$XDG_CACHE_HOME/waveplan/<key>/numba`, by default `~/.cache/waveplan/<key>/numba`.

`<key>` is the installed waveplan's version and a digest of the kernel files' paths, sizes and
mtimes (`cache_key`). numba keys each entry by its own source file's path and stamp only, so a
kernel that calls a kernel of another file (`wave_pricer._admitted` calls `walk.walk`) would
otherwise be loaded stale after that other file changed (an editable install, a checkout that
moved on): a changed kernel file starts a fresh folder. Several checkouts still share the root
without mixing their kernels.

numba picks a kernel's cache folder when `@njit(cache=True)` decorates it (the locator is made
then, from `numba.config.CACHE_DIR`), not when numba is imported. `use()` therefore sets
`numba.config.CACHE_DIR` itself, which works even when numba was imported before waveplan, and
`NUMBA_CACHE_DIR` in the environment, so that numba's own re-reads of its environment and any
child process (e.g. torch.distributed ranks) agree. `waveplan.pricing` calls `use()` before
any kernel module is imported; `waveplan.search` imports `waveplan.pricing` first.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import re
from importlib import metadata
from pathlib import Path

ENV_ROOT = "WAVEPLAN_CACHE_DIR"
ENV_NUMBA = "NUMBA_CACHE_DIR"
# how every kernel is decorated, and the packages that hold kernels
_KERNEL_LINE = re.compile(rb"^@njit\b", re.MULTILINE)
_PACKAGES = ("waveplan.pricing", "waveplan.search", "waveplan.planner")


def waveplan_version() -> str:
    """The installed distribution's version ("unknown" when waveplan is not installed)."""
    try:
        return metadata.version("waveplan")
    except metadata.PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=1)
def kernel_files() -> tuple[Path, ...]:
    """The package's kernel modules: source files with a line that starts with `@njit`
    (how every kernel is decorated), sorted. Read from disk, not from imported modules, so it
    works before any kernel is decorated. O(package files), once per process."""
    out: set[Path] = set()
    for name in _PACKAGES:
        spec = importlib.util.find_spec(name)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            for path in Path(folder).rglob("*.py"):
                try:
                    if _KERNEL_LINE.search(path.read_bytes()):
                        out.add(path.resolve())
                except OSError:
                    continue
    return tuple(sorted(out))


def kernel_stamps() -> list[str]:
    """"path:size:mtime" of every kernel file (`kernel_files`), what numba keys its entries by."""
    parts = []
    for path in kernel_files():
        try:
            st = path.stat()
        except OSError:
            continue
        parts.append(f"{path}:{st.st_size}:{st.st_mtime_ns}")
    return parts


@functools.lru_cache(maxsize=1)
def cache_key() -> str:
    """The cache folder's name under the root: waveplan's version and 12 hex digits of the
    kernel files' stamps (`kernel_stamps`). O(package files), once per process."""
    digest = hashlib.sha256("\n".join(kernel_stamps()).encode()).hexdigest()[:12]
    return f"{waveplan_version()}-{digest}"


def cache_dir(environ: os._Environ | dict | None = None) -> Path:
    """The numba cache folder the rules above give for `environ` (default: this process's
    environment). Reads only; creates nothing. O(1) once `cache_key` is known."""
    env = os.environ if environ is None else environ
    root = env.get(ENV_ROOT)
    if root:
        return Path(root).expanduser() / cache_key() / "numba"
    if env.get(ENV_NUMBA):
        return Path(env[ENV_NUMBA]).expanduser()
    xdg = env.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path("~").expanduser() / ".cache"
    return base / "waveplan" / cache_key() / "numba"


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
