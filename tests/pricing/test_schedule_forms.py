"""The schedule is written once as the walk (`pricing.walk`) and kept in two other forms: the
envelope's affine points (`pricing.envelope`, an upper bound the search packs against) and
calibration's numpy points (`measure.calibrate.model_points`, what a fit is solved against).
On random one-call gradient waves of random configurations (CP, SP, EP and ETP layouts, GDN
chunk padding included) the three agree: calibration's points peak at the walk's raw price, and
the envelope never prices below the walk (PP too: the stage walks)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pricing_properties import two_level_counts

from waveplan.pricing.errors import WaveplanError
from waveplan.pricing.lora import LoraConfig, LoraSlot
from waveplan.pricing.measure.calibrate import model_points
from waveplan.pricing.model import PricingModel
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.presets import load_preset
from waveplan.pricing.price import GroupLoad, price_groups, rank_rows
from waveplan.pricing.step import Request, Step
from waveplan.pricing.wave_pricer import WavePricer

PRESETS = ("qwen3-8b", "llama-3.1-8b", "qwen3-30b-a3b", "qwen3.8-27b")
LAYOUTS = (ParallelLayout(), ParallelLayout(tp=2), ParallelLayout(tp=4, sequence_parallel=True),
           ParallelLayout(tp=2, sequence_parallel=True), ParallelLayout(cp=2),
           ParallelLayout(tp=4, sequence_parallel=True, cp=2), ParallelLayout(tp=2, cp=2),
           ParallelLayout(ep=2), ParallelLayout(tp=4, sequence_parallel=True, ep=2),
           ParallelLayout(tp=2, sequence_parallel=True, etp=1))
# calibration's form is one stage's walk (calibration fits PP1 cells); the envelope covers PP too
PP_LAYOUTS = (ParallelLayout(pp=2), ParallelLayout(tp=4, sequence_parallel=True, pp=2))
HEADS = ("chunked:512", "full-native", "full-te")
LORA = LoraConfig(slots=(LoraSlot(rank=16),))

_models: dict = {}


def _model(preset, layout, mode, head, backend) -> PricingModel | None:
    """The configuration's model, or None where it is invalid (EP on a dense model)."""
    key = (preset, layout, mode, head, backend)
    if key not in _models:
        try:
            _models[key] = PricingModel.build(load_preset(preset), parallel=layout,
                                              recompute=Recompute(mode=mode), lora=LORA,
                                              head=head, backend=backend)
        except WaveplanError:
            _models[key] = None
    return _models[key]


def _models_over(layouts):
    return st.builds(_model, st.sampled_from(PRESETS), st.sampled_from(layouts),
                     st.sampled_from(("full", "selective", "none")), st.sampled_from(HEADS),
                     st.sampled_from(("te-gpu", "torch-cpu"))).filter(lambda m: m is not None)


models = _models_over(LAYOUTS)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=models, tokens=st.integers(1, 20000), segments=st.integers(1, 64))
def test_calibrations_points_peak_at_the_walks_price(model, tokens, segments):
    # up to the layout's row multiple, not the GDN kernel's chunk: chunk padding rows too
    m = model.parallel.row_multiple
    rows = -(-tokens // m) * m
    load = GroupLoad(slot="default", grad=True, packed_rows=rows, padded_rows=rows,
                     logical_rows=rows, segments=segments)
    walk = price_groups(model, [load], first_slots=frozenset({"default"}), profiled=True)
    points = model_points(model, rank_rows(model, rows), segments, logical_rows=rows)
    assert abs(points.max() - walk.raw_bytes) <= 1.0


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=_models_over(LAYOUTS + PP_LAYOUTS),
       lens=st.lists(st.integers(64, 6000), min_size=1, max_size=12),
       prompt=st.integers(0, 2000), data=st.data())
def test_the_envelope_never_prices_a_wave_below_the_walk(model, lens, prompt, data):
    step = Step.from_requests([Request(id=f"r{i}", num_tokens=n + prompt,
                                       prompt="p" if prompt else None, num_prompt_tokens=prompt)
                               for i, n in enumerate(lens)])
    pricer = WavePricer.build(step, model)
    n = len(lens)
    sub = np.sort(np.asarray(data.draw(st.permutations(range(n)))[:data.draw(st.integers(1, n))],
                             dtype=np.int64))
    exact = pricer.price([sub])
    assert pricer.admitted([sub]) == exact.admitted_bytes   # the jitted walk: the same walk
    present, counts = two_level_counts(step, pricer, sub)
    envelope = pricer.envelope().value(present, counts)
    assert envelope >= exact.admitted_bytes
    # carrying the slot's pending gradients adds at most `pending_bytes` (what the search adds)
    carried = pricer.price([sub], first_slots=frozenset({"default"})).admitted_bytes
    assert envelope + pricer.pending_bytes("default") >= carried


# split layer points (`walk.WalkCharges.mlp_points`): FSDP MoE and dense models, several classes a wave
_MOE_CFG = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=1024, model_type="qwen3_moe",
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
                tie_word_embeddings=False, mlp_only_layers=[1])
_fsdp_models: dict = {}


