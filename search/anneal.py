"""Emptying light waves by annealing against the envelope (numba, one kernel).

The greedy keeps prompt groups together and the ejection chains (`eject`) only accept
placements that fit, so neither reshapes the plan: on large steps the waves are full, and
room appears only when their slots mix. A wave's load peaks at the point of the gradient slot
whose rows bind, where a row of that slot costs about twice what a row of the other slot
costs (rank 64 against 16), so a wave that mixes the slots holds more rows, even when that
repeats a prompt. Here the lightest wave (sum of loads; ties: the lower index) goes to a pool
and the plan is annealed until the pool is empty:
- pool insert: a pool atom (the largest, or a drawn one) goes into the wave where it fits
  with the smallest rise of the wave's peak (then the tightest after): a wave whose binding
  point belongs to the other slot takes it for little or nothing;
- pool swap: it replaces a smaller atom of a drawn wave that then fits; the atom it replaces
  joins the pool;
- wave move / swap: an atom of a drawn wave moves to, or trades places with an atom of,
  another drawn wave, when both still fit.
Every change is priced by its waves' envelope loads (the primitives of `kernels`, touched
waves only) and accepted when the objective falls, else with probability exp(-rise / T):
the objective is each wave's peak less ROOM_BONUS x its room squared over the mean atom size
(room concentrated in few waves is what lets a pool atom in), plus POOL_PENALTY x the sizes in
the pool. T falls geometrically from T_START to T_END (x the mean atom size) over the chain's
evaluations. When the pool empties the wave is gone and the next lightest is tried with what
is left; a chain out of evaluations is rolled back. numba's generator is seeded from `seed`,
so the same input gives the same plan.

Aimed chains (`aimed`, for large evaluation budgets: `packers.ANNEAL_AIMED_MIN_EVALS`) get
more out of each evaluation; on generated 512-request steps (`bench_search.bench_case`) they
empty the next wave in a half to a quarter of the evaluations (medians of 12 draws: 51k
against 220k, 185k against 384k, 599k against 1225k on seeds 0, 2, 4):
- each atom's own point (where its weight is largest, its slot's binding point) and each
  wave's binding point are kept; an insert reads a wave's load at those two points first and
  prices the whole wave only when both fit (QUICK_PER_EVAL such reads count as one
  evaluation: measured, an aimed evaluation then costs what a plain one does), and a wave
  move is dropped the same way;
- the scan also finds the pool atom's nearest wave (the least of those two loads after it);
  NEAR_SHARE of the pool swaps go there, trading the atom for a smaller one of its own slot
  (the freed room is where the atom needs it);
- colder (AIM_T_START, AIM_T_END), and a chain lasts AIM_CHAIN_EVALS: one that cannot empty
  its wave gives the pool back to it (rolled back only if it no longer fits) and the next
  chain starts, reheated, from the mixed plan.
Plain chains (small budgets) run as before: at a few thousand evaluations either kind empties
at most an easy wave, by the luck of its draws (at the default 5 ms on 20 generated
512-request steps, aimed chains emptied none that plain ones left and missed one they
emptied), so plain ones keep those plans as they were.

Complexity: O(max_work) evaluations of one wave each, O(P (1 + s)) per evaluation; an insert
scans every wave (counted as W evaluations; aimed: W / QUICK_PER_EVAL for the quick reads);
O(W A) memory for the wave member lists.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kernels import add_atom, build_state, delta, peak, remove_atom

ROOM_BONUS = 0.2      # weight of the convex room bonus in the objective
POOL_PENALTY = 1.5    # objective cost of an atom's size while it sits in the pool
POOL_SHARE = 0.3      # share of the steps that work on the pool (the rest: wave to wave)
T_START = 0.05        # plain chains: temperature at the start of a chain, x the mean atom size
T_END = 0.002         # ... and at its end
AIM_T_START = 0.02    # aimed chains: the same, colder
AIM_T_END = 0.001
AIM_CHAIN_EVALS = 200000   # aimed: evaluations per chain; one out of them gives its pool back
NEAR_SHARE = 0.8      # aimed: share of the pool swaps that go to the pool atom's nearest wave
QUICK_PER_EVAL = 2    # aimed: quick misfit checks (two points) counted as one evaluation
NEAR_TRIES = 3        # ... drawing up to this many atoms for one of its slot, and smaller


@njit(cache=True)
def argpeak(load, b):
    """The binding point of wave b (the first of the largest loads). O(P)."""
    q = 0
    for p in range(1, load.shape[1]):
        if load[b, p] > load[b, q]:
            q = p
    return q


@njit(cache=True)
def anneal(atom_wave, nw, active, asize, target, max_work, seed, atoms, hdr, limit, aimed):
    """Empty light waves by annealing (module docstring) while more than `target` waves are
    left, within `max_work` evaluations in all. atom_wave (int64[A], -1 for inactive atoms)
    is updated in place, waves renumbered densely. Returns (waves, evaluations spent).
    `atoms`, `hdr`: `kernels.Pieces`, `kernels.Headers`; `limit`: the fit limit; `aimed`:
    aimed chains (module docstring), else plain ones."""
    aw, asptr, as_, acptr, ac = atoms
    sub_hdr, class_hdr = hdr
    np.random.seed(seed)
    n_act = active.shape[0]
    if n_act == 0 or nw <= max(target, 1):
        return nw, 0
    mean_size = 0.0
    for i in range(n_act):
        mean_size += asize[active[i]]
    mean_size /= n_act
    mean_size = max(mean_size, 1e-12)
    load, scnt, ccnt = build_state(atom_wave, nw, active, aw, asptr, as_, acptr, ac,
                                   sub_hdr, class_hdr)
    A = atom_wave.shape[0]
    mem = np.empty((nw, n_act), dtype=np.int64)   # members of each wave
    cnt = np.zeros(nw, dtype=np.int64)
    pos = -np.ones(A, dtype=np.int64)
    saved = atom_wave.copy()
    pool = np.empty(n_act, dtype=np.int64)
    tmp = np.empty(load.shape[1])
    P = load.shape[1]
    heavy = np.zeros(A, dtype=np.int64)      # the point where each atom weighs most
    for i in range(n_act):
        a = active[i]
        for p in range(1, P):
            if aw[a, p] > aw[a, heavy[a]]:
                heavy[a] = p
    bind = np.zeros(nw, dtype=np.int64)      # each wave's binding point
    for b in range(nw):
        bind[b] = argpeak(load, b)
    changed = np.zeros(nw, dtype=np.int64)   # when each wave last changed (a tick)
    seen = -np.ones(A, dtype=np.int64)       # when each pool atom last scanned the waves
    near_of = -np.ones(A, dtype=np.int64)    # ... and the wave nearest to holding it then
    tick = 0
    work = 0
    quick = 0    # quick misfit checks not yet counted as an evaluation
    t_start = AIM_T_START if aimed else T_START
    t_end = AIM_T_END if aimed else T_END
    while nw > max(target, 1) and work < max_work:
        # members and the lightest wave
        for b in range(nw):
            cnt[b] = 0
        for i in range(n_act):
            a = active[i]
            b = atom_wave[a]
            pos[a] = cnt[b]
            mem[b, cnt[b]] = a
            cnt[b] += 1
        c = np.int64(0)   # typed, not Literal[int]: remove_atom compiles once
        best_w = 1e300
        for b in range(nw):
            w = 0.0
            for p in range(load.shape[1]):
                w += load[b, p]
            if w < best_w:
                best_w = w
                c = b
        for i in range(n_act):
            saved[active[i]] = atom_wave[active[i]]
        npool = 0
        tick += 1
        for b in range(nw):
            changed[b] = tick
        for j in range(cnt[c]):
            a = mem[c, j]
            remove_atom(c, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr)
            atom_wave[a] = -1
            pool[npool] = a
            npool += 1
            seen[a] = -1
        cnt[c] = 0
        start = work
        span = max(min(max_work - work, AIM_CHAIN_EVALS) if aimed else max_work - work, 1)
        while npool > 0 and work < max_work and work - start < span:
            frac = (work - start) / span
            temp = mean_size * t_start * (t_end / t_start) ** frac
            if np.random.random() < POOL_SHARE or npool == n_act:
                # a pool atom: the largest, or a drawn one
                if np.random.random() < 0.5:
                    j = np.random.randint(0, npool)
                else:
                    j = 0
                    for q in range(1, npool):
                        if asize[pool[q]] > asize[pool[j]] or (
                                asize[pool[q]] == asize[pool[j]] and pool[q] < pool[j]):
                            j = q
                a = pool[j]
                # insert: the smallest rise of the peak, then the tightest
                best = np.int64(-1)
                best_rise = 0.0
                best_after = 0.0
                subs = as_[asptr[a]:asptr[a + 1]]
                classes = ac[acptr[a]:acptr[a + 1]]
                scanned = 0
                h = heavy[a]
                near = -1
                near_load = 0.0
                for b in range(nw):
                    if b == c or changed[b] <= seen[a]:
                        continue
                    if aimed:   # its load at two points: the nearest wave, a quick misfit
                        est = max(load[b, h] + aw[a, h], load[b, bind[b]] + aw[a, bind[b]])
                        if near < 0 or est < near_load:
                            near = b
                            near_load = est
                        if est > limit:
                            quick += 1
                            continue
                    scanned += 1
                    after = delta(load, scnt, ccnt, b, aw[a], subs, classes, sub_hdr,
                                  class_hdr, tmp, limit)
                    if after > limit:
                        continue
                    before = peak(load, b)
                    if (best < 0 or after - before < best_rise or (
                            after - before == best_rise and after > best_after)):
                        best = b
                        best_rise = after - before
                        best_after = after
                if near < 0:   # no wave changed since its last scan: the nearest then
                    near = near_of[a]
                near_of[a] = near
                tick += 1
                seen[a] = tick
                work += max(scanned, 1) + quick // QUICK_PER_EVAL
                quick %= QUICK_PER_EVAL
                if best >= 0:
                    add_atom(best, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                             class_hdr)
                    tick += 1
                    changed[best] = tick
                    bind[best] = argpeak(load, best)
                    atom_wave[a] = best
                    pos[a] = cnt[best]
                    mem[best, cnt[best]] = a
                    cnt[best] += 1
                    pool[j] = pool[npool - 1]
                    npool -= 1
                    continue
                # swap with a smaller atom of a drawn wave (or of the wave with the most room
                # at the atom's point, for an atom of the same slot)
                b = np.random.randint(0, nw)
                if aimed and near >= 0 and np.random.random() < NEAR_SHARE:
                    b = near
                if b == c or cnt[b] == 0:
                    continue
                y = mem[b, np.random.randint(0, cnt[b])]
                if b == near:
                    for _ in range(NEAR_TRIES):
                        if heavy[y] == h and asize[y] < asize[a]:
                            break
                        y = mem[b, np.random.randint(0, cnt[b])]
                if asize[y] >= asize[a] and np.random.random() < 0.8:
                    continue
                work += 1
                v0 = peak(load, b)
                remove_atom(b, y, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                            class_hdr)
                add_atom(b, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr)
                v1 = peak(load, b)
                ok = v1 <= limit
                if ok:
                    r0 = max(limit - v0, 0.0)
                    r1 = max(limit - v1, 0.0)
                    d = (v1 - ROOM_BONUS * r1 * r1 / mean_size) - (
                        v0 - ROOM_BONUS * r0 * r0 / mean_size) + POOL_PENALTY * (
                        asize[y] - asize[a])
                    ok = d <= 0.0 or np.random.random() < np.exp(-d / temp)
                if ok:
                    tick += 1
                    changed[b] = tick
                    bind[b] = argpeak(load, b)
                    seen[y] = -1
                    atom_wave[a] = b
                    atom_wave[y] = -1
                    mem[b, pos[y]] = a
                    pos[a] = pos[y]
                    pool[j] = y
                else:
                    remove_atom(b, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                                class_hdr)
                    add_atom(b, y, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                             class_hdr)
                continue
            # wave to wave: move x from wave a to wave b, or swap it with y of b
            wa = np.random.randint(0, nw)
            wb = np.random.randint(0, nw)
            if wa == wb or wa == c or wb == c or cnt[wa] == 0:
                continue
            x = mem[wa, np.random.randint(0, cnt[wa])]
            y = np.int64(-1)
            if cnt[wb] > 0 and np.random.random() < 0.5:
                y = mem[wb, np.random.randint(0, cnt[wb])]
            if aimed and y < 0 and (load[wb, heavy[x]] + aw[x, heavy[x]] > limit
                                    or load[wb, bind[wb]] + aw[x, bind[wb]] > limit):
                quick += 1    # two points overflow: a quick misfit
                work += 1 + quick // QUICK_PER_EVAL
                quick %= QUICK_PER_EVAL
                continue
            work += 2
            if y < 0 and delta(load, scnt, ccnt, wb, aw[x], as_[asptr[x]:asptr[x + 1]],
                               ac[acptr[x]:acptr[x + 1]], sub_hdr, class_hdr, tmp,
                               limit) > limit:
                continue
            va0 = peak(load, wa)
            vb0 = peak(load, wb)
            remove_atom(wa, x, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr)
            add_atom(wb, x, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr)
            if y >= 0:
                remove_atom(wb, y, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                            class_hdr)
                add_atom(wa, y, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                         class_hdr)
            va1 = peak(load, wa)
            vb1 = peak(load, wb)
            ok = va1 <= limit and vb1 <= limit
            if ok:
                ra0 = max(limit - va0, 0.0)
                rb0 = max(limit - vb0, 0.0)
                ra1 = max(limit - va1, 0.0)
                rb1 = max(limit - vb1, 0.0)
                d = (va1 + vb1 - va0 - vb0) - ROOM_BONUS * (
                    ra1 * ra1 + rb1 * rb1 - ra0 * ra0 - rb0 * rb0) / mean_size
                ok = d <= 0.0 or np.random.random() < np.exp(-d / temp)
            if ok:
                tick += 1
                changed[wa] = tick
                changed[wb] = tick
                bind[wa] = argpeak(load, wa)
                bind[wb] = argpeak(load, wb)
                atom_wave[x] = wb
                px = pos[x]
                if y >= 0:
                    atom_wave[y] = wa
                    mem[wa, px] = y
                    mem[wb, pos[y]] = x
                    pos[x], pos[y] = pos[y], px
                else:
                    last = mem[wa, cnt[wa] - 1]
                    mem[wa, px] = last
                    pos[last] = px
                    cnt[wa] -= 1
                    mem[wb, cnt[wb]] = x
                    pos[x] = cnt[wb]
                    cnt[wb] += 1
            else:
                if y >= 0:
                    remove_atom(wa, y, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                                class_hdr)
                    add_atom(wb, y, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                             class_hdr)
                remove_atom(wb, x, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                            class_hdr)
                add_atom(wa, x, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                         class_hdr)
        if npool > 0:
            # out of evaluations. Aimed: the pool goes back to wave c and the moves are kept
            # when it fits there (the next chain starts from the mixed plan); else, and in a
            # plain chain, the chain is rolled back
            if aimed:
                for j in range(npool):
                    a = pool[j]
                    add_atom(c, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr,
                             class_hdr)
                    atom_wave[a] = c
                if peak(load, c) <= limit:
                    for b in range(nw):
                        bind[b] = argpeak(load, b)
                    continue
            for i in range(n_act):
                atom_wave[active[i]] = saved[active[i]]
            if not aimed:
                break
            load, scnt, ccnt = build_state(atom_wave, nw, active, aw, asptr, as_, acptr, ac,
                                           sub_hdr, class_hdr)
            for b in range(nw):
                bind[b] = argpeak(load, b)
            continue
        for i in range(n_act):
            a = active[i]
            if atom_wave[a] > c:
                atom_wave[a] -= 1
        nw -= 1
        load, scnt, ccnt = build_state(atom_wave, nw, active, aw, asptr, as_, acptr, ac,
                                       sub_hdr, class_hdr)
        for b in range(nw):
            bind[b] = argpeak(load, b)
    return nw, work
