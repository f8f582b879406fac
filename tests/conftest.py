"""Shared test set-up. numba's cache folder is the one the CLI and `make` use
(`waveplan.pricing.jit_cache`), so tests load kernels compiled by either, and vice versa.

Hypothesis draws the same examples on every run (profile ``gate``: derandomized, no example
database), so the suite is a stable gate; ``WAVEPLAN_HYPOTHESIS=explore`` draws fresh examples
each run to hunt for new counterexamples (docs/architecture.md)."""

import os

from hypothesis import settings

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

settings.register_profile("gate", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("WAVEPLAN_HYPOTHESIS", "gate"))
