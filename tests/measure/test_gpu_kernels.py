"""The te-gpu kernel set on the CPU tracer (pricing/measure/gpu_kernels.py): each allocation
model allocates what its GPU kernel does (counted by the tracker, byte for byte), computes the
same loss and gradients as torch's ops, and `trace_wave(kernels="te-gpu")` runs it."""

from __future__ import annotations

import contextlib
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from waveplan.pricing.errors import ConfigError  # noqa: E402
from waveplan.pricing.geometry import (  # noqa: E402
    AttentionSpec,
    MixerKind,
    MlpActivation,
    MlpKind,
    ModelFeatures,
    ModelGeometry,
    MoeSpec,
)
from waveplan.pricing.measure import gpu_kernels as gk  # noqa: E402
from waveplan.pricing.measure.trace import _tracker_class, trace_wave  # noqa: E402
from waveplan.pricing.measure.uncounted import uncounted  # noqa: E402
from waveplan.pricing.parallel import Recompute  # noqa: E402

BF16 = torch.bfloat16


def _counted(fn, *inputs):
    """(result, bytes live after fn, peak bytes during fn) as the tracer counts them, above
    `inputs` (made before, as a trace's weights and inputs)."""
    tracker = _tracker_class()()
    tracker.ignore(inputs)
    with tracker:
        out = fn()
    return out, tracker.current, tracker.peak


def test_uncounted_storages_are_not_counted():
    _, live, peak = _counted(lambda: torch.empty(1000, dtype=torch.float32))
    assert live == peak == 4000
    tracker = _tracker_class()()
    with tracker, uncounted():
        kept = torch.empty(1000)
    assert tracker.peak == 0 and kept.numel() == 1000


def test_rmsnorm_saves_input_and_fp32_rstd_and_backward_allocates_dx_and_dgamma():
    rows, h = 48, 64
    x = torch.randn(rows, h, dtype=BF16, requires_grad=True)
    w = torch.nn.Parameter(torch.rand(h, dtype=BF16) + 0.5)
    y, live, peak = _counted(lambda: gk.TeRMSNorm.apply(x, w, 1e-6), x, w)
    assert live == peak == rows * h * 2 + rows * 4          # y (bf16) + rstdevs (fp32)
    ref = torch.nn.functional.rms_norm(x, (h,), w, 1e-6)
    assert torch.equal(y, ref)
    g = torch.randn(rows, h, dtype=BF16)
    tracker = _tracker_class()()
    with tracker:
        y.backward(g)
    assert tracker.peak == rows * h * 2 + h * 2     # dx (becomes x.grad) and dgamma
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.nn.functional.rms_norm(xr, (h,), wr, 1e-6).backward(g)
    assert torch.equal(x.grad, xr.grad) and torch.equal(w.grad, wr.grad)


def test_swiglu_holds_its_input_and_one_output_and_backward_one_gradient():
    rows, f = 40, 32
    x = torch.randn(rows, 2 * f, dtype=BF16, requires_grad=True)
    y, live, peak = _counted(lambda: gk.bias_swiglu_impl(x, None), x)
    assert live == peak == rows * f * 2
    a, b = torch.chunk(x, 2, dim=-1)
    assert torch.equal(y, torch.nn.functional.silu(a) * b)
    g = torch.randn(rows, f, dtype=BF16)
    tracker = _tracker_class()()
    with tracker:
        y.backward(g)
    assert tracker.peak == rows * 2 * f * 2     # dx (becomes x.grad)
    xr = x.detach().clone().requires_grad_()
    ar, br = torch.chunk(xr, 2, dim=-1)
    (torch.nn.functional.silu(ar) * br).backward(g)
    assert torch.equal(x.grad, xr.grad)


