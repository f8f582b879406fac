"""Shared test set-up. numba's cache folder is the one the CLI and `make` use
(`waveplan.pricing.jit_cache`), so tests load kernels compiled by either, and vice versa."""

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
