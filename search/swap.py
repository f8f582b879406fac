"""Emptying the lightest wave with exactly priced moves and swaps (large steps).

`reprice.dissolve_lightest` only moves atoms, so one atom that fits no other wave keeps the
wave alive; on large steps the waves are nearly full and that is the common case. Here the
atoms of the lightest flat wave go to a pool and are placed one at a time, the largest first
(size x (1 + times it already left in this chain), so chains drift towards small atoms and do
not cycle):
- a move into another wave where it fits at its exact price, or else
- a swap: it replaces an atom y of another wave when that wave then fits at its exact
  price, and y joins the pool (an atom placed within the last TABU placements does not
  leave again).
Candidates are ranked by an estimate that sees the per-slot peak structure: the envelope of
the wave's load after the change (the atom's weight and any header it brings in, y's weight
out) times the wave's exact/envelope ratio. A wave's price is a max over points, and a row of
the slot whose point binds costs about twice what a row of the other slot costs there, so
the estimate ranks first the waves (and the y) where the atom's rows land on a point that
does not bind: swaps trade a row of the binding slot for one of the other and mix the slots.
Only the touched wave is re-priced (one exact price per candidate, its envelope load
recomputed once a change is kept). When the pool empties the wave is gone and the next
lightest is tried; a chain that runs out of prices or candidates is rolled back.

Complexity: O(max_prices) exact prices of one wave each, plus O(W x atoms of a wave x P)
estimates per placement.
"""

from __future__ import annotations

import numpy as np

from .contract import SearchPricer
from .items import Items, atom_size
from .reprice import Draft, price_draft, wave_loads

TABU = 3               # an atom placed within the last TABU placements does not leave again
TRIES_PER_ATOM = 12    # exact prices per pool atom (moves and swaps together), best estimate first
ESTIMATE_SLACK = 1.05  # a candidate is priced when its estimate is within this x the budget
WAVES_TRIED = 4        # lightest waves tried per round


def empty_by_swaps(drafts: list[Draft], items: Items, pricer: SearchPricer, budget: int,
                   max_prices: int, lower: int = 0) -> tuple[list[Draft], int]:
    """Empty the lightest flat waves (without first_slots) by exactly priced moves and swaps
    (module docstring) while the plan is above `lower` (a valid bound) and prices are left.
    Returns (drafts, exact prices spent). Deterministic: ties go to the lower wave and atom.
    O(max_prices) prices."""
    drafts = list(drafts)
    spent = 0
    size = atom_size(items)
    const = items.budget - items.cap
    while spent < max_prices and len(drafts) > lower:
        flat = [d for d in drafts if not d.fixed and not d.first_slots]
        if len(flat) < 2:
            break
        flat.sort(key=lambda d: (d.price.admitted_bytes, int(d.reqs(items)[0])))
        emptied = None
        for i in range(min(WAVES_TRIED, len(flat))):
            c, others = flat[i], flat[:i] + flat[i + 1:]
            ok, spent = _chain(c, others, items, pricer, budget, size, const, spent,
                               max_prices)
            if ok:
                emptied = c
                break
            if spent >= max_prices:
                break
        if emptied is None:
            break
        drafts = [d for d in drafts if d is not emptied]
    return drafts, spent


