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
