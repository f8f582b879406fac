"""Stable sorting for the jitted kernels, cheaper to compile than numba's own.

numba's `np.argsort(kind="mergesort")`, `np.sort` and `np.unique` overloads each compile a
family of helper functions per key type (about 0.8 s each on a 2-core machine, most of a
kernel's compile time when the kernel itself is small). The three kernels here are one small
loop each and give the same results: `stable_argsort` is the unique stable ascending order
(what `np.argsort(kind="mergesort")` returns: ties by index, NaN last), and sorting integers
gives the same values whatever the algorithm.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def stable_argsort(keys):
    """Indices that sort the 1-d array `keys` ascending; equal keys keep their index order,
    NaN sorts last. Equal to `np.argsort(keys, kind="mergesort")`. Bottom-up merge sort:
    O(n log n) time, O(n) extra memory."""
    n = keys.shape[0]
    src = np.arange(n)
    dst = np.empty(n, dtype=np.int64)
    width = 1
    while width < n:
        lo = 0
        while lo < n:
            mid = min(lo + width, n)
            hi = min(lo + 2 * width, n)
            i = lo
            j = mid
            k = lo
            while i < mid and j < hi:
                x = keys[src[j]]
                y = keys[src[i]]
                # x < y, NaN last; ties take the left run (stability)
                if x < y or (y != y and x == x):
                    dst[k] = src[j]
                    j += 1
                else:
                    dst[k] = src[i]
                    i += 1
                k += 1
            while i < mid:
                dst[k] = src[i]
                i += 1
                k += 1
            while j < hi:
                dst[k] = src[j]
                j += 1
                k += 1
            lo = hi
        src, dst = dst, src
        width *= 2
    return src


@njit(cache=True)
def sorted_ints(values):
    """A sorted copy of the 1-d integer array `values` (equal to `np.sort(values)`).
    O(n log n)."""
    order = stable_argsort(values)
    out = np.empty(values.shape[0], dtype=values.dtype)
    for i in range(values.shape[0]):
        out[i] = values[order[i]]
    return out


@njit(cache=True)
def unique_ints(values):
    """The distinct values of the 1-d integer array `values`, ascending (equal to
    `np.unique(values)`). O(n log n)."""
    ordered = sorted_ints(values)
    out = np.empty(ordered.shape[0], dtype=values.dtype)
    m = 0
    for i in range(ordered.shape[0]):
        if m == 0 or ordered[i] != out[m - 1]:
            out[m] = ordered[i]
            m += 1
    return out[:m].copy()
