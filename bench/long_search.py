"""Reference wave counts for large steps: a long large-neighbourhood search with exact prices.

Independent of the search's own improvement stages, it starts from the search's plan
(`pack`, deterministic, 5 ms) and repeats: drop the lightest wave that carries no pending
gradients (its requests go to a pool), then anneal until the pool is empty, every candidate
wave priced by the project's exact admitted-bytes kernel (`WavePricer.admitted`, with the
wave's first_slots):
- insert: a pool request goes into the roomiest waves (a few tried, then a few drawn at
  random) where it fits;
- swap with the pool: a pool request replaces a request of a drawn wave when the wave then
  fits; the replaced request joins the pool. Accepted when the pool gets lighter (by the
  requests' prices alone), else with probability exp(-increase / temperature);
- moves and swaps between two drawn waves, kept whenever both still fit (plateau moves that
  reshuffle the slots and prompts of the waves).
The temperature falls geometrically over the price limit. A plan whose pool empties is kept
and the next lightest wave is dropped; the search stops at the price limit (`--prices`,
deterministic) or at the wall-clock limit (`--seconds`, a safety net: when it is hit the
result depends on the machine, and the output says so). The slot that carries pending
gradients keeps at least one gradient request of its slot, and an earlier carrier never
takes gradient requests of a slot a later carrier carries, so the run order stays valid.
Split waves (children) are left as they are. The result passes `check_plan`.

    .venv/bin/python bench/long_search.py [--sizes 512 2048] [--seeds 5] [--prices 300000]
        [--seconds 600] [--out bench/results/long_search.txt]

Complexity: O(prices) exact prices of one wave each, plus O(waves) Python work per dropped
wave.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from bench_search import bench_case  # noqa: E402

from waveplan.pricing.atomic_io import write_text_atomic  # noqa: E402
from waveplan.search import pack  # noqa: E402
from waveplan.search.contract import SearchPricer  # noqa: E402
from waveplan.search.invariants import check_plan  # noqa: E402
from waveplan.search.result import PackedWave, SearchResult  # noqa: E402

INSERT_ROOMIEST = 4     # roomiest waves tried for a pool request
INSERT_DRAWN = 4        # ... then this many drawn waves
POOL_SHARE = 0.3        # share of the steps that work on the pool (the rest: wave to wave)
PENALTY = 1.5           # objective: sum of wave prices + PENALTY x sizes in the pool
SIZE_CONST = 0.9        # a request's size: its price alone less this x the smallest one
ROOM_BONUS = 0.2        # weight of the convex room bonus (`_value`)
T0, T1 = 0.05, 0.002    # temperature (relative to the mean request size), start and end


def _value(st, p: float) -> float:
    """What a wave priced p adds to the objective: its price, less a bonus convex in its room
    (room concentrated in few waves is what lets a pool request in)."""
    room = max(st.budget - p, 0.0)
    return p - ROOM_BONUS * room * room / st.scale


def _accept(delta: float, temp: float, rng) -> bool:
    return delta <= 0 or rng.random() < math.exp(-delta / temp)


def _pool_step(st, pool, flat, size, temp, rng) -> None:
    """A pool request (the largest, or a drawn one) into the first roomy or drawn wave where
    it fits; else swapped with a drawn request of a drawn wave (annealed)."""
    if rng.random() < 0.5:
        j = int(rng.integers(len(pool)))
    else:
        j = max(range(len(pool)), key=lambda q: (size[pool[q]], -pool[q]))
    r = pool[j]
    roomiest = sorted(flat, key=lambda w: (st.prices[w], w))[:INSERT_ROOMIEST]
    drawn = [flat[int(i)] for i in rng.integers(len(flat), size=INSERT_DRAWN)]
    for w in dict.fromkeys(roomiest + drawn):
        if not st.may_take(w, r):
            continue
        p = st.try_price(w, st.waves[w] + [r])
        if p is not None:
            st.waves[w].append(r)
            st.prices[w] = p
            pool.pop(j)
            return
    w = flat[int(rng.integers(len(flat)))]
    if not st.waves[w] or not st.may_take(w, r):
        return
    smaller = [q for q in st.waves[w] if size[q] < size[r] and st.may_lose(w, q)]
    if smaller and rng.random() < 0.8:
        y = smaller[int(rng.integers(len(smaller)))]
    else:
        y = st.waves[w][int(rng.integers(len(st.waves[w])))]
    if not st.may_lose(w, y):
        return
    new = [x for x in st.waves[w] if x != y] + [r]
    p = st.try_price(w, new)
    if p is None:
        return
    gain = _value(st, p) - _value(st, st.prices[w])
    if _accept(gain + PENALTY * (size[y] - size[r]), temp, rng):
        st.waves[w] = new
        st.prices[w] = p
        pool[j] = y


def _wave_step(st, flat, temp, rng) -> None:
    """A drawn request moves to, or swaps with a drawn request of, another drawn wave, when
    both waves still fit; annealed on the change of the two waves' prices."""
    a, b = (flat[int(i)] for i in rng.integers(len(flat), size=2))
    if a == b or not st.waves[a]:
        return
    x = st.waves[a][int(rng.integers(len(st.waves[a])))]
    if not (st.may_lose(a, x) and st.may_take(b, x)):
        return
    na = [q for q in st.waves[a] if q != x]
    nb = st.waves[b] + [x]
    if rng.random() >= 0.5 and st.waves[b]:   # swap x with y of b
        y = st.waves[b][int(rng.integers(len(st.waves[b])))]
        if not (st.may_lose(b, y) and st.may_take(a, y)):
            return
        na = na + [y]
        nb = [q for q in nb if q != y]
    pb = st.try_price(b, nb)
    if pb is None:
        return
    pa = st.try_price(a, na)
    if pa is None:
        return
    if _accept(_value(st, pa) + _value(st, pb) - _value(st, st.prices[a])
               - _value(st, st.prices[b]), temp, rng):
        st.waves[a], st.prices[a] = na, pa
        st.waves[b], st.prices[b] = nb, pb


