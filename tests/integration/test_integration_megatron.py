"""The Megatron-core driver (waveplan.planner.integrations.megatron) on a small real Megatron-core
GPT with LoRA, on the CPU, through Megatron-core's own `get_forward_backward_func()`.

* a planned step (several sequences per wave, packed THD; with and without shared prompts run
  as prefix trees; split children) gives the same loss and LoRA gradients, to fp32 tolerance,
  as running every sequence as its own micro-batch, and feeds each wave's peak to `observe`;
* a planner that under-prices the model that runs (configured half as wide) gets a miss for
  every wave: `StepRun.misses`, one warning, one record per wave that re-prices to its estimate;
* two gloo data-parallel ranks with different steps agree on the wave count through
  `plan_distributed` and both run that many micro-batches.
"""

from __future__ import annotations

import dataclasses
import logging
import textwrap
from pathlib import Path

import numpy as np
import pytest
from gloo_ranks import run_ranks

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

MIB = 2**20
TIMEOUT_S = 600  # two cold processes on a busy two-core machine; a hang still fails



@pytest.fixture(scope="module")
def setup():
    """One process group and model for the module (one torch thread: tiny matmuls)."""
    import torch

    from waveplan.pricing.measure.megatron_shim import init_single_process

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with init_single_process(1):
            import megatron_tiny as mod

            model, planner = mod.build()
            yield mod, model, planner
    finally:
        torch.set_num_threads(threads)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def _run(model, plan, data, loss_func, planner=None):
    from waveplan.planner.integrations.megatron import run_plan

    model.zero_grad(set_to_none=True)
    run = run_plan(model, plan, data, loss_func, planner=planner)
    loss = sum(float(d["lm loss"][0]) for d in run.logged)
    tokens = sum(float(d["lm loss"][1]) for d in run.logged)
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return run, loss, tokens, grads


def _same(a, b):
    import torch

    assert a.keys() == b.keys() and len(a) == 2 * 2 * 4  # lora_A and lora_B of 4 linears x 2 layers
    for name in a:
        assert float(a[name].abs().max()) > 0, name
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5 * float(b[name].abs().max()))


@pytest.mark.slow
@pytest.mark.parametrize("share", [False, True], ids=["unshared", "prefix-tree"])
def test_planned_step_equals_one_sequence_per_micro_batch(setup, share):
    from waveplan.planner.integrations.megatron import StepData, plan_step

    mod, model, planner = setup
    seqs, plens = mod.grpo(np.random.default_rng(1))
    data = StepData.from_sequences(seqs, prompt_lengths=plens, share_prompts=share)
    plan = plan_step(planner, data, 3 * MIB)
    assert 1 < plan.num_waves < len(seqs) and max(len(w.request_ids) for w in plan.waves) > 1
    assert sorted(i for w in plan.waves for i in w.request_indices) == list(range(len(seqs)))
    observed = sum(p.count for p in planner.profiles)
    run, loss, tokens, grads = _run(model, plan, data, mod.loss_func, planner=planner)
    assert len(run.logged) == len(run.peaks) == plan.num_waves  # one micro-batch per wave
    assert all(p > 0 for p in run.peaks)  # every wave's peak fed to observe:
    assert not run.misses, [(o.ratio, o.kind) for o in run.misses]  # fp32 priced x2: no miss
    assert sum(p.count for p in planner.profiles) == observed + plan.num_waves
    alone = planner.plan(data.step, 2**40, num_waves=len(seqs))  # every sequence on its own
    assert all(len(w.request_ids) == 1 for w in alone.waves)
    _, ref_loss, ref_tokens, ref_grads = _run(model, alone, data, mod.loss_func)
    assert tokens == ref_tokens == data.num_loss_tokens
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    _same(grads, ref_grads)


@pytest.mark.slow
def test_split_children_run_as_sub_forwards_sharing_one_backward(setup):
    from waveplan.planner import Planner
    from waveplan.planner.integrations.megatron import StepData

    mod, model, learned = setup
    planner = Planner.from_model(learned.model)  # static prices: no profile learned by other tests
    seqs, plens = mod.grpo(np.random.default_rng(2), prompts=2, completions=4)
    data = StepData.from_sequences(seqs, prompt_lengths=plens, share_prompts=True)
    unit = list(range(8))  # everything must run as one wave, one byte short of fitting flat
    flat = planner.pricer(data.step).price([np.arange(8)], first_slots=frozenset({"default"}))
    plan = planner.plan(data.step, flat.admitted_bytes - 1, atomic_units=[unit], deterministic=True)
    assert plan.num_waves == 1 and plan.waves[0].is_split
    run, loss, _, grads = _run(model, plan, data, mod.loss_func)
    assert len(run.logged) == 1
    alone = planner.plan(data.step, 2**40, num_waves=len(seqs))
    _, ref_loss, _, ref_grads = _run(model, alone, data, mod.loss_func)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    _same(grads, ref_grads)


