"""Shared test set-up. NUMBA_CACHE_DIR must be set before numba is first imported."""

import os
import tempfile

os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(tempfile.gettempdir(), "waveplan-numba-cache"))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