def test_grouped_linear_holds_one_output_and_one_input_gradient():
    counts, d_in, d_out = (5, 0, 7), 16, 24
    rows = sum(counts)
    x = torch.randn(rows, d_in, dtype=BF16, requires_grad=True)
    ws = tuple(torch.randn(d_out, d_in, dtype=BF16) for _ in counts)
    out, live, peak = _counted(lambda: gk.GroupedLinear.apply(x, ws, counts), x)
    assert live == peak == rows * d_out * 2
    ref = torch.cat([torch.nn.functional.linear(x[a:a + n], w) for a, n, w in
                     zip((0, 5, 5), counts, ws, strict=True)])
    assert torch.equal(out, ref)
    tracker = _tracker_class()()
    tracker.ignore([out])
    with tracker:
        out.backward(torch.ones_like(out))
    assert tracker.peak == rows * d_out * 2 + rows * d_in * 2     # the ones, dx


def test_rope_saves_nothing_new_and_its_gradient_is_the_inverse_rotation():
    from megatron.core.models.common.embeddings import rope_utils

    s, heads, d = 16, 2, 8
    t = torch.randn(s, 1, heads, d, dtype=torch.float32, requires_grad=True)
    freqs = torch.randn(s, 1, 1, d)
    out, live, peak = _counted(lambda: gk._fused_rope_bshd(t, freqs), t, freqs)
    assert live == peak == t.numel() * 4
    ref_in = t.detach().clone().requires_grad_()
    ref = rope_utils._apply_rotary_pos_emb_bshd(ref_in, freqs)
    assert torch.allclose(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    assert torch.allclose(t.grad, ref_in.grad, atol=1e-6)


def test_flash_varlen_allocations_follow_mha_varlen_fwd_and_bwd():
    t, h, g, d, batch = 40, 4, 2, 16, 3

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(h // g, 1).transpose(0, 1),
            v.repeat_interleave(h // g, 1).transpose(0, 1), is_causal=True).transpose(0, 1)

    q = torch.randn(t, h, d, dtype=BF16, requires_grad=True)
    k = torch.randn(t, g, d, dtype=BF16, requires_grad=True)
    v = torch.randn(t, g, d, dtype=BF16, requires_grad=True)
    out, live, peak = _counted(lambda: gk.FlashVarlen.apply(q, k, v, batch, attend), q, k, v)
    assert live == peak == t * h * d * 2 + h * t * 4 + 16      # out, softmax_lse, rng_state
    assert torch.equal(out, attend(q, k, v))
    tracker = _tracker_class()()
    tracker.ignore([out])    # alive since the forward (unpacking a saved output detaches it)
    with tracker:
        out.backward(torch.ones_like(out))
    grads = (t * h * d + 2 * t * g * d) * 2
    work = h * (t + 128 * batch) * 4 + (t + 128 * batch) * h * 32 * 4 + 2 * t * h * d * 2
    ones = t * h * d * 2
    assert tracker.peak == ones + grads + work
    assert gk._round_head(16) == 32 and gk._round_head(128) == 128 and gk._round_head(192) == 192 \
        and gk._round_head(200) == 256


def _tiny(dtype="fp32", moe=False, geglu=False, shared=0):
    mlp = MlpKind.MOE if moe else MlpKind.DENSE
    act = MlpActivation.GEGLU if geglu else MlpActivation.SWIGLU
    return ModelGeometry(name="tiny", hidden=64, ffn=0 if moe else 192, vocab=256,
                         layers=((MixerKind.ATTENTION, mlp),) * 2,
                         attention=AttentionSpec(4, 2, 16), dtype=dtype,
                         moe=MoeSpec(num_experts=4, top_k=2, expert_ffn=48, shared_expert_ffn=shared)
                         if moe else None,
                         features=ModelFeatures(mlp_activation=act))


def _loss_and_grads(kernels: bool, mode: str, moe: bool = False, geglu: bool = False, shared: int = 0):
    from waveplan.pricing.measure import thd
    from waveplan.pricing.measure.megatron_build import build_gpt
    from waveplan.pricing.measure.trace import _balanced_router, _install_balanced_dispatch
    from waveplan.pricing.parallel import ParallelLayout

    lens = [40, 24]
    torch.manual_seed(0)
    model = build_gpt(_tiny(moe=moe, geglu=geglu, shared=shared), device="cpu", lora_rank=4, recompute=Recompute(mode=mode),
                      seq_len=64, dtype=torch.float32)
    if moe:
        _install_balanced_dispatch(model, ParallelLayout())
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    gen = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, 256, (1, 64), generator=gen) for _ in range(2))
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    params, _ = thd.packed_params(torch, lens, "cpu")
    with contextlib.ExitStack() as stack:
        stack.enter_context(thd.rope_patch())
        if moe:
            stack.enter_context(_balanced_router())
        installed = stack.enter_context(gk.te_gpu_kernels(model)) if kernels else []
        loss = model(ids, pos, None, labels=labels, packed_seq_params=params).sum()
        loss.backward()
    return float(loss.detach()), [p.grad for p in model.parameters() if p.requires_grad], installed


@pytest.mark.parametrize("mode,moe,geglu,shared", [("none", False, False, 0), ("full", False, False, 0),
                                                  ("none", True, False, 0), ("none", False, True, 0),
                                                  ("none", True, False, 32)])
def test_te_gpu_kernels_compute_the_same_loss_and_adapter_gradients(mode, moe, geglu, shared):
    from waveplan.pricing.measure.megatron_shim import init_single_process

    with init_single_process(1):
        ref_loss, ref_grads, _ = _loss_and_grads(False, mode, moe, geglu, shared)
        loss, grads, installed = _loss_and_grads(True, mode, moe, geglu, shared)
    mlp = ["fused bias-GeGLU"] if geglu else ["fused bias-SwiGLU"] + (
        ["grouped GEMM experts"] if moe else [])
    assert installed == ["TE RMSNorm", "flash attention (varlen)", "TE fused RoPE"] + mlp
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_the_shared_expert_runs_the_fused_swiglu_under_the_kernel_set():
    """SharedExpertMLP copies the config at build (as SequentialMLP does for an expert width
    other than the dense one): the kernel set switches the fusion on in every copy, and puts
    each back after."""
    from waveplan.pricing.measure.megatron_build import build_gpt
    from waveplan.pricing.measure.megatron_shim import init_single_process

    with init_single_process(1):
        model = build_gpt(_tiny(moe=True, shared=32), device="cpu", lora_rank=4,
                          recompute=Recompute(mode="none"), seq_len=64, dtype=torch.float32)
        shared = [m for m in model.modules() if type(m).__name__ == "SharedExpertMLP"]
        experts = [m for m in model.modules() if type(m).__name__ == "SequentialMLP"]
        assert len(shared) == 2 and len(experts) == 2
        copies = [m.config for m in shared + experts]
        assert all(m.config is not model.config for m in shared)   # each reads its own copy
        assert not any(c.bias_activation_fusion for c in copies + [model.config])
        calls = []

        def fused(*args, **kw):
            calls.append(args[0].shape[-1])
            return gk.bias_swiglu_impl(*args, **kw)

        with gk.te_gpu_kernels(model):
            assert all(c.bias_activation_fusion for c in copies + [model.config])
            mlp_mod = __import__("megatron.core.transformer.mlp", fromlist=["mlp"])
            mlp_mod.bias_swiglu_impl = fused
            x = torch.randn(8, 1, 64)
            shared[0](x)
        assert calls == [2 * 32]   # the shared expert's FC1 output went through the fused SwiGLU
        assert not any(c.bias_activation_fusion for c in copies + [model.config])


def test_trace_wave_runs_the_kernel_set_and_it_holds_less_than_torch_ops():
    g = _tiny("bf16")
    kw = dict(seq_lens=[96, 64], device="cpu-fake", recompute=Recompute(mode="none"))
    cpu = trace_wave(g, **kw)
    te = trace_wave(g, kernels="te-gpu", **kw)
    assert te.kernels == "te-gpu" and te.to_dict()["kernels"] == "te-gpu"
    assert "kernels" not in cpu.to_dict()
    assert any(n.startswith("te-gpu kernel set") for n in te.notes)
    # the fused norms, SwiGLU and RoPE keep no fp32 or elementwise intermediates
    assert te.decoder_peak_bytes < cpu.decoder_peak_bytes


def test_bad_kernel_sets_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match="kernels"):
        trace_wave(_tiny(), seq_lens=[8], kernels="cudnn")
    with pytest.raises(ConfigError, match="kernels"):
        trace_wave(_tiny(), seq_lens=[8], kernels="te-gpu", device="cuda")
    with pytest.raises(ConfigError, match="kernels"):
        gk.check_kernels("fa3")


