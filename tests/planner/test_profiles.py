"""Learning from observed peaks: profile pricing (docs/memory-model.md#learned-profiles), profile files."""

from __future__ import annotations

import json
import math

import pytest

from waveplan.planner import Planner
from waveplan.planner.profiles import (
    Observation,
    Profile,
    ProfileStore,
    Signature,
    Size,
    load_profiles,
)
from waveplan.pricing.errors import ConfigError
from waveplan.pricing.price import GroupLoad
from waveplan.pricing.step import Request, Step
from waveplan.search import check_plan

GIB = 2**30


def _load(packed, logical=None, padded=None, segments=1):
    logical = packed if logical is None else logical
    return GroupLoad(packed_rows=packed, padded_rows=packed if padded is None else padded,
                     logical_rows=logical, segments=segments)


def _profile(*observations: tuple[GroupLoad, int, int]) -> Profile:
    sig = Signature(config="{}", mix=(("default", True),))
    store = ProfileStore()
    for load, static, peak in observations:
        store.observe(sig, [load], static_raw_bytes=static, peak_bytes=peak)
    return store.get(sig)


@pytest.fixture(scope="module")
def planner_factory():
    def make(**kw):
        return Planner.from_preset("qwen3.6-35b-a3b", **kw)
    return make


def _single(n=7119):
    return Step.from_requests([Request(id="solo", num_tokens=n)])


def _shared(prompt=15_477, completion=104, n=7, prefix="p"):
    return Step.from_requests([Request(id=f"{prefix}{i}", num_tokens=prompt + completion, prompt=prefix,
                                       num_prompt_tokens=prompt) for i in range(n)])


# --- rules on a profile ---------------------------------------------------------------------


def test_tightening_inside_the_trust_window():
    p = _profile((_load(1000), 1000, 800))
    assert p.ratio == pytest.approx(0.8)
    raw, why = p.learned_raw(2000, Size.of([_load(2000)]))
    assert raw == 1600 and "tightened" in why


def test_raise_when_the_model_under_priced_applies_everywhere():
    p = _profile((_load(1000), 1000, 1300))
    # far outside any trust window, r > 1 still applies
    raw, why = p.learned_raw(10**9, Size.of([_load(10**6, logical=10**8)]))
    assert raw == math.ceil(10**9 * 1.3) and "raised" in why


def test_never_below_a_peak_seen_at_equal_or_smaller_size():
    p = _profile((_load(1000), 1000, 500), (_load(2000), 4000, 1000))   # r = 0.5
    # a wave at least as big as both, whose static price is low (e.g. split children)
    raw, why = p.learned_raw(1200, Size.of([_load(1000), _load(1000)]))
    assert raw == 1000 and "floored" in why
    # smaller in segments than the 2000-row observation: only the first floor applies
    raw, _ = p.learned_raw(1200, Size.of([_load(2000, segments=0)]))
    assert raw == 600


@pytest.mark.parametrize(("size", "tightened"), [
    (Size(packed_rows=8000, padded_rows=8000, logical_rows=64000, segments=9), True),     # 8x rows, 8x sharing
    (Size(packed_rows=8001, padded_rows=8001, logical_rows=8001, segments=1), False),     # rows beyond 8x
    (Size(packed_rows=1000, padded_rows=1000, logical_rows=8001, segments=9), False),     # sharing beyond 8x
])
def test_extrapolation_is_bounded_by_the_trust_window(size, tightened):
    p = _profile((_load(1000), 1000, 500))
    raw, why = p.learned_raw(100_000, size)
    assert (raw == 50_000) is tightened
    if not tightened:
        assert raw == 100_000 and "outside the trust window" in why


def test_dominated_observations_are_dropped_but_aggregates_kept():
    p = _profile((_load(1000), 1000, 500), (_load(500, padded=600), 400, 600), (_load(2000), 3000, 550))
    assert p.count == 3 and p.max_padded_rows == 2000
    assert p.ratio == pytest.approx(1.5)
    # the 2000-row peak (550) is dominated by the smaller 500-row peak (600)
    assert sorted(o.peak_bytes for o in p.observations) == [600]


# --- through the planner ---------------------------------------------------------------------


def test_observe_then_plan_prices_with_the_profile(planner_factory):
    planner = planner_factory()
    step = _single()
    plan = planner.plan(step, free_bytes=80 * GIB)
    wave = plan.waves[0]
    assert wave.breakdown.basis == "evidence" and wave.breakdown.terms["first_execution"] > 0
    planner.observe(wave, peak_bytes=[0.5 * wave.static_raw_bytes, 0.8 * wave.static_raw_bytes])
    again = planner.plan(step, free_bytes=80 * GIB)
    b = again.waves[0].breakdown
    assert b.basis == "profile"
    assert b.terms["first_execution"] == 0     # a profiled signature is warm
    assert b.raw_bytes == math.ceil(0.8 * wave.static_raw_bytes)
    assert b.terms["profile"] == b.raw_bytes - wave.static_raw_bytes < 0
    assert b.admitted_bytes == math.ceil(b.raw_bytes * planner.model.safety)
    assert again.to_dict()["waves"][0]["basis"] == "profile"


def test_raised_profile_replans_within_budget(planner_factory):
    planner = planner_factory()
    step = _shared(prompt=2000, completion=3000, n=16)
    plan = planner.plan(step, free_bytes=30 * GIB)
    for wave in plan.waves:
        planner.observe(wave, peak_bytes=1.4 * wave.static_raw_bytes)
    again = planner.plan(step, free_bytes=30 * GIB)
    assert again.num_waves >= plan.num_waves
    for wave in again.waves:
        assert wave.breakdown.basis == "profile"
        assert wave.raw_bytes >= math.ceil(1.4 * wave.static_raw_bytes)
        assert wave.admitted_bytes <= 30 * GIB
    pricer = planner.pricer(step)
    check_plan(step, pricer, again, budget_bytes=again.budget_bytes)


