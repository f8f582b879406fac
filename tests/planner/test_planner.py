"""The per-step API: Planner, Plan and their JSON form."""

from __future__ import annotations

import json
import math

import pytest

from waveplan.planner import Planner, Request, Step, load_step
from waveplan.pricing.errors import ConfigError
from waveplan.pricing.parallel import ParallelLayout
from waveplan.pricing.presets import load_preset
from waveplan.pricing.step import bundled_step
from waveplan.search import check_plan

GIB = 2**30
WAVE_KEYS = {"index", "requests", "packed_tokens", "logical_tokens", "segments", "raw_bytes",
             "admitted_bytes", "budget_bytes", "binding", "basis", "first_slots", "terms", "children",
             "request_indices", "child_indices"}


@pytest.fixture(scope="module")
def planner():
    return Planner.from_preset("qwen3.8-27b", tp=4, sequence_parallel=True, recompute="full", lora_rank=16)


@pytest.fixture(scope="module")
def step():
    return load_step(bundled_step("grpo-8x8"))


def test_plan_grpo_8x8_is_valid_and_proven(planner, step):
    plan = planner.plan(step, free_bytes=40 * GIB)
    check_plan(step, planner.pricer(step), plan, budget_bytes=40 * GIB)
    assert plan.proven_optimal and plan.num_waves == plan.lower_bound_waves
    assert sorted(i for w in plan.waves for i in w.request_ids) == sorted(step.ids)
    assert sum(1 for w in plan.waves if w.first_slots) == 1


def test_plan_dict_has_exactly_the_documented_fields(planner, step):
    d = planner.plan(step, free_bytes=40 * GIB).to_dict()
    assert set(d) - {"compile_ms"} == {"schema", "packer", "planning_ms", "lower_bound_waves", "proven_optimal", "waves"}
    assert d["schema"] == 1 and d["packer"] == "auto"
    for i, w in enumerate(d["waves"]):
        assert set(w) == WAVE_KEYS
        assert w["index"] == i and w["children"] == []
        assert w["budget_bytes"] == 40 * GIB
        assert w["admitted_bytes"] == math.ceil(w["raw_bytes"] * 1.10)
        assert w["packed_tokens"] <= w["logical_tokens"]
        assert all(isinstance(v, int) for v in w["terms"].values())


def test_same_inputs_give_byte_identical_json(step):
    a = Planner.from_preset("qwen3.8-27b", tp=4, sequence_parallel=True).plan(step, free_bytes=30 * GIB)
    b = Planner.from_preset("qwen3.8-27b", tp=4, sequence_parallel=True).plan(step, free_bytes=30 * GIB)

    def strip(plan):
        d = json.loads(plan.to_json())
        d.pop("planning_ms")
        d.pop("compile_ms", None)
        return json.dumps(d, sort_keys=True, indent=1)

    assert strip(a) == strip(b)
    text = a.to_json()
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=1)   # sorted, stable


def test_budget_is_the_minimum_over_ranks(planner, step):
    plan = planner.plan(step, free_bytes=[80 * GIB, 30 * GIB, 50 * GIB, 31 * GIB])
    assert plan.budget_bytes == 30 * GIB
    assert all(w.admitted_bytes <= 30 * GIB for w in plan.waves)
    assert plan.num_waves >= planner.plan(step, free_bytes=80 * GIB).num_waves


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), 2.0**51, True, "40", [],
                                 [40 * GIB, 0], [40 * GIB, float("nan")]])
def test_bad_budgets_name_free_bytes_and_the_value(planner, step, bad):
    with pytest.raises(ConfigError, match=r"free_bytes(\[\d\])?=") as info:
        planner.plan(step, free_bytes=bad)
    assert "free_bytes" in str(info.value)


def test_split_children_and_atomic_units(planner, step):
    unit = list(range(8))
    plan = planner.plan(step, free_bytes=12 * GIB, atomic_units=[unit])
    check_plan(step, planner.pricer(step), plan, budget_bytes=12 * GIB, atomic_units=[unit])
    holder = next(w for w in plan.waves if "g0-c0" in w.request_ids)
    assert set(holder.request_ids) == {f"g0-c{i}" for i in range(8)}
    d = plan.to_dict()["waves"][holder.index]
    assert holder.is_split   # the unit does not fit 12 GiB flat: split children
    assert len(d["children"]) == len(holder.children) > 1
    assert sorted(i for c in d["children"] for i in c) == sorted(d["requests"])


def test_num_waves_is_honoured(planner, step):
    plan = planner.plan(step, free_bytes=40 * GIB, num_waves=4)
    assert plan.num_waves == 4
    check_plan(step, planner.pricer(step), plan, budget_bytes=40 * GIB, num_waves=4)


def test_step_forms_and_keyword_only_constructor(tmp_path):
    geometry = load_preset("qwen3-8b")
    with pytest.raises(TypeError):
        Planner(geometry)  # type: ignore[misc]
    planner = Planner(geometry=geometry, parallel=ParallelLayout(), recompute="full")
    requests = [Request(id=f"r{i}", num_tokens=1000 + i) for i in range(4)]
    a = planner.plan(requests, free_bytes=40 * GIB)
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "completion_tokens": 1000 + i}) + "\n" for i in range(4)))
    b = planner.plan(str(path), free_bytes=40 * GIB)
    c = planner.plan(Step.from_requests(requests), free_bytes=40 * GIB)
    assert a.to_dict()["waves"] == b.to_dict()["waves"] == c.to_dict()["waves"]


@pytest.mark.parametrize("peak", [0, -5, float("nan"), [], "1"])
def test_observe_validates_peaks(planner, step, peak):
    wave = planner.plan(step, free_bytes=40 * GIB).waves[0]
    with pytest.raises(ConfigError, match="peak_bytes"):
        planner.observe(wave, peak_bytes=peak)


def test_observe_refuses_a_wave_of_another_configuration(step):
    a = Planner.from_preset("qwen3.8-27b", tp=4, sequence_parallel=True)
    b = Planner.from_preset("qwen3.8-27b", tp=4, sequence_parallel=True, lora_rank=8)
    wave = a.plan(step, free_bytes=40 * GIB).waves[0]
    with pytest.raises(ConfigError, match="another model configuration"):
        b.observe(wave, peak_bytes=10 * GIB)
    with pytest.raises(ConfigError, match="wave"):
        b.observe("wave 0", peak_bytes=10 * GIB)  # type: ignore[arg-type]


def test_save_profiles_needs_a_path(planner):
    with pytest.raises(ConfigError, match="profiles_path"):
        planner.save_profiles()
