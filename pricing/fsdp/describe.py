"""The fsdp framework's configuration in words, for `waveplan inspect --framework fsdp`: shard
group, attention implementation, checkpointing, LoRA targets, the family's terms and the basis
(docs/memory-model.md#fsdp2-with-hugging-face-transformers)."""

from __future__ import annotations

from . import model as fsdp_model

_ATTN_WORDS = {"flash": "flash_attention_2 on packed rows (varlen; priced by its allocation model)",
               "sdpa": "sdpa on packed rows (transformers' block-causal bool mask)",
               "eager": "eager on packed rows (bf16 additive mask, per-head scores)"}
_DENSE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_MOE = ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj",
        "router gate.weight")


def lora_targets(geometry) -> tuple[str, ...]:
    """What PEFT's all-linear LoRA adapts in one decoder layer of the family: every nn.Linear
    but the head, and (transformers 5 MoE) the fused 3-D expert stacks and the router's weight
    through `target_parameters`."""
    mt = fsdp_model.model_type_of(geometry)
    if geometry.moe is not None:
        return _MOE
    if mt == "phi3":
        return _FUSED
    return _DENSE if geometry.gated_mlp else ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")


def family_words(model) -> str:
    """How the model's family is priced: tensor by tensor, with its additions, or bounded."""
    mt = fsdp_model.model_type_of(model.geometry) or "unknown"
    if mt in fsdp_model.EVIDENCE_FAMILIES:
        return f"{mt}: Llama-shaped terms, tensor by tensor (CPU traces, sets 1-2)"
    if mt in fsdp_model.TRACED_FAMILIES:
        return (f"{mt}: Llama-shaped terms with the family's additions (#fsdp-families), layer terms "
                f"x {model.bound_scale:g} (CPU traces, sets 3-30)")
    return f"{mt}: no FSDP trace, layer terms x {model.bound_scale:g} (a bound)"


def fsdp_view(model) -> dict:
    """The fsdp-specific view as plain JSON."""
    lay = model.fsdp_layout
    return {"framework": "fsdp", "shard_group": lay.fsdp, "attn": lay.attn,
            "checkpointing": lay.checkpointing, "reshard_after_forward": lay.reshard_after_forward,
            "ulysses": lay.ulysses,
            "lora": {s.name: {"rank": s.rank, "layers": "all" if s.layers is None else list(s.layers)}
                     for s in model.lora.slots},
            "lora_targets": list(lora_targets(model.geometry)),
            "family": family_words(model), "basis": model.basis, "reasons": list(model.gaps)}


def fsdp_lines(model) -> list[str]:
    """The inspect lines of an fsdp-framework model (in place of Megatron's TP/CP layout)."""
    lay = model.fsdp_layout
    slots = ", ".join(f"{s.name} r{s.rank}" + ("" if s.layers is None else f" on {len(s.layers)} layers")
                      for s in model.lora.slots)
    lines = [
        "framework  fsdp: Hugging Face transformers + PEFT LoRA, base frozen",
        f"shard      FSDP2 x{lay.fsdp}: fully_shard per decoder layer and the root, bf16 parameters, "
        f"fp32 reduce, {'reshard after forward' if lay.reshard_after_forward else 'no reshard after forward'}",
        f"attention  {lay.attn}: {_ATTN_WORDS[lay.attn]}",
        "checkpoint " + ("per decoder layer (gradient_checkpointing_enable, non-reentrant)"
                         if lay.checkpointing else "none"),
        f"lora       {slots}; targets {', '.join(lora_targets(model.geometry))}",
        f"family     {family_words(model)}",
    ]
    if lay.ulysses > 1:
        lines.append(f"ulysses    {lay.ulysses}")
    return lines
