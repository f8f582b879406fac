"""Every family's preset, built as a Megatron-core model on the `meta` device, reads back with
`geometry_from_megatron` as the geometry the config reader gives (shapes, layer pattern and
the features Megatron expresses: MLA, shared experts, biases, sliding windows, sinks, the
MLP activation, the router).

Dense models are built at full size; MoE models at their first five layers (their leading
dense layers included), since a meta build of hundreds of experts per layer only repeats
the same modules.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from waveplan.pricing.errors import ConfigError  # noqa: E402
from waveplan.pricing.hf_config import load_hf_config  # noqa: E402
from waveplan.pricing.lora import LoraConfig, LoraSlot, adapter_param_counts  # noqa: E402
from waveplan.pricing.measure.live_geometry import geometry_from_megatron  # noqa: E402
from waveplan.pricing.measure.megatron_build import build_gpt  # noqa: E402
from waveplan.pricing.measure.megatron_shim import init_single_process  # noqa: E402
from waveplan.pricing.parallel import ParallelLayout, Recompute  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore::UserWarning")]

HF = Path(__file__).resolve().parents[1] / "data" / "hf"
FAMILIES = ("qwen2.5-7b", "mistral-7b", "mixtral-8x7b", "gemma-2-9b", "gemma-3-27b",
            "deepseek-v2-lite", "deepseek-v3", "phi-4", "gpt-oss-20b", "gpt-oss-120b")
MOE_LAYERS = 5


@pytest.fixture(scope="module")
def megatron_tp1():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with init_single_process():
            yield


def config_geometry(name: str):
    """The config reader's geometry (MoE models: their first layers)."""
    geometry = load_hf_config(HF / f"{name}.json")
    if geometry.moe is not None:
        geometry = dataclasses.replace(geometry, layers=geometry.layers[:MOE_LAYERS])
    return geometry


@pytest.mark.parametrize("name", FAMILIES)
def test_meta_model_reads_back_the_config_geometry(megatron_tp1, name):
    geometry = config_geometry(name)
    model = build_gpt(geometry, device="meta", lora_rank=8)
    assert all(p.device.type == "meta" for p in model.parameters())
    got, layout, recompute, lora = geometry_from_megatron(model)
    assert got == geometry
    assert got.to_dict() == geometry.to_dict()
    assert layout == ParallelLayout() and recompute == Recompute()
    # the adapters found cover what the pricing charges for LoRA on every linear
    priced = adapter_param_counts(geometry, LoraConfig(slots=(LoraSlot(rank=8),)), "default", 1)
    found = adapter_param_counts(geometry, lora, "default", 1)
    assert (found == priced).all()


def test_megatron_settings_of_the_features(megatron_tp1):
    from megatron.core.activations import quick_gelu
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    oss = build_gpt(config_geometry("gpt-oss-20b"), device="meta")
    c = oss.config
    assert c.add_bias_linear and c.softmax_type == "learnable"
    assert c.window_size == (128, 0) and c.window_attn_skip_freq == 2
    assert c.activation_func is quick_gelu and c.glu_linear_offset == 1.0
    assert c.activation_func_clamp_value == 7.0
    v3 = build_gpt(config_geometry("deepseek-v3"), device="meta")
    assert isinstance(v3.decoder.layers[0].self_attention, MLASelfAttention)
    assert v3.config.moe_router_score_function == "sigmoid" and v3.config.moe_router_num_groups == 8
    assert v3.decoder.layers[3].mlp.shared_experts is not None
    qwen2 = build_gpt(config_geometry("qwen2.5-7b"), device="meta")
    assert qwen2.config.add_qkv_bias and not qwen2.config.qk_layernorm
    assert qwen2.decoder.layers[0].self_attention.linear_qkv.bias is not None  # (no LoRA here)


def test_features_megatron_lacks_come_only_from_the_builder(megatron_tp1):
    gemma = build_gpt(config_geometry("gemma-2-9b"), device="meta")
    assert gemma.waveplan_features == {"attention_softcap": 50.0, "final_softcap": 30.0,
                                       "embedding_scale": True, "sandwich_norms": True}
    del gemma.waveplan_features  # another Megatron model: nothing says it soft-caps
    got = geometry_from_megatron(gemma)[0]
    assert got.features.final_softcap == 0.0 and not got.features.sandwich_norms
    assert got.features.mlp_activation.value == "geglu" and got.features.sliding_window == 4096


