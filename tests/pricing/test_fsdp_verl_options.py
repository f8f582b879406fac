"""veRL's FSDP options no trace covers (docs/memory-model.md#fsdp-verl-options): padded rows
(`use_remove_padding=False`), `entropy_checkpointing` and `use_liger`, each priced by a bound
with its reason on the basis; the layout's JSON is unchanged when they are off."""

from __future__ import annotations

import json

import numpy as np
import pytest

from waveplan.pricing.errors import ConfigError
from waveplan.pricing.fsdp.layout import FsdpLayout
from waveplan.pricing.fsdp.model import (
    ENTROPY_CHECKPOINTING_GAP,
    LIGER_GAP,
    PADDED_GAP,
    FsdpPricingModel,
    build_fsdp_model,
    for_step,
    padded_step,
)
from waveplan.pricing.hf_config import load_hf_config
from waveplan.pricing.lora import LoraConfig, LoraSlot
from waveplan.pricing.step import Step
from waveplan.pricing.wave_pricer import WavePricer

CONFIG = dict(model_type="llama", hidden_size=192, intermediate_size=512, num_hidden_layers=3,
              num_attention_heads=6, num_key_value_heads=2, head_dim=32, vocab_size=2048,
              tie_word_embeddings=False)


def model(**kw):
    return build_fsdp_model(load_hf_config(dict(CONFIG)), fsdp=2, lora=LoraConfig(slots=(LoraSlot(rank=8),)),
                            attn_rows=1, **{"attn": "sdpa", "checkpointing": False, **kw})


def price(m, lens):
    step = Step.from_lengths([0] * len(lens), list(lens))
    m, step = for_step(m, step)
    return WavePricer.build(step, m).price([np.arange(len(lens))], first_slots=frozenset({"default"})).raw_bytes


def test_the_options_off_leave_the_layout_json_and_the_price_as_they_were():
    lay = FsdpLayout(fsdp=2, attn="sdpa")
    assert set(lay.to_dict()) == {"fsdp", "attn", "checkpointing", "reshard_after_forward", "ulysses"}
    on = FsdpLayout(fsdp=2, attn="sdpa", head="verl", remove_padding=False, entropy_checkpointing=True,
                    liger=True)
    assert FsdpLayout.from_dict(json.loads(json.dumps(on.to_dict()))) == on
    m = model(liger=True, entropy_checkpointing=True, head="verl", remove_padding=False)
    assert FsdpPricingModel.from_dict(json.loads(json.dumps(m.to_dict()))).fsdp_layout == m.fsdp_layout


def test_padded_rows_price_every_sequence_at_the_step_longest_and_say_why():
    packed, padded = model(), model(remove_padding=False)
    assert packed.basis == "evidence" and PADDED_GAP not in packed.gaps
    assert padded.basis == "conservative" and PADDED_GAP in padded.gaps
    step = Step.from_lengths([0, 0, 0], [300, 40, 20])
    assert [r.num_tokens for r in padded_step(step).requests] == [300, 300, 300]
    assert [r.id for r in padded_step(step).requests] == [r.id for r in step.requests]
    # a wave of B sequences runs B x its longest rows: never priced below the packed row of the
    # same B x longest tokens, and above the packed price of its own tokens
    assert price(padded, [300, 40, 20]) == price(packed, [300, 300, 300]) > price(packed, [300, 40, 20])
    # equal lengths pad nothing
    assert price(padded, [128, 128]) == price(packed, [128, 128])


def test_padded_rows_under_ulysses_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="remove_padding"):
        FsdpLayout(fsdp=2, attn="sdpa", ulysses=2, remove_padding=False)
    with pytest.raises(ConfigError, match="liger"):
        FsdpLayout(fsdp=2, liger=1)


def test_entropy_checkpointing_and_liger_are_priced_as_without_them_with_their_reason():
    base = model(head="verl")
    ckpt = model(head="verl", entropy_checkpointing=True)
    liger = model(liger=True)
    assert ENTROPY_CHECKPOINTING_GAP in ckpt.gaps and ckpt.basis == "conservative"
    assert LIGER_GAP in liger.gaps and liger.basis == "conservative"
    lens = [200, 96, 64]
    assert price(ckpt, lens) == price(base, lens)
    assert price(liger, lens) == price(model(), lens)
    # transformers' loss computes no entropy: the option changes nothing there
    assert ENTROPY_CHECKPOINTING_GAP not in model(entropy_checkpointing=True).gaps
