"""Which wave carries each slot's pending adapter gradients, and the run order.

A slot's pending adapter gradients are allocated in the first wave (in run order) that holds
a gradient request of that slot, so that wave's `first_slots` is exactly the set of slots whose
gradient requests it is the first to hold.

Rule: slots with gradient requests are taken in sorted order. For a slot not yet covered, the
candidate waves are those holding one of its gradient requests, by increasing exact price
(most room first); the first that still fits when re-priced with first_slots = (its gradient
slots not yet covered) is appended to the *leading* waves, and every slot it holds gradients
of is covered. If none fits, one of the slot's lightest gradient atoms moves into the
roomiest wave that then fits with the pending gradients (a wave carrying another slot's often
has room: their peaks are at different walk points; `_bring_carrier`). Otherwise atoms are
exchanged pairwise between a candidate (roomiest first) and the flat waves that run later,
each exchange priced exactly, until the candidate fits with the pending gradients
(`_swap_carrier`; undone if it never does). Since an exchange changes the waves the later
slots choose from, a plan that used one is kept only when it has fewer waves than the same
rule without exchanges. Otherwise the roomiest candidate is repaired: its atoms move into other waves where they fit exactly (atoms without the
slot's gradients first, smallest first), and only when none fits anywhere the largest goes
into a new wave (unless the wave count is fixed), until it fits; a split unit climbs the ladder instead. If even
one atom cannot carry the gradients, InfeasibleError.

When the repair added waves, `dissolve_after_order` (called by the packer) empties the light
waves that carry no pending gradients into the others, each priced exactly with its
first_slots, never letting a slot's gradients run before its first wave.

Run order: the leading waves in the order they were chosen (so each slot's first wave runs
before every other wave of that slot), then the remaining waves by their smallest request
index. Their first_slots are empty.

Complexity: O(W) exact prices per slot when a fitting wave exists, O(W x atoms of the
repaired wave) otherwise, plus at most SWAP_TRIES exact prices per slot for the exchanges
(and the rule once more without them when one was kept).
"""

from __future__ import annotations

import numpy as np

from waveplan.pricing.errors import InfeasibleError

from .contract import SearchPricer
from .items import Items
from .ladder import run_ladder, unit_label
from .prices import exact_price
from .reprice import Draft, empty_wave, price_draft

CARRIER_TRIES = 3   # gradient atoms tried as the carrier moved to a roomier wave
SWAP_TRIES = 256    # exact prices spent exchanging requests to make a carrier fit, per slot
SWAP_NEAR = 4       # partners tried per request of the carrier and wave, on either side
ROOM_SLACK = 1.25   # an exchange's estimated gain may pass the partner's room by this factor
ROOM_TRIES = 64     # exact prices spent looking for room for one atom of a repaired wave


class SlotInfo:
    """Gradient slot of each request (None when the request has no gradient)."""

    def __init__(self, pricer: SearchPricer, n: int):
        class_of = np.asarray(pricer.class_of, dtype=np.int64)
        self.names = sorted({pricer.class_slot[k] for k in range(pricer.num_classes)
                             if pricer.class_grad[k]})
        index = {s: i for i, s in enumerate(self.names)}
        per_class = np.asarray([index[pricer.class_slot[k]] if pricer.class_grad[k] else -1
                                for k in range(pricer.num_classes)] or [-1], dtype=np.int64)
        self.code = per_class[class_of] if n else np.zeros(0, dtype=np.int64)

    def of(self, reqs: np.ndarray) -> set[str]:
        codes = self.code[np.asarray(reqs, dtype=np.int64)]
        return {self.names[c] for c in set(codes.tolist()) if c >= 0}

    def all(self) -> list[str]:
        present = np.unique(self.code)
        return [self.names[c] for c in present if c >= 0]


def _price_with(d: Draft, items: Items, pricer: SearchPricer, fs: frozenset[str]):
    return exact_price(pricer, d.parts(items), fs)


def _move_out(d: Draft, a: int, others: list[Draft], items: Items, pricer: SearchPricer,
              budget: int, allow_new: bool) -> Draft | None:
    """Put atom a into another flat draft where it fits exactly (lightest first), or a new
    draft. Returns the new draft if one was opened, raises if not allowed."""
    for o in sorted(others, key=lambda o: o.price.admitted_bytes):
        if o.fixed or o is d:
            continue
        cand = Draft(sorted(o.atoms + [a]))
        if price_draft(cand, items, pricer).admitted_bytes <= budget:
            o.atoms, o.price = cand.atoms, cand.price
            return None
    if not allow_new:
        raise InfeasibleError("no room to move requests out of a wave without adding a wave")
    nd = Draft([a])
    price_draft(nd, items, pricer)
    return nd


