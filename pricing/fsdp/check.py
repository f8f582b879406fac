"""Price a traced FSDP wave (`measure.fsdp_trace.FsdpTrace.to_dict()`) as the model would:
the held-out comparison of bench/fsdp_validation.py and the tests."""

from __future__ import annotations

import numpy as np

from ..hf_config import load_hf_config
from ..lora import LoraConfig, LoraSlot
from ..price import Breakdown
from ..step import Step
from ..wave_pricer import WavePricer
from .model import build_fsdp_model, for_step


def price_record(record: dict, *, backend: str = "torch-cpu", table=None) -> Breakdown:
    """The raw price of a trace record's wave (its first gradient wave: the adapter gradients
    allocated), on its configuration; `table` (a `CoefficientTable`) in place of `backend`'s, as
    `waveplan calibrate` prices a fitted one. O(layers + sequences)."""
    geometry = load_hf_config(dict(record["config"]))
    model = build_fsdp_model(geometry, fsdp=int(record["fsdp"]), attn=record["attn"],
                             checkpointing=bool(record["checkpointing"]),
                             reshard_after_forward=bool(record.get("reshard_after_forward", True)),
                             ulysses=int(record.get("ulysses", 1)),
                             head=record.get("head", "transformers"),
                             remove_padding=bool(record.get("remove_padding", True)),
                             lora=LoraConfig(slots=(LoraSlot(rank=int(record["lora_rank"])),)),
                             backend=backend, attn_rows=1)
    if table is not None:
        import dataclasses

        model = dataclasses.replace(model, table=table)
    lens = [int(n) for n in record["seq_lens"]]
    step = Step.from_lengths([0] * len(lens), lens)
    model, step = for_step(model, step)
    pricer = WavePricer.build(step, model)
    return pricer.price([np.arange(len(step.requests))], first_slots=frozenset({"default"}))