def test_seed_002_single_request_profile_does_not_price_shared_batch_by_logical_tokens(planner_factory):
    """docs/memory-model.md#learned-profiles: after a single-request step (sharing 1.0), the first shared
    batch (16,205 packed / 109,065 logical tokens) was priced by its logical tokens: 56.3 GiB
    predicted against 6.9 GiB observed."""
    planner = planner_factory()
    calib = planner.plan(_single(), free_bytes=120 * GIB).waves[0]
    peak = int(0.9 * calib.static_raw_bytes)
    planner.observe(calib, peak_bytes=peak)

    batch = _shared()
    plan = planner.plan(batch, free_bytes=120 * GIB)
    assert plan.num_waves == 1
    wave = plan.waves[0]
    size = wave.size
    assert size.packed_rows == 16_205 and size.logical_rows == 109_067
    # the old rule: bytes per token of the profile x max(packed, logical / its sharing ratio)
    calib_size = calib.size
    profile_ratio = calib_size.logical_rows / calib_size.packed_rows           # 1.0
    old = peak / calib_size.packed_rows * max(size.packed_rows, size.logical_rows / profile_ratio)
    ours = wave.raw_bytes
    assert old > 5 * ours                       # old: ~15x the profile's density, by logical tokens
    r = peak / calib.static_raw_bytes
    assert ours == math.ceil(wave.static_raw_bytes * r)   # ours: static (packed-token) x r
    assert wave.breakdown.basis == "profile"
    # and ours still grows with packed rows: doubling the prompt raises the price
    bigger = planner.plan(_shared(prompt=2 * 15_477, prefix="q"), free_bytes=120 * GIB).waves[0]
    assert bigger.raw_bytes > ours


# --- files ----------------------------------------------------------------------------------


def test_profiles_round_trip(tmp_path, planner_factory):
    planner = planner_factory()
    wave = planner.plan(_single(), free_bytes=80 * GIB).waves[0]
    planner.observe(wave, peak_bytes=0.7 * wave.static_raw_bytes)
    path = planner.save_profiles(tmp_path / "p.json")
    data = json.loads(path.read_text())
    assert data["schema"] == 1 and len(data["profiles"]) == 1
    reloaded = planner_factory(profiles_path=path)
    b1 = planner.plan(_single(), free_bytes=80 * GIB).waves[0].breakdown
    b2 = reloaded.plan(_single(), free_bytes=80 * GIB).waves[0].breakdown
    assert b1 == b2 and b2.basis == "profile"
    assert load_profiles(path).to_dict() == data


@pytest.mark.parametrize("content", [
    '{"schema": 1, "profiles": [', "", "[]", '{"schema": 2, "profiles": []}',
    '{"schema": 1, "profiles": [{"signature": {"config": {}, "mix": []}, "observations": []}]}',
])
def test_bad_profile_file_is_a_clear_error(tmp_path, content):
    path = tmp_path / "prof.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match="prof.json"):
        load_profiles(path)
    assert path.read_text() == content   # nothing overwritten


def test_planner_sets_a_corrupt_profile_file_aside(tmp_path, planner_factory):
    path = tmp_path / "prof.json"
    path.write_text('{"schema": 1, "profi')
    (tmp_path / "prof.json.corrupt").write_text("older evidence")
    with pytest.warns(RuntimeWarning, match="prof.json"):
        planner = planner_factory(profiles_path=path)
    assert len(planner.profiles) == 0 and not path.exists()
    assert (tmp_path / "prof.json.corrupt").read_text() == "older evidence"
    assert (tmp_path / "prof.json.corrupt.1").read_text() == '{"schema": 1, "profi'
    plan = planner.plan(_single(), free_bytes=80 * GIB)
    assert plan.waves[0].breakdown.basis == "evidence"


def test_inconsistent_aggregates_are_refused(tmp_path):
    obs = Observation(loads=(_load(1000),), static_raw_bytes=1000, peak_bytes=900)
    sig = Signature(config="{}", mix=(("default", True),))
    data = ProfileStore([Profile.first(sig, obs)]).to_dict()
    data["profiles"][0]["ratio"] = 0.5
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="aggregates"):
        load_profiles(path)


def test_a_load_keeps_its_longest_sequence_through_a_profile_file(tmp_path):
    """`longest_rows` is written when known and read back; a file without it (written before it)
    loads with it unknown, priced at the bound (docs/memory-model.md#cp-rope-cache)."""
    sig = Signature(config="{}", mix=(("default", True),))
    known = GroupLoad(packed_rows=1000, padded_rows=1008, logical_rows=1200, segments=3, longest_rows=512)
    data = ProfileStore([Profile.first(sig, Observation(loads=(known,), static_raw_bytes=1000,
                                                         peak_bytes=900))]).to_dict()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    assert load_profiles(path).to_dict() == data
    (load,) = data["profiles"][0]["observations"][0]["loads"]
    assert load["longest_rows"] == 512
    del load["longest_rows"]
    path.write_text(json.dumps(data))
    assert load_profiles(path).to_dict() == data
    load["longest_rows"] = 2000   # beyond its padded rows: one line naming the field
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="longest_rows"):
        load_profiles(path)
