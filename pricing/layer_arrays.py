"""The decoder layers' arrays of one rank's memory model: each layer's stage workspace, its
retained activations, its no-grad forward transient and its GDN state, with the layout residual,
the CP RoPE cache and the GDN kernel's chunk padding beside them (docs/memory-model.md).

Each layer is priced by its kind's pricer (`pricing.layers`) under the configuration's
`LayerContext` (`layers.context`); `layer_arrays` composes the rows into the per-layer arrays
the jitted walk reads. The head, the final norm and the pending gradients are priced by
`PricingModel` (`pricing.model`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import feature_terms, gdn_kernel_terms, gdn_terms, layout_terms, terms
from .geometry import LayerSpec, MixerKind, MlpKind
from .layers import mla, pricer_for
from .layers.context import LayerContext, RetainedBy, charged_unsharded, layer_context
from .parallel import RecomputeMode
from .pipeline import rope_cache_instances, rope_cache_per_row

__all__ = ["LayerArrays", "LayerContext", "LayerRow", "RetainedBy", "layer_arrays",
           "layer_context", "layer_row"]


# --- one layer's row of the arrays ------------------------------------------------------------


class LayerRow(NamedTuple):
    """One layer's entries of the per-layer arrays (bytes per row; `gdn_state` per segment)."""

    retained: float
    workspace: float
    nograd: float
    nograd_plain: float
    retained_forward: float
    gdn_state: float
    structural_point: bool


def layer_row(ctx: LayerContext, index: int, layer: LayerSpec) -> LayerRow:
    """Layer `index`'s charges before the layout residual and the RoPE cache: its stage
    workspace (its kind's `stage`, `pricing.layers`) and no-grad forward transient, each with the dispatcher's
    routed extra and the features' extra; its GDN state; under full recompute its boundary
    activation retained (and a multi-layer chunk's re-materialised layers in the workspace),
    else its retained activations (its kind's `retained`), its own forward peak and its
    retained backward in the workspace."""
    g, t, widths, mode = ctx.geometry, ctx.table, ctx.widths, ctx.mode
    pricer = pricer_for(g, layer)
    workspace, structural = pricer.stage(ctx, layer)
    nograd = terms.nograd_stage_per_row(t, widths, layer.mlp, ep_skew=ctx.ep_skew,
                                        local_experts=ctx.local_experts)
    if ctx.fused_gdn_point and layer.mixer == MixerKind.GDN:
        # the checkpointed first forward at FLA's forward (gdn_kernel_terms), where it holds more
        nograd = max(nograd, gdn_kernel_terms.fused_gdn_point_per_row(t, ctx.widths_r, g.gdn,
                                                                      part="nograd"))
    moe_extra = ctx.routed_extra if layer.mlp == MlpKind.MOE else 0.0
    if moe_extra:
        workspace += moe_extra
        nograd = nograd + moe_extra
    # model-family features: their extra tensors live in the stage, the forward
    # transient and (without full recompute) the retained activations alike
    extra = feature_terms.layer_extra_per_row(g, widths, layer, tp=ctx.tp,
                                              sp_div=ctx.sp_div, ep_skew=ctx.ep_skew)
    if t.kernels.fused and layer.mixer == MixerKind.ATTENTION and g.attention.mla is None:
        # flash-attn's fp32 log-sum-exp (kept) and dq accumulator and softmax_d (its backward)
        # beyond the bounds the fused and fitted attention terms charge (layout_terms)
        flash_kept, flash_backward = layout_terms.flash_fp32_excess_per_row(
            widths, g.attention.head_dim)
        extra += flash_kept
        workspace += flash_backward - flash_kept
    if extra:
        workspace += extra
        nograd = nograd + extra
    gdn_state = (terms.gdn_state_per_segment(t, g.gdn, tp=ctx.tp)
                 if layer.mixer == MixerKind.GDN else 0.0)
    layer_retained, sp_forward = pricer.retained(ctx, index, layer, extra=extra, moe_extra=moe_extra)
    if mode == RecomputeMode.FULL:
        retained = terms.boundary_per_row(t, widths, sp_div=ctx.sp_div)
        if ctx.recompute.num_layers > 1 or ctx.recompute.method == "block":
            # a multi-layer recompute chunk re-materialises num_layers layers at once (a GDN
            # hybrid's recomputed layers on the kernel models: at least what those keep)
            if ctx.fused_gdn_point:
                layer_retained = max(layer_retained, gdn_kernel_terms.kernel_kept_per_row(ctx, layer) + extra)
            workspace += (ctx.recompute.num_layers - 1) * layer_retained
        return LayerRow(retained=retained, workspace=workspace, nograd=nograd, nograd_plain=nograd,
                        retained_forward=0.0, gdn_state=gdn_state, structural_point=structural)
    own = max(terms.retained_forward_per_row(t, widths, layer.mlp, ep_skew=ctx.ep_skew,
                                             layer_retained=layer_retained) + moe_extra,
              sp_forward)
    if ctx.gdn_retained_structural:
        # the layer's residual input and the embedding's output beside it (gdn_terms)
        own += gdn_terms.forward_inputs_per_row(widths, sp_div=ctx.sp_div)
    stage = workspace
    workspace = terms.retained_backward_per_row(t, ctx.widths_r, layer.mlp, ep_skew=ctx.ep_skew,
                                                stage=stage)
    if ctx.kernels.retained_backward:
        # the backward's all-to-all and un-sort copies of the routed gradients
        workspace += moe_extra
    # a MoE layer retained on the fused kernels: its forward point is its kernel models' (`own`,
    # which holds more than its no-grad forward), not the fitted no-grad stage
    forward = own if ctx.fused_moe_retained else max(nograd, own)
    return LayerRow(retained=layer_retained, workspace=workspace, nograd=forward,
                    nograd_plain=nograd, retained_forward=own, gdn_state=gdn_state,
                    structural_point=structural)


