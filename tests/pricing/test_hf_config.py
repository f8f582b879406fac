"""Hugging Face config.json loading, and `load_model` (preset name or path)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from waveplan.pricing.errors import ConfigError
from waveplan.pricing.geometry import MixerKind, MlpKind
from waveplan.pricing.hf_config import SUPPORTED_MODEL_TYPES, load_hf_config
from waveplan.pricing.model_source import load_model
from waveplan.pricing.presets import list_presets, load_preset

HF = Path(__file__).resolve().parents[1] / "data" / "hf"
FIXTURES = sorted(p.stem for p in HF.glob("*.json"))


def raw(name: str) -> dict:
    return json.loads((HF / f"{name}.json").read_text())


def write(tmp_path: Path, data: dict, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def named(field: str, value: object) -> str:
    """Regex for an error that names `field` and `value` the way errors.bad does."""
    return re.escape(f"{field}={value!r}")


# --- every fixture equals its preset --------------------------------------------------------


def test_every_preset_has_a_fixture():
    assert FIXTURES == list_presets()


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_loads_equal_to_preset(name):
    geometry = load_hf_config(HF / f"{name}.json")
    assert geometry.name == name  # a loose file is named by its stem
    assert geometry == load_preset(name)
    assert geometry.extra["source"].endswith(f"{name}.json")


@pytest.mark.parametrize("name", FIXTURES)
def test_dict_and_path_load_the_same(name):
    assert load_hf_config(raw(name), name=name) == load_hf_config(HF / f"{name}.json")


def test_each_model_type_is_covered_by_a_fixture_or_its_text_config():
    seen = set()
    for name in FIXTURES:
        data = raw(name)
        seen.add(data["model_type"])
        if "text_config" in data:
            seen.add(data["text_config"]["model_type"])
    for path in (HF.parent / "hf_more").glob("*.json"):   # families without a preset
        seen.add(json.loads(path.read_text())["model_type"])
    assert seen - {"olmo"} == set(SUPPORTED_MODEL_TYPES)   # olmo: the --as-family fixture


# --- nesting, layer patterns, model types ---------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3.8-27b", "qwen3.6-35b-a3b"])
def test_unwrapped_text_config_loads_the_same(name):
    data = raw(name)
    text = data["text_config"] | {"tie_word_embeddings": False}
    assert load_hf_config(text, name=name) == load_preset(name)


@pytest.mark.parametrize("name", ["qwen3.8-27b", "qwen3.6-35b-a3b"])
def test_outer_model_type_is_used_when_text_config_has_none(name):
    data = raw(name)
    del data["text_config"]["model_type"]
    geometry = load_hf_config(data, name=name)
    assert geometry == load_preset(name)
    assert geometry.extra["model_type"] == data["model_type"]


def test_layer_types_and_interval_agree():
    text = raw("qwen3.8-27b")["text_config"]
    from_types = load_hf_config({k: v for k, v in text.items() if k != "full_attention_interval"})
    from_interval = load_hf_config({k: v for k, v in text.items() if k != "layer_types"})
    assert from_types == from_interval
    assert [layer.mixer for layer in from_types.layers][:4] == [
        MixerKind.GDN, MixerKind.GDN, MixerKind.GDN, MixerKind.ATTENTION]


def test_layer_types_win_over_interval():
    text = raw("qwen3.8-27b")["text_config"]
    text["layer_types"] = ["full_attention"] + ["linear_attention"] * 63
    geometry = load_hf_config(text)
    assert geometry.layers[0].mixer == MixerKind.ATTENTION
    assert geometry.count(MixerKind.ATTENTION) == 1


@pytest.mark.parametrize(("interval", "attention_at"), [(1, list(range(8))), (2, [1, 3, 5, 7]),
                                                        (3, [2, 5]), (8, [7]), (9, [])])
def test_full_attention_interval_counts_from_one(interval, attention_at):
    text = raw("qwen3.8-27b")["text_config"]
    del text["layer_types"]
    text |= {"num_hidden_layers": 8, "full_attention_interval": interval}
    geometry = load_hf_config(text)
    assert [i for i, layer in enumerate(geometry.layers)
            if layer.mixer == MixerKind.ATTENTION] == attention_at
    assert (geometry.attention is None) == (not attention_at)


def test_all_gdn_model_needs_no_attention_fields():
    text = raw("qwen3.8-27b")["text_config"]
    del text["layer_types"]
    for key in ("head_dim", "num_key_value_heads"):
        del text[key]
    text["full_attention_interval"] = 1000
    geometry = load_hf_config(text)
    assert geometry.attention is None and geometry.count(MixerKind.GDN) == 64


def test_all_attention_hybrid_needs_no_gdn_fields():
    text = raw("qwen3.8-27b")["text_config"]
    text["layer_types"] = ["full_attention"] * 64
    for key in [k for k in text if k.startswith("linear_")]:
        del text[key]
    geometry = load_hf_config(text)
    assert geometry.gdn is None and geometry.count(MixerKind.ATTENTION) == 64


def test_dense_qwen3_accepts_all_full_attention_layer_types():
    data = raw("qwen3-8b") | {"layer_types": ["full_attention"] * 36}
    assert load_hf_config(data, name="qwen3-8b") == load_preset("qwen3-8b")


def test_llama_head_dim_defaults_to_hidden_over_heads():
    data = raw("llama-3.1-8b")
    assert "head_dim" not in data
    assert load_hf_config(data).attention.head_dim == 4096 // 32
    assert load_hf_config(data | {"head_dim": 64}).attention.head_dim == 64


def test_kv_heads_default_to_attention_heads():
    data = raw("llama-3.1-8b")
    del data["num_key_value_heads"]
    assert load_hf_config(data).attention.num_kv_groups == 32


def test_attn_output_gate_false_is_honoured_for_hybrids():
    text = raw("qwen3.8-27b")["text_config"] | {"attn_output_gate": False}
    assert load_hf_config(text).attention.output_gate is False
    del text["attn_output_gate"]
    assert load_hf_config(text).attention.output_gate is True


def test_qwen3_moe_dense_layers_from_mlp_only_layers_and_sparse_step():
    data = raw("qwen3-30b-a3b") | {"mlp_only_layers": [0, 47], "decoder_sparse_step": 2}
    geometry = load_hf_config(data)
    moe_layers = [i for i, layer in enumerate(geometry.layers) if layer.mlp == MlpKind.MOE]
    assert moe_layers == [i for i in range(1, 47, 2)]  # (i + 1) % 2 == 0, minus 47
    assert geometry.ffn == 6144  # a dense layer exists, so intermediate_size is used


def test_all_moe_model_keeps_hf_intermediate_size_only_as_extra():
    geometry = load_hf_config(HF / "qwen3-30b-a3b.json")
    assert geometry.ffn == 0
    assert geometry.extra["hf_intermediate_size"] == 6144


@pytest.mark.parametrize(("value", "dtype"), [("bfloat16", "bf16"), ("float16", "fp16"),
                                              ("float32", "fp32"), ("torch.float16", "fp16")])
def test_dtype_from_torch_dtype_or_dtype(value, dtype):
    base = raw("qwen3-8b")
    del base["torch_dtype"]
    assert load_hf_config(base).dtype == "bf16"  # default when absent
    assert load_hf_config(base | {"torch_dtype": value}).dtype == dtype
    assert load_hf_config(base | {"dtype": value, "torch_dtype": "float32"}).dtype == dtype


def test_wrapper_fields_fall_back_to_outer_config():
    data = raw("qwen3.6-35b-a3b")
    data["tie_word_embeddings"] = True
    data["torch_dtype"] = "float16"
    geometry = load_hf_config(data)
    assert geometry.tied_embeddings and geometry.dtype == "fp16"
    data["text_config"]["tie_word_embeddings"] = False  # the inner value wins
    assert not load_hf_config(data).tied_embeddings


def test_name_defaults(tmp_path):
    checkpoint = tmp_path / "My-Model"
    checkpoint.mkdir()
    write(checkpoint, raw("qwen3-8b"))
    assert load_hf_config(checkpoint).name == "My-Model"
    assert load_hf_config(checkpoint / "config.json").name == "My-Model"
    assert load_hf_config(checkpoint, name="x").name == "x"
    assert load_hf_config(raw("qwen3-8b")).name == "qwen3"
    assert load_hf_config(raw("qwen3-8b") | {"_name_or_path": "Qwen/Qwen3-8B"}).name == "Qwen3-8B"


# --- errors -----------------------------------------------------------------------------------


def test_unknown_model_type_names_it_and_lists_supported(tmp_path):
    path = write(tmp_path, raw("qwen3-8b") | {"model_type": "mamba2"})
    with pytest.raises(ConfigError, match=named("model_type", "mamba2")) as info:
        load_hf_config(path)
    assert str(path) in str(info.value)
    for model_type in SUPPORTED_MODEL_TYPES:
        assert model_type in str(info.value)


def test_missing_model_type(tmp_path):
    data = raw("qwen3-8b")
    del data["model_type"]
    with pytest.raises(ConfigError, match=named("model_type", None)):
        load_hf_config(write(tmp_path, data))


REQUIRED = [
    ("qwen3-8b", "hidden_size"), ("qwen3-8b", "intermediate_size"),
    ("qwen3-8b", "num_hidden_layers"), ("qwen3-8b", "num_attention_heads"),
    ("qwen3-8b", "vocab_size"), ("qwen3-8b", "head_dim"),
    ("llama-3.1-8b", "intermediate_size"),
    ("qwen3-30b-a3b", "num_experts"), ("qwen3-30b-a3b", "num_experts_per_tok"),
    ("qwen3-30b-a3b", "moe_intermediate_size"),
    ("qwen3.8-27b", "linear_num_key_heads"), ("qwen3.8-27b", "linear_num_value_heads"),
    ("qwen3.8-27b", "linear_key_head_dim"), ("qwen3.8-27b", "linear_value_head_dim"),
    ("qwen3.8-27b", "linear_conv_kernel_dim"), ("qwen3.8-27b", "head_dim"),
    ("qwen3.8-27b", "intermediate_size"), ("qwen3.6-35b-a3b", "moe_intermediate_size"),
]


@pytest.mark.parametrize(("name", "field"), REQUIRED)
def test_missing_required_field_names_field_and_file(tmp_path, name, field):
    data = raw(name)
    inner = data.get("text_config", data)
    del inner[field]
    path = write(tmp_path, data)
    prefix = "text_config." if "text_config" in data else ""
    with pytest.raises(ConfigError, match=named(prefix + field, None)) as info:
        load_hf_config(path)
    assert "missing required field" in str(info.value)
    assert str(path) in str(info.value)


def test_hybrid_without_any_layer_pattern_fails_closed(tmp_path):
    data = raw("qwen3.8-27b")
    del data["text_config"]["layer_types"]
    del data["text_config"]["full_attention_interval"]
    with pytest.raises(ConfigError, match=named("text_config.layer_types", None)):
        load_hf_config(write(tmp_path, data))


@pytest.mark.parametrize(("name", "patch", "field", "value"), [
    ("qwen3-8b", {"hidden_size": "4096"}, "hidden_size", "4096"),
    ("qwen3-8b", {"num_hidden_layers": 0}, "num_hidden_layers", 0),
    ("llama-3.1-8b", {"num_attention_heads": 0}, "num_attention_heads", 0),
    ("qwen3-8b", {"tie_word_embeddings": "no"}, "tie_word_embeddings", "no"),
    ("qwen3-8b", {"torch_dtype": "int8"}, "torch_dtype", "int8"),
    ("qwen3-8b", {"layer_types": ["full_attention"] * 35}, "layer_types", ["full_attention"] * 35),
    ("qwen3-8b", {"layer_types": ["linear_attention"] * 36}, "layer_types", "linear_attention"),
    ("qwen3-30b-a3b", {"decoder_sparse_step": 0}, "decoder_sparse_step", 0),
    ("qwen3-30b-a3b", {"mlp_only_layers": "0"}, "mlp_only_layers", "0"),
    ("qwen3-30b-a3b", {"mlp_only_layers": [0]}, "intermediate_size", None),
])
def test_bad_field_value_names_field_and_value(name, patch, field, value):
    data = raw(name) | patch
    if field == "intermediate_size":
        del data["intermediate_size"]  # needed once mlp_only_layers makes a dense layer
    with pytest.raises(ConfigError, match=named(field, value)):
        load_hf_config(data)


@pytest.mark.parametrize(("patch", "field", "value"), [
    ({"layer_types": ["sliding_attention"] * 64}, "text_config.layer_types", "sliding_attention"),
    ({"full_attention_interval": 0}, "text_config.full_attention_interval", 0),
    ({"attn_output_gate": 1}, "text_config.attn_output_gate", 1),
])
def test_bad_hybrid_field_names_it(patch, field, value):
    data = raw("qwen3.8-27b")
    if "full_attention_interval" in patch:
        del data["text_config"]["layer_types"]
    data["text_config"] |= patch
    with pytest.raises(ConfigError, match=named(field, value)):
        load_hf_config(data)


def test_geometry_validation_error_names_the_file(tmp_path):
    path = write(tmp_path, raw("qwen3-8b") | {"num_key_value_heads": 5})
    with pytest.raises(ConfigError, match=named("attention.num_kv_groups", 5)) as info:
        load_hf_config(path)
    assert str(path) in str(info.value)


def test_unreadable_inputs(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_hf_config(tmp_path / "absent.json")
    with pytest.raises(ConfigError, match="no such file"):
        load_hf_config(tmp_path)  # a directory without config.json
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable JSON file"):
        load_hf_config(bad_json)
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        load_hf_config(write(tmp_path, [1, 2], "list.json"))  # type: ignore[arg-type]


def test_loader_does_not_mutate_its_input():
    data = raw("qwen3.6-35b-a3b")
    before = copy.deepcopy(data)
    load_hf_config(data)
    assert data == before


# --- load_model ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list_presets())
def test_load_model_by_preset_name(name):
    assert load_model(name) == load_preset(name)


def test_load_model_by_file_and_directory(tmp_path):
    assert load_model(str(HF / "qwen3-8b.json")) == load_preset("qwen3-8b")
    checkpoint = tmp_path / "qwen3-8b"
    checkpoint.mkdir()
    write(checkpoint, raw("qwen3-8b"))
    assert load_model(str(checkpoint)) == load_preset("qwen3-8b")


def test_preset_name_wins_over_same_named_relative_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen3-8b").mkdir()
    write(tmp_path / "qwen3-8b", raw("llama-3.1-8b"))
    assert load_model("qwen3-8b") == load_preset("qwen3-8b")
    assert load_model("./qwen3-8b").extra["model_type"] == "llama"


@pytest.mark.parametrize("spec", ["no-such-model", "/nonexistent/config.json"])
def test_load_model_error_names_spec_and_presets(spec):
    with pytest.raises(ConfigError, match=named("model", spec)) as info:
        load_model(spec)
    for name in list_presets():
        assert name in str(info.value)


def test_load_model_directory_without_config(tmp_path):
    with pytest.raises(ConfigError, match="directory without config.json"):
        load_model(str(tmp_path))
