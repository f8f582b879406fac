"""Model geometry from a Hugging Face `config.json` (plain, or a multimodal `text_config` wrapper),
its dict, or a `transformers` config object.

Field names are transformers' own, per family (`_FAMILIES`). A field that decides memory is
read from the config; where the public configs of a family leave it out, the default is the
family's transformers config class default (`_Family.defaults`, e.g. Gemma 3's vocabulary), and
anything with no such default (head_dim of Qwen models, the layer pattern of a hybrid, MLA
dimensions) must be present, so that a half-read config fails instead of being priced on a
guess. Every family sets its features (`geometry.ModelFeatures`) explicitly: none is read as
"like Llama" by omission. An unknown `model_type` fails with one line naming the supported ones.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from .errors import ConfigError, bad
from .geometry import (
    AttentionSpec,
    GdnSpec,
    LayerSpec,
    MixerKind,
    MlaSpec,
    MlpActivation,
    MlpKind,
    ModelFeatures,
    ModelGeometry,
    MoeSpec,
    RouterScore,
)

_ABSENT = object()


@dataclass(frozen=True, kw_only=True)
class _Family:
    """How one `model_type` is read.

    moe: None (dense), "qwen" (num_experts, mlp_only_layers, decoder_sparse_step), "mixtral"
    (num_local_experts; every layer MoE; intermediate_size is the expert width), "deepseek"
    (n_routed_experts, n_shared_experts, first_k_dense_replace, moe_layer_freq).
    sliding: None (no sliding windows read), "all" (sliding_window, when set, on every layer:
    Mistral, Phi-3), "qwen2" (use_sliding_window from max_window_layers on), "alternate"
    (layer_types, else full attention every second layer: Gemma 2, gpt-oss), "gemma3"
    (layer_types, else sliding_window_pattern).
    """

    hybrid: bool = False            # GDN/attention layers, by layer_types or full_attention_interval
    moe: str | None = None
    head_dim_default: bool = False  # head_dim defaults to hidden_size // num_attention_heads
    mla: bool = False               # DeepSeek multi-latent attention
    sliding: str | None = None
    gemma: bool = False             # GeGLU, sandwich norms, scaled embeddings
    qk_norm: bool = False
    qkv_bias: bool = False
    gpt_oss: bool = False           # biases everywhere, attention sinks, clamped SwiGLU
    granite: bool = False           # embedding/residual/logits multipliers; mlp_bias
    post_norms: bool = False        # norms on the attention and MLP outputs (OLMo 2)
    shared_expert_gate: bool = False  # sigmoid-gated shared expert (Qwen2-MoE)
    nope: bool = False              # no_rope_layers / no_rope_layer_interval (SmolLM3)
    bias_key: str | None = None     # the field that puts biases on q/k/v (and o): InternLM2's `bias`
    mlp_bias: bool = False          # `mlp_bias` puts biases on the MLP's linears too (every linear)
    activations: tuple[str, ...] = ()  # accepted hidden_act / hidden_activation values (empty: unchecked)
    defaults: Mapping[str, object] = field(default_factory=dict)  # transformers' class defaults


_SILU = ("silu", "swish")
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu")
_GEMMA2_DEFAULTS = {"vocab_size": 256000, "head_dim": 256, "sliding_window": 4096,
                    "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
                    "tie_word_embeddings": True}
_GEMMA3_DEFAULTS = {"vocab_size": 262208, "head_dim": 256, "sliding_window": 4096,
                    "sliding_window_pattern": 6, "final_logit_softcapping": None,
                    "attn_logit_softcapping": None, "tie_word_embeddings": True}
_DEEPSEEK = _Family(moe="deepseek", mla=True, activations=_SILU,
                    defaults={"first_k_dense_replace": 0, "moe_layer_freq": 1, "q_lora_rank": None,
                              "n_shared_experts": None, "n_group": 1, "topk_group": 1,
                              "topk_method": "greedy"})
_FAMILIES: dict[str, _Family] = {
    "llama": _Family(head_dim_default=True),
    "qwen3": _Family(qk_norm=True),
    "qwen3_moe": _Family(moe="qwen", qk_norm=True),
    "qwen3_5": _Family(hybrid=True, qk_norm=True),
    "qwen3_5_text": _Family(hybrid=True, qk_norm=True),
    "qwen3_5_moe": _Family(hybrid=True, moe="qwen", qk_norm=True),
    "qwen3_5_moe_text": _Family(hybrid=True, moe="qwen", qk_norm=True),
    "qwen2": _Family(head_dim_default=True, qkv_bias=True, sliding="qwen2", activations=_SILU,
                     defaults={"use_sliding_window": False, "sliding_window": 4096}),
    "mistral": _Family(head_dim_default=True, sliding="all", activations=_SILU,
                       defaults={"sliding_window": 4096}),
    "mixtral": _Family(head_dim_default=True, moe="mixtral", sliding="all", activations=_SILU,
                       defaults={"sliding_window": None}),
    "phi3": _Family(head_dim_default=True, sliding="all", activations=_SILU,
                    defaults={"sliding_window": None}),
    "gemma2": _Family(gemma=True, sliding="alternate", activations=_GELU_TANH,
                      defaults=_GEMMA2_DEFAULTS),
    "gemma3": _Family(gemma=True, sliding="gemma3", qk_norm=True, activations=_GELU_TANH,
                      defaults=_GEMMA3_DEFAULTS),
    "gemma3_text": _Family(gemma=True, sliding="gemma3", qk_norm=True, activations=_GELU_TANH,
                           defaults=_GEMMA3_DEFAULTS),
    "deepseek_v2": _DEEPSEEK,
    "deepseek_v3": _Family(moe="deepseek", mla=True, activations=_SILU,
                           defaults={**_DEEPSEEK.defaults, "scoring_func": "sigmoid",
                                     "topk_method": "noaux_tc"}),
    "gpt_oss": _Family(moe="mixtral", gpt_oss=True, sliding="alternate", activations=_SILU,
                       defaults={"attention_bias": True, "sliding_window": 128,
                                 "tie_word_embeddings": False}),
    "granite": _Family(head_dim_default=True, granite=True, bias_key="attention_bias",
                       mlp_bias=True, activations=_SILU,
                       defaults={"embedding_multiplier": 1.0, "logits_scaling": 1.0,
                                 "residual_multiplier": 1.0, "attention_multiplier": 1.0}),
    # InternLM2 (remote code): one fused `wqkv` in Megatron's grouped (h, q/k/v, d) layout,
    # `wo`, `w1`/`w3`/`w2`; `bias` (default true) on wqkv and wo.
    "internlm2": _Family(head_dim_default=True, bias_key="bias", activations=_SILU,
                         defaults={"bias": True, "tie_word_embeddings": False}),
    "olmo2": _Family(head_dim_default=True, post_norms=True, qk_norm=True, bias_key="attention_bias",
                     activations=_SILU),
    "qwen2_moe": _Family(head_dim_default=True, moe="qwen", qkv_bias=True, sliding="qwen2",
                         shared_expert_gate=True, activations=_SILU,
                         defaults={"use_sliding_window": False, "sliding_window": 4096}),
    "smollm3": _Family(head_dim_default=True, sliding="qwen2", nope=True, bias_key="attention_bias",
                       mlp_bias=True, activations=_SILU,
                       defaults={"use_sliding_window": False, "no_rope_layer_interval": 4,
                                 "tie_word_embeddings": True}),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_FAMILIES))

_LAYER_TYPES = {"full_attention": MixerKind.ATTENTION, "linear_attention": MixerKind.GDN,
                "sliding_attention": MixerKind.ATTENTION}
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
# Read from the wrapper when a multimodal text_config does not repeat them.
_OUTER_FALLBACK = ("tie_word_embeddings", "dtype", "torch_dtype")


class _Fields:
    """Typed access to a config dict; every error names the field (with its prefix) and the source.
    `defaults` are the family's transformers defaults, used when a field is absent (not when
    it is present as null: a null soft-cap means no cap)."""

    def __init__(self, data: dict, outer: dict | None, source: str,
                 defaults: Mapping[str, object] | None = None) -> None:
        self.data, self.outer, self.source = data, outer, source
        self.defaults = defaults or {}
        self.prefix = "text_config." if outer is not None else ""

    def lookup(self, key: str) -> object:
        """The value as written (None for null), or `_ABSENT`."""
        if key in self.data:
            return self.data[key]
        if self.outer is not None and key in _OUTER_FALLBACK and key in self.outer:
            return self.outer[key]
        return _ABSENT

    def raw(self, key: str) -> object:
        value = self.lookup(key)
        if value is _ABSENT:
            return self.defaults.get(key)
        return value

    def has(self, key: str) -> bool:
        return self.raw(key) is not None

    def fail(self, key: str, value: object, why: str) -> ConfigError:
        return bad(ConfigError, f"{self.prefix}{key}", value, f"{why} (in {self.source})")

    def int(self, key: str, default: int | None = None) -> int:
        value = self.raw(key)
        if value is None:
            if default is None:
                raise self.fail(key, None, "missing required field")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, value, "must be an integer")
        return value

    def first_int(self, *keys: str) -> int:
        """The first of several spellings that is present (errors name the first)."""
        for key in keys:
            if self.has(key):
                return self.int(key)
        raise self.fail(keys[0], None, "missing required field"
                        + (f" (or {', '.join(keys[1:])})" if len(keys) > 1 else ""))

    def number(self, key: str) -> float:
        """A non-negative number; null or absent (with no default) is 0."""
        value = self.raw(key)
        if value is None:
            return 0.0
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise self.fail(key, value, "must be a number >= 0 or null")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(key, value, "must be true or false")
        return value

    def str(self, key: str, allowed: tuple[str, ...]) -> str | None:
        value = self.raw(key)
        if value is None:
            return None
        if value not in allowed:
            raise self.fail(key, value, f"unsupported; supported: {', '.join(allowed)}")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self.raw(key)
        if value is None:
            return []
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int)
                                              for v in value):
            raise self.fail(key, value, "must be a list of layer indices")
        return value

    def dtype(self) -> str:
        key = "dtype" if self.has("dtype") else "torch_dtype"
        value = self.raw(key)
        if value is None:
            return "bf16"  # training dtype when the checkpoint does not say
        name = str(value).removeprefix("torch.")
        if name not in _DTYPES:
            raise self.fail(key, value, f"unsupported dtype; supported: {', '.join(_DTYPES)}")
        return _DTYPES[name]


def _read(path: Path) -> dict:
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise bad(ConfigError, "config", str(path), "no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(ConfigError, "config", str(path), f"not a readable JSON file: {exc}") from None
    if not isinstance(data, dict):
        raise bad(ConfigError, "config", str(path), "must hold a JSON object")
    return data


def _layer_types(f: _Fields, family: _Family, num_layers: int) -> list[str] | None:
    """layer_types as written (validated against the family), or None when absent."""
    if not f.has("layer_types"):
        return None
    types = f.raw("layer_types")
    if not isinstance(types, list) or len(types) != num_layers:
        raise f.fail("layer_types", types, f"must list one type for each of {num_layers} layers")
    allowed = ["full_attention"]
    if family.hybrid:
        allowed.append("linear_attention")
    if family.sliding is not None:
        allowed.append("sliding_attention")
    for value in types:
        if value not in allowed:
            raise f.fail("layer_types", value, f"unsupported layer type; supported: {', '.join(allowed)}")
    return types


def _mixers(f: _Fields, family: _Family, num_layers: int) -> list[MixerKind]:
    """Mixer kind of each layer, from layer_types, else full_attention_interval."""
    types = _layer_types(f, family, num_layers)
    if types is not None:
        return [_LAYER_TYPES[value] for value in types]
    if not family.hybrid:
        return [MixerKind.ATTENTION] * num_layers
    if not f.has("full_attention_interval"):
        raise f.fail("layer_types", None, "missing required field (or full_attention_interval)")
    interval = f.int("full_attention_interval")
    if interval <= 0:
        raise f.fail("full_attention_interval", interval, "must be a positive integer")
    # Counting from 1: layer i is full attention when (i + 1) % interval == 0 (transformers' rule).
    return [MixerKind.ATTENTION if (i + 1) % interval == 0 else MixerKind.GDN for i in range(num_layers)]


def _sliding(f: _Fields, family: _Family, num_layers: int) -> tuple[int, int]:
    """(sliding_window, full_attention_interval) as `ModelFeatures` stores them: window 0 when no
    layer slides; interval 0 when every layer slides, else P with layer i full attention
    exactly when (i + 1) % P == 0. A pattern of another shape fails (none of the supported
    families writes one)."""
    if family.sliding is None:
        return 0, 0
    window = f.int("sliding_window", 0)
    if window < 0:
        raise f.fail("sliding_window", window, "must be a positive integer or null")
    types = _layer_types(f, family, num_layers)
    if types is None:
        if family.sliding == "all":
            return window, 0
        if family.sliding == "qwen2":
            if not f.bool("use_sliding_window", False) or not window:
                return 0, 0
            first = f.int("max_window_layers", num_layers)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        else:
            key = "sliding_window_pattern" if family.sliding == "gemma3" else None
            period = f.int(key) if key else 2
            if period <= 0:
                raise f.fail(key, period, "must be a positive integer")
            types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                     for i in range(num_layers)]
    sliding = [t == "sliding_attention" for t in types]
    if not any(sliding):
        return 0, 0
    if not window:
        raise f.fail("sliding_window", f.raw("sliding_window"),
                     "must be a positive integer when layer_types has sliding_attention layers")
    if all(sliding):
        return window, 0
    period = sliding.index(False) + 1
    if any(s != bool((i + 1) % period) for i, s in enumerate(sliding)):
        raise f.fail("layer_types", types, "unsupported sliding-window pattern: full attention "
                     "must fall on every P-th layer (i + 1) % P == 0, or on none")
    return window, period


def _mlps(f: _Fields, family: _Family, num_layers: int) -> list[MlpKind]:
    """MLP kind of each layer, by the family's rule."""
    if family.moe is None:
        return [MlpKind.DENSE] * num_layers
    if family.moe == "mixtral":
        return [MlpKind.MOE] * num_layers
    if family.moe == "deepseek":
        if not f.has("n_routed_experts"):
            return [MlpKind.DENSE] * num_layers
        first = f.int("first_k_dense_replace")
        freq = f.int("moe_layer_freq")
        if first < 0:
            raise f.fail("first_k_dense_replace", first, "must be an integer >= 0")
        if freq <= 0:
            raise f.fail("moe_layer_freq", freq, "must be a positive integer")
        # DeepSeek's rule: MoE from layer first_k_dense_replace on, every moe_layer_freq-th layer.
        return [MlpKind.MOE if i >= first and i % freq == 0 else MlpKind.DENSE
                for i in range(num_layers)]
    # Qwen's rule: MoE unless listed in mlp_only_layers or off-step.
    step = f.int("decoder_sparse_step", 1)
    if step <= 0:
        raise f.fail("decoder_sparse_step", step, "must be a positive integer")
    dense_only = set(f.int_list("mlp_only_layers"))
    return [MlpKind.MOE if i not in dense_only and (i + 1) % step == 0 else MlpKind.DENSE
            for i in range(num_layers)]