# --- beside the layers: the layout residual, the CP RoPE cache, the GDN chunk padding ---------


def layout_residual_per_layer(ctx: LayerContext) -> np.ndarray:
    """What the layout leaves unsharded (`layout_terms.layout_residual_per_row`), per layer and
    row, at the credited layout's class: the residual fitted with the structural layout terms
    for the layers they cover (their kind's `residual_covered`), the one fitted without them
    (`bare`) for the others."""
    g, t, mode, c = ctx.geometry, ctx.table, ctx.mode, ctx.credit
    # a GDN layer charged unsharded under SP (`RetainedBy.GDN_UNSHARDED`; every layer of a GDN
    # hybrid with MoE MLPs, `ALL_UNSHARDED`) holds no more than without SP: it takes the
    # residual of the class without SP
    # with the fused kernels' point (te-gpu, full recompute) only the layers it prices take the
    # residual fitted beside it; every other layer the one fitted without it (`bare`)
    # (and the MLA layers the fused kernels' MLA terms price, `mla.on_kernels`)
    beside_models = ctx.kernels.fused
    return np.array([layout_terms.layout_residual_per_row(
        t, ctx.widths, tp=c.tp, cp=c.cp, retained=mode != RecomputeMode.FULL,
        sequence_parallel=c.sequence_parallel and not charged_unsharded(ctx, layer),
        bare=not (ctx.fused_point or ctx.kernel_retained or ctx.fused_gdn_point
                  or mla.on_kernels(ctx, layer)
                  if beside_models else pricer_for(g, layer).residual_covered(ctx, layer)))
        for layer in g.layers]) if g.num_layers else np.zeros(0)