def assign_first_slots(drafts: list[Draft], items: Items, pricer: SearchPricer, step,
                       budget: int, *, allow_new_waves: bool = True) -> list[Draft]:
    """Set first_slots and return the drafts in run order (see module docstring)."""
    info = SlotInfo(pricer, items.n)
    copies = [_copy(d) for d in drafts]
    swapped = [False]
    out = _assign(drafts, items, pricer, step, budget, allow_new_waves, info, swapped)
    if swapped[0]:
        # an exchange changes the waves the later slots choose from: keep it only when the
        # plan is no longer than without exchanges
        plain = _assign(copies, items, pricer, step, budget, allow_new_waves, info, None)
        if len(plain) <= len(out):
            return plain
    return out


def _copy(d: Draft) -> Draft:
    return Draft(list(d.atoms), d.children, d.price, d.first_slots, d.fixed)


def _assign(drafts: list[Draft], items: Items, pricer: SearchPricer, step, budget: int,
            allow_new_waves: bool, info: SlotInfo, swapped: list[bool] | None) -> list[Draft]:
    """`assign_first_slots`; exchanges (`_swap_carrier`) only when `swapped` is given, which
    records whether one was kept."""
    drafts = list(drafts)
    covered: set[str] = set()
    leading: list[Draft] = []
    for slot in info.all():
        if slot in covered:
            continue
        cands = [d for d in drafts if d not in leading and slot in info.of(d.reqs(items))]
        cands.sort(key=lambda d: (d.price.admitted_bytes, int(d.reqs(items)[0])))
        chosen = None
        for d in cands:
            fs = frozenset(info.of(d.reqs(items)) - covered)
            price = _price_with(d, items, pricer, fs)
            if price.admitted_bytes <= budget:
                d.first_slots, d.price = fs, price
                chosen = d
                break
        if chosen is None:
            chosen = _bring_carrier(slot, drafts, leading, covered, info, items, pricer, budget,
                                    allow_new_waves)
        if chosen is None and swapped is not None:
            chosen = _swap_carrier(slot, cands, drafts, leading, covered, info, items, pricer,
                                   budget)
            swapped[0] = swapped[0] or chosen is not None
        if chosen is None:
            chosen = _repair(_repair_candidate(cands, slot, covered, info, items, pricer,
                                               budget), slot, drafts, leading, covered, info, items, pricer,
                             step, budget, allow_new_waves)
        if chosen not in leading:
            leading.append(chosen)
        covered |= set(chosen.first_slots)
    rest = [d for d in drafts if d not in leading]
    for d in rest:
        if d.first_slots:
            d.first_slots = frozenset()
            price_draft(d, items, pricer)
    rest.sort(key=lambda d: int(d.reqs(items)[0]))
    return leading + rest


def _bring_carrier(slot: str, drafts: list[Draft], leading: list[Draft], covered: set[str],
                   info: SlotInfo, items: Items, pricer: SearchPricer, budget: int,
                   may_drop: bool) -> Draft | None:
    """No wave holding `slot`'s gradients has room for its pending gradients: move one of its
    lightest gradient atoms (holding no other slot's gradients) into the roomiest flat wave
    that fits with them, so that wave carries them. Pending gradients of different slots peak
    at different walk points, so a wave that already carries one slot's often has room for
    another's. A wave emptied by the move is dropped (only with `may_drop`: not under an exact
    wave count). Returns the carrier, or None.
    O(CARRIER_TRIES x waves) exact prices."""
    carriers = sorted(((a, d) for d in drafts if not d.fixed and d not in leading
                       for a in d.atoms if info.of(items.atom(a)) == {slot}),
                      key=lambda t: (float(items.atom_alone[t[0]].max()), t[0]))
    targets = sorted((d for d in drafts if not d.fixed),
                     key=lambda d: (d.price.admitted_bytes, int(d.reqs(items)[0])))
    for a, src in carriers[:CARRIER_TRIES]:
        if len(src.atoms) == 1 and not may_drop:
            continue
        for w in targets:
            if w is src:
                continue
            cand = Draft(sorted(w.atoms + [a]))
            fs = frozenset(w.first_slots) | frozenset(info.of(cand.reqs(items)) - covered)
            price = _price_with(cand, items, pricer, fs)
            if price.admitted_bytes > budget:
                continue
            w.atoms, w.first_slots, w.price = cand.atoms, fs, price
            src.atoms = [x for x in src.atoms if x != a]
            if src.atoms:
                price_draft(src, items, pricer)
            else:
                drafts.remove(src)
            return w
    return None


