"""The warm-up's process entry points, above the planner: the detached background warm-up
`cold_start` starts (`python -m waveplan.planner.warm_jobs`) and the kernel manifest's
recorder (`python -m waveplan.planner.warm_jobs --record`, docs/architecture.md#rooms).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import warmup
from .parallel_compile import MANIFEST, _calls, decode_type, encode_type
from .planner import Planner


def _background_main() -> int:
    """The detached warm-up: compile (or load) every kernel under the cache folder's lock,
    unless another process finished it meanwhile."""
    report = warmup.warmup(Planner, lazy=True)
    print(report.line() if report is not None else "warm already", flush=True)
    return 0


def _record_here(path: Path) -> None:
    """Run the warm-up's plans in this (cold) process and write the kernels they compile
    from Python to `path`, each with its CPU seconds (nested compiles included)."""
    from numba.core import event as ev


    warmup._STATE["done"] = True   # no warm-up (nor parallel compile): only the plans compile

    found: dict[tuple[str, str, str], list] = {}
    stack: list[float] = []

    class _Top(ev.Listener):
        def on_start(self, event):
            stack.append(time.process_time())

        def on_end(self, event):
            start = stack.pop()
            if stack:
                return
            d = event.data["dispatcher"]
            func = getattr(d, "py_func", None)
            module = getattr(func, "__module__", "") or ""
            if not module.startswith("waveplan."):
                return
            args = tuple(event.data["args"])
            key = (module, func.__name__, str(args))
            entry = found.setdefault(key, [module, func.__name__, args, 0.0])
            entry[3] += time.process_time() - start

    with ev.install_listener("numba:compile", _Top()):
        warmup._run(Planner)
    # every signature of a kernel compiled for several (nested ones included): the prelude
    from numba.core.dispatcher import Dispatcher

    multi = set()
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith("waveplan."):
            continue
        for name, value in vars(module).items():
            if (isinstance(value, Dispatcher) and value.py_func.__module__ == mod_name
                    and len(value.signatures) > 1):
                multi.add((mod_name, name))
                for args in value.signatures:
                    found.setdefault((mod_name, name, str(tuple(args))),
                                     [mod_name, name, tuple(args), 0.0])
    labels = {f"{m}.{n}" for m, n, _, _ in found.values()}
    kernels = [{"module": m, "name": n, "signature": str(a), "cpu_s": round(c, 2),
                "calls": _calls(m, n, labels), "prelude": (m, n) in multi,
                "args": [encode_type(ty) for ty in a]}
               for m, n, a, c in found.values()]
    for k, (_, _, a, _) in zip(kernels, found.values(), strict=True):
        assert tuple(decode_type(ty) for ty in k["args"]) == a, k["signature"]
    kernels.sort(key=lambda e: (e["module"], e["name"], e["signature"]))
    import numba

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"numba": numba.__version__, "kernels": kernels}, indent=1)
                    + "\n")


def record(path: Path = MANIFEST) -> None:
    """Rewrite the manifest from a fresh process with an empty cache folder. O(cold warm-up)."""
    with tempfile.TemporaryDirectory(prefix="waveplan-record-") as tmp:
        env = dict(os.environ, WAVEPLAN_CACHE_DIR=tmp)
        env.pop("NUMBA_CACHE_DIR", None)
        # this module by its import name: run as `python -m`, its __name__ is "__main__"
        subprocess.run([sys.executable, "-m", "waveplan.planner.warm_jobs", "--record-here", str(path)],
                       env=env, check=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--record-here"] and len(argv) == 2:
        _record_here(Path(argv[1]))
        return 0
    if argv == ["--record"]:
        record()
        print(f"wrote {MANIFEST}")
        return 0
    if not argv:
        return _background_main()
    print("usage: python -m waveplan.planner.warm_jobs [--record]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
