"""Config reading of the families beyond Llama/Qwen3: each family's field names, defaults and
layer rules, the features it sets, and `transformers` config objects.

The fixtures in data/hf are the public config.json files; data/hf_transformers holds what
transformers 5.24's config classes make of the same files (`to_dict()` of
`CONFIG_MAPPING[model_type](**config)`), which spells some fields differently (Qwen3-MoE's
num_local_experts) and fills in every default.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from waveplan.pricing.errors import ConfigError
from waveplan.pricing.geometry import MixerKind, MlpActivation, MlpKind, RouterScore
from waveplan.pricing.hf_config import SUPPORTED_MODEL_TYPES, load_hf_config
from waveplan.pricing.model import has_qk_norm
from waveplan.pricing.presets import list_presets, load_preset

HF = Path(__file__).resolve().parents[1] / "data" / "hf"
TF = Path(__file__).resolve().parents[1] / "data" / "hf_transformers"

NEW_TYPES = ("qwen2", "mistral", "mixtral", "gemma2", "gemma3", "gemma3_text", "deepseek_v2",
             "deepseek_v3", "phi3", "gpt_oss")


def raw(name: str) -> dict:
    return json.loads((HF / f"{name}.json").read_text())


def named(field: str, value: object) -> str:
    return re.escape(f"{field}={value!r}")


class FakeTransformersConfig:
    """Stands in for a transformers PretrainedConfig: the reader only calls to_dict()."""

    def __init__(self, data: dict) -> None:
        self._data = data

    def to_dict(self) -> dict:
        return dict(self._data)


def test_every_listed_family_is_supported():
    assert set(NEW_TYPES) <= set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("name", sorted(p.stem for p in TF.glob("*.json")))
def test_transformers_config_objects_load_equal_to_presets(name):
    stored = json.loads((TF / f"{name}.json").read_text())
    geometry = load_hf_config(FakeTransformersConfig(stored["to_dict"]), name=name)
    assert geometry == load_preset(name)
    assert geometry.extra["source"] == "<FakeTransformersConfig>"


def test_every_preset_has_a_transformers_dict():
    assert sorted(p.stem for p in TF.glob("*.json")) == list_presets()


def test_unsupported_input_type_is_named():
    with pytest.raises(ConfigError, match=named("config", "int")):
        load_hf_config(42)


def test_unknown_family_lists_the_new_ones_too():
    with pytest.raises(ConfigError, match=named("model_type", "falcon")) as info:
        load_hf_config(raw("mistral-7b") | {"model_type": "falcon"})
    for model_type in NEW_TYPES:
        assert model_type in str(info.value)


# --- Qwen2 ------------------------------------------------------------------------------------


def test_qwen2_has_qkv_bias_and_no_qk_norm_despite_its_name():
    geometry = load_hf_config(raw("qwen2.5-7b"), name="qwen2.5-7b")
    assert geometry.features.qkv_bias and not geometry.qk_norm and not has_qk_norm(geometry)
    assert geometry.features.sliding_window == 0  # use_sliding_window false


@pytest.mark.parametrize(("max_window_layers", "window", "interval"), [(0, 4096, 0), (28, 0, 0)])
def test_qwen2_use_sliding_window_from_max_window_layers(max_window_layers, window, interval):
    data = raw("qwen2.5-7b") | {"use_sliding_window": True, "sliding_window": 4096,
                                "max_window_layers": max_window_layers}
    features = load_hf_config(data).features
    assert (features.sliding_window, features.full_attention_interval) == (window, interval)


def test_qwen2_partial_window_layers_fail_closed():
    data = raw("qwen2.5-7b") | {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20}
    with pytest.raises(ConfigError, match="unsupported sliding-window pattern"):
        load_hf_config(data)


# --- Mistral, Mixtral, Phi-3 --------------------------------------------------------------------


def test_mistral_sliding_window_null_absent_and_set():
    data = raw("mistral-7b")
    assert load_hf_config(data).features.sliding_window == 0  # null: none
    del data["sliding_window"]
    absent = load_hf_config(data).features  # MistralConfig's default: 4096 on every layer
    assert (absent.sliding_window, absent.full_attention_interval) == (4096, 0)


def test_mistral_head_dim_defaults_to_hidden_over_heads():
    assert load_hf_config(raw("mistral-7b")).attention.head_dim == 4096 // 32
    assert load_hf_config(raw("mistral-7b") | {"head_dim": 64}).attention.head_dim == 64


def test_mixtral_intermediate_size_is_the_expert_width():
    geometry = load_hf_config(raw("mixtral-8x7b"))
    assert geometry.ffn == 0 and geometry.moe.expert_ffn == 14336
    assert geometry.moe.num_experts == 8 and geometry.moe.top_k == 2
    assert "hf_intermediate_size" not in geometry.extra
    assert all(layer.mlp == MlpKind.MOE for layer in geometry.layers)
    data = raw("mixtral-8x7b")
    del data["num_local_experts"]
    with pytest.raises(ConfigError, match=named("num_local_experts", None)):
        load_hf_config(data)


def test_phi3_sliding_window_applies_to_every_layer():
    assert load_hf_config(raw("phi-4")).features == load_preset("mistral-7b").features
    features = load_hf_config(raw("phi-4") | {"sliding_window": 2047}).features
    assert (features.sliding_window, features.full_attention_interval) == (2047, 0)


@pytest.mark.parametrize("name", ["mistral-7b", "phi-4", "gemma-2-9b", "gpt-oss-20b", "deepseek-v3"])
def test_activation_is_checked_against_the_family(name):
    data = raw(name)
    key = "hidden_activation" if "hidden_activation" in data else "hidden_act"
    with pytest.raises(ConfigError, match=named(key, "relu")):
        load_hf_config(data | {key: "relu"})


# --- Gemma 2 and 3 ------------------------------------------------------------------------------


def test_gemma2_features_and_defaults():
    geometry = load_hf_config(raw("gemma-2-9b"))
    f = geometry.features
    assert f.mlp_activation == MlpActivation.GEGLU and f.sandwich_norms and f.embedding_scale
    assert (f.attention_softcap, f.final_softcap) == (50.0, 30.0)
    assert geometry.tied_embeddings and not has_qk_norm(geometry)
    data = raw("gemma-2-9b")
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "vocab_size"):
        del data[key]
    defaults = load_hf_config(data)  # Gemma2Config's defaults
    assert (defaults.features.attention_softcap, defaults.features.final_softcap) == (50.0, 30.0)
    assert defaults.vocab == 256000
    capped_off = load_hf_config(raw("gemma-2-9b") | {"final_logit_softcapping": None}).features
    assert capped_off.final_softcap == 0.0  # null is no cap, not the default


def test_gemma2_layer_types_when_given_must_match_a_period():
    data = raw("gemma-2-9b") | {"layer_types": ["sliding_attention", "full_attention"] * 21}
    assert load_hf_config(data).features == load_preset("gemma-2-9b").features
    odd = ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention", "full_attention"] * 19
    with pytest.raises(ConfigError, match="unsupported sliding-window pattern"):
        load_hf_config(raw("gemma-2-9b") | {"layer_types": odd})


def test_gemma3_wrapper_and_text_defaults():
    data = raw("gemma-3-27b")
    assert "vocab_size" not in data["text_config"]
    geometry = load_hf_config(data)
    assert geometry.vocab == 262208 and geometry.tied_embeddings and has_qk_norm(geometry)
    assert geometry.extra["model_type"] == "gemma3_text"
    text = data["text_config"] | {"sliding_window_pattern": 4}
    assert load_hf_config(text).features.full_attention_interval == 4
    # a gemma3 text config whose model_type says only "gemma3" (outer) reads the same
    del data["text_config"]["model_type"]
    assert load_hf_config(data, name="gemma-3-27b") == load_preset("gemma-3-27b")


def test_gemma3_text_model_without_wrapper():
    """Gemma 3 1B's config is gemma3_text at the top level."""
    text = raw("gemma-3-27b")["text_config"] | {
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512,
        "vocab_size": 262144}
    geometry = load_hf_config(text)
    assert geometry.count(MixerKind.ATTENTION) == 26 and geometry.features.sliding_window == 512
    assert geometry.attention.num_kv_groups == 1 and geometry.vocab == 262144


