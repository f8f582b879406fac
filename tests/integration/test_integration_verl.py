"""The veRL adapter (waveplan.planner.integrations.verl) against the real `verl` package (CPU):

* the micro-batches cover the batch exactly once (padded and nested `input_ids`), and veRL's
  own `restore_dynamic_batch` puts per-micro-batch outputs back in the batch's order;
* against veRL's `rearrange_micro_batches` with a token budget that fits memory (the largest
  `max_token_len` under which any first micro-batch fits the same budget, priced by the same
  model), the adapter packs fewer micro-batches on a batch of long sequences;
* two gloo data-parallel ranks agree on the micro-batch count (also rounded by
  `num_batches_divided_by`), as veRL's own function does;
* `install` puts the adapter under veRL's engine (`verl.workers.engine.utils.prepare_micro_batches`)
  and `restore` takes it out;
* measured micro-batch peaks pass through `observe_micro_batches` / `handle.observe`: a peak
  above its estimate is a miss, recorded and re-priced to its estimate; one below records nothing.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from gloo_ranks import run_ranks
from verl_token_budget import FIRST, memory_safe_token_budget

torch = pytest.importorskip("torch")
pytest.importorskip("verl")  # the dev extra installs verl==0.9.1

from tensordict import TensorDict  # noqa: E402  (a verl dependency)
from verl.utils import seqlen_balancing as vsb  # noqa: E402

from waveplan.planner import Planner  # noqa: E402
from waveplan.planner.integrations import verl as adapter  # noqa: E402
from waveplan.pricing.errors import ConfigError, InfeasibleError  # noqa: E402
from waveplan.pricing.step import Step  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

GIB = 2**30
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def planner():
    return Planner.from_preset("qwen3-8b", tp=1, recompute="full", lora_rank=16)


def padded_batch(lengths, *, seed=0, left=False):
    """A veRL-style padded batch: input_ids, attention_mask, position_ids (right- or left-padded)."""
    rng = np.random.default_rng(seed)
    n, width = len(lengths), int(max(lengths))
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for r, length in enumerate(lengths):
        cols = slice(width - length, width) if left else slice(0, length)
        ids[r, cols] = torch.from_numpy(rng.integers(1, 50_000, length))
        mask[r, cols] = 1
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    return TensorDict({"input_ids": ids, "attention_mask": mask, "position_ids": position},
                      batch_size=n)


def nested_batch(lengths, *, seed=0):
    """veRL's engine form: jagged nested input_ids (no padding)."""
    rng = np.random.default_rng(seed)
    rows = [torch.from_numpy(rng.integers(1, 50_000, int(n))) for n in lengths]
    nested = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    return TensorDict({"input_ids": nested}, batch_size=len(lengths))


def lengths_of(seed, n, lo, hi):
    return [int(x) for x in np.random.default_rng(seed).integers(lo, hi + 1, n)]


@pytest.mark.slow
@pytest.mark.parametrize("form", ["right-padded", "left-padded", "nested"])
def test_micro_batches_cover_the_batch_once_and_verl_restores_the_order(planner, form):
    lengths = lengths_of(1, 64, 256, 6144)
    batch = nested_batch(lengths) if form == "nested" else padded_batch(lengths, left=form == "left-padded")
    micro, idx = adapter.rearrange_micro_batches(batch, planner=planner, free_bytes=12 * GIB)
    assert len(micro) == len(idx) > 1
    flat = [i for part in idx for i in part]
    assert sorted(flat) == list(range(len(lengths)))  # exactly once
    rows = batch["input_ids"].unbind() if form == "nested" else list(batch["input_ids"])
    for mb, part in zip(micro, idx, strict=True):
        got = mb["input_ids"].unbind() if form == "nested" else list(mb["input_ids"])
        assert len(got) == len(part)
        for row, i in zip(got, part, strict=True):
            assert torch.equal(row, rows[i])
    # a per-sequence "model output" computed micro-batch by micro-batch, restored by veRL
    outputs = torch.cat([torch.tensor([float(r.sum()) for r in
                                       (mb["input_ids"].unbind() if form == "nested" else mb["input_ids"])])
                         for mb in micro])
    expected = torch.tensor([float(r.sum()) for r in rows])
    assert torch.equal(vsb.restore_dynamic_batch(outputs, idx), expected)
    assert torch.equal(outputs[torch.tensor(vsb.get_reverse_idx(flat))], expected)
    # nested outputs (the engine's postprocess_batch_func path)
    per_token = [torch.ones(n) * k for k, n in enumerate(lengths)]
    nested_out = torch.nested.as_nested_tensor([per_token[i] for i in flat], layout=torch.jagged)
    restored = vsb.restore_dynamic_batch(nested_out, idx).unbind()
    assert all(torch.equal(a, b) for a, b in zip(restored, per_token, strict=True))
    # every micro-batch fits: the plan behind it, re-priced
    plan = adapter.plan_micro_batches(batch, planner=planner, free_bytes=12 * GIB)
    assert [list(w.request_indices) for w in plan.waves] == idx
    assert all(w.admitted_bytes <= 12 * GIB for w in plan.waves)


