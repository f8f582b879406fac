"""Properties of the memory model: monotone, envelope above exact, padding and CP respected."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from waveplan.pricing import layout_terms
from waveplan.pricing.lora import LoraConfig, LoraSlot
from waveplan.pricing.model import PricingModel
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.pipeline import rope_cache_per_row
from waveplan.pricing.presets import load_preset
from waveplan.pricing.price import GroupLoad, price_groups, rank_rows
from waveplan.pricing.step import Request, Step
from waveplan.pricing.wave_pricer import WavePricer

PRESETS = ("qwen3-8b", "qwen3-30b-a3b", "qwen3.8-27b", "qwen3.6-35b-a3b")
LAYOUTS = (ParallelLayout(), ParallelLayout(cp=2), ParallelLayout(tp=4, sequence_parallel=True),
           ParallelLayout(tp=2), ParallelLayout(ep=2))
HEADS = ("chunked:512", "full-native", "full-te")
SLOTS = LoraConfig(slots=(LoraSlot(name="a"), LoraSlot(name="b", rank=64)))

_models: dict = {}


def model_for(preset, layout, mode, head):
    key = (preset, layout, mode, head)
    if key not in _models:
        _models[key] = PricingModel.build(load_preset(preset), parallel=layout,
                                          recompute=Recompute(mode=mode), lora=SLOTS, head=head)
    return _models[key]


def _valid(args):
    preset, layout = args[0], args[1]
    return layout.tp == 1 or preset != "qwen3.6-35b-a3b"  # 2 KV groups cannot split over TP4


models = st.tuples(st.sampled_from(PRESETS), st.sampled_from(LAYOUTS),
                   st.sampled_from(("full", "selective", "none")),
                   st.sampled_from(HEADS)).filter(_valid).map(lambda args: model_for(*args))


@st.composite
def loads(draw):
    out = []
    for _ in range(draw(st.integers(1, 4))):
        packed = draw(st.integers(1, 40_000))
        pad = draw(st.integers(0, 64))
        out.append(GroupLoad(slot=draw(st.sampled_from(("a", "b"))), grad=draw(st.booleans()),
                             packed_rows=packed, padded_rows=packed + pad,
                             logical_rows=packed + draw(st.integers(0, 100_000)),
                             segments=draw(st.integers(1, 500))))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=models, groups=loads(), which=st.integers(0, 3), field=st.sampled_from(
    ("padded_rows", "logical_rows", "segments")), more=st.integers(1, 5000),
    first=st.sets(st.sampled_from(("a", "b"))))
def test_price_never_falls_when_a_count_grows(model, groups, which, field, more, first):
    which %= len(groups)
    before = price_groups(model, groups, first_slots=frozenset(first))
    grown = list(groups)
    g = grown[which]
    values = {k: getattr(g, k) for k in ("slot", "grad", "packed_rows", "padded_rows", "logical_rows", "segments")}
    values[field] += more
    grown[which] = GroupLoad(**values)
    after = price_groups(model, grown, first_slots=frozenset(first))
    assert after.raw_bytes >= before.raw_bytes
    assert after.admitted_bytes >= before.raw_bytes
    assert before.admitted_bytes >= before.raw_bytes


@st.composite
def steps(draw):
    requests = []
    for g in range(draw(st.integers(1, 6))):
        prompt = draw(st.integers(1, 3000))
        for c in range(draw(st.integers(1, 6))):
            requests.append(Request(
                id=f"g{g}-c{c}", prompt=f"g{g}", num_prompt_tokens=prompt,
                num_tokens=prompt + draw(st.integers(1, 4000)),
                slot="a" if g % 2 == 0 else draw(st.sampled_from(("a", "b"))),
                grad=draw(st.booleans()) if g == 0 else True))
    for s in range(draw(st.integers(0, 3))):
        requests.append(Request(id=f"sft{s}", num_tokens=draw(st.integers(1, 5000)), slot="b"))
    return Step.from_requests(requests)


def two_level_counts(step, pricer, sub):
    present = np.zeros(pricer.num_classes, dtype=bool)
    counts = np.zeros((pricer.num_classes, 3))
    for k in range(pricer.num_classes):
        members = sub[pricer.class_of[sub] == k]
        if members.size == 0:
            continue
        groups = np.unique(step.group_of[members])
        present[k] = True
        counts[k] = (step.prefix_rows[groups].sum() + step.own_rows[members].sum(),
                     sum(step.requests[i].num_tokens for i in members), groups.size + members.size)
    return present, counts


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=models, step=steps(), data=st.data())
def test_envelope_never_below_exact_price(model, step, data):
    pricer = WavePricer.build(step, model)
    envelope = pricer.envelope()
    n = len(step.requests)
    size = data.draw(st.integers(1, n))
    sub = np.sort(np.array(data.draw(st.permutations(range(n)))[:size], dtype=np.int64))
    exact = pricer.price([sub]).admitted_bytes
    present, counts = two_level_counts(step, pricer, sub)
    assert envelope.value(present, counts) >= exact


def test_tp_padding_per_sequence():
    model = model_for("qwen3.8-27b", ParallelLayout(tp=4, sequence_parallel=True), "full", "chunked:512")
    step = Step.from_requests([Request(id="a", num_tokens=1001, slot="a"), Request(id="b", num_tokens=1003, slot="a")])
    (load,) = WavePricer.build(step, model).group_loads([np.array([0, 1])])
    assert load.packed_rows == 2004
    assert load.padded_rows == 1004 + 1004          # each sequence to a multiple of TP
    assert load.segments == 2 + (2008 - 2004)       # one root per padding row


def test_cp_busiest_rank_rows():
    # on one kernel path: te-gpu prices CP1's retained dense layers by the fused kernels' model
    # and CP2's by the fitted terms (docs/memory-model.md#gpu-kernel-allocation-models)
    def model_for(preset, layout, mode, head):
        return PricingModel.build(load_preset(preset), parallel=layout, recompute=Recompute(mode=mode),
                                  lora=SLOTS, head=head, backend="torch-cpu")

    cp2 = model_for("qwen3-8b", ParallelLayout(cp=2), "selective", "chunked:512")
    step = Step.from_requests([Request(id="a", num_tokens=4097, slot="a")])
    (load,) = WavePricer.build(step, cp2).group_loads([np.array([0])])
    assert load.padded_rows == 4100                 # a multiple of 2 x CP
    assert rank_rows(cp2, load.padded_rows) == 2050  # chunks r and 2CP-1-r: half on each rank
    cp1 = model_for("qwen3-8b", ParallelLayout(), "selective", "chunked:512")
    half = price_groups(cp1, [GroupLoad(slot="a", packed_rows=2050, padded_rows=2050, logical_rows=4097,
                                        segments=1)])
    # the rank's half of the rows, plus the RoPE cache of the whole sequence beyond them
    g = cp2.geometry
    rope = layout_terms.cp_rope_cache_per_row(rope_cache_per_row(g, g.layers), cp=2) * 2050
    assert rope == 4 * g.attention.head_dim * 2050
    assert price_groups(cp2, [load]).raw_bytes == pytest.approx(half.raw_bytes + rope, rel=1e-9)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=models, step=steps(), data=st.data())
def test_lower_envelope_never_above_exact_price(model, step, data):
    from waveplan.pricing.envelope import build_envelope

    pricer = WavePricer.build(step, model)
    lower = build_envelope(model, pricer.class_grad, pricer.class_slot, lower=True)
    n = len(step.requests)
    sub = np.sort(np.array(data.draw(st.permutations(range(n)))[:data.draw(st.integers(1, n))]))
    exact = pricer.price([sub]).admitted_bytes
    counts = np.zeros((pricer.num_classes, 3))
    for k in range(pricer.num_classes):
        members = sub[pricer.class_of[sub] == k]
        if members.size:
            from waveplan.pricing.layout import layout

            total = layout(step, members)
            counts[k, :2] = total.packed_rows, total.logical_rows
    assert np.einsum("pkc,kc->p", lower.coef, counts).max() <= exact
    # and the bound on waves never exceeds a trivial plan's count (one request per wave)
    budget = max(pricer.price([np.array([i])]).admitted_bytes for i in range(n))
    assert pricer.lower_bound_waves(budget) <= n