def _moe(f: _Fields, family: _Family) -> MoeSpec:
    if family.moe == "mixtral":
        return MoeSpec(num_experts=f.int("num_local_experts"),
                       top_k=f.first_int("num_experts_per_tok", "experts_per_token"),
                       expert_ffn=f.int("intermediate_size"))
    if family.moe == "deepseek":
        expert_ffn = f.int("moe_intermediate_size")
        shared = f.int("n_shared_experts", 0)
        if shared < 0:
            raise f.fail("n_shared_experts", shared, "must be an integer >= 0 or null")
        return MoeSpec(num_experts=f.int("n_routed_experts"), top_k=f.int("num_experts_per_tok"),
                       expert_ffn=expert_ffn, shared_expert_ffn=shared * expert_ffn)
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts
    return MoeSpec(num_experts=f.first_int("num_experts", "num_local_experts"),
                   top_k=f.int("num_experts_per_tok"),
                   expert_ffn=f.int("moe_intermediate_size"),
                   shared_expert_ffn=f.int("shared_expert_intermediate_size", 0))


def _attention(f: _Fields, family: _Family, hidden: int, heads: int) -> AttentionSpec:
    if family.mla:
        q_lora = f.int("q_lora_rank", 0)
        if q_lora < 0:
            raise f.fail("q_lora_rank", q_lora, "must be a positive integer or null")
        mla = MlaSpec(kv_lora_rank=f.int("kv_lora_rank"), qk_nope_head_dim=f.int("qk_nope_head_dim"),
                      qk_rope_head_dim=f.int("qk_rope_head_dim"), v_head_dim=f.int("v_head_dim"),
                      q_lora_rank=q_lora)
        # HF's num_key_value_heads (= heads) and head_dim (the rotary width in newer
        # transformers) do not describe MLA's tensors; the MLA dimensions do.
        return AttentionSpec(num_heads=heads, num_kv_groups=heads, head_dim=mla.qk_head_dim, mla=mla)
    head_dim_default = hidden // heads if family.head_dim_default else None
    return AttentionSpec(
        num_heads=heads,
        num_kv_groups=f.int("num_key_value_heads", heads),  # transformers: MHA when absent
        head_dim=f.int("head_dim", head_dim_default),
        # Qwen3-Next / Qwen3.5 attention always gates its output unless told otherwise.
        output_gate=f.bool("attn_output_gate", True) if family.hybrid else False,
    )


