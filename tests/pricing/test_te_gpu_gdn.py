"""GDN hybrids retained on the default table's kernel models (issue 33; docs/memory-model.md#te-gpu-gdn):
the retained GDN and gated attention layers at TP1 CP1 priced by what FLA's and the fused kernels keep,
never under the te-gpu traces of the grid's and the held-out GDN cells, the path gated to where it
was traced, and the basis saying so."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
from bench_modules import BENCH, bench_module

from waveplan.pricing import gdn_kernel_terms
from waveplan.pricing.coefficients import load_table
from waveplan.pricing.geometry import ModelGeometry
from waveplan.pricing.model import PricingModel, layer_widths
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.presets import load_preset

RESULTS = BENCH / "results"


@pytest.fixture(scope="module")
def grid():
    return bench_module("te_gpu_grid")


def _retained_gdn_ratios(grid, path) -> dict[str, float]:
    """te-gpu estimate / traced peak of the file's retained (selective, none) GDN cells at TP1 CP1."""
    out = {}
    for rec in grid._load(path):
        cell = rec["cell"]
        lay = cell["layout"]
        if not grid.has_gdn(cell) or cell["recompute"] == "full" or lay["tp"] > 1 or lay["cp"] > 1:
            continue
        g = grid.geometry_of(cell["model"])
        est = grid.current_estimate(cell, table="te-gpu", head=cell["head"], geometry=g)
        out[f"{cell['model']} {cell['recompute']}"] = est["raw_bytes"] / rec["trace"]["peak_bytes"]
    return out


@pytest.mark.parametrize("which", ["traces_te_gpu.jsonl", "traces_te_gpu_heldout.jsonl"])
def test_retained_gdn_hybrids_on_the_kernel_models_are_never_under(grid, which):
    """The grid's retained GDN cells (grid-gdn-h1024, grid-gdn-h768, qwen3.8-27b; the terms were
    checked on them) and the held-out grid-gdn-h1280 and grid-gdn-h896 cells (traced after the terms
    were final): none under, worst within 10%, median within 3%."""
    ratios = _retained_gdn_ratios(grid, RESULTS / which)
    assert len(ratios) >= 2, ratios
    assert min(ratios.values()) >= 1.0, ratios
    assert max(ratios.values()) <= 1.10, ratios
    assert statistics.median(ratios.values()) <= 1.03, ratios


def _model(name, *, recompute="none", layout=None, backend="te-gpu"):
    g = load_preset(name)
    return PricingModel.build(g, parallel=layout or ParallelLayout(), recompute=Recompute(mode=recompute),
                              backend=backend)


def test_the_kernel_model_path_is_where_it_was_traced():
    """TP1 CP1 retained dense-MLP GDN hybrids on te-gpu; full recompute, TP > 1, CP, GDN+MoE hybrids
    and torch-cpu keep their terms (the seeds' GPU cells are full recompute or CP2)."""
    on = [_model("qwen3.8-27b", recompute=rc) for rc in ("none", "selective")]
    assert all(m.layer_context().fused_gdn_retained for m in on)
    off = [_model("qwen3.8-27b", recompute="full"),
           _model("qwen3.8-27b", layout=ParallelLayout(tp=4, sequence_parallel=True)),
           _model("qwen3.8-27b", layout=ParallelLayout(cp=2)),
           _model("qwen3.8-27b", backend="torch-cpu"),
           _model("qwen3.6-35b-a3b")]
    assert not any(m.layer_context().fused_gdn_retained for m in off)
    # a table without the entry keeps the fitted GDN layer
    t = load_table("te-gpu")
    bare = dataclasses.replace(t, terms={k: v for k, v in t.terms.items() if k != "fused_gdn_layer"})
    m = dataclasses.replace(_model("qwen3.8-27b"), table=bare)
    assert not m.layer_context().fused_gdn_retained


