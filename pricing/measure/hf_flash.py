"""flash-attn 2 for transformers' flash_attention_2 path on the CPU: an allocation model.

flash-attn does not run here. `flash_attention_2()` (a context manager) loads transformers'
flash_attention_2 integration with stand-ins for the two kernel entry points it resolves
(`modeling_flash_attention_utils.lazy_import_flash_attention`): `flash_attn_varlen_func` (packed
rows, cu_seqlens from position_ids; veRL's remove-padding path) and `flash_attn_func` (one
unpacked sequence per row). Everything around them is transformers' own code: the q/k/v
transposes, `_prepare_from_posids`' contiguous copies and cu_seqlens, `_upad_input` /
`_pad_input` on padded rows, the output view. Both stand-ins are `gpu_kernels.FlashVarlen`,
the allocation model of flash-attn 2's kernels that the Megatron te-gpu tracer uses: what
`mha_varlen_fwd` / `mha_fwd` save and what `mha_varlen_bwd` / `mha_bwd` allocate
(csrc/flash_attn/flash_api.cpp); their values are block-causal attention per sequence computed
uncounted (docs/memory-model.md#fsdp-attention).

A model is built with sdpa (transformers refuses flash_attention_2 without flash-attn) and
switched with `use_flash(model)`. Imports torch and transformers: only tracer processes load it.
"""

from __future__ import annotations

import contextlib
import math

import torch

from .gpu_kernels import FlashVarlen
from .uncounted import uncounted

IMPLEMENTATION = "flash_attention_2"


def flash_attn_available() -> bool:
    """True when the real flash-attn 2 package is importable (a CUDA trace then runs it)."""
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def _attend_one(q, k, v, *, scale, causal, window, softcap):
    """Attention of one sequence: q [s, h, d], k/v [s, g, d] -> [s, h, dv] (q's dtype)."""
    h, g = q.shape[1], k.shape[1]
    qf = q.transpose(0, 1).float()
    kf = k.transpose(0, 1).float().repeat_interleave(h // g, 0)
    vf = v.transpose(0, 1).float().repeat_interleave(h // g, 0)
    scores = qf @ kf.transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    s_q, s_k = q.shape[0], k.shape[0]
    i = torch.arange(s_q).unsqueeze(1) + (s_k - s_q)
    j = torch.arange(s_k).unsqueeze(0)
    keep = torch.ones(s_q, s_k, dtype=torch.bool)
    if causal:
        keep &= j <= i
    left, right = window
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    scores = scores.masked_fill(~keep.to(scores.device), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf
    return out.transpose(0, 1).to(q.dtype)


def _options(q, softmax_scale, causal, window_size, softcap):
    return {"scale": softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1]),
            "causal": bool(causal), "window": tuple(int(x) for x in window_size),
            "softcap": float(softcap or 0.0)}


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                           max_seqlen_k=None, dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2's `flash_attn_varlen_func` (its signature; transformers passes what it
    names): q [total_q, h, d], k/v [total_k, g, d] -> [total_q, h, dv], through `FlashVarlen`
    (dq_accum and softmax_d of total_q + 128 x batch rows)."""
    opts = _options(q, softmax_scale, causal, window_size, softcap)
    with uncounted():
        bq = [int(x) for x in cu_seqlens_q.tolist()]
        bk = [int(x) for x in cu_seqlens_k.tolist()]

    def attend(q_, k_, v_):
        return torch.cat([_attend_one(q_[a:b], k_[c:e], v_[c:e], **opts)
                          for a, b, c, e in zip(bq[:-1], bq[1:], bk[:-1], bk[1:], strict=True)])

    return FlashVarlen.apply(q, k, v, len(bq) - 1, attend)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """flash-attn 2's `flash_attn_func`: q [b, s, h, d], k/v [b, s_k, g, d] -> [b, s, h, dv],
    through `FlashVarlen` with `mha_bwd`'s accumulators (b x round128(s) rows)."""
    opts = _options(q, softmax_scale, causal, window_size, softcap)
    b, s = q.shape[0], q.shape[1]

    def attend(q_, k_, v_):
        return torch.stack([_attend_one(q_[i], k_[i], v_[i], **opts) for i in range(b)])

    return FlashVarlen.apply(q, k, v, b, attend, b * (-(-s // 128) * 128))


def use_flash(model) -> None:
    """Switch a transformers model built with sdpa to flash_attention_2 (its config and every
    sub-config; the attention functions are looked up by name at each call)."""
    seen = set()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and id(cfg) not in seen:
            seen.add(id(cfg))
            cfg._attn_implementation = IMPLEMENTATION


@contextlib.contextmanager
def flash_attention_2():
    """transformers' flash_attention_2 path with the stand-in kernels loaded in place of
    flash-attn's (the module state `lazy_import_flash_attention` caches), restored on exit."""
    from transformers import modeling_flash_attention_utils as fa

    names = ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn",
             "_pad_fn", "_unpad_fn", "_process_flash_kwargs_fn")
    saved = {n: getattr(fa, n) for n in names}
    fa._loaded_implementation = IMPLEMENTATION
    fa._flash_fn, fa._flash_varlen_fn, fa._flash_with_kvcache_fn = (
        flash_attn_func, flash_attn_varlen_func, None)
    fa._pad_fn, fa._unpad_fn = fa._pad_input, fa._unpad_input
    fa._process_flash_kwargs_fn = fa._lazy_define_process_function(flash_attn_varlen_func)
    try:
        yield
    finally:
        for n, val in saved.items():
            setattr(fa, n, val)