def _router(f: _Fields, family: _Family) -> dict:
    """DeepSeek's router: softmax or sigmoid scores, group-limited top-k for the group methods."""
    if family.moe != "deepseek":
        return {}
    score = f.str("scoring_func", ("softmax", "sigmoid")) or "softmax"
    method = f.str("topk_method", ("greedy", "group_limited_greedy", "noaux_tc")) or "greedy"
    groups, group_top_k = 1, 1
    if method != "greedy":
        groups, group_top_k = f.int("n_group"), f.int("topk_group")
        if groups <= 0 or not 0 < group_top_k <= groups:
            raise f.fail("topk_group", group_top_k, f"must be in 1..n_group={groups}")
    return {"router_score": RouterScore(score), "router_groups": groups,
            "router_group_top_k": group_top_k}


def _features(f: _Fields, family: _Family, num_layers: int, has_moe: bool) -> ModelFeatures:
    """Everything the family changes beyond shapes, set explicitly for every family."""
    if family.activations:
        key = "hidden_activation" if f.has("hidden_activation") else "hidden_act"
        f.str(key, family.activations)
    window, interval = _sliding(f, family, num_layers)
    activation = MlpActivation.SWIGLU
    if family.gemma:
        activation = MlpActivation.GEGLU
    elif family.gpt_oss:
        activation = MlpActivation.CLAMPED_SWIGLU
    qkv_bias = family.qkv_bias or (f.bool(family.bias_key, False) if family.bias_key else False)
    linear_bias = f.bool("attention_bias", True) if family.gpt_oss else False
    if family.mlp_bias:   # biases on the MLP's linears too: every linear has one (none priced)
        linear_bias = f.bool("mlp_bias", False)
    # Granite's multipliers: attention_multiplier is the softmax scale (no memory); the others
    # each make one more tensor unless they are 1
    granite = {}
    if family.granite:
        granite = {"embedding_scale": f.number("embedding_multiplier") != 1.0,
                   "residual_scale": f.number("residual_multiplier") != 1.0,
                   "logit_scale": f.number("logits_scaling") != 1.0}
        f.number("attention_multiplier")
    return ModelFeatures(
        qk_norm=family.qk_norm, qkv_bias=qkv_bias and not linear_bias, linear_bias=linear_bias,
        sliding_window=window, full_attention_interval=interval,
        attention_sinks=family.gpt_oss,
        attention_softcap=f.number("attn_logit_softcapping") if family.gemma else 0.0,
        final_softcap=f.number("final_logit_softcapping") if family.gemma else 0.0,
        sandwich_norms=family.gemma, embedding_scale=family.gemma or granite.pop("embedding_scale", False),
        post_norms=family.post_norms, shared_expert_gate=family.shared_expert_gate and has_moe,
        nope_layers=_nope_layers(f, num_layers) if family.nope else 0,
        mlp_activation=activation, **granite, **(_router(f, family) if has_moe else {}),
    )