class _State:
    """Waves as request lists with exact prices; slot bookkeeping for the pending gradients."""

    def __init__(self, step, pricer, budget: int, res):
        self.sp = SearchPricer.of(pricer)
        self.budget = budget
        self.waves = [sorted(int(i) for i in w.requests) for w in res.waves]
        self.first = [frozenset(w.first_slots) for w in res.waves]
        self.split = [w.is_split for w in res.waves]
        self.children = [w.children for w in res.waves]
        class_of = np.asarray(pricer.class_of)
        self.gslot = [pricer.class_slot[k] if pricer.class_grad[k] else None for k in class_of]
        # carrier order: waves with first_slots, in run order
        self.carriers = [w for w in range(len(self.waves)) if self.first[w]]
        self.prices = [self.price(w, self.waves[w]) for w in range(len(self.waves))]
        self.n_prices = 0

    def price(self, w: int, reqs) -> int:
        if self.split[w]:
            return int(self.sp.price(list(self.children[w]),
                                     first_slots=self.first[w]).admitted_bytes)
        return int(self.sp.fast.admitted([np.asarray(sorted(reqs), dtype=np.int64)],
                                         first_slots=self.first[w]))

    def try_price(self, w: int, reqs) -> int | None:
        self.n_prices += 1
        p = self.price(w, reqs)
        return p if p <= self.budget else None

    def may_take(self, w: int, r: int) -> bool:
        """Whether request r may join wave w without breaking the run order of carriers."""
        if self.split[w]:
            return False
        s = self.gslot[r]
        if s is None or w not in self.carriers:
            return True
        later = self.carriers[self.carriers.index(w) + 1:]
        return not any(s in self.first[c] for c in later)

    def may_lose(self, w: int, r: int) -> bool:
        """Whether request r may leave wave w (a carrier keeps a gradient request per slot)."""
        if self.split[w]:
            return False
        s = self.gslot[r]
        if s is None or s not in self.first[w]:
            return True
        return sum(1 for x in self.waves[w] if self.gslot[x] == s) > 1


