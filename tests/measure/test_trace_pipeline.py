"""Pipeline traces: two gloo ranks run Megatron-core's own 1F1B schedule over variable-length
micro-batches; each stage reports its peak, when it happened and every phase in schedule
order, and no priced stage is under its trace."""

from __future__ import annotations

import json
import textwrap

import pytest
from gloo_ranks import run_ranks

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from waveplan.pricing.errors import ConfigError  # noqa: E402
from waveplan.pricing.geometry import AttentionSpec, MixerKind, MlpKind, ModelGeometry  # noqa: E402
from waveplan.pricing.parallel import ParallelLayout  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

# a hang guard only: cold imports of two ranks on a busy machine are slow
TIMEOUT_S = 900
TINY = ModelGeometry(name="tiny", hidden=256, ffn=768, vocab=1024,
                     layers=((MixerKind.ATTENTION, MlpKind.DENSE),) * 2,
                     attention=AttentionSpec(4, 2, 64))
WAVES = [[96, 32], [160], [64]]

WORKER = textwrap.dedent("""
    import datetime, faulthandler, json, os, sys, warnings
    faulthandler.dump_traceback_later(TIMEOUT_S - 30, exit=True)
    warnings.filterwarnings("ignore")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    import torch
    import torch.distributed as dist
    from waveplan.pricing.measure.pipeline_trace import trace_pipeline_rank

    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    spec = json.loads(open(sys.argv[4]).read())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    result = trace_pipeline_rank(spec)
    with open(out, "w") as f:
        json.dump(result, f)
    dist.barrier()
    os._exit(0)
""").replace("TIMEOUT_S", str(TIMEOUT_S))


@pytest.mark.slow
def test_pp2_stages_report_their_1f1b_phases_and_prices_cover_them(tmp_path):
    from waveplan.pricing.coefficients import load_table
    from waveplan.pricing.lora import LoraConfig, LoraSlot
    from waveplan.pricing.measure.pipeline_trace import pipeline_spec
    from waveplan.pricing.model import PricingModel
    from waveplan.pricing.parallel import Recompute
    from waveplan.pricing.price import GroupLoad
    from waveplan.pricing.stage_price import price_stages

    spec = pipeline_spec(TINY, layout=ParallelLayout(pp=2), waves=WAVES, timeout_s=TIMEOUT_S)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ranks = run_ranks(script, tmp_path, 2,
                      lambda r, port, out: [str(r), str(port), str(out), str(tmp_path / "spec.json")],
                      TIMEOUT_S, what="pipeline trace (PP2)")
    got = [r[0] for r in ranks]
    assert [(r["stage"], r["layers"]) for r in got] == [(0, [0, 1]), (1, [1, 2])]
    # the phases in schedule order: stage 0 warms up with one extra forward, the last stage
    # alternates (1F1B), and each ends with the cool-down backward
    order = [[(m, ph) for m, ph, _ in r["phases"] if ph in ("forward", "backward")] for r in got]
    f, b = "forward", "backward"
    assert order[0] == [(0, f), (1, f), (0, b), (2, f), (1, b), (2, b)]
    assert order[1] == [(0, f), (0, b), (1, f), (1, b), (2, f), (2, b)]
    for r in got:
        assert r["peak_bytes"] == max(p[2] for p in r["phases"]) > 0
        m, ph = r["peak_at"]
        assert [m, ph, r["peak_bytes"]] in r["phases"]
        assert r["baseline_bytes"] > 0
    # only the last stage computes a loss
    assert got[0]["loss_sum"] == 0.0 and got[1]["loss_sum"] != 0.0
    # priced as the bench prices a traced cell: no stage under its trace
    model = PricingModel(geometry=TINY, parallel=ParallelLayout(pp=2), recompute=Recompute(),
                         lora=LoraConfig(slots=(LoraSlot(rank=16),), grad_bytes=2),
                         table=load_table("torch-cpu"), head="full-native", safety=1.0)
    waves = [([GroupLoad(packed_rows=sum(w), padded_rows=sum(w), logical_rows=sum(w),
                         segments=len(w))], frozenset({"default"}) if i == 0 else frozenset())
             for i, w in enumerate(WAVES)]
    priced = price_stages(model, waves, [2**62] * 2, profiled=True,
                          max_len=max(max(w) for w in WAVES))
    for p, r in zip(priced, got, strict=True):
        assert p.peak_bytes >= r["peak_bytes"], (p, r["peak_bytes"])


def test_bad_pipeline_traces_are_refused_before_any_process_starts():
    from waveplan.pricing.measure.pipeline_trace import trace_pipeline

    with pytest.raises(ConfigError, match="parallel.pp=1"):
        trace_pipeline(TINY, layout=ParallelLayout(), waves=WAVES)
    with pytest.raises(ConfigError, match="num_layers=1"):
        trace_pipeline(TINY, layout=ParallelLayout(pp=2), waves=WAVES, num_layers=1)
    with pytest.raises(ConfigError, match="waves="):
        trace_pipeline(TINY, layout=ParallelLayout(pp=2), waves=[[96], []])
    with pytest.raises(ConfigError, match="parallel="):
        trace_pipeline(TINY, layout=ParallelLayout(pp=2, cp=2), waves=WAVES)


def test_cli_cuts_a_step_into_consecutive_micro_batches():
    from waveplan.planner.cmd_trace import micro_batches

    assert micro_batches([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4, 5]]
    assert micro_batches([1, 2, 3], 3) == [[1], [2], [3]]
    assert sum(micro_batches(list(range(10)), 4), []) == list(range(10))