def wave_rope_cache_per_row(ctx: LayerContext) -> float:
    """The RoPE cache entry of the whole longest sequence under CP (`layout_terms.cp_rope_cache_per_row`),
    per row, once per wave; with the structural GDN terms, or the SP structural terms under TP
    with SP (without full recompute, or with it in a model without MoE or GDN layers, whose
    structural full-recompute points carry the entry) or at TP1 (`ctx.tp1_structural`), also
    the entry's own rows, which the
    fitted layers those terms replace absorbed (`gdn_terms.rope_cache_entry_per_row`,
    `layout_terms.sp_rope_entry_per_row`)."""
    entry = rope_cache_per_row(ctx.geometry, ctx.geometry.layers)
    instances = rope_cache_instances(ctx.geometry, ctx.geometry.layers)
    # every instance's entry beyond the rank's rows under CP; with MLA the call's own entries
    # beyond the one the fitted and structural terms carry (docs/memory-model.md#mla-rope-caches)
    rope = layout_terms.cp_rope_cache_per_row(entry * instances, cp=ctx.rows_cp)
    if instances > 1:
        rope += entry * (instances - 1)
    if ctx.gdn_retained_structural:
        # the entry's own rows, which the fitted layer the GDN term replaces absorbed (gdn_terms)
        rope += gdn_terms.rope_cache_entry_per_row(entry)
    elif (ctx.mode != RecomputeMode.FULL or ctx.fused_gdn_point
          or (ctx.geometry.moe is None and ctx.geometry.gdn is None)):
        # ... and beside the SP structural terms (layout_terms; under full recompute the MoE and
        # GDN layers' structural points carry the entry's rows themselves)
        # (the fused kernels' point at any TP: the entry's rows once per wave)
        rope += entry if ctx.on_kernel_models else \
            layout_terms.sp_rope_entry_per_row(ctx.table, rope_per_row=entry, tp=ctx.tp,
                                               sequence_parallel=ctx.sp_div > 1,
                                               at_tp1=ctx.tp1_structural)
    return rope


def gdn_chunk_padding(ctx: LayerContext) -> tuple[int, np.ndarray, np.ndarray]:
    """The GDN kernel's chunk (1 without GDN layers) and its padding rows' bytes per padding row
    per layer: at the layer's own points, and retained (without full recompute)."""
    g = ctx.geometry
    # a GDN layer's chunked kernel pads each forward call's rows (gdn_terms): its padding
    # rows keep the kernel's tensors until the layer's backward (without full recompute) and
    # hold them at the layer's own points (the recomputed kernel under full recompute, the
    # gradients of its padded tensors in a retained layer's backward)
    gdn_chunk = gdn_terms.chunk_of(ctx.table) if g.gdn is not None else 1
    kernel = gdn_terms.gdn_kernel_per_row(g.gdn, tp=ctx.tp, chunk=gdn_chunk) if gdn_chunk > 1 else 0.0
    pad_point = np.array([kernel if layer.mixer == MixerKind.GDN else 0.0 for layer in g.layers])
    pad_retained = pad_point * (1.0 if ctx.mode != RecomputeMode.FULL else 0.0)
    return gdn_chunk, pad_point, pad_retained


