"""The data-parallel group plan (`planner.group.plan_group`), the wave time model
(`pricing.time_model`) and `waveplan plan --dp`:

* veRL's balance (`dp_balance.karmarkar_karp`) gives verl 0.9.1's own partitions;
* every rank runs the same number of waves, every request runs once, every rank's plan passes
  `check_plan` against its share and its own budget; the same inputs give the same plan;
* the group never needs more waves than veRL's balance (by sequence, by whole prompt group,
  computed here with veRL's own functions) followed by each share planned, MAX count;
* the time model counts rows and causal pairs as written out by hand, and `observe(wave,
  seconds=...)` rescales it;
* `waveplan plan --dp N --json` gives N plans; bad `--dp` is one line, exit 2.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from waveplan.planner import Planner
from waveplan.planner.cli import main
from waveplan.planner.dp_balance import karmarkar_karp, verl_workload
from waveplan.planner.group import plan_group
from waveplan.pricing.errors import ConfigError
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.step import Request, Step
from waveplan.pricing.time_model import WaveTimeModel, linear_params_per_row, wave_work
from waveplan.search import check_plan

GIB = 2**30


@pytest.fixture(scope="module")
def planner():
    return Planner.from_preset("qwen3-8b", tp=1, recompute="full", lora_rank=16)


def grpo(prompts, per, seed, *, tail=0.9):
    rng = np.random.default_rng(seed)
    p = rng.integers(200, 1500, prompts)
    reqs = []
    for g in range(prompts):
        c = np.clip(np.rint(900 * np.exp(tail * rng.standard_normal(per))), 32, 12_000).astype(int)
        reqs += [Request(id=f"g{g}-{k}", prompt=f"g{g}", num_prompt_tokens=int(p[g]),
                         num_tokens=int(p[g] + c[k])) for k in range(per)]
    return Step.from_requests(reqs)


def strip_timings(d):
    if isinstance(d, dict):
        return {k: strip_timings(v) for k, v in d.items() if k not in ("planning_ms", "compile_ms")}
    if isinstance(d, list):
        return [strip_timings(v) for v in d]
    return d


def check_group(planner, step, group, budgets):
    """Equal wave counts, every request once, each rank's plan valid for its share and budget."""
    counts = {p.num_waves for p in group.ranks}
    assert len(counts) == 1
    seen = np.concatenate([np.asarray(s) for s in group.shares])
    assert sorted(seen.tolist()) == list(range(step.num_requests))
    for r, (plan, share) in enumerate(zip(group.ranks, group.shares, strict=True)):
        share = np.asarray(share)
        ran = np.sort(np.concatenate([np.asarray(w.request_indices) for w in plan.waves]))
        assert np.array_equal(ran, share)
        ids = {step.ids[i] for i in share}
        assert {i for w in plan.waves for i in w.request_ids} == ids
        sub = Step.from_requests([step.requests[i] for i in share])
        local = [type(w)(**{**w.__dict__, "wave": type(w.wave)(
            children=tuple(np.searchsorted(share, c) for c in w.wave.children),
            first_slots=w.wave.first_slots, price=w.wave.price, loads=w.wave.loads)})
            for w in plan.waves]
        check_plan(sub, planner.pricer(sub), type(plan)(**{**plan.__dict__, "waves": tuple(local)}),
                   budget_bytes=budgets[r])


# --- veRL's balance ---------------------------------------------------------------------------