def test_the_gdn_layer_keeps_what_the_kernels_save():
    """The kept term on the grid's shape, tensor by tensor (docs/memory-model.md#te-gpu-gdn):
    4 key : 12 value heads of 128, hidden 1024, FFN 3456, rank 16."""
    grid_shape = bench_module("gdn_grid").GDN
    g = ModelGeometry.from_dict(grid_shape)
    w = dict(layer_widths(g, tp=1, etp=1), rank=16.0)
    h, f, hk, hv, d = 1024, 3456, 4, 12, 128
    conv = 2 * hk * d + hv * d
    expected = (8 * h + 6 * f + 8 * 16 + 4 * conv + 4 * hk * d + 4 * hv * d + 16 * hv * d
                + 8 * hk + 146 * hv)
    assert gdn_kernel_terms.fused_gdn_layer_per_row(load_table("te-gpu"), w, g.gdn) == expected
    # as many key as value heads: FLA's rule takes the L2 norm's outputs, no repeated copies
    same = dataclasses.replace(g.gdn, num_value_heads=4)
    assert gdn_kernel_terms.gdn_widths(w, same, tp=1)["key_repeated"] == 0.0
    # the torch-cpu table has no such entry
    assert gdn_kernel_terms.fused_gdn_layer_per_row(load_table("torch-cpu"), w, g.gdn) == 0.0


def test_the_basis_names_the_gdn_kernel_models():
    m = _model("qwen3.8-27b", recompute="selective")
    assert any("fused_gdn_layer" in line and "FLA" in line for line in m.kernel_basis)
    assert not any("fused_gdn_layer" in line for line in _model("qwen3.8-27b", recompute="full").kernel_basis)


# --- the keys read on the window anatomy (bench/results/te_gpu_gdn_windows.txt) ---------------


def _grid_widths():
    g = ModelGeometry.from_dict(bench_module("gdn_grid").GDN)
    return g, dict(layer_widths(g, tp=1, etp=1), rank=16.0)


def test_the_gated_attention_layer_holds_what_the_windows_show():
    """grid-gdn-h1024's gated attention layer (8 heads of 128 in 4 KV groups, output gate, FFN 3456):
    the gate's fp32 sigmoid and bf16 output less the dense qkv term's 1 core for a rotated gate
    (5 core); its input (2H) beside its FC1 forward point; its backward the fused MLP's less the
    SwiGLU output FC2's backward freed (6F + 2H + 8 rank - 2F), above flash's and the gate's
    backward once the MLP's 6F are freed."""
    t = load_table("te-gpu")
    _, w = _grid_widths()
    h, f, core, rank = 1024, 3456, 1024, 16
    assert gdn_kernel_terms.fused_gated_attention_per_row(t, w) == 5 * core
    assert gdn_kernel_terms.fused_gated_attention_per_row(t, w, part="forward") == 2 * h
    mlp = 6 * f + 2 * h + 8 * rank - 2 * f
    assert gdn_kernel_terms.mlp_backward_per_row(t, w) == mlp
    assert gdn_kernel_terms.fused_gated_attention_per_row(t, w, part="backward") == mlp
    # the gate's backward (16 core + 2H) beside everything kept would be above the MLP's on a
    # shape with a wide gate; less the MLP's freed tensors it is not
    wide = dict(w, core=4 * core)
    gate = 16 * 4 * core + 2 * h - 6 * f
    assert gdn_kernel_terms.fused_gated_attention_per_row(t, wide, part="backward") == max(
        mlp, gate, t.per_row("fused_retained_layer", wide, key="attention_backward") - 6 * f)


def test_the_gdn_layer_backward_is_flas_less_the_freed_mlp():
    """grid-gdn-h1024's GDN layer: FLA's backward (10 hv dk + 12 value + hv dk dv / 16 + 10 hv + 4H)
    less the MLP's saved tensors (6F, freed by the MLP's backward, which runs first), or the fused
    MLP's backward less the SwiGLU output where larger."""
    t = load_table("te-gpu")
    g, w = _grid_widths()
    h, f, hv, d = 1024, 3456, 12, 128
    fla = 10 * hv * d + 12 * hv * d + hv * d * d / 16 + 10 * hv + 4 * h
    mlp = 4 * f + 2 * h + 8 * 16
    assert gdn_kernel_terms.fused_gdn_layer_per_row(t, w, g.gdn, part="backward") == max(fla - 6 * f, mlp)


def test_the_retained_gdn_grid_cell_binds_at_the_attention_layers_forward(grid):
    """With the backward keys tightened, grid-gdn-h1024 none binds where its trace peaks: the
    attention layer's FC1 forward (window 0 of the anatomy)."""
    cell = grid._cell("grid-gdn-h1024", {}, "none")
    est = grid.current_estimate(cell, table="te-gpu", head=cell["head"], geometry=grid.geometry_of(cell["model"]))
    assert est["binding"] == "forward:layer1:attention/dense", est["binding"]
