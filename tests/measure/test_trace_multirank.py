"""Multi-rank CPU traces (one process per rank over gloo): every rank's peak is reported and
the busiest rank is the largest; real collectives measure what the rank-0 shard measures; the
CP ring attention computes one rank's attention."""

from __future__ import annotations

import json
import os
import tempfile
import warnings

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from waveplan.pricing.errors import ConfigError  # noqa: E402
from waveplan.pricing.geometry import (  # noqa: E402
    AttentionSpec,
    GdnSpec,
    MixerKind,
    MlpKind,
    ModelGeometry,
    MoeSpec,
)
from waveplan.pricing.parallel import ParallelLayout, Recompute  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

A, G = MixerKind.ATTENTION, MixerKind.GDN
D, M = MlpKind.DENSE, MlpKind.MOE
TIMEOUT_S = 900  # a hang guard only: cold imports of several ranks on a busy machine are slow

TINY_CONFIG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 768,
               "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
               "vocab_size": 1024, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
TINY = ModelGeometry(name="tiny", hidden=256, ffn=768, vocab=1024, layers=((A, D),) * 2,
                     attention=AttentionSpec(4, 2, 64))
TINY_MOE = ModelGeometry(name="tiny-moe", hidden=256, ffn=0, vocab=1024, layers=((A, M),) * 2,
                         attention=AttentionSpec(4, 2, 64), moe=MoeSpec(8, 2, 128))
LENS = [200, 312]


def _check_ranks(trace: dict, world: int) -> None:
    """Every rank reported with positive peaks; the busiest rank is the largest, and the
    record's peaks are its own."""
    ranks = trace["ranks"]
    assert [r["rank"] for r in ranks] == list(range(world))
    for r in ranks:
        assert 0 < r["peak_forward_bytes"] and 0 < r["peak_backward_bytes"]
        assert r["peak_bytes"] == max(r["peak_forward_bytes"], r["peak_backward_bytes"])
        assert 0 < r["decoder_peak_bytes"] <= r["peak_bytes"]
    top = max(r["peak_bytes"] for r in ranks)
    busiest = ranks[trace["busiest_rank"]]
    assert busiest["peak_bytes"] == top == trace["peak_bytes"]
    assert trace["busiest_rank"] == min(r["rank"] for r in ranks if r["peak_bytes"] == top)
    assert trace["peak_forward_bytes"] == busiest["peak_forward_bytes"]
    assert trace["decoder_peak_bytes"] == max(r["decoder_peak_bytes"] for r in ranks)
    assert trace["world_size"] == world


@pytest.mark.slow
def test_cli_tp2_sp_reports_every_rank_and_matches_the_rank0_shard(tmp_path, capsys):
    from waveplan.planner.cli import main
    from waveplan.pricing.measure.calibrate import _check_record
    from waveplan.pricing.measure.trace import trace_wave

    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(TINY_CONFIG))
    step = tmp_path / "step.jsonl"
    step.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"p{i}", "prompt_tokens": 8,
                                        "completion_tokens": n - 8}) + "\n"
                            for i, n in enumerate(LENS)))
    code = main(["trace", str(step), "--model", str(tmp_path / "tiny" / "config.json"),
                 "--tp", "2", "--sp", "--json", "--timeout", str(TIMEOUT_S)])
    assert code == 0
    record = json.loads(capsys.readouterr().out)
    _check_record(record, "cli")  # the form `waveplan calibrate` reads
    cell, trace = record["cell"], record["trace"]
    assert cell["layout"] == {"tp": 2, "cp": 1, "pp": 1, "ep": 1, "dp": 1,
                              "sequence_parallel": True}
    assert cell["seq_lens"] == LENS and cell["geometry"]["hidden"] == 256
    assert cell["step"] == "step.jsonl"
    _check_ranks(trace, 2)
    assert [r["tp_rank"] for r in trace["ranks"]] == [0, 1]
    assert all(r["rows"] == sum(LENS) for r in trace["ranks"])
    # real collectives over gloo hold what rank 0's shard holds on torch's fake process group
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shard = trace_wave(TINY, seq_lens=LENS, device="cpu",
                           layout=ParallelLayout(tp=2, sequence_parallel=True))
    rank0 = trace["ranks"][0]
    assert rank0["peak_forward_bytes"] == shard.peak_forward_bytes
    assert rank0["peak_backward_bytes"] == shard.peak_backward_bytes
    assert rank0["decoder_peak_bytes"] == shard.decoder_peak_bytes


