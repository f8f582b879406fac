"""flash_attention_2's layer points under FSDP (docs/memory-model.md#fsdp-flash-steps): a dense flash
model is priced at its MLP's and attention's points apart with FSDP2's reduce-scatter steps and
the attention adapters' gradients off the MLP point; the head's backward is credited the input
gradient only for vocabularies of at least 2H; Gemma 3 carries no factor under flash; sdpa/eager
prices are untouched; every committed flash trace is priced at or above its peak."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from waveplan.pricing.fsdp import build_fsdp_model, terms
from waveplan.pricing.fsdp.check import price_record
from waveplan.pricing.fsdp.model import TRACED_FAMILIES, flash_mlp_backward, reduce_scatter_steps
from waveplan.pricing.hf_config import load_hf_config
from waveplan.pricing.walk import (
    ATTN_BACKWARD_SEGMENT,
    LAYER_BACKWARD,
    MLP_BACKWARD,
    MLP_ROWS,
    MLP_WORKSPACE,
    POINT_BACKWARD,
    POINT_FORWARD,
    TERM_GDN_STATES,
    WalkGroups,
    walk,
)

TRACES = Path(__file__).resolve().parents[2] / "bench" / "results" / "fsdp_traces.jsonl"
BASE = dict(hidden_size=128, intermediate_size=448, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=False)


def _model(cfg, attn="flash", fsdp=2, ckpt=True, rank=8):
    from waveplan.pricing.lora import LoraConfig, LoraSlot

    return build_fsdp_model(load_hf_config(dict(cfg)), fsdp=fsdp, attn=attn, checkpointing=ckpt,
                            attn_rows=0 if attn == "flash" else 64,
                            lora=LoraConfig(slots=(LoraSlot(rank=rank),)))


def test_every_attention_is_priced_at_two_points():
    flash = _model(dict(BASE, model_type="llama")).charges.walk
    sdpa = _model(dict(BASE, model_type="llama"), attn="sdpa").charges.walk
    assert flash.mlp_points.shape == (MLP_ROWS, 3)
    assert sdpa.mlp_points.shape == (MLP_ROWS, 3)
    # the MLP's backward (checkpointed: the recomputed MLP's tensors) is the larger workspace
    assert np.all(flash.mlp_points[MLP_WORKSPACE] > flash.workspace)


def test_reduce_scatter_steps_and_the_attention_adapters_gradients():
    g = load_hf_config(dict(BASE, model_type="llama"))
    top = 60000.0
    steps = reduce_scatter_steps(3, top, 2)
    assert steps[0] == steps[1] == -4 * terms.shard(top, 2)
    assert steps[2] == -4 * terms.shard(top, 2) - 4 * top
    # q, k, v, o adapters, A and B: (H + Q) + 2 (H + KV) + (Q + H) per unit of rank, bf16
    assert flash_mlp_backward(g, 8) == -2 * 8 * ((128 + 128) + 2 * (128 + 64) + (128 + 128))
    phi3 = load_hf_config(dict(BASE, model_type="phi3", sliding_window=None, pad_token_id=0))
    assert flash_mlp_backward(phi3, 8) == -2 * 8 * ((128 + 128 + 128) + (128 + 128))
    walk = _model(dict(BASE, model_type="llama")).charges.walk
    assert np.all(walk.mlp_points[MLP_BACKWARD] < 0) and walk.mlp_points[LAYER_BACKWARD, 2] < walk.mlp_points[
        LAYER_BACKWARD, 1] < 0


def test_head_credit_only_for_vocabularies_of_at_least_2h():
    w = terms.widths(load_hf_config(dict(BASE, model_type="llama")), 8)
    assert terms.flash_head_credit(w) == 2 * 128
    small = terms.widths(load_hf_config(dict(BASE, model_type="llama", vocab_size=200)), 8)
    assert terms.flash_head_credit(small) == 0.0
    flash = _model(dict(BASE, model_type="llama")).charges.walk
    sdpa = _model(dict(BASE, model_type="llama"), attn="sdpa").charges.walk
    eager = _model(dict(BASE, model_type="llama"), attn="eager").charges.walk
    # the same head program under every attention (sdpa's anatomy too): the same credit
    assert flash.head_transient == sdpa.head_transient == eager.head_transient
    head = terms.head_per_row(w, final_softcap=False)[1]
    assert sdpa.head_transient == head - 2 * 128


def test_gemma3_carries_no_factor():
    cfg = dict(BASE, model_type="gemma3_text", query_pre_attn_scalar=32, sliding_window=256,
               tie_word_embeddings=True)
    for attn in ("flash", "sdpa", "eager"):
        assert "gemma3_text" in TRACED_FAMILIES and _model(cfg, attn=attn).bound_scale == 1.0


@pytest.mark.parametrize("attn", ["flash"])
def test_committed_flash_traces_are_never_under(attn):
    recs = [json.loads(line) for line in TRACES.read_text().splitlines()]
    recs = [r for r in recs if r["attn"] == attn]
    assert len(recs) >= 40
    for rec in recs:
        assert price_record(rec).raw_bytes >= rec["peak_bytes"], rec["class"]


def test_flash_basis_follows_the_held_out_classes():
    llama = dict(BASE, model_type="llama")
    assert _model(llama, ckpt=False).basis == "evidence"
    assert _model(llama, ckpt=False, fsdp=1).basis == "evidence"
    assert _model(llama, ckpt=True, fsdp=4).basis == "evidence"
    # set 24 held out checkpointing at FSDP1 (llama, qwen2) and qwen3, mistral, phi3 with it
    assert _model(llama, ckpt=True, fsdp=1).basis == "evidence"
    assert _model(dict(BASE, model_type="qwen3"), ckpt=True).basis == "evidence"
    phi3 = dict(BASE, model_type="phi3", sliding_window=None, pad_token_id=0)
    assert _model(phi3, ckpt=True).basis == "evidence"
    off = _model(phi3, ckpt=False)
    assert off.basis == "conservative" and any("may be one sequence" in r for r in off.gaps)
    # a step priced whole with every call packed: held out on set 30
    from waveplan.pricing.fsdp.model import for_step
    from waveplan.pricing.step import Step

    assert for_step(off, Step.from_lengths([0, 0], [96, 64]))[0].basis == "evidence"
    gemma3 = dict(BASE, model_type="gemma3_text", query_pre_attn_scalar=32, sliding_window=256,
                  tie_word_embeddings=True)
    assert _model(gemma3, ckpt=False, fsdp=1).basis == "evidence"
    assert _model(gemma3, ckpt=True).basis == "evidence"
    gemma2 = dict(gemma3, model_type="gemma2")
    # gemma2 with checkpointing: held out on set 30 (F = 5H) after its MLP point's norm term
    assert _model(gemma2, ckpt=True).basis == "evidence"
    moe = dict(BASE, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96)
    assert any("MoE family traced" in r for r in _model(moe).gaps)
    assert _model(moe).basis == "conservative"


def test_accumulator_rows_sit_at_the_attention_backward_point_only():
    """flash-attn's 128 accumulator rows per sequence (`terms.flash_per_sequence`) are charged per
    segment at each layer's attention backward point, not at its forward or MLP points."""
    charges = _model(dict(BASE, model_type="llama")).charges.walk
    w = terms.widths(load_hf_config(dict(BASE, model_type="llama")), 8)
    assert np.all(charges.gdn_state == 0.0)
    assert np.all(charges.mlp_points[ATTN_BACKWARD_SEGMENT] == terms.flash_per_sequence(w))
    rows = 300.0

    def peak(ch, segments):
        groups = WalkGroups(rows=np.array([rows]), logical=np.array([rows]),
                            segments=np.array([float(segments)]), grad=np.array([True]),
                            slot=np.array([0]), carries=np.array([True]), longest=np.array([rows]))
        return walk(ch, 0.0, groups)

    base, _ = peak(charges._replace(mlp_points=charges.mlp_points * (np.arange(MLP_ROWS) != ATTN_BACKWARD_SEGMENT)[:, None]), 40)
    # a per-segment charge so large that its point binds: an attention backward point, whose
    # workspace is the attention's (not the MLP's), carrying the segments' bytes
    big = charges.mlp_points.copy()
    big[ATTN_BACKWARD_SEGMENT] = 1e9
    best, at = peak(charges._replace(mlp_points=big), 40)
    i = int(best[2])
    assert best[1] == POINT_BACKWARD and at[TERM_GDN_STATES] == 40 * 1e9
    assert at[1] == rows * charges.workspace[i] + charges.mlp_points[LAYER_BACKWARD, i]
    assert best[0] <= base[0] + 40 * 1e9
    # the walk's forward points are unchanged by the charge
    assert base[1] != POINT_FORWARD or peak(charges, 40)[0][0] == base[0]


