"""Ulysses sequence parallelism under FSDP2 (veRL's layout): pricing/fsdp/ulysses.py,
pricing/measure/fsdp_verl_trace.py; docs/memory-model.md#fsdp-ulysses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from waveplan.planner import Planner
from waveplan.planner.cli import main
from waveplan.pricing.errors import ConfigError
from waveplan.pricing.fsdp import build_fsdp_model
from waveplan.pricing.fsdp.check import price_record
from waveplan.pricing.fsdp.model import for_step
from waveplan.pricing.fsdp.ulysses import pad_row_bound
from waveplan.pricing.model_source import load_model
from waveplan.pricing.step import Step, bundled_step, load_step
from waveplan.pricing.wave_pricer import WavePricer

TRACES = Path(__file__).resolve().parents[2] / "bench" / "results" / "fsdp_ulysses_traces.jsonl"
SMALL = dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
             tie_word_embeddings=False)


def test_recorded_ulysses_traces_never_under():
    """Every committed Ulysses trace (bench/fsdp_ulysses_validation.py) is priced at or above
    its busiest rank's peak."""
    records = [json.loads(line) for line in TRACES.read_text().splitlines()]
    assert records and {r["ulysses"] for r in records} >= {2, 4}
    for rec in records:
        assert price_record(rec).raw_bytes >= rec["peak_bytes"], rec["class"]


def _price(model, lens):
    model, step = for_step(model, Step.from_lengths([0] * len(lens), lens))
    return WavePricer.build(step, model).price([np.arange(len(lens))])


@pytest.mark.parametrize("attn", ["flash", "sdpa", "eager"])
def test_ulysses_splits_the_rows_not_the_parameters(attn):
    g = load_model("qwen3-8b")
    lens = [6000, 3000, 1001]
    kw = dict(fsdp=8, attn=attn, attn_rows=1)
    m1, m2 = build_fsdp_model(g, **kw), build_fsdp_model(g, ulysses=2, **kw)
    one, two = _price(m1, lens), _price(m2, lens)
    four = _price(build_fsdp_model(g, ulysses=4, **kw), lens)
    assert four.raw_bytes < two.raw_bytes < one.raw_bytes
    # the gathered parameters are sharded over the whole FSDP group, whatever the sp group;
    # Ulysses adds only the ceil(S / N) row bound to the constant
    assert m2.charges.resident - pad_row_bound(m2.charges.walk) == pytest.approx(m1.charges.resident)
    assert m1.charges.start == m2.charges.start > 0


def test_ulysses_rows_per_rank_round_up():
    """A rank gets ceil(S / N) rows of the padded packed row: at Ulysses 4, 10001 tokens cost
    a whole rank row more than 10000, and 10004 only the caller's three more logical rows."""
    g = load_model("qwen3-8b")
    m = build_fsdp_model(g, fsdp=8, ulysses=4)
    assert m.rows_cp == 4
    p0, p1, p4 = (_price(m, [n]).raw_bytes for n in (10000, 10001, 10004))
    assert p1 - p0 > 100 * m.charges.walk.caller
    assert p4 - p1 == pytest.approx(3 * m.charges.walk.caller, abs=2)


@pytest.mark.parametrize("kw, field", [
    (dict(fsdp=8, ulysses=3), "num_attention_heads"),
    (dict(fsdp=2, ulysses=4), "fsdp=2"),
])
def test_ulysses_validation(kw, field):
    with pytest.raises(ConfigError, match=field):
        build_fsdp_model(load_model("qwen3-8b"), **kw)


def test_ulysses_kv_heads_must_divide_or_be_divided():
    cfg = dict(SMALL, num_attention_heads=12, num_key_value_heads=3, head_dim=16, hidden_size=192)
    with pytest.raises(ConfigError, match="num_key_value_heads=3"):
        Planner.from_hf_config(cfg, framework="fsdp", fsdp=4, ulysses=4)
    # kv heads fewer than N and dividing it: veRL repeats them
    cfg = dict(SMALL, num_attention_heads=8, num_key_value_heads=2, head_dim=16, hidden_size=128)
    assert Planner.from_hf_config(cfg, framework="fsdp", fsdp=4, ulysses=4).model.rows_cp == 4