@pytest.mark.slow
def test_ep2_with_the_router_reports_both_ranks_and_the_busiest_is_the_max():
    from waveplan.pricing.measure.multirank import trace_multirank, trace_record

    tr = trace_multirank(TINY_MOE, layout=ParallelLayout(ep=2), seq_lens=LENS,
                         routing="router", timeout_s=TIMEOUT_S)
    d = tr.to_dict()
    _check_ranks(d, 2)
    assert [(r.dp_rank, r.ep_rank) for r in tr.ranks] == [(0, 0), (1, 1)]
    assert tr.layout.dp == 2 and d["routing"] == "router"
    # the router on random weights loads the two ranks' experts differently
    assert tr.ranks[0].peak_bytes != tr.ranks[1].peak_bytes
    assert tr.peak_bytes == max(r.peak_bytes for r in tr.ranks)
    rec = trace_record(tr, TINY_MOE)
    assert rec["cell"]["layout"]["ep"] == 2 and rec["cell"]["routing"] == "router"
    assert "loss" not in json.dumps(rec)  # deterministic fields only


@pytest.mark.slow
def test_a_gdn_hybrid_runs_concatenated_at_tp2_and_matches_the_rank0_shard():
    """GatedDeltaNet takes no packed input: a GDN hybrid's wave runs as one causal row (as the
    single-rank tracer runs it), and rank 0 of TP2 over gloo holds what rank 0's shard holds on
    torch's fake process group (bench/gdn_grid.py traces TP2/TP4 with and without SP this way)."""
    from waveplan.pricing.measure.multirank import trace_multirank
    from waveplan.pricing.measure.trace import trace_wave

    hybrid = ModelGeometry(name="tiny-gdn", hidden=256, ffn=768, vocab=1024,
                           layers=((G, D), (A, D)), attention=AttentionSpec(4, 2, 64),
                           gdn=GdnSpec(2, 6, 64, 64, 4))
    lay = ParallelLayout(tp=2)
    tr = trace_multirank(hybrid, layout=lay, seq_lens=LENS, timeout_s=TIMEOUT_S)
    d = tr.to_dict()
    _check_ranks(d, 2)
    assert d["packed"] == "concatenated" and any("concatenated" in n for n in d["notes"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shard = trace_wave(hybrid, seq_lens=LENS, device="cpu", layout=lay)
    assert shard.packed == "concatenated"
    # to a few scalars' bytes (12 B of 6.7 MB here): the rank's GDN pass over gloo holds a
    # scalar or two more than on the fake process group; the shapes are the same
    assert abs(tr.ranks[0].peak_forward_bytes - shard.peak_forward_bytes) <= 64
    assert abs(tr.ranks[0].peak_backward_bytes - shard.peak_backward_bytes) <= 64


@pytest.mark.slow
def test_expert_tp_reaches_megatron_and_etp1_holds_less_than_etp_tp():
    """ETP (Megatron's expert_tensor_parallel_size) is passed to the rank processes: at TP2+SP
    with ETP1 each rank's experts run its own shard's routed rows, whole-width, with no gather,
    so its busiest rank holds less than at ETP2 (docs/memory-model.md#moe-tp-point)."""
    from waveplan.pricing.measure.multirank import rank_world, trace_multirank, trace_record

    lens = [208, 304]   # multiples of TP
    etp1 = ParallelLayout(tp=2, sequence_parallel=True, etp=1)
    assert rank_world(etp1).etp == 1
    peaks = {}
    for lay in (etp1, ParallelLayout(tp=2, sequence_parallel=True)):
        tr = trace_multirank(TINY_MOE, layout=lay, seq_lens=lens, timeout_s=TIMEOUT_S)
        _check_ranks(tr.to_dict(), 2)
        peaks[lay.expert_tp] = tr.peak_bytes
        assert trace_record(tr, TINY_MOE)["cell"]["layout"].get("etp") == lay.etp
    assert peaks[1] < peaks[2], peaks


def test_cp2_loss_equals_one_rank_and_rows_halve():
    from waveplan.pricing.measure.multirank import TraceJob, trace_multirank_batch

    jobs = [TraceJob(seq_lens=tuple(LENS), recompute=Recompute(mode="none"))]
    one = trace_multirank_batch(TINY, layout=ParallelLayout(), jobs=jobs, timeout_s=TIMEOUT_S)[0]
    cp2 = trace_multirank_batch(TINY, layout=ParallelLayout(cp=2), jobs=jobs,
                                timeout_s=TIMEOUT_S)[0]
    _check_ranks(cp2.to_dict(), 2)
    assert [r.cp_rank for r in cp2.ranks] == [0, 1]
    assert [r.rows for r in cp2.ranks] == [sum(LENS) // 2] * 2
    # each CP rank's token losses on its chunks add up to one rank's (bf16: a small tolerance)
    total = sum(r.loss_sum for r in cp2.ranks)
    assert abs(total - one.ranks[0].loss_sum) <= 2e-3 * abs(one.ranks[0].loss_sum)
    assert cp2.peak_bytes < one.peak_bytes


def _ring_worker(rank, cp, init, lens, out, flash=False):  # pragma: no cover - spawned process
    import torch
    import torch.distributed as dist

    from waveplan.pricing.measure.ring_attention import cp_split, ring_attention

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=cp)
    gen = torch.Generator().manual_seed(0)
    t, h, g, d = sum(lens), 4, 2, 16
    q, k, v, go = (torch.randn(t, n, d, generator=gen, dtype=torch.float64)
                   for n in (h, g, g, h))
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    outs, a = [], 0
    for n in lens:
        o = torch.nn.functional.scaled_dot_product_attention(
            *(x[a:a + n].transpose(0, 1) for x in ref_in), is_causal=True, enable_gqa=True)
        outs.append(o.transpose(0, 1))
        a += n
    ref = torch.cat(outs)
    (ref * go).sum().backward()
    split = cp_split(lens, cp, rank)
    idx = torch.tensor(split.global_index)
    local = [x[idx].clone().requires_grad_() for x in (q, k, v)]
    got = ring_attention(*local, split.bounds, dist.group.WORLD, list(range(cp)), flash=flash)
    (got * go[idx]).sum().backward()
    errs = [(got - ref[idx]).abs().max().item()]
    errs += [(mine.grad - theirs.grad[idx]).abs().max().item()
             for mine, theirs in zip(local, ref_in, strict=True)]
    with open(os.path.join(out, f"{rank}.json"), "w") as fh:
        json.dump(errs, fh)
    dist.barrier()
    os._exit(0)


@pytest.mark.slow
@pytest.mark.parametrize(("cp", "flash"), [(2, False), (4, False), (2, True)])
def test_ring_attention_equals_causal_attention_over_the_whole_sequence(cp, flash):
    """The CPU ring, and with `flash` (te-gpu: flash-attn's allocations, values uncounted),
    gives causal attention's output and gradients."""
    import torch.multiprocessing as mp

    lens = [8 * cp * 3, 2 * cp, 2 * cp * 5]  # chunks of 12, 1 and 5 rows (cp 2)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_ring_worker, args=(cp, os.path.join(tmp, "init"), lens, tmp, flash),
                           nprocs=cp, start_method="spawn")
        errs = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(cp)]
    assert max(max(e) for e in errs) < 1e-12, errs


