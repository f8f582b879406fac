"""Multi-latent attention layers with MoE MLPs on the default table's kernel path (issue 33;
docs/memory-model.md#mla-moe-kernel-models): retained (selective, none) at TP1 CP1 EP1, priced by
MLA's kernel terms and the retained MoE layer's composed; full recompute and other layouts keep
the fitted terms; never under the te-gpu traces, the held-out cell pair within 10%."""

from __future__ import annotations

import dataclasses

import pytest
from bench_modules import BENCH, bench_module
from pricing_fixtures import layers_model

from waveplan.pricing import layout_terms
from waveplan.pricing.coefficients import load_table
from waveplan.pricing.geometry import MlpKind
from waveplan.pricing.layers import mla
from waveplan.pricing.parallel import ParallelLayout
from waveplan.pricing.presets import load_preset

RESULTS = BENCH / "results"
# tuning: grid-mla-moe-h768 (its anatomy confirmed the shared expert's kept term once the tracer ran
# its fused SwiGLU) and grid-mla-moe-h640 (traced before that change); held out, traced after the
# terms were final: grid-mla-moe-h896 (binds at the layer's forward), grid-mla-moe-h512 (its backward);
# and the plain-attention MoE shape with a shared expert, grid-moe-shared-h832 (its backward)
SHAPES = ("grid-mla-moe-h768", "grid-mla-moe-h640", "grid-mla-moe-h896", "grid-mla-moe-h512",
          "grid-moe-shared-h832")


@pytest.fixture(scope="module")
def grid():
    return bench_module("te_gpu_grid")


def _ratios(grid, which, model):
    out = {}
    for rec in grid._load(RESULTS / which):
        cell = rec["cell"]
        if cell["model"] != model or cell["layout"].get("tp", 1) != 1 or cell["layout"].get("ep", 1) != 1:
            continue
        est = grid.current_estimate(cell, table="te-gpu", head=cell["head"],
                                    geometry=grid.geometry_of(model))
        out[cell["recompute"]] = est["raw_bytes"] / rec["trace"]["peak_bytes"]
    return out


@pytest.mark.parametrize("model", SHAPES)
def test_mla_moe_cells_on_the_real_dispatcher_never_under(grid, model):
    """The MoE shapes with a shared expert on the multi-rank tracer's real dispatcher (MLA ones
    and a plain-attention one; tuning and held out): none and selective at or over their traces,
    within 10%."""
    r = _ratios(grid, "traces_te_gpu_dispatcher.jsonl", model)
    assert set(r) == {"none", "selective"}, r
    assert all(1.0 <= v <= 1.10 for v in r.values()), r


def test_deepseek_v2_lite_grid_cells_never_under(grid):
    """deepseek-v2-lite's grid cells (its dense MLA layer 0 and MoE MLA layer 1): at or over."""
    r = _ratios(grid, "traces_te_gpu.jsonl", "deepseek-v2-lite")
    assert set(r) == {"full", "selective", "none"}, r
    assert min(r.values()) >= 1.0, r


def test_the_composition_takes_retained_mla_moe_layers_at_tp1_cp1_ep1_only(grid):
    """te-gpu, TP1 CP1 EP1, selective or none: every MLA layer on the kernel terms (the MoE ones
    composed); full recompute, torch-cpu, TP2, CP2 and EP2 keep the fitted MoE-MLA layer."""
    ds = load_preset("deepseek-v2-lite")
    for rc in ("selective", "none"):
        ctx = layers_model(ds, recompute=rc).layer_context()
        assert ctx.fused_moe_retained and ctx.mla_on_kernels
        assert all(mla.on_kernels(ctx, layer) for layer in ctx.geometry.layers)
    full = layers_model(ds, recompute="full").layer_context()
    assert not full.fused_moe_retained and not full.mla_on_kernels
    assert not mla.on_kernels(full, full.geometry.layers[1])
    assert not layers_model(ds, table="torch-cpu").layer_context().fused_moe_retained
    for par in (ParallelLayout(tp=2), ParallelLayout(cp=2), ParallelLayout(ep=2)):
        ctx = layers_model(ds, parallel=par).layer_context()
        assert not (ctx.fused_mla and ctx.fused_moe_retained), par
    assert any("MoE MLP" in line for line in layers_model(ds).kernel_basis)


def test_composed_terms_by_their_formula():
    """The composed layer: MLA's attention, its adapters and the layer's hidden tensors, the MoE
    MLP's kept tensors per row and per routed row, the shared expert's FC1 output; the forward
    point adds the MoE forward's additions and the shared expert's output; the backward is the
    largest of the experts', the shared expert's and MLA's."""
    ds = load_preset("deepseek-v2-lite")
    ctx = layers_model(ds).layer_context()
    w = mla.mla_widths(ctx)
    H, r, ef, sf = w["H"], w["rank"], w["expert_ffn"], w["shared_ffn"]
    routed = 6
    attention = 4 * w["qk"] + 4 * w["core"] + 4 * w["heads"] + 4 * w["latent"] + 8 * w["rope"]
    # the router's tensors (14 experts) and what a GPU run's may keep (moe_gpu_router, 12 experts)
    kept = (attention + 10 * r + 8 * H + 4 * 6 + (14 + 12) * 64 + 16 * 6 + routed * (2 * H + 6 * ef)
            + 4 * sf)
    assert mla.moe_kernel_layer_per_row(ctx, w, point="retained") == pytest.approx(kept)
    assert mla.moe_kernel_layer_per_row(ctx, w, point="forward") == pytest.approx(
        kept + routed * (4 * H + 2 * H) + 2 * H)
    experts = 4 * H + 8 * 64 + routed * max(2 * H + 4 * ef, 6 * ef, 4 * H)
    flash = 4 * w["qk"] + 4 * w["core"] + 4 * w["qk_acc"] + 4 * w["heads"] + 2 * H
    shared = 4 * H + 8 * 64 + 6 * sf + 2 * H + routed * 2 * H
    assert mla.moe_kernel_layer_per_row(ctx, w, point="backward") == pytest.approx(
        max(experts, flash, shared))
    t = ctx.table
    assert layout_terms.fused_moe_experts_backward_per_row(t, w, routed=routed) == pytest.approx(experts)
    # the retained row and the stage go through the layer pricer
    moe = ctx.geometry.layers[1]
    assert moe.mlp == MlpKind.MOE
    kept_row, fwd_row = mla.retained(ctx, 1, moe, extra=0.0, moe_extra=0.0)
    assert kept_row == pytest.approx(kept) and fwd_row == pytest.approx(kept + routed * 6 * H + 2 * H)
    assert mla.stage(ctx, moe) == (pytest.approx(max(experts, flash, shared)), False)


def test_the_composition_leaves_other_models_alone():
    """Plain-attention MoE and dense models without a shared expert: their layer arrays do not move
    with the shared-expert keys (only a shared expert reads them); full recompute of
    deepseek-v2-lite keeps its fitted MoE layer."""
    t = load_table("te-gpu")
    stripped = dataclasses.replace(t, terms={
        name: ({k: v for k, v in e.items() if not k.startswith("moe_shared_")}
               if name == "fused_retained_layer" else e) for name, e in t.terms.items()})
    for name in ("qwen3-30b-a3b", "qwen3-8b"):
        g = load_preset(name)
        a = layers_model(g).charges.walk
        b = dataclasses.replace(layers_model(g), table=stripped).charges.walk
        assert (a.retained == b.retained).all() and (a.workspace == b.workspace).all(), name
