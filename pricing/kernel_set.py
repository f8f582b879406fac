"""The kernel set a table was fitted on, and the framework that runs it: chosen once per table
(docs/memory-model.md#calibration).

Two kernel sets ship: Transformer Engine's fused GPU kernels (te-gpu: the TP1-fitted stage and
retained terms, and for recomputed plain dense layers and the head the structural entries written
from the kernels' allocation models, `kernel_models`) and plain PyTorch CPU kernels (torch-cpu: the
fitted terms plus the structural ones read off the traces, which price layers by what they hold). A user's
table may carry any subset of the optional entries; `KernelSet.of` reads which, through the
entry registry (`entries.has`), so no term function probes the table. The framework is
Megatron-core's; `FRAMEWORKS` is where a second one registers.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import entries
from .compat import StrEnum


class Framework(StrEnum):
    """The training framework whose schedule and layers are priced."""

    MEGATRON = "megatron"
    """Megatron-core's GPTModel under its 1F1B schedule."""
    FSDP = "fsdp"
    """Hugging Face transformers with PEFT LoRA under FSDP2 (`pricing.fsdp`)."""


FRAMEWORKS: tuple[Framework, ...] = (Framework.MEGATRON, Framework.FSDP)

KERNEL_MODELS: dict[str, str] = {
    "te-rmsnorm": "Transformer Engine's RMSNorm (ops/basic/rmsnorm.py): saves its input and fp32 rstdevs",
    "fused-swiglu": "Megatron's fused bias-SwiGLU (fused_bias_swiglu.py): saves its input",
    "fused-rope": "Transformer Engine's fused RoPE (attention/rope.py FusedRoPEFunc): saves freqs",
    "flash-varlen": "flash-attn 2 varlen (flash_api.cpp): out, fp32 lse; dq/dk/dv and fp32 workspaces",
}
"""The fused GPU kernels whose allocation models a table's `kernel_models` entry may name
(pricing/measure/gpu_kernels.py; docs/memory-model.md#gpu-kernel-allocation-models)."""
"""The frameworks the memory model prices; a new framework adds its member and its pricer."""


