"""The terms the torch-cpu table adds (pricing.terms, pricing.coefficients.OPTIONAL_TERMS): each
is charged where its docstring says, and a table without them (te-gpu) prices as before."""

import dataclasses

import numpy as np
import pytest

from waveplan.pricing import layout_terms, terms
from waveplan.pricing.coefficients import OPTIONAL_TERMS, load_table
from waveplan.pricing.entries import ENTRIES
from waveplan.pricing.geometry import MixerKind
from waveplan.pricing.lora import LoraConfig
from waveplan.pricing.model import PricingModel, has_qk_norm, layer_widths
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.pipeline import rope_cache_per_row
from waveplan.pricing.presets import load_preset


def test_te_gpu_carries_none_of_the_optional_terms():
    table = load_table("te-gpu")
    # te-gpu carries only the entries written from the fused kernels' allocation models
    # (docs/memory-model.md#gpu-kernel-allocation-models)
    assert set(OPTIONAL_TERMS) & set(table.terms) == {
        "final_norm", "final_norm_backward", "tp1_fc1_point", "sp_head_forward", "fused_retained_layer",
        "fused_mla_layer", "fused_gdn_layer", "fused_gdn_point", "kernel_models"}
    cpu = load_table("torch-cpu")
    # the fused kernels' entries only
    fused = {"kernel_models", "fused_retained_layer", "fused_mla_layer", "fused_gdn_layer", "fused_gdn_point"}
    fsdp = {e.name for e in ENTRIES if e.anchor == "fsdp-calibration"}   # fitted by users, per GPU
    plain = set(OPTIONAL_TERMS) - fused - fsdp
    assert plain <= set(cpu.terms) and not fused & set(cpu.terms)
    # each says where it comes from: a fit, or a structural form read off the traces
    assert all(any(word in cpu.source(name) for word in ("fitted", "structural", "set by trace"))
               for name in plain)
    # te-gpu's say which rest on the kernels' allocation models
    assert all("kernel-model" in table.source(name) for name in (
        "final_norm", "final_norm_backward", "tp1_fc1_point", "sp_head_forward", "fused_retained_layer",
        "fused_mla_layer"))


def test_qk_norm_follows_the_geometry():
    qwen, llama = load_preset("qwen3-8b"), load_preset("llama-3.1-8b")
    assert has_qk_norm(qwen) and not has_qk_norm(llama)
    assert not has_qk_norm(dataclasses.replace(qwen, extra={"qk_layernorm": False}))
    assert has_qk_norm(dataclasses.replace(llama, extra={"qk_layernorm": True}))
    cpu = load_table("torch-cpu")
    for geometry, charged in ((qwen, True), (llama, False)):
        widths = layer_widths(geometry, tp=1)
        qk = terms.qk_norm_per_row(cpu, widths)
        assert qk > 0
        plain = dataclasses.replace(geometry, extra={"qk_layernorm": False})
        # the TP1 structural layer and point (torch-cpu, plain dense) take them whole
        # (layout_terms.structural_qk_norm_per_row, docs/memory-model.md#tp1-structural)
        whole = layout_terms.structural_qk_norm_per_row(widths, cpu.kernels)
        for mode, key, each in (("full", "workspace", whole), ("none", "retained", whole)):
            model = PricingModel.build(geometry, backend="torch-cpu", recompute=Recompute(mode=mode))
            without = PricingModel.build(plain, backend="torch-cpu", recompute=Recompute(mode=mode))
            diff = getattr(model.charges.walk, key) - getattr(without.charges.walk, key)
            assert np.allclose(diff, each if charged else 0.0), mode
    assert layout_terms.structural_qk_norm_per_row(layer_widths(qwen, tp=1), cpu.kernels) > terms.qk_norm_per_row(
        cpu, layer_widths(qwen, tp=1))
    # beside the fitted layer (a MoE model at TP1) the fitted q/k norms
    moe = load_preset("qwen3-30b-a3b")
    assert has_qk_norm(moe)
    plain = dataclasses.replace(moe, extra={"qk_layernorm": False})
    for mode, key in (("full", "workspace"), ("none", "retained")):
        diff = (getattr(PricingModel.build(moe, backend="torch-cpu", recompute=Recompute(mode=mode)).charges.walk, key)
                - getattr(PricingModel.build(plain, backend="torch-cpu", recompute=Recompute(mode=mode)).charges.walk, key))
        assert np.allclose(diff, terms.qk_norm_per_row(cpu, layer_widths(moe, tp=1))), mode


