"""Local moves on an envelope plan (numba): emptying light waves and balancing loads.

`eliminate` empties the lightest waves into the others (the greedy and the multistart apply
it to every run); `balance` moves atoms out of the most loaded wave while that lowers the
largest load (exact wave counts). Both keep every wave within the envelope. Both take the
items' atoms and headers as `kernels.Pieces` and `kernels.Headers` (`greedy.atom_args`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from waveplan.pricing.stable_sort import stable_argsort
from waveplan.pricing.tolerances import BALANCE_GAIN_EPS

from .kernels import add_atom, build_state, delta, remove_atom


@njit(cache=True)
def eliminate(atom_wave, nw, active, asize, candidates, atoms, hdr, limit):
    """Empty light waves by moving their atoms into other waves (cheapest increase), up to
    `candidates` lightest waves per round, until no wave can be emptied. Returns the new
    number of waves (atom_wave is updated in place, waves renumbered densely).
    O(rounds * candidates * A_w * W * P)."""
    aw, asptr, as_, acptr, ac = atoms
    sub_hdr, class_hdr = hdr
    load, scnt, ccnt = build_state(atom_wave, nw, active, aw, asptr, as_, acptr, ac,
                                   sub_hdr, class_hdr)
    P = sub_hdr.shape[1]
    tmp = np.empty(P)
    order_a = active[stable_argsort(-asize[active])]
    moved_a = np.empty(active.shape[0], dtype=np.int64)
    moved_to = np.empty(active.shape[0], dtype=np.int64)
    while nw > 1:
        weight = np.zeros(nw)
        for b in range(nw):
            for p in range(P):
                weight[b] += load[b, p]
        worder = stable_argsort(weight)
        done = False
        for ci in range(min(candidates, nw)):
            c = worder[ci]
            nm = 0
            ok = True
            for i in range(order_a.shape[0]):
                a = order_a[i]
                if atom_wave[a] != c:
                    continue
                # choose among waves != c: cheapest increase
                best = np.int64(-1)   # typed, not Literal[int]: one compile of add_atom
                best_key = 0.0
                wa = aw[a]
                subs = as_[asptr[a]:asptr[a + 1]]
                classes = ac[acptr[a]:acptr[a + 1]]
                for b in range(nw):
                    if b == c:
                        continue
                    m = delta(load, scnt, ccnt, b, wa, subs, classes, sub_hdr, class_hdr, tmp,
                              limit)
                    if m > limit:
                        continue
                    inc = 0.0
                    for p in range(P):
                        inc += tmp[p] - load[b, p]
                    if best < 0 or inc < best_key:
                        best = b
                        best_key = inc
                if best < 0:
                    ok = False
                    break
                remove_atom(c, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                             class_hdr)
                add_atom(best, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                          class_hdr)
                atom_wave[a] = best
                moved_a[nm] = a
                moved_to[nm] = best
                nm += 1
            if ok:
                last = nw - 1
                if c != last:
                    for i in range(active.shape[0]):
                        a = active[i]
                        if atom_wave[a] == last:
                            atom_wave[a] = c
                    for p in range(load.shape[1]):   # loops, not row copies (compile time)
                        load[c, p] = load[last, p]
                    for p in range(scnt.shape[1]):
                        scnt[c, p] = scnt[last, p]
                    for p in range(ccnt.shape[1]):
                        ccnt[c, p] = ccnt[last, p]
                nw -= 1
                done = True
                break
            for j in range(nm - 1, -1, -1):
                a = moved_a[j]
                remove_atom(moved_to[j], a, load, scnt, ccnt, aw, asptr, as_, acptr, ac,
                             sub_hdr, class_hdr)
                add_atom(c, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                          class_hdr)
                atom_wave[a] = c
        if not done:
            break
    return nw


@njit(cache=True)
def balance(atom_wave, nw, active, max_moves, atoms, hdr, limit):
    """Move atoms out of the most loaded wave while that lowers the largest load, keeping
    every wave non-empty. In place; returns the number of moves. O(max_moves * A * W * P)."""
    aw, asptr, as_, acptr, ac = atoms
    sub_hdr, class_hdr = hdr
    load, scnt, ccnt = build_state(atom_wave, nw, active, aw, asptr, as_, acptr, ac,
                                   sub_hdr, class_hdr)
    P = sub_hdr.shape[1]
    tmp = np.empty(P)
    rem = np.empty(P)
    count = np.zeros(nw, dtype=np.int64)
    for i in range(active.shape[0]):
        count[atom_wave[active[i]]] += 1
    moves = 0
    while moves < max_moves:
        top = np.int64(0)   # typed, not Literal[int]: one compile of add/remove_atom
        top_m = -1e300
        for b in range(nw):
            m = load[b].max()
            if m > top_m:
                top_m = m
                top = b
        if count[top] <= 1:
            break
        best_a = np.int64(-1)
        best_b = np.int64(-1)
        best_val = top_m - BALANCE_GAIN_EPS
        for i in range(active.shape[0]):
            a = active[i]
            if atom_wave[a] != top:
                continue
            # load of `top` without a
            remove_atom(top, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                         class_hdr)
            for p in range(P):
                rem[p] = load[top, p]
            add_atom(top, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr)
            rm = rem.max()
            wa = aw[a]
            subs = as_[asptr[a]:asptr[a + 1]]
            classes = ac[acptr[a]:acptr[a + 1]]
            for b in range(nw):
                if b == top:
                    continue
                m = delta(load, scnt, ccnt, b, wa, subs, classes, sub_hdr, class_hdr, tmp, limit)
                if m > limit:
                    continue
                val = max(m, rm)
                if val < best_val:
                    best_val = val
                    best_a = a
                    best_b = b
        if best_a < 0:
            break
        remove_atom(top, best_a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                     class_hdr)
        add_atom(best_b, best_a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                  class_hdr)
        atom_wave[best_a] = best_b
        count[top] -= 1
        count[best_b] += 1
        moves += 1
    return moves
