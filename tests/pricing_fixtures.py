"""Pricing helpers the pricing and measure tests share: a model of a geometry's first layers as
the trace cells are priced, and one wave's raw price from one forward call of a number of rows,
or from a list of sequence lengths (each its own request), the way the trace cells are compared
with the model."""

from __future__ import annotations

import dataclasses

import numpy as np

from waveplan.pricing.coefficients import load_table
from waveplan.pricing.lora import LoraConfig, LoraSlot
from waveplan.pricing.model import PricingModel
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.price import GroupLoad, price_groups
from waveplan.pricing.step import Request, Step
from waveplan.pricing.wave_pricer import WavePricer


def one_group_raw(model: PricingModel, rows: int = 4096) -> int:
    """Raw bytes of one forward call of `rows` rows in rows / 1024 segments, the slot's first
    gradient wave."""
    group = GroupLoad(packed_rows=rows, padded_rows=rows, logical_rows=rows, segments=rows // 1024)
    return price_groups(model, [group], first_slots=frozenset({"default"})).raw_bytes


def wave_raw(model: PricingModel, seq_lens) -> int:
    """Raw bytes of one wave of the sequences `seq_lens` (a request each; profiled: no
    first-execution allowance), the slot's first gradient wave."""
    step = Step.from_requests([Request(id=f"r{i}", num_tokens=int(n)) for i, n in enumerate(seq_lens)])
    return WavePricer.build(step, model, profiled=True).price(
        [np.arange(len(step.requests))], first_slots=frozenset({"default"})).raw_bytes


def layers_model(geometry, *, table: str = "te-gpu", recompute: str = "none",
                 parallel: ParallelLayout | None = None, layers: int = 2, rank: int = 16) -> PricingModel:
    """`geometry`'s first `layers` decoder layers priced as the te-gpu grid's cells are: one LoRA
    slot of `rank` with 2-byte adapter gradients, the full-native head, safety 1.0."""
    g = dataclasses.replace(geometry, layers=geometry.layers[:layers])
    return PricingModel(geometry=g, parallel=parallel or ParallelLayout(),
                        recompute=Recompute(mode=recompute),
                        lora=LoraConfig(slots=(LoraSlot(rank=rank),), grad_bytes=2),
                        table=load_table(table), head="full-native", safety=1.0)