def test_misses_surface_through_the_driver(setup, tmp_path, caplog):
    from waveplan.planner import Planner
    from waveplan.planner.integrations.megatron import StepData, run_plan
    from waveplan.planner.misses import MissKind, miss_kind, own_estimate, read_misses, reprice

    mod, model, learned = setup
    g = learned.model.geometry
    narrow = dataclasses.replace(learned.model, geometry=dataclasses.replace(g, hidden=g.hidden // 2, ffn=g.ffn // 2))
    planner = Planner.from_model(narrow, misses_path=tmp_path / "m.jsonl")
    seqs, plens = mod.grpo(np.random.default_rng(4), prompts=2)
    data = StepData.from_sequences(seqs, prompt_lengths=plens)
    plan = planner.plan(data.step, 3 * MIB, num_waves=3, deterministic=True)
    with caplog.at_level(logging.WARNING, logger="waveplan"):
        run = run_plan(model, plan, data, mod.loss_func, planner=planner)
    assert len(run.observations) == len(run.peaks) == plan.num_waves > 1
    for wave, peak, obs in zip(plan.waves, run.peaks, run.observations, strict=True):
        raw, admitted = own_estimate(wave.breakdown, narrow.safety)
        assert obs.peak_bytes == peak and obs.kind is miss_kind(peak, raw, admitted)
    assert run.misses == run.observations and {o.kind for o in run.misses} == {MissKind.OVER_ADMITTED}
    warned = [r for r in caplog.records if r.name == "waveplan" and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "tiny-fp32 TP1 full recompute [default:grad]" in warned[0].getMessage()
    records, bad = read_misses(tmp_path / "m.jsonl")
    assert bad == [] and len(records) == plan.num_waves
    assert records[0].data["versions"]["framework"].get("megatron-core")
    assert all(reprice(r).same_estimate(r) for r in records)


def test_step_data_errors_name_field_and_value():
    from waveplan.planner.integrations.megatron import StepData
    from waveplan.pricing.errors import StepError

    with pytest.raises(StepError, match=r"prompt_lengths\[1\]=3: must leave at least one completion"):
        StepData.from_sequences([[1, 2, 3], [4, 5, 6]], prompt_lengths=[1, 3])
    with pytest.raises(StepError, match=r"groups\[1\]='g': sequence 1 and sequence 0 share the group"):
        StepData.from_sequences([[1, 2, 3], [4, 5, 6]], prompt_lengths=[1, 1], groups=["g", "g"])
    with pytest.raises(StepError, match=r"loss_masks\[0\]='<prompt positions>'"):
        StepData.from_sequences([[1, 2, 3], [1, 5, 6]], prompt_lengths=[1, 1],
                                loss_masks=[[1, 1, 1], [0, 1, 1]], share_prompts=True)
    with pytest.raises(StepError, match=r"loss_masks\[1\]='<2 values>': needs one value per token \(3\)"):
        StepData.from_sequences([[1, 2, 3], [1, 5, 6]], loss_masks=[[1, 1, 1], [0, 1]])
    data = StepData.from_sequences([[1, 2, 3, 4], [1, 2, 5]], prompt_lengths=[2, 2], share_prompts=True)
    assert data.step.to_length_form()[0] == {"id": "0", "prompt": "0", "prompt_tokens": 2,
                                             "completion_tokens": 2}
    assert [m.tolist() for m in data.loss_masks] == [[0, 0, 1, 0], [0, 0, 0]]
    unshared = StepData.from_sequences([[1, 2, 3, 4], [1, 2, 5]], prompt_lengths=[2, 2])
    assert unshared.step.prefix_rows.tolist() == [0, 0]  # priced as it runs: nothing shared


# --- two data-parallel ranks ------------------------------------------------------------------

WORKER = textwrap.dedent("""
    import faulthandler, json, os, sys
    sys.path.insert(0, sys.argv[4])   # tests/: megatron_tiny
    import numpy as np
    import torch
    from megatron_tiny import build, grpo, loss_func
    faulthandler.dump_traceback_later(580, exit=True)
    import torch.distributed as dist
    from waveplan.planner.integrations.megatron import StepData, train_step
    from waveplan.pricing.measure.megatron_shim import init_single_process

    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    with init_single_process(1):   # Megatron on the existing world: TP 1, so DP 2
        model, planner = build(seed=0)
        rng = np.random.default_rng(10 + rank)
        # rank 0: a small step; rank 1: a larger one (more waves on its own)
        seqs, plens = grpo(rng, prompts=1 if rank == 0 else 3, completions=4)
        data = StepData.from_sequences(seqs, prompt_lengths=plens)
        alone = planner.plan(data.step, 3 * 2**20, deterministic=True).num_waves
        run = train_step(model, planner, data, 3 * 2**20, loss_func)
        result = {"rank": rank, "alone": alone, "waves": run.plan.num_waves,
                  "micro_batches": len(run.logged), "peaks": len(run.peaks),
                  "requests": sorted(i for w in run.plan.waves for i in w.request_indices),
                  "n": len(seqs)}
    with open(out, "w") as f:
        json.dump(result, f)
    os._exit(0)  # the result is on disk; gloo's teardown sometimes aborts (see test_distributed)
""")


@pytest.mark.slow
def test_two_gloo_dp_ranks_agree_on_the_wave_count(setup, tmp_path):
    # the numba kernels are compiled (and cached) by this process's planner first: the fixture
    # planned nothing yet, so plan once here, then the workers load the cache
    from waveplan.planner.integrations.megatron import StepData

    mod, _, planner = setup
    seqs, plens = mod.grpo(np.random.default_rng(3))
    planner.plan(StepData.from_sequences(seqs, prompt_lengths=plens).step, 3 * MIB)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    tests_dir = str(Path(__file__).resolve().parents[1])
    res = run_ranks(script, tmp_path, 2, lambda r, port, out: [str(r), str(port), str(out), tests_dir],
                    TIMEOUT_S)
    assert res[0]["alone"] < res[1]["alone"], res  # on its own, rank 0 would run fewer waves
    assert res[0]["waves"] == res[1]["waves"] == res[1]["alone"], res
    for r in res:
        assert r["micro_batches"] == r["peaks"] == r["waves"], r
        assert r["requests"] == list(range(r["n"])), r
