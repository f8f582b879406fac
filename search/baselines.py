"""Baseline packers under the same exact pricing, for studies (not for production plans).

- `uniform-width`: the existing planner's rule. One width w (atoms per wave), found by
  doubling w = 1, 2, 4, ... while every contiguous chunk of w atoms (in request order) prices
  within the budget, then bisection between the last width that fits and the first that
  does not; the waves are those chunks. O(A log A) exact prices.
- `ffd`: first-fit decreasing on logical tokens against a token budget T, then every bin is
  priced exactly and halved while over the budget. T is the largest token count a single
  request of the most expensive gradient class can have and still fit as one wave, solved in
  closed form from the envelope (one prompt-less request: packed = logical = t, 2 segments):
  T = min_k min_p (budget - const[p] - presence[p,k] - 2 coef[p,k,2]) /
  (coef[p,k,0] + coef[p,k,1]). O(A log A + A B) plus O(B log A) prices.
- `kk`: Karmarkar-Karp (largest differencing) partition of the atoms' logical tokens into
  m = ceil(total / T) parts, m raised by one until every part prices within the budget.
  O(A m log A) per m.

Token-budget packers know nothing of prefix sharing, gradient classes or segments, which is
what the study measures. All three honour atomic units (an atom is never cut).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from .contract import SearchPricer
from .items import Items
from .reprice import Draft, price_draft


def _tokens(items: Items, step) -> np.ndarray:
    tok = np.asarray([r.num_tokens for r in step.requests], dtype=np.float64)
    out = np.zeros(items.num_atoms)
    np.add.at(out, items.atom_of, tok)
    return out


def _fits(atoms: list[int], items: Items, pricer: SearchPricer, budget: int) -> Draft | None:
    d = Draft(sorted(atoms))
    return d if price_draft(d, items, pricer).admitted_bytes <= budget else None


def uniform_width(items: Items, step, pricer: SearchPricer, budget: int,
                  active: np.ndarray) -> list[Draft]:
    atoms = [int(a) for a in np.sort(active)]
    A = len(atoms)
    if A == 0:
        return []
    cache: dict[int, list[Draft] | None] = {}

    def attempt(w: int) -> list[Draft] | None:
        if w not in cache:
            out = []
            for i in range(0, A, w):
                d = _fits(atoms[i:i + w], items, pricer, budget)
                if d is None:
                    cache[w] = None
                    return None
                out.append(d)
            cache[w] = out
        return cache[w]

    lo, hi = 1, None
    w = 1
    while attempt(w) is not None:
        lo = w
        if w >= A:
            return cache[lo]
        w = min(2 * w, A)
    hi = w
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if attempt(mid) is not None:
            lo = mid
        else:
            hi = mid
    return attempt(lo)


def token_budget(items: Items, pricer: SearchPricer, budget: int) -> float:
    env = pricer.envelope()
    const = np.asarray(env.const, dtype=np.float64)
    pres = np.maximum(np.asarray(env.presence, dtype=np.float64), 0.0)
    coef = np.maximum(np.asarray(env.coef, dtype=np.float64), 0.0)
    classes = np.unique(np.asarray(pricer.class_of, dtype=np.int64))
    best = math.inf
    for k in classes:
        per_row = coef[:, k, 0] + coef[:, k, 1]
        room = budget - const - pres[:, k] - 2.0 * coef[:, k, 2]
        with np.errstate(divide="ignore"):
            t = np.where(per_row > 0, room / np.where(per_row > 0, per_row, 1.0), math.inf)
        best = min(best, float(t.min()))
    return max(best, 1.0)


def _split_until_fit(atoms: list[int], tok: np.ndarray, items: Items, pricer: SearchPricer,
                     budget: int) -> list[Draft]:
    d = _fits(atoms, items, pricer, budget)
    if d is not None:
        return [d]
    srt = sorted(atoms, key=lambda a: (-tok[a], a))
    left, right = srt[0::2], srt[1::2]
    return (_split_until_fit(left, tok, items, pricer, budget)
            + _split_until_fit(right, tok, items, pricer, budget))


def ffd(items: Items, step, pricer: SearchPricer, budget: int,
        active: np.ndarray) -> list[Draft]:
    tok = _tokens(items, step)
    T = token_budget(items, pricer, budget)
    bins: list[list[int]] = []
    loads: list[float] = []
    for a in sorted((int(a) for a in active), key=lambda a: (-tok[a], a)):
        for b in range(len(bins)):
            if loads[b] + tok[a] <= T:
                bins[b].append(a)
                loads[b] += tok[a]
                break
        else:
            bins.append([a])
            loads.append(tok[a])
    out: list[Draft] = []
    for b in bins:
        out.extend(_split_until_fit(b, tok, items, pricer, budget))
    return out


def _kk_partition(values: list[tuple[float, int]], m: int) -> list[list[int]]:
    """Multiway largest differencing method."""
    heap = []
    for v, a in values:
        sums = [v] + [0.0] * (m - 1)
        parts = [[a]] + [[] for _ in range(m - 1)]
        heapq.heappush(heap, (-v, a, sums, parts))
    tie = len(values)
    while len(heap) > 1:
        _, _, s1, p1 = heapq.heappop(heap)
        _, _, s2, p2 = heapq.heappop(heap)
        o1 = sorted(range(m), key=lambda i: -s1[i])
        o2 = sorted(range(m), key=lambda i: s2[i])
        sums = [s1[i] + s2[j] for i, j in zip(o1, o2, strict=True)]
        parts = [p1[i] + p2[j] for i, j in zip(o1, o2, strict=True)]
        tie += 1
        heapq.heappush(heap, (-(max(sums) - min(sums)), tie, sums, parts))
    return heap[0][3] if heap else []


def kk(items: Items, step, pricer: SearchPricer, budget: int,
       active: np.ndarray) -> list[Draft]:
    tok = _tokens(items, step)
    atoms = [int(a) for a in active]
    if not atoms:
        return []
    T = token_budget(items, pricer, budget)
    m = max(1, math.ceil(sum(tok[a] for a in atoms) / T))
    values = [(float(tok[a]), a) for a in atoms]
    while True:
        m = min(m, len(atoms))
        parts = [p for p in _kk_partition(values, m) if p]
        out = []
        for p in parts:
            d = _fits(p, items, pricer, budget)
            if d is None:
                break
            out.append(d)
        else:
            return out
        if m >= len(atoms):  # single atoms always fit; unreachable
            raise AssertionError("kk: single atoms do not fit")
        m += 1
