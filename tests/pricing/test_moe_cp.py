"""MoE layers under context parallelism (docs/memory-model.md#moe-cp): every traced MoE cell with
CP > 1 (TP1, TP2+SP and TP4+SP with CP2 and CP4; full, selective, none; EP with CP) is priced
at or over its busiest rank with the existing terms, and the classes are credited as themselves
(evidence under full recompute; the conservative basis, with the layout's credit, without it)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from pricing_fixtures import one_group_raw, wave_raw

from waveplan.pricing import moe_terms
from waveplan.pricing.coefficients import load_table
from waveplan.pricing.geometry import ModelGeometry
from waveplan.pricing.lora import LoraConfig, LoraSlot
from waveplan.pricing.model import PricingModel
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.presets import load_preset

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _cp_cells() -> list[dict]:
    path = RESULTS / "traces_multirank_ep.jsonl"
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [rec for rec in out if rec["cell"]["geometry"]["moe"] and rec["cell"]["layout"]["cp"] > 1]


def _model(cell: dict, table, load: float | None) -> PricingModel:
    g = ModelGeometry.from_dict(cell["geometry"])
    g = dataclasses.replace(g, layers=g.layers[:cell["num_layers"]])
    return PricingModel(geometry=g, parallel=ParallelLayout(**cell["layout"]),
                        recompute=Recompute(mode=cell["recompute"]),
                        lora=LoraConfig(slots=(LoraSlot(rank=cell["lora_rank"]),), grad_bytes=2),
                        table=table, head="full-native", safety=1.0, moe_load=load)


def test_every_moe_cp_cell_is_priced_at_or_over_its_trace():
    """torch-cpu, at the cell's own layout: never under, credited as its own layout; per class and
    recompute mode the median within 3 % and the worst within 10 % (EP cells at the load 1 they
    ran; at the default worst-case load they stay over, a bound)."""
    table = load_table("torch-cpu")
    ratios: dict[tuple, list[float]] = {}
    cells = _cp_cells()
    assert len(cells) >= 52
    for rec in cells:
        cell, trace = rec["cell"], rec["trace"]
        lay = cell["layout"]
        for load in [None] + ([1.0] if lay["ep"] > 1 else []):
            model = _model(cell, table, load)
            ratio = wave_raw(model, cell["seq_lens"]) / trace["peak_bytes"]
            key = (cell["model"], lay["tp"], lay["cp"], lay["ep"], cell["recompute"])
            assert ratio >= 1.0, (key, load, ratio)
            c = model.credit
            assert (c.tp, c.sequence_parallel, c.cp) == (lay["tp"], lay["sequence_parallel"], lay["cp"]), key
            # torch-cpu prices retained MoE layers on its CPU traces' evidence too
            assert model.basis == ("assumed" if load else "evidence"), (key, model.reasons)
            if lay["ep"] == 1 or load == 1.0:
                ratios.setdefault(key, []).append(ratio)
    for key, vals in ratios.items():
        assert float(np.median(vals)) <= 1.03 and max(vals) <= 1.10, (key, vals)


def test_te_gpu_prices_the_moe_cp_cells_at_or_over_them_too():
    """te-gpu gets the same credit and keeps its own fitted MoE terms (no CPU structural term):
    on the CPU cells it stays over (CPU torch holds more than a GPU: fp32 norm inputs, an unfused
    dispatcher), so the credit does not lean on the CPU units."""
    table = load_table("te-gpu")
    for rec in _cp_cells():
        cell, trace = rec["cell"], rec["trace"]
        model = _model(cell, table, 1.0 if cell["layout"]["ep"] > 1 else None)
        assert model.credit.cp == cell["layout"]["cp"]
        assert wave_raw(model, cell["seq_lens"]) >= trace["peak_bytes"], (cell["model"], cell["layout"], cell["recompute"])


@pytest.mark.parametrize("backend", ["te-gpu", "torch-cpu"])
def test_qwen3_30b_a3b_under_cp_is_credited_as_its_layout(backend):
    """Full recompute: the traced CP classes on evidence, below the CP1 class; selective and none:
    on evidence on torch-cpu (its CPU traces), conservative on te-gpu (no GPU trace of a retained
    MoE layer) with the layout's own credit."""
    g = load_preset("qwen3-30b-a3b")
    for tp, sp, cp in ((1, False, 2), (2, True, 2), (4, True, 2), (1, False, 4), (2, True, 4), (4, True, 4)):
        base = ParallelLayout(tp=tp, sequence_parallel=sp)
        par = ParallelLayout(tp=tp, sequence_parallel=sp, cp=cp)
        for mode in ("full", "selective", "none"):
            rc = Recompute(mode=mode)
            m = PricingModel.build(g, parallel=par, recompute=rc, backend=backend)
            c = m.credit
            if mode == "full" or backend == "torch-cpu":
                assert m.basis == "evidence", (tp, sp, cp, m.reasons)
            else:
                assert m.basis == "conservative"
            assert (c.tp, c.sequence_parallel, c.cp) == (tp, sp, cp), (tp, sp, cp, mode)
            cp1 = PricingModel.build(g, parallel=base, recompute=rc, backend=backend)
            if tp > 1 and cp1.layer_context().fused_moe_retained:
                # TP with SP at CP1 is priced by the retained MoE kernel models (evidence), under CP
                # by the fitted, conservative terms (no te-gpu trace of a retained MoE layer under
                # CP): the conservative price may be the larger
                continue
            assert one_group_raw(m, 8192) <= one_group_raw(cp1, 8192)


def test_the_retained_tp_sp_moe_layer_keeps_the_rope_cache_entry_once():
    """The first retained layer holds the RoPE cache entry of the wave's longest sequence (one
    entry row per rank row; CP's other CP - 1 rows are `cp_rope_cache_per_row`'s), once per wave."""
    w = {"H": 512.0, "qkv": 512.0, "core": 256.0, "rank": 16.0, "experts": 32.0, "expert_ffn": 96.0,
         "shared_ffn": 0.0}
    kw = dict(tp=2, etp=2, routed=8.0, rope_per_row=256.0)
    later = moe_terms.sp_retained_moe_layer_per_row(w, **kw)
    first = moe_terms.sp_retained_moe_layer_per_row(w, first=True, **kw)
    assert first - later == 2 * 512 / 2 + 256
    assert (moe_terms.sp_retained_moe_layer_per_row(w, first=True, forward=True, **kw)
            - moe_terms.sp_retained_moe_layer_per_row(w, forward=True, **kw)) == 2 * 512 / 2 + 256