def test_gemma_post_feedforward_norm_at_the_mlp_backward_point():
    """max(0, 20H - 4F) at the MLP's backward point in all, of which `sandwich_backward_per_row`
    holds 6H: set 10's shape (F = 3.5H), set 24's narrow MLP and set 27's wide gemma2 (F = 4H)."""
    w = terms.widths(load_hf_config(dict(BASE, model_type="gemma2", query_pre_attn_scalar=32,
                                         sliding_window=256, tie_word_embeddings=True)), 8)
    six = terms.sandwich_backward_per_row(w, checkpointing=True)
    assert six == 6 * 128
    assert terms.flash_sandwich_mlp_per_row(w, checkpointing=True) + six == 20 * 128 - 4 * 448
    assert terms.flash_sandwich_mlp_per_row(w, checkpointing=False) == 0.0
    narrow = dataclasses.replace(w, H=240.0, F=576.0)
    assert terms.flash_sandwich_mlp_per_row(narrow, checkpointing=True) == 14 * 240 - 4 * 576
    wide = dataclasses.replace(w, H=256.0, F=1024.0)
    assert terms.flash_sandwich_mlp_per_row(wide, checkpointing=True) == -2 * 256
    wider = dataclasses.replace(w, H=256.0, F=2048.0)
    assert terms.flash_sandwich_mlp_per_row(wider, checkpointing=True) == -6 * 256


