"""Wave-state primitives shared by the greedy, the local moves and the multistart (numba).

A wave's state is its normalised envelope load (float64[W, P]) and how many of its atoms
touch each subgroup (int32[W, S]) and each class (int32[W, K]); a subgroup or class pays its
header only while its count is positive. Every primitive is O(P (1 + s)) for an atom touching
s subgroups, except `build_state` (O(A P)).

The kernels' entry points (`greedy.greedy_run`, `local.eliminate`, ...) take the packing
items as bundles: `Pieces` (what the greedy places: atoms, or blocks of atoms) and `Headers`
(what a subgroup or class present in a wave pays once). They unpack them once into local
arrays; the primitives here, called in their inner loops, take the plain arrays (numba
compiles the same loops as before the bundles existed).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit


class Pieces(NamedTuple):
    """Pieces to place (atoms, or blocks of atoms), with the subgroups and classes each
    touches as CSR: piece i touches subgroups s[sptr[i]:sptr[i + 1]] and classes
    c[cptr[i]:cptr[i + 1]]."""

    w: np.ndarray      # float64[N, P] normalised request weight
    sptr: np.ndarray   # int64[N + 1]
    s: np.ndarray      # int64: subgroups, ascending inside a piece
    cptr: np.ndarray   # int64[N + 1]
    c: np.ndarray      # int64: classes, ascending inside a piece


class Headers(NamedTuple):
    """What a wave pays once per subgroup (its prompt) and once per class present in it."""

    sub: np.ndarray    # float64[S, P]
    cls: np.ndarray    # float64[K, P]


@njit(cache=True)
def grow(load, scnt, ccnt, need):
    cap = load.shape[0]
    if need <= cap:
        return load, scnt, ccnt
    new = max(need, 2 * cap)
    l2 = np.zeros((new, load.shape[1]))
    s2 = np.zeros((new, scnt.shape[1]), dtype=np.int32)
    c2 = np.zeros((new, ccnt.shape[1]), dtype=np.int32)
    # loops, not slice copies: numba's slice copy compiles a shape check with string formatting
    for i in range(cap):
        for p in range(load.shape[1]):
            l2[i, p] = load[i, p]
        for p in range(scnt.shape[1]):
            s2[i, p] = scnt[i, p]
        for p in range(ccnt.shape[1]):
            c2[i, p] = ccnt[i, p]
    return l2, s2, c2


@njit(cache=True)
def delta(load, scnt, ccnt, b, w, subs, classes, sub_hdr, class_hdr, out, limit):
    """out = load of wave b after adding a piece of weight `w` touching subgroups `subs` and
    classes `classes`; returns max(out), or a value > limit as soon as the request weights
    alone overflow (out is then incomplete)."""
    P = load.shape[1]
    for p in range(P):
        v = load[b, p] + w[p]
        if v > limit:
            return v
        out[p] = v
    for j in range(subs.shape[0]):
        s = subs[j]
        if scnt[b, s] == 0:
            for p in range(P):
                out[p] += sub_hdr[s, p]
    for j in range(classes.shape[0]):
        k = classes[j]
        if ccnt[b, k] == 0:
            for p in range(P):
                out[p] += class_hdr[k, p]
    m = -1e300
    for p in range(P):
        if out[p] > m:
            m = out[p]
    return m


@njit(cache=True)
def peak(load, b):
    """The largest load of wave b over the points (its binding point's load). O(P)."""
    m = -1e300
    for p in range(load.shape[1]):
        if load[b, p] > m:
            m = load[b, p]
    return m


@njit(cache=True)
def add_atom(b, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr):
    P = load.shape[1]
    for p in range(P):
        load[b, p] += aw[a, p]
    for j in range(asptr[a], asptr[a + 1]):
        s = as_[j]
        if scnt[b, s] == 0:
            for p in range(P):
                load[b, p] += sub_hdr[s, p]
        scnt[b, s] += 1
    for j in range(acptr[a], acptr[a + 1]):
        k = ac[j]
        if ccnt[b, k] == 0:
            for p in range(P):
                load[b, p] += class_hdr[k, p]
        ccnt[b, k] += 1


@njit(cache=True)
def remove_atom(b, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr):
    P = load.shape[1]
    for p in range(P):
        load[b, p] -= aw[a, p]
    for j in range(asptr[a], asptr[a + 1]):
        s = as_[j]
        scnt[b, s] -= 1
        if scnt[b, s] == 0:
            for p in range(P):
                load[b, p] -= sub_hdr[s, p]
    for j in range(acptr[a], acptr[a + 1]):
        k = ac[j]
        ccnt[b, k] -= 1
        if ccnt[b, k] == 0:
            for p in range(P):
                load[b, p] -= class_hdr[k, p]


@njit(cache=True)
def build_state(atom_wave, nw, active, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr):
    P = sub_hdr.shape[1]
    load = np.zeros((max(nw, 1), P))
    scnt = np.zeros((max(nw, 1), sub_hdr.shape[0]), dtype=np.int32)
    ccnt = np.zeros((max(nw, 1), class_hdr.shape[0]), dtype=np.int32)
    for i in range(active.shape[0]):
        a = active[i]
        add_atom(atom_wave[a], a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                  class_hdr)
    return load, scnt, ccnt
