"""Granite, InternLM2, OLMo 2, Qwen2-MoE and SmolLM3 configs, and the `--as-family` opt-in.

The fixtures in data/hf_more are shaped as the public config.json files of Granite 4.0 Micro,
InternLM2-chat-1.8B, OLMo-2-0425-1B, Qwen1.5-MoE-A2.7B, SmolLM3-3B and OLMo-1B-hf (a
`model_type` no family supports), with the field names the families' own config classes use.
Each family's own fields are read; what no trace covers is charged and makes the basis
conservative with a reason naming it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from waveplan.planner import Planner
from waveplan.planner.cli import main
from waveplan.pricing.errors import ConfigError
from waveplan.pricing.geometry import MlpKind
from waveplan.pricing.hf_config import load_hf_config
from waveplan.pricing.lora import LoraConfig, LoraSlot
from waveplan.pricing.model import PricingModel
from waveplan.pricing.model_source import load_model
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.step import load_step

DATA = Path(__file__).resolve().parents[1] / "data" / "hf_more"
FAMILIES = {   # fixture: (model_type, basis, words its reasons hold)
    "granite-4.0-micro": ("granite", "conservative", ("residual multiplier", "logits scaling")),
    "internlm2-chat-1_8b": ("internlm2", "evidence", ()),
    "olmo-2-0425-1b": ("olmo2", "conservative", ("post-norms",)),
    "qwen1.5-moe-a2.7b": ("qwen2_moe", "conservative", ("gated shared expert",)),
    "smollm3-3b": ("smollm3", "conservative", ("9 NoPE layers",)),
}


def raw(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def price(geometry, *, head: str = "chunked:512", step: str = "sft-64"):
    model = PricingModel.build(geometry, parallel=ParallelLayout(), recompute=Recompute(mode="full"),
                               lora=LoraConfig(slots=(LoraSlot(rank=16),)), head=head)
    steps = load_step(step)
    planner = Planner.from_model(model)
    return planner.pricer(steps).price([np.arange(steps.num_requests)], first_slots=frozenset())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_prices_with_its_basis_and_reasons(name):
    model_type, basis, words = FAMILIES[name]
    geometry = load_hf_config(DATA / f"{name}.json")
    assert geometry.extra["model_type"] == model_type
    b = price(geometry)
    assert b.basis == basis, b.reasons
    for word in words:
        assert any(word in r for r in b.reasons), (word, b.reasons)
    assert bool(b.reasons) == (basis != "evidence")


def test_family_fields_are_read():
    granite = load_hf_config(raw("granite-4.0-micro")).features
    assert granite.residual_scale and granite.logit_scale and granite.embedding_scale
    plain = load_hf_config({**raw("granite-4.0-micro"), "residual_multiplier": 1.0,
                            "logits_scaling": 1.0, "embedding_multiplier": 1.0}).features
    assert not (plain.residual_scale or plain.logit_scale or plain.embedding_scale)

    internlm = load_hf_config(raw("internlm2-chat-1_8b"))
    assert internlm.attention.num_kv_groups == 8 and internlm.attention.head_dim == 128
    assert internlm.vocab == 92544 and not internlm.features.qkv_bias and not internlm.tied_embeddings
    without_bias_key = {k: v for k, v in raw("internlm2-chat-1_8b").items() if k != "bias"}
    assert load_hf_config(without_bias_key).features.qkv_bias   # InternLM2Config: bias=True

    olmo = load_hf_config(raw("olmo-2-0425-1b")).features
    assert olmo.post_norms and olmo.qk_norm

    moe = load_hf_config(raw("qwen1.5-moe-a2.7b"))
    assert (moe.moe.num_experts, moe.moe.top_k, moe.moe.expert_ffn, moe.moe.shared_expert_ffn) == \
        (60, 4, 1408, 5632)
    assert all(layer.mlp == MlpKind.MOE for layer in moe.layers) and moe.features.shared_expert_gate
    assert moe.features.qkv_bias

    smol = load_hf_config(raw("smollm3-3b"))
    assert smol.features.nope_layers == 9 and smol.tied_embeddings   # SmolLM3Config default
    by_interval = {k: v for k, v in raw("smollm3-3b").items() if k != "no_rope_layers"}
    assert load_hf_config(by_interval).features.nope_layers == 9
    assert load_hf_config({**by_interval, "no_rope_layer_interval": 3}).features.nope_layers == 12


@pytest.mark.parametrize("field, value", [("no_rope_layers", [1, 0]), ("no_rope_layer_interval", 0)])
def test_bad_nope_fields_name_the_field(field, value):
    data = {k: v for k, v in raw("smollm3-3b").items() if k != "no_rope_layers"}
    with pytest.raises(ConfigError, match=re.escape(f"{field}={value!r}")):
        load_hf_config({**data, field: value})


@pytest.mark.parametrize("feature, name", [
    ("residual_scale", "granite-4.0-micro"), ("post_norms", "olmo-2-0425-1b"),
    ("shared_expert_gate", "qwen1.5-moe-a2.7b")])
def test_each_layer_feature_is_charged(feature, name):
    geometry = load_hf_config(DATA / f"{name}.json")
    off = dataclasses.replace(geometry, features=dataclasses.replace(geometry.features, **{feature: False}))
    assert price(geometry).raw_bytes > price(off).raw_bytes


def test_logits_scaling_is_charged_in_the_head():
    geometry = load_hf_config(DATA / "granite-4.0-micro.json")
    off = dataclasses.replace(geometry, features=dataclasses.replace(geometry.features, logit_scale=False))
    on, without = price(geometry, head="full-native"), price(off, head="full-native")
    assert on.binding == without.binding == "head-backward"
    assert on.terms["head"] > without.terms["head"]


def test_unknown_family_error_says_how():
    with pytest.raises(ConfigError) as info:
        load_hf_config(DATA / "olmo-1b-hf.json")
    message = str(info.value)
    assert message.startswith("model_type='olmo': unsupported") and "--as-family llama" in message
    assert "as_family=" in message and "\n" not in message


def test_as_family_is_an_explicit_conservative_opt_in():
    geometry = load_hf_config(DATA / "olmo-1b-hf.json", as_family="llama")
    assert geometry.features.read_as == "olmo" and geometry.extra["model_type"] == "olmo"
    b = price(geometry)
    assert b.basis == "conservative" and any("'olmo' read as" in r for r in b.reasons)
    as_llama = dataclasses.replace(geometry, features=dataclasses.replace(geometry.features, read_as=""))
    assert price(as_llama).raw_bytes == b.raw_bytes        # priced as Llama, only the basis differs
    planner = Planner.from_hf_config(DATA / "olmo-1b-hf.json", as_family="llama")
    assert planner.model.geometry.features.read_as == "olmo"
    assert json.loads(json.dumps(geometry.to_dict()))["features"]["read_as"] == "olmo"


@pytest.mark.parametrize("spec, family, needle", [
    ("olmo-1b-hf.json", "olmo", "not a supported family"),
    ("olmo-2-0425-1b.json", "llama", "is supported itself"),
    ("qwen3-8b", "llama", "not to the preset")])
def test_as_family_misuse_is_one_line(spec, family, needle):
    path = spec if "." not in spec else str(DATA / spec)
    with pytest.raises(ConfigError, match=needle):
        load_model(path, as_family=family)


def test_cli_as_family(capsys):
    code = main(["price", "sft-64", "--model", str(DATA / "olmo-1b-hf.json"), "--as-family", "llama",
                 "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["basis"] == "conservative"
    assert main(["price", "sft-64", "--model", str(DATA / "olmo-1b-hf.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--as-family llama" in err and len(err) < 500


def test_transformers_reads_the_same_fields():
    transformers = pytest.importorskip("transformers")
    for name, (model_type, _, _) in FAMILIES.items():
        if model_type == "internlm2":     # remote code: transformers ships no InternLM2Config
            continue
        data = raw(name)
        config = transformers.CONFIG_MAPPING[model_type](**data)
        assert load_hf_config(config, name=name) == load_hf_config(data, name=name), name
