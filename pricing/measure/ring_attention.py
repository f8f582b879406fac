"""Context parallelism on the CPU: Megatron's load-balanced THD split (`cp_split`) and a ring
attention that allocates as Transformer Engine's `AttnFuncWithCPAndKVP2P` does (`RingAttention`).
Each step's kernel is the CPU flash kernel, called once per sequence; with `flash` (the te-gpu
kernel set) it is flash-attn's varlen kernel as TE's ring calls it on a GPU, once per step over
all the rank's rows: the CPU kernel's own tensors uncounted, flash-attn's backward workspace
allocated (`flash_workspace`). See docs/measurement.md#ring-attention and
docs/memory-model.md#gpu-kernel-allocation-models.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigError, bad
from .uncounted import uncounted

BLOCK_ROWS = 256


@dataclass(frozen=True)
class CpSplit:
    """The rows one CP rank holds of a packed wave.

    `global_index`: the global (padded) row of each local row, in local order; `segments`:
    (start, end, position offset) of each local chunk, two per sequence; `local_lens`: 2c per
    sequence; `bounds`: the global cu_seqlens (padded)."""

    global_index: tuple[int, ...]
    segments: tuple[tuple[int, int, int], ...]
    local_lens: tuple[int, ...]
    bounds: tuple[int, ...]


def cp_split(padded_lens, cp: int, cp_rank: int) -> CpSplit:
    """The load-balanced split of sequences of `padded_lens` rows (each a multiple of 2 x cp)
    for rank `cp_rank`: chunks r and 2cp-1-r of every sequence. O(rows)."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise bad(ConfigError, "cp", cp, "must be a positive integer")
    if not 0 <= cp_rank < cp:
        raise bad(ConfigError, "cp_rank", cp_rank, f"must be in [0, {cp})")
    index: list[int] = []
    segments: list[tuple[int, int, int]] = []
    bounds = [0]
    local = 0
    for n in padded_lens:
        if n % (2 * cp):
            raise bad(ConfigError, "seq_lens", n, f"must be padded to a multiple of 2 x CP = {2 * cp}")
        c = n // (2 * cp)
        start = bounds[-1]
        for chunk in (cp_rank, 2 * cp - 1 - cp_rank):
            index.extend(range(start + chunk * c, start + (chunk + 1) * c))
            segments.append((local, local + c, chunk * c))
            local += c
        bounds.append(start + n)
    return CpSplit(tuple(index), tuple(segments), tuple(2 * (n // (2 * cp)) for n in padded_lens),
                   tuple(bounds))


# --- the kernel's pieces -------------------------------------------------------------------

_FWD = None
_BWD = None


def _ops():
    global _FWD, _BWD
    if _FWD is None:
        _FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        _BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    return _FWD, _BWD


def _bhsd(x):
    """[s, h, d] -> [1, h, s, d] (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def _halves(x, seqs, which: int):
    """The first (0) or second (1) half of each local sequence of `x`, packed (a copy, as
    Transformer Engine's `thd_read_half_tensor`). `seqs`: (start, c) per sequence."""
    parts = [x[a + which * c:a + (which + 1) * c] for a, c in seqs]
    return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0].clone()


def _half_rows(seqs):
    """(start, c) of each sequence in a packed half tensor (`_halves`)."""
    out, at = [], 0
    for _, c in seqs:
        out.append((at, c))
        at += c
    return out


def _lse_cols(lse, seqs, which: int):
    """The first/second-half columns of an [h, t] log-sum-exp, packed (a copy)."""
    parts = [lse[:, a + which * c:a + (which + 1) * c] for a, c in seqs]
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].clone()


def _lse_dtype(q):
    """The kernel's log-sum-exp dtype: fp32 for 16-bit inputs, else the inputs' own."""
    return torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype


def _kernel(flash: bool):
    """Where a step's kernel runs: counted (the CPU flash kernel's own tensors) or, as flash-attn
    on a GPU (`flash`), uncounted (its registers and shared memory)."""
    return uncounted() if flash else contextlib.nullcontext()


def flash_workspace(rows_q: int, rows_k: int, batch: int, q, k):
    """What flash-attn's varlen backward allocates beside dq, dk and dv (csrc/flash_attn/
    flash_api.cpp `mha_varlen_bwd`): softmax_d fp32 [h, rows_q + 128 b], dq_accum fp32
    [rows_q + 128 b, h, round32(d)] and, under GQA, dk and dv expanded to every head
    [rows_k, h, d] (q's dtype). O(1) tensors."""
    from ..fsdp.terms import FLASH_ROW_PAD, flash_head_rounded

    h, d = q.shape[1], q.shape[2]
    acc = rows_q + FLASH_ROW_PAD * batch
    work = [torch.empty((h, acc), dtype=torch.float32, device=q.device),
            torch.empty((acc, h, flash_head_rounded(d)), dtype=torch.float32, device=q.device)]
    if k.shape[1] != h:
        work += [torch.empty((rows_k, h, d), dtype=q.dtype, device=q.device) for _ in range(2)]
    return work


def _step_forward(kind: str, q, k, v, seqs, scale, flash: bool = False):
    """One ring step's partial attention: ("causal" | "kv_half" | "q_half"). Returns the
    packed partial output [rows, h, d] (q's dtype) and log-sum-exp [h, rows] (fp32)."""
    fwd, _ = _ops()
    h = q.shape[1]
    if kind == "q_half":
        qh = _halves(q, seqs, 1)
        rows, qseq, kseq = qh.shape[0], _half_rows(seqs), [(a, 2 * c) for a, c in seqs]
        src = qh
    elif kind == "kv_half":
        k, v = _halves(k, seqs, 0), _halves(v, seqs, 0)
        rows, qseq, kseq = q.shape[0], [(a, 2 * c) for a, c in seqs], _half_rows(seqs)
        src = q
    else:
        rows, qseq, kseq = q.shape[0], [(a, 2 * c) for a, c in seqs], [(a, 2 * c) for a, c in seqs]
        src = q
    out = torch.empty((rows,) + tuple(q.shape[1:]), dtype=q.dtype)
    lse = torch.empty((h, rows), dtype=_lse_dtype(q))
    for (qa, qn), (ka, kn) in zip(qseq, kseq, strict=True):
        with _kernel(flash):
            o, m = fwd(_bhsd(src[qa:qa + qn]), _bhsd(k[ka:ka + kn]), _bhsd(v[ka:ka + kn]), 0.0,
                       kind == "causal", scale=scale)
            out[qa:qa + qn].copy_(o[0].transpose(0, 1))
            lse[:, qa:qa + qn].copy_(m[0])
            del o, m
    return out, lse


def _merge(q, outs, lses, kinds, seqs, flash: bool = False):
    """The merged output (q's dtype, [t, h, d]) and log-sum-exp (fp32, [h, t]) of the steps,
    corrected block by block (fp32 scratch of BLOCK_ROWS rows; `flash`: TE's correction
    kernels, `thd_out_correction`, whose scratch is uncounted)."""
    t, h = q.shape[0], q.shape[1]
    out = torch.zeros_like(q)
    lse = torch.empty((h, t), dtype=_lse_dtype(q))
    half = _half_rows(seqs)
    for s, (a, c) in enumerate(seqs):
        for which in (0, 1):
            base = a + which * c
            for lo in range(0, c, BLOCK_ROWS):
                n = min(BLOCK_ROWS, c - lo)
                parts = []  # (output rows, lse cols) of each step covering these rows
                for o, m, kind in zip(outs, lses, kinds, strict=True):
                    if kind == "q_half":
                        if which == 0:
                            continue
                        at = half[s][0] + lo
                    else:
                        at = base + lo
                    parts.append((o[at:at + n], m[:, at:at + n]))
                with _kernel(flash):
                    total = parts[0][1]
                    for _, m in parts[1:]:
                        total = torch.logaddexp(total, m)
                    acc = None
                    for o, m in parts:
                        w = torch.exp(m - total).transpose(0, 1).unsqueeze(-1)  # [n, h, 1]
                        term = o.to(w.dtype) * w
                        acc = term if acc is None else acc + term
                    out[base + lo:base + lo + n].copy_(acc)
                    lse[:, base + lo:base + lo + n].copy_(total)
                    del parts, total, acc
    return out, lse


def _exchange(send, dst, recv, src, group):
    """Post one send and one receive (gloo point-to-point); returns their requests."""
    return [dist.isend(send, dst, group=group), dist.irecv(recv, src, group=group)]


def _step_kind(step: int, cp_rank: int) -> str:
    """Forward step `step` of rank `cp_rank`: its k/v come from rank (cp_rank - step) mod CP."""
    if step == 0:
        return "causal"
    return "kv_half" if step <= cp_rank else "q_half"


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seqs, group, ranks, scale, flash):
        cp = len(ranks)
        r = dist.get_rank(group)
        nxt, prv = ranks[(r + 1) % cp], ranks[(r - 1) % cp]
        n_k = k.numel()
        bufs = [torch.cat((k.reshape(-1), v.reshape(-1)))]
        outs, lses, kinds = [], [], []
        reqs: list = []
        for i in range(cp):
            for req in reqs:
                req.wait()
            reqs = []
            if i < cp - 1:
                bufs.append(torch.empty_like(bufs[i]))
                reqs = _exchange(bufs[i], nxt, bufs[i + 1], prv, group)
            kv = bufs[i]
            kind = _step_kind(i, r)
            o, m = _step_forward(kind, q, kv[:n_k].view(k.shape), kv[n_k:].view(v.shape), seqs,
                                 scale, flash)
            outs.append(o)
            lses.append(m)
            kinds.append(kind)
        out, lse = _merge(q, outs, lses, kinds, seqs, flash)
        del outs, lses
        ctx.save_for_backward(q, bufs[-1], out, lse)
        ctx.seqs, ctx.group, ctx.ranks, ctx.scale, ctx.flash = seqs, group, ranks, scale, flash
        ctx.k_shape, ctx.v_shape = k.shape, v.shape
        return out

    @staticmethod
    def backward(ctx, dout):
        _, bwd = _ops()
        q, kv_last, out, lse = ctx.saved_tensors
        seqs, group, ranks, scale = ctx.seqs, ctx.group, ctx.ranks, ctx.scale
        cp = len(ranks)
        r = dist.get_rank(group)
        # backward passes k/v and their gradients to the previous rank
        dst, src = ranks[(r - 1) % cp], ranks[(r + 1) % cp]
        n_k = kv_last.numel() - int(torch.Size(ctx.v_shape).numel())
        dout = dout.contiguous().view(q.shape)
        dq = torch.zeros_like(q)
        bufs = [torch.empty((2, kv_last.numel()), dtype=kv_last.dtype),
                torch.empty((2, kv_last.numel()), dtype=kv_last.dtype)]
        bufs[0][0].copy_(kv_last)
        full = [(a, 2 * c) for a, c in seqs]
        half = _half_rows(seqs)
        reqs: list = []
        for i in range(cp):
            for req in reqs:
                req.wait()
            send, recv = bufs[i % 2], bufs[(i + 1) % 2]
            if i == 0:
                send, recv = send[0], recv[0]
            elif i == cp - 1:
                send, recv = send[1], recv[1]
            reqs = _exchange(send, dst, recv, src, group)
            kv = bufs[i % 2][0]
            k, v = kv[:n_k].view(ctx.k_shape), kv[n_k:].view(ctx.v_shape)
            kind = _step_kind(cp - 1 - i, r)
            if kind == "q_half":
                q_, out_, dout_ = (_halves(x, seqs, 1) for x in (q, out, dout))
                lse_ = _lse_cols(lse, seqs, 1)
                qseq, kseq = half, full
            elif kind == "kv_half":
                q_, out_, dout_, lse_ = q, out, dout, lse
                k, v = _halves(k, seqs, 0), _halves(v, seqs, 0)
                qseq, kseq = full, half
            else:
                q_, out_, dout_, lse_ = q, out, dout, lse
                qseq, kseq = full, full
            dq_ = torch.empty_like(q_)
            dk_, dv_ = torch.empty_like(k), torch.empty_like(v)
            # flash-attn's varlen backward over every local sequence at once: its workspace
            work = flash_workspace(q_.shape[0], k.shape[0], len(seqs), q_, k) if ctx.flash else []
            for (qa, qn), (ka, kn) in zip(qseq, kseq, strict=True):
                with _kernel(ctx.flash):
                    g = bwd(_bhsd(dout_[qa:qa + qn]), _bhsd(q_[qa:qa + qn]), _bhsd(k[ka:ka + kn]),
                            _bhsd(v[ka:ka + kn]), _bhsd(out_[qa:qa + qn]),
                            lse_[:, qa:qa + qn].unsqueeze(0), 0.0, kind == "causal", scale=scale)
                    dq_[qa:qa + qn].copy_(g[0][0].transpose(0, 1))
                    dk_[ka:ka + kn].copy_(g[1][0].transpose(0, 1))
                    dv_[ka:ka + kn].copy_(g[2][0].transpose(0, 1))
                    del g
            del work
            if kind == "q_half":
                for (a, c), (ha, _) in zip(seqs, half, strict=True):
                    dq[a + c:a + 2 * c].add_(dq_[ha:ha + c])
            else:
                dq.add_(dq_)
            del q_, out_, dout_, lse_, dq_
            for req in reqs:  # the gradient of this step's k/v has arrived (except at step 0)
                req.wait()
            reqs = []
            dkv = bufs[(i + 1) % 2][1]
            dk, dv = dkv[:n_k].view(ctx.k_shape), dkv[n_k:].view(ctx.v_shape)
            if i == 0:
                dk.zero_()
                dv.zero_()
            if kind == "kv_half":
                for (a, c), (ha, _) in zip(seqs, half, strict=True):
                    dk[a:a + c].add_(dk_[ha:ha + c])
                    dv[a:a + c].add_(dv_[ha:ha + c])
            else:
                dk.add_(dk_)
                dv.add_(dv_)
            del dk_, dv_, k, v
        dkv = bufs[cp % 2][1]
        return (dq, dkv[:n_k].view(ctx.k_shape), dkv[n_k:].view(ctx.v_shape), None, None, None,
                None, None)


