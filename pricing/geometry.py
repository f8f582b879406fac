"""Model geometry: frozen, validated dataclasses that describe a decoder's shapes.

Sizes are global (unsharded); the pricing layer divides them by the parallel layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .compat import StrEnum
from .errors import ConfigError, bad


class MixerKind(StrEnum):
    ATTENTION = "attention"
    GDN = "gdn"


class MlpKind(StrEnum):
    DENSE = "dense"
    MOE = "moe"


class MlpActivation(StrEnum):
    """The gated MLP's activation (dense layers and experts alike)."""

    SWIGLU = "swiglu"                  # silu(gate) * up: Llama, Qwen, Mistral, Phi, DeepSeek
    GEGLU = "geglu"                    # gelu_tanh(gate) * up: Gemma 2 and 3
    CLAMPED_SWIGLU = "clamped-swiglu"  # gpt-oss: clamped gate and up, gate * sigmoid(1.702 gate) * (up + 1)


class RouterScore(StrEnum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def _positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise bad(ConfigError, f"{owner}.{name}", value, "must be a positive integer")


@dataclass(frozen=True)
class MlaSpec:
    """Multi-latent attention (DeepSeek V2/V3) shapes: queries through an optional low-rank
    latent (`q_lora_rank`, 0: projected straight from the hidden state), keys and values
    through one shared latent of `kv_lora_rank` plus a shared rotary key of
    `qk_rope_head_dim`; per head, query/key width `qk_nope_head_dim + qk_rope_head_dim`
    and value width `v_head_dim`."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0

    def __post_init__(self) -> None:
        _positive("attention.mla", kv_lora_rank=self.kv_lora_rank,
                  qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                  v_head_dim=self.v_head_dim)
        if isinstance(self.q_lora_rank, bool) or not isinstance(self.q_lora_rank, int) \
                or self.q_lora_rank < 0:
            raise bad(ConfigError, "attention.mla.q_lora_rank", self.q_lora_rank,
                      "must be an integer >= 0 (0: no query latent)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def down_width(self) -> int:
        """Outputs of the down projections, replicated over TP: the query latent (if any) and
        the key/value latent with the shared rotary key."""
        return self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim

    def up_width(self, num_heads: int) -> int:
        """Outputs of the per-head (TP-split) projections: queries and the keys/values."""
        return num_heads * self.qk_head_dim + num_heads * (self.qk_nope_head_dim + self.v_head_dim)


@dataclass(frozen=True)
class AttentionSpec:
    """Self-attention shapes. `output_gate` doubles the query projection (Qwen3.5-style gate).
    `mla` makes it multi-latent attention: then `num_kv_groups` equals `num_heads` and
    `head_dim` is the query/key head width (`qk_nope_head_dim + qk_rope_head_dim`)."""

    num_heads: int
    num_kv_groups: int
    head_dim: int
    output_gate: bool = False
    mla: MlaSpec | None = None

    def __post_init__(self) -> None:
        _positive("attention", num_heads=self.num_heads, num_kv_groups=self.num_kv_groups,
                  head_dim=self.head_dim)
        if self.num_heads % self.num_kv_groups:
            raise bad(ConfigError, "attention.num_kv_groups", self.num_kv_groups,
                      f"must divide num_heads={self.num_heads}")
        if isinstance(self.mla, dict):
            object.__setattr__(self, "mla", MlaSpec(**self.mla))
        if self.mla is not None:
            if self.num_kv_groups != self.num_heads:
                raise bad(ConfigError, "attention.num_kv_groups", self.num_kv_groups,
                          f"must equal num_heads={self.num_heads} with multi-latent attention")
            if self.head_dim != self.mla.qk_head_dim:
                raise bad(ConfigError, "attention.head_dim", self.head_dim,
                          f"must be qk_nope_head_dim + qk_rope_head_dim = {self.mla.qk_head_dim} "
                          "with multi-latent attention")
            if self.output_gate:
                raise bad(ConfigError, "attention.output_gate", True,
                          "is not supported with multi-latent attention")

    @property
    def qkv_width(self) -> int:
        """Output width of the fused QKV projection (query doubled when gated); with
        multi-latent attention, of all its query and key/value projections together."""
        if self.mla is not None:
            return self.mla.down_width + self.mla.up_width(self.num_heads)
        q = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        return q + 2 * self.num_kv_groups * self.head_dim

    def qkv_width_per_rank(self, tp: int) -> float:
        """`qkv_width` on one TP rank: MLA's down projections are replicated, the rest split."""
        if self.mla is not None:
            return self.mla.down_width + self.mla.up_width(self.num_heads) / tp
        return self.qkv_width / tp

    @property
    def core_width(self) -> int:
        """Width of the attention core output (input of the output projection)."""
        if self.mla is not None:
            return self.num_heads * self.mla.v_head_dim
        return self.num_heads * self.head_dim

    def to_dict(self) -> dict:
        out = {"num_heads": self.num_heads, "num_kv_groups": self.num_kv_groups,
               "head_dim": self.head_dim, "output_gate": self.output_gate}
        if self.mla is not None:
            out["mla"] = dict(self.mla.__dict__)
        return out


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


def qk_norm_by_name(name: str) -> bool:
    """The Megatron builder's default for query/key norms when nothing says: on for Qwen
    models (`megatron_build`), off otherwise."""
    return "qwen" in name.lower()


@dataclass(frozen=True, kw_only=True)
class ModelFeatures:
    """What a model family changes beyond its shapes; `pricing.feature_terms` prices each one.

    The defaults are the Llama/Qwen3 baseline the seeds traced, and `to_dict` writes only what
    differs from them. `qk_norm` None means the builder's default for the model's name
    (`qk_norm_by_name`); `ModelGeometry` stores an explicit value only where it differs.
    Sliding windows: with `sliding_window` > 0, layer i is full attention when
    (i + 1) % `full_attention_interval` == 0 (0: every layer slides), as Gemma and gpt-oss
    alternate them. Soft-caps are the tanh caps (0: none); routers score experts by softmax
    or sigmoid, optionally limited to the `router_group_top_k` best of `router_groups` groups.
    """

    qk_norm: bool | None = None
    qkv_bias: bool = False          # biases on the query/key/value projections (Qwen2)
    linear_bias: bool = False       # biases on every linear, experts included (gpt-oss)
    sliding_window: int = 0
    full_attention_interval: int = 0
    attention_sinks: bool = False   # a learned per-head sink logit in the softmax (gpt-oss)
    attention_softcap: float = 0.0  # tanh cap of the attention logits (Gemma 2)
    final_softcap: float = 0.0      # tanh cap of the output logits (Gemma 2)
    embedding_scale: bool = False   # embeddings multiplied by a constant (Gemma: sqrt(hidden); Granite)
    sandwich_norms: bool = False    # norms after attention and after the MLP as well (Gemma 2, 3)
    residual_scale: bool = False    # attention and MLP outputs scaled before the residual add (Granite)
    logit_scale: bool = False       # output logits divided by a constant (Granite's logits_scaling)
    post_norms: bool = False        # norms on the attention and MLP outputs, none before (OLMo 2)
    shared_expert_gate: bool = False  # a sigmoid gate on the shared expert's output (Qwen2-MoE)
    nope_layers: int = 0            # layers without rotary embeddings (SmolLM3's NoPE layers)
    read_as: str = ""               # this model_type, read as the family's by explicit opt-in
    mlp_activation: MlpActivation = MlpActivation.SWIGLU
    router_score: RouterScore = RouterScore.SOFTMAX
    router_groups: int = 1
    router_group_top_k: int = 1

    def __post_init__(self) -> None:
        for name, kind in (("mlp_activation", MlpActivation), ("router_score", RouterScore)):
            try:
                object.__setattr__(self, name, kind(getattr(self, name)))
            except ValueError:
                raise bad(ConfigError, f"model.features.{name}", getattr(self, name),
                          f"unknown; known: {', '.join(k.value for k in kind)}") from None
        for name in ("qkv_bias", "linear_bias", "attention_sinks", "embedding_scale", "sandwich_norms",
                     "residual_scale", "logit_scale", "post_norms", "shared_expert_gate"):
            if not isinstance(getattr(self, name), bool):
                raise bad(ConfigError, f"model.features.{name}", getattr(self, name), "must be true or false")
        if self.qk_norm is not None and not isinstance(self.qk_norm, bool):
            raise bad(ConfigError, "model.features.qk_norm", self.qk_norm, "must be true, false or null")
        if not isinstance(self.read_as, str):
            raise bad(ConfigError, "model.features.read_as", self.read_as, "must be a model_type string")
        for name in ("sliding_window", "full_attention_interval", "nope_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(ConfigError, f"model.features.{name}", value, "must be an integer >= 0")
        for name in ("attention_softcap", "final_softcap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise bad(ConfigError, f"model.features.{name}", value, "must be a number >= 0 (0: none)")
            object.__setattr__(self, name, float(value))
        _positive("model.features", router_groups=self.router_groups,
                  router_group_top_k=self.router_group_top_k)
        if self.router_group_top_k > self.router_groups:
            raise bad(ConfigError, "model.features.router_group_top_k", self.router_group_top_k,
                      f"must not exceed router_groups={self.router_groups}")

    def sliding_layers(self, num_layers: int) -> tuple[bool, ...]:
        """Whether each layer's attention uses the sliding window."""
        if not self.sliding_window:
            return (False,) * num_layers
        p = self.full_attention_interval
        return tuple(not (p and (i + 1) % p == 0) for i in range(num_layers))

    def to_dict(self) -> dict:
        """The fields that differ from the baseline (plain JSON)."""
        base = ModelFeatures()
        out = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if value != getattr(base, name):
                out[name] = value.value if isinstance(value, StrEnum) else value
        return out

    @classmethod
    def from_dict(cls, data: dict) -> ModelFeatures:
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise bad(ConfigError, "model.features", unknown[0], "unknown field")
        return cls(**data)


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
    features: ModelFeatures = ModelFeatures()
    extra: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        _positive("model", hidden=self.hidden, vocab=self.vocab)
        if isinstance(self.features, dict):
            object.__setattr__(self, "features", ModelFeatures.from_dict(self.features))
        if not isinstance(self.features, ModelFeatures):
            raise bad(ConfigError, "model.features", self.features, "must be a features object")
        if self.features.qk_norm is not None and self.features.qk_norm == qk_norm_by_name(self.name):
            # one spelling per geometry: the name's default is stored as None
            object.__setattr__(self, "features", replace(self.features, qk_norm=None))
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
        if self.features.sliding_window and self.attention is None:
            raise bad(ConfigError, "model.features.sliding_window", self.features.sliding_window,
                      "needs attention layers")
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

    @property
    def plain_dense(self) -> bool:
        """Whether every layer is plain attention (no output gate, no multi-latent attention)
        with a dense MLP, and the model has no GDN or MoE spec: the layers the structural TP1
        terms were traced on (`pricing.layout_terms.structural_at_tp1`). O(layers)."""
        att = self.attention
        return (att is not None and not att.output_gate and att.mla is None and self.gdn is None
                and self.moe is None and all(layer.mixer == MixerKind.ATTENTION and layer.mlp == MlpKind.DENSE
                                             for layer in self.layers))

    def to_dict(self) -> dict:
        """Plain-JSON form (stable key order) used by reports and `inspect --json`."""
        out: dict = {
            "name": self.name, "hidden": self.hidden, "ffn": self.ffn, "vocab": self.vocab,
            "dtype": self.dtype, "gated_mlp": self.gated_mlp, "tied_embeddings": self.tied_embeddings,
            "layers": [[layer.mixer.value, layer.mlp.value] for layer in self.layers],
        }
        out["attention"] = None if self.attention is None else self.attention.to_dict()
        for name in ("gdn", "moe"):
            spec = getattr(self, name)
            out[name] = None if spec is None else dict(spec.__dict__)
        features = self.features.to_dict()
        if features:
            out["features"] = features
        return out

    @property
    def qk_norm(self) -> bool:
        """Whether attention layers normalise queries and keys (explicit, else by name)."""
        if self.features.qk_norm is not None:
            return self.features.qk_norm
        return qk_norm_by_name(self.name)

    @classmethod
    def from_dict(cls, data: dict) -> ModelGeometry:
        """Inverse of `to_dict`; unknown keys are an error."""
        known = {"name", "hidden", "ffn", "vocab", "dtype", "gated_mlp", "tied_embeddings",
                 "layers", "attention", "gdn", "moe", "features"}
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
                features=ModelFeatures.from_dict(data.get("features") or {}),
            )
        except KeyError as exc:
            raise bad(ConfigError, f"model.{exc.args[0]}", None, "missing field") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"model: {exc}") from None