def _swap_carrier(slot: str, cands: list[Draft], drafts: list[Draft], leading: list[Draft],
                  covered: set[str], info: SlotInfo, items: Items, pricer: SearchPricer,
                  budget: int) -> Draft | None:
    """No wave holding `slot`'s gradients fits with its pending gradients, and no carrier
    moves: exchange atoms between a candidate d (roomiest first) and the flat waves that run
    later (see `_exchange`). Returns d once it fits with them; else every exchange is undone
    and the next candidate is tried; None when none fits. At most SWAP_TRIES exact prices."""
    v = (items.atom_w * items.cap).max(axis=1)
    tries = [0]
    for d in cands:
        if tries[0] >= SWAP_TRIES:
            break
        others = [o for o in drafts if o is not d and not o.fixed and o not in leading]
        if d.fixed or len(d.atoms) < 2 or not others:
            continue
        saved = [(w, w.atoms, w.price) for w in [d] + others]
        if _exchange(d, slot, others, covered, info, items, pricer, budget, v, tries):
            return d
        for w, atoms, price in saved:   # d still does not fit: undo every exchange
            w.atoms, w.price = atoms, price
        d.first_slots = frozenset()
    return None


def _exchange(d: Draft, slot: str, others: list[Draft], covered: set[str], info: SlotInfo,
              items: Items, pricer: SearchPricer, budget: int, v: np.ndarray,
              tries: list[int]) -> bool:
    """Exchange atoms until d fits with the pending gradients of the slots it holds first.

    One exchange moves an atom x of d (never its last gradient atom of `slot`) into another
    wave o and an atom y of o (or nothing) into d. It is kept when d, priced exactly with the
    pending gradients of every uncovered slot it then holds, costs less than before and o
    still fits. Candidate pairs come from the envelope weights v (bytes, shared prompts left
    out): the gain v[x] - v[y] should match the smaller of d's excess and o's room and may
    not pass ROOM_SLACK x o's room; for each x the SWAP_NEAR nearest y on either side are
    candidates, best match first. Deterministic; `tries` counts exact prices (SWAP_TRIES).
    Returns whether d fits."""
    fs = frozenset(info.of(d.reqs(items)) - covered)
    cur = _price_with(d, items, pricer, fs).admitted_bytes
    tries[0] += 1
    carries = {a: slot in info.of(items.atom(a)) for a in d.atoms}
    for o in others:
        carries.update((a, slot in info.of(items.atom(a))) for a in o.atoms)
    tried: set[tuple[int, int, int]] = set()
    sorted_partners: dict[int, tuple[list[int], np.ndarray, np.ndarray]] = {}
    while tries[0] < SWAP_TRIES:
        excess = cur - budget
        xs = np.asarray(d.atoms, dtype=np.int64)
        if sum(carries[a] for a in d.atoms) == 1:
            xs = xs[[not carries[a] for a in d.atoms]]
        vx = v[xs]
        parts: list[tuple[np.ndarray, ...]] = []   # (match, x, y, wave) arrays
        for oi, o in enumerate(others):
            room = budget - o.price.admitted_bytes
            if room <= 0:
                continue
            goal = min(excess, room)
            hit = sorted_partners.get(oi)
            if hit is None or hit[0] is not o.atoms:   # o's atoms change only by an exchange
                ys = np.asarray([-1] + o.atoms, dtype=np.int64)
                vy = np.concatenate([[0.0], v[ys[1:]]])
                order = np.lexsort((ys, vy))
                hit = sorted_partners[oi] = (o.atoms, ys[order], vy[order])
            _, ys, vy = hit
            pos = np.searchsorted(vy, vx - goal)
            j = pos[:, None] + np.arange(-SWAP_NEAR, SWAP_NEAR)[None, :]   # all offsets at once
            jc = np.clip(j, 0, len(ys) - 1)
            gain = vx[:, None] - vy[jc]
            keep = (j >= 0) & (j < len(ys)) & (gain > 0) & (gain <= ROOM_SLACK * room)
            parts.append((np.abs(gain[keep] - goal), np.broadcast_to(xs[:, None], j.shape)[keep],
                          ys[jc][keep], np.full(int(keep.sum()), oi, dtype=np.int64)))
        if not parts:
            return False
        m, cx, cy, co = (np.concatenate(col) for col in zip(*parts, strict=True))
        best = np.lexsort((co, cy, cx, m))   # by match, then x, y, wave: deterministic
        moved = False
        for x, y, oi in zip(cx[best].tolist(), cy[best].tolist(), co[best].tolist(), strict=True):
            if tries[0] >= SWAP_TRIES:
                return False
            if (x, y, oi) in tried:
                continue
            tried.add((x, y, oi))
            o = others[oi]
            nd = Draft(sorted([a for a in d.atoms if a != x] + ([y] if y >= 0 else [])))
            nfs = frozenset(info.of(nd.reqs(items)) - covered)
            price = _price_with(nd, items, pricer, nfs)
            tries[0] += 1
            if price.admitted_bytes >= cur:
                continue
            no = Draft(sorted([a for a in o.atoms if a != y] + [x]))
            tries[0] += 1
            if price_draft(no, items, pricer).admitted_bytes > budget:
                continue
            o.atoms, o.price = no.atoms, no.price
            d.atoms, d.first_slots, d.price = nd.atoms, nfs, price
            cur = price.admitted_bytes
            moved = True
            break
        if cur <= budget:
            return True
        if not moved:
            return False
    return False


