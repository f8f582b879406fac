"""Every packer through the one invariant checker, on hypothesis-generated steps and budgets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from search_fakes import grpo_step, make_step, pricers
from waveplan.pricing.errors import InfeasibleError
from waveplan.search import PackerKind, check_plan, pack
from waveplan.search.ladder import split_children

PRICERS = pricers()
FAST = [PackerKind.AUTO, PackerKind.GREEDY, PackerKind.UNIFORM_WIDTH, PackerKind.FFD,
        PackerKind.KK]


@st.composite
def steps(draw, max_groups=6, max_members=6):
    ngroups = draw(st.integers(1, max_groups))
    groups, slots, grads = [], [], []
    for _ in range(ngroups):
        pre = draw(st.integers(0, 3000))
        members = draw(st.lists(st.integers(1, 6000), min_size=1, max_size=max_members))
        groups.append((pre, members))
        slots.append(draw(st.sampled_from(["a", "b", "c"])))
        grads.append(draw(st.booleans()))
    return make_step(groups, slots=slots, grads=grads)


def feasible_budget(step, pricer, factor: float) -> int:
    """A budget at which every request fits alone, pending gradients included."""
    worst = 0
    for i, r in enumerate(step.requests):
        fs = frozenset({r.slot}) if r.grad else frozenset()
        worst = max(worst, pricer.price([np.asarray([i])], first_slots=fs).admitted_bytes)
    return int(worst * factor)


@st.composite
def units_for(draw, n):
    perm = draw(st.permutations(range(n)))
    units, i = [], 0
    while i < n and len(units) < 3:
        k = draw(st.integers(1, 3))
        if draw(st.booleans()):
            units.append(sorted(perm[i:i + k]))
        i += k
    return units


def _run_checked(step, pricer, kind, budget, units=(), num_waves=None, **kw):
    try:
        res = pack(step, pricer, budget_bytes=budget, packer=kind, atomic_units=units,
                   num_waves=num_waves, **kw)
    except InfeasibleError as exc:
        # only a unit whose last rung (one request per child) does not fit may be refused,
        # or an exact count the search could not meet
        msg = str(exc)
        if num_waves is not None and "num_waves" in msg:
            return None
        assert "atomic unit" in msg, msg
        def last_rung(u):
            fs = frozenset(step.requests[i].slot for i in u if step.requests[i].grad)
            return pricer.price([np.asarray([i]) for i in sorted(u)], first_slots=fs)

        assert any(last_rung(u).admitted_bytes > budget for u in units if len(u) > 1), msg
        return None
    check_plan(step, pricer, res, budget_bytes=budget, atomic_units=units, num_waves=num_waves)
    assert res.packer == PackerKind(kind).value
    return res


@pytest.mark.parametrize("pname,make", PRICERS, ids=[p[0] for p in PRICERS])
@pytest.mark.parametrize("kind", FAST, ids=[k.value for k in FAST])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=steps(), factor=st.floats(1.0, 6.0), data=st.data())
def test_every_packer_keeps_invariants(pname, make, kind, step, factor, data):
    step, pricer = make(step)
    budget = feasible_budget(step, pricer, factor)
    units = data.draw(units_for(len(step.requests)))
    _run_checked(step, pricer, kind, budget, units)


@pytest.mark.parametrize("pname,make", PRICERS, ids=[p[0] for p in PRICERS])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=steps(max_groups=3, max_members=4), factor=st.floats(1.0, 4.0))
def test_exact_packer_keeps_invariants(pname, make, step, factor):
    step, pricer = make(step)
    budget = feasible_budget(step, pricer, factor)
    res = _run_checked(step, pricer, PackerKind.EXACT, budget, time_budget_ms=20.0)
    auto = _run_checked(step, pricer, PackerKind.GREEDY, budget)
    assert len(res.waves) <= len(auto.waves)


@pytest.mark.parametrize("pname,make", PRICERS, ids=[p[0] for p in PRICERS])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=steps(), factor=st.floats(1.0, 6.0), data=st.data())
def test_exact_wave_count(pname, make, step, factor, data):
    step, pricer = make(step)
    budget = feasible_budget(step, pricer, factor)
    base = pack(step, pricer, budget_bytes=budget)
    n = len(step.requests)
    lo = base.lower_bound_waves
    if lo > n:
        return
    N = data.draw(st.integers(max(lo, 1), n))
    for kind in (PackerKind.AUTO, PackerKind.GREEDY):
        _run_checked(step, pricer, kind, budget, num_waves=N)


@pytest.mark.parametrize("pname,make", PRICERS, ids=[p[0] for p in PRICERS])
@pytest.mark.parametrize("n", [32, 128])
def test_grpo_steps_all_packers(pname, make, n):
    for seed in range(3):
        step = grpo_step(seed, n)
        step, pricer = make(step)
        budget = feasible_budget(step, pricer, 2.5)
        counts = {}
        for kind in FAST:
            res = _run_checked(step, pricer, kind, budget)
            counts[kind] = len(res.waves)
        assert counts[PackerKind.AUTO] <= min(counts.values())


@settings(max_examples=40, deadline=None)
@given(step=steps(), data=st.data())
def test_envelope_covers_flat_price(step, data):
    """Every pricer keeps the envelope guarantee: max_p envelope >= flat price."""
    from waveplan.search.items import build_items
    for _, make in PRICERS:
        st2, pricer = make(step)
        n = len(st2.requests)
        idx = np.asarray(sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1))))
        items = build_items(st2, pricer, 1e15)
        env = float(np.max(items.budget - items.cap + items.load_of(idx) * items.cap))
        assert pricer.price([idx]).admitted_bytes <= np.ceil(env * (1 + 1e-12))


@given(step=steps(), k=st.integers(1, 5))
@settings(max_examples=30, deadline=None)
def test_split_children_partition(step, k):
    idx = np.arange(len(step.requests))
    k = min(k, len(idx))
    children = split_children(step, idx, k)
    assert len(children) == k
    assert all(len(c) > 0 for c in children)
    assert np.array_equal(np.sort(np.concatenate(children)), idx)
