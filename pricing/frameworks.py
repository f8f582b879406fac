"""The framework of a model's dict, chosen once: its pricing model rebuilt (reports, misses
files). Megatron-core's `PricingModel` or the fsdp framework's `FsdpPricingModel`
(`kernel_set.Framework`)."""

from __future__ import annotations

from .fsdp import FsdpPricingModel
from .kernel_set import Framework
from .model import PricingModel


def model_from_dict(data: object) -> PricingModel:
    """Inverse of `to_dict` for either framework (`"framework"` names fsdp; absent: Megatron-core)."""
    if isinstance(data, dict) and data.get("framework") == Framework.FSDP:
        return FsdpPricingModel.from_dict(data)
    return PricingModel.from_dict(data)
