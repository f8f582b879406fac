"""An allocation model of Transformer Engine's parallel cross entropy, for CPU traces of the
`full-te` head (`trace_wave(head="full-te")`, `waveplan trace --head full-te`).

Megatron-core calls `te_parallel_cross_entropy(logits, labels, tp_group, is_cg_capturable)` when
`cross_entropy_loss_fusion` is on with `cross_entropy_fusion_impl="te"`; Transformer Engine needs
CUDA (its kernels are Triton), so on the CPU `te_cross_entropy_head(model)` turns those flags on
and puts `TeCrossEntropy` in its place, the way the tracer stands in for flash attention with
SDPA. It allocates what TE's `CrossEntropyFunction` allocates (transformer_engine/pytorch/
cross_entropy.py and triton/cross_entropy.py):

- forward: one fp32 triple per row (running max, sum of exponentials, target logit:
  `m_d_X_y`, rows x 3 x 4 bytes), all-gathered over TP (TP x rows x 3 x 4 bytes), the fp32 loss
  (rows x 4 bytes); the gradient, softmax - one-hot, is written into the bf16 logits **in place**
  and the logits are saved for the backward (no fp32 copy, no second vocabulary-wide tensor);
- backward: the saved logits are scaled by the incoming gradient in place and returned.

TE computes each row in registers; this stand-in computes a chunk of rows at a time (about
`CHUNK_ELEMENTS` logits) in two fp32 scratch buffers allocated before the tracer starts counting,
so, like TE, it adds no vocabulary-wide transient; the chunk loops run `uncounted()`, so the
scratch's views are never counted either (before, the tracer counted both buffers, 8 MiB, in
every full-te trace).
The numbers are real: the loss equals torch's cross entropy on the same logits and the gradient
is softmax - one-hot (tests/measure/test_trace_te_head.py). Imports torch.
"""

from __future__ import annotations

import contextlib

import torch

from .uncounted import uncounted

CHUNK_ELEMENTS = 1 << 20   # logits per chunk of rows (4 MiB of fp32 scratch)

# fp32 scratch of one chunk of rows, [chunk, vocab/TP] x 2, allocated by `te_cross_entropy_head`
# before the tracer counts: it stands for TE's registers, so the loss adds no vocabulary-wide
# transient
_SCRATCH: list = []


def _tp(group) -> tuple[int, int]:
    if group is None or not torch.distributed.is_initialized():
        return 1, 0
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def _scratch(part: int, device) -> tuple:
    for a, b in _SCRATCH:
        if a.shape[1] == part and a.device == device:
            return a, b
    rows = max(1, CHUNK_ELEMENTS // part)
    pair = (torch.empty(rows, part, dtype=torch.float32, device=device),
            torch.empty(rows, part, dtype=torch.float32, device=device))
    _SCRATCH.append(pair)
    return pair


class TeCrossEntropy(torch.autograd.Function):
    """loss[s, b] (fp32) of vocab-parallel logits[s, b, vocab/TP] (bf16) and labels[s, b]; the
    logits are overwritten by their gradient (as TE does: not marked dirty, nothing else saves
    them)."""

    @staticmethod
    def forward(ctx, logits, labels, group):
        size, rank = _tp(group)
        rows, part = logits.shape[0] * logits.shape[1], logits.shape[-1]
        buf_x, buf_e = _scratch(part, logits.device)
        chunk = buf_x.shape[0]
        flat = logits.view(rows, part)
        target = labels.reshape(rows)
        local = target - rank * part
        owned = ((local >= 0) & (local < part)).to(torch.float32)
        local = local.clamp(0, part - 1)
        m_d_x = torch.zeros(rows, 3, dtype=torch.float32, device=logits.device)
        with uncounted():   # the scratch's views and the chunk arithmetic: TE's registers
            for r0 in range(0, rows, chunk):
                n = min(chunk, rows - r0)
                x, e = buf_x[:n], buf_e[:n]
                x.copy_(flat[r0:r0 + n])
                m = x.amax(dim=1)
                torch.sub(x, m[:, None], out=e)
                e.exp_()
                m_d_x[r0:r0 + n, 0] = m
                m_d_x[r0:r0 + n, 1] = e.sum(dim=1)
                m_d_x[r0:r0 + n, 2] = x.gather(1, local[r0:r0 + n, None])[:, 0]
        m_d_x[:, 2] *= owned
        if size > 1:
            gathered = torch.empty(size, rows, 3, dtype=torch.float32, device=logits.device)
            torch.distributed.all_gather(list(gathered.unbind(0)), m_d_x, group=group)
        else:
            gathered = m_d_x[None]
        big_m = gathered[:, :, 0].amax(dim=0)
        big_d = (gathered[:, :, 1] * torch.exp(gathered[:, :, 0] - big_m)).sum(dim=0)
        loss = torch.log(big_d) + big_m - gathered[:, :, 2].sum(dim=0)
        del gathered
        # the gradient of each token's loss, softmax - one-hot, written into the logits in place
        with uncounted():
            for r0 in range(0, rows, chunk):
                n = min(chunk, rows - r0)
                e = buf_e[:n]
                e.copy_(flat[r0:r0 + n])
                e.sub_(big_m[r0:r0 + n, None]).exp_().div_(big_d[r0:r0 + n, None])
                e.scatter_add_(1, local[r0:r0 + n, None], -owned[r0:r0 + n, None])
                flat[r0:r0 + n].copy_(e)
        ctx.save_for_backward(logits)
        return loss.view(logits.shape[0], logits.shape[1])

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        grad.mul_(grad_loss[..., None].to(grad.dtype))
        return grad, None, None


def te_parallel_cross_entropy(logits, labels, tp_group=None, is_cg_capturable=False):
    """Megatron's call signature of TE's `parallel_cross_entropy` (no reduction, no label
    smoothing): the loss per token, [s, b] fp32."""
    return TeCrossEntropy.apply(logits, labels, tp_group)


@contextlib.contextmanager
def te_cross_entropy_head(model):
    """Run `model`'s loss through `te_parallel_cross_entropy` (Megatron's TE fusion path)."""
    from megatron.core.models.common.language_module import language_module

    config = model.config
    weight = model.output_layer.weight if model.output_layer.weight is not None else \
        model.shared_embedding_or_output_weight()
    _SCRATCH.clear()
    _scratch(weight.shape[0], weight.device)
    saved = (config.cross_entropy_loss_fusion, getattr(config, "cross_entropy_fusion_impl", None),
             getattr(language_module, "te_parallel_cross_entropy", None))
    config.cross_entropy_loss_fusion = True
    config.cross_entropy_fusion_impl = "te"
    language_module.te_parallel_cross_entropy = te_parallel_cross_entropy
    try:
        yield
    finally:
        config.cross_entropy_loss_fusion, config.cross_entropy_fusion_impl, patched = saved
        language_module.te_parallel_cross_entropy = patched
        _SCRATCH.clear()
