"""Cold start of the command line: plan at once, compile the kernels in the background.

On a machine whose cache folder holds no compiled kernels yet, compiling every kernel a plan
can need costs minutes (docs/usage.md#compile-cost; numba's type inference and lowering, not
LLVM's optimiser: `NUMBA_OPT=0` compiles no faster). A one-shot command does not wait for
that. When the cache folder's warm marker (`warm_marker`) is missing, `plan`, `price` and
`inspect` run waveplan's kernels as plain Python (numba's `DISABLE_JIT`, set before any kernel
module is decorated): the same code, the same results, about 100x slower per call, which one
plan at the default budget affords (0.4 s for 512 requests, 1.1 s for 2048 on this 2-core
machine). Once the command succeeded, one detached process (`python -m
waveplan.planner.cold_start`) compiles every kernel into the cache folder: the warm-up, under
the folder's lock, so concurrent cold commands on a node start one compile between them (one
that finds the lock held starts none). The next command finds the marker and runs compiled. A
command that fails prints only its error and starts nothing.

An interpreted plan reads no clock: 5 ms of interpreted search buys about 1% of its compiled
work, so the search runs the iteration cap that `--time-budget-ms` implies instead (what
`--deterministic` does), and the plan is the one `--deterministic` gives, byte for byte. A
budget above `INTERPRET_MAX_BUDGET_MS` compiles first instead: the interpreter would take
seconds per step.

`WAVEPLAN_COLD_COMPILE` chooses: `background` (the default, as above); `foreground` (compile
every kernel first, then run compiled: the library's behaviour); `never` (interpret and start
no compile, e.g. a read-only or throw-away environment). A cache folder that cannot be
written compiles in the foreground, as before (a background compile could not keep its work).

The library never interprets: `Planner` compiles on its first plan (`Planner.warmup()` pays it
at start-up), since a trainer plans every step and must not run a step's plan 100x slower.
Nor does a command run in a process that has imported a kernel module already (e.g. tests
calling `cli.main`): numba decides at decoration time.

This module imports no kernel module (it must run before them): the marker is computed from
the package's files, not from imported modules.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from waveplan.pricing import jit_cache
from waveplan.pricing.compat import StrEnum
from waveplan.pricing.errors import ConfigError, bad

ENV_MODE = "WAVEPLAN_COLD_COMPILE"
INTERPRETED_COMMANDS = ("plan", "price", "inspect")
INTERPRET_MAX_BUDGET_MS = 20.0   # --time-budget-ms above this compiles first
LOG_NAME = "background-warmup.log"


class ColdMode(StrEnum):
    """When the kernels compile on a cold cache (`WAVEPLAN_COLD_COMPILE`)."""

    BACKGROUND = "background"
    FOREGROUND = "foreground"
    NEVER = "never"


@dataclass(frozen=True)
class ColdStart:
    """What `prepare` decided for this process: kernels `interpreted` or compiled, the mode
    (`WAVEPLAN_COLD_COMPILE`), and why, in words."""

    interpreted: bool
    mode: ColdMode = ColdMode.BACKGROUND
    reason: str = ""


_DECISION = ColdStart(interpreted=False, reason="not prepared")


def current() -> ColdStart:
    """This process's decision (`prepare`), or a compiled one when nothing was prepared."""
    return _DECISION


def mode(environ: dict | None = None) -> ColdMode:
    """`WAVEPLAN_COLD_COMPILE` (default background); a bad value is one line naming it."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_MODE, "") or ColdMode.BACKGROUND.value
    try:
        return ColdMode(value)
    except ValueError:
        raise bad(ConfigError, ENV_MODE, value,
                  f"must be one of {', '.join(m.value for m in ColdMode)}") from None


def kernel_files() -> tuple[Path, ...]:
    """The package's kernel modules (`jit_cache.kernel_files`)."""
    return jit_cache.kernel_files()


