"""Bundled presets carry exactly the public config values, and load by name."""

from __future__ import annotations

import json
import re
from importlib import resources

import pytest

from waveplan.pricing.errors import ConfigError
from waveplan.pricing.geometry import (
    AttentionSpec,
    GdnSpec,
    LayerSpec,
    MixerKind,
    MlaSpec,
    MlpKind,
    ModelFeatures,
    ModelGeometry,
    MoeSpec,
)
from waveplan.pricing.presets import (
    expand_layers,
    geometry_from_preset_dict,
    list_presets,
    load_preset,
)

A, G = MixerKind.ATTENTION, MixerKind.GDN
D, M = MlpKind.DENSE, MlpKind.MOE
HYBRID = (G, G, G, A)

EXPECTED = {
    "qwen3-8b": ModelGeometry(
        name="qwen3-8b", hidden=4096, ffn=12288, vocab=151936,
        layers=tuple(LayerSpec(A, D) for _ in range(36)),
        attention=AttentionSpec(num_heads=32, num_kv_groups=8, head_dim=128)),
    "llama-3.1-8b": ModelGeometry(
        name="llama-3.1-8b", hidden=4096, ffn=14336, vocab=128256,
        layers=tuple(LayerSpec(A, D) for _ in range(32)),
        attention=AttentionSpec(num_heads=32, num_kv_groups=8, head_dim=128)),
    "qwen3-30b-a3b": ModelGeometry(
        name="qwen3-30b-a3b", hidden=2048, ffn=0, vocab=151936,
        layers=tuple(LayerSpec(A, M) for _ in range(48)),
        attention=AttentionSpec(num_heads=32, num_kv_groups=4, head_dim=128),
        moe=MoeSpec(num_experts=128, top_k=8, expert_ffn=768, shared_expert_ffn=0)),
    "qwen3.8-27b": ModelGeometry(
        name="qwen3.8-27b", hidden=5120, ffn=17408, vocab=248320,
        layers=tuple(LayerSpec(HYBRID[i % 4], D) for i in range(64)),
        attention=AttentionSpec(num_heads=24, num_kv_groups=4, head_dim=256, output_gate=True),
        gdn=GdnSpec(num_key_heads=16, num_value_heads=48, key_head_dim=128, value_head_dim=128,
                    conv_kernel=4)),
    "qwen3.6-35b-a3b": ModelGeometry(
        name="qwen3.6-35b-a3b", hidden=2048, ffn=0, vocab=248320,
        layers=tuple(LayerSpec(HYBRID[i % 4], M) for i in range(40)),
        attention=AttentionSpec(num_heads=16, num_kv_groups=2, head_dim=256, output_gate=True),
        gdn=GdnSpec(num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128,
                    conv_kernel=4),
        moe=MoeSpec(num_experts=256, top_k=8, expert_ffn=512, shared_expert_ffn=512)),
    # --- the other families (values from each model's public config.json) ---
    "qwen2.5-7b": ModelGeometry(
        name="qwen2.5-7b", hidden=3584, ffn=18944, vocab=152064,
        layers=tuple(LayerSpec(A, D) for _ in range(28)),
        attention=AttentionSpec(num_heads=28, num_kv_groups=4, head_dim=128),
        features=ModelFeatures(qk_norm=False, qkv_bias=True)),
    "mistral-7b": ModelGeometry(
        name="mistral-7b", hidden=4096, ffn=14336, vocab=32768,
        layers=tuple(LayerSpec(A, D) for _ in range(32)),
        attention=AttentionSpec(num_heads=32, num_kv_groups=8, head_dim=128)),
    "mixtral-8x7b": ModelGeometry(
        name="mixtral-8x7b", hidden=4096, ffn=0, vocab=32000,
        layers=tuple(LayerSpec(A, M) for _ in range(32)),
        attention=AttentionSpec(num_heads=32, num_kv_groups=8, head_dim=128),
        moe=MoeSpec(num_experts=8, top_k=2, expert_ffn=14336)),
    "gemma-2-9b": ModelGeometry(
        name="gemma-2-9b", hidden=3584, ffn=14336, vocab=256000, tied_embeddings=True,
        layers=tuple(LayerSpec(A, D) for _ in range(42)),
        attention=AttentionSpec(num_heads=16, num_kv_groups=8, head_dim=256),
        features=ModelFeatures(sliding_window=4096, full_attention_interval=2, attention_softcap=50.0,
                               final_softcap=30.0, embedding_scale=True, sandwich_norms=True,
                               mlp_activation="geglu")),
    "gemma-3-27b": ModelGeometry(
        name="gemma-3-27b", hidden=5376, ffn=21504, vocab=262208, tied_embeddings=True,
        layers=tuple(LayerSpec(A, D) for _ in range(62)),
        attention=AttentionSpec(num_heads=32, num_kv_groups=16, head_dim=128),
        features=ModelFeatures(qk_norm=True, sliding_window=1024, full_attention_interval=6,
                               embedding_scale=True, sandwich_norms=True, mlp_activation="geglu")),
    "deepseek-v2-lite": ModelGeometry(
        name="deepseek-v2-lite", hidden=2048, ffn=10944, vocab=102400,
        layers=(LayerSpec(A, D),) + tuple(LayerSpec(A, M) for _ in range(26)),
        attention=AttentionSpec(num_heads=16, num_kv_groups=16, head_dim=192, mla=MlaSpec(
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=0)),
        moe=MoeSpec(num_experts=64, top_k=6, expert_ffn=1408, shared_expert_ffn=2 * 1408)),
    "deepseek-v3": ModelGeometry(
        name="deepseek-v3", hidden=7168, ffn=18432, vocab=129280,
        layers=tuple(LayerSpec(A, D) for _ in range(3)) + tuple(LayerSpec(A, M) for _ in range(58)),
        attention=AttentionSpec(num_heads=128, num_kv_groups=128, head_dim=192, mla=MlaSpec(
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            q_lora_rank=1536)),
        moe=MoeSpec(num_experts=256, top_k=8, expert_ffn=2048, shared_expert_ffn=2048),
        features=ModelFeatures(router_score="sigmoid", router_groups=8, router_group_top_k=4)),
    "phi-4": ModelGeometry(
        name="phi-4", hidden=5120, ffn=17920, vocab=100352,
        layers=tuple(LayerSpec(A, D) for _ in range(40)),
        attention=AttentionSpec(num_heads=40, num_kv_groups=10, head_dim=128)),
    "gpt-oss-20b": ModelGeometry(
        name="gpt-oss-20b", hidden=2880, ffn=0, vocab=201088,
        layers=tuple(LayerSpec(A, M) for _ in range(24)),
        attention=AttentionSpec(num_heads=64, num_kv_groups=8, head_dim=64),
        moe=MoeSpec(num_experts=32, top_k=4, expert_ffn=2880),
        features=ModelFeatures(linear_bias=True, sliding_window=128, full_attention_interval=2,
                               attention_sinks=True, mlp_activation="clamped-swiglu")),
    "gpt-oss-120b": ModelGeometry(
        name="gpt-oss-120b", hidden=2880, ffn=0, vocab=201088,
        layers=tuple(LayerSpec(A, M) for _ in range(36)),
        attention=AttentionSpec(num_heads=64, num_kv_groups=8, head_dim=64),
        moe=MoeSpec(num_experts=128, top_k=4, expert_ffn=2880),
        features=ModelFeatures(linear_bias=True, sliding_window=128, full_attention_interval=2,
                               attention_sinks=True, mlp_activation="clamped-swiglu")),
    "llama-3.1-70b": ModelGeometry(
        name="llama-3.1-70b", hidden=8192, ffn=28672, vocab=128256,
        layers=tuple(LayerSpec(A, D) for _ in range(80)),
        attention=AttentionSpec(num_heads=64, num_kv_groups=8, head_dim=128)),
    "qwen3-32b": ModelGeometry(
        name="qwen3-32b", hidden=5120, ffn=25600, vocab=151936,
        layers=tuple(LayerSpec(A, D) for _ in range(64)),
        attention=AttentionSpec(num_heads=64, num_kv_groups=8, head_dim=128)),
    "qwen3-235b-a22b": ModelGeometry(
        name="qwen3-235b-a22b", hidden=4096, ffn=0, vocab=151936,
        layers=tuple(LayerSpec(A, M) for _ in range(94)),
        attention=AttentionSpec(num_heads=64, num_kv_groups=4, head_dim=128),
        moe=MoeSpec(num_experts=128, top_k=8, expert_ffn=1536)),
}


