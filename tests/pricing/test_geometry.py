"""Validation of the geometry, parallel-layout and LoRA dataclasses, and their JSON round trips.

Every error test checks that the message names the field and the offending value
(`errors.bad` writes them as `field=value!r: why`).
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waveplan.pricing.errors import ConfigError, WaveplanError
from waveplan.pricing.geometry import (
    AttentionSpec,
    GdnSpec,
    LayerSpec,
    MixerKind,
    MlpKind,
    ModelGeometry,
    MoeSpec,
)
from waveplan.pricing.lora import (
    ALL_TARGETS,
    LoraConfig,
    LoraSlot,
    adapter_param_counts,
    module_shapes,
)
from waveplan.pricing.parallel import ParallelLayout, Recompute, RecomputeMode
from waveplan.pricing.presets import load_preset

A, G = MixerKind.ATTENTION, MixerKind.GDN
D, M = MlpKind.DENSE, MlpKind.MOE
ATT = AttentionSpec(num_heads=32, num_kv_groups=8, head_dim=128)
GDN = GdnSpec(num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128,
              conv_kernel=4)
MOE = MoeSpec(num_experts=128, top_k=8, expert_ffn=768)


def names(field: str, value: object):
    """pytest.raises for a ConfigError whose message starts with `field=value!r`."""
    return pytest.raises(ConfigError, match="^" + re.escape(f"{field}={value!r}"))


def dense(**overrides) -> ModelGeometry:
    kwargs = dict(name="t", hidden=4096, ffn=12288, vocab=151936,
                  layers=(LayerSpec(A, D),) * 4, attention=ATT)
    return ModelGeometry(**(kwargs | overrides))


# --- geometry ---------------------------------------------------------------------------------


def test_errors_are_value_errors_so_callers_can_catch_either():
    assert issubclass(ConfigError, WaveplanError) and issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(("kwargs", "field", "value"), [
    ({"num_heads": 0}, "attention.num_heads", 0),
    ({"num_heads": -32}, "attention.num_heads", -32),
    ({"num_heads": 32.0}, "attention.num_heads", 32.0),
    ({"num_kv_groups": 0}, "attention.num_kv_groups", 0),
    ({"num_kv_groups": 3}, "attention.num_kv_groups", 3),  # does not divide 32 heads
    ({"head_dim": True}, "attention.head_dim", True),
    ({"head_dim": "128"}, "attention.head_dim", "128"),
])
def test_attention_spec_errors(kwargs, field, value):
    with names(field, value):
        AttentionSpec(**({"num_heads": 32, "num_kv_groups": 8, "head_dim": 128} | kwargs))


def test_attention_widths():
    assert ATT.qkv_width == 32 * 128 + 2 * 8 * 128
    assert ATT.core_width == 32 * 128
    gated = AttentionSpec(num_heads=32, num_kv_groups=8, head_dim=128, output_gate=True)
    assert gated.qkv_width == 2 * 32 * 128 + 2 * 8 * 128


@pytest.mark.parametrize(("kwargs", "field", "value"), [
    ({"num_key_heads": 0}, "gdn.num_key_heads", 0),
    ({"num_value_heads": -1}, "gdn.num_value_heads", -1),
    ({"num_value_heads": 24}, "gdn.num_value_heads", 24),  # not a multiple of 16 key heads
    ({"key_head_dim": 0}, "gdn.key_head_dim", 0),
    ({"value_head_dim": False}, "gdn.value_head_dim", False),
    ({"conv_kernel": 0}, "gdn.conv_kernel", 0),
])
def test_gdn_spec_errors(kwargs, field, value):
    base = {"num_key_heads": 16, "num_value_heads": 32, "key_head_dim": 128,
            "value_head_dim": 128, "conv_kernel": 4}
    with names(field, value):
        GdnSpec(**(base | kwargs))


def test_gdn_widths():
    assert (GDN.key_width, GDN.value_width) == (2048, 4096)
    assert GDN.conv_width == 2 * 2048 + 4096
    assert GDN.in_proj_width == GDN.conv_width + 4096 + 2 * 32


@pytest.mark.parametrize(("kwargs", "field", "value"), [
    ({"num_experts": 0}, "moe.num_experts", 0),
    ({"top_k": 0}, "moe.top_k", 0),
    ({"top_k": 129}, "moe.top_k", 129),  # more than num_experts
    ({"expert_ffn": -768}, "moe.expert_ffn", -768),
    ({"shared_expert_ffn": -1}, "moe.shared_expert_ffn", -1),
])
def test_moe_spec_errors(kwargs, field, value):
    with names(field, value):
        MoeSpec(**({"num_experts": 128, "top_k": 8, "expert_ffn": 768} | kwargs))


def test_layer_spec_accepts_strings():
    assert LayerSpec("gdn", "moe") == LayerSpec(G, M)


def test_layer_spec_unknown_kind_is_config_error():
    with pytest.raises(ConfigError, match="mamba"):
        LayerSpec("mamba", "dense")


@pytest.mark.parametrize(("overrides", "field", "value"), [
    ({"hidden": 0}, "model.hidden", 0),
    ({"hidden": -4096}, "model.hidden", -4096),
    ({"vocab": 0}, "model.vocab", 0),
    ({"vocab": 151936.0}, "model.vocab", 151936.0),
    ({"layers": ()}, "model.layers", ()),
    ({"dtype": "int8"}, "model.dtype", "int8"),
    ({"ffn": 0}, "model.ffn", 0),  # a dense layer needs a dense width
    ({"ffn": True}, "model.ffn", True),
    ({"attention": None}, "model.attention", None),
    ({"layers": (LayerSpec(G, D),)}, "model.gdn", None),
    ({"layers": (LayerSpec(A, M),)}, "model.moe", None),
    ({"layers": (LayerSpec(A, M),), "moe": MOE, "ffn": -1}, "model.ffn", -1),
])
def test_model_geometry_errors(overrides, field, value):
    with names(field, value):
        dense(**overrides)


def test_model_geometry_normalises_layers_and_derives_counts():
    geometry = dense(layers=[("gdn", "moe"), ("attention", "dense")], gdn=GDN, moe=MOE)
    assert geometry.layers == (LayerSpec(G, M), LayerSpec(A, D))
    assert (geometry.num_layers, geometry.count(A), geometry.count(G)) == (2, 1, 1)
    assert geometry.dtype_bytes == 2 and dense(dtype="fp32").dtype_bytes == 4


def test_all_moe_geometry_may_have_zero_ffn():
    assert dense(layers=(LayerSpec(A, M),), moe=MOE, ffn=0).ffn == 0


def test_extra_does_not_affect_equality_or_hash():
    assert dense(extra={"source": "a"}) == dense(extra={"source": "b"})
    assert hash(dense(extra={"source": "a"})) == hash(dense())


def test_from_dict_unknown_field():
    with names("model", "hiden"):
        ModelGeometry.from_dict(dense().to_dict() | {"hiden": 1})


@pytest.mark.parametrize("key", ["name", "hidden", "vocab", "layers"])
def test_from_dict_missing_field(key):
    data = dense().to_dict()
    del data[key]
    with names(f"model.{key}", None):
        ModelGeometry.from_dict(data)


def test_from_dict_bad_nested_spec_names_the_key():
    data = dense().to_dict()
    data["attention"] = {"num_heads": 32, "num_kv_groups": 8, "head_dim": 128, "heads": 1}
    with pytest.raises(ConfigError, match="'heads'"):
        ModelGeometry.from_dict(data)
    data["attention"] = {"num_heads": 32}
    with pytest.raises(ConfigError, match="num_kv_groups"):
        ModelGeometry.from_dict(data)


def test_from_dict_nested_validation_names_field():
    data = dense().to_dict()
    data["attention"]["num_kv_groups"] = 5
    with names("attention.num_kv_groups", 5):
        ModelGeometry.from_dict(data)


def test_from_dict_unknown_layer_kind_is_config_error():
    data = dense().to_dict()
    data["layers"][0] = ["mamba", "dense"]
    with pytest.raises(ConfigError, match="mamba"):
        ModelGeometry.from_dict(data)


# --- hypothesis: to_dict / from_dict round trip ----------------------------------------------


@st.composite
def geometries(draw) -> ModelGeometry:
    layers = draw(st.lists(st.tuples(st.sampled_from(list(MixerKind)), st.sampled_from(list(MlpKind))),
                           min_size=1, max_size=12))
    mixers = {m for m, _ in layers}
    mlps = {p for _, p in layers}
    kv = draw(st.integers(1, 8))
    attention = AttentionSpec(num_heads=kv * draw(st.integers(1, 8)), num_kv_groups=kv,
                              head_dim=draw(st.sampled_from([64, 128, 256])),
                              output_gate=draw(st.booleans())) if A in mixers else None
    keys = draw(st.integers(1, 16))
    gdn = GdnSpec(num_key_heads=keys, num_value_heads=keys * draw(st.integers(1, 4)),
                  key_head_dim=draw(st.sampled_from([64, 128])),
                  value_head_dim=draw(st.sampled_from([64, 128])),
                  conv_kernel=draw(st.integers(2, 8))) if G in mixers else None
    experts = draw(st.integers(1, 256))
    moe = MoeSpec(num_experts=experts, top_k=draw(st.integers(1, experts)),
                  expert_ffn=draw(st.integers(1, 4096)),
                  shared_expert_ffn=draw(st.integers(0, 4096))) if M in mlps else None
    ffn = draw(st.integers(1, 65536) if D in mlps else st.integers(0, 65536))
    return ModelGeometry(
        name=draw(st.text(min_size=1, max_size=12)), hidden=draw(st.integers(1, 16384)), ffn=ffn,
        vocab=draw(st.integers(1, 300_000)), layers=tuple(layers), attention=attention, gdn=gdn,
        moe=moe, dtype=draw(st.sampled_from(["bf16", "fp16", "fp32"])),
        gated_mlp=draw(st.booleans()), tied_embeddings=draw(st.booleans()))


@settings(max_examples=150, deadline=None)
@given(geometries())
def test_geometry_round_trips_through_json(geometry):
    data = json.loads(json.dumps(geometry.to_dict()))
    again = ModelGeometry.from_dict(data)
    assert again == geometry
    assert again.to_dict() == geometry.to_dict()


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3.6-35b-a3b"])
def test_preset_round_trips(name):
    geometry = load_preset(name)
    assert ModelGeometry.from_dict(geometry.to_dict()) == geometry


# --- parallel layout and recompute ----------------------------------------------------------


@pytest.mark.parametrize("field", ["tp", "cp", "pp", "ep", "dp"])
@pytest.mark.parametrize("value", [0, -2, True, 2.0])
def test_parallel_sizes_must_be_positive_integers(field, value):
    with names(f"parallel.{field}", value):
        ParallelLayout(**{field: value})


def test_sequence_parallel_needs_tp():
    with names("parallel.sequence_parallel", True):
        ParallelLayout(sequence_parallel=True)
    assert ParallelLayout(tp=2, sequence_parallel=True).row_multiple == 2


@pytest.mark.parametrize(("layout", "multiple"), [
    (ParallelLayout(), 1), (ParallelLayout(tp=4), 1), (ParallelLayout(tp=4, sequence_parallel=True), 4),
    (ParallelLayout(cp=2), 4), (ParallelLayout(tp=2, cp=2, sequence_parallel=True), 8),
])
def test_row_multiple(layout, multiple):
    assert layout.row_multiple == multiple


@pytest.mark.parametrize(("preset", "layout", "field", "value", "names_also"), [
    ("qwen3-8b", ParallelLayout(tp=3), "parallel.tp", 3, "attention.num_heads=32"),
    # 32 heads split over 16 ranks, but 8 KV groups cannot be: the KV check must fire.
    ("qwen3-8b", ParallelLayout(tp=16), "parallel.tp", 16, "attention.num_kv_groups=8"),
    ("qwen3.6-35b-a3b", ParallelLayout(tp=4), "parallel.tp", 4, "attention.num_kv_groups=2"),
    ("qwen3-30b-a3b", ParallelLayout(ep=3), "parallel.ep", 3, "moe.num_experts=128"),
    ("qwen3-8b", ParallelLayout(pp=37), "parallel.pp", 37, "36 layers"),
])
def test_layout_invalid_for_geometry(preset, layout, field, value, names_also):
    with names(field, value) as info:
        layout.validate_for(load_preset(preset))
    assert names_also in str(info.value)


def test_layout_tp_must_divide_gdn_heads():
    geometry = ModelGeometry(
        name="gdn-only", hidden=1024, ffn=4096, vocab=1000, layers=(LayerSpec(G, D),),
        gdn=GdnSpec(num_key_heads=6, num_value_heads=12, key_head_dim=64, value_head_dim=64,
                    conv_kernel=4))
    with names("parallel.tp", 4) as info:
        ParallelLayout(tp=4).validate_for(geometry)
    assert "gdn.num_key_heads=6" in str(info.value)


def test_layout_tp_must_divide_ffn():
    with names("parallel.tp", 2) as info:
        ParallelLayout(tp=2).validate_for(dense(ffn=12289))
    assert "model.ffn=12289" in str(info.value)


@pytest.mark.parametrize(("preset", "tps"), [("qwen3-8b", (1, 2, 4, 8)),
                                             ("qwen3.8-27b", (1, 2, 4)),
                                             ("qwen3.6-35b-a3b", (1, 2))])
def test_layout_valid_tp_pass(preset, tps):
    geometry = load_preset(preset)
    for tp in tps:
        ParallelLayout(tp=tp, sequence_parallel=tp > 1, ep=geometry.moe.num_experts
                       if geometry.moe else 1).validate_for(geometry)


def test_layout_vocab_not_divisible_is_allowed():
    ParallelLayout(tp=8).validate_for(dense(vocab=151937))  # Megatron pads the vocabulary


@given(tp=st.integers(1, 64), cp=st.integers(1, 16), pp=st.integers(1, 64),
       ep=st.integers(1, 64), dp=st.integers(1, 64), sp=st.booleans())
def test_layout_to_dict_round_trips(tp, cp, pp, ep, dp, sp):
    layout = ParallelLayout(tp=tp, cp=cp, pp=pp, ep=ep, dp=dp, sequence_parallel=sp and tp > 1)
    assert ParallelLayout(**layout.to_dict()) == layout
    assert layout.model_parallel_size == tp * cp * pp


@pytest.mark.parametrize(("kwargs", "field", "value"), [
    ({"mode": "partial"}, "recompute.mode", "partial"),
    ({"method": "chunked"}, "recompute.method", "chunked"),
    ({"num_layers": 0}, "recompute.num_layers", 0),
    ({"num_layers": True}, "recompute.num_layers", True),
])
def test_recompute_errors(kwargs, field, value):
    with names(field, value):
        Recompute(**kwargs)


def test_recompute_defaults_and_normalisation():
    recompute = Recompute(mode="selective", modules=["core_attn", "mlp"])
    assert recompute.mode is RecomputeMode.SELECTIVE and recompute.modules == ("core_attn", "mlp")
    assert Recompute().is_one_layer_full and not recompute.is_one_layer_full
    assert Recompute(**Recompute().to_dict()) == Recompute()


# --- LoRA -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "field", "value"), [
    ({"name": ""}, "lora.name", ""),
    ({"rank": 0}, "lora[default].rank", 0),
    ({"name": "a", "rank": True}, "lora[a].rank", True),
    ({"rank": 8.0}, "lora[default].rank", 8.0),
    ({"targets": ("linear_qkv", "q_proj")}, "lora[default].targets", "q_proj"),
])
def test_lora_slot_errors(kwargs, field, value):
    with names(field, value):
        LoraSlot(**kwargs)


def test_lora_unknown_target_lists_known_modules():
    with pytest.raises(ConfigError) as info:
        LoraSlot(targets=("q_proj",))
    for target in ALL_TARGETS:
        assert target in str(info.value)


def test_lora_slot_layers_are_sorted_and_unique():
    assert LoraSlot(layers=[3, 1, 3]).layers == (1, 3)


def test_lora_duplicate_slot_names():
    with names("lora.slots", ["a", "b", "a"]):
        LoraConfig(slots=(LoraSlot(name="a"), LoraSlot(name="b"), LoraSlot(name="a")))


@pytest.mark.parametrize("grad_bytes", [0, 1, 3, 8])
def test_lora_grad_bytes(grad_bytes):
    with names("lora.grad_bytes", grad_bytes):
        LoraConfig(grad_bytes=grad_bytes)


def test_lora_unknown_slot_lookup():
    with names("slot", "missing") as info:
        LoraConfig().slot("missing")
    assert "default" in str(info.value)


@pytest.mark.parametrize("layer", [36, -1])
def test_lora_layer_out_of_range(layer):
    lora = LoraConfig(slots=(LoraSlot(name="s", layers=(0, layer)),))
    with names("lora[s].layers", layer):
        adapter_param_counts(load_preset("qwen3-8b"), lora, "s", 1)


def test_lora_from_dict_missing_key_is_config_error():
    with pytest.raises(ConfigError, match="slots"):
        LoraConfig.from_dict({"grad_bytes": 4})


@settings(max_examples=100, deadline=None)
@given(st.lists(st.builds(
    LoraSlot,
    rank=st.integers(1, 256),
    targets=st.lists(st.sampled_from(ALL_TARGETS), unique=True).map(tuple),
    layers=st.none() | st.lists(st.integers(0, 63), max_size=8).map(tuple),
), min_size=1, max_size=4), st.sampled_from([2, 4]))
def test_lora_config_round_trips(slots, grad_bytes):
    slots = [LoraSlot(name=f"s{i}", rank=s.rank, targets=s.targets, layers=s.layers)
             for i, s in enumerate(slots)]
    lora = LoraConfig(slots=tuple(slots), grad_bytes=grad_bytes)
    assert LoraConfig.from_dict(json.loads(json.dumps(lora.to_dict()))) == lora


def test_adapter_counts_of_the_dense_hybrid_at_tp2():
    geometry = load_preset("qwen3.8-27b")
    lora = LoraConfig(slots=(LoraSlot(name="s", rank=8),))
    counts = adapter_param_counts(geometry, lora, "s", 2)
    h, f = 5120, 17408
    mlp = 8 * ((h + 2 * f // 2) + (f // 2 + h))
    gdn_layer = 8 * ((h + geometry.gdn.in_proj_width // 2) + (geometry.gdn.value_width // 2 + h))
    att_layer = 8 * ((h + geometry.attention.qkv_width // 2) + (geometry.attention.core_width // 2 + h))
    assert counts[0] == gdn_layer + mlp and counts[3] == att_layer + mlp
    assert set(module_shapes(geometry, 0, 2)) == {"in_proj", "out_proj", "linear_fc1", "linear_fc2"}


def test_moe_layers_adapt_only_their_mixer():
    geometry = load_preset("qwen3-30b-a3b")
    assert set(module_shapes(geometry, 0, 1)) == {"linear_qkv", "linear_proj"}
