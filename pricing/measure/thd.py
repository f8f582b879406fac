"""Packed (THD) sequences on a Megatron-core model: their bounds, prefix trees,
`PackedSeqParams`, and the RoPE patch that reads them.

Megatron's THD code reads a packing's sequence bounds from its `cu_seqlens` tensor with
`.tolist()`; fake tensors have no data. So the bounds of every cu_seqlens tensor waveplan
builds are also kept here in Python, keyed by the tensor's id: `packed_params` records one
plain causal segment per sequence (as `trace.trace_wave` packs a wave), `register` a
packing with a prefix tree (as `training_wave.run_training_wave` packs shared prompts).
`bounds_of` and `tree_of` read them back (the core attention of `megatron_build` and
`rope_patch`); `forget` drops them. Each call is O(segments).

torch and megatron are imported lazily, inside the functions that need them.
"""

from __future__ import annotations

import contextlib

_BOUNDS: dict[int, list[int]] = {}

# id(cu_seqlens) -> [(start, end, parent (start, end) or None)] of a prefix-tree packing
_TREES: dict[int, list[tuple[int, int, tuple[int, int] | None]]] = {}


def register(cu, bounds: list[int],
             tree: list[tuple[int, int, tuple[int, int] | None]] | None = None) -> None:
    """Record the Python `bounds` of cu_seqlens tensor `cu` (and its prefix-tree segments,
    if it packs one)."""
    _BOUNDS[id(cu)] = bounds
    if tree is not None:
        _TREES[id(cu)] = tree


def forget(cu) -> None:
    """Drop what `register` recorded for `cu`."""
    _BOUNDS.pop(id(cu), None)
    _TREES.pop(id(cu), None)


def bounds_of(cu) -> list[int]:
    """Python bounds of a cu_seqlens tensor (the registered ones: fake tensors have no data)."""
    known = _BOUNDS.get(id(cu))
    return list(known) if known is not None else [int(x) for x in cu.tolist()]


def tree_of(cu) -> list[tuple[int, int, tuple[int, int] | None]] | None:
    """The prefix-tree segments registered for a cu_seqlens tensor (None: plain THD)."""
    return _TREES.get(id(cu))


def packed_params(torch, lens, device):
    """`PackedSeqParams` of `lens` packed one after another (THD, one causal segment each),
    and its cu_seqlens tensor, whose bounds are registered."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    register(cu, bounds)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    return params, cu


@contextlib.contextmanager
def rope_patch():
    """Megatron's THD RoPE reads cu_seqlens with `.tolist()`; use the known bounds instead.
    A prefix-tree packing (`training_wave.run_training_wave`) continues each segment's
    positions after its parent's rows."""
    import torch
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_thd

    def thd(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False,
            mscale=1.0, cp_group=None):
        tree = tree_of(cu_seqlens)
        if tree is None:
            bounds = bounds_of(cu_seqlens)
            tree = [(a, b, None) for a, b in zip(bounds[:-1], bounds[1:], strict=False)]
        parts = [freqs[(0 if parent is None else parent[1] - parent[0]):][:b - a]
                 for a, b, parent in tree]
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), torch.cat(parts, dim=0), rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention, mscale=mscale).squeeze(1)

    rope_utils._apply_rotary_pos_emb_thd = thd
    try:
        yield
    finally:
        rope_utils._apply_rotary_pos_emb_thd = original