def test_karmarkar_karp_is_verls():
    torch = pytest.importorskip("torch")
    pytest.importorskip("verl")
    from verl.utils import seqlen_balancing as vsb

    rng = np.random.default_rng(3)
    for trial in range(30):
        k = int(rng.integers(2, 9))
        n = k * int(rng.integers(1, 12))
        lengths = rng.integers(16, 9000, n)
        if trial % 3 == 0:
            lengths[: n // 2] = lengths[0]   # ties
        work = vsb.calculate_workload(torch.tensor(lengths)).tolist()
        assert work == [verl_workload(x) for x in lengths]
        for equal in (True, False):
            assert karmarkar_karp(work, k, equal_size=equal) == \
                vsb.get_seqlen_balanced_partitions(work, k, equal_size=equal)


# --- the group plan ---------------------------------------------------------------------------


def test_group_plan_invariants_and_determinism(planner):
    step = grpo(12, 4, seed=1)
    budgets = (14 * GIB, 12 * GIB, 14 * GIB)
    group = plan_group(planner, step, 3, list(budgets))
    check_group(planner, step, group, budgets)
    assert group.num_waves <= min(b["waves"] for b in group.baselines.values())
    assert group.lower_bound_waves <= group.num_waves
    assert group.proven_optimal == (group.num_waves == group.lower_bound_waves)
    assert group.keep_groups
    for share in group.shares:   # prompt groups whole
        keys = {step.requests[i].prompt for i in share}
        assert all(sum(r.prompt == k for r in step.requests) ==
                   sum(step.requests[i].prompt == k for i in share) for k in keys)
    again = plan_group(Planner.from_preset("qwen3-8b", tp=1, recompute="full", lora_rank=16),
                       step, 3, list(budgets))
    assert json.dumps(strip_timings(again.to_dict()), sort_keys=True) == \
        json.dumps(strip_timings(group.to_dict()), sort_keys=True)
    assert group.step_seconds == max(group.rank_seconds) > 0


def test_token_form_and_sequence_units(planner):
    rng = np.random.default_rng(9)
    prompts = [rng.integers(1, 1000, int(rng.integers(200, 900))) for _ in range(4)]
    seqs = [np.concatenate([p, rng.integers(1, 1000, int(rng.integers(50, 4000)))])
            for p in prompts for _ in range(3)]
    step = Step.from_token_ids(seqs)
    budget = alone_budget(planner, step, 1.3)
    for keep in (True, False):
        group = plan_group(planner, step, 2, budget, keep_groups=keep)
        check_group(planner, step, group, (budget, budget))
        assert group.keep_groups == keep


def test_equal_counts_and_bad_input(planner):
    step = grpo(8, 4, seed=2)
    group = plan_group(planner, step, 4, 16 * GIB, equal_counts=True)
    check_group(planner, step, group, (16 * GIB,) * 4)
    assert {len(s) for s in group.shares} == {8}
    fast = plan_group(planner, step, 4, [16 * GIB, 12 * GIB] * 2, objective="time")
    check_group(planner, step, fast, (16 * GIB, 12 * GIB) * 2)
    assert fast.step_seconds <= min(b["seconds"] for b in fast.baselines.values())
    with pytest.raises(ConfigError, match="objective"):
        plan_group(planner, step, 2, 16 * GIB, objective="speed")
    with pytest.raises(ConfigError, match="dp=0"):
        plan_group(planner, step, 0, 16 * GIB)
    with pytest.raises(ConfigError, match="equal counts"):
        plan_group(planner, step, 3, 16 * GIB, equal_counts=True)
    with pytest.raises(ConfigError, match="fewer units than ranks"):
        plan_group(planner, step, 40, 16 * GIB)
    with pytest.raises(ConfigError, match="free_bytes"):
        plan_group(planner, step, 2, [16 * GIB])


def verl_baseline(planner, step, dp, budgets, *, by_group):
    """veRL's balance computed with veRL's own functions, each share planned, MAX count."""
    torch = pytest.importorskip("torch")
    from verl.utils import seqlen_balancing as vsb

    lengths = step.lengths.tolist()
    if by_group:
        uid = [r.prompt or r.id for r in step.requests]
        parts = vsb.get_group_balanced_partitions(lengths, uid, dp)
    else:
        work = vsb.calculate_workload(torch.tensor(lengths)).tolist()
        parts = vsb.get_seqlen_balanced_partitions(work, dp, equal_size=True)
    waves = [planner.plan(Step.from_requests([step.requests[i] for i in p]), b,
                          deterministic=True).num_waves for p, b in zip(parts, budgets, strict=True)]
    return max(waves), min(len(p) for p in parts)


def alone_budget(planner, step, factor):
    """`factor` x the largest price of one request alone with its slot's adapter gradients."""
    pricer = planner.pricer(step)
    worst = max(pricer.price([np.array([i])], first_slots=frozenset({"default"})).admitted_bytes
                for i in range(step.num_requests))
    return int(worst * factor)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(dp=st.sampled_from([2, 4]), per=st.sampled_from([2, 4]), groups=st.integers(1, 3),
       seed=st.integers(0, 10_000), factor=st.sampled_from([1.05, 1.6, 2.5]), uneven=st.booleans())
def test_never_more_waves_than_balance_then_plan(planner, dp, per, groups, seed, factor, uneven):
    pytest.importorskip("verl")
    step = grpo(groups * dp, per, seed, tail=1.2)
    budget = alone_budget(planner, step, factor)
    # uneven: the odd ranks have 0.7x the room (still > 1.05x any request alone)
    budgets = [budget if r % 2 == 0 or not uneven or factor < 1.6 else int(budget * 0.7)
               for r in range(dp)]
    group = plan_group(planner, step, dp, budgets, rounds=8)
    check_group(planner, step, group, budgets)
    for by_group in (False, True):
        waves, fewest = verl_baseline(planner, step, dp, budgets, by_group=by_group)
        if waves <= fewest:   # the baseline can run that count on every rank
            assert group.num_waves <= waves


# --- the time model ---------------------------------------------------------------------------


def test_wave_work_counts_prefix_trees_by_hand():
    step = Step.from_requests([
        Request(id="a", prompt="p", num_prompt_tokens=10, num_tokens=13),
        Request(id="b", prompt="p", num_prompt_tokens=10, num_tokens=15),
        Request(id="c", num_tokens=4)])
    rows, pairs = wave_work(step, [np.array([0, 1, 2])])
    assert rows == 10 + 3 + 5 + 4
    assert pairs == 55 + (3 * 10 + 6) + (5 * 10 + 15) + 10
    # split children: the prompt is run again in each
    rows2, pairs2 = wave_work(step, [np.array([0]), np.array([1, 2])])
    assert (rows2, pairs2) == (rows + 10, pairs + 55)


def test_time_model_from_geometry_and_observe(planner):
    m = planner.model
    tm = WaveTimeModel.from_model(m)
    assert tm.row_flops == pytest.approx(6 * linear_params_per_row(m.geometry))
    assert linear_params_per_row(m.geometry) > 7e9   # an 8B model, head included
    tp4 = WaveTimeModel.from_geometry(m.geometry, ParallelLayout(tp=4), Recompute(mode="none"))
    assert tp4.row_flops == pytest.approx(tm.row_flops * 4 / 6 / 4)   # no recompute: 4, not 6
    assert tp4.pair_flops == pytest.approx(tm.pair_flops * 3.5 / 4.5 / 4)
    step = grpo(2, 2, seed=5)
    plan = planner.plan(step, 40 * GIB)
    wave = plan.waves[0]
    before = planner.time_model.seconds(*wave.work)
    planner.observe(wave, seconds=2 * before)
    assert planner.time_model.observations == 1
    assert planner.time_model.seconds(*wave.work) == pytest.approx(2 * before)
    planner.observe(wave, seconds=before * 4)   # the mean of the ratios: 2 and 4
    assert planner.time_model.scale == pytest.approx(3.0)
    with pytest.raises(ConfigError, match="seconds"):
        planner.observe(wave, seconds=-1.0)
    with pytest.raises(ConfigError, match=r"seconds\[1\]=nan"):
        planner.observe(wave, seconds=[1.0, float("nan")])
    planner.observe(wave, seconds=[before, 3 * before])   # the slowest rank binds: ratios 2, 4, 3
    assert planner.time_model.scale == pytest.approx(3.0) and planner.time_model.observations == 3
    with pytest.raises(ConfigError, match="time_model.overhead_s"):
        WaveTimeModel(row_flops=1.0, pair_flops=0.0, overhead_s=float("nan"))
    planner.time_model = tm


# --- the command line -------------------------------------------------------------------------


def test_cli_dp_json(capsys):
    argv = ["plan", "grpo-8x8", "--model", "qwen3-8b", "--free-gib", "20", "--dp", "2"]
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dp"] == 2 and len(data["ranks"]) == 2
    assert {len(p["waves"]) for p in data["ranks"]} == {data["num_waves"]}
    ids = [i for p in data["ranks"] for w in p["waves"] for i in w["requests"]]
    assert len(ids) == len(set(ids)) == 64
    assert all(p["schema"] == 1 for p in data["ranks"])
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 ranks x" in out and "baseline balance-by-group" in out
    uneven = ["plan", "grpo-8x8", "--model", "qwen3-8b", "--free-gib", "20,14", "--dp", "2", "--json"]
    assert main(uneven) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["waves"][0]["budget_bytes"] for p in data["ranks"]] == [20 * GIB, 14 * GIB]


@pytest.mark.parametrize("extra, field", [(["--dp", "0"], "--dp=0"),
                                          (["--dp", "2", "--num-waves", "3"], "--num-waves=3"),
                                          (["--dp", "3", "--free-gib", "20,14"], "--free-gib='20,14'")])
def test_cli_dp_bad_input(capsys, extra, field):
    assert main(["plan", "grpo-8x8", "--model", "qwen3-8b"] + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0]
