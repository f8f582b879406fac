"""Parallel layout and recompute settings, validated against a geometry."""

from __future__ import annotations

from dataclasses import dataclass

from .compat import StrEnum
from .errors import ConfigError, bad
from .geometry import ModelGeometry


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Megatron's parallel sizes. `sequence_parallel` shards layer boundaries over TP."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "pp", "ep", "dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise bad(ConfigError, f"parallel.{name}", value, "must be a positive integer")
        if self.sequence_parallel and self.tp == 1:
            raise bad(ConfigError, "parallel.sequence_parallel", True, "needs tp > 1")

    @property
    def model_parallel_size(self) -> int:
        """Ranks that run one wave together (and so share one budget): TP x CP x PP."""
        return self.tp * self.cp * self.pp

    @property
    def row_multiple(self) -> int:
        """Each packed sequence is padded to this many rows (Megatron's THD rule).

        CP needs 2*CP load-balanced chunks; sequence parallelism needs a multiple of TP.
        """
        m = 2 * self.cp if self.cp > 1 else 1
        return m * self.tp if self.sequence_parallel else m

    def validate_for(self, geometry: ModelGeometry) -> None:
        """Check that the geometry can be sharded this way; names the field that cannot.

        A vocabulary not divisible by TP is allowed (Megatron pads it; pricing rounds up), and
        so is CP > 2 (priced conservatively, see `pricing.model.evidence_gaps`)."""
        if geometry.attention is not None:
            att = geometry.attention
            if att.num_heads % self.tp:
                raise bad(ConfigError, "parallel.tp", self.tp,
                          f"must divide attention.num_heads={att.num_heads}")
            if att.num_kv_groups % self.tp:
                raise bad(ConfigError, "parallel.tp", self.tp,
                          f"must divide attention.num_kv_groups={att.num_kv_groups} "
                          "(replicated KV groups are not supported)")
        if geometry.gdn is not None:
            for name in ("num_key_heads", "num_value_heads"):
                value = getattr(geometry.gdn, name)
                if value % self.tp:
                    raise bad(ConfigError, "parallel.tp", self.tp, f"must divide gdn.{name}={value}")
        if geometry.ffn and geometry.ffn % self.tp:
            raise bad(ConfigError, "parallel.tp", self.tp, f"must divide model.ffn={geometry.ffn}")
        if geometry.moe is not None and geometry.moe.num_experts % self.ep:
            raise bad(ConfigError, "parallel.ep", self.ep,
                      f"must divide moe.num_experts={geometry.moe.num_experts}")
        if self.pp > geometry.num_layers:
            raise bad(ConfigError, "parallel.pp", self.pp,
                      f"exceeds the model's {geometry.num_layers} layers")

    def to_dict(self) -> dict:
        return {"tp": self.tp, "cp": self.cp, "pp": self.pp, "ep": self.ep, "dp": self.dp,
                "sequence_parallel": self.sequence_parallel}


class RecomputeMode(StrEnum):
    FULL = "full"
    SELECTIVE = "selective"
    NONE = "none"


@dataclass(frozen=True, kw_only=True)
class Recompute:
    """Activation recompute, as Megatron's `recompute_granularity/method/num_layers/modules`."""

    mode: RecomputeMode = RecomputeMode.FULL
    method: str = "uniform"
    num_layers: int = 1
    modules: tuple[str, ...] = ("core_attn",)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", RecomputeMode(self.mode))
        except ValueError:
            raise bad(ConfigError, "recompute.mode", self.mode,
                      "must be one of full, selective, none") from None
        if self.method not in ("uniform", "block"):
            raise bad(ConfigError, "recompute.method", self.method, "must be uniform or block")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers <= 0:
            raise bad(ConfigError, "recompute.num_layers", self.num_layers, "must be a positive integer")
        object.__setattr__(self, "modules", tuple(self.modules))

    @property
    def is_one_layer_full(self) -> bool:
        """The schedule the evidence covers (docs/memory-model.md#basis): full / uniform / 1."""
        return self.mode == RecomputeMode.FULL and self.method == "uniform" and self.num_layers == 1

    def to_dict(self) -> dict:
        return {"mode": self.mode.value, "method": self.method, "num_layers": self.num_layers,
                "modules": list(self.modules)}