def _fsdp_moe(ckpt, attn, fsdp, family="qwen3_moe"):
    from waveplan.pricing.fsdp import build_fsdp_model
    from waveplan.pricing.hf_config import load_hf_config

    key = (ckpt, attn, fsdp, family)
    cfg = dict(_MOE_CFG) if family == "qwen3_moe" else dict(_MOE_CFG, model_type=family)
    if key not in _fsdp_models:
        lora = LoraConfig(slots=(LoraSlot(name="a", rank=8), LoraSlot(name="b", rank=16)))
        _fsdp_models[key] = build_fsdp_model(load_hf_config(cfg), fsdp=fsdp, attn=attn,
                                             checkpointing=ckpt, lora=lora, attn_rows=512)
    return _fsdp_models[key]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.builds(_fsdp_moe, st.booleans(), st.sampled_from(("sdpa", "eager", "flash")),
                       st.sampled_from((1, 2, 4)), st.sampled_from(("qwen3_moe", "llama"))),
       lens=st.lists(st.integers(2, 200), min_size=1, max_size=8), data=st.data())
def test_split_layer_points_agree_in_every_form(model, lens, data):
    from waveplan.pricing.envelope import build_envelope
    from waveplan.pricing.walk import (
        ATTN_BACKWARD_SEGMENT,
        MLP_BACKWARD,
        MLP_FORWARD,
        MLP_KEPT,
        MLP_NOGRAD,
        MLP_RECOMPUTE,
        MLP_RECOMPUTE_CONST,
        MLP_ROWS,
        MLP_WORKSPACE,
        NO_MLP_POINTS,
    )

    assert model.charges.walk.mlp_points.shape == (MLP_ROWS, 3)
    slots = data.draw(st.lists(st.sampled_from(("a", "b")), min_size=len(lens), max_size=len(lens)))
    grads = data.draw(st.lists(st.booleans(), min_size=len(lens), max_size=len(lens)))
    step = Step.from_requests([Request(id=f"r{i}", num_tokens=n, slot=s, grad=g)
                               for i, (n, s, g) in enumerate(zip(lens, slots, grads, strict=True))])
    pricer = WavePricer.build(step, model)
    sub = np.arange(len(lens), dtype=np.int64)
    for first in (frozenset(), frozenset({"a"})):
        exact = pricer.price([sub], first_slots=first)
        assert pricer.admitted([sub], first_slots=first) == exact.admitted_bytes
    exact = pricer.price([sub])
    present, counts = two_level_counts(step, pricer, sub)
    assert pricer.envelope().value(present, counts) >= exact.admitted_bytes
    lower = build_envelope(model, pricer.class_grad, pricer.class_slot, lower=True)
    assert lower.value(present, counts) <= exact.admitted_bytes
    # the split points are the unsplit ones with the MLP's moved apart: the larger per row at
    # both points and the MLP's constants at every point never price lower
    import dataclasses

    a = model.charges.walk
    m = a.mlp_points
    every = dataclasses.replace(model)
    merged = a._replace(nograd=np.maximum(a.nograd, m[MLP_NOGRAD]),
                        workspace=np.maximum(a.workspace, np.maximum(m[MLP_WORKSPACE], m[MLP_RECOMPUTE])),
                        gdn_state=a.gdn_state + m[ATTN_BACKWARD_SEGMENT], mlp_points=NO_MLP_POINTS)
    # every call keeps its own copies (a no-grad call's at its own MLP point)
    const = pricer.num_classes * m[MLP_KEPT].sum() + max(m[MLP_FORWARD].max(), m[MLP_BACKWARD].max(),
                                                         m[MLP_RECOMPUTE_CONST].max())
    object.__setattr__(every, "charges", dataclasses.replace(model.charges, walk=merged,
                                                             resident=model.charges.resident + const))
    assert WavePricer.build(step, every).price([sub]).raw_bytes >= exact.raw_bytes


def test_split_points_reduce_to_the_walk_when_the_mlp_adds_nothing():
    """A Megatron model's walk with MLP points that repeat its layers' per-row charges and hold
    no constant prices every wave exactly as without them."""
    from waveplan.pricing.walk import MLP_NOGRAD, MLP_ROWS, MLP_WORKSPACE

    model = _model("qwen3-30b-a3b", ParallelLayout(), "full", "chunked:512", "te-gpu")
    a = model.charges.walk
    m = np.zeros((MLP_ROWS, a.retained.shape[0]))
    m[MLP_NOGRAD], m[MLP_WORKSPACE] = a.nograd, a.workspace
    import dataclasses

    split = dataclasses.replace(model)
    object.__setattr__(split, "charges", dataclasses.replace(model.charges, walk=a._replace(mlp_points=m)))
    step = Step.from_requests([Request(id=f"r{i}", num_tokens=n, grad=i % 3 != 0)
                               for i, n in enumerate((900, 4000, 17, 2500))])
    for sub in (np.arange(4, dtype=np.int64), np.array([1, 2], dtype=np.int64)):
        for first in (frozenset(), frozenset({"default"})):
            want = WavePricer.build(step, model).price([sub], first_slots=first)
            got = WavePricer.build(step, split).price([sub], first_slots=first)
            assert got.raw_bytes == want.raw_bytes
            assert WavePricer.build(step, split).admitted([sub], first_slots=first) == want.admitted_bytes
