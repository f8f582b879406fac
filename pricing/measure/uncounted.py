"""The tracer's switch for storages it does not count (no torch import).

`uncounted()` marks a stretch of work whose storages no `trace.StorageTracker` counts: an
allocation model's arithmetic (`gpu_kernels`), standing for a fused kernel's registers."""

from __future__ import annotations

import contextlib

# > 0 while `uncounted()` is active
ACTIVE = [0]


@contextlib.contextmanager
def uncounted():
    """Storages that aten ops create inside are not counted by any `StorageTracker`."""
    ACTIVE[0] += 1
    try:
        yield
    finally:
        ACTIVE[0] -= 1
