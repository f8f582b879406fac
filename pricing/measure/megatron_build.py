"""A Megatron-core `GPTModel` whose shapes match a waveplan `ModelGeometry`, with LoRA adapters
and the CPU stand-ins for flash attention and FLA's GDN kernel (`build_gpt`).
See docs/measurement.md#megatron-build.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402  (this module is only imported when torch is wanted)
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from ..errors import ConfigError, bad  # noqa: E402
from ..geometry import MixerKind, MlpActivation, MlpKind, ModelGeometry  # noqa: E402
from ..lora import ALL_TARGETS, MLA_TARGETS  # noqa: E402
from ..parallel import ParallelLayout, Recompute, RecomputeMode  # noqa: E402
from .thd import bounds_of  # noqa: E402

# Megatron-core's attribute name -> waveplan's target name (they are the same today).
_COLUMN, _ROW = "column", "row"


class LoraLinear(nn.Module):
    """A LoRA adapter around a Megatron linear module that returns `(output, bias)`.

    `y = base(x) + scaling * B(A(x))` with A: (rank x in_local) and B: (out_local x rank).
    Column-parallel bases shard B's output with theirs; row-parallel bases shard A's input
    with theirs, B is replicated and the rank-r product is all-reduced over TP (and split
    back over the sequence under sequence parallelism). Attributes the wrapper lacks are
    read from the base, so code that reads `linear_fc1.weight` keeps working.
    """

    def __init__(self, base: nn.Module, rank: int, *, alpha: float | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        weight = getattr(base, "weight", None)
        if weight is None or weight.dim() != 2:
            raise bad(ConfigError, "lora.target", type(base).__name__,
                      "has no 2-D weight to adapt")
        self.base = base
        self.rank = int(rank)
        self.scaling = (alpha if alpha is not None else 2.0 * rank) / rank
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        if isinstance(base, RowParallelLinear) or getattr(base, "input_is_parallel", False):
            self.parallel_mode = _ROW
        elif isinstance(base, ColumnParallelLinear):
            self.parallel_mode = _COLUMN
        else:
            self.parallel_mode = None
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False))
        out_local, in_local = weight.shape
        kw = {"device": weight.device, "dtype": dtype or weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(self.rank, in_local, **kw))
        self.lora_B = nn.Parameter(torch.empty(out_local, self.rank, **kw))
        if weight.device.type != "meta":
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B)
        for param in base.parameters():
            param.requires_grad_(False)

    @property
    def in_features(self) -> int:
        return self.lora_A.shape[1]

    @property
    def out_features(self) -> int:
        return self.lora_B.shape[0]

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base"), name)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        from megatron.core.tensor_parallel import mappings

        out, bias = self.base(x, *args, **kwargs)
        h = x
        if self.parallel_mode == _COLUMN and self.sequence_parallel:
            h = mappings.gather_from_sequence_parallel_region(h)
        h = F.linear(h, self.lora_A)
        if self.parallel_mode == _ROW:
            h = mappings.reduce_from_tensor_model_parallel_region(h)
        y = F.linear(h, self.lora_B) * self.scaling
        if self.parallel_mode == _ROW and self.sequence_parallel:
            y = mappings.scatter_to_sequence_parallel_region(y)
        return out + y, bias


def _sdpa_attention_class():
    from megatron.core.transformer.module import MegatronModule

    class SdpaAttention(MegatronModule):
        """Causal core attention with torch SDPA, standing in for flash attention.

        Input `[s, b, heads, d]` (or THD `[t, heads, d]` with `packed_seq_params`), output
        `[s, b, heads * d]` (THD: `[t, heads * d]`), like Megatron's core attention modules.
        """

        def __init__(self, config, layer_number=None, attn_mask_type=None, attention_type=None,
                     attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                     pg_collection=None, **kwargs) -> None:
            super().__init__(config=config)
            self.softmax_scale = softmax_scale
            self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
            self.softmax_offset = None
            if config.softmax_type == "learnable":  # attention sinks (gpt-oss), as Megatron's
                heads = config.num_attention_heads // config.tensor_model_parallel_size
                self.softmax_offset = nn.Parameter(torch.zeros(
                    heads, device=torch.cuda.current_device(), dtype=config.params_dtype))

        def _sdpa(self, q, k, v):
            if self.softmax_offset is None or q.device.type == "cuda":
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.softmax_scale,
                    dropout_p=self.dropout_p if self.training else 0.0,
                    enable_gqa=q.shape[1] != k.shape[1])
            # A sink logit z per head joins each row's softmax: out x sigmoid(lse - z), with
            # lse the row's log-sum-exp (kept by the flash kernel, which takes grouped keys as they are). The rescaled output is a
            # new bf16 [heads, s, d] tensor and sigmoid(lse - z) an fp32 [heads, s] one (a
            # fused kernel applies the sink in-kernel and holds neither). On CUDA the sink
            # is not run (the flash op's lse is not public there): a note says so.
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, is_causal=True, scale=self.softmax_scale)
            gate = torch.sigmoid(lse - self.softmax_offset.float()[None, :, None])
            return out * gate.to(out.dtype).unsqueeze(-1)

        def _one(self, q, k, v):
            # q: [b, s, h, d] -> [b, h, s, d]
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            dv = v.shape[-1]
            if dv != q.shape[-1]:
                # multi-latent attention: values narrower than queries/keys. torch's CPU
                # flash kernel wants one head width (else it falls back to the math kernel,
                # which holds [heads, s, s] scores); pad the values, slice the output.
                v = F.pad(v, (0, q.shape[-1] - dv))
            out = self._sdpa(q, k, v)
            if dv != out.shape[-1]:
                out = out[..., :dv]
            return out.transpose(1, 2)  # [b, s, h, d]

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                cu = packed_seq_params.cu_seqlens_q_padded
                if cu is None:
                    cu = packed_seq_params.cu_seqlens_q
                bounds = bounds_of(cu)
                outs = [self._one(query[a:b].unsqueeze(0), key[a:b].unsqueeze(0),
                                  value[a:b].unsqueeze(0)).squeeze(0)
                        for a, b in zip(bounds[:-1], bounds[1:], strict=False) if b > a]
                out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
                return out.reshape(out.shape[0], -1)
            out = self._one(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1))
            out = out.transpose(0, 1)  # [s, b, h, d]
            return out.reshape(out.shape[0], out.shape[1], -1)

    return SdpaAttention


_SDPA = None


def sdpa_attention_class():
    """The `SdpaAttention` module class (built once, lazily)."""
    global _SDPA
    if _SDPA is None:
        _SDPA = _sdpa_attention_class()
    return _SDPA


class TorchRMSNorm(nn.RMSNorm):
    """torch's RMSNorm built from a Megatron config, in place of Megatron's WrappedTorchNorm,
    which refuses sequence parallelism (the norm is elementwise over rows, so a sequence
    shard needs nothing special)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in self.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)


