"""Emptying a light wave by ejection chains against the envelope (numba).

`local.eliminate` only moves atoms, so one atom that fits no other wave keeps a wave alive.
Here the atoms of the wave being emptied go to a pool, and each is placed in turn (largest
first): into the wave where it fits tightest, or, when none holds it, into a wave that holds
it once one of its atoms leaves (a swap: the leaving atom joins the pool). The leaving atom
is the one with the smallest size times (1 + the times it already left in this chain), so
chains drift towards small atoms and do not cycle; an atom placed within the last TABU
placements does not leave again. Swaps are what rebalance the gradient slots: a wave's load peaks at the point of its
heavier slot, so trading an atom of that slot for one of the other frees room that moves
never find. A subgroup's header is paid once per wave it appears in, so a chain may split a
prompt group when that pays.

The chain of one wave stops after `steps` placements; unless the pool is empty by then,
everything it moved is rolled back. Waves are tried lightest (sum of loads) and fewest atoms
first, alternately, up to `candidates` per round, while the plan is above `target` waves (a
bound).

Complexity: O(steps x A x P x s) per wave tried (a swap looks at every atom of every other
wave), O(steps x W x P x s) when every atom of the pool fits directly.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from waveplan.pricing.stable_sort import stable_argsort

from .kernels import add_atom, build_state, delta, remove_atom

TABU = 3   # an atom placed within the last TABU placements does not leave again


@njit(cache=True)
def _place(a, c, nw, state, atoms, hdr, tmp, limit):
    """The wave (not c) where atom a fits tightest (largest max load after), or -1.
    `state`: (load, scnt, ccnt) of the waves; `atoms`, `hdr`: `kernels.Pieces`, `Headers`."""
    load, scnt, ccnt = state
    aw, asptr, as_, acptr, ac = atoms
    sub_hdr, class_hdr = hdr
    best = -1
    best_m = -1.0
    subs = as_[asptr[a]:asptr[a + 1]]
    classes = ac[acptr[a]:acptr[a + 1]]
    for b in range(nw):
        if b == c:
            continue
        m = delta(load, scnt, ccnt, b, aw[a], subs, classes, sub_hdr, class_hdr, tmp, limit)
        if m <= limit and m > best_m:
            best, best_m = b, m
    return best


@njit(cache=True)
def _swap(a, c, nw, recent, chain, state, atoms, hdr, tmp, limit):
    """The atom y (in a wave other than c, not placed after placement `recent`) whose
    leaving lets atom a fit in y's wave, with the smallest asize[y] x (1 + left[y]) (ties:
    the lower index); -1 when none. `chain`: (active, atom_wave, stamp, left, asize, rm_ub,
    out); `rm_ub[y]` bounds what y's leaving frees (its weight and every header it touches),
    so most atoms are rejected at their wave's worst point without re-pricing; `out`
    (float64[W, P]) is scratch."""
    active, atom_wave, stamp, left, asize, rm_ub, out = chain
    load, scnt, ccnt = state
    aw, asptr, as_, acptr, ac = atoms
    sub_hdr, class_hdr = hdr
    P = load.shape[1]
    subs = as_[asptr[a]:asptr[a + 1]]
    classes = ac[acptr[a]:acptr[a + 1]]
    worst = np.zeros(nw, dtype=np.int64)
    over = np.zeros(nw)
    for b in range(nw):
        if b == c:
            continue
        for p in range(P):
            out[b, p] = load[b, p] + aw[a, p]
        for j in range(subs.shape[0]):
            if scnt[b, subs[j]] == 0:
                for p in range(P):
                    out[b, p] += sub_hdr[subs[j], p]
        for j in range(classes.shape[0]):
            if ccnt[b, classes[j]] == 0:
                for p in range(P):
                    out[b, p] += class_hdr[classes[j], p]
        w = 0
        for p in range(1, P):
            if out[b, p] > out[b, w]:
                w = p
        worst[b] = w
        over[b] = out[b, w] - limit
    ys = np.empty(active.shape[0], dtype=np.int64)
    keys = np.empty(active.shape[0])
    m_y = 0
    for i in range(active.shape[0]):
        y = active[i]
        b = atom_wave[y]
        if b < 0 or b == c or stamp[y] > recent or rm_ub[y, worst[b]] < over[b]:
            continue
        ys[m_y] = y
        keys[m_y] = asize[y] * (1.0 + left[y])
        m_y += 1
    order = stable_argsort(keys[:m_y])   # stable: ties by index
    for j in range(m_y):
        y = ys[order[j]]
        b = atom_wave[y]
        remove_atom(b, y, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr)
        m = delta(load, scnt, ccnt, b, aw[a], subs, classes, sub_hdr, class_hdr, tmp, limit)
        add_atom(b, y, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr)
        if m <= limit:
            return y
    return -1


@njit(cache=True)
def eject(atom_wave, nw, active, asize, target, candidates, steps, max_work, atoms, hdr,
          limit):
    """Empty light waves by ejection chains (module docstring) while more than `target`
    waves are left, at most `steps` placements per chain and `max_work` in all (a chain cut
    short by it is rolled back). Returns the new wave count (atom_wave updated in place,
    waves renumbered densely) and the placements made (kept or rolled back)."""
    aw, asptr, as_, acptr, ac = atoms
    sub_hdr, class_hdr = hdr
    load, scnt, ccnt = build_state(atom_wave, nw, active, aw, asptr, as_, acptr, ac,
                                   sub_hdr, class_hdr)
    P = sub_hdr.shape[1]
    A = atom_wave.shape[0]
    tmp = np.empty(P)
    saved = atom_wave.copy()
    stamp = -np.ones(A, dtype=np.int64)
    left = np.zeros(A)
    pool = np.empty(active.shape[0], dtype=np.int64)
    out = np.empty((max(nw, 1), P))
    rm_ub = np.zeros((A, P))     # what an atom's leaving frees at most, per point
    for i in range(active.shape[0]):
        y = active[i]
        for p in range(P):
            rm_ub[y, p] = aw[y, p]
        for j in range(asptr[y], asptr[y + 1]):
            for p in range(P):
                rm_ub[y, p] += sub_hdr[as_[j], p]
        for j in range(acptr[y], acptr[y + 1]):
            for p in range(P):
                rm_ub[y, p] += class_hdr[ac[j], p]
    chain = (active, atom_wave, stamp, left, asize, rm_ub, out)
    work = 0
    while nw > max(target, 1):
        weight = np.zeros(nw)
        for b in range(nw):
            for p in range(P):
                weight[b] += load[b, p]
        count = np.zeros(nw)
        for i in range(active.shape[0]):
            count[atom_wave[active[i]]] += 1.0
        # candidates: the lightest and the fewest-atom waves, alternately
        by_weight = stable_argsort(weight)
        by_count = stable_argsort(count)
        worder = np.empty(nw, dtype=np.int64)
        seen = np.zeros(nw, dtype=np.bool_)
        m = 0
        for i in range(nw):
            for x in (by_weight[i], by_count[i]):
                if not seen[x]:
                    seen[x] = True
                    worder[m] = x
                    m += 1
        emptied = False
        for ci in range(min(candidates, nw)):
            if work >= max_work:
                break
            c = worder[ci]
            for i in range(active.shape[0]):
                saved[active[i]] = atom_wave[active[i]]
            npool = 0
            for i in range(active.shape[0]):
                a = active[i]
                if atom_wave[a] == c:
                    remove_atom(c, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                                class_hdr)
                    atom_wave[a] = -1
                    pool[npool] = a
                    npool += 1
            for i in range(active.shape[0]):
                left[active[i]] = 0.0
            step = 0
            while npool > 0 and step < steps and work < max_work:
                # the largest atom of the pool (ties: the lower index)
                j = 0
                for q in range(1, npool):
                    if asize[pool[q]] > asize[pool[j]] or (asize[pool[q]] == asize[pool[j]]
                                                           and pool[q] < pool[j]):
                        j = q
                a = pool[j]
                pool[j] = pool[npool - 1]
                npool -= 1
                step += 1
                work += 1
                b = _place(a, c, nw, (load, scnt, ccnt), atoms, hdr, tmp, limit)
                if b < 0:
                    y = _swap(a, c, nw, work - TABU, chain, (load, scnt, ccnt), atoms, hdr,
                              tmp, limit)
                    if y < 0:
                        pool[npool] = a
                        npool += 1
                        break
                    b = atom_wave[y]
                    remove_atom(b, y, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                                class_hdr)
                    atom_wave[y] = -1
                    left[y] += 1.0
                    pool[npool] = y
                    npool += 1
                add_atom(b, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr)
                atom_wave[a] = b
                stamp[a] = work
            if npool == 0:
                # renumber: the waves above c move down by one
                for i in range(active.shape[0]):
                    a = active[i]
                    if atom_wave[a] > c:
                        atom_wave[a] -= 1
                nw -= 1
                load, scnt, ccnt = build_state(atom_wave, nw, active, aw, asptr, as_, acptr,
                                               ac, sub_hdr, class_hdr)
                emptied = True
                break
            # roll back
            for i in range(active.shape[0]):
                atom_wave[active[i]] = saved[active[i]]
            load, scnt, ccnt = build_state(atom_wave, nw, active, aw, asptr, as_, acptr, ac,
                                           sub_hdr, class_hdr)
        if not emptied or work >= max_work:
            break
    return nw, work
