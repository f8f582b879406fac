"""The dense sdpa/eager layer points read from live-storage anatomies (issue 30,
docs/memory-model.md#fsdp-attention):

* eager's forward point holds the scores, their fp32 copy and the softmax output (10 nh), its
  backward the 12 nh of the softmax's backward; without checkpointing the attention's backward
  point holds only what the attention keeps (the MLP's and norms' kept tensors released);
* a checkpointed sdpa layer on a masked GQA call: the kernel's backward holds k/v repeated to
  every query head and their Q-wide gradients, and the dense MLP's backward the repeats;
* qk-norm: the query norm's fp32 backward (24Q) after the kernel's;
* set 26's traces, which the old terms priced under (9% and 8.8%), are priced at or above.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from waveplan.pricing.fsdp import build_fsdp_model, terms
from waveplan.pricing.fsdp.check import price_record
from waveplan.pricing.hf_config import load_hf_config
from waveplan.pricing.lora import LoraConfig, LoraSlot

TRACES = Path(__file__).resolve().parents[2] / "bench" / "results" / "fsdp_traces.jsonl"
GQA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=16,
           num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=False,
           model_type="llama")


def _w(cfg, rank=8):
    return terms.widths(load_hf_config(dict(cfg)), rank)


def _walk(cfg, *, attn, ckpt, rows=64, one_sequence=False):
    from waveplan.pricing.fsdp.model import for_step
    from waveplan.pricing.step import Step

    model = build_fsdp_model(load_hf_config(dict(cfg)), fsdp=2, attn=attn, checkpointing=ckpt,
                             attn_rows=rows, lora=LoraConfig(slots=(LoraSlot(rank=8),)))
    lens = [rows] if one_sequence else [rows // 2, rows // 2]
    model, _ = for_step(model, Step.from_lengths([0] * len(lens), lens))
    return model.charges.walk


def test_masked_gqa_recompute_holds_repeated_kv_and_q_wide_gradients():
    w = _w(GQA)
    masked = terms.sdpa_recompute_backward_per_row(w, masked=True, qk_norm=False)
    unmasked = terms.sdpa_recompute_backward_per_row(w, masked=False, qk_norm=False)
    assert masked - unmasked == 8 * w.Q - 8 * w.KV
    # one key/value head: the repeat is a view (kept 4KV) but the gradients are Q-wide
    one = _w(dict(GQA, num_key_value_heads=1))
    assert (terms.sdpa_recompute_backward_per_row(one, masked=True, qk_norm=False)
            - terms.sdpa_recompute_backward_per_row(one, masked=False, qk_norm=False)) == 4 * one.Q - 4 * one.KV
    assert terms.sdpa_recompute_repeats_per_row(w, masked=True) == 4 * w.Q - 4 * w.KV
    assert terms.sdpa_recompute_repeats_per_row(one, masked=True) == 0.0
    assert terms.sdpa_recompute_repeats_per_row(w, masked=False) == 0.0


def test_a_packed_gqa_checkpointed_sdpa_layer_is_charged_above_one_sequence():
    packed = _walk(GQA, attn="sdpa", ckpt=True)
    single = _walk(GQA, attn="sdpa", ckpt=True, one_sequence=True)
    w = _w(GQA)
    # the masked kernel's backward binds the packed layer; one sequence (no mask, GQA in the
    # kernel) stays below it
    kernel = terms.sdpa_recompute_backward_per_row(w, masked=True, qk_norm=False)
    assert packed.workspace[0] >= kernel > single.workspace[0]


def test_qk_norm_backward_moment_binds_wide_query_layers():
    cfg = dict(GQA, model_type="qwen3", num_attention_heads=12)
    w = _w(cfg)
    assert terms.qk_norm_backward_per_row(w, checkpointing=True) == 24 * w.Q + 8 * w.H + 4 * w.nh + 6 * w.r + 4
    single = _walk(cfg, attn="sdpa", ckpt=True, one_sequence=True)
    assert single.workspace[0] >= terms.qk_norm_backward_per_row(w, checkpointing=True)


def test_eager_forward_point_is_below_its_backward_point_with_checkpointing():
    cfg = dict(GQA, num_attention_heads=4, num_key_value_heads=2)
    w = _w(cfg)
    assert terms.eager_forward_quadratic(w) == 10 * w.nh
    rows = 256
    walk = _walk(cfg, attn="eager", ckpt=True, rows=rows)
    # per row: the forward point's 10 nh x S beside the attention's forward transient, the
    # backward point's 12 nh x S
    f_att = terms.layer_forward_per_row(w, qk_norm=False)[1]
    assert walk.nograd[1] == pytest.approx(f_att + 10 * w.nh * rows)
    assert walk.workspace[1] >= 12 * w.nh * rows


def test_eager_without_checkpointing_releases_the_mlp_before_the_softmax_backward():
    cfg = dict(GQA, num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024)
    w = _w(cfg)
    kept = terms.eager_attention_kept_per_row(w, qk_norm=False)
    own = terms.layer_retained_per_row(w, checkpointing=False, qk_norm=False, attn="eager")
    assert own - kept >= 8 * w.F   # the MLP's gate, up, act and product outputs are released
    rows = 1024
    eager = _walk(cfg, attn="eager", ckpt=False, rows=rows)
    # the softmax backward's moment binds: 6 nh x S beyond what the layer keeps, less what its
    # MLP, norms and output projection released
    assert eager.workspace[1] == pytest.approx(6 * w.nh * rows + terms.eager_softmax_backward_per_row(w)
                                               - (own - kept))


@pytest.mark.parametrize("cls", ["set26:llama/ckpt/sdpa/fsdp2", "set26:qwen3/ckpt/sdpa/fsdp2"])
def test_set26_traces_are_priced_at_or_above(cls):
    recs = [json.loads(line) for line in TRACES.read_text().splitlines()]
    recs = [r for r in recs if r["class"] == cls]
    assert len(recs) == 2
    for rec in recs:
        assert price_record(rec).raw_bytes >= rec["peak_bytes"]


def test_eager_one_key_value_head_keeps_no_repeats():
    # one key/value head: eager's repeated key and value are views of the rotated key and the
    # value (set 7's qwen3_moe anatomy), so a layer keeps 4KV for them, not 4Q; with more key/value
    # heads the repeats are copies (4Q)
    one = _w(dict(GQA, num_attention_heads=8, num_key_value_heads=1))
    two = _w(dict(GQA, num_attention_heads=8, num_key_value_heads=2))
    for w, extra in ((one, 0.0), (two, 4 * two.Q - 4 * two.KV)):
        sdpa = terms.layer_retained_per_row(w, checkpointing=False, qk_norm=False, attn="sdpa")
        eager = terms.layer_retained_per_row(w, checkpointing=False, qk_norm=False, attn="eager")
        assert eager - sdpa == extra
    # the softmax backward's kept tensors: the rotated query and the key the scores' matmul saved
    base = terms.eager_attention_kept_per_row(one, qk_norm=False) - 2 * one.Q
    assert base == 6 * one.H + 4 + 2 * one.KV + 6 * one.r
    assert terms.eager_attention_kept_per_row(two, qk_norm=False) - 2 * two.Q == 6 * two.H + 4 + 2 * two.Q + 6 * two.r
