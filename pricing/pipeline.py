"""Pipeline parallelism (PP > 1): what every stage holds under Megatron-core's 1F1B schedule.

Formula: stage s of p holds layers [s*L//p, (s+1)*L//p) and at most k_s = min(p - s, waves)
consecutive waves in flight; its peak is its highest 1F1B operation (`schedule_points`), a
wave's backward walk (or forward bound) beside the retained parts r_s of the others in flight
and what the schedule still holds. `stage_charges` restricts the model's per-layer arrays to
each stage, `fold_stages` folds them into the per-wave proxy the search packs against,
`stage_peaks` prices a wave sequence exactly and `window_peak` is the plain window bound; the
interleaved schedule is refused (`check_schedule`). See docs/memory-model.md#pipeline.
Complexity: O(p x L) to build; O(W x (groups^2 + groups x L / p) + W x k) to price W waves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import gdn_terms
from .errors import ConfigError, bad
from .tolerances import CEIL_SLACK
from .walk import PEAK_BYTES, WalkCharges, WalkGroups, walk


def check_schedule(virtual_stages: int, pp: int) -> None:
    """Fail closed for the interleaved schedule. With v > 1 virtual stages (model chunks per
    rank) Megatron runs `forward_backward_pipelining_with_interleaving`: rank r warms up
    with (p - r - 1) x 2 + (v - 1) x p chunk forwards, so it holds chunks of up to that many
    + 1 micro-batches, in an order the window model of the non-interleaved 1F1B schedule
    (k_s = p - s consecutive waves) does not describe; nothing prices or traces it.
    Raises ConfigError naming the setting, else returns. O(1)."""
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise bad(ConfigError, "virtual_stages", virtual_stages, "must be a positive integer")
    if virtual_stages > 1:
        raise bad(ConfigError, "virtual_stages", virtual_stages,
                  f"the interleaved pipeline schedule is not priced: rank r holds chunks of up "
                  f"to (p - r - 1) x 2 + (v - 1) x p + 1 = {2 * (pp - 1) + (virtual_stages - 1) * pp + 1}"
                  f" micro-batches on stage 0 (p={pp}), in windows the 1F1B model (p - s "
                  f"consecutive waves) does not cover; plan for the non-interleaved schedule "
                  f"(virtual stages 1)")


def stage_bounds(num_layers: int, pp: int) -> tuple[tuple[int, int], ...]:
    """The layers [lo, hi) of each stage: Megatron's even split. O(p)."""
    return tuple((s * num_layers // pp, (s + 1) * num_layers // pp) for s in range(pp))


def in_flight(pp: int, stage: int, num_waves: int) -> int:
    """Waves stage `stage` holds at once under 1F1B: min(p - s, waves)."""
    return max(1, min(pp - stage, num_waves))


@dataclass(frozen=True)
class StageCharges:
    """One stage's walk charges (its layers only) and what a wave's forward keeps per row."""

    stage: int
    lo: int
    hi: int
    window: int                # k = p - s, the in-flight waves at most
    charges: WalkCharges
    retained_per_row: float    # sum of the stage's retained rows (+ the loss's on the last)
    grad_in_per_row: float = 0.0   # the received output gradient, through the wave's backward
    held_per_row: float = 0.0      # the gradients a wave leaves held into the next forward
    held_backward_per_row: float = 0.0  # ... and into the next backward
    pending_total: np.ndarray | None = None  # per slot: the stage's adapter gradients
    rope_per_row: float = 0.0      # a RoPE cache entry's bytes per row of its sequence length
    rows_cp: int = 1               # a wave's rank rows x rows_cp = its packed rows


def rope_cache_per_row(geometry, layers: Sequence) -> float:
    """Bytes per row of sequence length of one entry of Megatron's RoPE cache on a stage with
    attention layers (`layers`: the stage's layer specs): `RotaryEmbedding.forward` is an
    `lru_cache` (32 entries) that keeps, per distinct longest packed sequence of a
    micro-batch, its frequencies [max_seqlen, rotary dim] in fp32, for the process's life.
    A wave's own entry is in its traced walk; the entries of the waves before it stay beside
    it. Rotary dim: the MLA rope head width, else head_dim x rotary_percent. 0 on a stage
    without attention. Evidence: docs/memory-model.md#pipeline-traces. O(layers)."""
    from .geometry import MixerKind

    att = geometry.attention
    if att is None or not any(spec.mixer == MixerKind.ATTENTION for spec in layers):
        return 0.0
    if getattr(att, "mla", None) is not None:
        dim = att.mla.qk_rope_head_dim
    else:
        dim = att.head_dim * float((geometry.extra or {}).get("rotary_percent", 1.0))
    return 4.0 * dim


ROPE_CACHE_ENTRIES = 32
"""`RotaryEmbedding.forward` / `YarnRotaryEmbedding.forward`'s `lru_cache(maxsize=32)`: entries
per process, over every instance."""


def rope_cache_instances(geometry, layers: Sequence) -> int:
    """How many RoPE cache entries a forward call fills for its longest sequence on a stage with
    `layers`: 1 (the model's one `RotaryEmbedding`), or with multi-latent attention one per attention
    layer, at most `ROPE_CACHE_ENTRIES` (each `MLASelfAttention` builds its own rotary embedding, and
    the `lru_cache` on `forward` is keyed by the instance). See docs/memory-model.md#mla-rope-caches.
    O(layers)."""
    from .geometry import MixerKind

    att = geometry.attention
    if att is None or getattr(att, "mla", None) is None:
        return 1
    n = sum(1 for spec in layers if spec.mixer == MixerKind.ATTENTION)
    return max(1, min(n, ROPE_CACHE_ENTRIES))


def received_activation_per_row(boundary: float, *, full_recompute: bool) -> float:
    """What stage s > 0 keeps per row of an in-flight wave beside its layers' retained rows:
    the activation it received (Megatron's receive buffer, kept by the schedule in
    `input_tensors` until the wave's backward). Under full recompute that tensor is the stage's
    first layer's checkpointed input, the same storage its boundary already counts: 0. Without
    full recompute, one boundary per row (conservative: not traced).
    Evidence: docs/memory-model.md#pipeline-traces. O(1)."""
    return 0.0 if full_recompute else boundary


def received_gradient_per_row(boundary: float, *, stage: int, pp: int) -> float:
    """Stage s < p - 1: the output gradient it receives for a wave's backward (a
    boundary-wide tensor per row, in the pipeline dtype), held by the schedule
    (`output_tensor_grad`) through the wave's whole backward, beside the layers' own input
    gradient: charged at every point of the wave's walk. 0 on the last stage (its backward
    starts at the loss). Evidence: docs/memory-model.md#pipeline-traces. O(1)."""
    return boundary if stage < pp - 1 else 0.0


def held_gradient_per_row(boundary: float, *, stage: int, pp: int,
                          into: str = "forward") -> float:
    """What a wave's backward leaves live into the next steps of the schedule, per row: on
    stage s > 0 its input gradient (the received activation's retained `.grad`, the
    schedule's `input_tensor_grad`, reassigned when the next backward returns: held through
    the next forward and the next backward); on stage s < p - 1 its received output gradient
    (`output_tensor_grad`, reassigned when the next one is received: held through the next
    forward only). `into`: "forward" or "backward", the next step priced.
    Evidence: docs/memory-model.md#pipeline-traces. O(1)."""
    if into == "backward":
        return boundary * (stage > 0)
    return boundary * ((stage > 0) + (stage < pp - 1))


def stage_charges(layers: WalkCharges, *, pp: int, received_per_row: float,
                  boundary_per_row: float = 0.0, rope_per_row: Sequence[float] | None = None,
                  rows_cp: int = 1) -> tuple[StageCharges, ...]:
    """Each stage's charges from a model's charges over all L layers (`layers`, the
    `Charges.layers` of a PP > 1 model): `received_per_row` what a stage s > 0
    keeps of the activation it received (`received_activation_per_row`), `boundary_per_row`
    one boundary-wide gradient per row (the schedule's held gradients), `rope_per_row` each
    stage's `rope_cache_per_row`, `rows_cp` a wave's packed rows per rank row. O(p x L)."""
    full = layers
    num_layers = full.retained.shape[0]
    out = []
    for s, (lo, hi) in enumerate(stage_bounds(num_layers, pp)):
        retained = full.retained[lo:hi].copy()
        if s > 0:
            retained[0] += received_per_row
        last = s == pp - 1
        # the stage's layers; the head on the last stage; the RoPE entries charged apart
        # (`StageCharges.rope_per_row`), so none in the walk's own charges
        charges = full._replace(
            retained=retained, workspace=full.workspace[lo:hi].copy(),
            nograd=full.nograd[lo:hi].copy(), gdn_state=full.gdn_state[lo:hi].copy(),
            pending=np.ascontiguousarray(full.pending[:, lo:hi]),
            input_grad=float(full.input_grad),
            head_retained=float(full.head_retained) if last else 0.0,
            head_transient=float(full.head_transient) if last else 0.0,
            head_const=float(full.head_const) if last else 0.0,
            caller=float(full.caller) if last else 0.0,
            pad_retained=full.pad_retained[lo:hi].copy(), pad_point=full.pad_point[lo:hi].copy(),
            chunk=float(full.chunk), rope_cp=0.0, rope_entry=0.0, rope_kept=False,
            head_forward=float(full.head_forward) if last else 0.0)
        out.append(StageCharges(
            stage=s, lo=lo, hi=hi, window=pp - s, charges=charges,
            retained_per_row=float(retained.sum()) + charges.head_retained,
            grad_in_per_row=received_gradient_per_row(boundary_per_row, stage=s, pp=pp),
            held_per_row=held_gradient_per_row(boundary_per_row, stage=s, pp=pp),
            held_backward_per_row=held_gradient_per_row(boundary_per_row, stage=s, pp=pp,
                                                        into="backward"),
            pending_total=charges.pending.sum(axis=1),
            rope_per_row=float(rope_per_row[s]) if rope_per_row is not None else 0.0,
            rows_cp=int(rows_cp)))
    return tuple(out)


def fold_stages(stages: Sequence[StageCharges]) -> dict:
    """One walk's per-layer charges (the `WalkCharges` fields they replace) that price a wave about as its worst stage does when
    k_s copies of it are in flight: position j is, stage by stage the larger, the stage's
    j-th layer; the first position also carries the other k_s - 1 waves' retained rows (in
    the retained and the forward transient), and the head is charged as on the last stage.
    A packing proxy only: `stage_peaks` decides. O(p x L)."""
    n = max(st.hi - st.lo for st in stages)
    n_slots = stages[0].charges.pending.shape[0]
    retained, workspace, nograd = np.zeros(n), np.zeros(n), np.zeros(n)
    gdn_state, pending = np.zeros(n), np.zeros((n_slots, n))
    pad_retained, pad_point = np.zeros(n), np.zeros(n)
    for st in stages:
        c, m = st.charges, st.hi - st.lo
        others = (st.window - 1) * float(c.retained.sum())
        r = c.retained.copy()
        ng = c.nograd.copy()
        if m:
            r[0] += others
            ng[0] += others
        retained[:m] = np.maximum(retained[:m], r)
        workspace[:m] = np.maximum(workspace[:m], c.workspace)
        nograd[:m] = np.maximum(nograd[:m], ng)
        gdn_state[:m] = np.maximum(gdn_state[:m], c.gdn_state)
        pending[:, :m] = np.maximum(pending[:, :m], c.pending)
        pad_retained[:m] = np.maximum(pad_retained[:m], c.pad_retained)
        pad_point[:m] = np.maximum(pad_point[:m], c.pad_point)
    return {"retained": retained, "workspace": workspace, "nograd": nograd,
            "gdn_state": gdn_state, "pending": pending, "pad_retained": pad_retained,
            "pad_point": pad_point}


@dataclass(frozen=True)
class StagePeak:
    """A stage's priced peak over a wave sequence: bytes (admitted, at the safety factor),
    the binding window of waves [first, last] and its budget."""

    stage: int
    layers: tuple[int, int]
    in_flight: int
    peak_bytes: int
    window: tuple[int, int]
    budget_bytes: int

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes

    def to_dict(self) -> dict:
        return {"stage": self.stage, "layers": list(self.layers), "in_flight": self.in_flight,
                "peak_bytes": self.peak_bytes, "window": list(self.window),
                "budget_bytes": self.budget_bytes}


class StageParts(NamedTuple):
    """Each wave's parts at each stage, raw bytes, [p, W] arrays in the waves' order:
    `kept` its retained part, `peak` its walk's peak (with its received output gradient),
    `forward` its forward's bound (`forward_charges`), `held_forward` / `held_backward` the
    gradients it leaves live into the next forward / backward (`held_gradient_per_row`),
    `left` the adapter gradients its backward allocates (the slots it carries), live to the
    step's end, `left_layer` their largest layer's share (`accumulation_transient`), `rope`
    its RoPE cache entry (`rope_cache_per_row`). None depends on the order; `take` reorders
    them."""

    kept: np.ndarray
    peak: np.ndarray
    forward: np.ndarray
    held_forward: np.ndarray
    held_backward: np.ndarray
    left: np.ndarray
    left_layer: np.ndarray
    rope: np.ndarray

    def take(self, order) -> StageParts:
        return StageParts(*(a[:, order] for a in self))


def forward_charges(c: WalkCharges) -> WalkCharges:
    """A bound of a wave's forward at a stage: its walk without the backward's gradients
    (input gradient, pending adapter gradients, the head's backward transient). The recomputed
    layer's workspace stays, since the table's own no-grad transient is not validated against the
    CPU traces' forwards. See docs/memory-model.md#pipeline-traces. O(L).
    """
    return c._replace(input_grad=0.0, pending=np.zeros_like(c.pending), head_transient=0.0)


def below_top_charges(c: WalkCharges) -> WalkCharges | None:
    """The stage's charges without its top layer, whose adapter gradients fold into the layer
    below (so that layer's pending suffix keeps them): the walk's points below the top layer,
    where the received output gradient is held beside the layer's own incoming gradient (at
    the top layer they are one tensor). None for a one-layer stage. O(L)."""
    if c.retained.shape[0] < 2:
        return None
    pending = np.ascontiguousarray(c.pending[:, :-1]).copy()
    pending[:, -1] += c.pending[:, -1]
    return c._replace(retained=c.retained[:-1].copy(), workspace=c.workspace[:-1].copy(),
                      nograd=c.nograd[:-1].copy(), gdn_state=c.gdn_state[:-1].copy(),
                      pending=pending, pad_retained=c.pad_retained[:-1].copy(),
                      pad_point=c.pad_point[:-1].copy())


def wave_parts(stage: StageCharges, groups: WalkGroups, first_exec: float,
               max_len: float = math.inf) -> tuple[float, ...]:
    """(retained part, peak, forward bound, held into the next forward, held into the next
    backward, left, left_layer, rope) of one wave at one stage, raw bytes (`StageParts`).
    The peak is the walk's, or below the top layer the walk's plus the received output
    gradient (`received_gradient_per_row`), the larger. Its longest sequence, which sizes
    its RoPE cache entry, is at most its packed rows and `max_len` (the step's longest).
    O(groups^2 + groups x L/p)."""
    best, _ = walk(stage.charges, first_exec, groups)
    fwd, _ = walk(forward_charges(stage.charges), first_exec, groups)
    rows = float(np.sum(groups.rows[groups.grad]))
    kept = rows * stage.retained_per_row
    if stage.charges.chunk > 1.0:
        # each forward call's GDN padding rows keep the kernel's tensors
        pads = gdn_terms.chunk_padding_rows(groups.rows[groups.grad], stage.charges.chunk)
        kept += float(pads.sum()) * float(stage.charges.pad_retained.sum())
    peak = float(best[PEAK_BYTES])
    if stage.grad_in_per_row and rows:
        lower = below_top_charges(stage.charges)
        if lower is not None:
            below, _ = walk(lower, first_exec, groups)
            peak = max(peak, float(below[PEAK_BYTES]) + rows * stage.grad_in_per_row)
    carried = np.unique(groups.slot[groups.carries])
    pending = stage.charges.pending[carried]
    left = float(pending.sum())
    longest = min(float(np.sum(groups.rows)) * stage.rows_cp, max_len)
    return (kept, peak, float(fwd[PEAK_BYTES]), rows * stage.held_per_row,
            rows * stage.held_backward_per_row, left, accumulation_transient(pending),
            longest * stage.rope_per_row)


def accumulation_transient(pending: np.ndarray) -> float:
    """Bytes a backward adds while it accumulates into adapter gradients that exist already
    (a wave after its slot's carrier): autograd computes a parameter's new gradient, then
    adds it into `.grad`; at most one layer's adapter gradients (`pending`: [slots, layers]
    of the carried slots) are such new tensors at once. Evidence:
    docs/memory-model.md#pipeline-traces. O(slots x L)."""
    return float(pending.sum(axis=0).max()) if pending.size else 0.0


def schedule_points(parts: StageParts, s: int, k: int) -> list[tuple[float, int, int]]:
    """Every operation of 1F1B at stage s (k waves in flight at most) priced: (bytes, first,
    last wave in flight). Forward of wave j: its forward bound beside the retained parts of
    the up to k - 1 waves before it still in flight; backward of wave i (the oldest in
    flight): its peak beside the retained parts of the waves after it in flight
    (i + 1 .. i + k - 1). Each point also carries the gradients still held from the last
    backward before it (of wave j - k, resp. i - 1) and the adapter gradients of every
    carrier whose backward ran; a backward after a carrier's also its gradients'
    accumulation (`accumulation_transient`); and the RoPE cache entries of every other wave
    whose forward ran (`rope_cache_per_row`; Megatron's cache keeps 32, this keeps all:
    conservative past 32 waves). O(W x k)."""
    kept, peak, fwd, held_f, held_b, left, left_layer, rope = (a[s] for a in parts)
    n = len(kept)
    done = np.concatenate(([0.0], np.cumsum(left)))   # done[m]: carriers among waves < m
    adding = np.concatenate(([0.0], np.maximum.accumulate(left_layer)))
    cached = np.concatenate(([0.0], np.cumsum(rope)))  # cached[m]: RoPE entries of waves < m
    out = []
    for j in range(n):
        lo = max(0, j - k + 1)
        v = fwd[j] + kept[lo:j].sum() + (held_f[j - k] if j >= k else 0.0) + done[lo]
        v += cached[j]
        out.append((float(v), lo, j))
    for i in range(n):
        hi = min(i + k, n)
        v = peak[i] + kept[i + 1:hi].sum() + (held_b[i - 1] if i > 0 else 0.0) + done[i]
        v += adding[i] + cached[hi] - rope[i]
        out.append((float(v), i, hi - 1))
    return out


def window_peak(kept: np.ndarray, peak: np.ndarray, k: int) -> tuple[float, int]:
    """max over windows of k consecutive waves of sum(kept) + max(peak - kept), and the first
    wave of the binding window: a bound of every 1F1B point when a wave's forward may peak as
    high as its backward (`schedule_points` prices the schedule's points). O(W x k)."""
    n = len(kept)
    k = max(1, min(k, n))
    transient = peak - kept
    best, at = -math.inf, 0
    for i in range(n - k + 1):
        v = float(kept[i:i + k].sum() + transient[i:i + k].max())
        if v > best:
            best, at = v, i
    return best, at


def stage_parts(stages: Sequence[StageCharges], waves: Sequence[WalkGroups],
                first_exec: Sequence[float], max_len: float = math.inf) -> StageParts:
    """Each wave's parts at each stage (`StageParts`), raw bytes. They do not depend on the
    waves' order. O(p x W x (groups^2 + groups x L/p))."""
    parts = np.zeros((len(StageParts._fields), len(stages), len(waves)))
    for s, st in enumerate(stages):
        for w, groups in enumerate(waves):
            parts[:, s, w] = wave_parts(st, groups, first_exec[w], max_len)
    return StageParts(*parts)


def peaks_from_parts(stages: Sequence[StageCharges], parts: StageParts,
                     budgets: Sequence[int], safety: float) -> tuple[StagePeak, ...]:
    """Every stage's peak over the waves (columns of `stage_parts`) in column order: its
    highest 1F1B point (`schedule_points`) and the waves in flight then, against each
    stage's budget. O(p x W x k)."""
    out = []
    n = parts.kept.shape[1]
    for st in stages:
        s = st.stage
        k = in_flight(len(stages), s, n)
        raw, lo, hi = max(schedule_points(parts, s, k), key=lambda p: p[0]) if n else (0.0, 0, -1)
        out.append(StagePeak(stage=s, layers=(st.lo, st.hi), in_flight=k,
                             peak_bytes=admitted(raw, safety) if n else 0,
                             window=(lo, hi), budget_bytes=int(budgets[s])))
    return tuple(out)


def admitted(raw: float, safety: float) -> int:
    """Admitted bytes of a raw peak, as a wave's price rounds them."""
    return int(math.ceil(math.ceil(raw) * safety))


def stage_peaks(stages: Sequence[StageCharges], waves: Sequence[WalkGroups],
                first_exec: Sequence[float], budgets: Sequence[int],
                safety: float, max_len: float = math.inf) -> tuple[StagePeak, ...]:
    """Every stage's peak over `waves` run in this order (each wave: its forward calls as a
    `WalkGroups`, with its first-execution allowance), against each stage's budget.
    O(p x W x (groups^2 + groups x L/p) + p x W x k)."""
    return peaks_from_parts(stages, stage_parts(stages, waves, first_exec, max_len), budgets,
                            safety)


def window_lower_bound(retained_rows: float, stage: StageCharges, budget: int,
                       safety: float) -> int:
    """Waves no plan goes below at this stage, under `schedule_points`' prices. A wave i of
    R_i gradient rows (one gradient group) keeps R_i x r (r = `retained_per_row`), and its
    backward passes the stage's top layer holding R_i x (r' + t) (r': the layers' retained
    rows, t: the top layer's workspace and input gradient). Its backward point B(i) adds the
    retained parts of the waves after it in flight (i + 1 .. i + k - 1), and every B(i) is
    within room = budget / safety. Summed over the W waves, wave j's retained part is counted
    min(j, k - 1) times beside the others, so
    W x room >= M (r' + t) + r ((k - 1) M - sum_{j < k-1} R_j (k - 1 - j)), with M the
    step's gradient rows `retained_rows` (packed rows are subadditive over waves) and
    R_j <= room / (r' + t): W >= M (r' + t + (k - 1) r) / room - r / (r' + t) x k (k - 1) / 2.
    Each wave alone gives W >= M (r' + t) / room. A plan of W < k waves has W in flight:
    the bound is the smallest W that satisfies its own k = min(k_s, W). O(k)."""
    room = budget / safety
    c = stage.charges
    top = float(c.workspace[-1]) if c.workspace.shape[0] else 0.0
    own = float(c.retained.sum()) + top + float(c.input_grad)     # r' + t
    r = stage.retained_per_row
    if retained_rows <= 0 or own <= 0:
        return 1
    if room <= 0:
        return math.inf

    def needs(k: int) -> int:
        v = retained_rows * (own + (k - 1) * r) / room - r / own * k * (k - 1) / 2
        return max(1, math.ceil(v - CEIL_SLACK), math.ceil(retained_rows * own / room - CEIL_SLACK))

    for w in range(1, stage.window):
        if w >= needs(w):
            return w
    return needs(stage.window)