def _move_to_room(d: Draft, others: list[Draft], carries, items: Items, pricer: SearchPricer,
                  budget: int) -> bool:
    """Move one atom of d into another flat wave where it fits exactly: non-carriers first,
    smallest first (they are the likeliest to fit the room left), always keeping one carrier
    in d; the roomiest wave first. Only a move no wave has room for opens a new wave (the
    caller's fallback). At most ROOM_TRIES exact prices. Returns whether an atom moved."""
    keep = min((a for a in d.atoms if carries(a)),
               key=lambda a: (float(items.atom_alone[a].max()), a), default=None)
    order = sorted((a for a in d.atoms if a != keep),
                   key=lambda a: (carries(a), float(items.atom_alone[a].max()), a))
    targets = sorted((o for o in others if not o.fixed),
                     key=lambda o: (o.price.admitted_bytes, int(o.reqs(items)[0])))
    tries = 0
    for a in order:
        for o in targets:
            if tries >= ROOM_TRIES:
                return False
            tries += 1
            cand = Draft(sorted(o.atoms + [a]))
            if price_draft(cand, items, pricer).admitted_bytes <= budget:
                o.atoms, o.price = cand.atoms, cand.price
                d.atoms = sorted(x for x in d.atoms if x != a)
                price_draft(d, items, pricer)
                return True
    return False


def _repair_candidate(cands: list[Draft], slot: str, covered: set[str], info: SlotInfo,
                      items: Items, pricer: SearchPricer, budget: int) -> Draft:
    """The roomiest candidate whose lightest carrier of `slot` fits alone with the pending
    gradients (a unit may still climb the ladder); else the roomiest one."""
    for d in cands:
        if d.fixed:
            return d
        carriers = [a for a in d.atoms if slot in info.of(items.atom(a))]
        a = min(carriers, key=lambda a: (float(items.atom_alone[a].max()), a))
        if items.atom_unit[a]:
            return d
        fs = frozenset(info.of(items.atom(a)) - covered)
        if exact_price(pricer, [items.atom(a)], fs).admitted_bytes <= budget:
            return d
    return cands[0]


