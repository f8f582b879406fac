"""Read a waveplan geometry, layout, recompute and LoRA setting from a live Megatron model.

`geometry_from_megatron(model)` walks a Megatron-core `GPTModel` (or its decoder, or a
`TransformerBlock`): each decoder layer's mixer class (`SelfAttention` -> attention,
`MLASelfAttention` -> multi-latent attention, `GatedDeltaNet` -> gdn, anything else is a
`ConfigError` naming the module path and class) and MLP class (`MLP` -> dense, `MoELayer`
-> moe, its shared experts included), global sizes from the `TransformerConfig` checked
against the modules' per-partition weights, the family features the config expresses (q/k
norms, biases, sliding windows, sinks, the MLP activation, the router), LoRA adapters found
among the modules, parallel sizes from `parallel_state` and recompute settings from the
config. Features Megatron-core cannot express (soft-caps, sandwich norms, embedding scaling)
come from `model.waveplan_features` when `megatron_build` made the model, else are absent.
It never touches tensor data, so a model built on the `meta` device (no memory) works.

Adapters recognised: `megatron_build.LoraLinear`; modules with `lora_A`/`lora_B` holding a
2-D parameter or one linear each (PEFT style, one adapter per module); modules with an
`adapter` that has `linear_in`/`linear_out` (Megatron-Bridge style). The adapter's target
name is the attribute under which it sits (`linear_qkv`, `linear_fc1`, ...). All adapters
must share one rank; they become one LoRA slot named "default".

torch and megatron are imported lazily.
"""

from __future__ import annotations

import re

from ..errors import ConfigError, bad
from ..geometry import (
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
)
from ..lora import KNOWN_TARGETS, LoraConfig, LoraSlot, module_shapes
from ..parallel import ParallelLayout, Recompute, RecomputeMode

_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _decoder(model):
    """(decoder block, prefix of its path, the GPT model or None)."""
    if hasattr(model, "decoder") and hasattr(model.decoder, "layers"):
        return model.decoder, "decoder.", model
    module = getattr(model, "module", None)  # DDP / Float16Module wrappers
    if module is not None and module is not model:
        return _decoder(module)
    if hasattr(model, "layers"):
        return model, "", None
    raise bad(ConfigError, "model", type(model).__name__,
              "is not a Megatron GPTModel or TransformerBlock (no decoder layers)")


def _parallel(config) -> ParallelLayout:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        tp = ps.get_tensor_model_parallel_world_size()
        pp = ps.get_pipeline_model_parallel_world_size()
        cp = ps.get_context_parallel_world_size()
        ep = ps.get_expert_model_parallel_world_size()
        etp = ps.get_expert_tensor_parallel_world_size()
        dp = ps.get_data_parallel_world_size()
    else:
        tp = config.tensor_model_parallel_size
        pp = config.pipeline_model_parallel_size
        cp = config.context_parallel_size
        ep = config.expert_model_parallel_size
        etp = getattr(config, "expert_tensor_parallel_size", None)
        dp = 1
    # Megatron's default expert TP (= TP) stays None, so the layout round-trips as before
    return ParallelLayout(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp,
                          sequence_parallel=bool(config.sequence_parallel) and tp > 1,
                          etp=None if etp in (None, tp) else etp)


def _recompute(config) -> Recompute:
    gran = config.recompute_granularity
    if gran is None:
        return Recompute(mode=RecomputeMode.NONE)
    if gran == "full":
        return Recompute(mode=RecomputeMode.FULL, method=config.recompute_method or "uniform",
                         num_layers=config.recompute_num_layers or 1,
                         modules=tuple(config.recompute_modules or ("core_attn",)))
    if gran == "selective":
        return Recompute(mode=RecomputeMode.SELECTIVE,
                         modules=tuple(config.recompute_modules or ("core_attn",)))
    raise bad(ConfigError, "config.recompute_granularity", gran, "must be full, selective or None")


