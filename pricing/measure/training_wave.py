"""A real training wave on the CPU, measured as the tracer measures (`run_training_wave`).

`trace.trace_wave` builds a fresh model and runs random tokens once; a training loop needs
the same measurement on *its* model, with its tokens, gradients accumulating over the waves
of a step and the optimizer's state alive. `run_training_wave` does that with the tracer's
own counting (live untyped storages created by aten ops, above everything alive before the
wave), so a training wave's peak is comparable with a trace and with a price. Shared prompts
run once as a prefix tree, as the planner prices them (`use_prefix_tree_attention`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ConfigError, bad
from . import thd
from .trace import _tracker_class


@dataclass(frozen=True)
class PromptGroup:
    """Sequences of one wave that share a prompt: `prompt` (may be empty) followed by each
    of `completions`. Packed as a prefix tree, as the planner prices a shared prompt: the
    prompt's rows once, then each completion's rows, attending to the prompt and causally
    to itself (RoPE positions continue after the prompt). Without a prompt, or with one
    completion, each sequence is one plain causal segment."""

    prompt: tuple[int, ...]
    completions: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.completions or any(len(c) == 0 for c in self.completions):
            raise bad(ConfigError, "completions", [len(c) for c in self.completions],
                      "needs at least one non-empty completion")

    @property
    def packed_rows(self) -> int:
        shared = len(self.prompt) if len(self.completions) > 1 else 0
        return sum(len(self.prompt) + len(c) for c in self.completions) - \
            shared * (len(self.completions) - 1)

    @property
    def logical_rows(self) -> int:
        return sum(len(self.prompt) + len(c) for c in self.completions)


@dataclass(frozen=True)
class WaveMeasurement:
    """One training wave's peaks, counted as `trace_wave` counts on "cpu": bytes of live
    untyped storages created by aten ops, above `baseline_bytes` (parameters, buffers,
    gradients already accumulated, the wave's inputs). `loss_sum` is the wave's summed
    token loss (before `loss_scale`), over `loss_tokens` tokens."""

    peak_forward_bytes: int
    peak_backward_bytes: int
    peak_bytes: int
    baseline_bytes: int
    packed_rows: int
    logical_rows: int
    loss_sum: float
    loss_tokens: int
    counted: str = ("live untyped storages created by aten ops during the wave (real CPU "
                    "tensors), above parameters, buffers, accumulated gradients and inputs")


def _tree_attention_class():
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from .megatron_build import sdpa_attention_class

    base = sdpa_attention_class()

    class TreeSdpaAttention(base):
        """`SdpaAttention` that also runs a prefix-tree packing (`run_training_wave`): a
        segment with a parent attends to all of the parent's rows and causally to itself
        (SDPA with a lower-right causal mask over [parent, segment]); other inputs run as in
        `SdpaAttention`."""

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            tree = None
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                tree = thd.tree_of(packed_seq_params.cu_seqlens_q)
            if tree is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type,
                                       attention_bias, packed_seq_params)
            outs = []
            for a, b, parent in tree:
                q = query[a:b].unsqueeze(0)
                if parent is None:
                    outs.append(self._one(q, key[a:b].unsqueeze(0),
                                          value[a:b].unsqueeze(0)).squeeze(0))
                    continue
                # the parent's keys/values joined to the segment's and the mask are built
                # inside a checkpoint: autograd keeps only views of the packed q/k/v (as a
                # varlen flash kernel keeps them), and backward rebuilds them for one segment
                # at a time, so the measured peak holds no per-segment copies the planner
                # does not price
                outs.append(checkpoint(self._child, q, key, value, a, b, parent,
                                       use_reentrant=False, preserve_rng_state=False))
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
            return out.reshape(out.shape[0], -1)

        def _child(self, q, key, value, a, b, parent):
            """One segment with a parent: all of the parent's rows, causal over its own."""
            pa, pb = parent
            k = torch.cat([key[pa:pb], key[a:b]]).unsqueeze(0).transpose(1, 2)
            v = torch.cat([value[pa:pb], value[a:b]]).unsqueeze(0).transpose(1, 2)
            rows, cols = b - a, (pb - pa) + (b - a)
            mask = torch.ones(rows, cols, dtype=torch.bool, device=q.device) \
                .tril(diagonal=pb - pa)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k, v, attn_mask=mask, scale=self.softmax_scale,
                dropout_p=self.dropout_p if self.training else 0.0,
                enable_gqa=q.shape[2] != k.shape[1])
            return out.transpose(1, 2).squeeze(0)

    return TreeSdpaAttention


_TREE_SDPA = None


def use_prefix_tree_attention(model) -> int:
    """Let `model`'s `SdpaAttention` modules (built by `megatron_build.build_gpt`) run
    prefix-tree packings too; returns how many were switched. Idempotent."""
    global _TREE_SDPA
    if _TREE_SDPA is None:
        _TREE_SDPA = _tree_attention_class()
    from .megatron_build import sdpa_attention_class

    base = sdpa_attention_class()
    switched = 0
    for module in model.modules():
        if type(module) is base:
            module.__class__ = _TREE_SDPA
            switched += 1
        elif type(module) is _TREE_SDPA:
            switched += 1
    return switched


