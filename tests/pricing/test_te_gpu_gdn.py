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
    """The grid's retained GDN cells (grid-gdn-h1024, qwen3.8-27b; the terms were checked on them) and
    the held-out grid-gdn-h768 cells (traced after the terms were final): none under, worst within 10%."""
    ratios = _retained_gdn_ratios(grid, RESULTS / which)
    assert len(ratios) >= 2, ratios
    assert min(ratios.values()) >= 1.0, ratios
    assert max(ratios.values()) <= 1.10, ratios
    if which == "traces_te_gpu.jsonl":
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
