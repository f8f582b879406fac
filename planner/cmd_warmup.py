"""`waveplan warmup`: compile (or load from the cache) every kernel a plan can need, now."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    parser = sub.add_parser(
        "warmup", help="compile every kernel a plan can need",
        description="Compile every numba kernel a plan can need into the cache folder (or load "
                    "them when another process compiled them), under a file lock so that "
                    "concurrent processes on one node compile once. Prints what it did and the "
                    "seconds.")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .planner import Planner
    from .warmup import warmup

    report = warmup(Planner, force=True)
    if report is None:   # NUMBA_DISABLE_JIT: the kernels run as Python
        print("warm-up: nothing to compile (numba's JIT is disabled: NUMBA_DISABLE_JIT)")
        return 0
    print(report.line())
    return 0
