"""Every coefficient-table entry the memory model reads, in one registry: its name, whether a
table must carry it (else what is priced without it), its unit and its docs anchor
(docs/memory-model.md#calibration).

`has(table, name)` is the one place the model asks whether a table carries an entry; the
kernel set (`kernel_set.KernelSet`) asks it once per table.
"""

from __future__ import annotations

from dataclasses import dataclass

DOCS = "docs/memory-model.md"


@dataclass(frozen=True)
class Entry:
    """One table entry."""

    name: str
    """The entry's key in a table's `terms`."""
    unit: str
    """What its numbers multiply: bytes per row of the given widths, per routed row, a scalar."""
    anchor: str
    """Its section in docs/memory-model.md."""
    default: str | None = None
    """None: every table must carry it; else what is priced without it."""

    @property
    def required(self) -> bool:
        """Whether every table must carry the entry."""
        return self.default is None

    @property
    def docs(self) -> str:
        """The docs link: the memory model page and this entry's anchor."""
        return f"{DOCS}#{self.anchor}"


_ROW = "bytes per row (coefficients x widths)"
_ROUTED = "bytes per routed row (coefficients x widths)"
_VOCAB = "bytes per row x vocab / TP"
_GROUPS = "x H bytes per gathered row, per layout class"

ENTRIES: tuple[Entry, ...] = (
    Entry("boundary", _ROW, "boundaries"),
    Entry("input_gradient", _ROW, "input-gradient"),
    Entry("residual_norm_shards", _ROW, "workspace"),
    Entry("norm_gathered", _ROW, "workspace"),
    Entry("mlp_dense_grad_stage", _ROW, "workspace"),
    Entry("mlp_dense_nograd", _ROW, "nograd-transient"),
    Entry("attention_stage", _ROW, "workspace"),
    Entry("gdn_stage", _ROW, "workspace"),
    Entry("moe_routed", _ROUTED, "expert-parallel"),
    Entry("moe_router", _ROW, "expert-parallel"),
    Entry("moe_shared_expert", _ROW, "expert-parallel"),
    Entry("gdn_state_bytes", "bytes per segment and head", "gdn-states"),
    Entry("first_execution", "bytes once per process", "first-execution"),
    Entry("caller_per_logical_token", "bytes per logical token", "caller"),
    Entry("head_chunk", _VOCAB, "head"),
    Entry("head_full_native", _VOCAB, "head-modes"),
    Entry("head_full_te", _VOCAB, "head-full-te"),
    Entry("retained_attention_layer", _ROW, "retained-activations"),
    Entry("retained_gdn_layer", _ROW, "retained-activations"),
    Entry("retained_moe_mlp", _ROUTED, "retained-activations"),
    Entry("selective_core_attn_discount", _ROW, "retained-activations"),
    Entry("layout_residual", _GROUPS, "layout-residuals",
          "0: no layout class beyond TP1 CP1 is covered (every other one conservative)"),
    Entry("qk_norm", _ROW, "workspace", "0: no query/key-norm copies beyond the attention stage"),
    Entry("final_norm", _ROW, "head", "0: the head terms cover the final norm's saved input"),
    Entry("final_norm_backward", _ROW, "head-norm-order",
          "0: the head terms cover the final norm's backward"),
    Entry("retained_forward", _ROW, "retained-activations",
          "the no-grad transient alone at a retained layer's forward point"),
    Entry("retained_backward", _ROW, "retained-activations",
          "the recomputed layer's full stage workspace in a retained layer's backward"),
    Entry("moe_nograd", _ROUTED, "expert-parallel",
          "the MoE gradient-stage workspace plus 6H as a MoE layer's forward transient"),
    Entry("moe_permutation", _ROUTED, "expert-parallel",
          "0: the fitted MoE stage holds the dispatcher's top-k copies (pricing.moe_terms)"),
    Entry("moe_expert_backward", _ROUTED, "moe-routed-points",
          "the CPU trace's units (pricing.terms.EXPERT_BACKWARD_UNITS): conservative"),
    Entry("moe_routing_metadata", "bytes per routed choice", "expert-parallel",
          "0: the fitted MoE stage covers the router's per-choice bookkeeping"),
    Entry("moe_norm_inputs", _ROW, "expert-parallel",
          "0: the mixer stage carries a MoE layer's norm inputs"),
    Entry("mla_norm_inputs", _ROW, "family-features",
          "0: the MLA stage alone (the norms' fp32 inputs not held on a GPU's fused norms)"),
    Entry("gdn_chunk_padding", "rows (the GDN kernel's chunk)", "gdn-sp-retained",
          "1: the GDN kernel runs no padding rows (FLA's chunked kernels mask the last chunk)"),
    Entry("layer_norm_point", _ROW, "layer-norm-point",
          "0: fused norms keep no fp32 intermediates (the stage sum alone)"),
    Entry("sp_fc2_point", _ROW + ", gathered and TP-sharded parts", "sp-fc2-point",
          "0: the fitted stage sum under TP with SP"),
    Entry("sp_retained_layer", _ROW + ", gathered and TP-sharded parts", "sp-retained-layer",
          "the fitted retained layers (no structural layer terms: the fused GPU kernel set)"),
    Entry("sp_head_forward", _ROW + ", and a TP-sharded part", "sp-head-forward",
          "0: the head's retained logits alone at its forward"),
    Entry("tp1_fc1_point", _ROW, "tp1-structural", "the fitted stage at TP1 full recompute"),
    Entry("cp_attention_release", _ROW, "cp-attention-release",
          "0: ring attention releases nothing the stage keeps"),
    Entry("fused_retained_layer", _ROW + ", replicated, gathered and TP-sharded parts",
          "gpu-kernel-allocation-models",
          "the fitted retained layer (plain dense layers retained on the fused kernels)"),
    Entry("fused_mla_layer", _ROW + " (multi-latent attention's widths: `layers.mla.mla_widths`)",
          "mla-kernel-models",
          "the fitted MLA layer (multi-latent attention with a dense MLP on the fused kernels)"),
    Entry("fused_gdn_layer", _ROW + " (GDN widths: key, value_heads), kept, backward and forward parts",
          "gpu-kernel-allocation-models",
          "the fitted GDN terms (GDN hybrids retained on the fused kernels)"),
    Entry("fused_gdn_point", _ROW + " (GDN widths: key, value_heads), point, backward, forward and nograd parts",
          "te-gpu-gdn-full",
          "the fitted GDN stage and the seeds' head margin (GDN hybrids under full recompute on the fused kernels)"),
    Entry("kernel_models", "names of the fused GPU kernels (`kernels`)", "gpu-kernel-allocation-models",
          "none: the structural terms hold plain PyTorch's tensors (fp32 norm inputs, rotary copies)"),
    # the fsdp framework's calibration factors (`waveplan calibrate` on `trace --framework fsdp`
    # records or an FSDP model's observed peaks); a table without them prices the derived terms
    Entry("fsdp_layer", "a factor on the fsdp decoder-layer terms (value)", "fsdp-calibration",
          "1: the derived decoder-layer terms"),
    Entry("fsdp_attention", "a factor on the fsdp packed-row S x S terms (value)", "fsdp-calibration",
          "1: the derived S x S terms"),
    Entry("fsdp_head", "a factor on the fsdp head terms (value)", "fsdp-calibration",
          "1: the derived head terms"),
    Entry("fsdp_constants", "a factor on the fsdp gathered parameters and gradient buffers (value)",
          "fsdp-calibration", "1: the derived constants"),
)

