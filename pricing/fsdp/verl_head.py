"""veRL's FSDP actor heads: log-probs and entropy as veRL 0.9.1's FSDP engine computes them
(`FSDPEngine.prepare_model_outputs`, remove-padding branch, `calculate_entropy`), per rank row
(docs/memory-model.md#fsdp-verl-head).

Heads (`FSDP_HEADS`): "transformers" (transformers' `ForCausalLMLoss`, `terms.head_per_row`);
"verl": the model's bf16 logits divided by the temperature (out of place),
`entropy_from_logits` (softmax, log-sum-exp, sum of p x logits) and `logprobs_from_logits`
(flash-attn's Triton cross entropy on a GPU with flash-attn, else the row loop of
`logprobs_from_logits_v2`); "verl-chunked": `entropy_from_logits_with_chunking` (fp32 chunks);
"verl-fused": `use_fused_kernels` with the Triton backend (`verl.utils.kernel.
linear_cross_entropy`: no logits; allocation model from `kernels.py`).

Two dtypes: on the CPU (torch-cpu backend, what the tracer runs) bf16 autocast leaves softmax,
log-softmax and log-sum-exp in bf16; CUDA autocast runs them in fp32 (`softmax`, `log_softmax`,
`sum` are on its fp32 list; `logsumexp` is charged as if it were), so the GPU terms charge fp32
copies where the CPU has bf16 ones, and the larger of the two log-prob kernels.
"""

from __future__ import annotations

import math

from .terms import BF16, FP32, Widths

FSDP_HEADS = ("transformers", "verl", "verl-chunked", "verl-fused")
FUSED_FORWARD_SPLIT = 1024
"""`efficient_entropy_forward`'s vocab_per_split: its [tokens, splits] fp32 partials."""
FUSED_BACKWARD_SPLIT = 9504
"""`efficient_entropy_backward`'s `_Split_Dlogits_N` vocab_per_split: its [tokens, 9504] bf16
d_logits buffer (the default backward method)."""


def fsdp_head(head: str) -> str:
    """The FSDP head a `head` argument names: Megatron's default head (what the planner and CLI
    default to) means transformers' loss; an FSDP head is itself; anything else is refused
    with one line."""
    from ..errors import ConfigError, bad
    from ..model import DEFAULT_HEAD

    if head == DEFAULT_HEAD:
        return "transformers"
    if head not in FSDP_HEADS:
        raise bad(ConfigError, "head", head, f"under --framework fsdp one of {', '.join(FSDP_HEADS)}")
    return head


def head_per_row(w: Widths, head: str, *, gpu: bool) -> tuple[float, float, float, float]:
    """(retained, backward transient, forward point) per rank row and the constant bytes at the
    head's backward, of veRL's head `head` (not "transformers"); the final norm's fp32 input
    (4H + 4) is in every entry as in `terms.head_per_row`. Docs: docs/memory-model.md#fsdp-verl-head.

    verl, CPU (traced): kept the scaled logits (2V), softmax's output (2V) and the log-softmax
    rows (2V); at the forward the logits, scaled logits, p and p x logits (8V); the backward 8V.
    verl, GPU: kept the scaled logits (2V), fp32 softmax output and log-sum-exp input (8V), the
    v2 loop's fp32 log-softmax rows when flash-attn is absent (4V); forward 16V; backward 16V
    (the fp32 gradients of p and p x logits, their bf16 casts, log-sum-exp's fp32 exp, the
    cross entropy's bf16 d_logits, the accumulated gradient).
    verl-chunked, CPU (traced): kept each chunk's fp32 logits and softmax (8V) and the
    log-softmax rows (2V); forward 16V; backward 20V. GPU: the log-prob rows in fp32 (+2V kept,
    +2V forward and backward).
    verl-fused (allocation model): kept the final hidden (2H), the fp32 max, accumulate and
    entropy_b (12) and the fp32 log-probs and entropy (8); forward + the [tokens, splits] fp32
    partials (12 ceil(V / 1024)) and temporaries (16); backward the bf16 d_logits
    [tokens, 9504] (2 x 9504) and d_hidden with its matmul temporary (4H); constant: d_weight
    [V, H] bf16, computed whether or not the head weight trains."""
    norm = FP32 * w.H + FP32
    V = w.V
    if head == "verl":
        ret, fwd, tr = (14 * V, 16 * V, 16 * V) if gpu else (6 * V, 8 * V, 8 * V)
        return ret + norm, tr, fwd + norm, 0.0
    if head == "verl-chunked":
        ret, fwd, tr = (12 * V, 18 * V, 22 * V) if gpu else (10 * V, 16 * V, 20 * V)
        return ret + norm, tr, fwd + norm, 0.0
    if head == "verl-fused":
        ret = BF16 * w.H + 12 + 8
        fwd = ret + 12 * math.ceil(V / FUSED_FORWARD_SPLIT) + 16
        tr = BF16 * FUSED_BACKWARD_SPLIT + 4 * w.H
        return ret + norm, tr, fwd + norm, BF16 * V * w.H
    raise ValueError(head)


def gpu_dtypes(table) -> bool:
    """Whether `table` prices the GPU's head dtypes: a table of fused GPU kernels (te-gpu, or one
    calibrated from it); a table of plain CPU kernels (torch-cpu, or one `waveplan calibrate`
    fitted from it, whatever its name) prices the CPU's traced bf16 head. Docs:
    docs/memory-model.md#fsdp-verl-head."""
    return table.kernels.name != "plain-cpu"


def head_gap(head: str, *, gpu: bool) -> str | None:
    """The reason a head's price is conservative, or None (a traced CPU path)."""
    if head == "verl-fused":
        return ("veRL fused head (Triton linear_cross_entropy): allocation model from "
                "verl/utils/kernel/kernels.py; no trace")
    if head in ("verl", "verl-chunked") and gpu:
        return (f"veRL {head} head on a GPU: CUDA autocast's fp32 softmax/log-sum-exp and "
                "flash-attn's cross entropy from source; traced on the CPU (bf16) only")
    return None
