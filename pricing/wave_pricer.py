"""A step's pricer for the search: its gradient classes, its envelope, and the exact price of
any wave (flat, or as split children) on its materialised full-sharing layout.

Two exact prices, equal in admitted bytes (tested on random waves):
- `price(children, first_slots=...)`: the full `Breakdown` (terms, binding point), through
  `pricing.price.price_groups`; what a plan carries. `group_loads` then `price_loads` is the
  same price in two steps, for a caller that keeps the loads (the planner learns from them).
- `admitted(children, first_slots=...)`: the admitted bytes only, for the search's inner loops.
  One jitted call lays out every (child, class) forward call and walks the schedule
  (`pricing.walk.walk`), with no GroupLoad, Breakdown or terms dict: a few microseconds
  instead of tens. With `adjust` (learned profiles) it is `price(...).admitted_bytes`.
For the search's bounds: `lower_bound_waves(budget)`, a wave count no plan goes below under
exact prices (see `_wave_bound`), and `pending_bytes(slot)`, an upper bound of what carrying a
slot's pending adapter gradients adds to a wave.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from numba import njit

from . import rope_cache
from .clique_bound import find_cliques, undominated_points
from .envelope import Envelope, build_envelope
from .layout import _tree_counts, layout
from .model import PricingModel
from .pipeline import rope_cache_instances
from .price import Breakdown, GroupLoad, price_groups
from .stage_price import StagePricer
from .step import Step
from .tolerances import CEIL_SLACK, PENDING_ROUNDING_BYTES
from .walk import PEAK_BYTES, WalkCharges, WalkGroups, walk

# Raises a group's price to what was learned for it (see waveplan.planner.profiles); identity
# when no profile applies. Called with the group loads and the static breakdown.
Adjust = Callable[[Sequence[GroupLoad], Breakdown], Breakdown]

# columns of the jitted load table: one row per (child, class) forward call
_CLASS, _PACKED, _PADDED, _LOGICAL, _SEGMENTS, _LONGEST = range(6)
# columns of the class table handed to `_admitted`: one row per class
_CLASS_GRAD, _CLASS_SLOT = range(2)
# entries of the scalar vector handed to the jitted walk
_S_INPUT_GRAD, _S_HEAD_RET, _S_HEAD_TR, _S_HEAD_CONST, _S_CALLER, _S_FIRST_EXEC, _S_SAFETY, \
    _S_CP, _S_CONSERVATIVE, _S_MULTIPLE, _S_CHUNK, _S_ROPE_CP, _S_ROPE_ENTRY, _S_ROPE_KEPT, \
    _S_HEAD_FWD, _S_RESIDENT, _S_START, _S_START_ROW = range(18)


@njit(cache=True)
def _loads(rank, table, length_at, class_of, reqs, ptr, num_classes, multiple):
    """One row per (child, class) forward call, children in order, classes ascending (the
    order of `WavePricer.group_loads`): class, packed, padded, logical rows, layout segments,
    padded rows of the longest packed sequence.
    Returns (status, rows); status != 0 (an index out of range or listed twice) leaves the
    error to `layout`. O(total requests x (log + classes))."""
    n_children = ptr.shape[0] - 1
    out = np.zeros((n_children * num_classes, 6), dtype=np.int64)
    count = 0
    members = np.empty(reqs.shape[0], dtype=np.int64)
    shared = np.bool_(True)   # typed, not Literal[bool]: _tree_counts compiles once
    for c in range(n_children):
        lo, hi = ptr[c], ptr[c + 1]
        for k in range(num_classes):
            m = 0
            for j in range(lo, hi):
                i = reqs[j]
                if i < 0 or i >= class_of.shape[0]:
                    return 1, out[:0]
                if class_of[i] == k:
                    members[m] = i
                    m += 1
            if m == 0:
                continue
            status, logical, packed, segments, seq = _tree_counts(rank, table, length_at,
                                                                  members[:m].copy(), shared)
            if status != 0:
                return status, out[:0]
            padded = 0
            longest = 0
            for r in seq:
                one = -(-r // multiple) * multiple
                padded += one
                longest = max(longest, one)
            out[count, _CLASS] = k
            out[count, _PACKED] = packed
            out[count, _PADDED] = padded
            out[count, _LOGICAL] = logical
            out[count, _SEGMENTS] = segments
            out[count, _LONGEST] = longest
            count += 1
    return 0, out[:count]


@njit(cache=True)
def _admitted(rank, table, length_at, class_of, reqs, ptr, classes, carry, layers, pending,
              scal, mlp):
    """Admitted bytes of one wave, exactly as `price_groups` computes them (its rank rows,
    segments = layout segments + padding rows, first execution only with a gradient group),
    or -status when `_loads` fails. `classes`: int64[K, 2] (grad, model slot index);
    `carry`: bool[model slots] in first_slots; `layers`: float64[6, L] (retained, workspace,
    nograd, gdn_state, pad_retained, pad_point); `mlp`: `WalkCharges.mlp_points`.
    O(requests x classes + groups^2 + groups x L)."""
    status, lo = _loads(rank, table, length_at, class_of, reqs, ptr, classes.shape[0],
                        np.int64(scal[_S_MULTIPLE]))
    if status != 0:
        return -status
    g = lo.shape[0]
    rows = np.empty(g)
    logical = np.empty(g)
    segments = np.empty(g)
    grad = np.empty(g, dtype=np.bool_)
    slot = np.empty(g, dtype=np.int64)
    carries = np.empty(g, dtype=np.bool_)
    longest = np.empty(g)
    cp = np.int64(scal[_S_CP])
    any_grad = False
    for j in range(g):
        k = lo[j, _CLASS]
        padded = lo[j, _PADDED]
        rows[j] = padded if scal[_S_CONSERVATIVE] > 0 else -(-padded // cp)
        logical[j] = lo[j, _LOGICAL]
        segments[j] = lo[j, _SEGMENTS] + padded - lo[j, _PACKED]
        longest[j] = lo[j, _LONGEST]
        grad[j] = classes[k, _CLASS_GRAD] != 0
        slot[j] = classes[k, _CLASS_SLOT]
        carries[j] = grad[j] and carry[slot[j]]
        any_grad = any_grad or grad[j]
    # the first execution with a gradient group; the resident bytes (FSDP2's gathered
    # parameters) in any wave, as `price_groups` charges them
    first_exec = (scal[_S_FIRST_EXEC] if any_grad else 0.0) + (scal[_S_RESIDENT] if g > 0 else 0.0)
    charges = WalkCharges(layers[0], layers[1], layers[2], layers[3], pending,
                          scal[_S_INPUT_GRAD], scal[_S_HEAD_RET], scal[_S_HEAD_TR],
                          scal[_S_HEAD_CONST], scal[_S_CALLER], layers[4], layers[5], scal[_S_CHUNK],
                          scal[_S_ROPE_CP], scal[_S_ROPE_ENTRY], scal[_S_ROPE_KEPT] > 0,
                          scal[_S_HEAD_FWD], mlp)
    best, _ = walk(charges, first_exec, WalkGroups(rows, logical, segments, grad, slot, carries, longest))
    peak = best[PEAK_BYTES]
    if scal[_S_START] > 0 and g > 0:   # the forward's start (`price.forward_start`)
        peak = max(peak, scal[_S_START] + scal[_S_START_ROW] * rows.sum()
                   + scal[_S_CALLER] * logical.sum())
    raw = np.ceil(peak)
    return np.int64(np.ceil(raw * scal[_S_SAFETY]))


@dataclass
class WavePricer:
    """Prices subsets of one step. Classes are the step's distinct (slot, grad) pairs, in order
    of first appearance. `adjust` lets the planner apply learned profiles."""

    step: Step
    model: PricingModel
    adjust: Adjust | None = None
    profiled: bool = False
    envelope_scale: float = 1.0
    """The envelope's factor (>= 1): with learned profiles, their largest ratio, so that the
    search still packs against an upper bound when profiles raise prices."""
    class_slot: tuple[str, ...] = field(init=False)
    class_grad: tuple[bool, ...] = field(init=False)
    class_of: np.ndarray = field(init=False)
    _envelope: Envelope | None = field(init=False, default=None)
    _fast: tuple | None = field(init=False, default=None, repr=False)
    _class_totals: np.ndarray | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        step = self.step
        slots = getattr(step, "slots", None)
        if slots is not None and getattr(step, "grads", None) is not None:
            # a class is (slot index, grad), numbered by first appearance: one jitted pass
            key = np.asarray(slots, dtype=np.int64) * 2 + np.asarray(step.grads, dtype=np.int64)
            class_of, class_key = _first_appearance(key)
            keys = [(step.slot_names[int(k) // 2], bool(k % 2)) for k in class_key]
        else:
            seen: dict[tuple[str, bool], int] = {}
            class_of = np.empty(len(step.requests), dtype=np.int64)
            for i, request in enumerate(step.requests):
                class_of[i] = seen.setdefault((request.slot, bool(request.grad)), len(seen))
            keys = list(seen)
        for slot, _ in keys:
            self.model.slot_index(slot)  # unknown slot: a clear error now
        self.class_of = class_of
        self.class_slot = tuple(k[0] for k in keys)
        self.class_grad = tuple(k[1] for k in keys)

    @classmethod
    def build(cls, step: Step, model: PricingModel, **kwargs) -> WavePricer:
        return cls(step=step, model=model, **kwargs)

    @property
    def num_classes(self) -> int:
        return len(self.class_slot)

    def envelope(self) -> Envelope:
        """The step's envelope, scaled by `envelope_scale` when above 1. O(1) once built."""
        if self._envelope is None:
            env = self._cached_envelope(lower=False)
            s = self.envelope_scale
            if s > 1.0:
                env = dataclasses.replace(
                    env, const=env.const * s, presence=env.presence * s, coef=env.coef * s,
                    pad=None if env.pad is None else env.pad * s,
                    seg=None if env.seg is None else env.seg * s,
                    pending=None if env.pending is None else env.pending * s)
            self._envelope = env
        return self._envelope

    def _cached_envelope(self, *, lower: bool) -> Envelope:
        # an envelope depends only on the model and the class mix: share it across steps
        cache = self.model.memo.setdefault("envelopes", {})
        key = (self.class_grad, self.class_slot, lower)
        if key not in cache:
            cache[key] = build_envelope(self.model, self.class_grad, self.class_slot, lower=lower)
        return cache[key]

    # --- exact prices ---------------------------------------------------------------------

    def _fast_args(self) -> tuple:
        """The arrays for `_admitted`: per class (built once per pricer, O(K)) and per model
        (cached in the model's arrays beside its envelopes, O(L))."""
        if self._fast is None:
            model, a = self.model, self.model.charges.walk
            cache = model.memo.setdefault("fast_walk", {})
            if self.profiled not in cache:
                layers = np.ascontiguousarray(np.stack([a.retained, a.workspace,
                                                        a.nograd, a.gdn_state,
                                                        a.pad_retained, a.pad_point]),
                                              dtype=np.float64)
                scal = np.asarray([a.input_grad, a.head_retained, a.head_transient,
                                   a.head_const, a.caller,
                                   0.0 if self.profiled else model.charges.first_exec, model.safety,
                                   model.rows_cp, 0.0,
                                   model.parallel.row_multiple, a.chunk, a.rope_cp,
                                   a.rope_entry, float(a.rope_kept), a.head_forward,
                                   model.charges.resident, model.charges.start,
                                   model.charges.start_row],
                                  dtype=np.float64)
                pending = np.ascontiguousarray(a.pending, dtype=np.float64)
                mlp = np.ascontiguousarray(a.mlp_points, dtype=np.float64)
                cache[self.profiled] = (layers, pending, scal, len(model.slot_names), mlp)
            layers, pending, scal, n_slots, mlp = cache[self.profiled]
            classes = np.asarray([[int(g), model.slot_index(s)]
                                  for s, g in zip(self.class_slot, self.class_grad, strict=True)]
                                 or np.zeros((0, 2)), dtype=np.int64).reshape(-1, 2)
            self._fast = (classes, layers, pending, scal, n_slots, mlp)
        return self._fast

    @staticmethod
    def _flatten(children: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        if len(children) == 1:
            reqs = np.asarray(children[0], dtype=np.int64).reshape(-1)
            return reqs, np.asarray([0, reqs.size], dtype=np.int64)
        parts = [np.asarray(c, dtype=np.int64).reshape(-1) for c in children]
        ptr = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum([p.size for p in parts], out=ptr[1:])
        return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)), ptr

    def admitted(self, children: Sequence[np.ndarray], *,
                 first_slots: frozenset[str] = frozenset()) -> int:
        """`price(children, first_slots=...).admitted_bytes`, without building the breakdown.
        O(requests x classes + groups x layers), jitted."""
        if self.adjust is not None:
            return self.price(children, first_slots=first_slots).admitted_bytes
        classes, layers, pending, scal, n_slots, mlp = self._fast_args()
        carry = np.zeros(max(n_slots, 1), dtype=np.bool_)
        for name in first_slots:
            carry[self.model.slot_index(name)] = True
        reqs, ptr = self._flatten(children)
        st = self.step
        out = int(_admitted(st.rank, st.lcp_table, st.length_at, self.class_of, reqs, ptr,
                            classes, carry, layers, pending, scal, mlp))
        if out < 0:   # a bad index: let the full path raise its error
            return self.price(children, first_slots=first_slots).admitted_bytes
        return out

    def earlier_entries(self, waves: Sequence[Sequence[GroupLoad]]) -> list[float]:
        """Bytes of the RoPE cache entries the waves before each wave (in run order, given by
        their group loads) left beside it (`rope_cache.earlier_wave_entries`); 0 under PP > 1,
        whose stage walks charge them. O(calls x log calls)."""
        entry, instances = self.rope_entry_parts()
        return rope_cache.earlier_wave_entries(entry, waves, instances)

    def rope_entry_parts(self) -> tuple[float, int]:
        """One RoPE cache entry per row and how many a call fills (`pipeline.rope_cache_instances`;
        the walk's `rope_entry` is their product). O(layers)."""
        g = self.model.geometry
        instances = rope_cache_instances(g, g.layers)
        return float(self.model.charges.walk.rope_entry) / instances, instances

    def earlier_reserve_bytes(self) -> int:
        """Admitted bytes that always cover them beside any wave of the step
        (`rope_cache.reserve_bytes` of the step's calls as one wave); 0 under PP > 1 or
        without rotary entries. O(requests)."""
        entry, instances = self.rope_entry_parts()
        if entry <= 0.0:
            return 0
        every = np.arange(len(self.class_of), dtype=np.int64)
        return rope_cache.reserve_bytes(entry, self.group_loads([every]), self.model.safety,
                                        instances)

    def plus_earlier(self, price: Breakdown, extra: float) -> Breakdown:
        """`price` with `extra` bytes of earlier waves' entries (`rope_cache.plus_earlier_entries`)."""
        return rope_cache.plus_earlier_entries(price, extra, self.model.safety)

    def group_loads(self, children: Sequence[np.ndarray]) -> list[GroupLoad]:
        """One load per (child, class): each runs as its own forward call. O(requests)."""
        reqs, ptr = self._flatten(children)
        st = self.step
        status, rows = _loads(st.rank, st.lcp_table, st.length_at, self.class_of, reqs, ptr,
                              self.num_classes, self.model.parallel.row_multiple)
        if status != 0:   # name the bad index with layout's error
            for child in children:
                layout(st, np.asarray(child, dtype=np.int64), shared=True)
        loads = []
        for k, packed, padded, logical, segments, longest in rows.tolist():
            loads.append(GroupLoad(
                slot=self.class_slot[k], grad=self.class_grad[k], packed_rows=packed,
                padded_rows=padded, logical_rows=logical, segments=segments + padded - packed,
                longest_rows=longest))
        return loads

    def price(self, children: Sequence[np.ndarray], *, first_slots: frozenset[str] = frozenset()) -> Breakdown:
        return self.price_loads(self.group_loads(children), first_slots=first_slots)

    def price_loads(self, loads: Sequence[GroupLoad], *,
                    first_slots: frozenset[str] = frozenset()) -> Breakdown:
        """`price(children, ...)` of the wave whose `group_loads(children)` are `loads`."""
        breakdown = price_groups(self.model, loads, first_slots=first_slots, profiled=self.profiled)
        if self.adjust is not None:
            breakdown = self.adjust(loads, breakdown)
        return breakdown

    def pending_bytes(self, slot: str) -> float:
        """An upper bound of what carrying `slot`'s pending adapter gradients adds to any
        wave's admitted bytes: all of the slot's adapter gradients (the walk adds at most that
        at a backward point, or in place of a group's retained rows), at the safety factor.
        With `adjust` (profiles) the envelope may be scaled, so this is only an estimate."""
        a = self.model.charges.walk
        return (float(a.pending[self.model.slot_index(slot)].sum()) * self.model.safety
                + PENDING_ROUNDING_BYTES)

    # --- lower bound ----------------------------------------------------------------------

    def class_totals(self, requests: np.ndarray | None = None) -> np.ndarray:
        """float64[K, 2]: true full-sharing packed rows and logical rows of each class's
        requests (all of the step's, cached, or `requests`). One jitted layout per class."""
        if requests is None and self._class_totals is not None:
            return self._class_totals
        K = self.num_classes
        idx = (np.arange(len(self.class_of), dtype=np.int64) if requests is None
               else np.asarray(requests, dtype=np.int64))
        st = self.step
        # one "child" holding them all: the kernel lays out each class's members on its own
        status, rows = _loads(st.rank, st.lcp_table, st.length_at, self.class_of, idx,
                              np.asarray([0, len(idx)], dtype=np.int64), K, 1)
        if status != 0:   # name the bad index with layout's error
            layout(st, idx, shared=True)
        totals = np.zeros((K, 2))
        totals[rows[:, _CLASS], 0] = rows[:, _PACKED]
        totals[rows[:, _CLASS], 1] = rows[:, _LOGICAL]
        if requests is None:
            self._class_totals = totals
        return totals

    def stages(self) -> StagePricer | None:
        """The model's stages for the pipeline search (PP > 1), None at PP1."""
        if self.model.parallel.pp == 1:
            return None
        totals = self.class_totals()
        grad = np.asarray(self.class_grad, dtype=bool)
        rows = float(totals[grad, 0].sum()) if grad.any() else 0.0
        return StagePricer(self.model, rows / self.model.rows_cp)

    def lower_bound_waves(self, budget_bytes: float, requests: np.ndarray | None = None) -> int:
        """A wave count no plan of flat waves within the budget can go below, for the whole
        step or for `requests` (the search leaves out split units, which run alone).
        The plain bound (`_wave_bound`, O(P x K) once the class totals are known) is raised
        by the prompt groups that cannot share a wave whole (`clique_bound`: a clique of
        them larger than the wave count forces prompts to be paid again), counting up from
        it while the forced mass says the count is too small. O(n log n + S'^2 P') for the
        conflict graph, then O(P x K) per count tried."""
        n = len(self.step.requests) if requests is None else len(requests)
        if n == 0:
            return 0
        lower = self._cached_envelope(lower=True)
        charges = self.model.charges
        fe = ((0.0 if self.profiled else float(charges.first_exec)) + float(charges.resident)) \
            * self.model.safety
        grad = np.asarray(self.class_grad, dtype=np.bool_)
        # each gradient class's slot has one wave carrying its pending gradients; for a part
        # of the step that wave may be elsewhere (a split unit), so it is not counted then
        pend = lower.pending if (lower.pending is not None and requests is None) \
            else np.zeros_like(lower.presence)
        totals = self.class_totals(requests)
        P = lower.presence.shape[0]
        bound = _wave_bound(lower.coef, lower.presence, pend, totals, grad,
                            float(budget_bytes), fe, np.zeros(P))
        if bound >= n:
            return n
        idx = np.arange(n, dtype=np.int64) if requests is None \
            else np.asarray(requests, dtype=np.int64)
        cache = self.model.memo.setdefault("clique_points", {})
        key = (self.class_grad, self.class_slot)
        if key not in cache:
            cache[key] = undominated_points(lower.coef[:, :, 0], lower.coef[:, :, 1],
                                            lower.presence)
        cliques = find_cliques(self.step, self.class_of, idx, lower.coef, lower.presence,
                               grad, float(budget_bytes), fe, cache[key])
        # the least N whose forced splits do not raise the bound above N (clique_bound)
        waves = int(bound)
        while waves < n:
            possible, extra = cliques.extra(waves)
            if possible and _wave_bound(lower.coef, lower.presence, pend, totals, grad,
                                        float(budget_bytes), fe, extra) <= waves:
                break
            waves += 1
        return waves


