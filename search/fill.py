"""Filling one wave at a time so that the gradient slots mix (numba, one kernel).

The greedy places each piece where it fits, so a wave's rows come mostly from one gradient
slot; its load then peaks at that slot's last backward layer, where a row of the rank-64
slot costs about twice a row of the rank-16 slot, and the other slot's point keeps room no
piece of the binding slot can use. Here each wave is filled in turn, starting from the
largest atom left: the next atom is the one whose rise of the wave's peak, less FILL_ALPHA x
its size (its largest weight), is smallest (ties: the larger). An atom of the slot that does
not bind raises the peak by little or nothing, so it wins while its slot has room, and the
wave takes rows of both slots until both points are full; an atom of a prompt already in the
wave pays no header, so the prompt is rarely repeated without need. The wave closes when no
atom left fits.

Candidates per pick: walking the atoms left by decreasing size, the first FILL_PER_POINT that
fit of each dominant point (where the atom weighs most: its slot's binding point), plus the
largest fitting atom of every prompt block already in the wave. An atom whose weight alone
overflows the wave never fits it again (loads only grow), so it leaves the wave's walk.

Deterministic (no random draws). Complexity: O(A) per wave to set up its walk, and per pick
O(walked atoms x P) cheap checks plus O((FILL_PER_POINT x P + blocks in the wave x block size)
x P (1 + s)) evaluations; on generated 512-request steps about 16 evaluations per atom.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from waveplan.pricing.tolerances import FILL_TIE_EPS

from .greedy import LIMIT, atom_args
from .items import Blocks, Items
from .kernels import add_atom, delta, grow, peak

FILL_ALPHA = 0.8      # weight of an atom's size against the rise of the wave's peak
FILL_PER_POINT = 1    # fitting candidates per dominant point and pick


@njit(cache=True)
def _better(key, size, best, best_key, best_size):
    return best < 0 or key < best_key - FILL_TIE_EPS or (abs(key - best_key) <= FILL_TIE_EPS
                                                         and size > best_size)


@njit(cache=True)
def _over(load, b, aw, x, limit):
    """Whether atom x's weight alone overflows wave b (it never fits b again). O(P)."""
    for p in range(load.shape[1]):
        if load[b, p] + aw[x, p] > limit:
            return True
    return False


