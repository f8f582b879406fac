"""Compile waveplan's kernels in parallel worker processes, into the shared cache folder.

numba compiles one kernel at a time per process (a global compiler lock), so a cold warm-up
costs the sum of every kernel's compile. Here the kernels a warm-up needs are listed in a
manifest (`data/warmup_kernels.json`: module, name, argument types, compile CPU seconds),
split into shares of about equal cost (longest first, each to the lightest share; kernels
that call one another share a process, so that a callee compiles once), and compiled at
once: share 0 in this process, the others in worker processes
(`python -m waveplan.planner.parallel_compile --share I N`), one per core up to
MAX_WORKERS. Every compiled kernel lands in the cache folder (numba saves each compile,
nested ones included); the warm-up's plans then load them instead of compiling. Kernels
compiled for several signatures (the manifest's prelude) compile in this process before the
workers start: numba rewrites a kernel's cache index without a lock, so two processes must
not save different signatures of one kernel at once.

On this 2-core machine the wall time is about half the serial compile; on a 16-core node,
about the longest share (the most expensive kernel with its callees).

The caller holds the cache folder's lock (`jit_cache.compile_lock`); workers take no lock
(they work for the holder). Where the folder cannot be written, no worker is started (their
compiles could not reach this process) and this process compiles everything itself, as it
would without a manifest. A stale manifest (a kernel renamed, a signature that no longer
types) costs time, never correctness: an entry that fails is skipped and the warm-up's plans
compile what is missing. A worker that fails or outlives WORKER_TIMEOUT_S is ended and
its share left to the plans.

`python -m waveplan.planner.parallel_compile --record` rewrites the manifest: it runs the
warm-up's plans in a fresh process with an empty cache folder and lists the kernels they
compile from Python (nested kernels compile with their callers). Rerun it after adding a
kernel or changing a kernel's argument types; `tests/planner/test_parallel_warmup.py` fails while the
manifest misses a kernel the warm-up compiles.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MANIFEST = Path(__file__).parent / "data" / "warmup_kernels.json"
MAX_WORKERS = 8
WORKER_TIMEOUT_S = 900.0         # a cold share on a loaded 2-core machine takes well under this
ENV_WORKERS = "WAVEPLAN_WARMUP_WORKERS"   # processes in all (1: compile here only)
_MODULE = "waveplan.planner.parallel_compile"   # the workers' entry point (also when run as __main__)


@dataclass(frozen=True)
class Kernel:
    """One manifest entry: the dispatcher `module.name` compiled for `args` (numba types),
    which cost `cpu_s` CPU seconds when recorded (nested kernels included); `calls`: the
    other entries' `module.name` it calls (they compile nested in it)."""

    module: str
    name: str
    args: tuple
    cpu_s: float
    calls: tuple[str, ...] = ()
    prelude: bool = False   # compiled here before any worker starts (see `compile_parallel`)

    @property
    def label(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(frozen=True)
class ParallelReport:
    """What `compile_parallel` did: processes used (1: this one only), kernels compiled in
    this process and in the workers, entries that failed (stale), workers that failed, and
    the seconds spent waiting for the workers after this process's share."""

    processes: int
    compiled_here: int
    compiled_by_workers: int
    stale: tuple[str, ...]
    failed_workers: int
    wait_s: float


def encode_type(ty) -> dict:
    """A kernel argument's numba type as plain JSON data: a scalar, an array, or a (named)
    tuple of those. Raises TypeError for any other type. O(size of the type)."""
    from numba.core import types

    if isinstance(ty, types.Array):
        return {"array": str(ty.dtype), "ndim": ty.ndim, "layout": ty.layout,
                "readonly": not ty.mutable}
    if isinstance(ty, types.BaseTuple):
        out = {"tuple": [encode_type(t) for t in ty.types]}
        if isinstance(ty, types.BaseNamedTuple):
            out["class"] = f"{ty.instance_class.__module__}.{ty.instance_class.__qualname__}"
        return out
    if isinstance(ty, (types.Integer, types.Float, types.Boolean)):
        return {"scalar": str(ty)}
    raise TypeError(f"no manifest encoding for the numba type {ty}")


def decode_type(data: dict):
    """The numba type `encode_type` wrote. O(size of the type)."""
    import numpy as np
    from numba.core import types
    from numba.np.numpy_support import from_dtype

    if "array" in data:
        return types.Array(from_dtype(np.dtype(data["array"])), int(data["ndim"]),
                           data["layout"], readonly=bool(data["readonly"]))
    if "tuple" in data:
        items = [decode_type(t) for t in data["tuple"]]
        cls = None
        if "class" in data:
            module, _, name = data["class"].rpartition(".")
            cls = getattr(importlib.import_module(module), name)
        return types.BaseTuple.from_types(items, cls)
    return from_dtype(np.dtype(data["scalar"]))


def load_manifest(path: Path = MANIFEST) -> list[Kernel]:
    """The manifest's kernels; [] when it is missing or unreadable (e.g. a type this numba
    does not know). O(entries)."""
    try:
        data = json.loads(path.read_text())
        return [Kernel(e["module"], e["name"], tuple(decode_type(a) for a in e["args"]),
                       float(e["cpu_s"]), tuple(e.get("calls", ())), bool(e.get("prelude")))
                for e in data["kernels"]]
    except Exception:   # noqa: BLE001 - any unreadable manifest means: no parallel compile
        return []


def _units(kernels: list[Kernel], n: int) -> list[list[int]]:
    """Kernels that call one another (`calls`, either way, transitively) form one unit, so
    that a share compiles a callee once, not once in each process that needs it; when a unit
    costs more than a fair share (total / n: many processes), its kernels go alone (a
    duplicate compile in another process costs CPU, not wall time). O(E^2)."""
    index = {k.label: i for i, k in enumerate(kernels)}
    root = list(range(len(kernels)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for i, k in enumerate(kernels):
        for callee in k.calls:
            j = index.get(callee)
            if j is not None and not kernels[j].prelude:   # the prelude is compiled first
                root[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for i in range(len(kernels)):
        groups.setdefault(find(i), []).append(i)
    fair = sum(k.cpu_s for k in kernels) / max(n, 1)
    units = []
    for members in groups.values():
        if len(members) > 1 and sum(kernels[i].cpu_s for i in members) > fair:
            units.extend([i] for i in members)
        else:
            units.append(members)
    return units


def shares(kernels: list[Kernel], n: int) -> list[list[int]]:
    """Split the kernels into `n` shares of about equal recorded cost: units of kernels
    that call one another (`_units`), longest first, each to the lightest share so far
    (ties: the lower share). Deterministic. O(E^2 + E n)."""
    out: list[list[int]] = [[] for _ in range(max(n, 1))]
    load = [0.0] * len(out)
    units = [kept for u in _units(kernels, len(out))
             if (kept := [i for i in u if not kernels[i].prelude])]
    cost = [sum(kernels[i].cpu_s for i in unit) for unit in units]
    for u in sorted(range(len(units)), key=lambda u: (-cost[u], min(units[u]))):
        s = min(range(len(out)), key=lambda s: (load[s], s))
        out[s].extend(sorted(units[u]))
        load[s] += cost[u]
    return out


def compile_kernels(kernels: list[Kernel]) -> tuple[int, list[str]]:
    """Compile (or load from the cache) each kernel in this process. Returns (compiled or
    loaded, names of the entries that failed). O(sum of compiles)."""
    from numba.core.dispatcher import Dispatcher

    done, stale = 0, []
    for k in kernels:
        label = k.label
        try:
            disp = getattr(importlib.import_module(k.module), k.name)
            if not isinstance(disp, Dispatcher):
                raise TypeError(f"{label} is not a numba kernel")
            disp.compile(k.args)
            done += 1
        except Exception:   # noqa: BLE001 - a stale entry: the warm-up's plans compile it
            stale.append(label)
    return done, stale


def worker_count(num_kernels: int) -> int:
    """Processes to use: `WAVEPLAN_WARMUP_WORKERS` when set, else the cores this process may
    run on, at most MAX_WORKERS and at most one per kernel. O(1)."""
    env = os.environ.get(ENV_WORKERS, "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            from waveplan.pricing.errors import ConfigError, bad

            raise bad(ConfigError, ENV_WORKERS, env, "must be a whole number of processes") from None
    else:
        try:
            n = len(os.sched_getaffinity(0))
        except AttributeError:   # not on Linux
            n = os.cpu_count() or 1
        n = min(n, MAX_WORKERS)
    return max(1, min(n, num_kernels))


def writable(folder: Path) -> bool:
    """Whether files can be created in `folder` (created if missing). O(1)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
        return True
    except OSError:
        return False


def compile_parallel(kernels: list[Kernel] | None = None) -> ParallelReport:
    """Compile the manifest's kernels (default: `load_manifest()`) across `worker_count`
    processes into the cache folder; see the module docstring. Call with the cache lock held.
    O(longest share) wall time, O(sum of compiles) CPU."""
    from waveplan.pricing import jit_cache

    kernels = load_manifest() if kernels is None else kernels
    n = worker_count(len(kernels)) if kernels else 1
    if n > 1 and not writable(jit_cache.cache_dir()):
        n = 1
    # numba's cache index is read, updated and rewritten without a lock: two processes saving
    # different signatures of one kernel at once could pair an index entry with the other's
    # code. Kernels compiled for several signatures (nested ones included) are therefore
    # compiled here first, and the workers load them.
    here, stale = compile_kernels([k for k in kernels if k.prelude])
    split = shares(kernels, n)
    procs = [subprocess.Popen([sys.executable, "-m", _MODULE, "--share", str(s), str(n)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for s in range(1, n)]
    try:
        done, failed_here = compile_kernels([kernels[i] for i in split[0]])
    except BaseException:   # interrupted: end the workers, they would compile for no one
        for proc in procs:
            proc.kill()
            proc.communicate()
        raise
    here += done
    stale += failed_here
    t0 = time.perf_counter()
    by_workers, failed = 0, 0
    for proc in procs:
        left = max(1.0, WORKER_TIMEOUT_S - (time.perf_counter() - t0))
        try:
            out, _ = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            failed += 1
            continue
        try:
            report = json.loads(out.strip().splitlines()[-1])
            by_workers += int(report["compiled"])
            stale += report["stale"]
        except (ValueError, IndexError, KeyError, TypeError):
            failed += 1
        else:
            failed += proc.returncode != 0
    wait_s = time.perf_counter() - t0
    return ParallelReport(processes=n, compiled_here=here, compiled_by_workers=by_workers,
                          stale=tuple(sorted(set(stale))), failed_workers=failed,
                          wait_s=wait_s)


def _calls(module: str, name: str, labels: set[str]) -> list[str]:
    """The kernels among `labels` that the kernel `module.name` calls, directly or through
    other kernels: names its code reads that are numba dispatchers. O(kernels reached)."""
    from numba.core.dispatcher import Dispatcher

    seen: set[str] = set()
    todo = [getattr(importlib.import_module(module), name)]
    while todo:
        func = todo.pop().py_func
        for ref in func.__code__.co_names:
            value = func.__globals__.get(ref)
            if isinstance(value, Dispatcher):
                label = f"{value.py_func.__module__}.{value.py_func.__name__}"
                if label not in seen:
                    seen.add(label)
                    todo.append(value)
    return sorted(seen & labels - {f"{module}.{name}"})


def main(argv: list[str]) -> int:
    if argv[:1] == ["--share"] and len(argv) == 3:
        kernels = load_manifest()
        mine = shares(kernels, int(argv[2]))[int(argv[1])]
        done, stale = compile_kernels([kernels[i] for i in mine])
        print(json.dumps({"compiled": done, "stale": stale}))
        return 0
    if argv == ["--record"]:   # the recorder runs the planner: `warm_jobs` (above the planner)
        return subprocess.run([sys.executable, "-m", "waveplan.planner.warm_jobs", "--record"]).returncode
    print("usage: python -m waveplan.planner.parallel_compile --record | --share I N",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
