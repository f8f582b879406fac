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
