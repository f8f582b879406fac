"""Retained MoE layers (selective and no recompute) under TP with sequence parallelism
(`moe_terms.sp_retained_moe_layer_per_row`, the credit `coverage.credit_layout` gives them): never
under the traced busiest ranks, far below the uncredited price, basis still conservative."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from pricing_fixtures import one_group_raw, wave_raw

from waveplan.pricing import moe_terms
from waveplan.pricing.coefficients import load_table
from waveplan.pricing.geometry import ModelGeometry
from waveplan.pricing.lora import LoraConfig, LoraSlot
from waveplan.pricing.model import PricingModel, layer_widths
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.presets import load_preset

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _cells() -> list[dict]:
    out = []
    for name in ("traces_multirank.jsonl", "traces_multirank_ep.jsonl"):
        out += [json.loads(line) for line in (RESULTS / name).read_text().splitlines() if line.strip()]
    return [rec for rec in out if rec["cell"]["geometry"]["moe"] and rec["cell"]["recompute"] != "full"
            and rec["cell"]["layout"]["tp"] in (2, 4) and rec["cell"]["layout"]["sequence_parallel"]
            and rec["cell"]["routing"] == "balanced"]


def _model(cell: dict, table, *, credit: bool = True) -> PricingModel:
    g = ModelGeometry.from_dict(cell["geometry"])
    g = dataclasses.replace(g, layers=g.layers[:cell["num_layers"]])
    lay = cell["layout"]
    return PricingModel(geometry=g, parallel=ParallelLayout(**lay), recompute=Recompute(mode=cell["recompute"]),
                        lora=LoraConfig(slots=(LoraSlot(rank=cell["lora_rank"]),), grad_bytes=2),
                        table=table, head="full-native", safety=1.0,
                        moe_load=1.0 if lay.get("ep", 1) > 1 else None)


def test_retained_tp_sp_moe_is_credited_and_never_under_its_traces():
    """Both MoE shapes at TP2+SP and TP4+SP (EP1) and the wide one at TP2+SP+EP2 (at the load it
    ran), at the default expert TP and below it (ETP1 at TP2+SP and TP4+SP, ETP2 at TP4+SP, EP1),
    selective and none, both waves: over the busiest rank, within 3 %, with the layout's
    own credit and on evidence (torch-cpu: these CPU traces; "assumed" where the EP cell's load 1
    is the caller's); te-gpu names the missing GPU trace."""
    table = load_table("torch-cpu")
    seen = 0
    for rec in _cells():
        cell, trace = rec["cell"], rec["trace"]
        model = _model(cell, table)
        ratio = wave_raw(model, cell["seq_lens"]) / trace["peak_bytes"]
        assert 1.0 <= ratio <= 1.03, (cell["model"], cell["layout"], cell["recompute"], ratio)
        assert model.credit.tp == cell["layout"]["tp"] and model.credit.sequence_parallel
        assert model.basis == ("assumed" if model.moe_load else "evidence"), model.reasons
        gpu = _model(cell, load_table("te-gpu"))
        assert gpu.basis == "conservative"
        assert any(r.startswith(f"MoE with {cell['recompute']} recompute (traced on the CPU only")
                   for r in gpu.reasons)
        seen += 1
    assert seen >= 40


def test_the_structural_layer_is_zero_at_tp1_and_adds_the_combine_point():
    w = {"H": 512.0, "qkv": 512.0, "core": 256.0, "rank": 16.0, "experts": 32.0, "expert_ffn": 96.0,
         "shared_ffn": 0.0}
    kw = dict(routed=8.0, rope_per_row=256.0)
    assert moe_terms.sp_retained_moe_layer_per_row(w, tp=1, etp=1, **kw) == 0.0
    kept = moe_terms.sp_retained_moe_layer_per_row(w, tp=2, etp=2, **kw)
    # gathered attention input, shards, attention, LoRA, router, rotary rows, experts' FC1 and activations
    assert kept == 2 * 512 + 12 * 512 / 2 + 3 * 512 + 5 * 256 + 8 * 16 + 3 * 32 + 2 * 256 + 8 * 10 * 96
    # the first layer also keeps the embedding's output, its input, and the RoPE cache entry (one
    # entry row per rank row), once per wave, not per layer
    first = moe_terms.sp_retained_moe_layer_per_row(w, tp=2, etp=2, first=True, **kw)
    assert first - kept == 2 * 512 / 2 + 256
    fwd = moe_terms.sp_retained_moe_layer_per_row(w, tp=2, etp=2, forward=True, **kw)
    assert fwd - kept == 8 * (6 * 512 + 6 * 512 / 2) + 8 * 32
    # ETP1 (below TP): no gather, no fp32 copy, no reduce-scatter: the combine holds point A's 6H
    # (permuted rows, FC2 outputs, their concatenation) on the rank's own routed rows
    one = moe_terms.sp_retained_moe_layer_per_row(w, tp=4, etp=1, **kw)
    assert one == 2 * 512 + 12 * 512 / 4 + 3 * 512 + 5 * 256 + 8 * 16 + 3 * 32 + 2 * 256 + 8 * 10 * 96
    assert moe_terms.sp_retained_moe_layer_per_row(w, tp=4, etp=1, forward=True, **kw) - one == 8 * 6 * 512 + 8 * 32
    shared = moe_terms.sp_retained_moe_layer_per_row(dict(w, shared_ffn=256.0), tp=2, etp=2, **kw)
    # a shared expert keeps its FC1 output and activations, nothing hidden-wide; its reduce-scattered
    # output at the forward peak (docs/memory-model.md#moe-shared-sp)
    assert shared - kept == 10 * 256
    shared_fwd = moe_terms.sp_retained_moe_layer_per_row(dict(w, shared_ffn=256.0), tp=2, etp=2, forward=True, **kw)
    assert shared_fwd - fwd == 10 * 256 + 2 * 512 / 2


@pytest.mark.parametrize("backend", ["te-gpu", "torch-cpu"])
@pytest.mark.parametrize("mode", ["selective", "none"])
def test_credit_only_at_the_traced_classes_and_expert_tps(backend, mode):
    g = load_preset("qwen3-30b-a3b")
    rc = Recompute(mode=mode)
    tp1 = PricingModel.build(g, recompute=rc, backend=backend)
    if backend == "te-gpu":
        # te-gpu's TP1 MoE layers are retained by the fused kernels' models (fused_retained_layer,
        # tests/pricing/test_te_gpu_kernel_models.py), below the fitted terms its credited TP > 1
        # classes keep (no te-gpu trace at TP > 1 with MoE): the credit is checked against its
        # fitted TP1 price, the same table without that entry
        table = load_table(backend)
        fitted = dataclasses.replace(table, terms={k: v for k, v in table.terms.items()
                                                   if k != "fused_retained_layer"})
        kernel_tp1, tp1 = tp1, dataclasses.replace(tp1, table=fitted)
        assert one_group_raw(kernel_tp1) < one_group_raw(tp1)
    # on evidence where the CPU traces price it (torch-cpu), conservative with the credit on te-gpu
    basis = "evidence" if backend == "torch-cpu" else "conservative"
    prices = {}
    for tp in (2, 4):
        m = PricingModel.build(g, parallel=ParallelLayout(tp=tp, sequence_parallel=True), recompute=rc,
                               backend=backend)
        assert m.basis == basis and m.credit.tp == tp and m.credit.sequence_parallel
        prices[tp] = one_group_raw(m)
    # more TP never prices higher, and every credited class below the uncredited TP1 price
    assert one_group_raw(tp1) > prices[2] >= prices[4]
    # an expert TP below TP at EP1 (traced: TP2+SP ETP1, TP4+SP ETP1 and ETP2) keeps the credit,
    # priced on its ETP / TP share of the routed rows, below the uncredited price
    for tp, etp in ((2, 1), (4, 1), (4, 2)):
        m = PricingModel.build(g, parallel=ParallelLayout(tp=tp, sequence_parallel=True, etp=etp), recompute=rc,
                               backend=backend)
        assert m.basis == basis and m.credit.tp == tp and m.credit.sequence_parallel
        assert m.expert_row_share == etp / tp and one_group_raw(m) < one_group_raw(tp1)
    # below TP with EP (no retained trace) gets none
    ep = PricingModel.build(g, parallel=ParallelLayout(tp=4, sequence_parallel=True, ep=2, etp=1), recompute=rc,
                            backend=backend)
    assert ep.credit.tp == 1 and one_group_raw(ep) >= prices[4]


def test_te_gpu_keeps_its_own_retained_moe_terms():
    """The structural layer is charged where the table carries the SP structural terms (torch-cpu);
    te-gpu's credited price keeps its fitted retained MoE layer, which is larger per layer."""
    g = load_preset("qwen3-30b-a3b")
    par = ParallelLayout(tp=4, sequence_parallel=True)
    gpu = PricingModel.build(g, parallel=par, recompute=Recompute(mode="none"), backend="te-gpu")
    widths = dict(layer_widths(g, tp=4), rank=16.0)
    structural = moe_terms.sp_retained_moe_layer_per_row(widths, tp=4, etp=4, routed=g.moe.top_k,
                                                         rope_per_row=0.0)
    assert gpu.charges.walk.retained[-1] > structural


def test_an_untraced_tp_sp_class_is_credited_as_the_largest_traced_one():
    """MoE retained at TP8+SP (no trace) is priced as TP4+SP, the largest traced class dividing it."""
    cell = next(rec["cell"] for rec in _cells() if rec["cell"]["model"] == "grid-moe-h1024")
    g = ModelGeometry.from_dict(cell["geometry"])
    rc = Recompute(mode="none")
    tp4 = PricingModel.build(g, parallel=ParallelLayout(tp=4, sequence_parallel=True), recompute=rc,
                             backend="torch-cpu")
    tp8 = PricingModel.build(g, parallel=ParallelLayout(tp=8, sequence_parallel=True), recompute=rc,
                             backend="torch-cpu")
    assert (tp8.credit.tp, tp8.credit.sequence_parallel) == (4, True)
    assert one_group_raw(tp8) <= one_group_raw(tp4)