def test_phi3_fused_output_kept_unless_every_call_is_packed():
    """A step priced whole whose every (slot, grad) class holds two requests or more runs
    flash's varlen path, which keeps no fused q/k/v output (`terms.flash_fused_qkv_per_row`);
    a planned step (a wave may hold one request), a one-request class, sdpa and Ulysses keep
    the one-sequence charge."""
    from waveplan.pricing.fsdp.model import for_step
    from waveplan.pricing.step import Request, Step

    phi3 = dict(BASE, model_type="phi3", sliding_window=None, pad_token_id=0)
    off = _model(phi3, ckpt=False)
    w = terms.widths(off.geometry, 8)
    two = Step.from_lengths([0, 0], [96, 64])
    packed, _ = for_step(off, two)
    assert packed.packed_calls
    kept = 2 * w.Q + 2 * w.KV
    assert np.allclose(off.charges.walk.retained - packed.charges.walk.retained, kept)
    assert not for_step(off, two, 1e9)[0].packed_calls
    assert not for_step(off, Step.from_lengths([0], [96]))[0].packed_calls
    lone = Step.from_requests([Request(id="a", num_tokens=96), Request(id="b", num_tokens=64),
                               Request(id="c", num_tokens=32, grad=False)])
    assert not for_step(off, lone)[0].packed_calls
    assert not for_step(_model(phi3, attn="sdpa", ckpt=False), two)[0].packed_calls
    # with checkpointing the charge is at the backward points, the same either way
    on = _model(phi3, ckpt=True)
    assert np.array_equal(for_step(on, two)[0].charges.walk.retained, on.charges.walk.retained)
    # the flag travels with the model's dict
    assert type(packed).from_dict(packed.to_dict()).packed_calls


def test_the_accumulator_is_head_size_rounded():
    assert [terms.flash_head_rounded(d) for d in (32, 40, 48, 64, 96, 128, 192, 200)] == [
        32, 64, 64, 64, 96, 128, 192, 256]
    w = terms.widths(load_hf_config(dict(BASE, model_type="qwen3", num_attention_heads=4, head_dim=40)), 8)
    assert terms.flash_accumulator_width(w) == 4 * 4 * 64 > 4 * w.Q
    assert terms.flash_per_sequence(w) == 128 * (4 * 4 * 64 + 4 * 4)
