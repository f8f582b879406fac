"""Model geometry from a Hugging Face `config.json` (plain, or a multimodal `text_config` wrapper).

Field names are transformers' own. Defaults are taken only where transformers documents the
same default for every supported model type; anything that decides memory and has no such
default (head_dim of Qwen models, the layer pattern of a hybrid) must be present, so that a
half-read config fails instead of being priced on a guess.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError, bad
from .geometry import AttentionSpec, GdnSpec, LayerSpec, MixerKind, MlpKind, ModelGeometry, MoeSpec


@dataclass(frozen=True, kw_only=True)
class _Family:
    hybrid: bool  # GDN/attention layers, described by layer_types or full_attention_interval
    moe: bool
    head_dim_default: bool = False  # llama: head_dim defaults to hidden_size // num_attention_heads


_DENSE = _Family(hybrid=False, moe=False)
_FAMILIES: dict[str, _Family] = {
    "llama": _Family(hybrid=False, moe=False, head_dim_default=True),
    "qwen3": _DENSE,
    "qwen3_moe": _Family(hybrid=False, moe=True),
    "qwen3_5": _Family(hybrid=True, moe=False),
    "qwen3_5_text": _Family(hybrid=True, moe=False),
    "qwen3_5_moe": _Family(hybrid=True, moe=True),
    "qwen3_5_moe_text": _Family(hybrid=True, moe=True),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_FAMILIES))

_LAYER_TYPES = {"full_attention": MixerKind.ATTENTION, "linear_attention": MixerKind.GDN}
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
# Read from the wrapper when a multimodal text_config does not repeat them.
_OUTER_FALLBACK = ("tie_word_embeddings", "dtype", "torch_dtype")


class _Fields:
    """Typed access to a config dict; every error names the field (with its prefix) and the source."""

    def __init__(self, data: dict, outer: dict | None, source: str) -> None:
        self.data, self.outer, self.source = data, outer, source
        self.prefix = "text_config." if outer is not None else ""

    def raw(self, key: str) -> object:
        if key in self.data:
            return self.data[key]
        if self.outer is not None and key in _OUTER_FALLBACK:
            return self.outer.get(key)
        return None

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

    def bool(self, key: str, default: bool) -> bool:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(key, value, "must be true or false")
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


def _mixers(f: _Fields, family: _Family, num_layers: int) -> list[MixerKind]:
    """Mixer kind of each layer, from layer_types, else full_attention_interval."""
    if f.has("layer_types"):
        types = f.raw("layer_types")
        if not isinstance(types, list) or len(types) != num_layers:
            raise f.fail("layer_types", types, f"must list one type for each of {num_layers} layers")
        allowed = _LAYER_TYPES if family.hybrid else {"full_attention": MixerKind.ATTENTION}
        for value in types:
            if value not in allowed:
                raise f.fail("layer_types", value, f"unsupported layer type; supported: {', '.join(allowed)}")
        return [allowed[value] for value in types]
    if not family.hybrid:
        return [MixerKind.ATTENTION] * num_layers
    if not f.has("full_attention_interval"):
        raise f.fail("layer_types", None, "missing required field (or full_attention_interval)")
    interval = f.int("full_attention_interval")
    if interval <= 0:
        raise f.fail("full_attention_interval", interval, "must be a positive integer")
    # Counting from 1: layer i is full attention when (i + 1) % interval == 0 (transformers' rule).
    return [MixerKind.ATTENTION if (i + 1) % interval == 0 else MixerKind.GDN for i in range(num_layers)]


def _mlps(f: _Fields, family: _Family, num_layers: int) -> list[MlpKind]:
    """MLP kind of each layer, by Qwen's rule: MoE unless listed in mlp_only_layers or off-step."""
    if not family.moe:
        return [MlpKind.DENSE] * num_layers
    step = f.int("decoder_sparse_step", 1)
    if step <= 0:
        raise f.fail("decoder_sparse_step", step, "must be a positive integer")
    dense_only = set(f.int_list("mlp_only_layers"))
    return [MlpKind.MOE if i not in dense_only and (i + 1) % step == 0 else MlpKind.DENSE
            for i in range(num_layers)]


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
        head_dim_default = hidden // heads if family.head_dim_default else None
        attention = AttentionSpec(
            num_heads=heads,
            num_kv_groups=f.int("num_key_value_heads", heads),  # transformers: MHA when absent
            head_dim=f.int("head_dim", head_dim_default),
            # Qwen3-Next / Qwen3.5 attention always gates its output unless told otherwise.
            output_gate=f.bool("attn_output_gate", True) if family.hybrid else False,
        )
    gdn = None
    if MixerKind.GDN in mixers:
        gdn = GdnSpec(
            num_key_heads=f.int("linear_num_key_heads"),
            num_value_heads=f.int("linear_num_value_heads"),
            key_head_dim=f.int("linear_key_head_dim"),
            value_head_dim=f.int("linear_value_head_dim"),
            conv_kernel=f.int("linear_conv_kernel_dim"),
        )
    moe = None
    if MlpKind.MOE in mlps:
        moe = MoeSpec(
            num_experts=f.int("num_experts"),
            top_k=f.int("num_experts_per_tok"),
            expert_ffn=f.int("moe_intermediate_size"),
            shared_expert_ffn=f.int("shared_expert_intermediate_size", 0),
        )
    # A model whose every layer is MoE has no dense MLP: its intermediate_size is unused.
    ffn = f.int("intermediate_size") if MlpKind.DENSE in mlps else 0
    extra = {"source": f.source, "model_type": model_type}
    if MlpKind.DENSE not in mlps and f.has("intermediate_size"):
        extra["hf_intermediate_size"] = f.int("intermediate_size")
    return ModelGeometry(
        name=name, hidden=hidden, ffn=ffn, vocab=f.int("vocab_size"),
        layers=tuple(LayerSpec(m, p) for m, p in zip(mixers, mlps, strict=True)),
        attention=attention, gdn=gdn, moe=moe, dtype=f.dtype(), gated_mlp=True,
        tied_embeddings=f.bool("tie_word_embeddings", False),  # every supported type: False
        extra=extra,
    )


