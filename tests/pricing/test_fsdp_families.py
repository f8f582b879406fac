"""The fsdp framework beyond Llama's shape (issue 30): family terms (docs/memory-model.md#fsdp-families),
calibration factors (#fsdp-calibration: `waveplan calibrate` on fsdp traces and `--profiles` for an
FSDP model) and `inspect --framework fsdp`.

* transformers 5 MoE families: PEFT all-linear folds LoRA into the fused expert stacks, a
  full-size bf16 copy per MoE layer: charged at the layer's MLP points (its own with
  checkpointing, kept to its backward without) and the expert adapters' gradients counted;
* Gemma: two packed-row masks where sliding and full layers alternate, the final soft-cap's
  bf16 copies;
* a table without the fsdp factors prices exactly as before; each factor raises what it scales;
* calibrate fits the factors to fsdp trace records (every record covered with the margin) and
  to an FSDP model's observed peaks; a file mixing frameworks is refused with one line.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from waveplan.planner import Planner
from waveplan.planner import profile_fit as pf
from waveplan.planner.cli import main
from waveplan.pricing.coefficients import load_table
from waveplan.pricing.fsdp import build_fsdp_model, terms
from waveplan.pricing.fsdp import calibrate as fc
from waveplan.pricing.fsdp.check import price_record
from waveplan.pricing.fsdp.model import TRACED_FAMILIES, for_step
from waveplan.pricing.hf_config import load_hf_config
from waveplan.pricing.step import Step
from waveplan.pricing.walk import (
    LAYER_BACKWARD,
    MLP_BACKWARD,
    MLP_FORWARD,
    MLP_KEPT,
    MLP_RECOMPUTE,
    MLP_RECOMPUTE_CONST,
    MLP_WORKSPACE,
)
from waveplan.pricing.wave_pricer import WavePricer

TRACES = Path(__file__).resolve().parents[2] / "bench" / "results" / "fsdp_traces.jsonl"
BASE = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=1024)
MOE = dict(BASE, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
           tie_word_embeddings=False)
GEMMA2 = dict(BASE, model_type="gemma2", query_pre_attn_scalar=32, sliding_window=64,
              tie_word_embeddings=True)
GIB = 2**30


def _price(cfg, *, ckpt=True, attn="sdpa", table=None, lens=(96, 64, 32)):
    model = build_fsdp_model(load_hf_config(dict(cfg)), fsdp=2, attn=attn, checkpointing=ckpt, attn_rows=1)
    if table is not None:
        model = dataclasses.replace(model, table=table)
    model, step = for_step(model, Step.from_lengths([0] * len(lens), list(lens)))
    return WavePricer.build(step, model).price([np.arange(len(lens))], first_slots=frozenset({"default"}))


def test_moe_folded_expert_stacks_are_charged_at_the_mlp_points():
    g = load_hf_config(dict(MOE))
    up, down = terms.moe_lora_stacks(g)
    assert up == 2 * 8 * 2 * 96 * 128 and down == 2 * 8 * 96 * 128
    grad = max(down, up - down)
    ck = build_fsdp_model(g, fsdp=2, attn="sdpa", checkpointing=True, attn_rows=64).charges
    no = build_fsdp_model(g, fsdp=2, attn="sdpa", checkpointing=False, attn_rows=64).charges
    # not in the constant every point holds: at each MoE layer's MLP points only
    # (#fsdp-moe-points): with checkpointing its two copies (and a gradient at its backward),
    # without, each layer keeps its copies from its forward MLP point to its backward one
    assert ck.resident == no.resident
    mc, mn = ck.walk.mlp_points, no.walk.mlp_points
    # one layer's LoRA parameters (every linear and the expert stacks' adapters): none of their
    # bf16 gradients is made at the MLP backward point but the down stack's adapters'; the fp32
    # reduce-scatter output shard, not live before a layer's reduce-scatter: off every backward
    # point of a layer but the last's, where the walk takes off every reduce buffer
    rank = build_fsdp_model(g, fsdp=2, attn="sdpa", attn_rows=64).lora.slots[0].rank
    top = rank * (terms.layer_param_counts(g, 0)[1] + terms.moe_lora_param_count(g) - (128 + 8))
    down_lora = 2 * rank * terms.moe_down_lora_param_count(g)
    assert terms.moe_down_lora_param_count(g) == 8 * (96 + 128)
    shard = 4 * terms.shard(top, 2)
    reduce_buffers = 4 * (top + terms.shard(top, 2))
    np.testing.assert_allclose(mc[MLP_FORWARD], up + down)
    np.testing.assert_allclose(mc[MLP_BACKWARD], up + down + grad - 2 * top + down_lora)
    # (layer 0, the last the backward runs, prefetches no layer)
    gathered = 2 * (terms.layer_param_counts(g, 0)[0] + top)
    np.testing.assert_allclose(mc[LAYER_BACKWARD], [-gathered - shard, -reduce_buffers])
    # FSDP2 pads a stack's experts (dim 0) to the shard group: none for 8 experts on 2 or 4
    # ranks, 2 experts' worth for 6 on 4 (their gate_up and down, H x F_e each x 3)
    assert terms.moe_stack_padding(g, 2) == terms.moe_stack_padding(g, 4) == 0
    six = load_hf_config(dict(MOE, num_experts=6))
    assert terms.moe_stack_padding(six, 4) == 2 * 3 * 96 * 128
    assert terms.moe_stack_padding(load_hf_config(dict(BASE, model_type="llama")), 4) == 0
    np.testing.assert_allclose(mc[MLP_KEPT], 0.0)
    np.testing.assert_allclose(mn[MLP_KEPT], up + down)
    np.testing.assert_allclose(mn[MLP_BACKWARD], grad - 2 * top + down_lora)
    # with checkpointing, the recomputed MLP's point before its backward: the two copies, none
    # of the layer's bf16 LoRA gradients; its routed rows' recompute tensors in place of the
    # backward's (`terms.moe_recompute_per_row`)
    np.testing.assert_allclose(mc[MLP_RECOMPUTE_CONST], up + down - 2 * top)
    w8 = terms.widths(g, rank)
    dense = terms.moe_per_row(w8) + 12 * w8.F
    routed = terms.moe_recompute_per_row(w8) - dense
    # and, sdpa under GQA on a masked call, k and v repeated to every query head
    gqa = terms.recompute_repeated_kv_per_row(w8, attn="sdpa")
    assert gqa == 4 * w8.Q - 4 * w8.KV > 0
    # the MLP's backward point (the down stack's gradient): the weighted output's gradients
    # and scatter freed, the product's gradient made (`terms.moe_backward_per_row`)
    assert terms.moe_backward_per_row(w8) == terms.moe_recompute_per_row(w8) - 6 * 2 * 128 + 2 * w8.F
    assert (terms.moe_backward_per_row(w8, fp32_weights=True)
            == terms.moe_recompute_per_row(w8, fp32_weights=True) - 12 * 2 * 128 + 2 * w8.F)
    np.testing.assert_allclose(mc[MLP_RECOMPUTE] - mc[MLP_WORKSPACE],
                               terms.moe_recompute_per_row(w8) - terms.moe_backward_per_row(w8))
    ws_att_free = mc[MLP_WORKSPACE] - (terms.moe_backward_per_row(w8) - dense + gqa)
    np.testing.assert_allclose(mc[MLP_RECOMPUTE], ws_att_free + routed + gqa)
    # without checkpointing the kept layer's MLP backward has two moments, each with the
    # router's gradients: the scatter's first (at the walk's third point, no LoRA gradient, no
    # stack gradient), then the down stack's (the product's gradient, at the MLP backward point)
    assert terms.moe_kept_backward_per_row(w8) == (6 * 2 * 128 + 12 * 8, 2 * w8.F + 12 * 8)
    assert terms.moe_kept_backward_per_row(w8, fp32_weights=True)[0] == 12 * 2 * 128 + 12 * 8
    first, down_moment = terms.moe_kept_backward_per_row(w8)
    np.testing.assert_allclose(mn[MLP_RECOMPUTE] - mn[MLP_WORKSPACE], first - down_moment)
    np.testing.assert_allclose(mn[MLP_RECOMPUTE_CONST], -2 * top)
    # Mixtral's fp32 routing weights: the weighted output's gradient and scatter in fp32
    assert (terms.moe_recompute_per_row(w8, fp32_weights=True) - terms.moe_recompute_per_row(w8)
            == 6 * 2 * 128)
    assert terms.moe_recompute_per_row(w8) == 10 * 2 * 128 + 8 * 2 * 96 + 12 * 8 + 48 * 2
    # the recomputed attention's S x S at the MLP's backward point: sdpa's kept float mask
    w = terms.widths(g, 8)
    assert terms.recompute_kept_quadratic(w, attn="sdpa", checkpointing=True) == 2.0
    assert terms.recompute_kept_quadratic(w, attn="eager", checkpointing=True) == 6 * w.nh
    assert terms.recompute_kept_quadratic(w, attn="eager", checkpointing=False) == 0.0
    # without checkpointing the head holds every layer's copies, with it none
    head_no = _price(MOE, ckpt=False, lens=(8,))
    assert no.walk.mlp_points.shape[1] == g.num_layers and head_no.raw_bytes > 0
    # a dense family is priced at two points per layer too, its MLP's without MoE constants
    dense = build_fsdp_model(load_hf_config(dict(BASE, model_type="llama")), fsdp=2, attn="sdpa",
                             attn_rows=64).charges.walk.mlp_points
    assert dense.shape[1] == 2 and not dense[MLP_FORWARD].any() and not dense[MLP_BACKWARD].any()
    # PEFT's expert adapters: A 2E x H and B 2F_e x 2E (gate_up), A E x F_e and B H x E (down), router
    assert terms.moe_lora_param_count(g) == 2 * 8 * (128 + 2 * 96) + 8 * (96 + 128) + (128 + 8)


def test_gemma_masks_and_final_softcap():
    g = load_hf_config(dict(GEMMA2))
    w = terms.widths(g, 8)
    assert terms.family_adds(g, w, checkpointing=True, attn="sdpa").masks == 2   # sliding + full
    assert terms.family_adds(g, w, checkpointing=True, attn="flash").masks == 1
    one_kind = load_hf_config(dict(GEMMA2, model_type="gemma3_text", num_hidden_layers=2))
    assert terms.family_adds(one_kind, terms.widths(one_kind, 8), checkpointing=True, attn="sdpa").masks == 1
    assert terms.final_softcap_per_row(w) == (2 * 1024, 0.0, 4 * 1024)   # bf16, not fp32 copies
    assert "gemma2" in TRACED_FAMILIES and _price(GEMMA2).basis in ("evidence", "conservative")


def test_factors_default_to_the_derived_terms_and_raise_what_they_scale():
    base = load_table("torch-cpu")
    plain = _price(MOE, attn="eager").raw_bytes
    assert _price(MOE, attn="eager", table=fc.scaled_table(base, {g: 1.0 for g in fc.GROUPS})).raw_bytes == plain
    for group in fc.GROUPS:
        assert _price(MOE, attn="eager", table=fc.scaled_table(base, {group: 2.0})).raw_bytes > plain, group


def test_calibrate_fits_fsdp_traces(tmp_path, capsys):
    records = [json.loads(line) for line in TRACES.read_text().splitlines()]
    picked = [r for r in records if r["class"].startswith("set3:")][:4] + records[:2]
    src = tmp_path / "traces.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in picked))
    out = tmp_path / "fitted.json"
    assert main(["calibrate", str(src), "--out", str(out)]) == 0
    assert "fsdp traces" in capsys.readouterr().out
    table = load_table(str(out))
    assert set(fc.GROUPS) <= set(table.terms)
    for rec in picked:   # the fitted table covers every record with the margin
        assert price_record(rec, table=table).raw_bytes >= (1 + fc.MARGIN) * rec["peak_bytes"] * 0.99999
    # a price with the fitted table, through the CLI's --backend
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(picked[0]["config"]))
    step = tmp_path / "wave.jsonl"
    step.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"p{i}", "prompt_tokens": n // 2,
                                        "completion_tokens": n - n // 2}) + "\n"
                            for i, n in enumerate(picked[0]["seq_lens"])))
    assert main(["price", str(step), "--model", str(cfg), "--framework", "fsdp", "--fsdp", "2",
                 "--attn", picked[0]["attn"], "--recompute", "full" if picked[0]["checkpointing"] else "none",
                 "--lora-rank", str(picked[0]["lora_rank"]), "--backend", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["raw_bytes"] >= picked[0]["peak_bytes"] and "fsdp_layer" in load_table(str(out)).terms


def test_calibrate_refuses_mixed_frameworks(tmp_path, capsys):
    rec = json.loads(TRACES.read_text().splitlines()[0])
    src = tmp_path / "mixed.jsonl"
    src.write_text(json.dumps(rec) + "\n" + json.dumps({"cell": {}, "trace": {}}) + "\n")
    assert main(["calibrate", str(src), "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mixed.jsonl:2" in err[0]


def test_calibrate_profiles_of_an_fsdp_model(tmp_path, capsys):
    cfg = dict(BASE, model_type="llama", tie_word_embeddings=False, hidden_size=1024, intermediate_size=2816,
               num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=32000)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(cfg))
    planner = Planner.from_hf_config(str(config), framework="fsdp", fsdp=4, attn="flash", recompute="full",
                                     lora_rank=8)
    plan = planner.plan("pricing/data/steps/grpo-8x8.jsonl", 16 * GIB, deterministic=True)
    for k, wave in enumerate(plan.waves):
        planner.observe(wave, peak_bytes=int(wave.static_raw_bytes * (0.9, 0.95)[k % 2]))
    fit = pf.fit_profiles(planner.profiles, planner.model, backend="mine")
    assert set(fit.scales) == set(fc.GROUPS)
    assert min(fit.ratios) >= 1 + pf.MARGIN and fit.uniform < 1.0
    assert fit.scales["fsdp_attention"] == 1.0   # flash: no S x S term, no evidence, kept
    fitted = dataclasses.replace(planner.model, table=fit.table)
    for cell in fit.cells:
        assert pf._price(fitted, cell) >= cell.peak_bytes
    # the same through the CLI: the profiles saved, the model given as the planner had it
    profiles = planner.save_profiles(tmp_path / "profiles.json")
    out = tmp_path / "fitted.json"
    assert main(["calibrate", "--profiles", str(profiles), "--model", str(config), "--framework", "fsdp",
                 "--fsdp", "4", "--attn", "flash", "--recompute", "full", "--lora-rank", "8",
                 "--out", str(out)]) == 0
    assert "observed waves" in capsys.readouterr().out
    assert set(fc.GROUPS) <= set(load_table(str(out)).terms)


def test_inspect_prints_the_fsdp_view(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(MOE))
    assert main(["inspect", "--model", str(config), "--framework", "fsdp", "--fsdp", "8", "--attn", "sdpa",
                 "--recompute", "none", "--no-reshard-after-forward"]) == 0
    out = capsys.readouterr().out
    assert "shard      FSDP2 x8" in out and "no reshard after forward" in out
    assert "experts.gate_up_proj" in out and "checkpoint none" in out and "TP1" not in out
    assert main(["inspect", "--model", str(config), "--framework", "fsdp", "--json"]) == 0
    view = json.loads(capsys.readouterr().out)["fsdp"]
    assert view["shard_group"] == 1 and view["attn"] == "flash" and view["checkpointing"] is True
    assert view["basis"] == "conservative" and any("Qwen3-MoE" in r for r in view["reasons"])
    assert "router gate.weight" in view["lora_targets"]


def test_no_reshard_after_forward_is_priced_on_evidence():
    g = load_hf_config(dict(BASE, model_type="llama", tie_word_embeddings=False))
    on = build_fsdp_model(g, fsdp=2, attn="sdpa", attn_rows=1)
    off = build_fsdp_model(g, fsdp=2, attn="sdpa", attn_rows=1, reshard_after_forward=False)
    assert off.basis == on.basis == "evidence"
    # every layer's gathered parameters, the head's points included
    assert off.charges.resident >= on.charges.resident
    assert off.charges.resident + off.charges.walk.head_const > on.charges.resident + on.charges.walk.head_const


def test_moe_basis_is_evidence_only_for_held_out_classes_on_target():
    # mixtral with checkpointing and sdpa at a shard group of 2 or more met the target on its
    # held-out set-22 class (MOE_EVIDENCE), Qwen3-MoE with checkpointing and sdpa at any shard group
    # (sets 22/28); FSDP1 mixtral, Ulysses, checkpointed eager and Mixtral's sdpa without
    # checkpointing stay conservative with the reason
    mixtral = load_hf_config(dict(BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                                  tie_word_embeddings=False, sliding_window=None))
    qwen = load_hf_config(dict(MOE))

    def basis(g, **kw):
        return build_fsdp_model(g, attn_rows=64, **dict(dict(fsdp=2, attn="sdpa", checkpointing=True), **kw))

    assert basis(mixtral).basis == "evidence" and basis(mixtral, fsdp=4).basis == "evidence"
    assert basis(qwen).basis == basis(qwen, fsdp=1).basis == "evidence"
    # without checkpointing (held-out sets 29 and 22): eager for both families and sdpa for
    # Qwen3-MoE at any shard group
    for on in (basis(qwen, checkpointing=False, attn="eager"), basis(mixtral, checkpointing=False, attn="eager"),
               basis(qwen, checkpointing=False), basis(qwen, checkpointing=False, attn="eager", fsdp=4),
               basis(qwen, checkpointing=False, attn="eager", fsdp=1), basis(qwen, checkpointing=False, fsdp=1),
               basis(mixtral, checkpointing=False, attn="eager", fsdp=1)):
        assert on.basis == "evidence"
    for off in (basis(mixtral, fsdp=1), basis(mixtral, attn="eager"), basis(mixtral, checkpointing=False),
                basis(qwen, attn="eager"), basis(mixtral, ulysses=2)):
        assert off.basis == "conservative"
        assert any("under FSDP" in r and "#fsdp-moe-points" in r for r in off.gaps)


def test_moe_eager_without_checkpointing_releases_the_mlp_before_the_softmax_backward():
    # a MoE layer's attention backward point without checkpointing is eager's dense one
    # (#fsdp-dense-points): by the softmax backward the layer's MLP (its routed rows' kept
    # tensors included), norms and output projection have released what they kept
    g = load_hf_config(dict(MOE))
    rows = 256
    model = build_fsdp_model(g, fsdp=2, attn="eager", checkpointing=False, attn_rows=rows)
    w = terms.widths(g, model.lora.slots[0].rank)
    model, _ = for_step(model, Step.from_lengths([0, 0], [rows // 2, rows // 2]))
    own = (terms.layer_retained_per_row(w, checkpointing=False, qk_norm=g.qk_norm, attn="eager")
           + terms.family_adds(g, w, checkpointing=False, attn="eager").retained)
    released = own - terms.eager_attention_kept_per_row(w, qk_norm=g.qk_norm)
    assert released >= terms.moe_per_row(w) + 8 * w.F
    _, b_att = terms.layer_backward_per_row(w, checkpointing=False, qk_norm=g.qk_norm, attn="eager")
    point = max(terms.eager_softmax_backward_per_row(w) - released + 6 * w.nh * rows, b_att - released)
    if g.qk_norm:
        point = max(point, terms.qk_norm_backward_per_row(w, checkpointing=False) - released)
    assert np.allclose(model.charges.walk.workspace, point)


def test_set22_moe_eager_without_checkpointing_is_priced_on_target():
    # set 22's qwen3_moe (FSDP2) and mixtral (FSDP4) eager cells without checkpointing: never
    # under, within the 10% worst (they were +11.3% and +6.0% with the S x S point term beside
    # every kept tensor)
    recs = [json.loads(line) for line in TRACES.read_text().splitlines()]
    recs = [r for r in recs if r["class"] in ("set22:qwen3_moe/nockpt/eager/fsdp2", "set22:mixtral/nockpt/eager/fsdp4")]
    assert len(recs) == 4
    for rec in recs:
        assert rec["peak_bytes"] <= price_record(rec).raw_bytes <= 1.05 * rec["peak_bytes"]