@pytest.mark.parametrize("preset", ["qwen3-8b", "qwen3-30b-a3b", "qwen3.8-27b"])
def test_head_points_carry_the_final_norm(preset):
    geometry = load_preset(preset)
    model = PricingModel.build(geometry, backend="torch-cpu", head="full-native")
    a, t = model.charges.walk, model.table
    widths = layer_widths(geometry, tp=1)
    saved, backward = terms.final_norm_per_row(t, widths, sp_div=1)
    logits_ret, logits_tr = terms.head_per_row(t, widths, "full-native")
    assert saved > 0 and backward > 0
    assert a.head_retained == pytest.approx(logits_ret + saved)
    # the final norm's backward runs after the logits are released: the larger, not the sum
    # beside it, under full recompute: the TP1 residual and the RoPE entry where the TP1 structural
    # point prices a plain dense model's layers (docs/memory-model.md#tp1-structural), else nothing
    beside = model.charges.head.layout_residual
    plain = geometry.moe is None and geometry.gdn is None
    assert (beside > 0) == plain
    if plain:
        assert beside == pytest.approx(
            t.terms["layout_residual"]["full"]["tp1-cp1"] * geometry.hidden + rope_cache_per_row(geometry, geometry.layers))
    assert a.head_transient == pytest.approx(max(logits_tr, backward) + beside)
    chunked = PricingModel.build(geometry, backend="torch-cpu", head="chunked:512").charges.walk
    assert chunked.head_retained == pytest.approx(saved)
    assert chunked.head_transient == pytest.approx(backward + beside)


@pytest.mark.parametrize("preset", ["qwen3-8b", "qwen3-30b-a3b", "qwen3.6-35b-a3b"])
def test_retained_layers_use_their_own_forward_and_backward_terms(preset):
    geometry = load_preset(preset)
    full = PricingModel.build(geometry, backend="torch-cpu").charges.walk
    for mode in ("selective", "none"):
        model = PricingModel.build(geometry, backend="torch-cpu", recompute=Recompute(mode=mode))
        a = model.charges.walk
        # a retained layer's backward holds less than a recomputed layer's stage
        assert np.all(a.workspace < full.workspace)
        fwd = model.charges.forward
        # layer 0's forward point also holds the wave's RoPE cache entry where the structural GDN
        # terms price a hybrid's layers (gdn_terms.rope_cache_entry_per_row, torch-cpu at TP1) and
        # beside the TP1 structural layer of a plain dense model (layout_terms.structural_at_tp1)
        rope = np.zeros(len(a.nograd))
        if geometry.gdn is not None or geometry.moe is None:
            rope[0] = rope_cache_per_row(geometry, geometry.layers)
        assert np.allclose(a.nograd, np.maximum(fwd.nograd, fwd.retained_forward) + rope)
        assert np.all(fwd.retained_forward >= load_table("torch-cpu").scalar("retained_forward")
                      * a.retained - 1e-6)


def test_te_gpu_prices_retained_layers_as_before():
    """Without the optional terms: the stage workspace in backward, the no-grad transient in
    forward, the head terms alone."""
    geometry = load_preset("qwen3.8-27b")
    t = load_table("te-gpu")
    # the retained GDN hybrid's kernel-model entry (docs/memory-model.md#te-gpu-gdn) left out
    fitted = dataclasses.replace(t, terms={k: v for k, v in t.terms.items() if k != "fused_gdn_layer"})
    widths = layer_widths(geometry, tp=1)
    for mode in ("selective", "none"):
        a = PricingModel(geometry=geometry, parallel=ParallelLayout(), recompute=Recompute(mode=mode),
                         lora=LoraConfig(), table=fitted).charges.walk
        for i, layer in enumerate(geometry.layers):
            stage = (terms.mixer_stage_per_row(t, widths, layer.mixer)
                     + terms.mlp_stage_per_row(t, widths, layer.mlp, ep_skew=1.0)
                     + terms.norm_and_residual_per_row(t, widths, sp_div=1))
            assert a.workspace[i] == pytest.approx(stage)
            assert a.nograd[i] == pytest.approx(
                terms.nograd_stage_per_row(t, widths, layer.mlp, ep_skew=1.0))
            if layer.mixer == MixerKind.ATTENTION:
                assert terms.qk_norm_per_row(t, widths) == 0.0
    # a GDN hybrid keeps the seeds' full-native head (its `gdn` values) beside the final norm's
    # kernel-model terms (TE RMSNorm: 2H saved, 2H in backward; KernelSet.priced_by_models) where
    # its layers keep fitted terms: here full recompute without the recomputed GDN layers'
    # kernel-model entry (docs/memory-model.md#te-gpu-gdn-full)
    h = geometry.hidden
    no_point = dataclasses.replace(t, terms={k: v for k, v in t.terms.items() if k != "fused_gdn_point"})
    model = dataclasses.replace(PricingModel.build(geometry, head="full-native"), table=no_point)
    a = model.charges.walk
    assert a.head_retained == pytest.approx(6 * geometry.vocab + 2 * h)
    # the norm's 2H backward within the logits' 2 x vocab transient, beside the full-recompute
    # wave's residual and RoPE entry
    assert model.charges.head.norm_backward == pytest.approx(2 * h)
    assert a.head_transient == pytest.approx(2 * geometry.vocab + model.charges.head.layout_residual)