def load_hf_config(path_or_dict: str | Path | dict, *, name: str | None = None) -> ModelGeometry:
    """Geometry of a Hugging Face `config.json` (a file, a directory holding one, or its dict).

    `name` defaults to `_name_or_path`'s last part, else the checkpoint directory's name (the
    file's stem when it is not called config.json), else the model type.
    """
    if isinstance(path_or_dict, dict):
        data, source, default_name = path_or_dict, "<dict>", None
    else:
        path = Path(path_or_dict)
        data = _read(path)
        source = str(path / "config.json" if path.is_dir() else path)
        # A checkpoint directory names the model; a loose file names it by its stem.
        file_named = path.is_dir() or path.name == "config.json"
        default_name = (path if path.is_dir() else path.parent).resolve().name if file_named \
            else path.stem
    outer = None
    if isinstance(data.get("text_config"), dict):
        outer, data = data, data["text_config"]
    f = _Fields(data, outer, source)
    model_type = data.get("model_type") or (outer or {}).get("model_type")
    if model_type is None:
        raise f.fail("model_type", None, "missing required field")
    if not isinstance(model_type, str) or model_type not in _FAMILIES:
        raise bad(ConfigError, "model_type", model_type,
                  f"unsupported (in {source}); supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if name is None:
        name_or_path = (outer or data).get("_name_or_path")
        from_hub = Path(name_or_path).name if isinstance(name_or_path, str) else None
        name = from_hub or default_name or model_type
    try:
        return _geometry(f, model_type, name)
    except ConfigError as exc:
        if source in str(exc):
            raise
        raise ConfigError(f"{exc} (in {source})") from None