def verl_fits(planner, lengths, idx, free) -> bool:
    """veRL's micro-batches, priced in veRL's run order (the first allocates the gradients),
    each beside the RoPE cache entries the ones before it left, as waveplan's waves are."""
    step = Step.from_lengths(np.zeros(len(lengths), np.int64), lengths)
    pricer = planner.pricer(step)
    parts = [np.array(part) for part in idx]
    earlier = pricer.earlier_entries([pricer.group_loads([part]) for part in parts])
    return all(pricer.plus_earlier(pricer.price([part], first_slots=FIRST if k == 0 else frozenset()),
                                   earlier[k]).admitted_bytes <= free for k, part in enumerate(parts))


# (batch, free GiB) -> wave counts: the report quotes these (docs/integration.md)
COMPARISON = [("long", 64, 4096, 8192, 20), ("mixed", 64, 128, 8192, 20), ("short", 256, 128, 1024, 20),
              ("long", 48, 4096, 8192, 10), ("mixed", 96, 128, 8192, 10)]


@pytest.mark.slow
def test_fewer_micro_batches_than_a_token_budget_that_fits_memory(planner):
    lo, hi = 128, 8192   # the run's sequence lengths; the token budget must hold for all of them
    rows = []
    for seed, (name, n, a, b, gib) in enumerate(COMPARISON):
        free = gib * GIB
        budget = memory_safe_token_budget(planner, lo, hi, free)
        lengths = lengths_of(100 + seed, n, a, b)
        batch = padded_batch(lengths)
        ours, idx = adapter.rearrange_micro_batches(batch, planner=planner, free_bytes=free)
        theirs, their_idx = vsb.rearrange_micro_batches(batch, max_token_len=budget)
        assert verl_fits(planner, lengths, their_idx, free)  # the budget really fits memory
        plan = adapter.plan_micro_batches(batch, planner=planner, free_bytes=free)
        rows.append((name, n, sum(lengths), gib, budget, len(theirs), len(ours), plan.lower_bound_waves))
        assert len(ours) <= len(theirs), rows[-1]
        assert len(ours) >= plan.lower_bound_waves
    print("\nbatch  n  tokens  free_GiB  token_budget  veRL  waveplan  lower_bound")
    for row in rows:
        print(" ".join(str(x) for x in row))
    # never more on any batch (above), and fewer over the batches together
    assert sum(r[6] for r in rows) < sum(r[5] for r in rows), rows


def test_options_and_errors(planner):
    lengths = lengths_of(5, 12, 512, 4096)
    batch = padded_batch(lengths)
    base = adapter.plan_micro_batches(batch, planner=planner, free_bytes=12 * GIB).num_waves
    plan = adapter.plan_micro_batches(batch, planner=planner, free_bytes=12 * GIB,
                                      min_num_micro_batch=base + 1, num_batches_divided_by=3)
    assert plan.num_waves == -(-(base + 1) // 3) * 3
    pairs = adapter.plan_micro_batches(batch, planner=planner, free_bytes=12 * GIB, force_group_size=2)
    for w in pairs.waves:  # reward-model pairs stay together
        assert all(i ^ 1 in w.request_indices for i in w.request_indices)
    with pytest.raises(ConfigError, match=r"force_group_size=5: must divide the batch size 12"):
        adapter.plan_micro_batches(batch, planner=planner, free_bytes=12 * GIB, force_group_size=5)
    with pytest.raises(InfeasibleError, match=r"num_micro_batches=13: the batch has only 12 sequences"):
        adapter.plan_micro_batches(batch, planner=planner, free_bytes=12 * GIB, min_num_micro_batch=13)
    with pytest.raises(ConfigError, match=r"batch='dict': must be a TensorDict \(or dict\) holding input_ids"):
        adapter.plan_micro_batches({}, planner=planner, free_bytes=12 * GIB)
    with pytest.raises(ConfigError, match=r"free_bytes=0"):
        adapter.plan_micro_batches(batch, planner=planner, free_bytes=0)
    # free bytes may be a callable, asked at every split
    asked = []
    adapter.plan_micro_batches(batch, planner=planner, free_bytes=lambda: asked.append(1) or 12 * GIB)
    assert asked == [1]


@pytest.mark.slow
def test_install_under_verl_engine_and_restore(planner):
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine import utils as engine_utils

    lengths = lengths_of(7, 32, 512, 8192)
    data = nested_batch(lengths)
    tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=16384)
    handle = adapter.install(planner, free_bytes=12 * GIB)
    try:
        micro, idx = engine_utils.prepare_micro_batches(data=data, dp_group=None)
        assert handle.calls == 1 and idx == [list(w.request_indices) for w in handle.last_plan.waves]
        assert len(micro) == handle.last_plan.num_waves
    finally:
        handle.restore()
    assert engine_utils.rearrange_micro_batches is vsb.rearrange_micro_batches
    _, theirs = engine_utils.prepare_micro_batches(data=data, dp_group=None)
    assert handle.calls == 1 and sorted(i for p in theirs for i in p) == list(range(len(lengths)))


