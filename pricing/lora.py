"""LoRA adapters: slots, their rank and target modules, and per-layer adapter sizes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ConfigError, bad
from .geometry import MixerKind, MlpKind, ModelGeometry

# Linear modules an adapter can wrap, by Megatron's names.
ATTENTION_TARGETS = ("linear_qkv", "linear_proj")
GDN_TARGETS = ("in_proj", "out_proj")
MLP_TARGETS = ("linear_fc1", "linear_fc2")
ALL_TARGETS = ATTENTION_TARGETS + GDN_TARGETS + MLP_TARGETS
# Multi-latent attention's query and key/value projections (Megatron's names). A slot that
# targets `linear_qkv` adapts all of them; each can also be targeted on its own.
MLA_TARGETS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
               "linear_kv_up_proj")
KNOWN_TARGETS = ALL_TARGETS + MLA_TARGETS


@dataclass(frozen=True, kw_only=True)
class LoraSlot:
    """One adapter set. `layers` limits it to some decoder layers (None: all)."""

    name: str = "default"
    rank: int = 16
    targets: tuple[str, ...] = ALL_TARGETS
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise bad(ConfigError, "lora.name", self.name, "must be non-empty")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise bad(ConfigError, f"lora[{self.name}].rank", self.rank, "must be a positive integer")
        if isinstance(self.targets, str):
            raise bad(ConfigError, f"lora[{self.name}].targets", self.targets, "must be a list of module names")
        object.__setattr__(self, "targets", tuple(self.targets))
        for target in self.targets:
            if target not in KNOWN_TARGETS:
                raise bad(ConfigError, f"lora[{self.name}].targets", target,
                          f"unknown module; known: {', '.join(KNOWN_TARGETS)}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(sorted(set(self.layers))))


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """All adapter slots of a model. Gradients are kept in `grad_bytes` per parameter."""

    slots: tuple[LoraSlot, ...] = (LoraSlot(),)
    grad_bytes: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "slots", tuple(self.slots))
        names = [slot.name for slot in self.slots]
        if len(set(names)) != len(names):
            raise bad(ConfigError, "lora.slots", names, "slot names must be unique")
        if self.grad_bytes not in (2, 4):
            raise bad(ConfigError, "lora.grad_bytes", self.grad_bytes, "must be 2 or 4")

    def slot(self, name: str) -> LoraSlot:
        for slot in self.slots:
            if slot.name == name:
                return slot
        raise bad(ConfigError, "slot", name, f"no such LoRA slot; known: {[s.name for s in self.slots]}")

    def to_dict(self) -> dict:
        return {"grad_bytes": self.grad_bytes, "slots": [
            {"name": s.name, "rank": s.rank, "targets": list(s.targets),
             "layers": None if s.layers is None else list(s.layers)} for s in self.slots]}

    @classmethod
    def from_dict(cls, data: dict) -> LoraConfig:
        try:
            return cls(grad_bytes=data.get("grad_bytes", 4), slots=tuple(
                LoraSlot(name=s["name"], rank=s["rank"], targets=tuple(s.get("targets", ALL_TARGETS)),
                         layers=None if s.get("layers") is None else tuple(s["layers"]))
                for s in data["slots"]))
        except KeyError as exc:
            raise bad(ConfigError, f"lora.{exc.args[0]}", None, "missing field") from None


def module_shapes(geometry: ModelGeometry, layer: int, tp: int) -> dict[str, tuple[int, int]]:
    """(in, out) widths per rank of each adaptable linear module in one decoder layer.

    Column-parallel modules shard their output over TP, row-parallel ones their input; the
    LoRA A of a row-parallel module is sharded with its input, B is replicated. Multi-latent
    attention's down projections are replicated over TP (Megatron's MLA), its up projections
    column-parallel.
    """
    spec = geometry.layers[layer]
    h = geometry.hidden
    shapes: dict[str, tuple[int, int]] = {}
    if spec.mixer == MixerKind.ATTENTION and geometry.attention.mla is not None:
        att, mla = geometry.attention, geometry.attention.mla
        q_out = att.num_heads * mla.qk_head_dim // tp
        if mla.q_lora_rank:
            shapes["linear_q_down_proj"] = (h, mla.q_lora_rank)
            shapes["linear_q_up_proj"] = (mla.q_lora_rank, q_out)
        else:
            shapes["linear_q_proj"] = (h, q_out)
        shapes["linear_kv_down_proj"] = (h, mla.kv_lora_rank + mla.qk_rope_head_dim)
        shapes["linear_kv_up_proj"] = (mla.kv_lora_rank,
                                       att.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim) // tp)
        shapes["linear_proj"] = (att.core_width // tp, h)
    elif spec.mixer == MixerKind.ATTENTION:
        att = geometry.attention
        shapes["linear_qkv"] = (h, att.qkv_width // tp)
        shapes["linear_proj"] = (att.core_width // tp, h)
    else:
        gdn = geometry.gdn
        shapes["in_proj"] = (h, gdn.in_proj_width // tp)
        shapes["out_proj"] = (gdn.value_width // tp, h)
    if spec.mlp == MlpKind.DENSE:
        f = geometry.ffn
        shapes["linear_fc1"] = (h, (2 if geometry.gated_mlp else 1) * f // tp)
        shapes["linear_fc2"] = (f // tp, h)
    return shapes


def adapter_param_counts(geometry: ModelGeometry, lora: LoraConfig, slot_name: str, tp: int) -> np.ndarray:
    """Trainable LoRA parameters per decoder layer on one rank, for one slot (int64[L]).

    Each wrapped module holds A (rank x in) and B (out x rank). MoE expert adapters are
    not modelled: a MoE layer's adapters cover its attention/GDN mixer only.
    """
    slot = lora.slot(slot_name)
    counts = np.zeros(geometry.num_layers, dtype=np.int64)
    chosen = range(geometry.num_layers) if slot.layers is None else slot.layers
    for layer in chosen:
        if not 0 <= layer < geometry.num_layers:
            raise bad(ConfigError, f"lora[{slot.name}].layers", layer,
                      f"out of range for {geometry.num_layers} layers")
        for module, (d_in, d_out) in module_shapes(geometry, layer, tp).items():
            if module in slot.targets or (module in MLA_TARGETS and "linear_qkv" in slot.targets):
                counts[layer] += slot.rank * (d_in + d_out)
    return counts
