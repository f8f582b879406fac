"""Split ladder: an atomic unit that does not fit flat runs as k sequential children
(sub-forwards sharing one backward), for k = 2, 3, 4, ... up to the number of requests.

Children are formed group-aware: groups in decreasing packed size, each request to the child
whose packed rows grow least (a prompt is paid again only in a child that lacks it), ties to
the lighter child. Each rung is priced exactly (`exact_price(pricer, children)`); the first that
fits wins. When no rung fits, `InfeasibleError` names the unit's request ids, its cheapest
price over all rungs and the budget.

Complexity: O(u^2) pricer calls in the worst case for a unit of u requests (rung k prices
one set of k children), plus O(u k) to form each rung.
"""

from __future__ import annotations

import numpy as np

from waveplan.pricing.errors import InfeasibleError

from .contract import SearchPricer
from .prices import exact_price


def split_children(step, idx: np.ndarray, k: int) -> tuple[np.ndarray, ...]:
    """Partition the requests `idx` into k non-empty children, keeping prompts together
    where that is cheap. O(u k)."""
    idx = np.asarray(idx, dtype=np.int64)
    group_of = np.asarray(step.group_of)
    prefix = np.asarray(step.prefix_rows)
    own = np.asarray(step.own_rows)
    groups = {}
    for i in idx:
        groups.setdefault(int(group_of[i]), []).append(int(i))
    gorder = sorted(groups, key=lambda g: (-(prefix[g] + sum(own[i] for i in groups[g])), g))
    load = np.zeros(k)
    members: list[list[int]] = [[] for _ in range(k)]
    has: list[set[int]] = [set() for _ in range(k)]
    for g in gorder:
        for i in sorted(groups[g], key=lambda i: (-own[i], i)):
            best, best_key = 0, None
            for c in range(k):
                inc = own[i] + (0 if g in has[c] else prefix[g])
                key = (load[c] + inc, len(members[c]), c)
                if best_key is None or key < best_key:
                    best, best_key = c, key
            load[best] += own[i] + (0 if g in has[best] else prefix[g])
            members[best].append(i)
            has[best].add(g)
    # every child non-empty: move from the fullest child while any is empty
    for c in range(k):
        if not members[c]:
            donor = max(range(k), key=lambda d: (len(members[d]), -d))
            members[c].append(members[donor].pop())
    return tuple(np.sort(np.asarray(m, dtype=np.int64)) for m in members)


def unit_label(step, idx: np.ndarray) -> str:
    ids = [step.requests[int(i)].id for i in idx]
    if len(ids) > 8:
        return "[" + ", ".join(map(repr, ids[:8])) + f", ... {len(ids)} requests]"
    return "[" + ", ".join(map(repr, ids)) + "]"


def run_ladder(step, pricer: SearchPricer, idx: np.ndarray, budget: int, *,
               first_slots: frozenset[str] = frozenset(), start_k: int = 1):
    """Cheapest rung (fewest children, from `start_k`) that fits. Returns (children, price).
    Raises InfeasibleError when no rung up to k = len(idx) fits."""
    idx = np.sort(np.asarray(idx, dtype=np.int64))
    cheapest = None
    for k in range(max(1, start_k), len(idx) + 1):
        children = (idx,) if k == 1 else split_children(step, idx, k)
        price = exact_price(pricer, list(children), first_slots)
        if cheapest is None or price.admitted_bytes < cheapest:
            cheapest = price.admitted_bytes
        if price.admitted_bytes <= budget:
            return children, price
    what = "request" if len(idx) == 1 else "atomic unit"
    extra = f" with pending gradients of {sorted(first_slots)}" if first_slots else ""
    raise InfeasibleError(
        f"{what} {unit_label(step, idx)}: does not fit under any split{extra}; cheapest price "
        f"{cheapest} admitted bytes > budget_bytes={int(budget)}")
