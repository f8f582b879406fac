"""A Megatron-core model built from a geometry reads back as the same geometry.

Every preset is built at full size on the `meta` device (no memory) and read back with
`geometry_from_megatron`: shapes, layer pattern, parallel layout, recompute and LoRA.
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from waveplan.pricing.errors import ConfigError  # noqa: E402
from waveplan.pricing.geometry import (  # noqa: E402
    AttentionSpec,
    MixerKind,
    MlpKind,
    ModelGeometry,
)
from waveplan.pricing.lora import (  # noqa: E402
    ATTENTION_TARGETS,
    GDN_TARGETS,
    MLP_TARGETS,
    LoraConfig,
    LoraSlot,
)
from waveplan.pricing.parallel import ParallelLayout, Recompute, RecomputeMode  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore::UserWarning")]

PRESETS = ("qwen3-8b", "llama-3.1-8b", "qwen3-30b-a3b", "qwen3.8-27b", "qwen3.6-35b-a3b")

A, D = MixerKind.ATTENTION, MlpKind.DENSE


def _preset(name: str) -> ModelGeometry:
    try:
        from waveplan.pricing.presets import load_preset
    except ImportError:  # presets not built yet: the public values by hand
        load_preset = None
    if load_preset is not None:
        return load_preset(name)
    if name != "qwen3-8b":
        pytest.skip("presets module missing")
    return ModelGeometry(name="qwen3-8b", hidden=4096, ffn=12288, vocab=151936,
                         layers=((A, D),) * 36, attention=AttentionSpec(32, 8, 128))


def _tiny(layers: int = 2) -> ModelGeometry:
    return ModelGeometry(name="tiny", hidden=256, ffn=768, vocab=1024, layers=((A, D),) * layers,
                         attention=AttentionSpec(4, 2, 64))


def _expected_targets(geometry: ModelGeometry) -> tuple[str, ...]:
    kinds = {s.mixer for s in geometry.layers}
    targets = ()
    if MixerKind.ATTENTION in kinds:
        targets += ATTENTION_TARGETS
    if MixerKind.GDN in kinds:
        targets += GDN_TARGETS
    if any(s.mlp == MlpKind.DENSE for s in geometry.layers):
        targets += MLP_TARGETS
    return targets


@pytest.fixture
def megatron_tp1():
    from waveplan.pricing.measure.megatron_shim import init_single_process

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with init_single_process():
            yield


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
def test_preset_round_trips_through_a_meta_model(megatron_tp1, name):
    import torch

    from waveplan.pricing.measure.live_geometry import geometry_from_megatron
    from waveplan.pricing.measure.megatron_build import build_gpt

    geometry = _preset(name)
    model = build_gpt(geometry, device="meta", lora_rank=16)  # full size, no memory
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    got, layout, recompute, lora = geometry_from_megatron(model)
    assert got == geometry
    assert got.to_dict() == geometry.to_dict()
    assert layout == ParallelLayout()
    assert recompute == Recompute()
    assert lora == LoraConfig(slots=(LoraSlot(rank=16, targets=_expected_targets(geometry)),))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)


@pytest.mark.parametrize("mode", ["full", "selective", "none"])
def test_recompute_and_partial_lora_read_back(megatron_tp1, mode):
    from waveplan.pricing.measure.live_geometry import geometry_from_megatron
    from waveplan.pricing.measure.megatron_build import build_gpt

    geometry = _tiny(3)
    recompute = Recompute(mode=mode)
    model = build_gpt(geometry, device="meta", lora_rank=8, lora_targets=("linear_qkv",),
                      recompute=recompute)
    got, _, rec, lora = geometry_from_megatron(model)
    assert got == geometry
    assert rec.mode == RecomputeMode(mode)
    if mode != "none":
        assert rec == recompute
    assert lora.slots == (LoraSlot(rank=8, targets=("linear_qkv",)),)
    # The decoder alone reads the same shapes (vocab comes from the GPT model).
    with pytest.raises(ConfigError, match="vocabulary"):
        geometry_from_megatron(model.decoder)


def test_no_lora_gives_no_slots(megatron_tp1):
    from waveplan.pricing.measure.live_geometry import geometry_from_megatron
    from waveplan.pricing.measure.megatron_build import build_gpt

    model = build_gpt(_tiny(), device="meta")
    _, _, _, lora = geometry_from_megatron(model)
    assert lora.slots == ()
    assert not any(p.requires_grad for p in model.parameters())


def test_unknown_mixer_module_is_named(megatron_tp1):
    from torch import nn

    from waveplan.pricing.measure.live_geometry import geometry_from_megatron
    from waveplan.pricing.measure.megatron_build import build_gpt

    class MysteryMixer(nn.Module):
        pass

    model = build_gpt(_tiny(), device="meta")
    model.decoder.layers[1].self_attention = MysteryMixer()
    with pytest.raises(ConfigError, match=r"decoder\.layers\.1\.self_attention.*MysteryMixer"):
        geometry_from_megatron(model)


def test_peft_style_adapters_are_found(megatron_tp1):
    import torch
    from torch import nn

    from waveplan.pricing.measure.live_geometry import geometry_from_megatron
    from waveplan.pricing.measure.megatron_build import build_gpt

    class PeftLinear(nn.Module):
        def __init__(self, base, rank):
            super().__init__()
            self.base_layer = base
            d_out, d_in = base.weight.shape
            self.lora_A = nn.ModuleDict({"default": nn.Linear(d_in, rank, bias=False,
                                                               device="meta")})
            self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, d_out, bias=False,
                                                               device="meta")})

    geometry = _tiny()
    model = build_gpt(geometry, device="meta", dtype=torch.bfloat16)
    for layer in model.decoder.layers:
        layer.mlp.linear_fc2 = PeftLinear(layer.mlp.linear_fc2, 4)
    _, _, _, lora = geometry_from_megatron(model)
    assert lora.slots == (LoraSlot(rank=4, targets=("linear_fc2",)),)


def test_tensor_parallel_layout_reads_global_sizes():
    """TP=2 through torch's fake process group: per-rank modules, global geometry."""
    from waveplan.pricing.measure.live_geometry import geometry_from_megatron
    from waveplan.pricing.measure.megatron_build import build_gpt
    from waveplan.pricing.measure.megatron_shim import init_single_process

    geometry = _preset("qwen3-8b")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with init_single_process(2):
            model = build_gpt(geometry, num_layers=2, device="meta", lora_rank=16)
            qkv = model.decoder.layers[0].self_attention.linear_qkv
            assert tuple(qkv.base.weight.shape) == (geometry.attention.qkv_width // 2,
                                                    geometry.hidden)
            got, layout, _, lora = geometry_from_megatron(model)
    assert layout.tp == 2 and layout.dp == 1
    assert got.layers == geometry.layers[:2]
    assert (got.hidden, got.ffn, got.vocab, got.attention) == \
        (geometry.hidden, geometry.ffn, geometry.vocab, geometry.attention)
    assert lora.slots[0].rank == 16