def test_the_te_gpu_rings_backward_step_allocates_mha_varlen_bwds_workspace():
    """`flash_workspace` (the te-gpu ring's backward step): softmax_d fp32 [h, rows + 128 b],
    dq_accum fp32 [rows + 128 b, h, round32(d)], under GQA dk/dv expanded to every head."""
    import torch

    from waveplan.pricing.measure.ring_attention import flash_workspace

    q = torch.empty(10, 8, 80, dtype=torch.bfloat16)
    gqa = flash_workspace(10, 6, 3, q, torch.empty(6, 2, 80, dtype=torch.bfloat16))
    assert [tuple(x.shape) for x in gqa] == [(8, 10 + 384), (10 + 384, 8, 96), (6, 8, 80), (6, 8, 80)]
    assert [x.dtype for x in gqa] == [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]
    mha = flash_workspace(5, 10, 1, q[:5], torch.empty(10, 8, 80, dtype=torch.bfloat16))
    assert [tuple(x.shape) for x in mha] == [(8, 5 + 128), (5 + 128, 8, 96)]


def _gloo_group():
    """A one-rank gloo ProcessGroup (not the default group, so nothing else is touched)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    store = dist.HashStore()
    pg = dist.ProcessGroup(store, 0, 1)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                         dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=60)))
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return pg


def test_traced_collectives_leave_gloo_no_reference_to_the_callers_tensors():
    """gloo's worker thread holds a collective's tensors until it drops the work, after the
    caller has seen the op complete; under the tracker it holds copies, so the caller's
    storages die when the caller drops them (not at a random moment on gloo's thread: the
    flaky TP2+SP decoder-only peak above the whole model's), and the results land in them."""
    import torch

    from waveplan.pricing.measure.trace import _tracker_class

    def refs(t):
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata)

    pg = _gloo_group()
    tracker = _tracker_class()()
    x = torch.full((64, 32), 2.0)
    tracker.ignore([x])
    with tracker:
        y = torch.empty(64, 32)
        z = torch.ones(64, 32)
        before = [refs(t) for t in (x, y, z)]
        gather = pg._allgather_base(y, x)
        reduce = pg.allreduce([z])
        # the works are alive (held here): what they hold is not the caller's
        assert [refs(t) for t in (x, y, z)] == before
        gather.wait()
        reduce.wait()
        assert bool((y == 2).all()) and bool((z == 1).all())
        assert tracker.current == 2 * 64 * 32 * 4
        del gather, reduce, y
        assert tracker.current == 64 * 32 * 4
        del z
        assert tracker.current == 0