REGISTRY: dict[str, Entry] = {e.name: e for e in ENTRIES}
REQUIRED: tuple[str, ...] = tuple(e.name for e in ENTRIES if e.required)
OPTIONAL: dict[str, str] = {e.name: e.default for e in ENTRIES if not e.required}


def has(table, name: str) -> bool:
    """Whether `table` carries entry `name` (a registered entry; KeyError otherwise)."""
    if name not in REGISTRY:
        raise KeyError(f"{name!r} is not a registered table entry (pricing.entries)")
    return name in table.terms


def missing_required(terms: dict) -> list[str]:
    """The required entries `terms` lacks, in registry order."""
    return [name for name in REQUIRED if name not in terms]


def entry(table, name: str, default=None):
    """Entry `name` of `table`, or `default` where the table lacks it."""
    return table.terms[name] if has(table, name) else default


def optional_per_row(table, name: str, widths: dict, key: str = "per_row") -> float:
    """Bytes per row of optional entry `name` (`table.per_row`); 0 where the table lacks it."""
    return table.per_row(name, widths, key) if has(table, name) else 0.0


def optional_scalar(table, name: str, default: float = 0.0, key: str = "value") -> float:
    """Scalar `key` of optional entry `name`; `default` where the table lacks it."""
    return table.scalar(name, key) if has(table, name) else default
