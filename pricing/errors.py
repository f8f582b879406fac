"""Errors raised by waveplan. Each names the field and the value that is wrong."""

from __future__ import annotations


class WaveplanError(ValueError):
    """Base class for every documented waveplan error (the CLI exits 2 on it)."""


class ConfigError(WaveplanError):
    """A geometry, layout, LoRA or pricing setting is invalid or unsupported."""


class StepError(WaveplanError):
    """A step file or an in-code request is malformed."""


class InfeasibleError(WaveplanError):
    """A request or atomic unit cannot fit the budget under any split."""


def bad(cls: type[WaveplanError], field: str, value: object, why: str) -> WaveplanError:
    """Build an error that names the field, the value and why it is wrong."""
    return cls(f"{field}={value!r}: {why}")