def _nope_layers(f: _Fields, num_layers: int) -> int:
    """How many layers skip RoPE (SmolLM3): `no_rope_layers` (1 = RoPE, 0 = none, one per
    layer), else every `no_rope_layer_interval`-th layer (transformers' rule)."""
    if f.has("no_rope_layers"):
        flags = f.raw("no_rope_layers")
        if not isinstance(flags, list) or len(flags) != num_layers or any(
                isinstance(v, bool) or v not in (0, 1) for v in flags):
            raise f.fail("no_rope_layers", flags, f"must list 0 or 1 for each of {num_layers} layers")
        return flags.count(0)
    interval = f.int("no_rope_layer_interval")
    if interval <= 0:
        raise f.fail("no_rope_layer_interval", interval, "must be a positive integer")
    return sum((i + 1) % interval == 0 for i in range(num_layers))


def _geometry(f: _Fields, model_type: str, name: str) -> ModelGeometry:
    family = _FAMILIES[model_type]
    hidden = f.int("hidden_size")
    num_layers = f.int("num_hidden_layers")
    if num_layers <= 0:
        raise f.fail("num_hidden_layers", num_layers, "must be a positive integer")
    heads = f.int("num_attention_heads")
    if heads <= 0:
        raise f.fail("num_attention_heads", heads, "must be a positive integer")
    mixers = _mixers(f, family, num_layers)
    mlps = _mlps(f, family, num_layers)

    attention = None
    if MixerKind.ATTENTION in mixers:
        attention = _attention(f, family, hidden, heads)
    gdn = None
    if MixerKind.GDN in mixers:
        gdn = GdnSpec(
            num_key_heads=f.int("linear_num_key_heads"),
            num_value_heads=f.int("linear_num_value_heads"),
            key_head_dim=f.int("linear_key_head_dim"),
            value_head_dim=f.int("linear_value_head_dim"),
            conv_kernel=f.int("linear_conv_kernel_dim"),
        )
    moe = _moe(f, family) if MlpKind.MOE in mlps else None
    # A model whose every layer is MoE has no dense MLP: its intermediate_size is unused
    # (Mixtral and gpt-oss name the expert width intermediate_size: it is read as such).
    ffn = f.int("intermediate_size") if MlpKind.DENSE in mlps else 0
    extra = {"source": f.source, "model_type": model_type}
    if MlpKind.DENSE not in mlps and f.has("intermediate_size") and family.moe != "mixtral":
        extra["hf_intermediate_size"] = f.int("intermediate_size")
    if family.mla and f.int("num_nextn_predict_layers", 0):
        # DeepSeek-V3's multi-token-prediction layers are not part of the decoder LoRA trains
        extra["mtp_layers_not_priced"] = f.int("num_nextn_predict_layers")
    features = _features(f, family, num_layers, MlpKind.MOE in mlps)
    tied_default = bool(family.defaults.get("tie_word_embeddings", False))
    return ModelGeometry(
        name=name, hidden=hidden, ffn=ffn, vocab=f.int("vocab_size"),
        layers=tuple(LayerSpec(m, p) for m, p in zip(mixers, mlps, strict=True)),
        attention=attention, gdn=gdn, moe=moe, dtype=f.dtype(), gated_mlp=True,
        tied_embeddings=f.bool("tie_word_embeddings", tied_default),
        features=features, extra=extra,
    )