def _weight_shape(module, path: str) -> tuple[int, int]:
    base = module
    for name in ("base", "base_layer", "to_wrap"):  # ours, PEFT, Megatron-Bridge
        inner = getattr(module, name, None)
        if inner is not None and hasattr(inner, "weight"):
            base = inner
            break
    weight = getattr(base, "weight", None)
    if weight is None or weight.dim() != 2:
        raise bad(ConfigError, path, type(module).__name__, "has no 2-D weight")
    return tuple(weight.shape)


def _mixer(layer, path: str, tp: int, config):
    from megatron.core.transformer.attention import SelfAttention

    try:
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    except ImportError:  # pragma: no cover - older megatron-core
        GatedDeltaNet = ()  # noqa: N806

    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    mixer = getattr(layer, "self_attention", None)
    mpath = f"{path}.self_attention"
    if mixer is None:
        raise bad(ConfigError, mpath, None, "decoder layer has no self_attention module")
    if isinstance(mixer, MLASelfAttention):
        mla = MlaSpec(kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_head_dim,
                      qk_rope_head_dim=config.qk_pos_emb_head_dim, v_head_dim=config.v_head_dim,
                      q_lora_rank=config.q_lora_rank or 0)
        heads = config.num_attention_heads
        spec = AttentionSpec(num_heads=heads, num_kv_groups=heads, head_dim=mla.qk_head_dim, mla=mla)
        out_local, _ = _weight_shape(mixer.linear_kv_up_proj, f"{mpath}.linear_kv_up_proj")
        if out_local * tp != heads * (mla.qk_nope_head_dim + mla.v_head_dim):
            raise bad(ConfigError, f"{mpath}.linear_kv_up_proj", out_local * tp,
                      f"width differs from the MLA shapes' {heads * (mla.qk_nope_head_dim + mla.v_head_dim)}")
        return MixerKind.ATTENTION, spec
    if GatedDeltaNet and isinstance(mixer, GatedDeltaNet):
        spec = GdnSpec(num_key_heads=mixer.num_key_heads, num_value_heads=mixer.num_value_heads,
                       key_head_dim=mixer.key_head_dim, value_head_dim=mixer.value_head_dim,
                       conv_kernel=mixer.conv_kernel_dim)
        out_local, _ = _weight_shape(mixer.in_proj, f"{mpath}.in_proj")
        if out_local * tp != spec.in_proj_width:
            raise bad(ConfigError, f"{mpath}.in_proj", out_local * tp,
                      f"width differs from the GDN shapes' {spec.in_proj_width}")
        return MixerKind.GDN, spec
    if isinstance(mixer, SelfAttention):
        spec = AttentionSpec(
            num_heads=mixer.num_attention_heads_per_partition * tp,
            num_kv_groups=mixer.num_query_groups_per_partition * tp,
            head_dim=mixer.hidden_size_per_attention_head,
            output_gate=bool(getattr(config, "attention_output_gate", False)))
        out_local, _ = _weight_shape(mixer.linear_qkv, f"{mpath}.linear_qkv")
        if out_local * tp != spec.qkv_width:
            raise bad(ConfigError, f"{mpath}.linear_qkv", out_local * tp,
                      f"width differs from the attention shapes' {spec.qkv_width}")
        return MixerKind.ATTENTION, spec
    raise bad(ConfigError, mpath, f"{type(mixer).__module__}.{type(mixer).__name__}",
              "unknown mixer module (known: SelfAttention -> attention, MLASelfAttention -> "
              "multi-latent attention, GatedDeltaNet -> gdn)")


def _activation(config) -> MlpActivation:
    """The gated MLP's activation from `activation_func` (and gpt-oss's clamp and offset)."""
    import torch.nn.functional as F
    from megatron.core.activations import fast_gelu, quick_gelu

    from .megatron_build import gelu_tanh

    fn = config.activation_func
    if fn is F.silu:
        return MlpActivation.SWIGLU
    if fn in (gelu_tanh, fast_gelu):
        return MlpActivation.GEGLU
    if fn is quick_gelu and config.glu_linear_offset == 1.0 \
            and config.activation_func_clamp_value is not None:
        return MlpActivation.CLAMPED_SWIGLU
    raise bad(ConfigError, "config.activation_func", getattr(fn, "__name__", fn),
              "unknown MLP activation (known: silu, a tanh GELU, quick_gelu clamped with offset 1)")


