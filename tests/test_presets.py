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
    MlpKind,
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
}


def test_list_presets_is_exactly_the_five_sorted():
    assert list_presets() == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_has_exact_public_values(name):
    geometry = load_preset(name)
    assert geometry == EXPECTED[name]
    # Fields that dataclass equality already covers, spelled out so a failure reads plainly.
    assert geometry.to_dict() == EXPECTED[name].to_dict()
    assert geometry.dtype == "bf16" and geometry.gated_mlp and not geometry.tied_embeddings
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
