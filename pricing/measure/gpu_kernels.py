"""The "te-gpu" kernel set on the CPU: allocation models of the fused GPU kernels.

On a GPU, Megatron-core with Transformer Engine (TE) and flash-attn runs fused kernels where
the CPU tracer runs plain torch ops: TE's RMSNorm, the fused bias-SwiGLU/GeGLU, TE's fused
RoPE, flash attention, TE's grouped GEMM of the experts, FLA's gated delta rule. Each kernel here is an autograd function that allocates what the GPU kernel
allocates (its outputs, what its forward saves for the backward, its backward's gradients and
workspaces, as `torch.empty` on the traced device, so `trace.StorageTracker` counts them) and
computes its values with plain torch ops inside `uncounted.uncounted()` (standing for the kernel's
registers and shared memory, which no allocator sees; `uncounted.uncounted`). The values are exact (the tests compare
losses and gradients with the torch-cpu kernels); only what is counted differs.

`te_gpu_kernels(model)` installs them on a model `megatron_build.build_gpt` built (a context
manager; `trace.trace_wave(kernels="te-gpu")` and `multirank` use it). What each model
allocates, with the GPU source it follows: docs/memory-model.md#gpu-kernel-allocation-models.
Everything else (linears, LoRA adapters, the native cross entropy, SP gathers, MoE dispatch,
the RoPE cache) stays the same PyTorch code on both.

Imports torch and megatron-core: only tracer processes load it.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F

from ..errors import ConfigError, bad
from .uncounted import uncounted

KERNEL_SETS = ("torch-cpu", "te-gpu")


def check_kernels(kernels: str) -> str:
    """`kernels` if it names a kernel set; a ConfigError naming the field otherwise."""
    if kernels not in KERNEL_SETS:
        raise bad(ConfigError, "kernels", kernels, f"must be one of {', '.join(KERNEL_SETS)}")
    return kernels


def _vjp(fn, inputs, needs, grad_out):
    """Gradients of `fn(*inputs)` for the inputs flagged in `needs`, uncounted."""
    with uncounted(), torch.enable_grad():
        leaves = [x.detach().requires_grad_(bool(n)) if isinstance(x, torch.Tensor) else x
                  for x, n in zip(inputs, needs, strict=True)]
        out = fn(*leaves)
        wanted = [x for x, n in zip(leaves, needs, strict=True) if n]
        grads = torch.autograd.grad(out, wanted, grad_out, allow_unused=True)
    it = iter(grads)
    return [next(it) if n else None for n in needs]


# --- TE RMSNorm --------------------------------------------------------------------------


class TeRMSNorm(torch.autograd.Function):
    """TE's RMSNorm (ops/basic/rmsnorm.py `RMSNorm.op_forward/op_backward`): y (x's dtype) and
    rstdevs (fp32 [rows]) out, (x, rstdevs) saved; backward: dx (x's shape) and dgamma
    (gamma's shape, computed even for a frozen gamma)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        h = x.shape[-1]
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(x.numel() // h, dtype=torch.float32, device=x.device)
        with uncounted():
            y.copy_(F.rms_norm(x, (h,), weight, eps))
        ctx.save_for_backward(x, rstd)
        ctx.weight, ctx.eps = weight, eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, _rstd = ctx.saved_tensors
        w = ctx.weight
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dw = torch.empty(w.shape, dtype=w.dtype, device=w.device)
        gx, gw = _vjp(lambda a, b: F.rms_norm(a, (a.shape[-1],), b, ctx.eps), (x, w),
                      (True, w.requires_grad), dy)
        with uncounted():
            dx.copy_(gx)
            if gw is not None:
                dw.copy_(gw)
        return dx, (dw if w.requires_grad else None), None


def _te_rmsnorm_forward(self, x):
    """TorchRMSNorm.forward through `TeRMSNorm` (a TE RMSNorm's input is made contiguous)."""
    if not x.is_contiguous():
        x = x.contiguous()
    eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
    return TeRMSNorm.apply(x, self.weight, eps)


# --- fused bias-SwiGLU ---------------------------------------------------------------------


def _glu(y, bias, gelu=False):
    if bias is not None:
        y = y + bias
    a, b = torch.chunk(y, 2, dim=-1)
    return (F.gelu(a, approximate="tanh") if gelu else F.silu(a)) * b


def _swiglu(y, bias):
    return _glu(y, bias)


class FusedGLU(torch.autograd.Function):
    """Megatron's fused (bias-)SwiGLU and GeGLU (fusions/fused_bias_swiglu.py
    `SwiGLUFunction`, `BiasSwiGLUFunction`; fused_bias_geglu.py `GeGLUFunction`,
    `BiasGeGLUFunction`; jit-fused on a GPU): out [rows, F] (input dtype), the input
    [rows, 2F] saved; backward: one [rows, 2F] gradient."""

    @staticmethod
    def forward(ctx, x, bias, gelu):
        out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
        with uncounted():
            out.copy_(_glu(x, bias, gelu))
        ctx.save_for_backward(x)
        ctx.bias, ctx.gelu = bias, gelu
        return out

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        bias = ctx.bias
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        needs_b = bias is not None and bias.requires_grad
        gx, gb = _vjp(lambda a, b: _glu(a, b, ctx.gelu), (x, bias), (True, needs_b), g)
        with uncounted():
            dx.copy_(gx)
        return dx, (gb.to(bias.dtype) if needs_b else None), None


def _glu_impl(input, bias, gelu):
    shape = input.shape
    if len(shape) not in (2, 3):
        raise bad(ConfigError, "glu input", list(shape), "must be 2-D or 3-D")
    out = FusedGLU.apply(input.view(-1, shape[-1]), bias, gelu)
    return out if len(shape) == 2 else out.view(shape[0], shape[1], -1)


def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
    """Megatron's `bias_swiglu_impl` call through `FusedGLU` (2-D or 3-D input)."""
    return _glu_impl(input, bias, False)


def bias_geglu_impl(input, bias):
    """Megatron's `bias_geglu_impl` (tanh GELU) call through `FusedGLU`."""
    return _glu_impl(input, bias, True)


def _weighted_swiglu(y, w):
    return (_swiglu(y, None) * w).to(y.dtype)


class WeightedSwiGLU(torch.autograd.Function):
    """Megatron's fused weighted SwiGLU of the experts (fused_bias_swiglu.py
    `WeightedSwiGLUFunction`): out [rows, F] (input dtype), the input and the router
    probabilities [rows, 1] saved; backward: the input's gradient [rows, 2F] and the
    probabilities' [rows, 1]."""

    @staticmethod
    def forward(ctx, x, w):
        out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
        with uncounted():
            out.copy_(_weighted_swiglu(x, w))
        ctx.save_for_backward(x, w)
        return out

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dw = torch.empty(w.shape, dtype=w.dtype, device=w.device)
        gx, gw = _vjp(_weighted_swiglu, (x, w), (True, True), g)
        with uncounted():
            dx.copy_(gx)
            dw.copy_(gw)
        return dx, dw


def weighted_bias_swiglu_impl(input, bias, weights, fp8_input_store=False):
    """Megatron's `weighted_bias_swiglu_impl` call through `WeightedSwiGLU` (no bias)."""
    if bias is not None:
        raise bad(ConfigError, "bias", "set", "the weighted SwiGLU fusion takes no bias")
    shape = input.shape
    out = WeightedSwiGLU.apply(input.view(-1, shape[-1]), weights)
    return out if len(shape) == 2 else out.view(shape[0], shape[1], -1)


# --- grouped GEMM of the MoE experts ------------------------------------------------------


class GroupedLinear(torch.autograd.Function):
    """TE's grouped linear of the experts (module/grouped_linear.py `_GroupedLinear`, as
    Megatron's `TEGroupedMLP` calls it) in bf16 with frozen weights: one output [rows, out]
    for every expert's rows, the input saved (its per-expert splits are views); backward: one
    input gradient [rows, in], no weight gradient."""

    @staticmethod
    def forward(ctx, x, weights, counts):
        out = torch.empty((x.shape[0], weights[0].shape[0]), dtype=x.dtype, device=x.device)
        with uncounted():
            at = 0
            for w, n in zip(weights, counts, strict=True):
                if n:
                    out[at:at + n].copy_(F.linear(x[at:at + n], w))
                at += n
        ctx.save_for_backward(x)
        ctx.weights, ctx.counts = weights, counts
        return out

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        with uncounted():
            at = 0
            for w, n in zip(ctx.weights, ctx.counts, strict=True):
                if n:
                    dx[at:at + n].copy_(g[at:at + n] @ w)
                at += n
        return dx, None, None


def _grouped_mlp_forward(self, hidden, tokens_per_expert, probs):
    """`SequentialMLP.forward` as `TEGroupedMLP.forward` allocates it (experts/experts.py):
    grouped FC1, the fused weighted SwiGLU (the router probabilities applied), grouped FC2."""
    counts = tuple(int(n) for n in tokens_per_expert.tolist())
    fc1 = GroupedLinear.apply(hidden, tuple(e.linear_fc1.weight for e in self.local_experts), counts)
    act = WeightedSwiGLU.apply(fc1, probs.unsqueeze(-1))
    out = GroupedLinear.apply(act, tuple(e.linear_fc2.weight for e in self.local_experts), counts)
    return out, None


# --- FLA's chunked gated delta rule and L2 norm (GDN layers) --------------------------------


def _empty(shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


def _chunk_cumsum(g, reverse=False):
    """FLA's `chunk_local_cumsum` of a [1, T, H] gate over chunks of 64 rows (uncounted)."""
    t = g.shape[1]
    pad = -t % 64
    x = F.pad(g.float(), (0, 0, 0, pad)).view(1, -1, 64, g.shape[-1])
    if reverse:
        x = x.flip(2)
    x = x.cumsum(2)
    if reverse:
        x = x.flip(2)
    return x.reshape(1, -1, g.shape[-1])[:, :t]


def _chunk_uncumsum(c):
    """The gate back from its chunk-local cumsum (the difference within each chunk)."""
    t = c.shape[1]
    pad = -t % 64
    x = F.pad(c, (0, 0, 0, pad)).view(1, -1, 64, c.shape[-1])
    x = torch.cat([x[:, :, :1], x[:, :, 1:] - x[:, :, :-1]], dim=2)
    return x.reshape(1, -1, c.shape[-1])[:, :t]


class FlaChunkGatedDeltaRule(torch.autograd.Function):
    """flash-linear-attention's chunked gated delta rule (fla/ops/gated_delta_rule/chunk.py
    `ChunkGatedDeltaRuleFunction`, `chunk_gated_delta_rule_fwd` / `_bwd`; chunk 64) on one
    row of T tokens, H heads, key width K, value width V (NT = ceil(T / 64) chunks). Forward:
    the chunk-local gate cumsum fp32 [T, H] and the WY matrix A (fp32 [T, H, 64], solved into
    q's dtype), then w [T, H, K], u [T, H, V], the chunk states h [NT, H, K, V], v_new and the
    output o [T, H, V]; kept: q, k, v, the cumsum, beta and A (w, u, h, v_new freed at return).
    Backward: w, u, h and v_new recomputed, dv, dh [NT, H, K, V], dv2, dq, dk, dw, dg (fp32,
    summed over the ceil(K / 128) key blocks of a Hopper tiling), then `prepare_wy_repr_bwd`'s
    dk2, dv, dbeta and dg2, and the reversed cumsum of dg. `rule(q, k, v, g, beta)` gives the
    values (Megatron's torch kernel)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, rule):
        _, t, h, kd = k.shape
        vd, dev, dt = v.shape[-1], q.device, q.dtype
        nt = -(-t // 64)
        g_c = _empty(g.shape, torch.float32, dev)
        with uncounted():
            g_c.copy_(_chunk_cumsum(g))
        a32 = _empty((1, t, h, 64), torch.float32, dev)
        a = _empty((1, t, h, 64), dt, dev)
        del a32
        w, u = _empty((1, t, h, kd), dt, dev), _empty((1, t, h, vd), v.dtype, dev)
        hs, v_new = _empty((1, nt, h, kd, vd), dt, dev), _empty((1, t, h, vd), v.dtype, dev)
        o = _empty((1, t, h, vd), v.dtype, dev)
        with uncounted():
            o.copy_(rule(q, k, v, g, beta))
        del w, u, hs, v_new
        ctx.save_for_backward(q, k, v, g_c, beta, a)
        ctx.rule, ctx.g_dtype, ctx.g_grad = rule, g.dtype, g.requires_grad
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, g_c, beta, _a = ctx.saved_tensors
        with uncounted():
            g = _chunk_uncumsum(g_c).to(ctx.g_dtype)
        _, t, h, kd = k.shape
        vd, dev, dt = v.shape[-1], q.device, q.dtype
        nt, nk = -(-t // 64), -(-kd // 128)
        w, u = _empty((1, t, h, kd), dt, dev), _empty((1, t, h, vd), v.dtype, dev)
        hs, v_new = _empty((1, nt, h, kd, vd), dt, dev), _empty((1, t, h, vd), v.dtype, dev)
        dv = _empty(do.shape, do.dtype, dev)
        dh, dv2 = _empty((1, nt, h, kd, vd), dt, dev), _empty(do.shape, do.dtype, dev)
        del dv
        dq, dk = _empty(q.shape, dt, dev), _empty(k.shape, dt, dev)
        dg_nk, dw = _empty((nk,) + tuple(g.shape), torch.float32, dev), _empty(w.shape, dt, dev)
        dg = _empty(g.shape, torch.float32, dev)
        del dg_nk
        dk2, dv3 = _empty(k.shape, dt, dev), _empty(v.shape, v.dtype, dev)
        db, dg2 = _empty(beta.shape, beta.dtype, dev), _empty(g.shape, torch.float32, dev)
        del dv2
        dg_rev = _empty(g.shape, torch.float32, dev)
        grads = _vjp(ctx.rule, (q, k, v, g, beta), (True, True, True, ctx.g_grad,
                                                    beta.requires_grad), do)
        with uncounted():
            dq.copy_(grads[0])
            dk.copy_(grads[1])
            dv3.copy_(grads[2])
            if grads[3] is not None:
                dg_rev.copy_(grads[3])
            if grads[4] is not None:
                db.copy_(grads[4])
        del w, u, hs, v_new, dh, dw, dk2, dg2, dg, g
        return (dq, dk, dv3, dg_rev if ctx.g_grad else None,
                db if beta.requires_grad else None, None)


def fla_chunk_gated_delta_rule(query, key, value, g, beta, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """Megatron's call of FLA's `chunk_gated_delta_rule` (no initial or final state, no
    in-kernel L2 norm) through `FlaChunkGatedDeltaRule`; the values are Megatron's torch
    kernel's."""
    from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

    if initial_state is not None or output_final_state or use_qk_l2norm_in_kernel:
        raise bad(ConfigError, "chunk_gated_delta_rule", "state or in-kernel norm",
                  "the FLA allocation model runs without them, as Megatron's GatedDeltaNet calls it")
    if query.shape[0] != 1:
        raise bad(ConfigError, "GDN input", list(query.shape), "the FLA model takes one row (b = 1)")

    def rule(q, k, v, gg, b):
        return torch_chunk_gated_delta_rule(q, k, v, g=gg, beta=b)[0].to(q.dtype)

    return FlaChunkGatedDeltaRule.apply(query, key, value, g, beta, rule), None


class FlaL2Norm(torch.autograd.Function):
    """FLA's L2 norm (fla/modules/l2norm.py `L2NormFunction`): y (x's shape and dtype) and
    rstd fp32 [rows] out, (y, rstd) saved (not x); backward: dx = rstd (dy - y <dy, y>)."""

    @staticmethod
    def forward(ctx, x):
        y = _empty(x.shape, x.dtype, x.device)
        rstd = _empty(x.shape[:-1], torch.float32, x.device)
        with uncounted():
            xf = x.float()
            rstd.copy_(torch.rsqrt((xf * xf).sum(-1) + 1e-6))
            y.copy_(xf * rstd.unsqueeze(-1))
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, rstd = ctx.saved_tensors
        dx = _empty(y.shape, y.dtype, y.device)
        with uncounted():
            yf, dyf = y.float(), dy.float()
            dx.copy_((dyf - yf * (dyf * yf).sum(-1, keepdim=True)) * rstd.unsqueeze(-1))
        return dx


def fla_l2norm(x, *args, **kwargs):
    """`fla.modules.l2norm.l2norm` through `FlaL2Norm`."""
    return FlaL2Norm.apply(x)


# --- TE fused RoPE -------------------------------------------------------------------------


class FusedRoPE(torch.autograd.Function):
    """TE's fused RoPE (attention/rope.py `FusedRoPEFunc`): the output (t's shape and dtype)
    out, only `freqs` (the RoPE cache, already alive) saved; backward: one gradient of t's
    shape. `rotate(t)` is the unfused rotation giving the values (linear in t)."""

    @staticmethod
    def forward(ctx, t, freqs, rotate):
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        with uncounted():
            out.copy_(rotate(t))
        ctx.save_for_backward(freqs)
        ctx.rotate, ctx.shape, ctx.dtype = rotate, t.shape, t.dtype
        return out

    @staticmethod
    def backward(ctx, g):
        dt = torch.empty(ctx.shape, dtype=ctx.dtype, device=g.device)
        with uncounted():
            zeros = torch.zeros(ctx.shape, dtype=ctx.dtype, device=g.device)
        (gt,) = _vjp(ctx.rotate, (zeros,), (True,), g)
        with uncounted():
            dt.copy_(gt)
            del zeros
        return dt, None, None


def _fused_rope_bshd(t, freqs, interleaved=False, **kwargs):
    from megatron.core.models.common.embeddings import rope_utils

    def rotate(x):
        return rope_utils._apply_rotary_pos_emb_bshd(x, freqs, rotary_interleaved=interleaved)

    return FusedRoPE.apply(t, freqs, rotate)


def _fused_rope_thd(t, cu_seqlens, freqs, cp_size=1, cp_rank=0, **kwargs):
    from megatron.core.models.common.embeddings import rope_utils

    def rotate(x):
        return rope_utils._apply_rotary_pos_emb_thd(x, cu_seqlens, freqs)

    return FusedRoPE.apply(t, freqs, rotate)


# --- flash attention (THD, varlen) -----------------------------------------------------------


def _round_head(d: int) -> int:
    """flash-attn's head_size_rounded (`fsdp.terms.flash_head_rounded`, which prices it)."""
    from ..fsdp.terms import flash_head_rounded

    return flash_head_rounded(d)


class FlashVarlen(torch.autograd.Function):
    """flash-attn 2's attention (flash_attn_interface.py `FlashAttnVarlenFunc` / `FlashAttnFunc`,
    csrc/flash_attn/flash_api.cpp `mha_varlen_fwd` / `mha_varlen_bwd`, `mha_fwd` / `mha_bwd`),
    as TE's FlashAttention backend calls it on THD and transformers' flash_attention_2 on packed
    rows (`pricing/measure/hf_flash.py`). q [..., h, d] (varlen [t, h, d]; dense [b, s, h, d]).
    Forward: out (q's shape, value width dv), softmax_lse fp32 [h, t] (dense [b, h, s]),
    rng_state int64 [2]; saved q, k, v, out, lse, rng_state. Backward: dq, dk, dv
    (`empty_like`), softmax_d fp32 [h, acc] and dq_accum fp32 [acc, h, round32(d)] with
    `acc` = t + 128 b (varlen) or b x round128(s) (dense: `acc_rows`), and under GQA dk/dv
    expanded to all heads before the group sum. `attend(q, k, v)` gives the values."""

    @staticmethod
    def forward(ctx, q, k, v, batch, attend, acc_rows=None):
        h = q.shape[-2]
        t = q.numel() // (h * q.shape[-1])
        dv = v.shape[-1]
        out = torch.empty(q.shape[:-1] + (dv,), dtype=q.dtype, device=q.device)
        lse = torch.empty((h, t), dtype=torch.float32, device=q.device)
        rng = torch.empty(2, dtype=torch.int64, device=q.device)
        with uncounted():
            out.copy_(attend(q, k, v))
        ctx.save_for_backward(q, k, v, out, lse, rng)
        ctx.batch, ctx.attend = batch, attend
        ctx.acc = t + 128 * batch if acc_rows is None else int(acc_rows)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, _out, _lse, _rng = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        h, d = q.shape[-2], q.shape[-1]
        g = k.shape[-2]
        tk = k.numel() // (g * d)
        acc = ctx.acc
        dq, dk, dvv = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
        work = [torch.empty((h, acc), dtype=torch.float32, device=q.device),
                torch.empty((acc, h, _round_head(d)), dtype=torch.float32, device=q.device)]
        if g != h:
            work += [torch.empty((tk, h, d), dtype=q.dtype, device=q.device),
                     torch.empty((tk, h, v.shape[-1]), dtype=q.dtype, device=q.device)]
        gq, gk, gv = _vjp(ctx.attend, (q, k, v), (True, True, True), dout)
        with uncounted():
            dq.copy_(gq)
            dk.copy_(gk)
            dvv.copy_(gv)
        del work
        return dq, dk, dvv, None, None, None


def _flash_class():
    from .megatron_build import sdpa_attention_class
    from .thd import bounds_of

    sdpa = sdpa_attention_class()

    class FlashAttention(sdpa):
        """Core attention through `FlashVarlen` (THD, or a [s, 1, h, d] row as one sequence);
        its values are the SDPA stand-in's (`SdpaAttention`)."""

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            base = super().forward
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                cu = packed_seq_params.cu_seqlens_q_padded
                if cu is None:
                    cu = packed_seq_params.cu_seqlens_q
                batch = len(bounds_of(cu)) - 1

                def attend(q, k, v):
                    out = base(q, k, v, packed_seq_params=packed_seq_params)
                    return out.view(q.shape[0], q.shape[1], -1)

                out = FlashVarlen.apply(query, key, value, batch, attend)
                return out.reshape(out.shape[0], -1)
            if query.dim() != 4 or query.shape[1] != 1:
                raise bad(ConfigError, "attention input", list(query.shape),
                          "the te-gpu flash stand-in takes THD or one [s, 1, h, d] row")

            def attend_row(q, k, v):
                out = base(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1))
                return out.view(q.shape[0], q.shape[1], -1)

            out = FlashVarlen.apply(query[:, 0], key[:, 0], value[:, 0], 1, attend_row)
            return out.reshape(out.shape[0], 1, -1)

    return FlashAttention


# --- installing the set --------------------------------------------------------------------


@contextlib.contextmanager
def te_gpu_kernels(model):
    """Run `model` (from `build_gpt`) with the te-gpu allocation models: TE RMSNorm on every
    `TorchRMSNorm`, flash attention in place of the SDPA stand-in and as the CP ring's step
    kernel (`ring_attention.RingAttention.flash`), fused RoPE (not under multi-latent attention, whose fused RoPE is a Triton
    kernel not modelled here), the fused bias-SwiGLU (SiLU-gated MLPs) and, with it, the
    experts' grouped GEMM in place of the `SequentialMLP` loop (experts without biases), or
    the fused bias-GeGLU (tanh-GELU-gated MLPs without experts); the clamped SwiGLU keeps
    torch's ops; FLA's gated delta rule and L2 norm in GDN layers. Yields the list of what was installed (for the trace's note)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.ssm import gated_delta_net as gdn_mod
    from megatron.core.transformer import mlp as mlp_mod
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from .megatron_build import TorchRMSNorm, gelu_tanh, sdpa_attention_class

    config = model.config
    installed, grouped, gelu_mlps = [], [], []
    gdn_saved = (getattr(gdn_mod, "chunk_gated_delta_rule", None), getattr(gdn_mod, "l2norm", None))
    if any(type(m).__name__ == "GatedDeltaNet" for m in model.modules()):
        gdn_mod.chunk_gated_delta_rule = fla_chunk_gated_delta_rule
        gdn_mod.l2norm = fla_l2norm
        installed.append("FLA gated delta rule and L2 norm")
    norms = [m for m in model.modules() if isinstance(m, TorchRMSNorm)]
    for m in norms:
        m.forward = types.MethodType(_te_rmsnorm_forward, m)
    if norms:
        installed.append("TE RMSNorm")
    sdpa, flash = sdpa_attention_class(), _flash_class()
    swapped = []
    for m in model.modules():
        core = getattr(m, "core_attention", None)
        if type(core) is sdpa:
            core.__class__ = flash   # same module, parameters (attention sinks) and config
            swapped.append(core)
    if swapped:
        installed.append("flash attention (varlen)")
    # the CP ring (`ring_attention.RingAttention`, TE's P2P ring): its steps' kernels flash-attn's
    rings = [m.core_attention for m in model.modules()
             if type(getattr(m, "core_attention", None)).__name__ == "RingAttention"]
    for core in rings:
        core.flash = True
    if rings:
        installed.append("flash attention in the CP ring's steps")
    # modules that copied the config at build (`SharedExpertMLP`, a `SequentialMLP` whose expert
    # width differs from the dense one, a TP core attention's GQA copy) read their own copy: the
    # fusion flags go on every copy, as a GPU run configured with them at build has them
    configs = list({id(c): c for c in [config] + [getattr(m, "config", None) for m in model.modules()]
                    if isinstance(c, TransformerConfig)}.values())
    flags = [(c.apply_rope_fusion, c.bias_activation_fusion, c.activation_func) for c in configs]

    def set_all(name, value):
        for c in configs:
            setattr(c, name, value)

    saved = (rope_utils.fused_apply_rotary_pos_emb, rope_utils.fused_apply_rotary_pos_emb_thd,
             mlp_mod.bias_swiglu_impl, mlp_mod.weighted_bias_swiglu_impl, mlp_mod.bias_geglu_impl)
    if not getattr(config, "multi_latent_attention", False):
        set_all("apply_rope_fusion", True)
        rope_utils.fused_apply_rotary_pos_emb = _fused_rope_bshd
        rope_utils.fused_apply_rotary_pos_emb_thd = _fused_rope_thd
        installed.append("TE fused RoPE")
    if config.gated_linear_unit and config.activation_func is F.silu \
            and getattr(config, "activation_func_clamp_value", None) is None:
        set_all("bias_activation_fusion", True)
        mlp_mod.bias_swiglu_impl = bias_swiglu_impl
        mlp_mod.weighted_bias_swiglu_impl = weighted_bias_swiglu_impl
        installed.append("fused bias-SwiGLU")
        if not config.add_bias_linear:
            for m in model.modules():
                if isinstance(m, SequentialMLP) and len(m.local_experts) > 1:
                    m.forward = types.MethodType(_grouped_mlp_forward, m)
                    grouped.append(m)
            if grouped:
                installed.append("grouped GEMM experts")
    elif config.gated_linear_unit and config.activation_func is gelu_tanh \
            and not any(isinstance(m, SequentialMLP) for m in model.modules()):
        # Megatron's fused GeGLU branch is taken for F.gelu; its kernel is the tanh GELU
        set_all("activation_func", F.gelu)
        for m in model.modules():
            if isinstance(m, mlp_mod.MLP) and m.activation_func is gelu_tanh:
                m.activation_func = F.gelu
                gelu_mlps.append(m)
        set_all("bias_activation_fusion", True)
        mlp_mod.bias_geglu_impl = bias_geglu_impl
        installed.append("fused bias-GeGLU")
    try:
        yield installed
    finally:
        (rope_utils.fused_apply_rotary_pos_emb, rope_utils.fused_apply_rotary_pos_emb_thd,
         mlp_mod.bias_swiglu_impl, mlp_mod.weighted_bias_swiglu_impl, mlp_mod.bias_geglu_impl) = saved
        for c, (rope, fusion, act) in zip(configs, flags, strict=True):
            c.apply_rope_fusion, c.bias_activation_fusion, c.activation_func = rope, fusion, act
        for core in swapped:
            core.__class__ = sdpa
        for core in rings:
            del core.flash
        for m in norms + grouped:
            del m.forward
        for m in gelu_mlps:
            m.activation_func = gelu_tanh
        gdn_mod.chunk_gated_delta_rule, gdn_mod.l2norm = gdn_saved


def kernels_note(installed) -> str:
    """The trace note of the te-gpu kernel set."""
    return ("te-gpu kernel set: allocation models of " + ", ".join(installed)
            + " (pricing/measure/gpu_kernels.py; values computed uncounted)")