def test_unknown_activation_is_named(megatron_tp1):
    import torch

    model = build_gpt(config_geometry("mistral-7b"), device="meta", num_layers=1)
    model.config.activation_func = torch.relu
    with pytest.raises(ConfigError, match="config.activation_func='relu'"):
        geometry_from_megatron(model)


def _tiny(vocab=512, **features):
    from waveplan.pricing.geometry import AttentionSpec, ModelFeatures, ModelGeometry

    return ModelGeometry(name="tiny", hidden=128, ffn=384, vocab=vocab, layers=(("attention", "dense"),) * 2,
                         attention=AttentionSpec(4, 2, 32), features=ModelFeatures(**features))


def _trace(geometry, lens):
    try:
        from waveplan.pricing.measure.trace import trace_wave
    except ImportError:
        from waveplan.pricing.measure.trace import trace_wave
    return trace_wave(geometry, seq_lens=lens, device="cpu-fake", lora_rank=8)


def test_tracer_models_the_final_softcap_and_sandwich_norms():
    """Megatron-core has neither; the builder's hooks allocate what transformers does: the tanh
    output of the capped logits (one bf16 [rows, vocab] more at the head's peak), and two more
    norms per layer."""
    rows, vocab = 256, 32768  # a vocabulary large enough for the head to bind
    plain = _trace(_tiny(vocab), [rows])
    capped = _trace(_tiny(vocab, final_softcap=30.0), [rows])
    assert capped.peak_bytes - plain.peak_bytes == 2 * vocab * rows
    assert capped.decoder_peak_bytes == plain.decoder_peak_bytes  # no head, no cap
    sandwich = _trace(_tiny(sandwich_norms=True), [rows])
    assert sandwich.decoder_peak_bytes > plain.decoder_peak_bytes