def _window(config) -> tuple[int, int]:
    """(sliding_window, full_attention_interval) from window_size and window_attn_skip_freq."""
    window = config.window_size
    if not window:
        return 0, 0
    freq = config.window_attn_skip_freq
    if freq is None:
        return int(window[0]), 0
    if isinstance(freq, int):
        return int(window[0]), freq
    n = len(freq)
    period = next((i + 1 for i, slides in enumerate(freq) if not slides), 0)
    if period and any(bool(s) != bool((i + 1) % period) for i, s in enumerate(freq)):
        raise bad(ConfigError, "config.window_attn_skip_freq", freq,
                  f"pattern over {n} layers is not full attention on every P-th layer")
    return (int(window[0]), period) if any(freq) else (0, 0)


def _features(config, gpt, mla: bool) -> ModelFeatures:
    """The family features the config expresses, plus what `megatron_build` recorded."""
    window, interval = _window(config)
    router = {}
    if config.num_moe_experts:
        router = {"router_score": config.moe_router_score_function,
                  "router_groups": config.moe_router_num_groups or 1,
                  "router_group_top_k": config.moe_router_group_topk or 1}
    recorded = dict(getattr(gpt, "waveplan_features", {}) or {})
    return ModelFeatures(
        qk_norm=False if mla else bool(config.qk_layernorm),  # MLA: latent norms, not q/k
        qkv_bias=bool(config.add_qkv_bias) and not config.add_bias_linear,
        linear_bias=bool(config.add_bias_linear), sliding_window=window,
        full_attention_interval=interval, attention_sinks=config.softmax_type == "learnable",
        shared_expert_gate=bool(config.num_moe_experts and config.moe_shared_expert_intermediate_size
                                and getattr(config, "moe_shared_expert_gate", False)),
        mlp_activation=_activation(config), **router, **recorded)


def _mlp(layer, path: str, tp: int, config):
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    mlp = getattr(layer, "mlp", None)
    mpath = f"{path}.mlp"
    if isinstance(mlp, MoELayer):
        shared = getattr(mlp, "shared_experts", None)
        shared_ffn = 0
        if shared is not None:
            _, in_local = _weight_shape(shared.linear_fc2, f"{mpath}.shared_experts.linear_fc2")
            shared_ffn = in_local * tp
        spec = MoeSpec(num_experts=config.num_moe_experts, top_k=mlp.router.topk,
                       expert_ffn=config.moe_ffn_hidden_size, shared_expert_ffn=shared_ffn)
        return MlpKind.MOE, spec
    if isinstance(mlp, MLP):
        fc1_out, _ = _weight_shape(mlp.linear_fc1, f"{mpath}.linear_fc1")
        _, fc2_in = _weight_shape(mlp.linear_fc2, f"{mpath}.linear_fc2")
        ffn = fc2_in * tp
        gated = bool(config.gated_linear_unit)
        if fc1_out * tp != (2 if gated else 1) * ffn:
            raise bad(ConfigError, f"{mpath}.linear_fc1", fc1_out * tp,
                      f"width differs from {'2 x ' if gated else ''}ffn={ffn}")
        return MlpKind.DENSE, ffn
    name = None if mlp is None else f"{type(mlp).__module__}.{type(mlp).__name__}"
    raise bad(ConfigError, mpath, name, "unknown MLP module (known: MLP -> dense, MoELayer -> moe)")


def _config_patterns(config) -> list[LayerSpec] | None:
    """Per-layer kinds from the config alone (for the layers another PP stage holds)."""
    n = config.num_layers
    lin = getattr(config, "linear_attention_freq", None)
    if getattr(config, "experimental_attention_variant", None) == "gated_delta_net":
        if isinstance(lin, int):
            mixers = [MixerKind.ATTENTION if (i + 1) % lin == 0 else MixerKind.GDN for i in range(n)]
        elif isinstance(lin, list):
            mixers = [MixerKind.GDN if x else MixerKind.ATTENTION for x in lin]
        else:
            return None
    else:
        mixers = [MixerKind.ATTENTION] * n
    if config.num_moe_experts:
        freq = config.moe_layer_freq
        if isinstance(freq, int):
            mlps = [MlpKind.MOE if i % freq == 0 else MlpKind.DENSE for i in range(n)]
        else:
            mlps = [MlpKind.MOE if x else MlpKind.DENSE for x in freq]
    else:
        mlps = [MlpKind.DENSE] * n
    return [LayerSpec(m, p) for m, p in zip(mixers, mlps, strict=True)]


