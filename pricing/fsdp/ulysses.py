"""Ulysses sequence parallelism under FSDP2 (veRL's `ulysses_sequence_parallel_size`): what a
rank of an sp group of N holds beside the one-rank terms of `fsdp.terms`
(docs/memory-model.md#fsdp-ulysses).

veRL pads the packed row to a multiple of N and gives each rank ceil(S / N) rows
(`ulysses_pad_and_slice_inputs`); every per-row term of `fsdp.terms` then applies to the rank's
rows (`FsdpPricingModel.rows_cp`). Around the attention kernel veRL's all-to-all gathers the
sequence and scatters the heads: the kernel runs on all S rows with heads / N, the same bytes per
rank row as one rank's S / N rows with every head, so the attention terms stay per rank row,
plus the all-to-all's copies (`all_to_all_parts`, placed by `attention_points`). What does not
shrink with N: a packed-row mask (sdpa/eager) covers the whole S x S row on every rank, and
flash-attn's per-sequence accumulator rows are per sequence of the whole row, with heads / N.
"""

from __future__ import annotations

from ..errors import ConfigError, bad
from .terms import BF16, Widths


def validate(geometry, fsdp: int, ulysses: int) -> None:
    """veRL's checks (`apply_monkey_patch`): query heads divisible by N, key/value heads
    divisible by N or N by them; and N dividing the FSDP group (veRL's (dp, sp) mesh over the
    ranks the FSDP mesh spans). One line naming the field."""
    if ulysses == 1:
        return
    att = geometry.attention
    if att.num_heads % ulysses:
        raise bad(ConfigError, "ulysses", ulysses,
                  f"must divide num_attention_heads={att.num_heads} (veRL's all-to-all scatters heads)")
    kv = att.num_kv_groups
    if kv % ulysses and ulysses % kv:
        raise bad(ConfigError, "ulysses", ulysses,
                  f"num_key_value_heads={kv} must divide it or be divisible by it (veRL repeats "
                  "key/value heads up to it)")
    if fsdp % ulysses:
        raise bad(ConfigError, "ulysses", ulysses,
                  f"must divide the FSDP group fsdp={fsdp} (veRL's (dp, sp) mesh over its ranks)")


def kv_width(w: Widths, ulysses: int) -> float:
    """Key (= value) width veRL's all-to-all moves: kv heads repeated up to N when fewer
    (`repeat_kv(k, max(N // kv_heads, 1))`)."""
    kv_heads = w.KV / w.hd if w.hd else 0.0
    return max(kv_heads, float(ulysses)) * w.hd


def all_to_all_parts(w: Widths, ulysses: int) -> tuple[float, float]:
    """(gathered, in flight): bytes per rank row the all-to-all adds at an attention point,
    forward or backward (docs/memory-model.md#fsdp-ulysses): the gathered query, key and value
    beside the local ones (2Q + 4KV', KV' the repeated key width); and one all-to-all in flight:
    its contiguous input chunks and the output list beside the concatenated result
    (4 max(Q, KV')), with repeated key and value copies (4KV') when kv heads < N. Backward: the
    gradients' all-to-alls, the same shapes."""
    kvr = kv_width(w, ulysses)
    flight = 2 * BF16 * max(w.Q, kvr)
    if kvr > w.KV:
        flight += 2 * BF16 * kvr
    return BF16 * w.Q + 2 * BF16 * kvr, flight


def attention_points(w: Widths, ulysses: int, attn: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """((beside, alone) forward, (beside, alone) backward): bytes per rank row the all-to-all
    adds at the attention's points, `beside` its S x S terms and `alone` the larger of the two
    with them (docs/memory-model.md#fsdp-ulysses). sdpa and flash: all of it beside. eager
    (anatomy of the wrapped eager attention on 2 gloo ranks): at the forward the gathered q, k,
    v beside the scores, the all-to-all in flight before or after them; at the backward the
    output gradient's all-to-all ends before the scores' gradients are made and the input
    gradients' start after they are freed."""
    if ulysses == 1:
        return (0.0, 0.0), (0.0, 0.0)
    gathered, flight = all_to_all_parts(w, ulysses)
    if attn == "eager":
        return (gathered, flight), (0.0, gathered + flight)
    return (gathered + flight, 0.0), (gathered + flight, 0.0)


def quadratic_scale(attn: str, ulysses: int) -> tuple[float, float, float]:
    """Factors on `terms.attention_quadratic`'s (held, kept per layer, at a layer's points),
    which are per row of the call: per rank row a whole-row S x S mask is N times as much; the
    per-head terms (eager's scores) are not (heads / N over S rows: the same per rank row).
    Docs: docs/memory-model.md#fsdp-ulysses (traces: bench/results/fsdp_ulysses_traces.jsonl)."""
    if attn == "sdpa":
        return float(ulysses), 1.0, float(ulysses)
    if attn == "eager":
        return float(ulysses), 1.0, 1.0
    return 1.0, 1.0, 1.0


def kept_mask_per_row(attn: str, checkpointing: bool) -> float:
    """Bytes per (row x attention row) each layer keeps beyond `terms.attention_quadratic`'s:
    sdpa without checkpointing keeps the kernel's bf16 copy of the packed-row mask for its
    backward (2 S^2 per layer; torch's CPU kernel saves its converted attn_mask), with or
    without Ulysses (docs/memory-model.md#fsdp-ulysses)."""
    return 2.0 if attn == "sdpa" and not checkpointing else 0.0


def caller_per_row(base: float, ulysses: int) -> float:
    """The caller's int64 tensors per logical row: the full row's ids, position ids and labels
    (`base`), plus this rank's padded slices of them and the loss's shifted labels (base / N
    per logical row, ceil'd slices covered by `pad_row_bound`). Docs:
    docs/memory-model.md#fsdp-ulysses."""
    return base + base / ulysses


def pad_row_bound(walk) -> float:
    """One rank row at the costliest point: the ceil(S / N) rows a rank gets above S / N, which
    the search's linear envelopes (rows / N) do not see. O(layers). Docs:
    docs/memory-model.md#fsdp-ulysses."""
    return float(walk.retained.sum() + max(walk.workspace.max(), walk.nograd.max())
                 + walk.input_grad + walk.head_retained + walk.head_transient
                 + max(walk.head_forward, 0.0))
