"""The CP RoPE cache priced from each forward call's longest sequence (docs/memory-model.md#cp-rope-cache):
the arrays carry the bound (the call as one sequence, CP x its rank rows of entry), the walk
credits what the call's longest sequence does not hold (`walk.rope_credit`)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waveplan.pricing.errors import ConfigError
from waveplan.pricing.lora import LoraConfig, LoraSlot
from waveplan.pricing.model import PricingModel
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.pipeline import rope_cache_per_row
from waveplan.pricing.presets import load_preset
from waveplan.pricing.price import GroupLoad, price_groups, rank_rows
from waveplan.pricing.step import Request, Step
from waveplan.pricing.wave_pricer import WavePricer

FIRST = frozenset({"default"})


def _model(cp: int, recompute: str = "full", tp: int = 4, name: str = "qwen3-8b") -> PricingModel:
    return PricingModel.build(load_preset(name), parallel=ParallelLayout(tp=tp, sequence_parallel=tp > 1, cp=cp),
                              recompute=Recompute(mode=recompute))


def _load(rows: int, longest: int | None) -> GroupLoad:
    return GroupLoad(packed_rows=rows, padded_rows=rows, logical_rows=rows, segments=4, longest_rows=longest)


def _raw(model: PricingModel, rows: int, longest: int | None) -> int:
    return price_groups(model, [_load(rows, longest)], first_slots=FIRST).raw_bytes


@pytest.mark.parametrize("recompute", ["full", "selective", "none"])
@pytest.mark.parametrize("cp", [2, 4])
def test_an_unknown_longest_sequence_is_priced_as_one_sequence(cp, recompute):
    model = _model(cp, recompute)
    rows = 8192
    assert _raw(model, rows, None) == _raw(model, rows, rows)


@pytest.mark.parametrize("recompute", ["full", "selective", "none"])
@pytest.mark.parametrize("cp", [2, 4])
def test_a_packed_call_is_credited_the_entry_rows_its_longest_sequence_does_not_hold(cp, recompute):
    model = _model(cp, recompute)
    rows = 8192
    per_rank = rank_rows(model, rows)
    entry = rope_cache_per_row(model.geometry, model.geometry.layers)
    one_sequence = price_groups(model, [_load(rows, rows)], first_slots=FIRST)
    # a longest sequence within the rank's rows: the per-row terms price its whole entry
    short = price_groups(model, [_load(rows, per_rank)], first_slots=FIRST)
    assert short.binding == one_sequence.binding
    assert one_sequence.raw_bytes - short.raw_bytes == pytest.approx(entry * (cp - 1) * per_rank, abs=2)
    # half the wave in its longest sequence: half the bound is credited back at CP2, more at CP4
    half = _raw(model, rows, rows // 2)
    assert one_sequence.raw_bytes - half == pytest.approx(entry * (rows - rows // 2), abs=2)


def test_cp1_prices_no_credit():
    model = _model(1)
    assert model.charges.walk.rope_cp == 0.0
    assert _raw(model, 4096, 16) == _raw(model, 4096, 4096) == _raw(model, 4096, None)


def test_pipeline_stages_keep_the_bound():
    model = PricingModel.build(load_preset("qwen3-8b"), parallel=ParallelLayout(tp=2, sequence_parallel=True, cp=2, pp=2),
                               recompute=Recompute(mode="full"))
    assert model.charges.walk.rope_cp == 0.0


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(64, 32_768), a=st.floats(0, 1), b=st.floats(0, 1),
       cp=st.sampled_from((2, 4)), recompute=st.sampled_from(("full", "selective", "none")),
       name=st.sampled_from(("qwen3-8b", "llama-3.1-8b", "qwen3-30b-a3b", "qwen3.8-27b")))
def test_a_longer_sequence_never_prices_lower_and_never_above_the_bound(rows, a, b, cp, recompute, name):
    model = _model(cp, recompute, tp=2, name=name)
    short, long_ = sorted((int(a * rows), int(b * rows)))
    prices = [_raw(model, rows, short), _raw(model, rows, long_), _raw(model, rows, None)]
    assert prices[0] <= prices[1] <= prices[2]


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(256, 32_768), frac=st.floats(0, 1), recompute=st.sampled_from(("full", "selective", "none")))
def test_more_cp_never_prices_higher_with_the_longest_sequence_known(rows, frac, recompute):
    longest = int(frac * rows)
    prices = [_raw(_model(cp, recompute), rows, longest) for cp in (1, 2, 4)]
    assert prices[0] >= prices[1] >= prices[2], prices


def test_group_loads_carry_the_longest_padded_sequence_and_both_exact_prices_agree():
    model = _model(2, "full", tp=2)
    lengths = [3000, 1200, 700, 655, 64]
    step = Step.from_requests([Request(id=f"r{i}", num_tokens=n) for i, n in enumerate(lengths)])
    pricer = WavePricer.build(step, model)
    multiple = model.parallel.row_multiple
    for members in ([0, 1, 2, 3, 4], [1, 2, 3], [4]):
        idx = np.asarray(members)
        (load,) = pricer.group_loads([idx])
        assert load.longest_rows == max(-(-lengths[i] // multiple) * multiple for i in members)
        for first in (frozenset(), FIRST):
            assert pricer.admitted([idx], first_slots=first) == pricer.price([idx], first_slots=first).admitted_bytes
    # split children: each call its own longest sequence
    loads = pricer.group_loads([np.asarray([0]), np.asarray([1, 2, 3, 4])])
    assert [g.longest_rows for g in loads] == [3000 + (-3000) % multiple, 1200 + (-1200) % multiple]
    children = [np.asarray([0]), np.asarray([1, 2, 3, 4])]
    assert pricer.admitted(children) == pricer.price(children).admitted_bytes


@pytest.mark.parametrize("recompute", ["full", "none"])
def test_the_lower_envelope_stays_below_the_exact_price(recompute):
    model = _model(4, recompute, tp=2)
    lengths = [40, 52, 64, 80, 96, 31, 17, 120]
    step = Step.from_requests([Request(id=f"r{i}", num_tokens=n) for i, n in enumerate(lengths)])
    pricer = WavePricer.build(step, model, profiled=True)
    lower = pricer._cached_envelope(lower=True)
    for k in range(1, len(lengths) + 1):
        idx = np.arange(k)
        (load,) = pricer.group_loads([idx])
        counts = np.asarray([[load.packed_rows, load.logical_rows, load.segments]], dtype=np.float64)
        assert lower.value(np.asarray([True]), counts) <= pricer.admitted([idx])
        assert pricer.envelope().value(np.asarray([True]), counts) >= pricer.admitted([idx])


def test_a_bad_longest_sequence_names_the_field():
    with pytest.raises(ConfigError, match="group.longest_rows"):
        GroupLoad(packed_rows=10, padded_rows=12, logical_rows=10, segments=1, longest_rows=13)
    with pytest.raises(ConfigError, match="group.longest_rows"):
        GroupLoad(packed_rows=10, padded_rows=12, logical_rows=10, segments=1, longest_rows=-1)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_each_call_keeps_its_own_entry_beside_the_others(cp):
    """A call's own entry is in its per-row terms; the other calls' entries are charged beside it
    (Megatron's lru_cache keeps one per distinct longest length), and the envelope bounds them."""
    model = PricingModel.build(load_preset("qwen3-8b"), parallel=ParallelLayout(tp=2, sequence_parallel=True, cp=cp),
                               lora=LoraConfig(slots=(LoraSlot(name="a"), LoraSlot(name="b"))))
    entry = rope_cache_per_row(model.geometry, model.geometry.layers)
    big = GroupLoad(slot="a", packed_rows=16_384, padded_rows=16_384, logical_rows=16_384, segments=2,
                    longest_rows=8192)
    alone = price_groups(model, [big])
    for longest in (64, 512, 1024):
        small = GroupLoad(slot="b", grad=False, packed_rows=1024, padded_rows=1024, logical_rows=1024,
                          segments=2, longest_rows=longest)
        both = price_groups(model, [big, small])
        assert both.binding == alone.binding
        assert both.terms["other_groups"] - alone.terms["other_groups"] == pytest.approx(entry * longest, abs=1)
    lengths = [700, 1300, 90, 2100, 450, 33]
    step = Step.from_requests([Request(id=f"r{i}", num_tokens=n, slot="ab"[i % 2], grad=i % 3 != 0)
                               for i, n in enumerate(lengths)])
    pricer = WavePricer.build(step, model)
    env = pricer.envelope()
    rng = np.random.default_rng(7)
    for _ in range(20):
        idx = np.flatnonzero(rng.random(len(lengths)) < 0.6)
        if idx.size == 0:
            continue
        present = np.zeros(pricer.num_classes, dtype=bool)
        counts = np.zeros((pricer.num_classes, 3))
        for load in pricer.group_loads([idx]):
            k = [i for i in range(pricer.num_classes)
                 if (pricer.class_slot[i], pricer.class_grad[i]) == (load.slot, load.grad)][0]
            present[k] = True
            counts[k] = (load.packed_rows, load.logical_rows, load.segments)
        assert env.value(present, counts) >= pricer.admitted([idx])