def _adapters(root):
    """[(path, layer index or None, target, rank, in_local, out_local)] of every adapter."""
    from torch import nn

    from .megatron_build import LoraLinear

    def shape(obj):
        if isinstance(obj, nn.Parameter) or hasattr(obj, "dim"):
            return tuple(obj.shape) if obj.dim() == 2 else None
        if isinstance(obj, nn.ModuleDict) and len(obj) == 1:
            obj = next(iter(obj.values()))
        weight = getattr(obj, "weight", None)
        return tuple(weight.shape) if weight is not None and weight.dim() == 2 else None

    found = []
    for path, module in root.named_modules():
        if not path:
            continue
        if isinstance(module, LoraLinear):
            a, b = tuple(module.lora_A.shape), tuple(module.lora_B.shape)
        elif hasattr(module, "lora_A") and hasattr(module, "lora_B"):
            a, b = shape(module.lora_A), shape(module.lora_B)
            if a is None or b is None:
                raise bad(ConfigError, path, type(module).__name__,
                          "has lora_A/lora_B that are not one 2-D weight each")
        elif hasattr(module, "adapter") and hasattr(module.adapter, "linear_in") \
                and hasattr(module.adapter, "linear_out"):
            a, b = shape(module.adapter.linear_in), shape(module.adapter.linear_out)
            if a is None or b is None:
                raise bad(ConfigError, path, type(module).__name__, "adapter has no 2-D weights")
        else:
            continue
        rank, d_in = a
        d_out, rank_b = b
        if rank != rank_b:
            raise bad(ConfigError, path, (a, b), "LoRA A and B ranks differ")
        match = _LAYER_RE.search("." + path + ".")
        target = path.rsplit(".", 1)[-1]
        found.append((path, int(match.group(1)) if match else None, target, rank, d_in, d_out))
    return found