# --- DeepSeek V2 / V3 ---------------------------------------------------------------------------


def test_deepseek_v3_layers_mla_and_router():
    geometry = load_hf_config(raw("deepseek-v3"))
    assert [layer.mlp for layer in geometry.layers[:4]] == [MlpKind.DENSE] * 3 + [MlpKind.MOE]
    assert geometry.attention.mla.q_lora_rank == 1536
    f = geometry.features
    assert (f.router_score, f.router_groups, f.router_group_top_k) == (RouterScore.SIGMOID, 8, 4)
    assert geometry.extra["mtp_layers_not_priced"] == 1
    assert not has_qk_norm(geometry)  # MLA normalises its latents (priced by the MLA term)


def test_deepseek_moe_layer_freq_and_dense_only():
    data = raw("deepseek-v2-lite") | {"moe_layer_freq": 2, "first_k_dense_replace": 3}
    moe = [i for i, layer in enumerate(load_hf_config(data).layers) if layer.mlp == MlpKind.MOE]
    assert moe == list(range(4, 27, 2))  # i >= 3 and i % 2 == 0
    dense = raw("deepseek-v2-lite") | {"n_routed_experts": None}
    geometry = load_hf_config(dense)
    assert geometry.moe is None and all(layer.mlp == MlpKind.DENSE for layer in geometry.layers)