def ring_attention(q, k, v, bounds, group, ranks, scale=None, flash: bool = False):
    """Causal attention of THD q [t, h, d], k, v [t, g, d] (this CP rank's rows of sequences
    whose global padded cu_seqlens are `bounds`) over the CP group `group` (global `ranks`,
    in group order); `flash`: each step's kernel allocates as flash-attn varlen's on a GPU.
    Returns [t, h, d]."""
    cp = len(ranks)
    seqs, at = [], 0
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=False):
        n = (hi - lo) // cp
        seqs.append((at, n // 2))
        at += n
    if at != q.shape[0]:
        raise bad(ConfigError, "cu_seqlens", list(bounds),
                  f"hold {at * cp} rows over CP={cp}, but this rank has {q.shape[0]}")
    return _Ring.apply(q, k, v, tuple(seqs), group, tuple(ranks), scale, bool(flash))


def ring_attention_class():
    """A Megatron core-attention module (the constructor and call of `SdpaAttention`) that
    runs `ring_attention` over Megatron's context-parallel group. Built lazily."""
    from megatron.core import parallel_state
    from megatron.core.transformer.module import MegatronModule

    from .thd import bounds_of

    class RingAttention(MegatronModule):
        """Causal core attention over the context-parallel ring (THD input only); `flash`
        (set by `gpu_kernels.te_gpu_kernels`): its steps' kernels are flash-attn's."""

        flash = False

        def __init__(self, config, layer_number=None, attn_mask_type=None, attention_type=None,
                     attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                     pg_collection=None, **kwargs) -> None:
            super().__init__(config=config)
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
                raise bad(ConfigError, "packed_seq_params", None,
                          "the CP ring attention takes packed (THD) input only")
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            out = ring_attention(query, key, value, bounds_of(cu),
                                 parallel_state.get_context_parallel_group(),
                                 parallel_state.get_context_parallel_global_ranks(),
                                 self.softmax_scale, flash=self.flash)
            return out.reshape(out.shape[0], -1)

    return RingAttention


def install_ring_attention(model) -> int:
    """Replace every `SdpaAttention` core attention of `model` by `RingAttention`; returns
    how many were replaced."""
    from .megatron_build import sdpa_attention_class

    sdpa, ring = sdpa_attention_class(), ring_attention_class()
    found = [(m, m.core_attention) for m in model.modules()
             if isinstance(getattr(m, "core_attention", None), sdpa)]
    for module, old in found:
        module.core_attention = ring(old.config, softmax_scale=old.softmax_scale)
    return len(found)
