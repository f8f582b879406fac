"""Python 3.10 compatibility: the 3.11+ standard-library names waveplan uses, one place.

`StrEnum` is `enum.StrEnum` on 3.11+; on 3.10 a `(str, Enum)` class whose `str()` and
`format()` give the value, as 3.11's does.
"""

from __future__ import annotations

import sys
from enum import Enum

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - exercised by the 3.10 install test

    class StrEnum(str, Enum):
        """Members are strings; `str(m)` and `f"{m}"` give `m.value` (as enum.StrEnum)."""

        def __str__(self) -> str:
            return str.__str__(self)

        def __format__(self, spec: str) -> str:
            return str.__format__(str.__str__(self), spec)

        @staticmethod
        def _generate_next_value_(name, start, count, last_values):  # auto() -> lower-case name
            return name.lower()


__all__ = ["StrEnum"]