def test_cp_split_gives_each_rank_chunks_r_and_2cp_minus_1_minus_r():
    from waveplan.pricing.measure.ring_attention import cp_split

    s = cp_split([8, 16], 2, 1)  # chunks of 2 and 4 rows
    assert s.global_index == (2, 3, 4, 5, 8 + 4, 8 + 5, 8 + 6, 8 + 7, 8 + 8, 8 + 9, 8 + 10, 8 + 11)
    assert s.segments == ((0, 2, 2), (2, 4, 4), (4, 8, 4), (8, 12, 8))
    assert s.local_lens == (4, 8) and s.bounds == (0, 8, 24)
    whole = sorted(i for r in range(2) for i in cp_split([8, 16], 2, r).global_index)
    assert whole == list(range(24))
    with pytest.raises(ConfigError, match="seq_lens=6"):
        cp_split([6], 2, 0)


def test_bad_layouts_are_refused_before_any_process_starts():
    from waveplan.pricing.measure.multirank import trace_multirank

    with pytest.raises(ConfigError, match="parallel.pp=2"):
        trace_multirank(TINY, layout=ParallelLayout(pp=2), seq_lens=LENS)
    with pytest.raises(ConfigError, match="parallel.ep=2"):
        trace_multirank(TINY, layout=ParallelLayout(ep=2), seq_lens=LENS)
    with pytest.raises(ConfigError, match="routing='random'"):
        trace_multirank(TINY_MOE, layout=ParallelLayout(ep=2), seq_lens=LENS, routing="random")
    hybrid = ModelGeometry(name="tiny-gdn", hidden=256, ffn=768, vocab=1024,
                           layers=((G, D), (A, D)), attention=AttentionSpec(4, 2, 64),
                           gdn=GdnSpec(2, 4, 32, 32, 4))
    with pytest.raises(ConfigError, match="parallel.cp=2"):
        trace_multirank(hybrid, layout=ParallelLayout(cp=2), seq_lens=LENS)
    with pytest.raises(ConfigError, match="parallel.tp=4"):
        trace_multirank(TINY, layout=ParallelLayout(tp=4), seq_lens=LENS)  # 2 KV groups


def test_cli_refuses_fake_tensors_for_a_multi_rank_trace(tmp_path, capsys):
    from waveplan.planner.cli import main

    step = tmp_path / "s.jsonl"
    step.write_text(json.dumps({"id": "a", "prompt": "p", "prompt_tokens": 8,
                                "completion_tokens": 56}) + "\n")
    assert main(["trace", str(step), "--model", "qwen3-8b", "--tp", "2",
                 "--device", "cpu-fake"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device=cpu-fake" in err[0], err


@pytest.mark.slow
def test_te_gpu_kernels_run_on_every_rank_with_the_same_loss():
    """`kernels="te-gpu"` on TP2+SP: every rank runs the GPU kernels' allocation models
    (gpu_kernels), the loss is the torch-cpu kernels' loss, the record names the kernel set and
    the fused kernels hold less than torch's ops."""
    from waveplan.pricing.measure.multirank import trace_multirank, trace_record

    layout = ParallelLayout(tp=2, sequence_parallel=True)
    kw = dict(layout=layout, seq_lens=LENS, recompute=Recompute(mode="none"), timeout_s=TIMEOUT_S)
    cpu = trace_multirank(TINY, **kw)
    te = trace_multirank(TINY, kernels="te-gpu", **kw)
    assert [r.loss_sum for r in te.ranks] == pytest.approx([r.loss_sum for r in cpu.ranks], rel=1e-3)
    rec = trace_record(te, TINY)
    assert rec["cell"]["kernels"] == rec["trace"]["kernels"] == "te-gpu"
    assert "kernels" not in trace_record(cpu, TINY)["cell"]
    assert any(n.startswith("te-gpu kernel set") for n in te.notes)
    assert te.peak_bytes < cpu.peak_bytes
    with pytest.raises(ConfigError, match="kernels"):
        trace_multirank(TINY, layout=layout, seq_lens=LENS, kernels="cudnn")
