"""Group-aware greedy packing against the affine envelope (numba kernels).

A *piece* is a block (atoms sharing prefix groups) or one atom. Each greedy run walks the
blocks in a given order; a block goes whole into an open wave chosen by the placement rule
when it fits there; otherwise (mode 0) it opens a new wave when it fits alone, or (mode 1, or
when it does not fit alone) its atoms are placed one by one, opening waves as needed. Adding
a piece to a wave costs its request weights plus the headers of the subgroups and classes the
wave does not hold yet, so a prompt is paid once per wave it appears in.

Placement rules: 0 first fit, 1 best fit (tightest wave after), 2 cheapest increase (favours
waves that already hold the prompt), 3 worst fit (least loaded after; used for exact counts).

`pack_greedy` runs several orders x rules x modes and keeps the fewest waves (first found on
ties), stopping as soon as a run meets the lower bound.

Complexity of one run: O(M W P (1 + s)) for M pieces placed, W open waves, P envelope points
and s distinct subgroups per piece; memory O(W (P + S + K)).
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit

from .items import FIT_EPS, Blocks, Items

LIMIT = 1.0 - FIT_EPS


@njit(cache=True)
def _grow(load, scnt, ccnt, need):
    cap = load.shape[0]
    if need <= cap:
        return load, scnt, ccnt
    new = max(need, 2 * cap)
    l2 = np.zeros((new, load.shape[1]))
    s2 = np.zeros((new, scnt.shape[1]), dtype=np.int32)
    c2 = np.zeros((new, ccnt.shape[1]), dtype=np.int32)
    l2[:cap] = load
    s2[:cap] = scnt
    c2[:cap] = ccnt
    return l2, s2, c2


@njit(cache=True)
def _delta(load, scnt, ccnt, b, w, s_lo, s_hi, s_arr, c_lo, c_hi, c_arr,
           sub_hdr, class_hdr, out, limit):
    """out = load of wave b after adding the piece; returns max(out), or a value > limit as
    soon as the request weights alone overflow (out is then incomplete)."""
    P = load.shape[1]
    for p in range(P):
        v = load[b, p] + w[p]
        if v > limit:
            return v
        out[p] = v
    for j in range(s_lo, s_hi):
        s = s_arr[j]
        if scnt[b, s] == 0:
            for p in range(P):
                out[p] += sub_hdr[s, p]
    for j in range(c_lo, c_hi):
        k = c_arr[j]
        if ccnt[b, k] == 0:
            for p in range(P):
                out[p] += class_hdr[k, p]
    m = -1e300
    for p in range(P):
        if out[p] > m:
            m = out[p]
    return m


@njit(cache=True)
def _add_atom(b, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr):
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
def _remove_atom(b, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr):
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
def _choose(nw, rule, load, scnt, ccnt, w, s_lo, s_hi, s_arr, c_lo, c_hi, c_arr,
            sub_hdr, class_hdr, tmp, limit):
    """Wave for a piece under `rule`, or -1 when no open wave holds it."""
    best = -1
    best_key = 0.0
    best_key2 = 0.0
    P = load.shape[1]
    for b in range(nw):
        m = _delta(load, scnt, ccnt, b, w, s_lo, s_hi, s_arr, c_lo, c_hi, c_arr,
                   sub_hdr, class_hdr, tmp, limit)
        if m > limit:
            continue
        if rule == 0:
            return b
        if rule == 1:
            key = -m
            key2 = 0.0
        elif rule == 2:
            inc = 0.0
            for p in range(P):
                inc += tmp[p] - load[b, p]
            key = inc
            key2 = -m
        else:
            key = m
            key2 = 0.0
        if best < 0 or key < best_key - 1e-15 or (abs(key - best_key) <= 1e-15
                                                   and key2 < best_key2):
            best = b
            best_key = key
            best_key2 = key2
    return best


@njit(cache=True)
def greedy_run(border, rule, mode, fixed, bptr, batoms, bw, bsptr, bs, bcptr, bc, balone,
               aw, asptr, as_, acptr, ac, aalone, sub_hdr, class_hdr, num_atoms, limit):
    """One greedy pass. Returns (atom_wave[num_atoms] with -1 for atoms not packed, waves);
    waves = -1 when `fixed` > 0 waves cannot hold everything (some may stay empty)."""
    P = sub_hdr.shape[1]
    S = sub_hdr.shape[0]
    K = class_hdr.shape[0]
    cap0 = fixed if fixed > 0 else 16
    load = np.zeros((cap0, P))
    scnt = np.zeros((cap0, S), dtype=np.int32)
    ccnt = np.zeros((cap0, K), dtype=np.int32)
    atom_wave = -np.ones(num_atoms, dtype=np.int64)
    nw = fixed if fixed > 0 else 0
    tmp = np.empty(P)
    for bi in range(border.shape[0]):
        blk = border[bi]
        b = _choose(nw, rule, load, scnt, ccnt, bw[blk], bsptr[blk], bsptr[blk + 1], bs,
                    bcptr[blk], bcptr[blk + 1], bc, sub_hdr, class_hdr, tmp, limit)
        whole_alone = True
        for p in range(P):
            if balone[blk, p] > limit:
                whole_alone = False
        if b < 0 and fixed == 0 and mode == 0 and whole_alone:
            load, scnt, ccnt = _grow(load, scnt, ccnt, nw + 1)
            b = nw
            nw += 1
        if b >= 0:
            for j in range(bptr[blk], bptr[blk + 1]):
                a = batoms[j]
                _add_atom(b, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr)
                atom_wave[a] = b
            continue
        for j in range(bptr[blk], bptr[blk + 1]):
            a = batoms[j]
            b = _choose(nw, rule, load, scnt, ccnt, aw[a], asptr[a], asptr[a + 1], as_,
                        acptr[a], acptr[a + 1], ac, sub_hdr, class_hdr, tmp, limit)
            if b < 0:
                if fixed > 0:
                    return atom_wave, -1
                load, scnt, ccnt = _grow(load, scnt, ccnt, nw + 1)
                b = nw
                nw += 1
            _add_atom(b, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr)
            atom_wave[a] = b
    return atom_wave, nw


@njit(cache=True)
def build_state(atom_wave, nw, active, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr):
    P = sub_hdr.shape[1]
    load = np.zeros((max(nw, 1), P))
    scnt = np.zeros((max(nw, 1), sub_hdr.shape[0]), dtype=np.int32)
    ccnt = np.zeros((max(nw, 1), class_hdr.shape[0]), dtype=np.int32)
    for i in range(active.shape[0]):
        a = active[i]
        _add_atom(atom_wave[a], a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                  class_hdr)
    return load, scnt, ccnt


@njit(cache=True)
def eliminate(atom_wave, nw, active, asize, candidates, aw, asptr, as_, acptr, ac,
              sub_hdr, class_hdr, limit):
    """Empty light waves by moving their atoms into other waves (cheapest increase), up to
    `candidates` lightest waves per round, until no wave can be emptied. Returns the new
    number of waves (atom_wave is updated in place, waves renumbered densely).
    O(rounds * candidates * A_w * W * P)."""
    load, scnt, ccnt = build_state(atom_wave, nw, active, aw, asptr, as_, acptr, ac,
                                   sub_hdr, class_hdr)
    P = sub_hdr.shape[1]
    tmp = np.empty(P)
    order_a = active[np.argsort(-asize[active], kind="mergesort")]
    moved_a = np.empty(active.shape[0], dtype=np.int64)
    moved_to = np.empty(active.shape[0], dtype=np.int64)
    while nw > 1:
        weight = np.zeros(nw)
        for b in range(nw):
            for p in range(P):
                weight[b] += load[b, p]
        worder = np.argsort(weight, kind="mergesort")
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
                best = -1
                best_key = 0.0
                wa = aw[a]
                for b in range(nw):
                    if b == c:
                        continue
                    m = _delta(load, scnt, ccnt, b, wa, asptr[a], asptr[a + 1], as_,
                               acptr[a], acptr[a + 1], ac, sub_hdr, class_hdr, tmp, limit)
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
                _remove_atom(c, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                             class_hdr)
                _add_atom(best, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
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
                    load[c] = load[last]
                    scnt[c] = scnt[last]
                    ccnt[c] = ccnt[last]
                nw -= 1
                done = True
                break
            for j in range(nm - 1, -1, -1):
                a = moved_a[j]
                _remove_atom(moved_to[j], a, load, scnt, ccnt, aw, asptr, as_, acptr, ac,
                             sub_hdr, class_hdr)
                _add_atom(c, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                          class_hdr)
                atom_wave[a] = c
        if not done:
            break
    return nw


@njit(cache=True)
def balance(atom_wave, nw, active, max_moves, aw, asptr, as_, acptr, ac, sub_hdr,
            class_hdr, limit):
    """Move atoms out of the most loaded wave while that lowers the largest load, keeping
    every wave non-empty. In place; returns the number of moves. O(max_moves * A * W * P)."""
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
        top = 0
        top_m = -1e300
        for b in range(nw):
            m = load[b].max()
            if m > top_m:
                top_m = m
                top = b
        if count[top] <= 1:
            break
        best_a = -1
        best_b = -1
        best_val = top_m - 1e-12
        for i in range(active.shape[0]):
            a = active[i]
            if atom_wave[a] != top:
                continue
            # load of `top` without a
            _remove_atom(top, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                         class_hdr)
            for p in range(P):
                rem[p] = load[top, p]
            _add_atom(top, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr)
            rm = rem.max()
            wa = aw[a]
            for b in range(nw):
                if b == top:
                    continue
                m = _delta(load, scnt, ccnt, b, wa, asptr[a], asptr[a + 1], as_,
                           acptr[a], acptr[a + 1], ac, sub_hdr, class_hdr, tmp, limit)
                if m > limit:
                    continue
                val = max(m, rm)
                if val < best_val:
                    best_val = val
                    best_a = a
                    best_b = b
        if best_a < 0:
            break
        _remove_atom(top, best_a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                     class_hdr)
        _add_atom(best_b, best_a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                  class_hdr)
        atom_wave[best_a] = best_b
        count[top] -= 1
        count[best_b] += 1
        moves += 1
    return moves


def kernel_args(items: Items, blocks: Blocks) -> tuple:
    """The array arguments shared by every kernel call, in `greedy_run` order after `fixed`."""
    return (blocks.ptr, blocks.atoms, blocks.w, blocks.sptr, blocks.s, blocks.cptr, blocks.c,
            blocks.alone, items.atom_w, items.atom_sptr, items.atom_s, items.atom_cptr,
            items.atom_c, items.atom_alone, items.sub_hdr, items.class_hdr, items.num_atoms,
            LIMIT)


def atom_args(items: Items) -> tuple:
    return (items.atom_w, items.atom_sptr, items.atom_s, items.atom_cptr, items.atom_c,
            items.sub_hdr, items.class_hdr)


def block_orders(blocks: Blocks, items: Items) -> list[np.ndarray]:
    """Deterministic block orders: decreasing largest load, decreasing total load,
    decreasing total load weighted towards the tightest point."""
    nb = blocks.count
    if nb == 0:
        return [np.zeros(0, dtype=np.int64)]
    idx = np.arange(nb)
    by_max = np.lexsort((idx, -blocks.size))
    by_sum = np.lexsort((idx, -blocks.alone.sum(axis=1)))
    tight = blocks.alone.sum(axis=0)
    key = blocks.alone @ (tight / max(float(tight.sum()), 1e-300))
    by_tight = np.lexsort((idx, -key))
    out = []
    for o in (by_max, by_sum, by_tight):
        o = o.astype(np.int64)
        if not any(np.array_equal(o, x) for x in out):
            out.append(o)
    return out


def pack_greedy(items: Items, blocks: Blocks, target: int, fixed: int = 0,
                deadline: float | None = None) -> tuple[np.ndarray | None, int, int]:
    """Best of the deterministic greedy runs. Returns (atom_wave, waves, runs); waves = -1
    (and atom_wave None) when `fixed` > 0 waves could not be filled by any run. With a
    `deadline` (perf_counter seconds), no new run starts after it once a plan exists."""
    rules = (3, 1, 2, 0) if fixed else (1, 2, 0)
    modes = (0,) if fixed else (0, 1)
    args = kernel_args(items, blocks)
    best, best_nw, runs = None, -1, 0
    for order in block_orders(blocks, items):
        for mode in modes:
            for rule in rules:
                aw, nw = greedy_run(order, rule, mode, fixed, *args)
                runs += 1
                if nw > 0 and (best_nw < 0 or nw < best_nw):
                    best, best_nw = aw, nw
                if best_nw > 0 and best_nw <= target:
                    return best, best_nw, runs
                if best_nw > 0 and deadline is not None and time.perf_counter() >= deadline:
                    return best, best_nw, runs
    return best, best_nw, runs
