"""The time of a wave: the time analogue of its memory price.

    seconds = scale x (overhead_s + (row_flops x rows + pair_flops x pairs) / flops_per_s)

`rows` are the wave's packed rows (a shared prompt counted once per forward call), `pairs`
its causal attention pairs (a prompt of P tokens attends P(P+1)/2 pairs once per call; a
completion of C tokens behind it C x P + C(C+1)/2). `row_flops` and `pair_flops` come from
the geometry (FLOPs per rank of one forward, the backward's input gradients and, with full
recompute, the forward again); `flops_per_s` and `overhead_s` are documented defaults and
`scale` is learned from observed wave times (`observed`). docs/faq.md#time-model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .errors import ConfigError, bad
from .geometry import MixerKind, MlpKind, ModelGeometry
from .parallel import ParallelLayout, Recompute, RecomputeMode

# an H100/H200's dense bf16 peak (989 TFLOP/s) at 40% utilisation
DEFAULT_FLOPS_PER_S = 4.0e14
# a wave's fixed cost: launches, the gradient-accumulation bookkeeping, collectives' latency
DEFAULT_OVERHEAD_S = 0.02
# flash attention's backward over its forward (dQ, dK, dV and the recomputed scores)
ATTENTION_BACKWARD = 2.5


def _positive_float(field: str, value: object, *, zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise bad(ConfigError, field, value, "must be a number")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero):
        raise bad(ConfigError, field, value, "must be a finite number > 0" + (" or 0" if zero else ""))
    return v


def check_seconds(field: str, value: object) -> float:
    """A measured time: a finite number of seconds > 0 (one ConfigError line otherwise)."""
    return _positive_float(field, value)


def linear_params_per_row(geometry: ModelGeometry) -> float:
    """Weights one row passes through (a MoE layer: its top-k experts, shared expert and
    router), the output head included."""
    h = geometry.hidden
    gate = 3 if geometry.gated_mlp else 2
    total = float(h * geometry.vocab)
    for layer in geometry.layers:
        if layer.mixer == MixerKind.ATTENTION:
            a = geometry.attention
            total += h * a.qkv_width + a.core_width * h
        else:
            g = geometry.gdn
            total += h * g.in_proj_width + g.value_width * h
        if layer.mlp == MlpKind.MOE:
            m = geometry.moe
            total += gate * h * (m.top_k * m.expert_ffn + m.shared_expert_ffn) + h * m.num_experts
        else:
            total += gate * h * geometry.ffn
    return total


def attention_flops_per_pair(geometry: ModelGeometry) -> float:
    """Forward FLOPs of one causal (query, key) pair summed over the attention layers: the
    scores (2 x heads x query/key width) and the weighted values (2 x heads x value width).
    Sliding windows are not credited (an upper bound)."""
    a = geometry.attention
    if a is None:
        return 0.0
    qk = a.mla.qk_head_dim if a.mla is not None else a.head_dim
    v = a.mla.v_head_dim if a.mla is not None else a.head_dim
    return 2.0 * a.num_heads * (qk + v) * geometry.count(MixerKind.ATTENTION)


@dataclass(frozen=True)
class WaveTimeModel:
    """Predicted seconds of a wave from its packed rows and causal attention pairs (module
    docstring; docs/faq.md#time-model)."""

    row_flops: float
    """FLOPs per packed row on one rank: linear layers and head, forward + input gradients
    (+ the forward again under full recompute), over TP x CP x PP."""
    pair_flops: float
    """FLOPs per causal attention pair on one rank (forward, flash backward, recompute)."""
    flops_per_s: float = DEFAULT_FLOPS_PER_S
    """Sustained FLOP/s of one rank (default: 989 TFLOP/s bf16 at 40%)."""
    overhead_s: float = DEFAULT_OVERHEAD_S
    """Fixed seconds per wave (default 20 ms)."""
    scale: float = 1.0
    """Observed over predicted seconds, the mean over `observations` (1.0 before any)."""
    observations: int = 0
    """How many observed waves `scale` is the mean of."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "row_flops", _positive_float("time_model.row_flops", self.row_flops))
        object.__setattr__(self, "pair_flops",
                           _positive_float("time_model.pair_flops", self.pair_flops, zero=True))
        object.__setattr__(self, "flops_per_s",
                           _positive_float("time_model.flops_per_s", self.flops_per_s))
        object.__setattr__(self, "overhead_s",
                           _positive_float("time_model.overhead_s", self.overhead_s, zero=True))
        object.__setattr__(self, "scale", _positive_float("time_model.scale", self.scale))
        if isinstance(self.observations, bool) or not isinstance(self.observations, int) \
                or self.observations < 0:
            raise bad(ConfigError, "time_model.observations", self.observations,
                      "must be an integer >= 0")

    @classmethod
    def from_geometry(cls, geometry: ModelGeometry, parallel: ParallelLayout | None = None,
                      recompute: Recompute | None = None, *,
                      flops_per_s: float = DEFAULT_FLOPS_PER_S,
                      overhead_s: float = DEFAULT_OVERHEAD_S) -> WaveTimeModel:
        """Coefficients from the geometry: a row costs 2 FLOPs per weight forward and 2 for the
        input gradients (LoRA's frozen weights get none), 2 more under full recompute; a pair
        its forward x (1 + `ATTENTION_BACKWARD` + 1 when recomputed). Per rank: over
        TP x CP x PP (the pipeline's bubble is not modelled)."""
        parallel = parallel or ParallelLayout()
        mode = (recompute or Recompute()).mode
        share = parallel.tp * parallel.cp * parallel.pp
        row = linear_params_per_row(geometry) * (6.0 if mode == RecomputeMode.FULL else 4.0)
        attention_again = 1.0 if mode != RecomputeMode.NONE else 0.0
        pair = attention_flops_per_pair(geometry) * (1.0 + ATTENTION_BACKWARD + attention_again)
        return cls(row_flops=row / share, pair_flops=pair / share, flops_per_s=flops_per_s,
                   overhead_s=overhead_s)

    @classmethod
    def from_model(cls, model, **kwargs) -> WaveTimeModel:
        """`from_geometry` of a `PricingModel`'s geometry, layout and recompute."""
        return cls.from_geometry(model.geometry, model.parallel, model.recompute, **kwargs)

    def seconds(self, rows: float, pairs: float) -> float:
        """Predicted seconds of a wave of `rows` packed rows and `pairs` attention pairs."""
        return self.scale * self.unscaled(rows, pairs)

    def unscaled(self, rows: float, pairs: float) -> float:
        """The prediction before the learned scale."""
        return self.overhead_s + (self.row_flops * rows + self.pair_flops * pairs) / self.flops_per_s

    def wave_seconds(self, step, children) -> float:
        """Predicted seconds of a wave of `step` run as `children` (arrays of request
        indices; one per forward call). O(requests of the wave)."""
        rows, pairs = wave_work(step, children)
        return self.seconds(rows, pairs)

    def observed(self, rows: float, pairs: float, seconds: float) -> WaveTimeModel:
        """The model after a wave of `rows` and `pairs` took `seconds`: `scale` becomes the
        mean of observed over unscaled predicted seconds."""
        s = check_seconds("seconds", seconds)
        ratio = s / self.unscaled(rows, pairs)
        n = self.observations
        return replace(self, scale=(self.scale * n + ratio) / (n + 1) if n else ratio,
                       observations=n + 1)


def wave_work(step, children) -> tuple[int, int]:
    """(packed rows, causal attention pairs) of a wave of `step` run as `children`: per
    forward call, each prompt group's prefix once (`step.prefix_rows`) and each request's own
    rows behind it (`step.own_rows`). Token form: sharing above a group's node is not
    credited (more work, never less). O(requests of the wave)."""
    rows = 0
    pairs = 0
    for child in children:
        idx = np.asarray(child, dtype=np.int64)
        groups = np.unique(step.group_of[idx])
        prefix = step.prefix_rows[groups]
        own = step.own_rows[idx]
        behind = step.prefix_rows[step.group_of[idx]]
        rows += int(prefix.sum() + own.sum())
        pairs += int((prefix * (prefix + 1) // 2).sum() + (own * behind + own * (own + 1) // 2).sum())
    return rows, pairs
