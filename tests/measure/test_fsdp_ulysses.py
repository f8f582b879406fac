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
from waveplan.pricing.walk import MLP_NOGRAD, MLP_WORKSPACE
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
    # (a layer priced at two points, as flash's: the bound is over the larger of them)
    w = m2.charges.walk
    if w.mlp_points.shape[1]:
        w = w._replace(nograd=np.maximum(w.nograd, w.mlp_points[MLP_NOGRAD]),
                       workspace=np.maximum(w.workspace, w.mlp_points[MLP_WORKSPACE]))
    assert m2.charges.resident - pad_row_bound(w) == pytest.approx(m1.charges.resident)
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


# --- the all-to-all at eager's points (pricing/fsdp/ulysses.py attention_points) ----------


def test_eager_all_to_all_is_not_charged_beside_the_scores_gradients():
    """sdpa: the whole all-to-all beside the S x S terms at both points; eager: the gathered
    q/k/v beside the scores at the forward, the in-flight all-to-all and the backward's
    all-to-alls instead of them (the larger of the two), so the eager price drops by at most
    the all-to-all's bytes and only at the attention's points."""
    from waveplan.pricing.fsdp import terms, ulysses

    g = load_model("qwen3-8b")
    m = build_fsdp_model(g, fsdp=8, ulysses=2, attn="eager", attn_rows=4096)
    w = terms.widths(g, max(s.rank for s in m.lora.slots))
    gathered, flight = ulysses.all_to_all_parts(w, 2)
    assert ulysses.attention_points(w, 2, "sdpa") == ((gathered + flight, 0.0), (gathered + flight, 0.0))
    assert ulysses.attention_points(w, 2, "eager") == ((gathered, flight), (0.0, gathered + flight))
    assert ulysses.attention_points(w, 1, "eager") == ((0.0, 0.0), (0.0, 0.0))
    walk = m.charges.walk
    # the S x S gradients (12 nh per rank row and attention row) exceed the all-to-all here
    f_mlp, f_att = terms.layer_forward_per_row(w, qk_norm=g.qk_norm)
    assert walk.nograd[1] == pytest.approx(f_att + gathered + 12 * w.nh * 4096)
    b_mlp, b_att = terms.layer_backward_per_row(w, checkpointing=True, qk_norm=g.qk_norm, attn="eager")
    assert walk.workspace[1] == pytest.approx(max(b_mlp, b_att + 12 * w.nh * 4096))


# --- sdpa without a mask on one sequence (pricing/fsdp/model.py maskless_sdpa) -------------


def test_transformers_builds_no_sdpa_mask_for_one_sequence():
    """What `maskless_sdpa` reads from transformers 5.10, checked on the CPU: position ids of one
    sequence give no mask (sdpa runs is_causal); restarting position ids give the packed mask."""
    import torch
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)
    cfg._attn_implementation = "sdpa"
    embeds = torch.zeros(1, 12, 64)
    one = torch.arange(12)[None]
    two = torch.cat([torch.arange(7), torch.arange(5)])[None]
    assert create_causal_mask(config=cfg, inputs_embeds=embeds, attention_mask=None,
                              past_key_values=None, position_ids=one) is None
    mask = create_causal_mask(config=cfg, inputs_embeds=embeds, attention_mask=None,
                              past_key_values=None, position_ids=two)
    assert mask is not None and tuple(mask.shape) == (1, 1, 12, 12)