def geometry_from_megatron(model) -> tuple[ModelGeometry, ParallelLayout, Recompute, LoraConfig]:
    """Geometry, parallel layout, recompute and LoRA setting of a live Megatron-core model.

    Works on a `meta`-device model. Raises `ConfigError` naming the module path for an
    unknown mixer or MLP module, and for shapes that disagree with the config.
    """
    decoder, prefix, gpt = _decoder(model)
    config = decoder.config
    layout = _parallel(config)
    tp = layout.tp
    local: dict[int, LayerSpec] = {}
    att = gdn = moe = None
    ffn = 0
    for i, layer in enumerate(decoder.layers):
        path = f"{prefix}layers.{i}"
        number = getattr(layer, "layer_number", i + 1) - 1
        mixer, mspec = _mixer(layer, path, tp, config)
        mlp, pspec = _mlp(layer, path, tp, config)
        if mixer == MixerKind.ATTENTION:
            if att is not None and att != mspec:
                raise bad(ConfigError, f"{path}.self_attention", mspec, f"differs from {att}")
            att = mspec
        else:
            if gdn is not None and gdn != mspec:
                raise bad(ConfigError, f"{path}.self_attention", mspec, f"differs from {gdn}")
            gdn = mspec
        if mlp == MlpKind.MOE:
            moe = pspec
        else:
            if ffn and ffn != pspec:
                raise bad(ConfigError, f"{path}.mlp", pspec, f"ffn differs from {ffn}")
            ffn = pspec
        local[number] = LayerSpec(mixer, mlp)
    n = config.num_layers
    if len(local) == n and set(local) == set(range(n)):
        layers = [local[i] for i in range(n)]
    else:  # a pipeline stage: the other stages' layers come from the config's patterns
        layers = _config_patterns(config)
        if layers is None or len(layers) != n:
            raise bad(ConfigError, "config.num_layers", n,
                      f"this stage holds layers {sorted(local)} and the config gives no pattern")
        for i, spec in local.items():
            if layers[i] != spec:
                raise bad(ConfigError, f"{prefix}layers", i, f"is {spec} but the config says {layers[i]}")
        if any(s.mixer == MixerKind.ATTENTION for s in layers) and att is None:
            att = AttentionSpec(num_heads=config.num_attention_heads,
                                num_kv_groups=config.num_query_groups or config.num_attention_heads,
                                head_dim=config.kv_channels,
                                output_gate=bool(getattr(config, "attention_output_gate", False)))
        if any(s.mlp == MlpKind.DENSE for s in layers) and not ffn:
            ffn = config.ffn_hidden_size
        if any(s.mlp == MlpKind.MOE for s in layers) and moe is None:
            moe = MoeSpec(num_experts=config.num_moe_experts, top_k=config.moe_router_topk,
                          expert_ffn=config.moe_ffn_hidden_size,
                          shared_expert_ffn=config.moe_shared_expert_intermediate_size or 0)
    vocab = _vocab(gpt, decoder)
    dtype = _DTYPES.get(str(config.params_dtype))
    if dtype is None:
        raise bad(ConfigError, "config.params_dtype", str(config.params_dtype), "unsupported dtype")
    extra = dict(getattr(gpt, "waveplan_extra", {}) or {})
    extra.setdefault("qk_layernorm", bool(config.qk_layernorm))
    mla = bool(getattr(config, "multi_latent_attention", False))
    geometry = ModelGeometry(
        name=getattr(gpt, "waveplan_geometry_name", None) or "megatron",
        hidden=config.hidden_size, ffn=ffn, vocab=vocab, layers=tuple(layers),
        attention=att, gdn=gdn, moe=moe, dtype=dtype, gated_mlp=bool(config.gated_linear_unit),
        tied_embeddings=bool(getattr(gpt, "share_embeddings_and_output_weights", False)),
        features=_features(config, gpt, mla), extra=extra)
    offset = min(local) if local else 0
    lora = _lora(model, geometry, tp, offset)
    return geometry, layout, _recompute(config), lora


def _vocab(gpt, decoder) -> int:
    if gpt is not None and getattr(gpt, "vocab_size", None):
        return int(gpt.vocab_size)
    emb = getattr(getattr(gpt, "embedding", None), "word_embeddings", None)
    if emb is not None:
        return int(emb.num_embeddings)
    raise bad(ConfigError, "model", type(decoder).__name__,
              "gives no vocabulary size (pass the GPTModel, not only its decoder)")


def _lora(model, geometry: ModelGeometry, tp: int, offset: int = 0) -> LoraConfig:
    found = _adapters(model)
    if not found:
        return LoraConfig(slots=())
    ranks = sorted({rank for *_, rank, _, _ in found})
    if len(ranks) > 1:
        raise bad(ConfigError, "lora.rank", ranks, "adapters of several ranks: one slot needs one rank")
    targets = []
    layers = set()
    for path, layer, target, _rank, d_in, d_out in found:
        if target not in KNOWN_TARGETS:
            raise bad(ConfigError, path, target,
                      f"adapter on an unknown target; known: {', '.join(KNOWN_TARGETS)}")
        if layer is None:
            raise bad(ConfigError, path, None, "adapter outside the decoder layers")
        layer += offset
        expected = module_shapes(geometry, layer, tp).get(target)
        if expected != (d_in, d_out):
            raise bad(ConfigError, path, (d_in, d_out),
                      f"adapter shape differs from the geometry's {target} {expected}")
        if target not in targets:
            targets.append(target)
        layers.add(layer)
    order = [t for t in KNOWN_TARGETS if t in targets]
    slot_layers = None if layers == set(range(geometry.num_layers)) else tuple(sorted(layers))
    return LoraConfig(slots=(LoraSlot(name="default", rank=ranks[0], targets=tuple(order),
                                      layers=slot_layers),))
