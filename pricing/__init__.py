"""waveplan.pricing: geometry, layouts and the memory model (numba kernels)."""

import os as _os

# numba reads this once, at import; a writable default keeps the JIT cache out of site-packages.
_os.environ.setdefault("NUMBA_CACHE_DIR", _os.path.join(_os.path.expanduser("~"), ".cache", "waveplan", "numba"))
