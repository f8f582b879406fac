"""Multi-latent attention on the default table's kernel path (issue 33;
docs/memory-model.md#mla-kernel-models): dense-MLP MLA layers at TP1 priced by what the fused
kernels keep and hold, on target against the te-gpu traces, grid and held out, never under; MoE-MLP
MLA layers and other layouts keep the fitted terms."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from bench_modules import BENCH, bench_module
from pricing_fixtures import layers_model

from waveplan.pricing.coefficients import load_table
from waveplan.pricing.geometry import ModelGeometry
from waveplan.pricing.layers import mla
from waveplan.pricing.parallel import ParallelLayout
from waveplan.pricing.presets import load_preset

RESULTS = BENCH / "results"
CLASSES = ("MLA TP1 dense MLP full", "MLA TP1 dense MLP selective/none")


@pytest.fixture(scope="module")
def grid():
    return bench_module("te_gpu_grid")


@pytest.mark.parametrize("which,cells", [("traces_te_gpu.jsonl", 3), ("traces_te_gpu_heldout.jsonl", 6)])
def test_mla_cells_on_target_and_never_under(grid, which, cells):
    """The MLA dense-MLP cells (the tuning shape in the grid; held out, a shape with a query
    latent and deepseek-v2-lite's dense layer, traced after the terms were final): every one at or
    over its trace, median within 3%, worst within 10%."""
    ratios: dict[str, list[float]] = {}
    for rec in grid._load(RESULTS / which):
        cell = rec["cell"]
        if grid.class_of(cell) not in CLASSES:
            continue
        est = grid.current_estimate(cell, table="te-gpu", head=cell["head"],
                                    geometry=grid.geometry_of(cell["model"]))
        ratios.setdefault(grid.class_of(cell), []).append(est["raw_bytes"] / rec["trace"]["peak_bytes"])
    assert sum(len(v) for v in ratios.values()) == cells, ratios
    for name, r in ratios.items():
        assert min(r) >= 1.0, (name, r)
        assert np.median(r) <= 1.03 and max(r) <= 1.10, (name, r)


def test_the_kernel_path_takes_dense_mla_layers_at_tp1_only(grid):
    """te-gpu at TP1 CP1: MLA layers with a dense MLP on the kernel terms, whatever the recompute;
    torch-cpu, TP2 and CP2 keep the fitted terms; so does a MoE MLP's MLA layer in a mixed model
    under full recompute."""
    g = grid.geometry_of("grid-mla-h1024")
    for rc in ("full", "selective", "none"):
        ctx = layers_model(g, recompute=rc).layer_context()
        assert ctx.fused_mla and all(mla.on_kernels(ctx, layer) for layer in ctx.geometry.layers)
    assert not layers_model(g, table="torch-cpu").layer_context().fused_mla
    for par in (ParallelLayout(tp=2), ParallelLayout(cp=2)):
        assert not layers_model(g, parallel=par).layer_context().fused_mla, par
    # a MoE MLP's MLA layer keeps the fitted terms under full recompute (retained, it takes the
    # composed MLA + MoE terms: tests/pricing/test_te_gpu_mla_moe.py)
    ds = layers_model(load_preset("deepseek-v2-lite"), recompute="full").layer_context()
    dense, moe = ds.geometry.layers
    assert mla.on_kernels(ds, dense) and not mla.on_kernels(ds, moe)
    # the MoE-MLP layer keeps exactly what the fitted MLA path charged it
    fitted = dataclasses.replace(ds, fused_mla=False)
    assert mla.retained(ds, 1, moe, extra=0.0, moe_extra=0.0) == \
        mla.retained(fitted, 1, moe, extra=0.0, moe_extra=0.0)
    assert mla.stage(ds, moe) == mla.stage(fitted, moe)
    # and the kernel path's basis line says so
    assert any("fused_mla_layer" in line for line in layers_model(g).kernel_basis)


def test_mla_terms_by_their_formula():
    """`fused_mla_layer` x the MLA widths (per row, TP1): the attention's saved tensors, a retained
    layer, its backward and the recomputed point, as docs/memory-model.md#mla-kernel-models writes
    them (deepseek-v2-lite's widths: 16 heads, qk 192, v 128, kv latent 512, rope 64)."""
    g = load_preset("deepseek-v2-lite")
    ctx = layers_model(g).layer_context()
    w = mla.mla_widths(ctx)
    H, F, r = 2048, 10944, 16
    qk, core, heads, latent, rope = 16 * 192, 16 * 128, 16, 512, 64
    assert (w["qk"], w["core"], w["heads"], w["qk_acc"], w["latent"], w["rope"]) == (
        qk, core, heads, 16 * 192, latent, rope)
    attention = 4 * qk + 4 * core + 4 * heads + 4 * latent + 8 * rope
    t = ctx.table
    assert mla.kernel_layer_per_row(t, w, point="retained") == attention + 6 * F + 14 * r + 8 * H
    flash = 4 * qk + 4 * core + 4 * qk + 4 * heads
    assert mla.kernel_layer_per_row(t, w, point="backward") == max(6 * F + 8 * r + 2 * H, 4 * H + 8 * r,
                                                                   flash + 2 * H)
    fc1, fc2 = 12 * F + 12 * r + 6 * H, 6 * F + 14 * r + 12 * H
    assert mla.kernel_layer_per_row(t, w, point="forward") == attention + max(fc1, fc2)
    assert mla.kernel_layer_per_row(t, w, point="recomputed") == attention + max(
        fc1, fc2, 12 * r + 4 * H + flash)
    # a query latent counts in `latent`; flash's accumulator rounds the qk head to 32
    q = ModelGeometry.from_dict(dict(grid_shape("grid-mla-h768")))
    wq = mla.mla_widths(layers_model(q).layer_context())
    assert wq["latent"] == 384 + 192 and wq["qk_acc"] == 12 * 64


def grid_shape(name: str) -> dict:
    return bench_module("te_gpu_grid").SHAPES[name]


def test_mla_kernel_terms_lower_the_fitted_price_without_moving_other_models():
    """The dense-MLA shape prices below the fitted MLA terms (which over-priced its traces by
    10-40%); a plain dense model's price does not move with the MLA entry removed."""
    g = ModelGeometry.from_dict(grid_shape("grid-mla-h1024"))
    te = load_table("te-gpu")
    bare = dataclasses.replace(te, terms={k: v for k, v in te.terms.items() if k != "fused_mla_layer"})
    for rc in ("full", "none"):
        with_terms = layers_model(g, recompute=rc).charges.walk.retained.sum()
        model = dataclasses.replace(layers_model(g, recompute=rc), table=bare)
        assert not model.layer_context().fused_mla
        if rc == "none":
            assert with_terms < model.charges.walk.retained.sum()
    dense = load_preset("qwen3-8b")
    a = layers_model(dense).charges.walk
    b = dataclasses.replace(layers_model(dense), table=bare).charges.walk
    assert np.array_equal(a.retained, b.retained) and np.array_equal(a.workspace, b.workspace)
