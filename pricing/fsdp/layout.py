"""The FSDP2 training layout of a Hugging Face transformers model: shard group, attention
implementation, gradient checkpointing, Ulysses (docs/memory-model.md#fsdp2-with-hugging-face-transformers)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, bad
from ..kernel_set import FRAMEWORKS  # noqa: F401  (re-exported: the frameworks, chosen in one place)

ATTN_IMPLEMENTATIONS = ("flash", "sdpa", "eager")


@dataclass(frozen=True, kw_only=True)
class FsdpLayout:
    """How the rank runs the model under FSDP2."""

    fsdp: int = 1
    """Shard group size: the ranks `fully_shard` splits parameters, gradients and optimizer
    states over (the device mesh's size)."""
    attn: str = "flash"
    """Attention implementation: flash (flash_attention_2 on packed rows, position_ids
    restarting per sequence), sdpa or eager (packed rows with transformers' block-causal mask)."""
    checkpointing: bool = True
    """Per-decoder-layer gradient checkpointing (transformers' `gradient_checkpointing_enable`,
    non-reentrant)."""
    reshard_after_forward: bool = True
    """FSDP2's `reshard_after_forward` on the decoder layers (False: every layer's gathered
    parameters stay from its forward to its backward)."""
    ulysses: int = 1
    """veRL's `ulysses_sequence_parallel_size`: the ranks one packed row is split over
    (docs/memory-model.md#fsdp-ulysses); it divides `fsdp` and the heads (checked against the
    model's geometry by `fsdp.ulysses.validate`)."""
    head: str = "transformers"
    """The loss: transformers' ForCausalLMLoss ("transformers") or veRL's FSDP actor's log-probs
    and entropy ("verl", "verl-chunked", "verl-fused"; docs/memory-model.md#fsdp-verl-head)."""
    remove_padding: bool = True
    """veRL's `use_remove_padding`: True, a micro-batch's sequences packed in one row; False,
    padded [B, S] rows with an attention mask, priced with every sequence at the step's longest
    (`fsdp.model.padded_step`; docs/memory-model.md#fsdp-verl-options)."""
    entropy_checkpointing: bool = False
    """veRL's `entropy_checkpointing` (the veRL heads' entropy under `torch.utils.checkpoint`):
    priced as without it, a bound (docs/memory-model.md#fsdp-verl-options)."""
    liger: bool = False
    """veRL's `use_liger` (Liger's Triton RMSNorm, SwiGLU and RoPE in place of transformers'):
    priced as transformers' own modules, a bound (docs/memory-model.md#fsdp-verl-options)."""

    def __post_init__(self) -> None:
        if isinstance(self.fsdp, bool) or not isinstance(self.fsdp, int) or not 1 <= self.fsdp <= 1 << 16:
            raise bad(ConfigError, "fsdp", self.fsdp, "must be an integer shard group size >= 1")
        if self.attn not in ATTN_IMPLEMENTATIONS:
            raise bad(ConfigError, "attn", self.attn, f"must be one of {', '.join(ATTN_IMPLEMENTATIONS)}")
        if not isinstance(self.checkpointing, bool):
            raise bad(ConfigError, "checkpointing", self.checkpointing, "must be true or false")
        if not isinstance(self.reshard_after_forward, bool):
            raise bad(ConfigError, "reshard_after_forward", self.reshard_after_forward,
                      "must be true or false")
        from .verl_head import FSDP_HEADS

        if self.head not in FSDP_HEADS:
            raise bad(ConfigError, "head", self.head, f"under FSDP one of {', '.join(FSDP_HEADS)}")
        if isinstance(self.ulysses, bool) or not isinstance(self.ulysses, int) or self.ulysses < 1:
            raise bad(ConfigError, "ulysses", self.ulysses, "must be a positive integer")
        for name in ("remove_padding", "entropy_checkpointing", "liger"):
            if not isinstance(getattr(self, name), bool):
                raise bad(ConfigError, name, getattr(self, name), "must be true or false")
        if not self.remove_padding and self.ulysses > 1:
            # veRL's FSDP engine refuses it too (`ulysses_sequence_parallel_size > 1` needs it)
            raise bad(ConfigError, "remove_padding", False, "Ulysses needs packed rows (remove_padding)")

    def to_dict(self) -> dict:
        return {"fsdp": self.fsdp, "attn": self.attn, "checkpointing": self.checkpointing,
                "reshard_after_forward": self.reshard_after_forward, "ulysses": self.ulysses,
                **({"head": self.head} if self.head != "transformers" else {}),
                **({"remove_padding": False} if not self.remove_padding else {}),
                **({"entropy_checkpointing": True} if self.entropy_checkpointing else {}),
                **({"liger": True} if self.liger else {})}

    @classmethod
    def from_dict(cls, data: dict) -> FsdpLayout:
        known = {"fsdp", "attn", "checkpointing", "reshard_after_forward", "ulysses", "head",
                 "remove_padding", "entropy_checkpointing", "liger"}
        for key in data:
            if key not in known:
                raise bad(ConfigError, f"fsdp.{key}", data[key], f"unknown field; known: {sorted(known)}")
        return cls(**data)
