"""Progress bars for long loops (studies, trace grids): tqdm when installed, else a tiny
built-in line on stderr, so the base install (numpy + numba) shows progress too."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class LineProgress:
    """A minimal tqdm stand-in: `update(n)`, `close()`, context manager. Rewrites one line
    ("study 12/40 30% 3.1 s") on `stream`, at most every `min_interval_s`; O(1) per update."""

    def __init__(self, total: int | None, desc: str, *, unit: str = "it", stream: TextIO | None = None,
                 min_interval_s: float = 0.2) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.stream = stream if stream is not None else sys.stderr
        self.n = 0
        self._start = self._last = time.perf_counter()
        self._min = min_interval_s
        self._width = 0

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self._last >= self._min or (self.total is not None and self.n >= self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        done = f"{self.n}/{self.total} {100 * self.n // max(self.total, 1)}%" if self.total else f"{self.n}"
        text = f"{self.desc} {done} {self.unit}s {now - self._start:.1f} s"
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()
        self._width = len(text)

    def close(self) -> None:
        if self._width:
            self.stream.write("\r" + " " * self._width + "\r")  # leave no trace, as tqdm(leave=False)
            self.stream.flush()
            self._width = 0

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_bar(total: int | None, desc: str, *, enabled: bool = True, unit: str = "it"):
    """tqdm(total, desc) if tqdm is installed, else a `LineProgress`; None when not enabled."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return LineProgress(total, desc, unit=unit)
    return tqdm(total=total, unit=unit, desc=desc, leave=False)