def test_planner_from_megatron_reads_the_live_model(megatron_tp1):
    from waveplan.planner import Planner
    from waveplan.pricing.errors import ConfigError
    from waveplan.pricing.measure.live_geometry import geometry_from_megatron
    from waveplan.pricing.measure.megatron_build import build_gpt

    geometry = _preset("qwen3-8b")
    model = build_gpt(geometry, device="meta", lora_rank=16)
    planner = Planner.from_megatron(model)
    g, layout, recompute, lora = geometry_from_megatron(model)
    assert planner.model.geometry == g and planner.model.parallel == layout
    assert planner.model.lora == lora and planner.model.recompute == recompute
    with pytest.raises(ConfigError, match="model="):
        Planner.from_megatron(model.config)


def test_layout_reads_the_expert_tp_and_keeps_megatrons_default_as_none():
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps

    from waveplan.pricing.measure.live_geometry import _parallel

    if ps.model_parallel_is_initialized():
        pytest.skip("a parallel state is live: the layout is read from it")
    cfg = SimpleNamespace(tensor_model_parallel_size=4, pipeline_model_parallel_size=1,
                          context_parallel_size=1, expert_model_parallel_size=2, sequence_parallel=True,
                          expert_tensor_parallel_size=1)
    assert _parallel(cfg).etp == 1 and _parallel(cfg).expert_tp == 1
    for default in (4, None):   # Megatron fills None with the TP size
        cfg.expert_tensor_parallel_size = default
        assert _parallel(cfg).etp is None and _parallel(cfg).expert_tp == 4
