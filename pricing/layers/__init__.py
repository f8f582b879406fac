"""One pricer per decoder layer kind, in a registry keyed by the kind (docs/memory-model.md).

Each kind's module gives a layer's figures under the configuration's `LayerContext`:
`stage(ctx, layer)` (its stage workspace per row, and whether it is a structural point),
`retained(ctx, index, layer, extra=, moe_extra=)` (its retained activations and its own forward
peak per row) and `residual_covered(ctx, layer)` (whether it takes the layout residual fitted
with the structural terms). `pricing.layer_arrays` composes them into the walk's arrays.
"""

from __future__ import annotations

from types import ModuleType

from ..compat import StrEnum
from ..geometry import LayerSpec, MixerKind, MlpKind, ModelGeometry
from . import attention_dense, attention_moe, gdn_dense, gdn_moe, mla


class LayerKind(StrEnum):
    """A decoder layer's kind: its mixer and its MLP."""

    ATTENTION_DENSE = "attention/dense"
    ATTENTION_MOE = "attention/moe"
    GDN_DENSE = "gdn/dense"
    GDN_MOE = "gdn/moe"
    MLA_DENSE = "mla/dense"
    MLA_MOE = "mla/moe"


PRICERS: dict[LayerKind, ModuleType] = {
    LayerKind.ATTENTION_DENSE: attention_dense, LayerKind.ATTENTION_MOE: attention_moe,
    LayerKind.GDN_DENSE: gdn_dense, LayerKind.GDN_MOE: gdn_moe,
    LayerKind.MLA_DENSE: mla, LayerKind.MLA_MOE: mla,
}
"""The pricer of each layer kind."""


def kind_of(geometry: ModelGeometry, layer: LayerSpec) -> LayerKind:
    """The layer's kind (multi-latent attention where the geometry's attention is). O(1)."""
    moe = layer.mlp == MlpKind.MOE
    if layer.mixer == MixerKind.GDN:
        return LayerKind.GDN_MOE if moe else LayerKind.GDN_DENSE
    if geometry.attention.mla is not None:
        return LayerKind.MLA_MOE if moe else LayerKind.MLA_DENSE
    return LayerKind.ATTENTION_MOE if moe else LayerKind.ATTENTION_DENSE


def pricer_for(geometry: ModelGeometry, layer: LayerSpec) -> ModuleType:
    """The pricer of the layer's kind (`PRICERS`)."""
    return PRICERS[kind_of(geometry, layer)]
