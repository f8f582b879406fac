"""The boundary between the search and pricing: the pricer contract and its capabilities, the
search options, and the one wave type from the search to the plan."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from search_fakes import FakePricer, LinearPricer, grpo_step, real_pricer, singles_step

from waveplan.planner import Planner, Request, Step
from waveplan.pricing.errors import ConfigError, InfeasibleError, StepError
from waveplan.search import (
    DEFAULT_PACKER,
    AdmittedPricer,
    BoundedPricer,
    LoadsPricer,
    PackerKind,
    PendingPricer,
    Pricer,
    SearchEnvelope,
    SearchOptions,
    SearchPricer,
    SearchStep,
    StagedPricer,
    check_plan,
    pack,
)

GIB = 2**30
CAPABILITIES = (AdmittedPricer, PendingPricer, BoundedPricer, LoadsPricer, StagedPricer)


# --- the pricer contract ---------------------------------------------------------------------


@pytest.mark.parametrize("make", [FakePricer, LinearPricer], ids=["fake", "linear"])
def test_the_fakes_meet_the_required_contract_and_offer_no_capability(make):
    step = grpo_step(0, 12)
    pricer = make(step)
    assert isinstance(step, SearchStep)
    assert isinstance(pricer, Pricer)
    assert isinstance(pricer.envelope(), SearchEnvelope)
    assert not any(isinstance(pricer, cap) for cap in CAPABILITIES)
    seen = SearchPricer.of(pricer)
    assert (seen.fast, seen.pending, seen.bounded, seen.loads, seen.staged) == (None,) * 5
    assert seen.stages() is None
    assert isinstance(seen, Pricer) and SearchPricer.of(seen) is seen


def test_the_wave_pricer_offers_every_capability():
    step, pricer = real_pricer(grpo_step(1, 12))
    assert isinstance(step, SearchStep) and isinstance(pricer, Pricer)
    assert all(isinstance(pricer, cap) for cap in CAPABILITIES)
    seen = SearchPricer.of(pricer)
    assert seen.fast is seen.pending is seen.bounded is seen.loads is seen.staged is pricer
    assert seen.stages() is None   # PP1: no stages for the pipeline search
    full = seen.full_prices_only()
    assert full.fast is None and full.pending is full.bounded is full.loads is pricer


def test_price_loads_is_the_price_in_two_steps():
    step, pricer = real_pricer(grpo_step(2, 20))
    children = [np.arange(0, 7), np.arange(7, 13)]
    for first in (frozenset(), frozenset(pricer.class_slot)):
        loads = pricer.group_loads(children)
        assert pricer.price_loads(loads, first_slots=first) == pricer.price(children,
                                                                             first_slots=first)


def _shared_step(n: int = 12) -> Step:
    return Step.from_requests([Request(id=f"r{i}", num_tokens=3000 + 100 * i, prompt="p",
                                       num_prompt_tokens=1000) for i in range(n)])


def test_the_planner_offers_the_fast_path_only_without_profiles():
    planner = Planner.from_preset("qwen3-8b")
    step = _shared_step()
    assert isinstance(planner.pricer(step), AdmittedPricer)
    plan = planner.plan(step, free_bytes=30 * GIB)
    for wave in plan.waves:
        planner.observe(wave, peak_bytes=1.2 * wave.static_raw_bytes)
    profiled = planner.pricer(step)
    view = Planner._search_view(profiled)   # what the search is handed: no fast path
    assert isinstance(profiled, Pricer) and view.fast is None
    assert all(isinstance(profiled, cap) for cap in CAPABILITIES[1:])
    assert all(getattr(view, c) is not None for c in ("pending", "bounded", "loads", "earlier", "staged"))
    again = planner.plan(step, free_bytes=30 * GIB)
    assert all(w.breakdown.basis == "profile" for w in again.waves)
    check_plan(step, profiled, again, budget_bytes=30 * GIB)


# --- the search options ------------------------------------------------------------------------


def test_options_have_their_defaults_once_and_normalise():
    o = SearchOptions()
    assert (o.packer, o.time_budget_ms, o.atomic_units, o.num_waves, o.seed,
            o.deterministic) == (DEFAULT_PACKER, None, (), None, 0, False)
    o = SearchOptions(packer="exact", time_budget_ms=20, atomic_units=[[0, 1], np.arange(2, 4)],
                      num_waves=np.int64(3), seed=np.int64(7), deterministic=np.bool_(True))
    assert o.packer is PackerKind.EXACT and type(o.time_budget_ms) is float
    assert o.atomic_units == ((0, 1), (2, 3)) and type(o.num_waves) is int
    assert type(o.seed) is int and o.deterministic is True


@pytest.mark.parametrize(("field", "value", "error"), [
    ("packer", "nope", ConfigError), ("time_budget_ms", 0, ConfigError),
    ("time_budget_ms", -1.0, ConfigError), ("time_budget_ms", float("nan"), ConfigError),
    ("time_budget_ms", float("inf"), ConfigError), ("time_budget_ms", True, ConfigError),
    ("time_budget_ms", "5", ConfigError), ("num_waves", 0, ConfigError),
    ("num_waves", True, ConfigError), ("num_waves", 2.0, ConfigError),
    ("seed", "1", ConfigError), ("seed", 1.5, ConfigError), ("deterministic", 1, ConfigError),
    ("atomic_units", 3, StepError), ("atomic_units", [[0], 1], StepError)])
def test_bad_options_are_refused_naming_the_field(field, value, error):
    with pytest.raises(error, match=f"^{field}="):
        SearchOptions(**{field: value})


@pytest.mark.parametrize("kind", ["uniform-width", "ffd", "kk"])
def test_num_waves_with_a_baseline_is_refused(kind):
    with pytest.raises(ConfigError, match="num_waves=2: not supported by the"):
        SearchOptions(packer=kind, num_waves=2)


def test_pack_takes_options_or_keywords_not_both():
    step = grpo_step(3, 24)
    pricer = FakePricer(step)
    budget = 10 * GIB
    kw = dict(packer="greedy", time_budget_ms=3.0, seed=4, deterministic=True)
    by_keywords = pack(step, pricer, budget_bytes=budget, **kw)
    by_options = pack(step, pricer, budget_bytes=budget, options=SearchOptions(**kw))
    assert [w.requests.tolist() for w in by_keywords.waves] == \
        [w.requests.tolist() for w in by_options.waves]
    assert by_options.packer == "greedy"
    with pytest.raises(ConfigError, match="^options="):
        pack(step, pricer, budget_bytes=budget, options=SearchOptions(**kw), seed=5)
    with pytest.raises(InfeasibleError, match="num_waves=4: more waves"):
        pack(singles_step([1, 2, 3]), LinearPricer(singles_step([1, 2, 3])), budget_bytes=100,
             options=SearchOptions(num_waves=4))


# --- one wave type ---------------------------------------------------------------------------


def test_packed_waves_carry_the_loads_their_price_was_computed_from():
    step, pricer = real_pricer(grpo_step(4, 40))
    budget = 3 * max(pricer.admitted([np.asarray([i])]) for i in range(len(step.requests)))
    res = pack(step, pricer, budget_bytes=budget, deterministic=True)
    for w in res.waves:
        assert w.loads == tuple(pricer.group_loads(list(w.children)))
    check_plan(step, pricer, res, budget_bytes=budget)
    fake = FakePricer(grpo_step(4, 40))
    assert all(w.loads is None for w in pack(fake.step, fake, budget_bytes=budget).waves)


def test_a_plan_wave_wraps_its_packed_wave():
    planner = Planner.from_preset("qwen3-8b")
    step = _shared_step(16)
    plan = planner.plan(step, free_bytes=24 * GIB)
    assert plan.num_waves > 1
    for i, w in enumerate(plan.waves):
        assert w.index == i
        assert w.children is w.wave.children and w.first_slots is w.wave.first_slots
        assert w.breakdown is w.wave.price is w.price and w.loads is w.wave.loads
        assert w.request_ids == tuple(step.ids[j] for j in w.wave.requests)
        assert w.size.packed_rows == sum(g.packed_rows for g in w.loads)
    check_plan(step, planner.pricer(step), plan, budget_bytes=24 * GIB)
    w0 = plan.waves[0]   # carrying one group load too few
    broken = replace(plan, waves=(replace(w0, wave=replace(w0.wave, loads=w0.loads[:-1])),
                                  *plan.waves[1:]))
    with pytest.raises(AssertionError, match="group loads"):
        check_plan(step, planner.pricer(step), broken, budget_bytes=24 * GIB)
