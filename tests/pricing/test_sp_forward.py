"""Where a TP+SP wave without full recompute peaks: the forward (docs/memory-model.md#sp-head-forward).

The head's forward point holds the larger of the head's retained bytes and what the full-native
head holds at its forward under SP (`layout_terms.sp_head_forward_per_row`); a retained SP
layer's forward form holds the full-row LoRA output and five sequence-sharded tensors. With the
layout residual set to 0 these structural points alone cover every dense TP+SP CP1 cell under
selective and no recompute (they fell 2-14% under before the forward was priced)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from bench_modules import BENCH, bench_module

from waveplan.pricing import layout_terms
from waveplan.pricing.coefficients import load_table
from waveplan.pricing.geometry import ModelGeometry
from waveplan.pricing.walk import (
    PEAK_BYTES,
    PEAK_POINT,
    POINT_HEAD_FORWARD,
    WalkCharges,
    WalkGroups,
    walk,
)

RESULTS = BENCH / "results"
DENSE_FILES = ("traces_multirank.jsonl", "traces_multirank_dense2.jsonl", "traces_multirank_dense3.jsonl")


def _widths(tp: int) -> dict:
    from waveplan.pricing.model import layer_widths

    g = ModelGeometry.from_dict(json.loads((RESULTS / "traces_multirank_dense3.jsonl").read_text()
                                           .splitlines()[0])["cell"]["geometry"])
    return g, layer_widths(g, tp=tp)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_sp_head_forward_is_both_logits_copies_and_the_sharded_hidden_tensors(tp):
    table = load_table("torch-cpu")
    g, widths = _widths(tp)
    got = layout_terms.sp_head_forward_per_row(table, widths, tp=tp, sequence_parallel=True)
    assert got == pytest.approx(6 * math.ceil(g.vocab / tp) + 8 * g.hidden / tp)
    # none without SP; te-gpu's: the logits copies beside TE RMSNorm's input and output (4H / TP,
    # no fp32 copy; docs/memory-model.md#gpu-kernel-allocation-models)
    assert layout_terms.sp_head_forward_per_row(table, widths, tp=tp, sequence_parallel=False) == 0.0
    assert layout_terms.sp_head_forward_per_row(load_table("te-gpu"), widths, tp=tp,
                                                sequence_parallel=True) == pytest.approx(
        6 * math.ceil(g.vocab / tp) + 4 * g.hidden / tp)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_sp_layers_charge_the_rope_entrys_own_rows_once_per_wave(cp):
    """Beside the dense SP structural terms the wave carries one fp32 RoPE entry row per rank row,
    and under CP the rows CP adds beyond them (`cp_rope_cache_per_row`)."""
    from waveplan.pricing.layer_arrays import wave_rope_cache_per_row
    from waveplan.pricing.lora import LoraConfig, LoraSlot
    from waveplan.pricing.model import PricingModel
    from waveplan.pricing.parallel import ParallelLayout, Recompute
    from waveplan.pricing.pipeline import rope_cache_per_row

    g, _ = _widths(1)
    entry = rope_cache_per_row(g, g.layers)
    assert entry == 4 * 128   # fp32 x rotary dim 128

    def rope(table: str, sp: bool) -> float:
        m = PricingModel(geometry=g, parallel=ParallelLayout(tp=4, sequence_parallel=sp, cp=cp),
                         recompute=Recompute(mode="selective"), table=load_table(table), head="full-native",
                         lora=LoraConfig(slots=(LoraSlot(rank=16),)))
        return wave_rope_cache_per_row(m.layer_context())

    beyond = layout_terms.cp_rope_cache_per_row(entry, cp=cp)
    assert rope("torch-cpu", True) == pytest.approx(entry + beyond)
    if cp == 1:
        assert rope("torch-cpu", False) == 0.0   # without SP the fitted layers absorb it
    # te-gpu: beside its kernel-model retained layers (CP1) the entry's rows too; under CP at TP > 1
    # its fitted layers absorb them (docs/memory-model.md#gpu-kernel-allocation-models)
    assert rope("te-gpu", True) == pytest.approx(beyond + (entry if cp == 1 else 0.0))


def _one_group_walk(head_retained: float, head_forward: float) -> tuple[float, int]:
    retained = np.array([10.0, 10.0])
    zeros = np.zeros(2)
    charges = WalkCharges(retained, zeros, zeros, zeros, np.zeros((1, 2)), 0.0, head_retained, 0.0, 0.0, 0.0,
                          zeros, zeros, 1.0, head_forward=head_forward)
    groups = WalkGroups(np.array([100.0]), np.array([100.0]), np.array([1.0]), np.array([True]),
                        np.array([0]), np.array([False]), np.array([100.0]))
    best, _ = walk(charges, 0.0, groups)
    return best[PEAK_BYTES], int(best[PEAK_POINT])


def test_walk_charges_the_larger_of_head_retained_and_head_forward_at_the_head_forward_point():
    peak, point = _one_group_walk(head_retained=5.0, head_forward=30.0)
    assert point == POINT_HEAD_FORWARD
    assert peak == pytest.approx(100.0 * (20.0 + 30.0))
    # below the head's retained bytes the forward adds nothing
    assert _one_group_walk(head_retained=5.0, head_forward=1.0) == _one_group_walk(5.0, 0.0)


def _sp_retained_cells() -> list[dict]:
    out = []
    for name in DENSE_FILES:
        for line in (RESULTS / name).read_text().splitlines():
            rec = json.loads(line)
            cell, lay = rec["cell"], rec["cell"]["layout"]
            dense = not cell["geometry"]["moe"] and not cell["geometry"].get("gdn")
            if (dense and lay["sequence_parallel"] and lay["cp"] == 1 and cell["recompute"] != "full"
                    and rec["trace"]["tokens"] == 2048):
                out.append(rec)
    return out


def test_sp_retained_cells_peak_in_the_forward_and_the_structural_points_cover_them():
    lv = bench_module("layout_validation")
    base = load_table("torch-cpu")
    cells = _sp_retained_cells()
    assert {c["cell"]["geometry"]["name"] for c in cells} == {
        "grid-dense-h1024", "grid-dense-h768", "grid-dense-h1536"}
    for rec in cells:
        cell, trace = rec["cell"], rec["trace"]
        busiest = trace["ranks"][trace["busiest_rank"]]
        assert busiest["peak_forward_bytes"] >= busiest["peak_backward_bytes"]
        key, _ = lv.key_and_group(cell)
        bare = dataclasses.replace(base, terms=dict(base.terms, **{
            layout_terms.ENTRY: {"full": {key: 0.0}, "retained": {key: 0.0}, "source": "test"}}))
        raw, _ = lv.estimate(cell, bare)
        ratio = raw / trace["peak_bytes"]
        assert 0.999 <= ratio <= 1.02, (cell["geometry"]["name"], key, cell["recompute"], ratio)