@njit(cache=True)
def fill_waves(order, atom_block, bptr, batoms, atoms, hdr, limit, alpha, per_point):
    """Waves filled one at a time (module docstring). `order`: the active atoms by decreasing
    size (ties: index); `atom_block`: each atom's block; `bptr`, `batoms`: the blocks' atoms
    (`items.Blocks`, decreasing size inside a block); `atoms`, `hdr`: `kernels.Pieces`,
    `kernels.Headers`. Returns (atom_wave with -1 for inactive atoms, waves, evaluations)."""
    aw, asptr, as_, acptr, ac = atoms
    sub_hdr, class_hdr = hdr
    A = aw.shape[0]
    P = aw.shape[1]
    n = order.shape[0]
    atom_wave = -np.ones(A, dtype=np.int64)
    if n == 0:
        return atom_wave, 0, 0
    size = np.zeros(A)
    heavy = np.zeros(A, dtype=np.int64)
    for i in range(n):
        a = order[i]
        for p in range(1, P):
            if aw[a, p] > aw[a, heavy[a]]:
                heavy[a] = p
        size[a] = aw[a, heavy[a]]
    points = 0   # dominant points held by some atom: the walk stops once each has its fits
    seen = np.zeros(P, dtype=np.bool_)
    for i in range(n):
        if not seen[heavy[order[i]]]:
            seen[heavy[order[i]]] = True
            points += 1
    done = np.zeros(A, dtype=np.bool_)
    load = np.zeros((16, P))
    scnt = np.zeros((16, sub_hdr.shape[0]), dtype=np.int32)
    ccnt = np.zeros((16, class_hdr.shape[0]), dtype=np.int32)
    tmp = np.empty(P)
    nxt = np.empty(n + 1, dtype=np.int64)   # the wave's walk: positions in `order`, n heads it
    prv = np.empty(n + 1, dtype=np.int64)
    present = np.empty(n, dtype=np.int64)   # blocks in the wave
    found = np.zeros(P, dtype=np.int64)
    nw = np.int64(0)   # typed, not Literal[int]: the primitives compile once
    left = n
    evals = 0
    while left > 0:
        load, scnt, ccnt = grow(load, scnt, ccnt, nw + 1)
        b = nw
        nw += 1
        last = n
        for i in range(n):
            if not done[order[i]]:
                nxt[last] = i
                prv[i] = last
                last = i
        nxt[last] = n
        prv[n] = last
        a = order[nxt[n]]   # the largest atom left
        npres = 0
        while True:
            add_atom(b, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr)
            atom_wave[a] = b
            done[a] = True
            left -= 1
            blk = atom_block[a]
            new = True
            for q in range(npres):
                if present[q] == blk:
                    new = False
            if new:
                present[npres] = blk
                npres += 1
            if left == 0:
                break
            pk = peak(load, b)
            best = np.int64(-1)
            best_key = 0.0
            best_size = 0.0
            for p in range(P):
                found[p] = 0
            full = 0
            i = nxt[n]
            while i != n and full < points:
                x = order[i]
                ni = nxt[i]
                gone = done[x]
                if not gone and found[heavy[x]] < per_point:
                    gone = _over(load, b, aw, x, limit)
                    if not gone:
                        evals += 1
                        m = delta(load, scnt, ccnt, b, aw[x], as_[asptr[x]:asptr[x + 1]],
                                  ac[acptr[x]:acptr[x + 1]], sub_hdr, class_hdr, tmp, limit)
                        if m <= limit:
                            found[heavy[x]] += 1
                            if found[heavy[x]] == per_point:
                                full += 1
                            key = (m - pk) - alpha * size[x]
                            if _better(key, size[x], best, best_key, best_size):
                                best, best_key, best_size = x, key, size[x]
                        else:
                            gone = True
                if gone:   # placed, or does not fit: out of this wave's walk
                    nxt[prv[i]] = ni
                    prv[ni] = prv[i]
                i = ni
            for q in range(npres):   # the blocks in the wave: their largest atom that fits
                blk = present[q]
                for j in range(bptr[blk], bptr[blk + 1]):
                    x = batoms[j]
                    if done[x] or _over(load, b, aw, x, limit):
                        continue
                    evals += 1
                    m = delta(load, scnt, ccnt, b, aw[x], as_[asptr[x]:asptr[x + 1]],
                              ac[acptr[x]:acptr[x + 1]], sub_hdr, class_hdr, tmp, limit)
                    if m > limit:
                        continue
                    key = (m - pk) - alpha * size[x]
                    if _better(key, size[x], best, best_key, best_size):
                        best, best_key, best_size = x, key, size[x]
                    break
            if best < 0:
                break
            a = best
    return atom_wave, nw, evals


def fill_plan(items: Items, blocks: Blocks, active: np.ndarray, alpha: float = FILL_ALPHA,
              per_point: int = FILL_PER_POINT) -> tuple[np.ndarray, int, int]:
    """`fill_waves` over the active atoms and their blocks (`items.blocks_for`): the atoms
    by decreasing largest weight (ties: index). Returns (atom_wave, waves, evaluations).
    O(A log A) plus the kernel's cost."""
    atom_block = np.full(items.num_atoms, -1, dtype=np.int64)
    atom_block[blocks.atoms] = np.repeat(np.arange(blocks.count, dtype=np.int64),
                                         np.diff(blocks.ptr))
    size = items.atom_w.max(axis=1) if items.atom_w.shape[1] else np.zeros(items.num_atoms)
    active = np.asarray(active, dtype=np.int64)
    order = active[np.lexsort((active, -size[active]))]
    atoms, headers = atom_args(items)
    return fill_waves(order, atom_block, blocks.ptr, blocks.atoms, atoms, headers, LIMIT,
                      float(alpha), int(per_point))