def warm_marker() -> Path:
    """The cache folder's warm marker for this installation: a file named by a hash of
    waveplan's and numba's versions and of the path, size and mtime of every kernel file (what
    numba keys its cache entries by). A completed warm-up leaves it. O(package files)."""
    try:
        numba_version = metadata.version("numba")
    except metadata.PackageNotFoundError:
        numba_version = "unknown"
    parts = [jit_cache.waveplan_version(), numba_version, *jit_cache.kernel_stamps()]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return jit_cache.cache_dir() / f".warm-{digest}"


def _command(argv: list[str]) -> str | None:
    """The subcommand: the first argument that is not an option (options before it are
    `-v`/`--version`, which take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def _budget_ms(argv: list[str]) -> float | None:
    """--time-budget-ms's value when given and a number (a bad one is argparse's to refuse)."""
    for i, arg in enumerate(argv):
        value = None
        if arg == "--time-budget-ms" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--time-budget-ms="):
            value = arg.split("=", 1)[1]
        if value is not None:
            try:
                return float(value)
            except ValueError:
                return None
    return None


def _kernels_imported() -> bool:
    """Whether a kernel module is imported already (its kernels are decorated: too late)."""
    files = {str(p) for p in kernel_files()}
    for name, module in list(sys.modules.items()):
        if name.startswith("waveplan."):
            path = getattr(module, "__file__", None)
            if path and str(Path(path).resolve()) in files:
                return True
    return False


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


BACKGROUND_MODULE = "waveplan.planner.warm_jobs"   # the detached warm-up's entry point


def _start_background() -> int | None:
    """Start the detached warm-up; its process id, or None when another process holds the
    cache folder's compile lock (it is compiling: one compile per node) or it cannot start."""
    folder = jit_cache.cache_dir()
    if jit_cache.lock_is_held(folder):
        return None
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_DISABLE_JIT"}
    try:
        with open(folder / LOG_NAME, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", BACKGROUND_MODULE], stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True, close_fds=True)
    except OSError:
        return None
    return proc.pid


def prepare(argv: list[str]) -> ColdStart:
    """Decide, before any kernel module is imported, whether this command runs its kernels
    interpreted (see the module docstring); if so, turn numba's JIT off for this process.
    Records the decision for `current()` and returns it; starts nothing (`finish` does, once
    the command succeeded). O(package files)."""
    global _DECISION
    import numba

    chosen = mode()
    compiled = (_command(argv) not in INTERPRETED_COMMANDS        # many plans, or torch
                or any(a in ("-h", "--help") for a in argv)       # nothing runs
                or chosen is ColdMode.FOREGROUND
                or bool(numba.config.DISABLE_JIT)                   # the user interprets already
                or (_budget_ms(argv) or 0.0) > INTERPRET_MAX_BUDGET_MS
                or _kernels_imported()
                or warm_marker().exists())
    if compiled:
        _DECISION = ColdStart(interpreted=False, mode=chosen, reason="compiled")
    elif chosen is ColdMode.BACKGROUND and not _writable(jit_cache.cache_dir()):
        _DECISION = ColdStart(interpreted=False, mode=chosen,
                              reason="cache folder not writable: compile here")
    else:
        numba.config.DISABLE_JIT = True
        _DECISION = ColdStart(interpreted=True, mode=chosen, reason="no completed warm-up")
    return _DECISION


def finish() -> str:
    """After a command that ran interpreted succeeded: start the background compile (mode
    `background`) and return the line that says what happened, for stderr ("" when the
    kernels ran compiled). A failed command starts nothing and prints only its error."""
    if not _DECISION.interpreted:
        return ""
    if _DECISION.mode is ColdMode.NEVER:
        compile_ = f"no compile started ({ENV_MODE}=never)"
    else:
        pid = _start_background()
        compile_ = ("another process is compiling them" if pid is None else
                    f"compiling them in the background now (pid {pid}; `waveplan warmup` waits "
                    "for it)")
    return ("waveplan: no compiled kernels in this machine's cache yet: ran them interpreted "
            f"(a plan is the one --deterministic gives); {compile_}")
