"""Parallel layout and recompute settings, validated against a geometry."""

from __future__ import annotations

from dataclasses import dataclass

from .compat import StrEnum
from .errors import ConfigError, bad
from .geometry import ModelGeometry


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Megatron's parallel sizes. `sequence_parallel` shards layer boundaries over TP.

    `etp` is Megatron's `expert_tensor_parallel_size`: the TP size of a MoE layer's experts
    (each rank holds 1/etp of every local expert's FFN width); None is Megatron's default,
    the layout's TP (`expert_tp`)."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    etp: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "pp", "ep", "dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise bad(ConfigError, f"parallel.{name}", value, "must be a positive integer")
        if self.sequence_parallel and self.tp == 1:
            raise bad(ConfigError, "parallel.sequence_parallel", True, "needs tp > 1")
        if self.etp is not None:
            if isinstance(self.etp, bool) or not isinstance(self.etp, int) or self.etp <= 0:
                raise bad(ConfigError, "parallel.etp", self.etp, "must be a positive integer or None (= tp)")
            if self.etp > self.tp:
                # Megatron allows it (the dispatcher then gathers other data-parallel ranks'
                # tokens into one expert-TP group); no term prices those rows
                raise bad(ConfigError, "parallel.etp", self.etp,
                          f"must not exceed parallel.tp={self.tp} (an expert TP wider than TP is not priced)")

    @property
    def expert_tp(self) -> int:
        """The experts' TP size: `etp`, or Megatron's default, the layout's TP."""
        return self.tp if self.etp is None else self.etp

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
        so is CP > 2 (priced conservatively, see `pricing.coverage.assess`)."""
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
        if geometry.moe is not None and geometry.moe.expert_ffn % self.expert_tp:
            # Megatron-core's experts `divide` their FFN width by the expert TP size
            raise bad(ConfigError, "parallel.etp" if self.etp is not None else "parallel.tp", self.expert_tp,
                      f"must divide moe.expert_ffn={geometry.moe.expert_ffn} (the expert TP size)")
        if self.pp > geometry.num_layers:
            raise bad(ConfigError, "parallel.pp", self.pp,
                      f"exceeds the model's {geometry.num_layers} layers")

    def to_dict(self) -> dict:
        """The sizes as keywords of this class (`etp` only when set, so Megatron's default
        round-trips as before)."""
        doc = {"tp": self.tp, "cp": self.cp, "pp": self.pp, "ep": self.ep, "dp": self.dp,
               "sequence_parallel": self.sequence_parallel}
        if self.etp is not None:
            doc["etp"] = self.etp
        return doc


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
