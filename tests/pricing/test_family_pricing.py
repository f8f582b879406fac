"""Pricing of the model-family features: every preset prices the bundled step, each feature
adds exactly its term (never less than the baseline), and the basis names the features that
no trace covers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from waveplan.planner import Planner
from waveplan.planner.cli import main
from waveplan.pricing import feature_terms
from waveplan.pricing.geometry import ModelFeatures
from waveplan.pricing.lora import LoraConfig, LoraSlot, adapter_param_counts
from waveplan.pricing.model import PricingModel, layer_widths
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.presets import list_presets, load_preset
from waveplan.pricing.step import bundled_step, load_step
from waveplan.pricing.wave_pricer import WavePricer

HF = Path(__file__).resolve().parents[1] / "data" / "hf"
STEP = load_step(bundled_step("grpo-8x8"))
# presets whose families add nothing beyond the traced baseline
# (q/k/v biases and GeGLU add nothing at the peak: cpu-fake ablations, bench/family_study.py)
# (Gemma 3's sandwich norms: its traced cells meet the targets, bench/family_study.py)
EVIDENCE = {"llama-3.1-8b", "llama-3.1-70b", "mistral-7b", "mixtral-8x7b", "phi-4", "qwen3-8b",
            "qwen3-32b", "qwen3-30b-a3b", "qwen3-235b-a22b", "qwen3.8-27b", "qwen3.6-35b-a3b",
            "qwen2.5-7b", "gemma-3-27b"}
REASON_WORDS = {
    "gemma-2-9b": ["attention logit soft-capping"],
    "deepseek-v2-lite": ["multi-latent attention"],
    "deepseek-v3": ["multi-latent attention", "group-limited sigmoid routing"],
    "gpt-oss-20b": ["clamped-swiglu"],
    "gpt-oss-120b": ["clamped-swiglu"],
}


def price_step(geometry, *, head="chunked:512", parallel=None, recompute=None):
    model = PricingModel.build(geometry, parallel=parallel, recompute=recompute, head=head)
    pricer = WavePricer.build(STEP, model)
    return model, pricer.price([np.arange(len(STEP.requests))], first_slots=frozenset({"default"}))


def baseline(geometry):
    return dataclasses.replace(geometry, features=ModelFeatures(qk_norm=geometry.qk_norm))


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_prices_the_bundled_step(name):
    model, breakdown = price_step(load_preset(name))
    assert breakdown.admitted_bytes >= breakdown.raw_bytes > 0
    assert sum(breakdown.terms.values()) == pytest.approx(breakdown.raw_bytes, abs=16)
    if name in EVIDENCE:
        assert breakdown.basis == "evidence" and not breakdown.reasons
    else:
        assert breakdown.basis == "conservative"
        for words in REASON_WORDS[name]:
            assert any(words in reason for reason in breakdown.reasons), (words, breakdown.reasons)
    assert set(REASON_WORDS) | EVIDENCE == set(list_presets())


@pytest.mark.parametrize("name", sorted(REASON_WORDS) + ["qwen2.5-7b"])
def test_features_never_price_below_the_baseline(name):
    geometry = load_preset(name)
    plain = baseline(geometry)
    _, with_features = price_step(geometry)
    _, without = price_step(plain)
    if name in ("deepseek-v2-lite", "qwen2.5-7b"):  # only MLA (a shape); q/k/v biases (free)
        assert with_features == without
    else:
        assert with_features.raw_bytes > without.raw_bytes
    assert without.basis == ("conservative" if geometry.attention.mla is not None else "evidence")


def test_feature_gaps_keep_the_layout_credit():
    """TP4 with sequence parallelism is traced (docs/memory-model.md#boundaries): a feature gap alone must not drop
    the TP and SP credit, only mark the basis."""
    gemma = load_preset("gemma-2-9b")
    model, _ = price_step(gemma, parallel=ParallelLayout(tp=4, sequence_parallel=True))
    assert model.basis == "conservative" and not model.conservative and model.width_tp == 4
    assert model.layout_gaps == () and len(model.gaps) == 1
    padded, _ = price_step(gemma, parallel=ParallelLayout(tp=8, sequence_parallel=True, cp=8))  # untraced
    assert padded.conservative and padded.layout_gaps


def test_each_layer_feature_adds_exactly_its_term():
    g = load_preset("gemma-2-9b")
    plain = baseline(g)
    widths = layer_widths(g, tp=1)
    a, b = (PricingModel.build(x).charges.walk for x in (g, plain))
    per_layer = (feature_terms.sandwich_norms_per_row(widths, sp_div=1)
                 + feature_terms.activation_per_ffn_row(g.features.mlp_activation) * widths["F"])
    assert per_layer == 2 * 6 * 3584  # GeGLU: nothing beyond SwiGLU
    np.testing.assert_allclose(a.workspace - b.workspace, per_layer)
    np.testing.assert_allclose(a.nograd - b.nograd, per_layer)
    np.testing.assert_array_equal(a.retained, b.retained)  # boundaries are unchanged
    # final-logit soft-capping: the tanh output (full head: what the trace shows); in a chunk,
    # the tanh output and the scaled logits
    assert a.head_const - b.head_const == 512 * 2 * 2 * 256000
    full_a, full_b = (PricingModel.build(x, head="full-native").charges.walk for x in (g, plain))
    assert full_a.head_retained - full_b.head_retained == pytest.approx(2 * 256000, abs=1e-6)
    assert full_a.head_transient == full_b.head_transient


def test_mla_stage_by_its_true_widths(monkeypatch):
    v3 = load_preset("deepseek-v3")
    att = v3.attention
    # queries and keys (128 heads x 192, bf16), values and output padded to 192 as the CPU
    # flash stand-in holds them, the output's 128-wide copy, the latent norms' fp32 + bf16
    expected = 2 * 128 * (4 * 192 + 128) + 6 * (1536 + 512)
    assert feature_terms.mla_stage_per_row(att, tp=1) == expected
    assert feature_terms.mla_stage_per_row(att, tp=4) == 2 * 32 * (4 * 192 + 128) + 6 * (1536 + 512)
    widths = layer_widths(v3, tp=4)
    assert widths["qkv"] == att.qkv_width_per_rank(4) and widths["core"] == 128 * 128 / 4
    # the recomputed layer's workspace carries the MLA stage in place of the fused-QKV one; on
    # te-gpu at TP1 the dense-MLP MLA layers (deepseek-v3's first three) are priced by the fused
    # kernels' MLA terms instead (docs/memory-model.md#mla-kernel-models), the MoE ones keep it
    from waveplan.pricing.geometry import MlpKind

    with_mla = PricingModel.build(v3).charges.walk.workspace
    monkeypatch.setattr(feature_terms, "mla_stage_per_row", lambda attention, tp: 0.0)
    without = PricingModel.build(v3).charges.walk.workspace
    moe = np.array([layer.mlp == MlpKind.MOE for layer in v3.layers])
    assert 0 < (~moe).sum() < moe.sum()
    np.testing.assert_allclose((with_mla - without)[moe], expected)
    np.testing.assert_allclose((with_mla - without)[~moe], 0.0)


def test_moe_features_are_charged_per_routed_row():
    oss = load_preset("gpt-oss-20b")
    widths = layer_widths(oss, tp=1)
    from waveplan.pricing.geometry import MlpKind

    extra = feature_terms.mlp_extra_per_row(oss, widths, MlpKind.MOE, ep_skew=1.0)
    # top 4 x the clamped gate and up (bf16, expert F wide); biases add nothing (traced)
    assert extra == 4 * (2 * 2 * 2880)
    # sinks: the stand-in's rescaled core output (bf16, 64 heads x 64) and per-head gate
    assert feature_terms.attention_extra_per_row(oss, widths, tp=1) == 2 * 64 * 64 + 4 * 64
    v3 = load_preset("deepseek-v3")
    assert feature_terms.router_per_row(layer_widths(v3, tp=1), v3.features) == 2 * 4 * 256


def test_mla_lora_adapters_cover_the_latent_projections():
    v3 = load_preset("deepseek-v3")
    lora = LoraConfig(slots=(LoraSlot(rank=8),))
    counts = adapter_param_counts(v3, lora, "default", 1)
    h = 7168
    attention = 8 * ((h + 1536) + (1536 + 128 * 192) + (h + 576) + (512 + 128 * 256)
                     + (128 * 128 + h))
    assert counts[5] == attention  # a MoE layer: attention adapters only
    assert counts[0] == attention + 8 * ((h + 2 * 18432) + (18432 + h))
    only_kv = LoraConfig(slots=(LoraSlot(rank=8, targets=("linear_kv_up_proj",)),))
    assert adapter_param_counts(v3, only_kv, "default", 1)[5] == 8 * (512 + 128 * 256)


def test_planner_from_hf_config_equals_from_preset(tmp_path):
    path = HF / "gemma-2-9b.json"
    by_preset = Planner.from_preset("gemma-2-9b", lora_rank=8)
    by_path = Planner.from_hf_config(path, lora_rank=8)
    by_dict = Planner.from_hf_config(json.loads(path.read_text()), lora_rank=8, name="gemma-2-9b")
    plans = [p.plan(STEP, free_bytes=80 * 2**30, deterministic=True).to_dict()
             for p in (by_preset, by_path, by_dict)]
    for plan in plans:
        plan.pop("planning_ms", None)
        plan.pop("compile_ms", None)
    assert plans[0] == plans[1] == plans[2]
    assert by_path.model.basis == "conservative"


def test_price_json_names_the_features(capsys):
    assert main(["price", str(bundled_step("grpo-8x8")), "--model", "deepseek-v3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["basis"] == "conservative"
    assert any("multi-latent attention" in r for r in data["reasons"])


def test_inspect_a_new_family_config(capsys):
    assert main(["inspect", "--model", str(HF / "gpt-oss-120b.json")]) == 0
    out = capsys.readouterr().out
    assert "36 attention/moe" in out and "128 experts, top 4" in out
    assert "sliding window 128 (full attention every 2 layers)" in out
    assert "attention sinks" in out and "clamped-swiglu MLP" in out


def test_inspect_unknown_family_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads((HF / "mistral-7b.json").read_text()) | {"model_type": "falcon"}))
    assert main(["inspect", "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model_type='falcon'" in err and "gemma2" in err


def test_no_recompute_charges_the_features_in_retained_activations():
    g = load_preset("gemma-2-9b")
    none = Recompute(mode="none")
    a = PricingModel.build(g, recompute=none).charges.walk
    b = PricingModel.build(baseline(g), recompute=none).charges.walk
    assert (a.retained > b.retained).all()


@pytest.mark.parametrize("name", list_presets())
def test_geometry_round_trips_through_its_dict(name):
    """Reports carry `to_dict()`; replay rebuilds with `from_dict` (MLA and features included)."""
    from waveplan.pricing.geometry import ModelGeometry

    geometry = load_preset(name)
    assert ModelGeometry.from_dict(json.loads(json.dumps(geometry.to_dict()))) == geometry