def _repair(d: Draft, slot: str, drafts: list[Draft], leading: list[Draft], covered: set[str],
            info: SlotInfo, items: Items, pricer: SearchPricer, step, budget: int,
            allow_new: bool) -> Draft:
    if d.fixed:
        fs = frozenset(info.of(d.reqs(items)) - covered)
        children, price = run_ladder(step, pricer, d.reqs(items), budget, first_slots=fs,
                                     start_k=len(d.children) if d.children else 1)
        d.children = children if len(children) > 1 else None
        d.price, d.first_slots = price, fs
        return d
    others = [o for o in drafts if o is not d and o not in leading]

    def carries(a: int) -> bool:
        return slot in info.of(items.atom(a))

    def size(a: int) -> float:
        return float(items.atom_alone[a].max())

    while True:
        fs = frozenset(info.of(d.reqs(items)) - covered)
        price = _price_with(d, items, pricer, fs)
        if price.admitted_bytes <= budget:
            d.first_slots, d.price = fs, price
            return d
        if len(d.atoms) == 1:
            a = d.atoms[0]
            if items.atom_unit[a]:
                children, price = run_ladder(step, pricer, items.atom(a), budget,
                                             first_slots=fs, start_k=2)
                d.children, d.price, d.first_slots, d.fixed = children, price, fs, True
                return d
            raise InfeasibleError(
                f"request {unit_label(step, items.atom(a))}: does not fit with the pending "
                f"adapter gradients of slot(s) {sorted(fs)}; price {price.admitted_bytes} "
                f"admitted bytes > budget_bytes={int(budget)}")
        if _move_to_room(d, others, carries, items, pricer, budget):
            continue
        movable = sorted(d.atoms, key=lambda a: (carries(a), -size(a), a))
        if carries(movable[0]):
            # only carriers left: keep the smallest carrier, move the largest one
            movable = sorted(d.atoms, key=lambda a: (-size(a), a))
        a = movable[0]
        d.atoms = sorted(x for x in d.atoms if x != a)
        price_draft(d, items, pricer)
        try:
            nd = _move_out(d, a, others, items, pricer, budget, allow_new)
        except InfeasibleError as exc:
            raise InfeasibleError(
                f"slot {slot!r}: its pending adapter gradients fit no wave, and moving "
                f"requests out would add a wave beyond num_waves") from exc
        if nd is not None:
            drafts.append(nd)
            others.append(nd)


def dissolve_after_order(drafts: list[Draft], items: Items, pricer: SearchPricer,
                         budget: int, max_prices: int,
                         lower: int = 0) -> tuple[list[Draft], int]:
    """Empty waves the order step left light, with the pending gradients priced in.

    The order step may add waves (a repaired carrier's atoms that fit nowhere before the
    carriers had their pending gradients); the waves it leaves are often light. Take the
    waves that carry no pending gradients (they run after every carrier), lightest first,
    and move each of its atoms (largest first) into another flat wave (roomiest first) where
    it still fits, priced exactly with that wave's first_slots. An atom may join a leading
    wave only when its gradient slots are carried by that wave or one running before it, so
    every slot's first wave stays its first. A wave that does not empty is rolled back and
    the next lightest one is tried. Stops at `lower` waves (a valid bound) or after
    `max_prices` exact prices. Returns (drafts in run order, exact prices spent)."""
    info = SlotInfo(pricer, items.n)
    drafts = list(drafts)
    spent = 0
    tried: set[int] = set()
    while spent < max_prices and len(drafts) > lower:
        # slots carried by each wave or one running before it
        covered, seen = [], set()
        for d in drafts:
            seen |= set(d.first_slots)
            covered.append(frozenset(seen))
        srcs = [d for d in drafts if not d.fixed and not d.first_slots and id(d) not in tried]
        if not srcs:
            break
        c = min(srcs, key=lambda d: (d.price.admitted_bytes, int(d.reqs(items)[0])))
        tried.add(id(c))
        targets = [(d, cov) for d, cov in zip(drafts, covered, strict=True)
                   if d is not c and not d.fixed]

        def allowed(a: int, targets=targets):
            slots = info.of(items.atom(a))
            for t, cov in sorted(targets, key=lambda tc: (tc[0].price.admitted_bytes,
                                                          int(tc[0].reqs(items)[0]))):
                if slots <= cov:   # the atom's slots already carried by t or a wave before it
                    yield t

        emptied, spent = empty_wave(c, sorted(c.atoms, key=lambda a: (-_alone(items, a), a)),
                                    allowed, items, pricer, budget, spent, max_prices)
        if emptied:
            drafts = [d for d in drafts if d is not c]
            tried.clear()
    return drafts, spent


def _alone(items: Items, a: int) -> float:
    return float(items.atom_alone[a].max()) if items.atom_alone.shape[1] else 0.0
