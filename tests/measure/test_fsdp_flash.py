"""transformers' flash_attention_2 path traced with flash-attn 2's allocation model
(pricing/measure/hf_flash.py): the stand-in's bytes, its values, and a 2-rank FSDP2 trace priced
at or above its peak (docs/memory-model.md#fsdp-attention)."""

from __future__ import annotations

import pytest

from waveplan.planner.cli import main
from waveplan.pricing.errors import ConfigError
from waveplan.pricing.fsdp.check import price_record

SMALL = dict(model_type="llama", hidden_size=64, intermediate_size=224, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
             tie_word_embeddings=False)


def _counted(fn, rest=()):
    """(fn(), bytes live after it, peak bytes during it) as the tracer counts them, `rest`
    (tensors that exist before) uncounted."""
    from waveplan.pricing.measure.trace import _tracker_class

    tracker = _tracker_class()()
    tracker.ignore(rest)
    with tracker:
        keep = fn()
    return keep, tracker.current, tracker.peak


@pytest.mark.parametrize("lens,heads,groups", [((40, 24, 8), 4, 2), ((130,), 4, 4), ((7, 9), 6, 1)])
def test_stand_in_allocates_flash_attn_2s_documented_bytes(lens, heads, groups):
    """Forward keeps out (2Q), softmax_lse fp32 [h, t] and rng_state; backward allocates dq, dk,
    dv, softmax_d fp32 [h, t + 128 b], dq_accum fp32 [t + 128 b, h, round32(d)] and, under
    GQA, dk/dv expanded to every head (flash_api.cpp `mha_varlen_bwd`); a one-sequence row
    (`mha_bwd`) rounds its accumulator rows to 128."""
    import torch

    from waveplan.pricing.measure import hf_flash

    torch.manual_seed(0)
    d, t, b = 16, sum(lens), len(lens)
    q = torch.randn(t, heads, d, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(t, groups, d, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(t, groups, d, dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    if b == 1:
        def forward():
            return hf_flash.flash_attn_func(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                            causal=True)
        acc = -(-t // 128) * 128
    else:
        def forward():
            return hf_flash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        acc = t + 128 * b
    out, kept, _ = _counted(forward, (q, k, v))
    assert kept == 2 * t * heads * d + 4 * heads * t + 16     # out, lse, rng_state
    grad = torch.randn_like(out)
    grads, _, peak = _counted(lambda: torch.autograd.grad(out, (q, k, v), grad),
                              (q, k, v, out, grad))
    expanded = 2 * (2 * t * heads * d) if groups != heads else 0
    # dq, dk, dv; softmax_d; dq_accum (head dim 16 rounded to 32); expanded dk/dv
    assert peak == (2 * t * heads * d + 4 * t * groups * d + 4 * heads * acc + 4 * acc * heads * 32
                    + expanded)
    # values: causal attention within each sequence, as sdpa computes it
    ref_q, ref_k, ref_v = (x.detach().float().requires_grad_() for x in (q, k, v))
    parts, start = [], 0
    for n in lens:
        sl = slice(start, start + n)
        kk = ref_k[sl].repeat_interleave(heads // groups, 1)
        vv = ref_v[sl].repeat_interleave(heads // groups, 1)
        parts.append(torch.nn.functional.scaled_dot_product_attention(
            ref_q[sl].transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), is_causal=True).transpose(0, 1))
        start += n
    ref = torch.cat(parts)
    assert torch.allclose(out.reshape(ref.shape).float(), ref, atol=2e-2)
    ref.backward(grad.reshape(ref.shape).float())
    for got, want in zip(grads, (ref_q.grad, ref_k.grad, ref_v.grad), strict=True):
        assert torch.allclose(got.float(), want, atol=5e-2)


def test_flash_trace_on_two_gloo_ranks_is_never_above_its_price():
    """transformers' flash_attention_2 path on packed rows (position_ids restarting) and on a
    one-sequence row, PEFT LoRA, checkpointing, FSDP2 over 2 gloo ranks."""
    from waveplan.pricing.measure.fsdp_trace import trace_fsdp

    traces = trace_fsdp(SMALL, jobs=[(96, 64, 32), (160,)], fsdp=2, attn="flash",
                        checkpointing=True, lora_rank=4)
    for trace in traces:
        assert trace.attn == "flash" and len(trace.peaks) == 2 and trace.peak_bytes > 0
        assert any("hf_flash" in n for n in trace.notes)
        assert price_record(trace.to_dict()).raw_bytes >= trace.peak_bytes


def test_flash_refusals(tmp_path, capsys):
    """flash is refused on CUDA without flash-attn, and under the Ulysses/veRL-head tracer."""
    import importlib.util

    from waveplan.pricing.measure.fsdp_trace import trace_fsdp
    from waveplan.pricing.measure.fsdp_verl_trace import trace_fsdp_verl

    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ConfigError, match="flash-attn"):
            trace_fsdp(SMALL, jobs=[(8,)], attn="flash", device="cuda")
    with pytest.raises(ConfigError, match="attn"):
        trace_fsdp_verl(SMALL, jobs=[(8,)], fsdp=2, ulysses=2, attn="flash")
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SMALL))
    step = tmp_path / "step.jsonl"
    step.write_text('{"id": "a", "completion_tokens": 16}\n')
    rc = main(["trace", str(step), "--framework", "fsdp", "--model", str(cfg), "--fsdp", "2",
               "--ulysses", "2", "--attn", "flash", "--lora-rank", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "--attn" in err and len(err.strip().splitlines()) == 1
