"""waveplan.pricing: geometry, layouts and the memory model (numba kernels)."""

from . import jit_cache as _jit_cache

# Before any kernel module is imported: numba picks a kernel's cache folder when it decorates it.
_jit_cache.use()