def _chain(c: Draft, others: list[Draft], items: Items, pricer: SearchPricer, budget: int,
           size: np.ndarray, const: np.ndarray, spent: int,
           max_prices: int) -> tuple[bool, int]:
    """One ejection chain emptying c into `others`; rolled back unless it succeeds."""
    saved = [(d.atoms, d.price) for d in others]
    loads = wave_loads(others, items)
    env = np.max(const[None, :] + loads * items.cap[None, :], axis=1)
    ratio = np.minimum(np.asarray([d.price.admitted_bytes for d in others], dtype=np.float64)
                       / np.maximum(env, 1.0), 1.0)
    subs = [_subgroups(d, items) for d in others]
    pool = list(c.atoms)
    left: dict[int, int] = {}
    stamp: dict[int, int] = {}
    step = 0
    stuck = 0          # pool atoms tried in a row without a placement
    while pool and stuck < len(pool):
        if spent >= max_prices:
            break
        # the largest atom (size x (1 + times it left)), or the next ones after failures
        ranked = sorted(range(len(pool)), key=lambda q: (
            -size[pool[q]] / (1.0 + left.get(pool[q], 0)), pool[q]))
        a = pool.pop(ranked[stuck])
        step += 1
        cands = _candidates(a, others, loads, subs, ratio, items, size, const, stamp, left,
                            step, budget)
        placed = False
        for t, y in cands[:TRIES_PER_ATOM]:
            if spent >= max_prices:
                break
            d = others[t]
            atoms = [x for x in d.atoms if x != y] + [a] if y >= 0 else d.atoms + [a]
            cand = Draft(sorted(atoms), first_slots=d.first_slots)
            spent += 1
            if price_draft(cand, items, pricer).admitted_bytes > budget:
                continue
            d.atoms, d.price = cand.atoms, cand.price
            loads[t] = wave_loads([d], items)[0]
            e = float(np.max(const + loads[t] * items.cap))
            ratio[t] = min(d.price.admitted_bytes / max(e, 1.0), 1.0)
            subs[t] = _subgroups(d, items)
            stamp[a] = step
            if y >= 0:
                pool.append(y)
                left[y] = left.get(y, 0) + 1
            placed = True
            break
        if placed:
            stuck = 0
        else:
            pool.append(a)
            stuck += 1
    if pool:
        for d, (atoms, price) in zip(others, saved, strict=True):
            d.atoms, d.price = atoms, price
        return False, spent
    return True, spent


def _subgroups(d: Draft, items: Items) -> set[int]:
    out: set[int] = set()
    for a in d.atoms:
        out.update(items.atom_s[items.atom_sptr[a]:items.atom_sptr[a + 1]].tolist())
    return out


def _candidates(a: int, others: list[Draft], loads: np.ndarray, subs: list[set[int]],
                ratio: np.ndarray, items: Items, size: np.ndarray, const: np.ndarray,
                stamp: dict[int, int], left: dict[int, int], step: int,
                budget: int) -> list[tuple[int, int]]:
    """(wave, y) pairs for atom a, y = -1 for a move: every move whose estimated exact price
    (the envelope of the load with a in, times the wave's exact/envelope ratio) is within
    ESTIMATE_SLACK x budget, cheapest first; then the swaps (y out as well) within it, the
    smallest y first (size x (1 + times it left), then the estimate). A y must be smaller
    than a and not placed within the last TABU placements. O(A P), vectorised."""
    cap = items.cap
    W = len(others)
    hdr = np.zeros((W, len(cap)))
    for s in items.atom_s[items.atom_sptr[a]:items.atom_sptr[a + 1]].tolist():
        missing = np.asarray([s not in subs[t] for t in range(W)])
        hdr[missing] += items.sub_hdr[s]
    base = loads + items.atom_w[a][None, :] + hdr
    move = np.max(const[None, :] + base * cap[None, :], axis=1) * ratio
    limit = ESTIMATE_SLACK * budget
    moves = np.flatnonzero(move <= limit)
    out = [(int(t), -1) for t in moves[np.argsort(move[moves], kind="stable")]]
    mem = np.asarray([y for t in range(W) if move[t] > limit for y in others[t].atoms
                      if size[y] < size[a] and stamp.get(y, -TABU - 1) < step - TABU],
                     dtype=np.int64)
    if len(mem) == 0:
        return out
    where = {y: t for t in range(W) for y in others[t].atoms}
    wv = np.asarray([where[y] for y in mem.tolist()], dtype=np.int64)
    est = np.max(const[None, :] + (base[wv] - items.atom_w[mem]) * cap[None, :],
                 axis=1) * ratio[wv]
    ok = np.flatnonzero(est <= limit)
    key = size[mem[ok]] * (1.0 + np.asarray([left.get(y, 0) for y in mem[ok].tolist()]))
    order = ok[np.lexsort((mem[ok], est[ok], key))]
    out.extend((int(wv[i]), int(mem[i])) for i in order)
    return out