def test_deepseek_v2_lite_has_no_query_latent_and_two_shared_experts():
    geometry = load_hf_config(raw("deepseek-v2-lite"))
    assert geometry.attention.mla.q_lora_rank == 0
    assert geometry.moe.shared_expert_ffn == 2 * 1408
    assert geometry.features.router_score == RouterScore.SOFTMAX  # greedy softmax routing
    no_shared = load_hf_config(raw("deepseek-v2-lite") | {"n_shared_experts": None})
    assert no_shared.moe.shared_expert_ffn == 0


@pytest.mark.parametrize("field", ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                   "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok"])
def test_deepseek_required_fields(field):
    data = raw("deepseek-v3")
    del data[field]
    if field == "n_routed_experts":
        data["n_routed_experts"] = 0  # present but not a positive count
        with pytest.raises(ConfigError, match="num_experts"):
            load_hf_config(data)
        return
    with pytest.raises(ConfigError, match=named(field, None)):
        load_hf_config(data)


def test_deepseek_group_routing_checks_topk_group():
    with pytest.raises(ConfigError, match=named("topk_group", 9)):
        load_hf_config(raw("deepseek-v3") | {"topk_group": 9})
    v2 = load_hf_config(raw("deepseek-v2-lite") | {"topk_method": "group_limited_greedy",
                                                   "n_group": 8, "topk_group": 3}).features
    assert (v2.router_score, v2.router_groups, v2.router_group_top_k) == (RouterScore.SOFTMAX, 8, 3)


# --- gpt-oss ------------------------------------------------------------------------------------


def test_gpt_oss_features_and_field_spellings():
    geometry = load_hf_config(raw("gpt-oss-20b"))
    f = geometry.features
    assert f.linear_bias and f.attention_sinks and f.mlp_activation == MlpActivation.CLAMPED_SWIGLU
    assert (f.sliding_window, f.full_attention_interval) == (128, 2)
    data = raw("gpt-oss-20b")
    del data["num_experts_per_tok"]  # the release spells it experts_per_token as well
    assert load_hf_config(data).moe.top_k == 4
    del data["layer_types"]  # GptOssConfig's default: alternate, sliding first
    assert load_hf_config(data).features == f
    assert not load_hf_config(raw("gpt-oss-20b") | {"attention_bias": False}).features.linear_bias
    del data["experts_per_token"]
    with pytest.raises(ConfigError, match=named("num_experts_per_tok", None)):
        load_hf_config(data)


def test_sliding_attention_layer_type_is_refused_where_the_family_has_none():
    data = raw("llama-3.1-70b") | {"layer_types": ["sliding_attention"] * 80}
    with pytest.raises(ConfigError, match=named("layer_types", "sliding_attention")):
        load_hf_config(data)
