"""The search's model of a wave against the exact price: step-aware items above it, the fast
admitted path equal to it, the radix tree exact in rows, the valid bound below any plan."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from search_fakes import LAYOUT_MODELS, grpo_step, layout_model, sft_step, to_real_step, token_step

from waveplan.pricing.layout import layout
from waveplan.pricing.wave_pricer import WavePricer
from waveplan.search import PackerKind, check_plan, pack
from waveplan.search.items import build_items, point_coefs, prefix_tree, weight_mode
from waveplan.search.items_jit import LENGTH_FORM, TOKEN_FORM

MODELS = [layout_model(p, **kw) for p, kw in LAYOUT_MODELS]
KINDS = ("grpo", "sft", "token")


def _step(kind: str, seed: int, n: int):
    if kind == "grpo":
        return to_real_step(grpo_step(seed, n, completions=4, slots=("a", "b", "c")))
    if kind == "sft":
        return sft_step(seed, n, slots=("a", "b"))
    return token_step(seed, n)


def _envelope_bytes(items, reqs) -> float:
    """The items' price of a flat wave: max over points of const + load x capacity."""
    return float(np.max(items.budget - items.cap + items.load_of(reqs) * items.cap))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(MODELS), kind=st.sampled_from(KINDS), seed=st.integers(0, 10**6),
       n=st.integers(1, 24), data=st.data())
def test_step_aware_items_cover_the_exact_price(model, kind, seed, n, data):
    step = _step(kind, seed, n)
    pricer = WavePricer.build(step, model)
    assert weight_mode(step, point_coefs(pricer.envelope())) == (TOKEN_FORM if kind == "token"
                                                                 else LENGTH_FORM)
    items = build_items(step, pricer, 1e15)
    size = data.draw(st.integers(1, len(step.requests)))
    sub = np.sort(np.asarray(data.draw(st.permutations(range(len(step.requests))))[:size]))
    assert pricer.admitted([sub]) <= _envelope_bytes(items, sub)


def test_items_are_exact_for_unshared_steps():
    """SFT (no sharing): each request is its own tree, so the items price a wave exactly,
    up to the envelope's rounding margin."""
    model = layout_model("qwen3.8-27b", tp=4, sp=True, cp=2)
    step = sft_step(3, 40)
    pricer = WavePricer.build(step, model)
    items = build_items(step, pricer, 1e15, reserve_pending=False)
    rng = np.random.default_rng(0)
    for _ in range(20):
        sub = np.sort(rng.permutation(40)[:rng.integers(1, 40)])
        exact = pricer.admitted([sub])
        assert exact <= _envelope_bytes(items, sub) <= exact * (1 + 1e-6) + 16


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(MODELS), kind=st.sampled_from(KINDS), seed=st.integers(0, 10**6),
       n=st.integers(1, 16), data=st.data())
def test_fast_admitted_equals_the_full_price(model, kind, seed, n, data):
    step = _step(kind, seed, n)
    pricer = WavePricer.build(step, model)
    sub = np.asarray(data.draw(st.permutations(range(len(step.requests)))))
    sub = sub[:data.draw(st.integers(1, len(sub)))]
    k = data.draw(st.integers(1, len(sub)))
    children = [np.sort(c) for c in np.array_split(sub, k)]
    first = frozenset(data.draw(st.sets(st.sampled_from(("a", "b", "c")))))
    assert pricer.admitted(children, first_slots=first) == \
        pricer.price(children, first_slots=first).admitted_bytes


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 30), data=st.data())
def test_radix_tree_rows_are_exact(seed, n, data):
    """Own rows below each request's deepest node plus the edges of the nodes on the paths
    of a subset = the subset's packed rows under full sharing."""
    step = token_step(seed, n)
    order = np.argsort(step.rank, kind="stable")
    parent, depth, leaf = prefix_tree(order, step.lcp_table[0, :n - 1].copy(), step.lengths)
    size = data.draw(st.integers(1, n))
    sub = np.asarray(data.draw(st.permutations(range(n)))[:size])
    nodes = set()
    own = 0
    for i in sub:
        v = leaf[i]
        own += step.lengths[i] - (depth[v] if v >= 0 else 0)
        while v >= 0:
            nodes.add(int(v))
            v = parent[v]
    edges = sum(depth[v] - (depth[parent[v]] if parent[v] >= 0 else 0) for v in nodes)
    assert own + edges == layout(step, sub).packed_rows


def _fits_with_pending(pricer, waves, budget: int) -> bool:
    """Whether some choice of carrier wave per gradient slot (a wave holding its gradient
    requests) lets every wave fit with the pending gradients it carries."""
    slot_of = [pricer.class_slot[k] if pricer.class_grad[k] else None for k in pricer.class_of]
    slots = sorted({s for s in slot_of if s is not None})
    options = [[w for w, wave in enumerate(waves) if any(slot_of[i] == s for i in wave)]
               for s in slots]
    for carriers in itertools.product(*options):
        first = [frozenset(s for s, c in zip(slots, carriers, strict=True) if c == w)
                 for w in range(len(waves))]
        if all(pricer.admitted([wave], first_slots=f) <= budget
               for wave, f in zip(waves, first, strict=True)):
            return True
    return False


def _brute_force_waves(pricer, n: int, budget: int) -> int:
    """Fewest flat waves of any plan within the budget, each gradient slot's pending
    gradients in some wave holding its gradient requests, by enumerating set partitions."""
    best = n + 1
    for labels in itertools.product(range(n), repeat=n):
        if any(labels[i] > max(labels[:i], default=-1) + 1 for i in range(n)):
            continue                               # canonical partitions only
        waves = [np.flatnonzero(np.asarray(labels) == w) for w in range(max(labels) + 1)]
        if len(waves) < best and _fits_with_pending(pricer, waves, budget):
            best = len(waves)
    return best


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(MODELS), kind=st.sampled_from(KINDS), seed=st.integers(0, 10**6),
       n=st.integers(1, 6), factor=st.floats(1.0, 3.0))
def test_valid_bound_never_exceeds_the_optimum(model, kind, seed, n, factor):
    """The bound the search reports is <= the fewest waves of any flat plan (brute force over
    partitions and carriers of the pending gradients)."""
    step = _step(kind, seed, n)
    pricer = WavePricer.build(step, model)
    n = len(step.requests)
    budget = int(factor * max(pricer.admitted([np.asarray([i])], first_slots=frozenset(
        {r.slot} if r.grad else ())) for i, r in enumerate(step.requests)))
    assert pricer.lower_bound_waves(budget) <= _brute_force_waves(pricer, n, budget)


@pytest.mark.parametrize("kind", KINDS)
def test_valid_bound_never_exceeds_a_feasible_plan(kind):
    """Every packer's plan is feasible under exact prices: the reported bound is below all."""
    for model in MODELS[:4]:
        for seed in range(3):
            step = _step(kind, seed, 48)
            pricer = WavePricer.build(step, model)
            worst = max(pricer.price([np.asarray([i])],
                                     first_slots=frozenset({r.slot} if r.grad else ()))
                        .admitted_bytes for i, r in enumerate(step.requests))
            budget = int(worst * 2.5)
            plans = {k: pack(step, pricer, budget_bytes=budget, packer=k, deterministic=True)
                     for k in (PackerKind.AUTO, PackerKind.FFD, PackerKind.KK,
                               PackerKind.UNIFORM_WIDTH)}
            bound = pricer.lower_bound_waves(budget)
            for res in plans.values():
                check_plan(step, pricer, res, budget_bytes=budget)
                assert bound <= len(res.waves)
            assert plans[PackerKind.AUTO].lower_bound_waves == bound
