"""Pricing speed: one wave on the 64-layer preset (jitted), and the envelope.

Run: .venv/bin/pytest bench/bench_pricing.py --benchmark-only
"""

import numpy as np
import pytest

from waveplan.pricing.envelope import build_envelope
from waveplan.pricing.model import PricingModel
from waveplan.pricing.parallel import ParallelLayout
from waveplan.pricing.presets import load_preset
from waveplan.pricing.price import GroupLoad, price_groups
from waveplan.pricing.step import bundled_step, load_step
from waveplan.pricing.wave_pricer import WavePricer


@pytest.fixture(scope="module")
def model():
    return PricingModel.build(load_preset("qwen3.8-27b"), parallel=ParallelLayout(tp=4, sequence_parallel=True))


def test_price_one_wave_64_layers(benchmark, model):
    wave = [GroupLoad(packed_rows=25_728, padded_rows=25_728, logical_rows=25_728, segments=9)]
    price_groups(model, wave)  # JIT outside the timing
    result = benchmark(price_groups, model, wave, first_slots=frozenset({"default"}))
    assert result.raw_bytes > 0


def test_price_step_subset_with_layout(benchmark, model):
    pricer = WavePricer.build(load_step(bundled_step("grpo-8x8")), model)
    wave = [np.arange(16, dtype=np.int64)]
    pricer.price(wave)
    assert benchmark(pricer.price, wave).raw_bytes > 0


def test_envelope(benchmark, model):
    assert benchmark(build_envelope, model, (True, False), ("default", "default")).num_points > 0