def test_cli_trace_kernels_flag(tmp_path, capsys):
    from waveplan.planner.cli import main

    step = tmp_path / "step.jsonl"
    step.write_text('{"id": "a", "completion_tokens": 100}\n')
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": 512, "torch_dtype": "bfloat16"}))
    assert main(["trace", str(step), "--model", str(config), "--kernels", "te-gpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kernels"] == "te-gpu"
    assert main(["trace", str(step), "--model", str(config), "--kernels", "te-gpu",
                 "--pp", "2"]) == 2
    assert "--kernels=te-gpu" in capsys.readouterr().err


def _gdn_loss_and_grads(kernels: bool):
    from waveplan.pricing.geometry import GdnSpec
    from waveplan.pricing.measure.megatron_build import build_gpt

    g = ModelGeometry(name="tiny-gdn", hidden=64, ffn=192, vocab=256,
                      layers=((MixerKind.GDN, MlpKind.DENSE), (MixerKind.ATTENTION, MlpKind.DENSE)),
                      attention=AttentionSpec(4, 2, 16),
                      gdn=GdnSpec(num_key_heads=2, num_value_heads=4, key_head_dim=16,
                                  value_head_dim=16, conv_kernel=4), dtype="fp32")
    torch.manual_seed(0)
    model = build_gpt(g, device="cpu", lora_rank=4, recompute=Recompute(mode="none"),
                      seq_len=160, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    gen = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, 256, (1, 150), generator=gen) for _ in range(2))
    pos = torch.arange(150).unsqueeze(0)
    with contextlib.ExitStack() as stack:
        installed = stack.enter_context(gk.te_gpu_kernels(model)) if kernels else []
        loss = model(ids, pos, None, labels=labels).sum()
        loss.backward()
    return float(loss.detach()), [p.grad for p in model.parameters() if p.requires_grad], installed