def test_cli_ulysses_price_plan_and_refusal(capsys):
    assert main(["price", "grpo-8x8", "--model", "qwen3-8b", "--framework", "fsdp", "--fsdp", "8",
                 "--ulysses", "2", "--json"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert main(["price", "grpo-8x8", "--model", "qwen3-8b", "--framework", "fsdp", "--fsdp", "8",
                 "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert two["raw_bytes"] < one["raw_bytes"]
    assert main(["plan", "grpo-8x8", "--model", "qwen3-8b", "--framework", "fsdp", "--fsdp", "8",
                 "--ulysses", "4", "--free-gib", "40", "--deterministic"]) == 0
    assert "Ulysses 4" in capsys.readouterr().out
    assert main(["price", "grpo-8x8", "--model", "qwen3-8b", "--framework", "fsdp", "--fsdp", "4",
                 "--ulysses", "8"]) == 2
    err = capsys.readouterr().err
    assert "ulysses=8" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_planner_with_ulysses_plans_fewer_waves_deterministically():
    step = load_step(bundled_step("grpo-8x8"))
    waves = {}
    for n in (1, 2):
        planner = Planner.from_preset("qwen3-8b", framework="fsdp", fsdp=8, ulysses=n)
        a = planner.plan(step, free_bytes=40 * 2**30, deterministic=True)
        b = planner.plan(step, free_bytes=40 * 2**30, deterministic=True)
        assert [w.request_ids for w in a.waves] == [w.request_ids for w in b.waves]
        assert all(w.price.admitted_bytes <= 40 * 2**30 for w in a.waves)
        waves[n] = len(a.waves)
    assert waves[2] < waves[1]


def test_live_ulysses_trace_matches_and_is_priced_above():
    """A real 2-rank gloo run: veRL's pad-and-slice and all-to-all around sdpa compute the same
    log-probs as one rank with the whole row (veRL's head gathers them over the sp group), and
    the busiest rank's peak is under its price. 97 + 64 tokens: veRL pads the row to 162."""
    from waveplan.pricing.measure.fsdp_verl_trace import trace_fsdp_verl

    lens = [(97, 64)]
    one = trace_fsdp_verl(SMALL, jobs=lens, fsdp=2, ulysses=1, head="verl", attn="sdpa",
                          checkpointing=True, lora_rank=4)[0]
    two = trace_fsdp_verl(SMALL, jobs=lens, fsdp=2, ulysses=2, head="verl", attn="sdpa",
                          checkpointing=True, lora_rank=4)[0]
    assert two.warmup_losses[0] == pytest.approx(one.warmup_losses[0], rel=2e-2)
    assert two.warmup_losses[0] == two.warmup_losses[1]
    assert two.peak_bytes < one.peak_bytes
    for trace in (one, two):
        assert price_record(trace.to_dict()).raw_bytes >= trace.peak_bytes


# --- veRL's heads (pricing/fsdp/verl_head.py; docs/memory-model.md#fsdp-verl-head) ---------


def test_verl_heads_price_and_basis():
    g = load_model("qwen3-8b")
    lens = [3000, 1000]
    prices = {h: _price(build_fsdp_model(g, fsdp=8, head=h, backend="torch-cpu", attn="sdpa",
                                         attn_rows=1), lens) for h in
              ("transformers", "verl", "verl-chunked", "verl-fused")}
    assert prices["verl-fused"].raw_bytes < prices["transformers"].raw_bytes
    assert prices["transformers"].raw_bytes < prices["verl-chunked"].raw_bytes
    # the torch paths are traced on the CPU (evidence); the GPU terms and Triton are models
    assert prices["verl"].basis == "evidence" and prices["verl-fused"].basis == "conservative"
    gpu = _price(build_fsdp_model(g, fsdp=8, head="verl", backend="te-gpu", attn="sdpa",
                                  attn_rows=1), lens)
    assert gpu.basis == "conservative" and any("CUDA autocast" in r for r in gpu.reasons)
    assert gpu.raw_bytes > prices["verl"].raw_bytes


def test_head_choice_travels_and_default_is_unchanged():
    """The default layout's dict is what it was (no `head` key); a veRL head round-trips."""
    from waveplan.pricing.fsdp import FsdpLayout

    assert "head" not in FsdpLayout().to_dict()
    lay = FsdpLayout(head="verl-chunked")
    assert FsdpLayout.from_dict(lay.to_dict()) == lay
    with pytest.raises(ConfigError, match="head"):
        FsdpLayout(head="liger")


def test_cli_head_under_fsdp(capsys):
    assert main(["price", "grpo-8x8", "--model", "qwen3-8b", "--framework", "fsdp", "--fsdp", "8",
                 "--head", "verl-fused", "--json"]) == 0
    fused = json.loads(capsys.readouterr().out)
    assert main(["price", "grpo-8x8", "--model", "qwen3-8b", "--framework", "fsdp", "--fsdp", "8",
                 "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert fused["raw_bytes"] < plain["raw_bytes"]
    assert main(["price", "grpo-8x8", "--model", "qwen3-8b", "--framework", "fsdp",
                 "--head", "full-te"]) == 2
    err = capsys.readouterr().err
    assert "--head" in err and "Traceback" not in err


def test_forward_start_prices_a_short_wave():
    """FSDP2's first all-gathers (the root's and layer 0's, each flat output beside its
    unsharded copy) bind a short wave: a 16-token wave of a hidden-256 Llama was traced at
    11,650,432 B above rest on 2 gloo ranks (bench/results/fsdp_ulysses_validation.txt)."""
    cfg = dict(SMALL, hidden_size=256, intermediate_size=704, num_attention_heads=8,
               num_key_value_heads=4, head_dim=32, vocab_size=4096)
    rec = dict(config=cfg, fsdp=2, attn="sdpa", checkpointing=True, lora_rank=16, seq_lens=[16])
    price = price_record(rec)
    assert price.binding == "forward-start" and price.raw_bytes >= 11_650_432
