"""Exact re-pricing of packed waves, repair of any wave priced over the budget, and merging
where the exact price leaves room.

Every wave leaving the search has been priced exactly (with its children and first_slots) and
its admitted bytes are <= budget: a wave over the budget is split by moving its largest atoms
into a new wave until both fit. Inside the search an exact price is only its admitted bytes
(`exact_price`: the pricer's `admitted` when it offers one, an `Admitted`); `finalise` turns
each draft into the `PackedWave` that leaves the search: its full price (with the breakdown)
and, when the pricer gives them, its group loads, the full price computed from those.

Merging (only while the plan is above the bound): pairs of flat waves, lightest first, are
tried when an estimate (the envelope of the union x the larger exact/envelope ratio of the
two) is within budget; the union is priced exactly and kept if it fits. At most
`MERGE_TRIES_PER_WAVE` x waves exact prices are spent on it.

Complexity: O(W) prices to re-price, O(W^2) estimates + O(W) prices to merge.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .contract import SearchPricer
from .items import Items
from .ladder import run_ladder
from .prices import Admitted, exact_price
from .reprice_jit import merge_candidates, wave_loads_jit
from .result import PackedWave

MERGE_TRIES_PER_WAVE = 6   # exact prices per wave (the fast path makes each a few us)
MERGE_BEYOND_ESTIMATE = 2  # pairs priced exactly when the estimate refuses every pair


@dataclass
class Draft:
    """A wave being built: its atoms, its children when split, its exact price."""

    atoms: list[int]
    children: tuple[np.ndarray, ...] | None = None
    price: object | None = None
    first_slots: frozenset[str] = field(default_factory=frozenset)
    fixed: bool = False          # runs alone (split or envelope-oversized): never merged

    _reqs: np.ndarray | None = field(default=None, repr=False)
    _key: tuple | None = field(default=None, repr=False)

    def reqs(self, items: Items) -> np.ndarray:
        """Request indices of the wave, ascending (cached until atoms/children change)."""
        key = (tuple(self.atoms), None if self.children is None else len(self.children))
        if self._reqs is None or self._key != key:
            if self.children is not None:
                self._reqs = np.sort(np.concatenate(self.children))
            elif not items.atom_unit.any():
                self._reqs = np.asarray(self.atoms, dtype=np.int64)
            else:
                self._reqs = np.sort(np.concatenate([items.atom(a) for a in self.atoms]))
            self._key = key
        return self._reqs

    def parts(self, items: Items) -> list[np.ndarray]:
        if self.children is not None:
            return list(self.children)
        return [self.reqs(items)]


def drafts_from_assign(items: Items, active: np.ndarray, assign: np.ndarray,
                       nw: int) -> list[Draft]:
    active = np.asarray(active, dtype=np.int64)
    w = assign[active]
    order = np.lexsort((active, w))
    counts = np.bincount(w, minlength=nw)
    groups = np.split(active[order], np.cumsum(counts)[:-1])
    return [Draft(atoms=g.tolist()) for g in groups if len(g)]


def price_draft(d: Draft, items: Items, pricer: SearchPricer) -> object:
    d.price = exact_price(pricer, d.parts(items), d.first_slots)
    return d.price


def finalise(d: Draft, items: Items, pricer: SearchPricer) -> PackedWave:
    """The draft as a wave leaving the search: children ascending, the full price (the one it
    carries when that is full, else `pricer.price`) and the group loads when the pricer
    offers them (`LoadsPricer`: one layout per wave, the full price priced from the loads).
    The draft keeps the full price. O(one full price)."""
    children = tuple(np.sort(c).astype(np.int64) for c in d.parts(items))
    loads = None
    if pricer.loads is not None:
        loads = tuple(pricer.loads.group_loads(children))
        if isinstance(d.price, Admitted):
            d.price = pricer.loads.price_loads(loads, first_slots=d.first_slots)
    elif isinstance(d.price, Admitted):
        d.price = pricer.price(children, first_slots=d.first_slots)
    return PackedWave(children=children, first_slots=frozenset(d.first_slots), price=d.price,
                      loads=loads)


def _size(items: Items, a: int) -> float:
    return float(items.atom_alone[a].max()) if items.atom_alone.shape[1] else 0.0


def reprice_all(drafts: list[Draft], items: Items, pricer: SearchPricer, step,
                budget: int) -> list[Draft]:
    """Price every draft exactly; split flat drafts that are over the budget."""
    out: list[Draft] = []
    queue = list(drafts)
    while queue:
        d = queue.pop(0)
        price = price_draft(d, items, pricer)
        if price.admitted_bytes <= budget:
            out.append(d)
            continue
        if d.fixed or len(d.atoms) == 1:
            a = d.atoms[0]
            children, price = run_ladder(step, pricer, items.atom(a), budget,
                                         first_slots=d.first_slots)
            out.append(Draft([a], children if len(children) > 1 else None, price,
                             d.first_slots, fixed=True))
            continue
        atoms = sorted(d.atoms, key=lambda a: (-_size(items, a), a))
        moved = []
        d2 = d
        while len(atoms) > 1:
            moved.append(atoms.pop(0))
            d2 = Draft(sorted(atoms), first_slots=d.first_slots)
            if price_draft(d2, items, pricer).admitted_bytes <= budget:
                break
        if d2.price is not None and d2.price.admitted_bytes <= budget:
            out.append(d2)
        else:
            queue.insert(0, d2)
        queue.append(Draft(sorted(moved)))
    return out


def wave_loads(drafts: list[Draft], items: Items) -> np.ndarray:
    """Normalised envelope load (W, P) of each flat draft. O(n P), jitted."""
    W = len(drafts)
    if W == 0:
        return np.zeros((0, len(items.points)))
    reqs = [d.reqs(items) for d in drafts]
    ptr = np.zeros(W + 1, dtype=np.int64)
    np.cumsum([len(r) for r in reqs], out=ptr[1:])
    return wave_loads_jit(np.concatenate(reqs), ptr, items.req_w, items.req_sptr,
                          items.req_s, items.sub_class, items.sub_hdr, items.class_hdr)


def merge_waves(drafts: list[Draft], items: Items, pricer: SearchPricer, budget: int,
                lower: int, max_prices: int | None = None) -> tuple[list[Draft], int]:
    """Merge pairs of flat drafts whose union fits when priced exactly, until the plan has
    `lower` waves (a valid bound: no merge can go below it). Candidates are pairs whose
    estimate (envelope of the sum of the two loads x the smaller exact/envelope ratio) is
    within budget, cheapest estimate first. Returns (drafts, exact prices spent).
    O(W^2 P) estimates + at most `max_prices` (default MERGE_TRIES_PER_WAVE x W) prices."""
    flat = [d for d in drafts if not d.fixed]
    fixed = [d for d in drafts if d.fixed]
    if len(flat) < 2:
        return drafts, 0
    limit = max_prices if max_prices is not None else MERGE_TRIES_PER_WAVE * len(drafts)
    const = items.budget - items.cap
    spent = 0
    while spent < limit and len(flat) >= 2 and len(flat) + len(fixed) > lower:
        loads = wave_loads(flat, items)
        env = np.max(const[None, :] + loads * items.cap[None, :], axis=1)
        exact = np.asarray([d.price.admitted_bytes for d in flat], dtype=np.float64)
        ratio = np.minimum(exact / np.maximum(env, 1.0), 1.0)
        cand = merge_candidates(loads, const, items.cap, ratio, float(budget))
        if len(cand) == 0:
            # The summed loads charge a prompt both waves hold twice, so the estimate can refuse
            # a pair whose exact price fits (shared prefixes): price the closest pairs anyway.
            cand = merge_candidates(loads, const, items.cap, ratio, np.inf)[:MERGE_BEYOND_ESTIMATE]
        if len(cand) == 0:
            break
        alive = np.ones(len(flat), dtype=bool)
        merged = []
        for i, j in cand.tolist():
            if not (alive[i] and alive[j]):
                continue
            if spent >= limit or len(flat) + len(fixed) - len(merged) <= lower:
                break
            m = Draft(sorted(flat[i].atoms + flat[j].atoms))
            spent += 1
            if price_draft(m, items, pricer).admitted_bytes <= budget:
                alive[i] = alive[j] = False
                merged.append(m)
        if not merged:
            break
        flat = [d for k, d in enumerate(flat) if alive[k]] + merged
    return flat + fixed, spent


def dissolve_lightest(drafts: list[Draft], items: Items, pricer: SearchPricer,
                      budget: int, max_prices: int, lower: int = 0) -> tuple[list[Draft], int]:
    """Rebalance: try to empty the lightest flat wave by moving its atoms (largest first)
    into the other flat waves (roomiest first) where the exact price still fits; repeat while
    it works and the plan is above `lower` (a valid bound). A failed attempt is rolled back.
    Returns (drafts, exact prices spent).
    At most `max_prices` prices: O(max_prices) time."""
    spent = 0
    drafts = list(drafts)
    const = items.budget - items.cap
    while spent < max_prices and len(drafts) > lower:
        flat = [d for d in drafts if not d.fixed]
        if len(flat) < 2:
            break
        env = np.max(const[None, :] + wave_loads(flat, items) * items.cap[None, :], axis=1)
        r_min = min(d.price.admitted_bytes / max(e, 1.0) for d, e in zip(flat, env, strict=True))
        flat.sort(key=lambda d: (d.price.admitted_bytes, int(d.reqs(items)[0])))
        c, others = flat[0], flat[1:]

        def targets(a: int, others=others, r_min=r_min):
            grow = r_min * float(np.min(items.atom_w[a] * items.cap))  # optimistic increase
            for t in sorted(others, key=lambda w: w.price.admitted_bytes):
                if t.price.admitted_bytes + grow > budget:
                    return   # the rest are fuller still
                yield t

        emptied, spent = empty_wave(c, sorted(c.atoms, key=lambda a: (-_size(items, a), a)),
                                    targets, items, pricer, budget, spent, max_prices)
        if not emptied:
            break
        drafts = [d for d in drafts if d is not c]
    return drafts, spent


def empty_wave(c: Draft, atoms, targets, items: Items, pricer: SearchPricer, budget: int,
               spent: int, max_prices: int) -> tuple[bool, int]:
    """Move every atom of wave c, in the order `atoms`, into the first wave of `targets(a)`
    (an iterable per atom, in the caller's order) where it fits at its exact price, priced
    with that wave's first_slots. When an atom fits nowhere, every move is undone. Stops at
    `max_prices` prices in all (`spent` so far). Returns (whether c emptied, prices spent);
    c itself is left for the caller to drop. O(atoms x targets) prices at most."""
    moves = []
    for a in atoms:
        placed = False
        for t in targets(a):
            if spent >= max_prices:
                break
            cand = Draft(sorted(t.atoms + [a]), first_slots=t.first_slots)
            spent += 1
            if price_draft(cand, items, pricer).admitted_bytes <= budget:
                moves.append((t, t.atoms, t.price))
                t.atoms, t.price = cand.atoms, cand.price
                placed = True
                break
        if not placed:
            for t, atoms_before, price in reversed(moves):
                t.atoms, t.price = atoms_before, price
            return False, spent
    return True, spent
