"""Model geometry: frozen, validated dataclasses that describe a decoder's shapes.

Sizes are global (unsharded); the pricing layer divides them by the parallel layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from .errors import ConfigError, bad


class MixerKind(StrEnum):
    ATTENTION = "attention"
    GDN = "gdn"


class MlpKind(StrEnum):
    DENSE = "dense"
    MOE = "moe"


_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def _positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise bad(ConfigError, f"{owner}.{name}", value, "must be a positive integer")


@dataclass(frozen=True)
class AttentionSpec:
    """Self-attention shapes. `output_gate` doubles the query projection (Qwen3.5-style gate)."""

    num_heads: int
    num_kv_groups: int
    head_dim: int
    output_gate: bool = False

    def __post_init__(self) -> None:
        _positive("attention", num_heads=self.num_heads, num_kv_groups=self.num_kv_groups,
                  head_dim=self.head_dim)
        if self.num_heads % self.num_kv_groups:
            raise bad(ConfigError, "attention.num_kv_groups", self.num_kv_groups,
                      f"must divide num_heads={self.num_heads}")

    @property
    def qkv_width(self) -> int:
        """Output width of the fused QKV projection (query doubled when gated)."""
        q = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        return q + 2 * self.num_kv_groups * self.head_dim

    @property
    def core_width(self) -> int:
        """Width of the attention core output (input of the output projection)."""
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class GdnSpec:
    """Gated DeltaNet (linear attention) shapes."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        _positive("gdn", num_key_heads=self.num_key_heads, num_value_heads=self.num_value_heads,
                  key_head_dim=self.key_head_dim, value_head_dim=self.value_head_dim,
                  conv_kernel=self.conv_kernel)
        if self.num_value_heads % self.num_key_heads:
            raise bad(ConfigError, "gdn.num_value_heads", self.num_value_heads,
                      f"must be a multiple of num_key_heads={self.num_key_heads}")

    @property
    def key_width(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_width(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_width(self) -> int:
        """Channels through the causal conv: q, k and v."""
        return 2 * self.key_width + self.value_width

    @property
    def in_proj_width(self) -> int:
        """Fused input projection: q, k, v, the output gate z, and per-head beta and alpha."""
        return self.conv_width + self.value_width + 2 * self.num_value_heads


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    expert_ffn: int
    shared_expert_ffn: int = 0

    def __post_init__(self) -> None:
        _positive("moe", num_experts=self.num_experts, top_k=self.top_k, expert_ffn=self.expert_ffn)
        if self.top_k > self.num_experts:
            raise bad(ConfigError, "moe.top_k", self.top_k,
                      f"must not exceed num_experts={self.num_experts}")
        if self.shared_expert_ffn < 0:
            raise bad(ConfigError, "moe.shared_expert_ffn", self.shared_expert_ffn, "must be >= 0")


@dataclass(frozen=True)
class LayerSpec:
    mixer: MixerKind
    mlp: MlpKind

    def __post_init__(self) -> None:
        for name, kind in (("mixer", MixerKind), ("mlp", MlpKind)):
            try:
                object.__setattr__(self, name, kind(getattr(self, name)))
            except ValueError:
                raise bad(ConfigError, f"model.layers.{name}", getattr(self, name),
                          f"unknown kind; known: {', '.join(k.value for k in kind)}") from None


@dataclass(frozen=True)
class ModelGeometry:
    """A decoder-only model's shapes.

    `ffn` is the dense MLP width (0 for a model whose every layer is MoE). `attention`, `gdn`
    and `moe` must be present exactly when some layer uses them.
    """

    name: str
    hidden: int
    ffn: int
    vocab: int
    layers: tuple[LayerSpec, ...]
    attention: AttentionSpec | None = None
    gdn: GdnSpec | None = None
    moe: MoeSpec | None = None
    dtype: str = "bf16"
    gated_mlp: bool = True
    tied_embeddings: bool = False
    extra: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        _positive("model", hidden=self.hidden, vocab=self.vocab)
        object.__setattr__(self, "layers", tuple(
            x if isinstance(x, LayerSpec) else LayerSpec(*x) for x in self.layers))
        if not self.layers:
            raise bad(ConfigError, "model.layers", self.layers, "must hold at least one layer")
        if self.dtype not in _DTYPE_BYTES:
            raise bad(ConfigError, "model.dtype", self.dtype, f"must be one of {sorted(_DTYPE_BYTES)}")
        kinds = {layer.mixer for layer in self.layers}
        mlps = {layer.mlp for layer in self.layers}
        for kind, spec, name in ((MixerKind.ATTENTION, self.attention, "attention"),
                                 (MixerKind.GDN, self.gdn, "gdn")):
            if kind in kinds and spec is None:
                raise bad(ConfigError, f"model.{name}", None, f"a layer uses {name} but no shapes are given")
        if MlpKind.MOE in mlps and self.moe is None:
            raise bad(ConfigError, "model.moe", None, "a layer is MoE but no MoE shapes are given")
        if MlpKind.DENSE in mlps:
            _positive("model", ffn=self.ffn)
        elif self.ffn < 0:
            raise bad(ConfigError, "model.ffn", self.ffn, "must be >= 0")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    def count(self, mixer: MixerKind) -> int:
        return sum(1 for layer in self.layers if layer.mixer == mixer)

    def to_dict(self) -> dict:
        """Plain-JSON form (stable key order) used by reports and `inspect --json`."""
        out: dict = {
            "name": self.name, "hidden": self.hidden, "ffn": self.ffn, "vocab": self.vocab,
            "dtype": self.dtype, "gated_mlp": self.gated_mlp, "tied_embeddings": self.tied_embeddings,
            "layers": [[layer.mixer.value, layer.mlp.value] for layer in self.layers],
        }
        for name in ("attention", "gdn", "moe"):
            spec = getattr(self, name)
            out[name] = None if spec is None else dict(spec.__dict__)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> ModelGeometry:
        """Inverse of `to_dict`; unknown keys are an error."""
        known = {"name", "hidden", "ffn", "vocab", "dtype", "gated_mlp", "tied_embeddings",
                 "layers", "attention", "gdn", "moe"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise bad(ConfigError, "model", unknown[0], "unknown field")
        try:
            return cls(
                name=str(data["name"]), hidden=data["hidden"], ffn=data.get("ffn", 0),
                vocab=data["vocab"], dtype=data.get("dtype", "bf16"),
                gated_mlp=bool(data.get("gated_mlp", True)),
                tied_embeddings=bool(data.get("tied_embeddings", False)),
                layers=tuple(LayerSpec(*pair) for pair in data["layers"]),
                attention=AttentionSpec(**data["attention"]) if data.get("attention") else None,
                gdn=GdnSpec(**data["gdn"]) if data.get("gdn") else None,
                moe=MoeSpec(**data["moe"]) if data.get("moe") else None,
            )
        except KeyError as exc:
            raise bad(ConfigError, f"model.{exc.args[0]}", None, "missing field") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"model: {exc}") from None