def test_mla_stand_in_attention_is_linear_in_rows():
    """Values narrower than queries (MLA) must not fall back to the math kernel's [heads, s, s]
    scores: doubling one sequence's rows about doubles the decoder's peak."""
    from waveplan.pricing.geometry import AttentionSpec, MlaSpec, ModelGeometry

    mla = MlaSpec(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    g = ModelGeometry(name="tiny-mla", hidden=128, ffn=384, vocab=512, layers=(("attention", "dense"),),
                      attention=AttentionSpec(8, 8, 48, mla=mla))
    short, long = (_trace(g, [n]).decoder_peak_bytes for n in (1024, 2048))
    assert long / short < 2.2


_MLA_TP2 = """
import dataclasses, json, warnings
warnings.simplefilter("ignore")
from waveplan.pricing.measure.megatron_build import build_gpt
from waveplan.pricing.measure.megatron_shim import init_single_process
from waveplan.pricing.parallel import ParallelLayout
from waveplan.pricing.presets import load_preset
g = load_preset("deepseek-v3")
g = dataclasses.replace(g, layers=g.layers[:1])
with init_single_process(tp=2):
    att = build_gpt(g, device="meta", layout=ParallelLayout(tp=2)).decoder.layers[0].self_attention
    print(json.dumps({n: list(getattr(att, n).weight.shape) for n in
                      ("linear_q_down_proj", "linear_kv_down_proj", "linear_q_up_proj", "linear_kv_up_proj")}))
"""


def test_mla_at_tp2_splits_the_down_projections_so_the_pricing_fails_closed():
    """Megatron-core's local spec builds MLA's down projections column-parallel (split, then
    gathered), while Transformer Engine duplicates them and the pricing replicates them: no
    trace covers MLA at TP > 1, so it is priced without TP credit, with the reason."""
    import json
    import os
    import subprocess
    import sys

    from waveplan.pricing.model import PricingModel
    from waveplan.pricing.presets import load_preset

    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    out = subprocess.run([sys.executable, "-c", _MLA_TP2], capture_output=True, text=True,
                         env=env, timeout=300, check=True).stdout
    shapes = json.loads(out.strip().splitlines()[-1])
    v3 = load_preset("deepseek-v3")
    mla, heads = v3.attention.mla, v3.attention.num_heads
    assert shapes["linear_q_down_proj"] == [mla.q_lora_rank // 2, v3.hidden]  # split, not replicated
    assert shapes["linear_kv_down_proj"] == [(mla.kv_lora_rank + mla.qk_rope_head_dim) // 2, v3.hidden]
    assert shapes["linear_q_up_proj"] == [heads * mla.qk_head_dim // 2, mla.q_lora_rank]
    model = PricingModel.build(v3, parallel=ParallelLayout(tp=2))
    assert model.basis == "conservative" and model.width_tp == 1
    assert any("multi-latent attention at TP2" in gap for gap in model.layout_gaps)
    assert PricingModel.build(v3).width_tp == 1 and not PricingModel.build(v3).layout_gaps


def _tiny_oss(**features):
    from waveplan.pricing.geometry import AttentionSpec, ModelFeatures, ModelGeometry, MoeSpec

    base = dict(linear_bias=True, attention_sinks=True, mlp_activation="clamped-swiglu",
                sliding_window=64, full_attention_interval=2)
    return ModelGeometry(name="tiny-oss", hidden=128, ffn=0, vocab=512,
                         layers=(("attention", "moe"),) * 2, attention=AttentionSpec(4, 2, 32),
                         moe=MoeSpec(num_experts=4, top_k=2, expert_ffn=128),
                         features=ModelFeatures(**dict(base, **features)))


def test_biased_experts_trace_and_sinks_add_their_rescaled_output():
    """gpt-oss-like layers (biased experts, sinks, clamped SwiGLU) trace at TP1 on cpu-fake:
    Megatron-core's in-place expert bias add runs on a copy of the FC2 output. The sinks'
    stand-in holds a rescaled core output and a per-head gate beyond the plain kernel."""
    rows = 256
    with_sinks = _trace(_tiny_oss(), [rows])
    without = _trace(_tiny_oss(attention_sinks=False), [rows])
    assert with_sinks.decoder_peak_bytes > without.decoder_peak_bytes
    assert with_sinks.decoder_peak_bytes - without.decoder_peak_bytes <= rows * (2 * 4 * 32 + 4 * 4)
    unbiased = _trace(_tiny_oss(linear_bias=False), [rows])
    assert unbiased.decoder_peak_bytes == with_sinks.decoder_peak_bytes  # biases: nothing at the peak


def test_sink_stand_in_is_a_sink_logit_in_the_softmax():
    """The stand-in's rescaled flash output equals softmax over the scores with one more
    logit per head (transformers' eager gpt-oss attention), on real tensors."""
    import torch

    from waveplan.pricing.measure.megatron_build import sdpa_attention_class

    class Config:  # what SdpaAttention reads
        attention_dropout = 0.0
        softmax_type = "learnable"
        num_attention_heads = 4
        tensor_model_parallel_size = 1
        params_dtype = torch.float32

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        att = sdpa_attention_class()(Config(), softmax_scale=0.25)
    att.softmax_offset.data = torch.tensor([0.5, -1.0, 2.0, 0.0])
    q, k, v = (torch.randn(1, 4, 6, 8) for _ in range(3))  # [b, heads, s, d]
    got = att._sdpa(q, k, v)
    scores = (q @ k.transpose(-1, -2)) * 0.25
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    sink = att.softmax_offset.detach().view(1, 4, 1, 1).expand(1, 4, 6, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    torch.testing.assert_close(got, probs @ v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen1.5-moe-a2.7b", "internlm2-chat-1_8b"])
def test_families_without_a_preset_read_back(megatron_tp1, name):
    """Qwen2-MoE's gated shared expert is Megatron's `moe_shared_expert_gate`; InternLM2 is a
    plain GQA decoder."""
    geometry = load_hf_config(HF.parent / "hf_more" / f"{name}.json")
    if geometry.moe is not None:
        geometry = dataclasses.replace(geometry, layers=geometry.layers[:2])
    model = build_gpt(geometry, device="meta", lora_rank=8)
    assert model.config.moe_shared_expert_gate == geometry.features.shared_expert_gate
    assert geometry_from_megatron(model)[0] == geometry
