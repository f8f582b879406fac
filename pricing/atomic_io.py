"""Atomic file writes: write next to the target, fsync, rename over it. A killed writer leaves
the old file intact. Shared by profiles, reports, plots, studies and calibration tables."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def _default_mode() -> int:
    """The mode open() gives a new file: 0666 less the umask (read by setting it back)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, _default_mode())  # mkstemp makes 0600; give the file ordinary permissions
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | Path, data: object) -> None:
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=False) + "\n")


def append_line_atomic(path: str | Path, line: str) -> None:
    """Append one line (a newline added) as one whole record: an O_APPEND write of the full
    line under an exclusive `flock`, fsynced. O_APPEND alone makes concurrent appenders
    (the ranks of one job) write at the end without overwriting each other; the lock keeps a
    short `write` (completed in a loop) from being interleaved with another's. A line a killed
    writer left without its newline is ended first, so the new record stays whole on its own
    line (the reader names the cut one). Rewriting the whole file (`write_bytes_atomic`)
    would cost O(file) per line and lose lines between unlocked writers."""
    if "\n" in line:
        raise ValueError("append_line_atomic: the line must not contain a newline")
    data = (line + "\n").encode("utf-8")
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        try:
            import fcntl
        except ImportError:   # not POSIX: O_APPEND alone
            fcntl = None
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)   # releases the lock