def _pack_groups(torch, groups, device):
    """Token ids, positions, next-token labels and loss weights of one forward call, packed
    as a prefix tree, with its PackedSeqParams. The loss covers every completion token after
    the first, predicted inside its completion (the prompt's last row, shared by several
    completions, has no single next token; dropping each completion's first token keeps the
    loss independent of how a prompt's completions are split over waves)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    ids, pos, labels, weights = [], [], [], []
    segments: list[tuple[int, int, tuple[int, int] | None]] = []
    longest = 1

    def add(tokens, first_pos, parent, loss):
        start = len(ids)
        n = len(tokens)
        ids.extend(tokens)
        pos.extend(range(first_pos, first_pos + n))
        labels.extend(list(tokens[1:]) + [0])
        weights.extend([1.0 if loss and j < n - 1 else 0.0 for j in range(n)])
        segments.append((start, start + n, parent))
        return start, start + n

    logical = 0
    for group in groups:
        prompt = [int(x) for x in group.prompt]
        comps = [[int(x) for x in c] for c in group.completions]
        logical += group.logical_rows
        if prompt and len(comps) > 1:
            parent = add(prompt, 0, None, False)
            for c in comps:
                add(c, len(prompt), parent, True)
                longest = max(longest, len(prompt) + len(c))
        else:
            for c in comps:
                start = len(ids)
                add(prompt + c, 0, None, False)
                for j in range(len(c) - 1):  # loss on the completion, after its first token
                    weights[start + len(prompt) + j] = 1.0
                longest = max(longest, len(prompt) + len(c))
    bounds = [a for a, _, _ in segments] + [len(ids)]
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    thd.register(cu, bounds,
                 segments if any(parent is not None for _, _, parent in segments) else None)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    tensors = (torch.tensor([ids], dtype=torch.long, device=device),
               torch.tensor([pos], dtype=torch.long, device=device),
               torch.tensor([labels], dtype=torch.long, device=device),
               torch.tensor(weights, dtype=torch.float32, device=device))
    return tensors, params, cu, logical


def run_training_wave(model, children, *, loss_scale: float = 1.0) -> WaveMeasurement:
    """Run one training wave of `model` for real and measure its peak.

    `children`: the wave's forward calls, each a sequence of `PromptGroup` (a flat wave is
    one child). Every child runs its forward (packed THD, prefix trees for shared prompts),
    then the children's backwards run one after another, as the planner's schedule walk
    assumes. The loss is Megatron's cross entropy on the full logits, weighted as
    `_pack_groups` says and multiplied by `loss_scale` (e.g. 1 / the step's loss tokens);
    gradients accumulate into `.grad` (call the optimizer after the step's last wave).

    Counted with the tracer's `StorageTracker`: everything alive before the wave
    (parameters, buffers, gradients of earlier waves, optimizer state, the inputs) is
    baseline; the first wave of a step therefore also counts the adapter gradients it
    allocates, later waves only their transient gradients. Call inside
    `megatron_shim.init_single_process` on a model from `megatron_build.build_gpt(...,
    device="cpu")`; prefix trees need `use_prefix_tree_attention(model)` (done here).
    """
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import torch

    children = [list(child) for child in children]
    if not children or any(not child for child in children):
        raise bad(ConfigError, "children", [len(c) for c in children],
                  "needs at least one child with at least one prompt group")
    if any(not isinstance(g, PromptGroup) for child in children for g in child):
        raise bad(ConfigError, "children", "groups", "must hold PromptGroup items")
    device = next(model.parameters()).device
    use_prefix_tree_attention(model)
    params = list(model.parameters())
    packs = [_pack_groups(torch, child, device) for child in children]
    tracker = _tracker_class()()
    baseline = tracker.ignore(params + list(model.buffers())
                              + [p.grad for p in params if p.grad is not None])
    for tensors, _, cu, _ in packs:
        baseline += tracker.ignore(list(tensors) + [cu])
    loss_tokens = sum(int(tensors[3].count_nonzero()) for tensors, _, _, _ in packs)
    losses = []
    loss_sum = 0.0
    model.train()
    try:
        with tracker, thd.rope_patch():
            tracker.reset_peak()
            for (ids, pos, labels, weights), packed, _, _ in packs:
                out = model(ids, pos, None, labels=labels, packed_seq_params=packed)
                loss = (out.reshape(-1) * weights).sum()
                del out
                loss_sum += float(loss.detach())
                losses.append(loss * loss_scale)
                del loss
            peak_forward = tracker.peak
            tracker.reset_peak()
            while losses:
                losses.pop(0).backward()
            peak_backward = tracker.peak
    finally:
        for _, _, cu, _ in packs:
            thd.forget(cu)
    return WaveMeasurement(
        peak_forward_bytes=int(peak_forward), peak_backward_bytes=int(peak_backward),
        peak_bytes=int(max(peak_forward, peak_backward)), baseline_bytes=int(baseline),
        packed_rows=sum(int(t[0].shape[1]) for t, _, _, _ in packs),
        logical_rows=sum(logical for _, _, _, logical in packs),
        loss_sum=loss_sum, loss_tokens=loss_tokens)