def _swap_norms(spec) -> None:
    """Replace WrappedTorchNorm by TorchRMSNorm in a layer spec (in place)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    sub = spec.submodules
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(sub, name, None) is WrappedTorchNorm:
            setattr(sub, name, TorchRMSNorm)
    att = getattr(sub.self_attention, "submodules", None)
    for name in ("q_layernorm", "k_layernorm", "kv_layernorm", "out_norm"):
        if att is not None and getattr(att, name, None) is WrappedTorchNorm:
            setattr(att, name, TorchRMSNorm)


def _patch_gdn_for_cpu() -> None:
    """Let Megatron's GatedDeltaNet run without flash-linear-attention."""
    from megatron.core.ssm import gated_delta_net as gdn

    if getattr(gdn, "_waveplan_patched", False):
        return

    def l2norm(x, dim=-1, eps=1e-6):
        return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)

    gdn.HAVE_FLA = True
    gdn.l2norm = l2norm
    gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule
    gdn._waveplan_patched = True


def _patch_mla_for_cpu() -> None:
    """Let Megatron's MLASelfAttention build without Transformer Engine: megatron-core 0.16.1
    tests `isinstance(self.linear_proj, TELinear)`, and without TE its TELinear is a mock
    placeholder, not a class; a class nothing is an instance of keeps the local spec's
    linears on their own path (`linear_*_down_proj in [TELinear]` stays false)."""
    from megatron.core.transformer import multi_latent_attention as mla

    if not isinstance(mla.TELinear, type):
        mla.TELinear = type("NoTELinear", (), {})


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The tanh-approximate GELU of GeGLU (Gemma's gelu_pytorch_tanh), one aten op."""
    return F.gelu(x, approximate="tanh")


# Features Megatron-core cannot express; `build_gpt` records them on the model.
UNMODELLED_FEATURES = ("attention_softcap", "final_softcap", "embedding_scale", "sandwich_norms")


def _feature_settings(geometry: ModelGeometry, layers) -> dict:
    """TransformerConfig settings for the geometry's features (see the module doc)."""
    from megatron.core.activations import quick_gelu

    f = geometry.features
    extra = geometry.extra or {}
    kw: dict = {"add_qkv_bias": bool(extra.get("qkv_bias", False)) or f.qkv_bias,
                "add_bias_linear": f.linear_bias}
    if f.mlp_activation == MlpActivation.GEGLU:
        kw["activation_func"] = gelu_tanh
    elif f.mlp_activation == MlpActivation.CLAMPED_SWIGLU:
        kw.update(activation_func=quick_gelu, glu_linear_offset=1.0,
                  activation_func_clamp_value=float(extra.get("swiglu_limit", 7.0)))
    if f.sliding_window:
        kw.update(window_size=(f.sliding_window, 0),
                  window_attn_skip_freq=f.full_attention_interval or None)
    if f.attention_sinks:
        kw["softmax_type"] = "learnable"
    if geometry.moe is not None and any(s.mlp == MlpKind.MOE for s in layers):
        kw["moe_router_score_function"] = f.router_score.value
        if f.router_groups > 1:
            kw.update(moe_router_num_groups=f.router_groups, moe_router_group_topk=f.router_group_top_k)
    return kw


def build_config(geometry: ModelGeometry, *, num_layers: int | None = None,
                 layout: ParallelLayout | None = None, recompute: Recompute | None = None,
                 dtype: torch.dtype = torch.bfloat16, perform_initialization: bool = False):
    """A Megatron `TransformerConfig` matching `geometry` (first `num_layers` layers)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    layout = layout or ParallelLayout()
    recompute = recompute or Recompute()
    layers = _layers(geometry, num_layers)
    extra = geometry.extra or {}
    att, gdn, moe = geometry.attention, geometry.gdn, geometry.moe
    kw: dict = dict(
        num_layers=len(layers), hidden_size=geometry.hidden,
        ffn_hidden_size=geometry.ffn or (moe.expert_ffn if moe else 4 * geometry.hidden),
        gated_linear_unit=geometry.gated_mlp, activation_func=F.silu,
        normalization="RMSNorm", layernorm_epsilon=float(extra.get("norm_eps", 1e-6)),
        hidden_dropout=0.0, attention_dropout=0.0,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        pipeline_dtype=dtype, perform_initialization=perform_initialization,
        use_cpu_initialization=False, transformer_impl="local",
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp, sequence_parallel=layout.sequence_parallel,
        apply_rope_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
    )
    kw.update(_feature_settings(geometry, layers))
    config_class = TransformerConfig
    if att is not None and att.mla is not None:
        mla = att.mla
        config_class = MLATransformerConfig
        kw.update(num_attention_heads=att.num_heads, num_query_groups=att.num_heads,
                  kv_channels=att.head_dim, qk_layernorm=True,  # MLA's latent norms
                  q_lora_rank=mla.q_lora_rank or None, kv_lora_rank=mla.kv_lora_rank,
                  qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim,
                  v_head_dim=mla.v_head_dim, rope_type="rope",
                  rotary_base=int(extra.get("rope_theta", 10_000)))
    elif att is not None:
        kw.update(num_attention_heads=att.num_heads, num_query_groups=att.num_kv_groups,
                  kv_channels=att.head_dim, attention_output_gate=att.output_gate,
                  qk_layernorm=bool(extra.get("qk_layernorm", geometry.qk_norm)))
    else:
        # GDN-only model: Megatron still wants head counts; they size nothing that is built.
        kw.update(num_attention_heads=gdn.num_value_heads, num_query_groups=gdn.num_value_heads,
                  kv_channels=gdn.value_head_dim)
    if gdn is not None:
        kw.update(experimental_attention_variant="gated_delta_net",
                  linear_attention_freq=[1 if s.mixer == MixerKind.GDN else 0 for s in layers],
                  linear_conv_kernel_dim=gdn.conv_kernel, linear_key_head_dim=gdn.key_head_dim,
                  linear_value_head_dim=gdn.value_head_dim,
                  linear_num_key_heads=gdn.num_key_heads,
                  linear_num_value_heads=gdn.num_value_heads)
    if moe is not None and any(s.mlp == MlpKind.MOE for s in layers):
        kw.update(num_moe_experts=moe.num_experts, moe_router_topk=moe.top_k,
                  moe_ffn_hidden_size=moe.expert_ffn,
                  moe_layer_freq=[1 if s.mlp == MlpKind.MOE else 0 for s in layers],
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                  moe_grouped_gemm=False, moe_token_dispatcher_type="alltoall",
                  moe_router_dtype="fp32")
        if moe.shared_expert_ffn:
            kw["moe_shared_expert_intermediate_size"] = moe.shared_expert_ffn
            if geometry.features.shared_expert_gate:   # Qwen2-MoE: sigmoid-gated shared expert
                kw["moe_shared_expert_gate"] = True
    if recompute.mode == RecomputeMode.FULL:
        kw.update(recompute_granularity="full", recompute_method=recompute.method,
                  recompute_num_layers=recompute.num_layers)
    elif recompute.mode == RecomputeMode.SELECTIVE:
        kw.update(recompute_granularity="selective", recompute_modules=list(recompute.modules))
    try:
        return config_class(**kw)
    except (AssertionError, ValueError) as exc:
        raise ConfigError(f"model {geometry.name!r}: Megatron rejects the config: {exc}") from None


def _post_norm_hook(norm):
    def hook(module, inputs, output):
        out, bias = output
        if bias is not None:
            out = out + bias
        return norm(out), None

    return hook


def _install_unmodelled(model, geometry: ModelGeometry, config) -> None:
    """Forward hooks for the features Megatron-core lacks (see the module doc). Call where
    the model's parameters are created (its device), before casting."""
    f = geometry.features
    if f.embedding_scale and model.pre_process:
        scale = float(geometry.hidden) ** 0.5
        model.embedding.register_forward_hook(lambda module, inputs, out: out * scale)
    if f.final_softcap and model.post_process:
        cap = f.final_softcap
        model.output_layer.register_forward_hook(
            lambda module, inputs, out: (torch.tanh(out[0] / cap) * cap, out[1]))
    if f.sandwich_norms:
        eps = config.layernorm_epsilon
        for layer in model.decoder.layers:
            for name, sub in (("post_attention_norm", layer.self_attention), ("post_mlp_norm", layer.mlp)):
                norm = TorchRMSNorm(config, geometry.hidden, eps=eps)
                layer.add_module(name, norm)
                sub.register_forward_hook(_post_norm_hook(norm))


def _fresh_output_hook(module, inputs, output):
    out, bias = output
    return out.clone(), bias


def _install_expert_bias_fix(model) -> None:
    """Let a biased expert MLP (gpt-oss) run its backward in the local spec.

    Megatron-core 0.16.1's `MLP.forward` adds an expert's FC2 bias in place
    (`output += output_bias * per_token_scale`), and the local `RowParallelLinear`'s output
    is `_ReduceFromModelParallelRegion`'s input returned as-is at TP1, a view that autograd
    refuses to modify in place. A forward hook on each expert's `linear_fc2` returns a copy
    of the output, which replaces it at once (the GEMM output is freed when the hook
    returns, nothing saves it), so the in-place add runs on an ordinary tensor. What is
    modelled: the GEMM output [routed rows, H] and, for the add, the scaled bias of the same
    shape: the two [routed rows, H] tensors a GPU's in-place add holds too; the copy holds
    the same two for one op, so the peak is unchanged. At TP > 1 the all-reduce already
    returns a new tensor and the copy changes nothing but its timing."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    for module in model.modules():
        if isinstance(module, SequentialMLP):
            for expert in module.local_experts:
                fc2 = expert.linear_fc2
                if getattr(fc2, "bias", None) is not None:
                    fc2.register_forward_hook(_fresh_output_hook)


def _layers(geometry: ModelGeometry, num_layers: int | None):
    if num_layers is None:
        return geometry.layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
        raise bad(ConfigError, "num_layers", num_layers, "must be a positive integer")
    return geometry.layers[:num_layers]


def _layer_specs(config, layers):
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    backend = LocalSpecProvider()
    norm = TorchRMSNorm
    sdpa = sdpa_attention_class()

    if getattr(config, "multi_latent_attention", False):
        _patch_mla_for_cpu()

    def attention_layer(moe: bool):
        spec = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts if moe else None, moe_grouped_gemm=False,
            qk_layernorm=config.qk_layernorm, normalization="RMSNorm",
            multi_latent_attention=bool(getattr(config, "multi_latent_attention", False)))
        spec.submodules.self_attention.submodules.core_attention = sdpa
        _swap_norms(spec)
        return spec

    cache: dict = {}
    specs = []
    for layer in layers:
        moe = layer.mlp == MlpKind.MOE
        key = (layer.mixer, moe)
        if key not in cache:
            base = attention_layer(moe)
            if layer.mixer == MixerKind.GDN:
                from megatron.core.ssm.gated_delta_net import (
                    GatedDeltaNet,
                    GatedDeltaNetSubmodules,
                )

                _patch_gdn_for_cpu()
                mixer = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
                    in_proj=backend.column_parallel_linear(), out_norm=norm,
                    out_proj=backend.row_parallel_linear()))
                base = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
                    input_layernorm=norm, self_attention=mixer,
                    self_attn_bda=get_bias_dropout_add, pre_mlp_layernorm=norm,
                    mlp=base.submodules.mlp, mlp_bda=get_bias_dropout_add))
            cache[key] = base
        specs.append(cache[key])
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm)


def _stage_layers(config, layers):
    """The decoder layers this pipeline rank builds (all of them when pp == 1)."""
    if config.pipeline_model_parallel_size == 1:
        return layers, 0
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config)
    count = get_num_layers_to_build(config)
    return layers[offset:offset + count], offset


def wrap_lora(model: nn.Module, rank: int, targets: Sequence[str] = ALL_TARGETS, *,
              alpha: float | None = None) -> int:
    """Wrap every non-expert linear named in `targets` with `LoraLinear`; freeze the rest.

    Returns the number of modules wrapped.
    """
    for param in model.parameters():
        param.requires_grad_(False)
    wanted = set(targets)
    if "linear_qkv" in wanted:  # on multi-latent attention, its q and kv projections
        wanted |= set(MLA_TARGETS)
    found = []
    for _, module in model.named_modules():
        for child_name, child in module.named_children():
            if child_name in wanted and not isinstance(child, LoraLinear) \
                    and not getattr(child, "is_expert", False) \
                    and getattr(child, "weight", None) is not None:
                found.append((module, child_name, child))
    for parent, child_name, child in found:
        if _inside_experts(parent):
            continue
        setattr(parent, child_name, LoraLinear(child, rank, alpha=alpha))
    return sum(1 for m in model.modules() if isinstance(m, LoraLinear))


def _inside_experts(module: nn.Module) -> bool:
    # Expert MLPs (SequentialMLP's local experts, shared experts) carry `is_expert` on
    # their linears; shared experts do not, so also skip by class name.
    name = type(module).__name__
    return name in ("SharedExpertMLP",)


def _require_grad_hook(module, inputs, output):
    """Make the decoder input require grad, so checkpointed layers get gradients (LoRA)."""
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        return output.detach().requires_grad_()
    return None


def _cast_floating(model: nn.Module, dtype: torch.dtype) -> None:
    # In place of `model.to(dtype)`, which cannot swap fake-tensor parameters.
    with torch.no_grad():
        for module in model.modules():
            for param in module._parameters.values():
                if param is not None and param.is_floating_point() and param.dtype != dtype:
                    param.data = param.data.to(dtype)
            for name, buf in module._buffers.items():
                if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                    module._buffers[name] = buf.to(dtype)


def build_gpt(geometry: ModelGeometry, *, num_layers: int | None = None, device: str = "meta",
              lora_rank: int | None = None, lora_targets: Sequence[str] = ALL_TARGETS,
              recompute: Recompute | None = None, layout: ParallelLayout | None = None,
              dtype: torch.dtype = torch.bfloat16, seq_len: int = 4096,
              perform_initialization: bool | None = None):
    """A Megatron-core `GPTModel` with `geometry`'s shapes (its first `num_layers` layers).

    `device`: "meta" (no memory; geometry only), "cpu" (real tensors, or fake ones when
    called inside a `FakeTensorMode`) or "cuda". `lora_rank` wraps the `lora_targets`
    linears of every layer with trainable `LoraLinear` adapters; all base weights are
    frozen either way. `layout` must match the parallel state set up by
    `megatron_shim.init_single_process`. Vocabulary is padded to a multiple of TP.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from .megatron_shim import install_cpu_shim, shim_device

    if device not in ("meta", "cpu", "cuda"):
        raise bad(ConfigError, "device", device, "must be meta, cpu or cuda")
    if not parallel_state.model_parallel_is_initialized():
        raise ConfigError("build_gpt: Megatron's parallel state is not initialised; "
                          "call it inside megatron_shim.init_single_process(...)")
    layout = layout or ParallelLayout(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        cp=parallel_state.get_context_parallel_world_size(),
        ep=parallel_state.get_expert_model_parallel_world_size())
    if perform_initialization is None:
        perform_initialization = device != "meta"
    layers = _layers(geometry, num_layers)
    config = build_config(geometry, num_layers=len(layers), layout=layout, recompute=recompute,
                          dtype=dtype, perform_initialization=perform_initialization)
    stage, _ = _stage_layers(config, layers)
    spec = _layer_specs(config, stage)
    vocab = -(-geometry.vocab // layout.tp) * layout.tp
    extra = geometry.extra or {}
    kwargs = dict(
        config=config, transformer_layer_spec=spec, vocab_size=vocab,
        max_sequence_length=max(seq_len, 1), pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(), parallel_output=True,
        share_embeddings_and_output_weights=geometry.tied_embeddings,
        position_embedding_type="rope", rotary_base=int(extra.get("rope_theta", 1_000_000)),
        rotary_percent=float(extra.get("rotary_percent", 1.0)))
    if device == "cuda":
        with torch.device("cuda"):
            model = GPTModel(**kwargs)
            _install_unmodelled(model, geometry, config)
    else:
        install_cpu_shim()
        with shim_device(device), torch.device(device):
            model = GPTModel(**kwargs)
            _install_unmodelled(model, geometry, config)
    if geometry.features.linear_bias:
        _install_expert_bias_fix(model)
    # As Megatron's Float16Module does: every floating parameter and buffer in `dtype`
    # (the local norms are built in fp32 and would otherwise promote activations).
    _cast_floating(model, dtype)
    if lora_rank is not None:
        wrap_lora(model, lora_rank, lora_targets)
        if model.pre_process:
            model.embedding.register_forward_hook(_require_grad_hook)
    else:
        for param in model.parameters():
            param.requires_grad_(False)
    model.waveplan_geometry_name = geometry.name
    model.waveplan_extra = dict(extra)
    model.waveplan_features = {name: getattr(geometry.features, name) for name in UNMODELLED_FEATURES
                               if getattr(geometry.features, name)}
    return model
