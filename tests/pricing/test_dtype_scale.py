"""An fp32 model is priced as its bf16 twin with every charge doubled (`coverage.dtype_scale`),
basis conservative with the dtype named: the traces are of bf16 models
(docs/memory-model.md#basis)."""

import dataclasses

import numpy as np
import pytest

from waveplan.pricing.model import PricingModel
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.presets import load_preset
from waveplan.pricing.step import load_step
from waveplan.pricing.wave_pricer import WavePricer


def _price(geometry, recompute="full", pp=1):
    model = PricingModel.build(geometry, parallel=ParallelLayout(tp=2, sequence_parallel=True, pp=pp),
                               recompute=Recompute(mode=recompute), backend="torch-cpu")
    step = load_step("grpo-8x8")
    pricer = WavePricer(step, model)
    return model, pricer.price([np.arange(len(step.requests))])


@pytest.mark.parametrize("recompute", ["full", "none"])
def test_fp32_is_priced_at_twice_its_bf16_twin_and_says_so(recompute):
    bf16 = load_preset("qwen3-8b")
    fp32 = dataclasses.replace(bf16, dtype="fp32")
    m16, p16 = _price(bf16, recompute)
    m32, p32 = _price(fp32, recompute)
    assert not any("dtype" in r for r in m16.reasons)
    assert any(r.startswith("dtype fp32") for r in m32.reasons) and p32.basis == "conservative"
    # every bf16 tensor doubled; the fp32 RoPE cache entries are the same bytes at any dtype
    assert 1.95 * p16.raw_bytes <= p32.raw_bytes <= 2 * p16.raw_bytes


def test_fp16_is_priced_as_bf16():
    bf16 = load_preset("qwen3-8b")
    _, p16 = _price(bf16)
    _, ph = _price(dataclasses.replace(bf16, dtype="fp16"))
    assert ph.raw_bytes == p16.raw_bytes and ph.basis == p16.basis