def test_fla_models_compute_the_gdn_layer_as_the_torch_kernel():
    from waveplan.pricing.measure.megatron_shim import init_single_process

    with init_single_process(1):
        ref_loss, ref_grads, _ = _gdn_loss_and_grads(False)
        loss, grads, installed = _gdn_loss_and_grads(True)
    assert installed[0] == "FLA gated delta rule and L2 norm"
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-4)


def test_fla_chunk_rule_holds_its_saved_tensors_and_frees_the_chunk_states():
    t, h, kd, vd = 130, 2, 16, 8
    q, k = (torch.randn(1, t, h, kd, dtype=BF16, requires_grad=True) for _ in range(2))
    v = torch.randn(1, t, h, vd, dtype=BF16, requires_grad=True)
    g = (-torch.rand(1, t, h)).requires_grad_()
    beta = torch.rand(1, t, h, dtype=BF16, requires_grad=True)
    nt = 3
    out, live, peak = _counted(lambda: gk.fla_chunk_gated_delta_rule(q, k, v, g, beta)[0],
                               q, k, v, g, beta)
    kept = t * h * 4 + t * h * 64 * 2 + t * h * vd * 2          # gate cumsum, A, o
    assert live == kept
    solve = t * h * 4 + t * h * 64 * 4 + t * h * 64 * 2           # cumsum, A fp32, A
    states = kept + (t * h * kd + 2 * t * h * vd + nt * h * kd * vd) * 2   # w, u, v_new, h
    assert peak == max(solve, states)
    assert out.shape == (1, t, h, vd)
