"""The RoPE cache entries a step's earlier waves leave (pricing/rope_cache.py, the planner's
charge of them at PP1, check_plan's re-check). docs/memory-model.md#rope-cache-earlier-waves."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from waveplan.planner import Planner
from waveplan.pricing import rope_cache
from waveplan.pricing.errors import InfeasibleError
from waveplan.pricing.price import GroupLoad
from waveplan.pricing.step import Request, Step
from waveplan.search import check_plan

GIB = 2**30


def _load(padded: int, longest: int | None) -> GroupLoad:
    return GroupLoad(packed_rows=padded, padded_rows=padded, logical_rows=padded, segments=1,
                     longest_rows=longest)


def test_each_wave_holds_the_distinct_lengths_earlier_waves_brought():
    waves = [[_load(100, 60)], [_load(80, 80)], [_load(90, 60)], [_load(50, None), _load(90, 80)]]
    got = rope_cache.earlier_wave_entries(2.0, waves)
    # wave 2: 60; wave 3 shares 60 (its own entry is the cached one): 80 only;
    # wave 4 (an unknown longest: its padded 50) shares 80: 60
    assert got == [0.0, 2.0 * 60, 2.0 * 80, 2.0 * 60]


def test_the_cache_bounds_the_entries():
    n = rope_cache.CACHE_ENTRIES + 8
    waves = [[_load(10 * (i + 1), 10 * (i + 1))] for i in range(n)]
    got = rope_cache.earlier_wave_entries(1.0, waves)
    largest = sorted((10 * (i + 1) for i in range(n - 1)), reverse=True)[:rope_cache.CACHE_ENTRIES]
    assert got[-1] == float(sum(largest))
    assert max(got) <= rope_cache.reserve_bound(1.0, 10 * n)
    assert rope_cache.earlier_wave_entries(0.0, waves) == [0.0] * n


def _planner(**kw) -> Planner:
    return Planner.from_preset("qwen3-8b", **kw)


def _step(n: int = 24) -> Step:
    return Step.from_requests([Request(id=f"r{i}", num_tokens=1024 + 512 * (i % 7)) for i in range(n)])


def test_a_plan_charges_them_in_run_order_and_check_plan_re_checks_them():
    planner = _planner()
    step = _step()
    plan = planner.plan(step, 6 * GIB, deterministic=True)
    assert plan.num_waves >= 3
    terms = [w.breakdown.terms[rope_cache.TERM] for w in plan.waves]
    entry = 4 * 128                        # Qwen3-8B: fp32 x rotary dim 128, per row
    expected = rope_cache.earlier_wave_entries(entry, [w.loads for w in plan.waves])
    assert terms == [math.ceil(e) for e in expected]
    assert terms[0] == 0 and max(terms) > 0
    pricer = planner.pricer(step)
    check_plan(step, pricer, plan, budget_bytes=plan.budget_bytes)
    for w in plan.waves:
        alone = pricer.price(list(w.children), first_slots=w.first_slots)
        assert w.raw_bytes == alone.raw_bytes + w.breakdown.terms[rope_cache.TERM]
    # a plan whose charge is off fails the checker
    w = plan.waves[-1]
    bad = dict(w.breakdown.terms)
    bad[rope_cache.TERM] -= 1
    wrong = dataclasses.replace(w, wave=dataclasses.replace(
        w.wave, price=dataclasses.replace(w.breakdown, terms=bad)))
    tampered = dataclasses.replace(plan, waves=plan.waves[:-1] + (wrong,))
    with pytest.raises(AssertionError, match="RoPE cache"):
        check_plan(step, pricer, tampered, budget_bytes=plan.budget_bytes)


def test_no_charge_under_pp_or_for_one_wave():
    step = _step(4)
    one = _planner().plan(step, 80 * GIB, deterministic=True)
    assert one.num_waves == 1 and rope_cache.TERM not in one.waves[0].breakdown.terms
    assert float(_planner(pp=2).model.charges.walk.rope_entry) == 0.0


def test_same_inputs_same_plan_json():
    def doc() -> str:
        d = json.loads(_planner().plan(_step(), 6 * GIB, deterministic=True).to_json())
        d.pop("planning_ms")
        d.pop("compile_ms", None)
        return json.dumps(d, sort_keys=True)

    first = doc()
    assert rope_cache.TERM in first
    assert doc() == first


@pytest.mark.parametrize("safety", [None, 3.0])
def test_a_budget_the_reserve_leaves_no_room_for_is_refused_in_one_line(safety):
    # a budget that fits the largest request alone but not beside the other waves' entries
    # (at any safety factor: the reserve covers plus_earlier's rounding x safety)
    planner = _planner() if safety is None else _planner(safety=safety)
    step = Step.from_requests([Request(id=f"r{i}", num_tokens=30000 + 7 * i) for i in range(12)])
    pricer = planner.pricer(step)
    alone = max(pricer.price([np.asarray([i])], first_slots=frozenset({"default"})).admitted_bytes
                for i in range(len(step.requests)))
    # twelve distinct lengths: wave k holds k - 1 entries of 15 MB, and the requests' prices
    # differ by a few KB, so only the first wave has room
    with pytest.raises(InfeasibleError, match="RoPE cache") as exc:
        planner.plan(step, alone, deterministic=True)
    assert "\n" not in str(exc.value)
    # with the bound set aside, it plans
    reserve = rope_cache.reserve_bytes(4 * 128, pricer.group_loads([np.arange(len(step.requests))]),
                                       planner.model.safety)
    assert reserve >= planner.model.safety * rope_cache.reserve_bound(4 * 128, 30000 + 7 * 11)
    plan = planner.plan(step, alone + reserve, deterministic=True)
    check_plan(step, pricer, plan, budget_bytes=plan.budget_bytes)