def _as_dict(config: object) -> tuple[dict, str] | None:
    """A `transformers` config object's dict (duck-typed: anything with `to_dict()`)."""
    to_dict = getattr(config, "to_dict", None)
    if isinstance(config, dict) or not callable(to_dict):
        return None
    data = to_dict()
    if not isinstance(data, dict):
        raise bad(ConfigError, "config", type(config).__name__, "to_dict() did not return a dict")
    return data, f"<{type(config).__name__}>"


def load_hf_config(config: str | Path | dict | object, *, name: str | None = None,
                   as_family: str | None = None) -> ModelGeometry:
    """Geometry of a Hugging Face config: a `config.json` file, a directory holding one, its
    dict, or a `transformers` `PretrainedConfig` (anything with `to_dict()`; transformers is
    not imported here).

    `name` defaults to `_name_or_path`'s last part, else the checkpoint directory's name (the
    file's stem when it is not called config.json), else the model type. `as_family`
    (explicit opt-in): read a `model_type` no family supports with that supported family's
    fields (e.g. "llama" for a decoder with the standard fields); its basis is conservative,
    with the assumption as its reason (`ModelFeatures.read_as`).
    """
    converted = _as_dict(config)
    if converted is not None:
        (data, source), default_name = converted, None
    elif isinstance(config, dict):
        data, source, default_name = config, "<dict>", None
    elif isinstance(config, str | Path):
        path = Path(config)
        data = _read(path)
        source = str(path / "config.json" if path.is_dir() else path)
        # A checkpoint directory names the model; a loose file names it by its stem.
        file_named = path.is_dir() or path.name == "config.json"
        default_name = (path if path.is_dir() else path.parent).resolve().name if file_named \
            else path.stem
    else:
        raise bad(ConfigError, "config", type(config).__name__,
                  "must be a path, a dict or a transformers config (with to_dict())")
    outer = None
    if isinstance(data.get("text_config"), dict):
        outer, data = data, data["text_config"]
    model_type = data.get("model_type") or (outer or {}).get("model_type")
    if model_type is None:
        raise _Fields(data, outer, source).fail("model_type", None, "missing required field")
    read_as = ""
    if as_family is not None:
        if as_family not in _FAMILIES:
            raise bad(ConfigError, "as_family", as_family,
                      f"not a supported family; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if model_type in _FAMILIES:
            raise bad(ConfigError, "as_family", as_family,
                      f"model_type {model_type!r} is supported itself (in {source}); leave it out")
        if not isinstance(model_type, str):
            raise bad(ConfigError, "model_type", model_type, f"must be a string (in {source})")
        model_type, read_as = as_family, model_type
    if not isinstance(model_type, str) or model_type not in _FAMILIES:
        raise bad(ConfigError, "model_type", model_type,
                  f"unsupported (in {source}); to price a decoder with the standard fields as "
                  "Llama, conservatively: --as-family llama (Python: as_family=\"llama\"); "
                  f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}; see docs/adding-a-family.md")
    f = _Fields(data, outer, source, _FAMILIES[model_type].defaults)
    if name is None:
        name_or_path = (outer or data).get("_name_or_path")
        from_hub = Path(name_or_path).name if isinstance(name_or_path, str) and name_or_path else None
        name = from_hub or default_name or model_type
    try:
        geometry = _geometry(f, model_type, name)
        if read_as:
            geometry = replace(geometry, features=replace(geometry.features, read_as=read_as),
                               extra={**geometry.extra, "model_type": read_as, "read_as": model_type})
        return geometry
    except ConfigError as exc:
        if source in str(exc):
            raise
        raise ConfigError(f"{exc} (in {source})") from None
