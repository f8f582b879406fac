"""Test doubles for the search layer: a duck-typed step and an affine/nonlinear pricer.

The doubles implement the search contract (`waveplan.search.contract`; tested in
test_search_contract.py): `FakeStep` is a `SearchStep`, `FakeEnvelope` a `SearchEnvelope`,
`FakePricer` and `LinearPricer` are `Pricer`s with none of the optional capabilities (no fast
admitted path, no pending bound, no lower bound of their own, no group loads), so the search
takes its generic paths for them; `real_pricer` gives the real `WavePricer`, which has them all.
`FakePricer` implements `Pricer` as follows:
- the envelope has a few peak points, each affine in (packed rows, logical rows, segments)
  per gradient class, plus a constant and a per-class presence charge;
- `price` is the envelope made slightly lower and nonlinear (`slack`), split children are
  priced as sum of per-child retained memory + max per-child transient, and each slot in
  `first_slots` that has gradient requests in the wave adds a fixed surcharge.
So max over points of the envelope >= price([wave]).admitted_bytes for every flat wave.

`make_step` builds a duck-typed `FakeStep`; `to_real_step` turns it into a real
`waveplan.pricing.step.Step` for the real pricer (`pricers()` includes it when importable).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FakeRequest:
    id: str
    num_tokens: int
    slot: str
    grad: bool


@dataclass(frozen=True)
class FakeStep:
    requests: tuple
    group_of: np.ndarray
    prefix_rows: np.ndarray
    own_rows: np.ndarray


def make_step(groups: Sequence[tuple[int, Sequence[int]]], *, slots: Sequence[str] | None = None,
              grads: Sequence[bool] | None = None) -> FakeStep:
    """groups: (prefix_rows, [own_rows of each member]); slot/grad per group (default 'a', True)."""
    reqs, group_of, own = [], [], []
    prefix = []
    for g, (pre, members) in enumerate(groups):
        prefix.append(int(pre))
        slot = slots[g] if slots is not None else "a"
        grad = grads[g] if grads is not None else True
        for m, o in enumerate(members):
            reqs.append(FakeRequest(f"g{g}r{m}", int(pre) + int(o), slot, bool(grad)))
            group_of.append(g)
            own.append(int(o))
    return FakeStep(tuple(reqs), np.asarray(group_of, dtype=np.int64),
                    np.asarray(prefix, dtype=np.int64), np.asarray(own, dtype=np.int64))


def grpo_step(seed: int, num_requests: int, *, completions: int = 8,
              slots: Sequence[str] = ("a", "b"), nograd_frac: float = 0.15) -> FakeStep:
    """A GRPO-style step: prompts of 200-2000 tokens, `completions` answers of 50-4000 each."""
    rng = np.random.default_rng(seed)
    groups, gslots, ggrads = [], [], []
    left = num_requests
    while left > 0:
        c = min(completions, left)
        pre = int(rng.integers(200, 2000))
        own = rng.integers(50, 4000, size=c).tolist()
        groups.append((pre, own))
        gslots.append(slots[int(rng.integers(0, len(slots)))])
        ggrads.append(bool(rng.random() >= nograd_frac))
        left -= c
    return make_step(groups, slots=gslots, grads=ggrads)


@dataclass(frozen=True)
class FakeEnvelope:
    const: np.ndarray
    presence: np.ndarray
    coef: np.ndarray


@dataclass(frozen=True)
class FakePrice:
    raw_bytes: int
    admitted_bytes: int
    binding: str
    terms: dict
    basis: str


_POINTS = ("forward", "backward", "head")


def _classes(step):
    """The fakes' gradient classes: the step's distinct (slot, grad) pairs, sorted; returns
    (class_slot, class_grad, class_of)."""
    keys = sorted({(r.slot, bool(r.grad)) for r in step.requests})
    index = {k: i for i, k in enumerate(keys)}
    return (tuple(k[0] for k in keys), tuple(k[1] for k in keys),
            np.asarray([index[(r.slot, bool(r.grad))] for r in step.requests], dtype=np.int64))


class FakePricer:
    """Protocol double. `slack` in [0, 0.2]: how much lower than the envelope `price` is."""

    def __init__(self, step, *, slack: float = 0.05, first_cost: float = 2.0e8,
                 retained: float = 0.6, scale: float = 1.0):
        self.step = step
        self.class_slot, self.class_grad, self.class_of = _classes(step)
        self.num_classes = len(self.class_slot)
        self.slack = slack
        self.first_cost = first_cost
        self.retained = retained
        K = self.num_classes
        P = len(_POINTS)
        self._const = np.asarray([2.0e9, 2.5e9, 1.5e9]) * scale
        presence = np.zeros((P, K))
        coef = np.zeros((P, K, 3))
        for k in range(K):
            g = 1.5 if self.class_grad[k] else 1.0
            salt = 1.0 + 0.1 * (sum(map(ord, self.class_slot[k])) % 3)
            presence[:, k] = np.asarray([5e7, 1.2e8 * g, 2e7]) * salt
            coef[0, k] = (9.0e4 * salt, 0.0, 0.0)
            coef[1, k] = (4.0e4 * g, 5.0e4 * g, 3.0e6)
            coef[2, k] = (1.0e4, 1.4e5, 0.0)
        self._presence = presence * scale
        self._coef = coef * scale
        self._num_tokens = np.asarray([r.num_tokens for r in step.requests], dtype=np.int64)
        self.calls = 0

    def envelope(self) -> FakeEnvelope:
        return FakeEnvelope(self._const.copy(), self._presence.copy(), self._coef.copy())

    def _var(self, idx: np.ndarray) -> tuple[np.ndarray, int]:
        """Envelope value minus const for a flat set of requests, and its packed rows."""
        st = self.step
        K = self.num_classes
        cls = self.class_of[idx]
        key = np.unique(st.group_of[idx] * K + cls)
        kcls = key % K
        packed = (np.bincount(kcls, weights=st.prefix_rows[key // K], minlength=K)
                  + np.bincount(cls, weights=st.own_rows[idx], minlength=K))
        logical = np.bincount(cls, weights=self._num_tokens[idx], minlength=K)
        segs = np.bincount(kcls, minlength=K) + np.bincount(cls, minlength=K)
        present = segs > 0
        total = (self._presence[:, present].sum(axis=1) + self._coef[:, :, 0] @ packed
                 + self._coef[:, :, 1] @ logical + self._coef[:, :, 2] @ segs)
        return total, int(packed.sum())

    def price(self, children, *, first_slots: frozenset = frozenset()) -> FakePrice:
        self.calls += 1
        children = [np.asarray(c, dtype=np.int64) for c in children]
        if not children or any(len(c) == 0 for c in children):
            raise ValueError("children must be non-empty")
        ret = np.zeros(len(_POINTS))
        trans = np.zeros(len(_POINTS))
        for c in children:
            var, packed = self._var(c)
            exact = var * ((1.0 - self.slack) + self.slack / (1.0 + packed / 4096.0))
            ret += self.retained * exact
            trans = np.maximum(trans, (1.0 - self.retained) * exact)
        total = self._const + ret + trans
        allidx = np.concatenate(children)
        grad_slots = {self.class_slot[k] for k in np.unique(self.class_of[allidx])
                      if self.class_grad[k]}
        pending = self.first_cost * len(set(first_slots) & grad_slots)
        total = total + pending
        p = int(np.argmax(total))
        admitted = int(math.ceil(total[p]))
        return FakePrice(raw_bytes=int(admitted / 1.1), admitted_bytes=admitted,
                         binding=_POINTS[p], terms={"pending": int(pending)}, basis="fake")


_REAL_MODEL = []


def real_model():
    """A small real pricing model (qwen3-8b, slots a/b/c), or None if pricing lacks it."""
    if not _REAL_MODEL:
        try:
            from waveplan.pricing.lora import LoraConfig, LoraSlot
            from waveplan.pricing.model import PricingModel
            from waveplan.pricing.presets import load_preset
            from waveplan.pricing.wave_pricer import WavePricer  # noqa: F401
            slots = LoraConfig(slots=(LoraSlot(name="a"), LoraSlot(name="b", rank=64),
                                      LoraSlot(name="c")))
            _REAL_MODEL.append(PricingModel.build(load_preset("qwen3-8b"), lora=slots))
        except ImportError:
            _REAL_MODEL.append(None)
    return _REAL_MODEL[0]


def to_real_step(step: FakeStep):
    """The same requests as a real `waveplan.pricing.step.Step` (length form: a group with a
    prompt is a prompt key; prefix 0 means no key)."""
    from waveplan.pricing.step import Request, Step
    reqs = []
    for i, r in enumerate(step.requests):
        g = int(step.group_of[i])
        pre = int(step.prefix_rows[g])
        key = f"p{g}" if 0 < pre < r.num_tokens else None
        reqs.append(Request(id=r.id, num_tokens=r.num_tokens, prompt=key,
                            num_prompt_tokens=pre if key else 0, slot=r.slot, grad=r.grad))
    return Step.from_requests(reqs)


def real_pricer(step: FakeStep):
    from waveplan.pricing.wave_pricer import WavePricer
    real = to_real_step(step)
    return real, WavePricer.build(real, real_model())


def pricers():
    """(name, make) pairs every search test is parametrised over; make(fake step) returns
    (step, pricer). The real `WavePricer` joins when `waveplan.pricing` provides it."""
    out = [("fake", lambda step: (step, FakePricer(step))),
           ("fake-tight", lambda step: (step, FakePricer(step, slack=0.0)))]
    if real_model() is not None:
        out.append(("real", real_pricer))
    return out


class LinearPricer:
    """One peak point, price == envelope: bytes = sum of num_tokens x `per_token` (+ a fixed
    `first_cost` per pending slot). Requests in their own groups make it plain bin packing."""

    def __init__(self, step, *, per_token: float = 1.0, first_cost: float = 0.0):
        self.step = step
        self.class_slot, self.class_grad, self.class_of = _classes(step)
        self.num_classes = len(self.class_slot)
        self.per_token = per_token
        self.first_cost = first_cost
        self._tok = np.asarray([r.num_tokens for r in step.requests], dtype=np.float64)

    def envelope(self) -> FakeEnvelope:
        K = self.num_classes
        coef = np.zeros((1, K, 3))
        coef[0, :, 1] = self.per_token
        return FakeEnvelope(np.zeros(1), np.zeros((1, K)), coef)

    def price(self, children, *, first_slots: frozenset = frozenset()) -> FakePrice:
        allidx = np.concatenate([np.asarray(c, dtype=np.int64) for c in children])
        total = float(self._tok[allidx].sum()) * self.per_token
        grad_slots = {self.class_slot[k] for k in np.unique(self.class_of[allidx])
                      if self.class_grad[k]}
        total += self.first_cost * len(set(first_slots) & grad_slots)
        admitted = int(math.ceil(total))
        return FakePrice(admitted, admitted, "all", {}, "linear")


def singles_step(tokens: Sequence[int], *, slot: str = "a", grad: bool = True) -> FakeStep:
    """Each request alone in its prefix group, no prompt."""
    return make_step([(0, [t]) for t in tokens], slots=[slot] * len(tokens),
                     grads=[grad] * len(tokens))


_MODELS: dict = {}


def layout_model(preset: str, *, tp: int = 1, cp: int = 1, pp: int = 1, sp: bool = False,
                 recompute: str = "full"):
    """A real pricing model with slots a/b/c under a parallel layout (cached)."""
    key = (preset, tp, cp, pp, sp, recompute)
    if key not in _MODELS:
        from waveplan.pricing.lora import LoraConfig, LoraSlot
        from waveplan.pricing.model import PricingModel
        from waveplan.pricing.parallel import ParallelLayout, Recompute
        from waveplan.pricing.presets import load_preset
        slots = LoraConfig(slots=(LoraSlot(name="a"), LoraSlot(name="b", rank=64),
                                  LoraSlot(name="c")))
        _MODELS[key] = PricingModel.build(
            load_preset(preset), parallel=ParallelLayout(tp=tp, cp=cp, pp=pp,
                                                         sequence_parallel=sp),
            recompute=Recompute(mode=recompute), lora=slots)
    return _MODELS[key]


# layouts whose padding, busiest CP rank, GDN states and conservative bounds the envelope and
# the step-aware items must cover: TP4+SP (rows to a multiple of 4), CP2 (of 4 and half the
# rows per rank), TP4+SP+CP2 (of 16), PP2 (conservative), a GDN hybrid and a MoE model
LAYOUT_MODELS = (("qwen3-8b", {}), ("qwen3.8-27b", {"tp": 4, "sp": True}),
                 ("qwen3.8-27b", {"tp": 4, "sp": True, "cp": 2}), ("llama-3.1-8b", {"cp": 2}),
                 ("qwen3-30b-a3b", {"tp": 2, "sp": True}), ("qwen3-8b", {"pp": 2}),
                 ("qwen3.8-27b", {"recompute": "selective"}))


def token_step(seed: int, n: int, *, slots: Sequence[str] = ("a", "b")):
    """A token-form step with nested sharing: requests keep random prefixes of a few shared
    bases (a system prompt inside a prompt inside a conversation), some are duplicates or
    prefixes of others."""
    from waveplan.pricing.step import Request, Step
    rng = np.random.default_rng(seed)
    bases = [rng.integers(0, 50, size=int(rng.integers(1, 400))).tolist() for _ in range(3)]
    reqs = []
    for i in range(n):
        base = bases[int(rng.integers(0, len(bases)))]
        keep = int(rng.integers(0, len(base) + 1))
        extra = rng.integers(0, 50, size=int(rng.integers(0 if keep else 1, 300))).tolist()
        if i and rng.random() < 0.1:
            tokens = list(reqs[int(rng.integers(0, i))].tokens)      # a duplicate
        else:
            tokens = base[:keep] + extra
        reqs.append(Request.from_tokens(f"t{i}", np.asarray(tokens, dtype=np.int64),
                                        slot=slots[int(rng.integers(0, len(slots)))],
                                        grad=bool(rng.random() < 0.85)))
    return Step.from_requests(reqs)


def sft_step(seed: int, n: int, *, slots: Sequence[str] = ("a",)):
    """A length-form SFT step: every request its own prompt, nothing shared."""
    from waveplan.pricing.step import Request, Step
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        prompt = int(np.clip(600 * np.exp(0.7 * rng.standard_normal()), 64, 4096))
        completion = int(np.clip(900 * np.exp(0.9 * rng.standard_normal()), 64, 8192))
        reqs.append(Request(id=f"s{i}", prompt=f"p{i}", num_prompt_tokens=prompt,
                            num_tokens=prompt + completion,
                            slot=slots[int(rng.integers(0, len(slots)))]))
    return Step.from_requests(reqs)


def search_state(seed: int, n: int, factor: float = 4.0):
    """The search state (`packers._bound`, deterministic) of a GRPO step `grpo_step(seed, n)`
    under a budget of `factor` x its largest one-request price."""
    import time

    from waveplan.search import packers as P
    from waveplan.search.contract import SearchPricer
    from waveplan.search.options import DEFAULT_TIME_BUDGET_MS, SearchOptions

    step, pricer = real_pricer(grpo_step(seed, n))
    worst = max(pricer.admitted([np.asarray([i])], first_slots=frozenset(
        {r.slot} if r.grad else ())) for i, r in enumerate(step.requests))
    return P._bound(step, SearchPricer.of(pricer), int(worst * factor),
                    SearchOptions(deterministic=True, time_budget_ms=DEFAULT_TIME_BUDGET_MS),
                    "measured", time.perf_counter(), {})


def greedy_plan(seed: int, n: int, factor: float = 4.0):
    """`search_state(seed, n, factor)` and one greedy plan of it without the slot-aware rule:
    (state, atom -> wave, waves). The anneal and ejection tests start from it."""
    from waveplan.search.greedy import pack_greedy
    from waveplan.search.items import blocks_for

    s = search_state(seed, n, factor)
    assign, nw, _ = pack_greedy(s.items, blocks_for(s.items, s.active), s.lower, max_runs=1)
    return s, assign, nw


def check_search_state(s, assign: np.ndarray, nw: int) -> None:
    """Every active atom in one of the nw waves, none empty, every wave within the limit."""
    from waveplan.search.greedy import LIMIT, atom_args
    from waveplan.search.kernels import build_state

    assert np.all((assign[s.active] >= 0) & (assign[s.active] < nw))
    assert len(np.unique(assign[s.active])) == nw
    load, _, _ = build_state(assign, nw, s.active, *atom_args(s.items)[0],
                             *atom_args(s.items)[1])
    assert load[:nw].max() <= LIMIT