@njit(cache=True)
def _first_appearance(key):
    """Renumber keys by first appearance: (class of each entry, key of each class). O(n)."""
    n = key.shape[0]
    top = 0
    for i in range(n):
        top = max(top, key[i])
    code = -np.ones(top + 1, dtype=np.int64)
    out = np.empty(n, dtype=np.int64)
    keys = np.empty(n, dtype=np.int64)
    m = 0
    for i in range(n):
        if code[key[i]] < 0:
            code[key[i]] = m
            keys[m] = key[i]
            m += 1
        out[i] = code[key[i]]
    return out, keys[:m].copy()


@njit(cache=True)
def _ceil_div(mass, room):
    if room <= 0.0:
        return np.inf if mass > 0.0 else 0.0
    return np.ceil(mass / room - CEIL_SLACK)


@njit(cache=True)
def _wave_bound(coef, pres, pend, totals, grad, budget, fe, extra):
    """Lower bound on the waves of any plan of flat waves within `budget`.

    Every wave W prices at least, at each lower-envelope point p (`build_envelope(...,
    lower=True)`: true rows, no padding or segments), lower_p(W) + the head constant
    pres[p,k] of each class k present + the first-execution allowance fe when W holds a
    gradient request. Packed rows are subadditive over a partition, so over the N waves of
    a plan: N x budget >= M_p + sum_k pres[p,k] G_k + fe G, where M_p is the step's mass at
    p, G_k the waves holding class k and G those holding a gradient class. G_k and G are
    bounded below the same way from their own mass alone (every other charge is >= 0):
    G_k >= M_q^k / (budget - pres[q,k] - fe_k) at any point q, G >= M_q^grad / (budget - fe),
    and G >= G_k for gradient classes. The one wave that carries a present gradient class's
    pending adapter gradients adds pend[p,k] at p (the lower envelope's `pending`; zeros
    when not counted). `extra[p]` is mass the caller knows every plan adds at p beyond the
    step's full-sharing rows (prompts paid again by split groups, `clique_bound`; zeros for
    none). O(P x K).
    """
    P = coef.shape[0]
    K = coef.shape[1]
    own = np.zeros((P, K))
    for p in range(P):
        for k in range(K):
            own[p, k] = coef[p, k, 0] * totals[k, 0] + coef[p, k, 1] * totals[k, 1]
    g_k = np.ones(K)
    g = 0.0
    for k in range(K):
        fk = fe if grad[k] else 0.0
        for p in range(P):
            g_k[k] = max(g_k[k], _ceil_div(own[p, k], budget - pres[p, k] - fk))
        if grad[k]:
            g = max(g, g_k[k])
    for p in range(P):
        m = 0.0
        for k in range(K):
            if grad[k]:
                m += own[p, k]
        if m > 0.0:
            g = max(g, _ceil_div(m, budget - fe))
    best = 1.0
    for k in range(K):
        best = max(best, g_k[k])
    best = max(best, g)
    for p in range(P):
        mass = fe * g + extra[p]
        for k in range(K):
            mass += own[p, k] + pres[p, k] * g_k[k]
            if grad[k] and totals[k, 1] > 0:
                mass += pend[p, k]
        best = max(best, _ceil_div(mass, budget))
    return best