@pytest.mark.parametrize("ckpt", [True, False])
def test_one_sequence_sdpa_prices_no_mask(ckpt):
    """A step of one request under sdpa: no S x S term (held mask, kernel copy, kept mask); a
    step of two keeps them for every wave the planner may form, eager and Ulysses keep them,
    and so does a sliding window shorter than the row."""
    g = load_model("qwen3-8b")
    n = 6000
    kw = dict(fsdp=8, checkpointing=ckpt, attn_rows=1)
    sdpa = build_fsdp_model(g, attn="sdpa", **kw)
    one_m, one_s = for_step(sdpa, Step.from_lengths([0], [n]))
    assert one_m.one_sequence and one_m.to_dict()["one_sequence"] is True
    two_m, _ = for_step(sdpa, Step.from_lengths([0, 0], [n // 2, n // 2]))
    assert not two_m.one_sequence and "one_sequence" not in two_m.to_dict()
    one = WavePricer.build(one_s, one_m).price([np.arange(1)]).raw_bytes
    masked = WavePricer.build(one_s, dataclasses_replace(one_m, one_sequence=False)).price([np.arange(1)]).raw_bytes
    # the held bool mask (S^2) at least, and without checkpointing each layer's kept bf16 copy
    assert masked - one >= n * n * (1 + (2 * g.num_layers if not ckpt else 0))
    planned, _ = for_step(sdpa, Step.from_lengths([0], [n]), budget_bytes=40 * 2**30)
    assert planned.one_sequence
    for other in (build_fsdp_model(g, attn="eager", **kw), build_fsdp_model(g, attn="sdpa", ulysses=2, **kw)):
        assert not for_step(other, Step.from_lengths([0], [n]))[0].one_sequence
    mistral = load_model_config(dict(SMALL, model_type="mistral", sliding_window=64))
    slid = build_fsdp_model(mistral, attn="sdpa", **kw)
    assert not for_step(slid, Step.from_lengths([0], [64]))[0].one_sequence
    assert for_step(slid, Step.from_lengths([0], [63]))[0].one_sequence
    # the model round-trips with the flag
    from waveplan.pricing.fsdp.model import FsdpPricingModel

    assert FsdpPricingModel.from_dict(one_m.to_dict()).one_sequence


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def load_model_config(cfg):
    from waveplan.pricing.hf_config import load_hf_config

    return load_hf_config(dict(cfg))


# --- calibrate on Ulysses and veRL-head traces (pricing/fsdp/calibrate.py) -----------------


def test_calibrate_fits_ulysses_and_verl_head_traces(tmp_path, capsys):
    """`waveplan calibrate` on `trace --framework fsdp --ulysses N` / `--head verl...` records:
    each record priced with its own layout and its device's head dtypes (a CPU record of a veRL
    head against the default te-gpu base is not priced at the GPU's fp32 head), every record
    covered with the margin, and the fit close to the records (worst under +20%)."""
    from waveplan.pricing.coefficients import load_table
    from waveplan.pricing.fsdp import calibrate as fc
    from waveplan.pricing.fsdp.verl_head import gpu_dtypes

    records = [json.loads(line) for line in TRACES.read_text().splitlines()]
    picked = ([r for r in records if r["ulysses"] == 2 and r["head"] == "transformers"][:2]
              + [r for r in records if r["head"] == "verl"][:2]
              + [r for r in records if r["head"] == "verl-chunked"][:1])
    assert {r["ulysses"] for r in picked} == {1, 2} and {r["head"] for r in picked} >= {"verl", "verl-chunked"}
    src = tmp_path / "uly.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in picked))
    out = tmp_path / "fitted.json"
    assert main(["calibrate", str(src), "--out", str(out)]) == 0   # base: te-gpu
    assert "5 fsdp traces" in capsys.readouterr().out
    table = load_table(str(out))
    assert gpu_dtypes(table)            # fitted from te-gpu: prices the GPU's head
    ratios = []
    for rec in picked:
        cpu = fc.device_table(table, rec["device"])
        assert not gpu_dtypes(cpu) and fc.factors(cpu) == fc.factors(table)
        ratios.append(price_record(rec, table=cpu).raw_bytes / rec["peak_bytes"])
    assert min(ratios) >= (1 + fc.MARGIN) * 0.99999 and max(ratios) < 1.2
    # fitted from torch-cpu, whatever its name, a table keeps the CPU's head
    assert main(["calibrate", str(src), "--base", "torch-cpu", "--out", str(out)]) == 0
    capsys.readouterr()
    table = load_table(str(out))
    assert table.backend != "torch-cpu" and not gpu_dtypes(table)
    assert fc.device_table(table, "cpu") is table
