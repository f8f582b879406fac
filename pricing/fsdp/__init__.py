"""Hugging Face transformers + PEFT LoRA under FSDP2: the fsdp framework's memory model
(docs/memory-model.md#fsdp2-with-hugging-face-transformers)."""

from .layout import ATTN_IMPLEMENTATIONS, FRAMEWORKS, FsdpLayout
from .model import FsdpPricingModel, attn_rows_bound, build_fsdp_model

__all__ = ["ATTN_IMPLEMENTATIONS", "FRAMEWORKS", "FsdpLayout", "FsdpPricingModel",
           "attn_rows_bound", "build_fsdp_model"]
