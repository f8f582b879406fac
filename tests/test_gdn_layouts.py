"""GDN hybrids under tensor parallelism (pricing.model._GDN_TRACED): the GDN grid's multi-rank
CPU cells (bench/gdn_grid.py) at TP2, TP2+SP, TP4 and TP4+SP, full recompute, are priced on
evidence, never under their busiest rank and within 10 %; what no trace covers stays conservative."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from waveplan.pricing.coefficients import load_table
from waveplan.pricing.geometry import ModelGeometry
from waveplan.pricing.lora import LoraConfig, LoraSlot
from waveplan.pricing.model import PricingModel
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.presets import load_preset
from waveplan.pricing.step import Request, Step
from waveplan.pricing.wave_pricer import WavePricer

TRACES = Path(__file__).resolve().parent.parent / "bench" / "results" / "traces_multirank_gdn.jsonl"


def _raw(model: PricingModel, seq_lens) -> int:
    step = Step.from_requests([Request(id=f"r{i}", num_tokens=int(n)) for i, n in enumerate(seq_lens)])
    return WavePricer.build(step, model, profiled=True).price(
        [np.arange(len(step.requests))], first_slots=frozenset({"default"})).raw_bytes


def test_traced_gdn_cells_are_on_evidence_never_under_and_within_ten_percent():
    """Every full-recompute GDN cell at TP > 1 (TP2, TP2+SP, TP4, TP4+SP; two waves each):
    torch-cpu, head full-native, 2-byte adapter gradients, safety 1.0, against the busiest rank."""
    table = load_table("torch-cpu")
    seen = set()
    for line in TRACES.read_text().splitlines():
        rec = json.loads(line)
        cell, trace = rec["cell"], rec["trace"]
        lay = cell["layout"]
        if cell["recompute"] != "full" or lay["tp"] == 1:
            continue
        g = ModelGeometry.from_dict(cell["geometry"])
        g = dataclasses.replace(g, layers=g.layers[:cell["num_layers"]])
        assert g.gdn is not None
        model = PricingModel(geometry=g, parallel=ParallelLayout(**lay), recompute=Recompute(),
                             lora=LoraConfig(slots=(LoraSlot(rank=cell["lora_rank"]),), grad_bytes=2),
                             table=table, head="full-native", safety=1.0)
        ratio = _raw(model, cell["seq_lens"]) / trace["peak_bytes"]
        assert model.basis == "evidence", model.gaps
        assert 1.0 <= ratio <= 1.10, (lay, trace["tokens"], ratio)
        seen.add((lay["tp"], lay["sequence_parallel"], trace["tokens"]))
    assert seen == {(tp, sp, n) for tp in (2, 4) for sp in (False, True) for n in (2048, 3072)}


def test_the_27b_hybrid_at_tp2_and_tp4_is_sharded_and_on_evidence():
    """qwen3.8-27b at TP2, TP2+SP and TP4 (full recompute): evidence, below TP1 and above TP4+SP;
    selective recompute there stays conservative; a GDN hybrid with MoE layers is on evidence at
    TP2+SP (traced together), not at TP2 without SP or under CP."""
    g = load_preset("qwen3.8-27b")
    lens = [4096] * 4

    def price(**kw):
        rc = kw.pop("recompute", "full")
        m = PricingModel.build(g, parallel=ParallelLayout(**kw), recompute=Recompute(mode=rc))
        return m, _raw(m, lens)

    _, tp1 = price()
    _, tp4sp = price(tp=4, sequence_parallel=True)
    for kw in (dict(tp=2), dict(tp=2, sequence_parallel=True), dict(tp=4)):
        m, raw = price(**kw)
        assert m.basis == "evidence" and m.credit == m.parallel, (kw, m.gaps)
        assert tp4sp <= raw < tp1, kw
    m, _ = price(tp=2, sequence_parallel=True, recompute="selective")
    assert m.basis == "conservative" and m.credit.tp == 1
    # a GDN hybrid with MoE layers: traced together at TP2+SP and TP4+SP (the GDN grid's GDN+MoE
    # shape), not at TP2 without SP nor under CP
    hybrid_moe = load_preset("qwen3.6-35b-a3b")
    m = PricingModel.build(hybrid_moe, parallel=ParallelLayout(tp=2, sequence_parallel=True))
    assert m.basis == "evidence" and m.credit == m.parallel, m.gaps
    m = PricingModel.build(hybrid_moe, parallel=ParallelLayout(tp=2))
    assert m.basis == "conservative" and any("GDN layers at TP2 CP1" in r for r in m.gaps)
    m = PricingModel.build(hybrid_moe, parallel=ParallelLayout(tp=2, sequence_parallel=True, cp=2))
    assert m.basis == "conservative" and any("GDN layers at TP2 SP CP2" in r for r in m.gaps)


def test_traced_gdn_moe_cells_are_on_evidence_and_never_under():
    """The GDN grid's GDN+MoE hybrid (one GDN and one attention layer, MoE MLPs with a shared
    expert) at TP1, TP2+SP and TP4+SP, full recompute, both waves: evidence, at or over the busiest
    rank (torch-cpu); TP1 and TP2+SP within 3 %, TP4+SP within 10 % (its GDN layer keeps the bare
    residual and the TP1-fitted stage sum: docs/memory-model.md#gdn-moe-tp)."""
    table = load_table("torch-cpu")
    seen = set()
    for line in TRACES.read_text().splitlines():
        rec = json.loads(line)
        cell, trace = rec["cell"], rec["trace"]
        if not cell["geometry"]["moe"]:
            continue
        lay = cell["layout"]
        g = ModelGeometry.from_dict(cell["geometry"])
        g = dataclasses.replace(g, layers=g.layers[:cell["num_layers"]])
        model = PricingModel(geometry=g, parallel=ParallelLayout(**lay), recompute=Recompute(mode=cell["recompute"]),
                             lora=LoraConfig(slots=(LoraSlot(rank=cell["lora_rank"]),), grad_bytes=2),
                             table=table, head="full-native", safety=1.0)
        ratio = _raw(model, cell["seq_lens"]) / trace["peak_bytes"]
        assert model.basis == "evidence" and model.credit == model.parallel, model.gaps
        assert 1.0 <= ratio <= (1.10 if lay["tp"] == 4 else 1.03), (lay, trace["tokens"], ratio)
        seen.add((lay["tp"], trace["tokens"]))
    assert seen == {(tp, n) for tp in (1, 2, 4) for n in (2048, 3072)}
