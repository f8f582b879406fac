"""The TP1 structural layer and point (docs/memory-model.md#tp1-structural): a plain dense model's
layers at TP1 (CP too) on torch-cpu are priced by what they hold (`layout_terms.structural_at_tp1`):
retained by the SP structural terms at TP = 1, recomputed at their FC1 backward, with the q/k norms
whole and the TP1 residual; on te-gpu a plain dense model's recomputed TP1 layer is priced at the
point written from the fused kernels' allocation models (docs/memory-model.md#gpu-kernel-allocation-models),
its retained layer and every other model keep the TP1-fitted layer and stage."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from bench_modules import BENCH, bench_module

from waveplan.pricing import layout_terms, terms
from waveplan.pricing.coefficients import load_table
from waveplan.pricing.measure import calibrate
from waveplan.pricing.model import PricingModel, layer_widths
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.pipeline import rope_cache_per_row
from waveplan.pricing.presets import load_preset

RESULTS = BENCH / "results"


@pytest.mark.parametrize("mode", ["selective", "none"])
@pytest.mark.parametrize("preset", ["llama-3.1-8b", "qwen3-8b"])
def test_retained_tp1_layer_is_the_structural_term_at_tp1(preset, mode):
    g = load_preset(preset)
    model = PricingModel.build(g, backend="torch-cpu", recompute=Recompute(mode=mode), head="full-native")
    t = model.table
    widths = dict(layer_widths(g, tp=1), rank=float(max(s.rank for s in model.lora.slots)))
    rope = rope_cache_per_row(g, [g.layers[1]])
    kept = layout_terms.sp_retained_layer_per_row(t, widths, tp=1, rope_per_row=rope,
                                                   sequence_parallel=False, at_tp1=True)
    assert kept > 0
    qk = layout_terms.structural_qk_norm_per_row(widths, t.kernels) if preset == "qwen3-8b" else 0.0
    discount = t.per_row("selective_core_attn_discount", widths) if mode == "selective" else 0.0
    residual = layout_terms.layout_residual_per_row(t, widths, tp=1, sequence_parallel=False, cp=1,
                                                    retained=True)
    assert residual > 0
    assert residual == pytest.approx(t.terms[layout_terms.ENTRY]["retained"]["tp1-cp1"] * g.hidden)
    # layer 1 (layer 0 also holds the wave's RoPE cache entry)
    assert model.charges.walk.retained[1] == pytest.approx(kept - discount + qk + residual)
    assert model.charges.walk.retained[0] == pytest.approx(model.charges.walk.retained[1] + rope)
    # the head's forward point: both logits copies, the final norm's tensors, the embedding's output
    assert model.charges.walk.head_forward == pytest.approx(
        layout_terms.sp_head_forward_per_row(t, layer_widths(g, tp=1), tp=1, sequence_parallel=False,
                                             at_tp1=True))


def test_the_fitted_layer_stays_elsewhere():
    """Models that are not plain dense attention keep the TP1-fitted layer, no head-forward charge
    and no TP1 residual (te-gpu too where layers keep fitted terms, MLA with MoE MLPs under full
    recompute here: its plain dense and plain-attention MoE layers are priced by the fused kernels'
    terms, tests/pricing/test_te_gpu_kernel_models.py, and so are its retained MLA layers,
    tests/pricing/test_te_gpu_mla_moe.py)."""
    for preset, backend, mode in (("deepseek-v2-lite", "te-gpu", "full"),
                                  ("qwen3-30b-a3b", "torch-cpu", "none"), ("deepseek-v2-lite", "torch-cpu", "none"),
                                  ("qwen3.8-27b", "torch-cpu", "selective")):
        g = load_preset(preset)
        model = PricingModel.build(g, backend=backend, recompute=Recompute(mode=mode), head="full-native")
        assert model.charges.walk.head_forward == 0.0, (preset, backend, mode)
    t = load_table("torch-cpu")
    assert layout_terms.structural_at_tp1(t, retained=False, plain_dense=True)
    # te-gpu: the recomputed TP1 layer at its kernel-model point, the retained one fitted
    assert layout_terms.structural_at_tp1(load_table("te-gpu"), retained=False, plain_dense=True)
    assert not layout_terms.structural_at_tp1(t, retained=True, plain_dense=False)
    assert not layout_terms.structural_at_tp1(load_table("te-gpu"), retained=True, plain_dense=True)
    assert layout_terms.structural_at_tp1(t, retained=True, plain_dense=True)
    # the SP terms at TP > 1 without SP stay off, with or without `at_tp1`
    w = layer_widths(load_preset("llama-3.1-8b"), tp=2)
    assert layout_terms.sp_retained_layer_per_row(t, w, tp=2, rope_per_row=1.0, sequence_parallel=False,
                                                  at_tp1=True) == 0.0


def test_te_gpu_tp1_retained_layer_is_what_the_fused_kernels_keep():
    """te-gpu prices a plain dense layer retained at TP1 by its kernel-model entry (not the
    torch-cpu structural layer, not the fitted one): kept tensors plus the TP1 retained residual."""
    g = load_preset("llama-3.1-8b")
    te = load_table("te-gpu")
    model = PricingModel.build(g, backend="te-gpu", recompute=Recompute(mode="none"))
    widths = dict(layer_widths(g, tp=1), rank=float(max(s.rank for s in model.lora.slots)))
    kept = layout_terms.fused_retained_layer_per_row(te, widths, tp=1, sequence_parallel=False)
    f, h, qkv, core, rank = (widths[k] for k in ("F", "H", "qkv", "core", "rank"))
    assert kept == pytest.approx(6 * f + 8 * h + 3 * qkv + 3.0625 * core + 8 * rank)
    residual = te.terms[layout_terms.ENTRY]["retained"]["tp1-cp1"] * g.hidden
    assert model.charges.walk.retained[1] == pytest.approx(kept + residual)
    fitted = terms.retained_layer_per_row(te, widths, g.layers[1].mixer, g.layers[1].mlp, sp_div=1,
                                          selective=False, ep_skew=1.0)
    assert model.charges.walk.retained[1] < fitted


def test_every_tp1_calibration_cell_is_covered():
    """The real-width and small calibration cells the TP1 structural layer prices (selective and
    none, plain dense) are never under their trace with the shipped table."""
    table = load_table("torch-cpu")
    cells = bench_module("layout_validation").tp1_calibration_cells()
    assert len(cells) >= 40
    ratios = [calibrate.estimate(table, rec)["peak"] / rec["trace"]["peak_bytes"] for rec in cells]
    assert min(ratios) >= 1.0
    assert np.median(ratios) < 1.03


def test_tp1_grid_cells_within_target():
    """The multi-rank grid's TP1 and TP1+CP dense cells under selective and no recompute (three
    geometries, the fit, held-out, scale and long waves): never under, median within 3%."""
    lv = bench_module("layout_validation")
    table = load_table("torch-cpu")
    ratios: dict[str, list[float]] = {}
    for rec in lv.load_cells() + lv.load_scale_cells() + lv.load_long_cells():
        cell = rec["cell"]
        if lv.mixed(cell) or cell["layout"]["tp"] != 1 or cell["recompute"] == "full":
            continue
        raw, model = lv.estimate(cell, table)
        assert model.basis == "evidence"
        ratios.setdefault(f"cp{cell['layout']['cp']}", []).append(raw / rec["trace"]["peak_bytes"])
    assert set(ratios) == {"cp1", "cp2", "cp4"}
    for key, r in ratios.items():
        assert min(r) >= 1.0, key
        assert np.median(r) <= 1.03, (key, np.median(r))


def test_structural_tp1_layer_prices_no_more_than_the_fitted_one_on_real_widths():
    """At real widths the structural layer is a tighter price than the TP1-fitted layer it
    replaces (the calibration cells: 1.005-1.027 fitted)."""
    g = load_preset("llama-3.1-8b")
    cpu = PricingModel.build(g, backend="torch-cpu", recompute=Recompute(mode="none"))
    fitted_table = dataclasses.replace(cpu.table, terms={k: v for k, v in cpu.table.terms.items()
                                                         if k != layout_terms.SP_HEAD})
    fitted = dataclasses.replace(cpu, table=fitted_table)
    assert cpu.charges.walk.retained[1:].sum() < fitted.charges.walk.retained[1:].sum()


def test_tp1_cp_takes_the_tp1_margin():
    t = load_table("torch-cpu")
    retained = t.terms[layout_terms.ENTRY]["retained"]
    assert retained["tp1-cp2"] >= retained["tp1-cp1"] and retained["tp1-cp4"] >= retained["tp1-cp1"]
    g = load_preset("llama-3.1-8b")
    cp2 = PricingModel.build(g, backend="torch-cpu", recompute=Recompute(mode="none"),
                             parallel=ParallelLayout(cp=2), head="full-native")
    # the TP1 structural layer under CP: the head's forward charge, and the residual of TP1+CP2
    assert cp2.charges.walk.head_forward > 0
    residual = layout_terms.layout_residual_per_row(cp2.table, layer_widths(g, tp=1), tp=1,
                                                    sequence_parallel=False, cp=2, retained=True)
    assert residual == pytest.approx(retained["tp1-cp2"] * g.hidden)


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "qwen3-8b"])
def test_recomputed_tp1_layer_is_priced_at_its_fc1_backward(preset):
    """Full recompute at TP1 on torch-cpu: a plain dense layer's stage is the FC1-backward point
    (`layout_terms.tp1_fc1_point_per_row`) with the q/k norms whole; te-gpu keeps its fitted stage."""
    g = load_preset(preset)
    model = PricingModel.build(g, backend="torch-cpu", recompute=Recompute(mode="full"), head="full-native")
    t = model.table
    widths = layer_widths(g, tp=1)
    point = layout_terms.tp1_fc1_point_per_row(t, widths, rope_per_row=rope_cache_per_row(g, [g.layers[1]]),
                                               at_tp1=True)
    assert point > 0
    qk = layout_terms.structural_qk_norm_per_row(widths, t.kernels) if preset == "qwen3-8b" else 0.0
    residual = layout_terms.layout_residual_per_row(t, widths, tp=1, sequence_parallel=False, cp=1,
                                                    retained=False)
    assert residual == pytest.approx(t.terms[layout_terms.ENTRY]["full"]["tp1-cp1"] * g.hidden)
    rope = rope_cache_per_row(g, g.layers)   # the RoPE entry, at every point under full recompute
    assert model.charges.walk.workspace[1] == pytest.approx(point + qk + residual + rope)
    assert model.charges.walk.head_forward > 0
    # te-gpu's point is its kernel-model entry alone, the larger of the recomputed FC1's and FC2's
    # forward: TE's fused RoPE keeps no rotary copies (docs/memory-model.md#gpu-kernel-allocation-models)
    te = load_table("te-gpu")
    f, h, qkv, core, rank = (widths[k] for k in ("F", "H", "qkv", "core", "rank"))
    attention = 3 * qkv + 3.0625 * core
    assert layout_terms.tp1_fc1_point_per_row(te, widths, rope_per_row=1.0, at_tp1=True) == pytest.approx(
        max(12 * f + 6 * h + 6 * rank + attention, 6 * f + 12 * h + 8 * rank + attention,
            4 * qkv + 15.1875 * core + 6 * rank + 4 * h))   # FC1's, FC2's forward; flash's backward
    assert layout_terms.tp1_fc1_point_per_row(t, widths, rope_per_row=1.0, at_tp1=False) == 0.0


def test_tp1_full_grid_and_calibration_cells_covered():
    """Every TP1 and TP1+CP full-recompute grid cell and every plain dense full calibration cell is
    at or over its trace with the shipped table; the grid classes' medians within 3%."""
    lv = bench_module("layout_validation")
    table = load_table("torch-cpu")
    ratios: dict[str, list[float]] = {}
    for rec in lv.load_cells() + lv.load_scale_cells() + lv.load_long_cells():
        cell = rec["cell"]
        if lv.mixed(cell) or cell["layout"]["tp"] != 1 or cell["recompute"] != "full":
            continue
        ratios.setdefault(f"cp{cell['layout']['cp']}", []).append(lv.estimate(cell, table)[0] / rec["trace"]["peak_bytes"])
    assert set(ratios) == {"cp1", "cp2", "cp4"}
    for key, r in ratios.items():
        assert min(r) >= 1.0 and np.median(r) <= 1.03, (key, min(r), np.median(r))
    full = [rec for rec in lv.tp1_calibration_cells() if rec["cell"]["recompute"] == "full"]
    assert len(full) >= 20
    for rec in full:
        est = calibrate.estimate(table, rec)
        assert est["peak"] >= rec["trace"]["peak_bytes"]
        assert est["decoder"] >= rec["trace"]["decoder_peak_bytes"]