@dataclass(frozen=True, kw_only=True)
class KernelSet:
    """Which optional table entries apply: what the table's kernels are priced with."""

    structural: bool
    """The structural layer terms (`sp_retained_layer`): retained layers under TP with SP, GDN
    layers and the TP1 structural layer priced by what they hold (plain PyTorch kernels)."""
    sp_point: bool
    """The MLP output projection's backward point under TP with SP (`sp_fc2_point`), and the
    MoE and GDN layers' structural backward points beside it."""
    norm_point: bool
    """The input norm's backward point with replicated norms (`layer_norm_point`)."""
    sp_head: bool
    """The full-native head's forward under SP (`sp_head_forward`)."""
    tp1_point: bool
    """A plain dense TP1 layer recomputed at its FC1 backward (`tp1_fc1_point`)."""
    cp_release: bool
    """What ring attention releases under CP (`cp_attention_release`)."""
    permutation: bool
    """The MoE dispatcher's sort copy (`moe_permutation`)."""
    gdn_padding: bool
    """The GDN kernel's chunk padding (`gdn_chunk_padding`)."""
    retained_forward: bool
    """A retained layer's own forward peak (`retained_forward`)."""
    retained_backward: bool
    """A retained layer's backward transient (`retained_backward`)."""
    moe_nograd: bool
    """A MoE layer's no-grad forward transient (`moe_nograd`)."""
    moe_expert_backward: bool
    """The routed experts' backward (`moe_expert_backward`)."""
    fused_retained: bool = False
    """A plain dense layer retained (selective, none; under CP without SP too) or a plain-attention
    MoE layer retained at TP1 (with EP too) or under TP with SP priced by what the fused kernels keep
    (`fused_retained_layer`), with its backward transient and own forward peak."""
    fused_mla: bool = False
    """A multi-latent-attention layer with a dense MLP at TP1 CP1 priced by what the fused kernels
    keep and hold at its points (`fused_mla_layer`), retained or recomputed."""
    fused_gdn: bool = False
    """A GDN hybrid's retained layers (dense MLPs, TP1 CP1) priced by what FLA's kernels and the
    fused kernels keep (`fused_gdn_layer`)."""
    fused_gdn_point: bool = False
    """A GDN hybrid's layers (dense MLPs, TP1 CP1) recomputed under full recompute priced at the
    points FLA's kernels and the fused kernels hold (`fused_gdn_point`)."""
    kernel_models: tuple[str, ...] = ()
    """The fused GPU kernels whose allocation models (`pricing/measure/gpu_kernels.py`) the
    table's structural terms were written from (`kernel_models`; empty: plain PyTorch kernels).
    Such figures rest on the kernels' source, checked on CPU traces, not on GPU traces."""
    framework: Framework = Framework.MEGATRON
    """The framework the table's traces ran."""

    @classmethod
    def of(cls, table) -> KernelSet:
        """The kernel set of `table`, read once from its entries. O(entries)."""
        h = entries.has
        return cls(structural=h(table, "sp_retained_layer"), sp_point=h(table, "sp_fc2_point"),
                   norm_point=h(table, "layer_norm_point"), sp_head=h(table, "sp_head_forward"),
                   tp1_point=h(table, "tp1_fc1_point"), cp_release=h(table, "cp_attention_release"),
                   permutation=h(table, "moe_permutation"), gdn_padding=h(table, "gdn_chunk_padding"),
                   retained_forward=h(table, "retained_forward"),
                   retained_backward=h(table, "retained_backward"),
                   moe_nograd=h(table, "moe_nograd"),
                   moe_expert_backward=h(table, "moe_expert_backward"),
                   fused_retained=h(table, "fused_retained_layer"),
                   fused_mla=h(table, "fused_mla_layer"),
                   fused_gdn=h(table, "fused_gdn_layer"),
                   fused_gdn_point=h(table, "fused_gdn_point"),
                   kernel_models=tuple(entries.entry(table, "kernel_models", {}).get("kernels", ())))

    @property
    def fused(self) -> bool:
        """Whether the structural terms price the fused GPU kernels (`kernel_models`): TE's norms
        keep their bf16 inputs and fp32 per-row statistics, TE's fused RoPE keeps no per-row
        rotary copies (docs/memory-model.md#gpu-kernel-allocation-models)."""
        return bool(self.kernel_models)

    def priced_by_models(self, *, has_gdn: bool) -> bool:
        """Whether the full-native head is priced by what the kernels hold (`fused`; Megatron's
        native cross entropy is plain PyTorch): not for a GDN hybrid, whose layers keep the fitted
        GDN terms that FLA's allocation model shows short without the seeds' head margin (the
        entry's `gdn` values; docs/memory-model.md#gpu-kernel-allocation-models)."""
        return self.fused and not has_gdn

    def caller_by_heads(self, *, fitted_layers: bool) -> bool:
        """Whether the caller's memory is charged only with the head kinds its entry names
        (`fused`): not where layers keep fitted terms no kernel model replaced (GDN layers, MoE
        layers but where retained by the kernel models), which keep its margin with every head
        (docs/memory-model.md#caller)."""
        return self.fused and not fitted_layers

    @property
    def rope_copies(self) -> float:
        """The rotary frequencies' copies per row a structural layer term holds, in units of the
        RoPE cache row (`pipeline.rope_cache_per_row`): 2 with plain PyTorch's RoPE (gathered
        bf16 copies), 0 with TE's fused RoPE, which saves only the cache entry."""
        return 0.0 if self.fused else 2.0

    @property
    def name(self) -> str:
        """'fused-gpu-models' (structural terms from the fused kernels' allocation models),
        'plain-cpu' (the structural terms) or 'fused-gpu' (the fitted terms alone)."""
        if self.fused:
            return "fused-gpu-models"
        return "plain-cpu" if self.structural else "fused-gpu"

    def structural_at_tp1(self, *, retained: bool, plain_dense: bool) -> bool:
        """Whether a plain dense model's TP1 layers are priced by what they hold: retained by
        the structural layer at TP = 1, recomputed at their FC1 backward
        (docs/memory-model.md#tp1-structural)."""
        entry = self.structural if retained else self.tp1_point
        return plain_dense and entry and self.sp_head