def _result(st: _State, pricer, lower: int) -> SearchResult:
    order = st.carriers + [w for w in range(len(st.waves)) if w not in st.carriers]
    waves = []
    for w in order:
        children = (st.children[w] if st.split[w]
                    else (np.asarray(sorted(st.waves[w]), dtype=np.int64),))
        price = pricer.price(list(children), first_slots=st.first[w])
        waves.append(PackedWave(children=tuple(children), first_slots=st.first[w],
                                price=price))
    lb = min(lower, len(waves))
    return SearchResult(tuple(waves), lb, lb == len(waves), "long-search", {})


def long_search(step, pricer, budget: int, *, seed: int = 0, max_prices: int = 300_000,
                max_seconds: float = 600.0):
    """The best plan found (a `SearchResult`), the start's wave count, prices spent, whether
    the wall-clock limit cut it, and the seconds it took. See the module docstring."""
    t0 = time.perf_counter()
    start = pack(step, pricer, budget_bytes=budget, deterministic=True)
    st = _State(step, pricer, budget, start)
    rng = np.random.default_rng(seed)
    alone = np.asarray([st.sp.fast.admitted([np.asarray([i])], first_slots=frozenset())
                        for i in range(len(step.requests))], dtype=np.float64)
    size = alone - SIZE_CONST * alone.min()     # roughly what a request adds to a wave
    scale = float(size.mean())
    st.scale = scale
    best = _result(st, pricer, start.lower_bound_waves)
    cut = False
    while True:
        # drop the lightest wave that carries nothing and is not split
        cand = [w for w in range(len(st.waves)) if not st.first[w] and not st.split[w]]
        if not cand or len(st.waves) <= start.lower_bound_waves:
            break
        c = min(cand, key=lambda w: (st.prices[w], w))
        pool = list(st.waves[c])
        for lst in (st.waves, st.first, st.split, st.children, st.prices):
            del lst[c]
        st.carriers = [w - (w > c) for w in st.carriers]
        flat = [w for w in range(len(st.waves)) if not st.split[w]]
        spent0 = st.n_prices
        budget_here = max_prices - st.n_prices
        while pool:
            if st.n_prices >= max_prices:
                break
            if time.perf_counter() - t0 > max_seconds:
                cut = True
                break
            frac = (st.n_prices - spent0) / max(budget_here, 1)
            temp = scale * T0 * (T1 / T0) ** min(frac, 1.0)
            if rng.random() < POOL_SHARE:
                _pool_step(st, pool, flat, size, temp, rng)
            else:
                _wave_step(st, flat, temp, rng)
        if pool:
            break
        best = _result(st, pricer, start.lower_bound_waves)
    return best, len(start.waves), st.n_prices, cut, time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--prices", type=int, default=300_000,
                    help="exact prices per step (deterministic limit)")
    ap.add_argument("--seconds", type=float, default=600.0,
                    help="wall-clock safety limit per step (if hit: machine-dependent)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    lines = [f"# bench/long_search.py --prices {a.prices} --seconds {a.seconds:g} "
             f"(search seed = step seed)",
             "n,seed,start_waves,long_search_waves,bound,prices,seconds,cut_by_clock"]
    print("\n".join(lines), flush=True)
    for n in a.sizes:
        tot = 0
        for seed in range(a.seeds):
            step, make, budget = bench_case(n, seed)
            pricer = make()
            res, w0, spent, cut, secs = long_search(step, pricer, budget, seed=seed,
                                                    max_prices=a.prices,
                                                    max_seconds=a.seconds)
            check_plan(step, pricer, res, budget_bytes=budget)
            tot += len(res.waves)
            line = (f"{n},{seed},{w0},{len(res.waves)},{res.lower_bound_waves},{spent},"
                    f"{secs:.1f},{cut}")
            lines.append(line)
            print(line, flush=True)
        lines.append(f"{n},mean,,{tot / a.seeds:.1f},,,,")
        print(lines[-1], flush=True)
    if a.out is not None:
        write_text_atomic(a.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
