"""The fsdp framework's configuration read from a live transformers model: PEFT-wrapped or not,
`fully_shard`ed or not (`Planner.from_hf_model`). Duck-typed: imports neither torch nor
transformers."""

from __future__ import annotations

from ..errors import ConfigError, bad
from ..lora import LoraConfig, LoraSlot

_ATTN = {"flash_attention_2": "flash", "flash_attention_3": "flash", "sdpa": "sdpa",
         "eager": "eager"}


def _inner(model):
    """The transformers model inside PEFT's wrappers (`PeftModel.base_model.model`)."""
    inner = model
    for _ in range(4):
        if hasattr(inner, "peft_config") and hasattr(inner, "base_model"):
            inner = inner.base_model
        elif type(inner).__name__ in ("LoraModel",) and hasattr(inner, "model"):
            inner = inner.model
        else:
            break
    return inner


def read_live_model(model) -> dict:
    """{config, lora, attn, checkpointing, fsdp}: the model's transformers config, its LoRA
    adapters (one slot per PEFT adapter, its rank), attention implementation, gradient
    checkpointing, and FSDP2 shard group size (the device mesh of its sharded parameters;
    1 when not sharded). O(parameters) for the shard check."""
    inner = _inner(model)
    config = getattr(inner, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise bad(ConfigError, "model", type(model).__name__,
                  "needs a transformers model (or a PEFT wrapper of one) with a `config`")
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in _ATTN:
        raise bad(ConfigError, "model.config._attn_implementation", impl,
                  f"must be one of {', '.join(sorted(_ATTN))}")
    peft = getattr(model, "peft_config", None) or {}
    slots = []
    for name, cfg in sorted(peft.items()):
        rank = int(getattr(cfg, "r", 0) or 0)
        if rank <= 0:
            raise bad(ConfigError, f"peft_config[{name}].r", rank, "must be a positive LoRA rank")
        slots.append(LoraSlot(name=name, rank=rank))
    if not slots:
        raise bad(ConfigError, "model", type(model).__name__,
                  "has no PEFT LoRA adapters (waveplan plans LoRA training)")
    ckpt = bool(getattr(inner, "is_gradient_checkpointing", False))
    fsdp = 1
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            fsdp = int(mesh.size())
            break
    return {"config": config, "lora": LoraConfig(slots=tuple(slots)), "attn": _ATTN[impl],
            "checkpointing": ckpt, "fsdp": fsdp}
