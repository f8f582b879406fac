"""Compile-time accounting through numba's event API: how long a block of code spent
compiling kernels (`numba:compile`) and, in all, inside numba's compiler (`numba:compiler_lock`:
compiling, or loading a kernel from the on-disk cache, or resolving a new signature).

Only outermost events count (a kernel's compile nests the compiles of the kernels it calls).
numba serialises compilation behind one global lock, so a clock sees every compile of the
process while it is active, from any thread. O(1) per event.
"""

from __future__ import annotations

import threading
import time

from numba.core import event as ev

COMPILE = "numba:compile"
COMPILER_LOCK = "numba:compiler_lock"


class _Span(ev.Listener):
    """Sums the wall time of outermost events of one kind; counts them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count = 0
        self._depth = 0
        self._start = 0.0
        self._mutex = threading.Lock()

    def on_start(self, event: ev.Event) -> None:
        with self._mutex:
            if self._depth == 0:
                self._start = time.perf_counter()
            self._depth += 1

    def on_end(self, event: ev.Event) -> None:
        with self._mutex:
            self._depth -= 1
            if self._depth == 0:
                self.seconds += time.perf_counter() - self._start
                self.count += 1


class CompileClock:
    """Context manager: after the block, `compile_s` (seconds compiling kernels), `compiles`
    (outermost compiles), `jit_s` (seconds inside numba's compiler, loads from the cache
    included; >= compile_s).

        with CompileClock() as clock:
            ...
        clock.compile_s, clock.jit_s
    """

    def __init__(self) -> None:
        self._compile = _Span()
        self._lock = _Span()

    def __enter__(self) -> CompileClock:
        ev.register(COMPILE, self._compile)
        ev.register(COMPILER_LOCK, self._lock)
        return self

    def __exit__(self, *exc) -> None:
        ev.unregister(COMPILER_LOCK, self._lock)
        ev.unregister(COMPILE, self._compile)

    @property
    def compile_s(self) -> float:
        return self._compile.seconds

    @property
    def compiles(self) -> int:
        return self._compile.count

    @property
    def jit_s(self) -> float:
        return max(self._lock.seconds, self._compile.seconds)