# --- the composition ------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerArrays:
    """The decoder layers' arrays (one entry per layer, bytes per row; `gdn_state` per segment)
    and what lies beside them: the largest layer's layout residual and the CP RoPE cache
    (per row; with full recompute both are beside the head's backward), the GDN chunk."""

    retained: np.ndarray
    """Each layer's retained activations per row: its boundary activation under full recompute,
    else what it keeps for its backward (with the layout residual and, on layer 0, the RoPE
    cache)."""
    workspace: np.ndarray
    """Each layer's workspace per row: its stage (full recompute: with the layout residual and
    the RoPE cache) or, retained, its backward transient."""
    nograd: np.ndarray
    """Each layer's no-grad forward transient per row, the larger of it and a retained layer's
    own forward peak, with the layout residual and the RoPE cache where they are live."""
    gdn_state: np.ndarray
    """Each layer's GDN recurrent state per segment (0 for non-GDN layers)."""
    nograd_plain: np.ndarray
    """The no-grad transient and a retained layer's own forward peak, before `nograd` takes the
    larger; without the layout residual and the RoPE cache."""
    retained_forward: np.ndarray
    """A retained layer's own forward peak per row (0 under full recompute); without the layout
    residual and the RoPE cache."""
    pad_point: np.ndarray
    """Each GDN layer's chunk-padding bytes per padding row at its own points (0 elsewhere)."""
    pad_retained: np.ndarray
    """`pad_point` kept until the layer's backward (all 0 under full recompute)."""
    gdn_chunk: int
    """The GDN kernel's chunk (1: no GDN layers, or a table without the padding entry)."""
    residual: float
    """The largest layer's layout residual per row (beside the head's backward under full
    recompute)."""
    rope: float
    """The CP RoPE cache entry per row, once per wave (beside the head's backward under full
    recompute)."""
    rope_entry: float
    """One RoPE cache entry per row of a call's longest sequence (`pipeline.rope_cache_per_row`):
    what the walk charges the other calls' entries at a call's points, and under CP the entry
    rows beyond the rank's own instead of the bound in `rope` (`walk.rope_credit`)."""


def layer_arrays(ctx: LayerContext) -> LayerArrays:
    """Every layer's row (`layer_row`), then what the layout leaves unsharded
    (`layout_residual_per_layer`: per layer when layers retain activations, once per wave at
    every point under full recompute) and the CP RoPE cache (`wave_rope_cache_per_row`: live
    from the first layer's forward on), and the GDN chunk padding (`gdn_chunk_padding`).
    O(layers)."""
    g, mode = ctx.geometry, ctx.mode
    n = g.num_layers
    retained = np.zeros(n)
    workspace = np.zeros(n)
    nograd = np.zeros(n)
    gdn_state = np.zeros(n)
    nograd_plain = np.zeros(n)  # the no-grad transient and a retained layer's own forward
    retained_fwd = np.zeros(n)  # peak, before `nograd` takes the larger
    structural_point = np.zeros(n, dtype=bool)  # layers priced at a structural point (MoE TP+SP, GDN full: no residual)
    for i, layer in enumerate(g.layers):
        row = layer_row(ctx, i, layer)
        retained[i], workspace[i], nograd[i] = row.retained, row.workspace, row.nograd
        nograd_plain[i], retained_fwd[i] = row.nograd_plain, row.retained_forward
        gdn_state[i], structural_point[i] = row.gdn_state, row.structural_point
    # what the layout leaves unsharded (layout_terms): per layer when layers retain
    # activations, once per wave (every point) under full recompute
    per_layer = layout_residual_per_layer(ctx)
    residual = float(per_layer.max()) if n else 0.0   # beside the head's backward
    if mode == RecomputeMode.FULL:
        workspace += np.where(structural_point, 0.0, per_layer)
        nograd += per_layer
    else:
        retained += per_layer
    # the RoPE cache entry of the whole longest sequence under CP (layout_terms): once per
    # wave, live from the first layer's forward on (layer 0's retained memory, and its
    # forward transient; under full recompute beside the full residual at every point)
    rope = wave_rope_cache_per_row(ctx)
    # a call's entry rows, every instance's (the walk's RoPE charges)
    entry = rope_cache_per_row(g, g.layers) * rope_cache_instances(g, g.layers)
    if rope and mode == RecomputeMode.FULL:
        workspace += rope
        nograd += rope
    elif rope:
        retained[0] += rope
        nograd[0] += rope
    gdn_chunk, pad_point, pad_retained = gdn_chunk_padding(ctx)
    return LayerArrays(retained=retained, workspace=workspace, nograd=nograd, gdn_state=gdn_state,
                       nograd_plain=nograd_plain, retained_forward=retained_fwd,
                       pad_point=pad_point, pad_retained=pad_retained, gdn_chunk=gdn_chunk,
                       residual=residual, rope=rope, rope_entry=entry)