def test_list_presets_is_exactly_the_expected_sorted():
    assert list_presets() == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_has_exact_public_values(name):
    geometry = load_preset(name)
    assert geometry == EXPECTED[name]
    # Fields that dataclass equality already covers, spelled out so a failure reads plainly.
    assert geometry.to_dict() == EXPECTED[name].to_dict()
    assert geometry.dtype == "bf16" and geometry.gated_mlp
    assert geometry.tied_embeddings == name.startswith("gemma")  # Gemma ties its embeddings
    assert geometry.extra["source"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_file_name_matches_its_name_field(name):
    text = resources.files("waveplan.pricing").joinpath("data", "presets", f"{name}.json").read_text()
    assert json.loads(text)["name"] == name


def test_hybrid_pattern_is_three_gdn_then_attention():
    for name, count in (("qwen3.8-27b", 16), ("qwen3.6-35b-a3b", 10)):
        geometry = load_preset(name)
        mixers = [layer.mixer for layer in geometry.layers]
        assert mixers == list(HYBRID) * count
        assert geometry.count(A) == count and geometry.count(G) == 3 * count


def test_derived_widths_of_the_dense_hybrid():
    geometry = load_preset("qwen3.8-27b")
    assert geometry.attention.qkv_width == 24 * 256 * 2 + 2 * 4 * 256  # gated query
    assert geometry.gdn.in_proj_width == 2 * 2048 + 6144 + 6144 + 2 * 48  # q k v z beta alpha


def test_load_preset_is_case_insensitive():
    assert load_preset(" Qwen3-8B ") == load_preset("qwen3-8b")


def test_unknown_preset_names_it_and_lists_known():
    with pytest.raises(ConfigError) as info:
        load_preset("qwen9-1t")
    message = str(info.value)
    assert "preset='qwen9-1t'" in message
    for name in EXPECTED:
        assert name in message


def test_compact_layers_expand():
    assert expand_layers({"repeat": 2, "pattern": [["gdn", "moe"], ["attention", "moe"]]}) == [
        ["gdn", "moe"], ["attention", "moe"]] * 2
    assert expand_layers([["attention", "dense"]]) == [["attention", "dense"]]
    # blocks are concatenated (DeepSeek's leading dense layers)
    assert expand_layers([{"repeat": 2, "pattern": [["attention", "dense"]]},
                          {"repeat": 1, "pattern": [["attention", "moe"]]}]) == [
        ["attention", "dense"], ["attention", "dense"], ["attention", "moe"]]


def test_derived_widths_of_multi_latent_attention():
    att = load_preset("deepseek-v3").attention
    # q down 1536 + kv down 512 + rope 64, replicated; q up 128 x 192 and kv up 128 x (128 + 128)
    assert att.qkv_width == 1536 + 512 + 64 + 128 * 192 + 128 * 256
    assert att.qkv_width_per_rank(4) == 1536 + 512 + 64 + (128 * 192 + 128 * 256) / 4
    assert att.core_width == 128 * 128
    lite = load_preset("deepseek-v2-lite").attention
    assert lite.qkv_width == 512 + 64 + 16 * 192 + 16 * 256  # no query latent


def test_sliding_layers_of_the_alternating_families():
    gemma2 = load_preset("gemma-2-9b").features.sliding_layers(42)
    assert gemma2 == tuple(i % 2 == 0 for i in range(42))  # even layers slide
    gemma3 = load_preset("gemma-3-27b").features.sliding_layers(62)
    assert [i for i, s in enumerate(gemma3) if not s] == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    assert load_preset("mistral-7b").features.sliding_layers(32) == (False,) * 32


@pytest.mark.parametrize(("layers", "field", "value"), [
    ({"repeat": 0, "pattern": [["attention", "dense"]]}, "model.layers.repeat", "0"),
    ({"repeat": True, "pattern": [["attention", "dense"]]}, "model.layers.repeat", "True"),
    ({"repeat": 2, "pattern": []}, "model.layers.pattern", "[]"),
    ({"repeat": 2, "pattern": [["attention", "dense"]], "times": 3}, "model.layers", "'times'"),
])
def test_bad_compact_layers_name_field_and_value(layers, field, value):
    with pytest.raises(ConfigError, match="^" + re.escape(f"{field}={value}")):
        expand_layers(layers)


def test_preset_dict_rejects_unknown_keys():
    data = load_preset("qwen3-8b").to_dict() | {"hiden": 1}
    with pytest.raises(ConfigError, match="'hiden'"):
        geometry_from_preset_dict(data)