def test_observed_peaks_surface_misses(planner, tmp_path):
    from waveplan.planner.misses import MissKind, misses, own_estimate, read_misses, reprice

    learner = Planner.from_model(planner.model, misses_path=tmp_path / "m.jsonl")  # the module's stays static
    batch = padded_batch(lengths_of(5, 12, 512, 4096))
    handle = adapter.install(learner, free_bytes=12 * GIB)
    try:
        with pytest.raises(ConfigError, match=r"last_plan=None: no micro-batches were planned yet"):
            handle.observe([1])
        micro, _ = handle.rearrange(batch)
        plan = handle.last_plan
        assert len(micro) == plan.num_waves > 1
        peaks = [None] * plan.num_waves
        peaks[0] = int(plan.waves[0].admitted_bytes * 1.3)   # over the admitted bytes
        # within the estimate (the wave's own: without earlier waves' RoPE cache entries)
        peaks[1] = own_estimate(plan.waves[1].breakdown, learner.model.safety)[0] - 1
        missed = handle.observe(peaks)
    finally:
        handle.restore()
    kinds = [None if o is None else o.kind for o in handle.last_observations]
    assert kinds[:2] == [MissKind.OVER_ADMITTED, MissKind.NONE] and set(kinds[2:]) <= {None}
    assert [o.wave for o in missed] == [0]
    obs = adapter.observe_micro_batches(learner, plan, [p and p + 1 for p in peaks])
    assert [o.wave for o in misses(obs)] == [0]   # the same peaks again, plus one byte
    records, bad = read_misses(tmp_path / "m.jsonl")
    assert bad == [] and [r.data["wave"]["index"] for r in records] == [0, 0]
    assert records[0].data["versions"]["framework"].get("verl")
    assert all(reprice(r).same_estimate(r) for r in records)
    with pytest.raises(ConfigError, match=r"plan='list': must be the Plan"):
        adapter.observe_micro_batches(learner, [], [])


# --- two data-parallel ranks ------------------------------------------------------------------

WORKER = textwrap.dedent("""
    import faulthandler, json, os, sys
    faulthandler.dump_traceback_later(580, exit=True)
    import numpy as np
    import torch
    import torch.distributed as dist
    from tensordict import TensorDict
    from waveplan.planner import Planner
    from waveplan.planner.integrations.verl import rearrange_micro_batches

    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    planner = Planner.from_preset("qwen3-8b", tp=1, recompute="full", lora_rank=16)
    rng = np.random.default_rng(rank)
    lengths = rng.integers(256, 1024 if rank == 0 else 8192, 24)  # rank 1: far more tokens
    mask = torch.zeros(24, int(lengths.max()), dtype=torch.long)
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
    batch = TensorDict({"input_ids": mask.clone(), "attention_mask": mask}, batch_size=24)
    result = {"rank": rank}
    alone, _ = rearrange_micro_batches(batch, planner=planner, free_bytes=12 * 2**30)
    result["alone"] = len(alone)
    group = dist.group.WORLD
    micro, idx = rearrange_micro_batches(batch, planner=planner, free_bytes=12 * 2**30, dp_group=group)
    result["agreed"] = len(micro)
    result["covered"] = sorted(i for part in idx for i in part) == list(range(24))
    micro, idx = rearrange_micro_batches(batch, planner=planner, free_bytes=12 * 2**30, dp_group=group,
                                         num_batches_divided_by=4)
    result["divided"] = len(micro)
    with open(out, "w") as f:
        json.dump(result, f)
    os._exit(0)  # the result is on disk; gloo's teardown sometimes aborts (see test_distributed)
""")


@pytest.mark.slow
def test_two_gloo_dp_ranks_agree_on_the_micro_batch_count(planner, tmp_path):
    # compile (and cache) the numba kernels here first, so the workers only load them
    adapter.plan_micro_batches(padded_batch(lengths_of(0, 8, 256, 1024)), planner=planner,
                               free_bytes=12 * GIB)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    res = run_ranks(script, tmp_path, 2, lambda r, port, out: [str(r), str(port), str(out)],
                    TIMEOUT_S)
    assert res[0]["alone"] < res[1]["alone"], res
    assert res[0]["agreed"] == res[1]["agreed"] == res[1]["alone"], res
    assert all(r["covered"] for r in res), res
    assert res[0]["divided"] == res[1]["divided"] == -(-res[1]["alone"] // 4) * 4, res
