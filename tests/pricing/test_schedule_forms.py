"""The schedule is written once as the walk (`pricing.walk`) and kept in two other forms: the
envelope's affine points (`pricing.envelope`, an upper bound the search packs against) and
calibration's numpy points (`measure.calibrate.model_points`, what a fit is solved against).
On random one-call gradient waves of random configurations the three agree: calibration's
points peak at the walk's raw price, and the envelope never prices below the walk."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pricing_properties import two_level_counts

from waveplan.pricing.lora import LoraConfig, LoraSlot
from waveplan.pricing.measure.calibrate import model_points
from waveplan.pricing.model import PricingModel
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.presets import load_preset
from waveplan.pricing.price import GroupLoad, price_groups, rank_rows
from waveplan.pricing.step import Request, Step
from waveplan.pricing.wave_pricer import WavePricer

PRESETS = ("qwen3-8b", "llama-3.1-8b", "qwen3-30b-a3b", "qwen3.8-27b")
# CP1: calibration's form leaves out what the walk credits of the CP RoPE entry
LAYOUTS = (ParallelLayout(), ParallelLayout(tp=2), ParallelLayout(tp=4, sequence_parallel=True),
           ParallelLayout(tp=2, sequence_parallel=True))
HEADS = ("chunked:512", "full-native", "full-te")
LORA = LoraConfig(slots=(LoraSlot(rank=16),))

_models: dict = {}


def _model(preset, layout, mode, head, backend) -> PricingModel:
    key = (preset, layout, mode, head, backend)
    if key not in _models:
        _models[key] = PricingModel.build(load_preset(preset), parallel=layout,
                                          recompute=Recompute(mode=mode), lora=LORA, head=head,
                                          backend=backend)
    return _models[key]


models = st.builds(_model, st.sampled_from(PRESETS), st.sampled_from(LAYOUTS),
                   st.sampled_from(("full", "selective", "none")), st.sampled_from(HEADS),
                   st.sampled_from(("te-gpu", "torch-cpu")))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=models, units=st.integers(1, 300), segments=st.integers(1, 64))
def test_calibrations_points_peak_at_the_walks_price(model, units, segments):
    # rows a multiple of the GDN kernel's chunk and the layout's row multiple: no padding rows
    rows = units * math.lcm(64, model.parallel.row_multiple)
    load = GroupLoad(slot="default", grad=True, packed_rows=rows, padded_rows=rows,
                     logical_rows=rows, segments=segments)
    walk = price_groups(model, [load], first_slots=frozenset({"default"}), profiled=True)
    points = model_points(model, rank_rows(model, rows), segments)
    assert abs(points.max() - walk.raw_bytes) <= 1.0


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=models, lens=st.lists(st.integers(64, 6000), min_size=1, max_size=12),
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
