"""One checker of every invariant a search result must satisfy (used by every packer test).

`check_plan` raises AssertionError naming the first broken invariant:
- every request exactly once; children non-empty, disjoint, ascending, union = the wave;
- every wave re-priced (children and first_slots) fits: admitted bytes <= budget, and equals
  the price the result carries; the group loads it carries (if any) are the pricer's; where
  the result charges the RoPE cache entries of earlier waves (a planner's plan at PP1: the
  term `rope_cache.TERM`), every wave charges exactly the pricer's `earlier_entries` of the
  waves before it, re-priced with them (`plus_earlier`);
- each atomic unit inside one wave;
- first_slots: each slot with gradient requests has exactly one first wave, which holds a
  gradient request of that slot and runs before every other wave holding one; a wave lists
  only slots it holds gradient requests of;
- wave count == num_waves when set; 0 <= lower bound <= waves; proven_optimal iff equal.
It reads a `SearchResult` or a planner's plan alike (`result.Waves`: their waves have
children, first_slots and a price). Complexity: O(W) exact prices + O(n).
"""

from __future__ import annotations

import numpy as np

from waveplan.pricing.rope_cache import TERM

from .contract import EarlierEntriesPricer, LoadsPricer, Pricer, SearchStep
from .result import Waves


def check_plan(step: SearchStep, pricer: Pricer, result: Waves, *, budget_bytes: int,
               atomic_units=(), num_waves: int | None = None) -> None:
    n = len(step.requests)
    seen = np.full(n, -1, dtype=np.int64)
    class_of = np.asarray(pricer.class_of, dtype=np.int64)
    grad_slot = [pricer.class_slot[k] if pricer.class_grad[k] else None for k in class_of]
    first_wave: dict[str, list[int]] = {}
    earlier = None
    if any(TERM in getattr(wave.price, "terms", {}) for wave in result.waves):
        assert isinstance(pricer, EarlierEntriesPricer), (
            "the plan charges earlier waves' RoPE cache entries; the pricer cannot price them")
        assert all(wave.loads is not None for wave in result.waves), (
            "the plan charges earlier waves' RoPE cache entries without its group loads")
        earlier = pricer.earlier_entries([wave.loads for wave in result.waves])
    for w, wave in enumerate(result.waves):
        assert len(wave.children) >= 1, f"wave {w}: no children"
        for c in wave.children:
            assert len(c) > 0, f"wave {w}: empty child"
            assert np.all(np.diff(c) > 0), f"wave {w}: child not strictly ascending"
            assert c.min() >= 0 and c.max() < n, f"wave {w}: request index out of range"
            dup = c[seen[c] >= 0]
            assert len(dup) == 0, (f"wave {w}: request {int(dup[0])} already in wave "
                                   f"{int(seen[dup[0]])} (or in another child)")
            seen[c] = w
        price = pricer.price(list(wave.children), first_slots=wave.first_slots)
        if earlier is not None:
            price = pricer.plus_earlier(price, earlier[w])
            assert wave.price.terms.get(TERM) == price.terms[TERM], (
                f"wave {w}: charges {wave.price.terms.get(TERM)} B of earlier waves' RoPE cache "
                f"entries, {price.terms[TERM]} B expected")
        assert price.admitted_bytes <= budget_bytes, (
            f"wave {w}: admitted {price.admitted_bytes} > budget {budget_bytes}")
        assert price.admitted_bytes == wave.price.admitted_bytes, (
            f"wave {w}: carried price {wave.price.admitted_bytes} != re-priced "
            f"{price.admitted_bytes}")
        if wave.loads is not None and isinstance(pricer, LoadsPricer):
            assert tuple(wave.loads) == tuple(pricer.group_loads(list(wave.children))), (
                f"wave {w}: carried group loads differ from the pricer's")
        reqs = np.concatenate(wave.children)
        slots = {grad_slot[int(i)] for i in reqs} - {None}
        assert set(wave.first_slots) <= slots, (
            f"wave {w}: first_slots {sorted(wave.first_slots)} without gradient requests")
        for s in wave.first_slots:
            first_wave.setdefault(s, []).append(w)
    missing = np.flatnonzero(seen < 0)
    assert len(missing) == 0, f"request {int(missing[0])} is in no wave"
    for u, unit in enumerate(atomic_units):
        ws = set(seen[np.asarray(list(unit), dtype=np.int64)].tolist())
        assert len(ws) == 1, f"atomic unit {u} spread over waves {sorted(ws)}"
    all_slots = {s for s in grad_slot if s is not None}
    for s in all_slots:
        fw = first_wave.get(s, [])
        assert len(fw) == 1, f"slot {s!r}: {len(fw)} first waves"
        holders = [w for w, wave in enumerate(result.waves)
                   if any(grad_slot[int(i)] == s for c in wave.children for i in c)]
        assert fw[0] == min(holders), (
            f"slot {s!r}: first wave {fw[0]} runs after wave {min(holders)} holding its "
            f"gradients")
    assert set(first_wave) <= all_slots
    if num_waves is not None:
        assert len(result.waves) == num_waves, (
            f"{len(result.waves)} waves, num_waves={num_waves}")
    assert 0 <= result.lower_bound_waves <= len(result.waves), (
        f"lower bound {result.lower_bound_waves} vs {len(result.waves)} waves")
    assert result.proven_optimal == (result.lower_bound_waves == len(result.waves)), (
        "proven_optimal must mean waves == lower bound")
