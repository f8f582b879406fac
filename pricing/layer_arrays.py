"""The decoder layers' arrays of one rank's memory model: each layer's stage workspace, its
retained activations, its no-grad forward transient and its GDN state, with the layout residual,
the CP RoPE cache and the GDN kernel's chunk padding beside them (docs/memory-model.md).

`layer_context` computes once what every layer is priced with (`LayerContext`: the credited
widths and divisors, the busiest EP rank's load, the flags naming the structural terms that
replace the TP1-fitted ones); one function per concern prices a layer; `layer_arrays` composes
them into the per-layer arrays the jitted walk reads. The head, the final norm and the pending
gradients are priced by `PricingModel._build_arrays` (`pricing.model`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import feature_terms, gdn_terms, layout_terms, moe_terms, terms
from .coefficients import CoefficientTable
from .compat import StrEnum
from .coverage import Coverage
from .geometry import LayerSpec, MixerKind, MlpKind, ModelGeometry
from .kernel_set import KernelSet
from .parallel import ParallelLayout, Recompute, RecomputeMode
from .pipeline import rope_cache_per_row


class RetainedBy(StrEnum):
    """How a configuration's retained layers (selective or no recompute) are priced."""

    RECOMPUTED = "recomputed"
    """Full recompute: layers keep only their boundary activation."""
    FITTED = "fitted"
    """The TP1-fitted retained terms, sharded by the credited layout."""
    STRUCTURAL = "structural"
    """By what they hold (the structural kernel set, at a credited TP > 1 or at TP1 CP1):
    GDN layers by `gdn_terms`, docs/memory-model.md#gdn-sp-retained."""
    GDN_UNSHARDED = "gdn-unsharded"
    """The fitted terms under SP without the structural ones: a GDN layer's charged unsharded
    (it keeps its column-parallel inputs gathered)."""
    ALL_UNSHARDED = "all-unsharded"
    """`GDN_UNSHARDED` in a GDN hybrid with MoE MLPs: its attention layers' too
    (docs/memory-model.md#gdn-moe-sp-retained)."""


@dataclass(frozen=True, kw_only=True)
class LayerContext:
    """What every decoder layer of one configuration is priced with, computed once
    (`layer_context`) under the credited layout (`PricingModel.credit`)."""

    geometry: ModelGeometry
    """The decoder's shapes and layer kinds."""
    table: CoefficientTable
    """The backend's coefficients."""
    recompute: Recompute
    """The recompute schedule (a multi-layer chunk's size and method)."""
    credit: ParallelLayout
    """The layout whose sharding the rank is credited with (`coverage.credit_layout`): the class
    whose layout residual the layers get."""
    widths: dict
    """Per-rank widths at the credited TP and expert TP (`model.layer_widths`)."""
    widths_r: dict
    """`widths` with `rank` the largest LoRA slot's rank (the structural terms' adapter tensors)."""
    tp: int
    """TP divisor of widths (`PricingModel.width_tp`)."""
    etp: int
    """Expert-TP divisor of the experts' widths (`PricingModel.width_etp`)."""
    sp_div: int
    """Sequence-parallel divisor of hidden-wide terms (`PricingModel.sp_div`)."""
    rows_cp: int
    """CP divisor of a wave's rows on the busiest rank (`PricingModel.rows_cp`)."""
    ep_skew: float
    """The busiest EP rank's routed rows over rows x top_k, times the expert-TP group's share and
    the EP peers' row scale (`PricingModel.peer_row_scale`, 1 outside `planner.ep_peers`)."""
    routed_extra: float
    """What the all-to-all dispatcher adds per wave row on the busiest EP rank (0: dense)."""
    local_experts: int
    """Experts per EP rank (1: dense)."""
    qk_norm_per_row: float
    """An attention layer's q/k norms, bytes per row (0 without them: `model.has_qk_norm`)."""
    qk_structural_per_row: float
    """The q/k norms beside the structural layer terms (`layout_terms.structural_qk_norm_per_row`;
    0 without them)."""
    cp_release_per_row: float
    """The projection output ring attention (CP > 1) releases, bytes per row (0 unless plain
    attention)."""
    kernels: KernelSet
    """The table's kernel set (`CoefficientTable.kernels`): which structural terms apply."""
    retained_by: RetainedBy
    """How retained layers are priced (`RetainedBy`; `RECOMPUTED` under full recompute)."""
    gdn_retained_structural: bool
    """`retained_by` is `STRUCTURAL` and a GDN layer is so priced (a dense MLP at any such TP,
    a MoE MLP at TP1 and under TP with SP): the final norm's backward and the RoPE entry's own
    rows are charged beside it (`gdn_terms`)."""
    gdn_backward_point: bool
    """Recomputed GDN layers (full recompute, CP1) priced at their backward peak by what they
    hold (`gdn_terms`; the structural kernel set, docs/memory-model.md#gdn-full-point)."""
    tp1_structural: bool
    """A plain dense model's layers at a credited TP1 priced by what they hold
    (`KernelSet.structural_at_tp1`, docs/memory-model.md#tp1-structural)."""

    @property
    def mode(self) -> RecomputeMode:
        """The recompute mode (`recompute.mode`)."""
        return self.recompute.mode

    @property
    def full(self) -> bool:
        """Whether layers are recomputed (full recompute) rather than retained."""
        return self.mode == RecomputeMode.FULL


def layer_context(coverage: Coverage, *, geometry: ModelGeometry, table: CoefficientTable,
                  recompute: Recompute, widths: dict, qk_norm: bool, max_rank: int,
                  moe_load: float | None = None, peer_row_scale: float = 1.0) -> LayerContext:
    """The context of a configuration's layers under its `coverage` (the credited layout and
    divisors, `coverage.assess`): `widths` its credited widths (`model.layer_widths`),
    `qk_norm` whether its attention layers normalise queries and keys, `max_rank` the largest
    LoRA slot's rank, `moe_load` the opt-in MoE load, `peer_row_scale` the EP peers' row scale
    (`planner.ep_peers`). O(layers)."""
    g, p, t = geometry, coverage.parallel, table
    mode = recompute.mode
    sp_div = coverage.sp_div
    width_tp, rows_cp = coverage.width_tp, coverage.rows_cp
    # the busiest EP rank's routed rows over rows x top_k (moe_terms), and what the
    # all-to-all dispatcher adds per wave row on that rank (its top-k copies and receive buffer)
    # and the share of the gathered routed rows one expert-TP group runs (ETP / TP: with an
    # expert TP below TP each rank's experts see its own sequence shard's routed rows)
    ep_skew = moe_terms.busiest_rank_load(g.moe, p.ep, moe_load) if g.moe is not None else 1.0
    ep_skew *= coverage.expert_row_share
    # a wave checked against larger concurrent calls of its EP peers (planner.ep_peers): the routed
    # rows the busiest rank receives grow with the peers' calls, the rest stays this rank's own
    ep_skew *= peer_row_scale
    routed_extra = (moe_terms.routed_extra_per_row(t, widths, ep=p.ep, tp=p.expert_tp, load=ep_skew)
                    if g.moe is not None else 0.0)
    local_experts = g.moe.num_experts // p.ep if g.moe is not None else 1
    layers = g.layers
    widths_r = dict(widths, rank=max_rank)
    qk = terms.qk_norm_per_row(t, widths) if qk_norm else 0.0
    qk_structural = layout_terms.structural_qk_norm_per_row(widths) if qk_norm else 0.0
    # ring attention (CP > 1) releases the projection output the attention would keep;
    # traced for plain attention only (an output gate is a view of that output and keeps it)
    plain = g.attention is not None and not g.attention.output_gate and g.attention.mla is None
    cp_release = layout_terms.cp_attention_release_per_row(t, widths, cp=rows_cp) if plain else 0.0
    kernels = t.kernels
    if mode == RecomputeMode.FULL:
        retained_by = RetainedBy.RECOMPUTED
    elif kernels.structural and (width_tp > 1 or rows_cp == 1):
        # priced by what they hold (gdn_terms), at a credited TP > 1 and at TP1 CP1 (a GDN
        # layer under CP has no CPU trace: the fitted layer stays)
        retained_by = RetainedBy.STRUCTURAL
    elif sp_div > 1 and not kernels.structural:
        retained_by = (RetainedBy.ALL_UNSHARDED if g.gdn is not None and g.moe is not None
                       else RetainedBy.GDN_UNSHARDED)
    else:
        retained_by = RetainedBy.FITTED
    gdn_retained_structural = retained_by == RetainedBy.STRUCTURAL and any(
        layer.mixer == MixerKind.GDN and (layer.mlp == MlpKind.DENSE or width_tp == 1 or sp_div > 1)
        for layer in layers)
    gdn_backward_point = mode == RecomputeMode.FULL and rows_cp == 1 and kernels.structural
    tp1_structural = width_tp == 1 and kernels.structural_at_tp1(
        retained=mode != RecomputeMode.FULL, plain_dense=g.plain_dense)
    return LayerContext(
        geometry=g, table=t, recompute=recompute, credit=coverage.credit,
        widths=widths, widths_r=widths_r, tp=width_tp, etp=coverage.width_etp, sp_div=sp_div,
        rows_cp=rows_cp, ep_skew=ep_skew, routed_extra=routed_extra, local_experts=local_experts,
        qk_norm_per_row=qk, qk_structural_per_row=qk_structural, cp_release_per_row=cp_release,
        kernels=kernels, retained_by=retained_by, gdn_retained_structural=gdn_retained_structural,
        gdn_backward_point=gdn_backward_point, tp1_structural=tp1_structural)


def table_discount(table: CoefficientTable, widths: dict) -> float:
    """The selective core-attention recompute's discount of a retained attention layer
    (`selective_core_attn_discount`; 0 without the entry)."""
    return table.per_row("selective_core_attn_discount", widths)


# --- the layer's stage workspace -------------------------------------------------------------


def mixer_stage_per_row(ctx: LayerContext, layer: LayerSpec) -> float:
    """The layer's mixer stage per row: the TP1-fitted attention or GDN stage (`terms`), or
    multi-latent attention by its true widths (`feature_terms.mla_stage_per_row`) with its
    norms' inputs; an attention layer adds its q/k norms and, under full recompute, gives back
    what ring attention releases (`ctx.cp_release_per_row`)."""
    g, t, widths = ctx.geometry, ctx.table, ctx.widths
    if layer.mixer == MixerKind.ATTENTION and g.attention.mla is not None:
        mixer = (feature_terms.mla_stage_per_row(g.attention, tp=ctx.tp)
                 + terms.mla_norm_inputs_per_row(t, widths, sp_div=ctx.sp_div))
    else:
        mixer = terms.mixer_stage_per_row(t, widths, layer.mixer)
    if layer.mixer == MixerKind.ATTENTION:
        mixer += ctx.qk_norm_per_row - (ctx.cp_release_per_row if ctx.mode == RecomputeMode.FULL else 0.0)
    return mixer


def mlp_stage_per_row(ctx: LayerContext, layer: LayerSpec) -> float:
    """The layer's MLP stage per row (`terms.mlp_stage_per_row`): dense, or the MoE layer's
    routed experts at the busiest EP rank's load and its shared expert."""
    return terms.mlp_stage_per_row(ctx.table, ctx.widths, layer.mlp, ep_skew=ctx.ep_skew,
                                   local_experts=ctx.local_experts,
                                   etp=ctx.etp if ctx.sp_div > 1 else 1, sp_div=ctx.sp_div)


def attention_points_per_row(ctx: LayerContext, layer: LayerSpec, *, stage: float, mixer: float,
                             norms: float) -> tuple[float, bool]:
    """Full recompute: a recomputed attention layer's workspace per row at the backward points
    the TP1-fitted `stage` misses (`layout_terms`, `moe_terms`), and whether it is priced at a
    structural point (a MoE layer under TP with SP: no layout residual beside it)."""
    g, t, widths = ctx.geometry, ctx.table, ctx.widths
    # points of the recomputed layer's backward the TP1-fitted stage misses
    # (layout_terms): the input norm's backward with replicated norms (TP without SP),
    # the MLP's output projection's backward with gathered inputs (TP with SP)
    rope_rows = rope_cache_per_row(g, [layer])
    norm_point = layout_terms.layer_norm_point_per_row(
        t, widths, rope_per_row=rope_rows, replicated=ctx.tp > 1 and ctx.sp_div == 1)
    fc2_point = layout_terms.sp_fc2_point_per_row(
        t, widths, tp=ctx.tp, rope_per_row=rope_rows,
        sequence_parallel=ctx.sp_div > 1) if layer.mlp == MlpKind.DENSE else 0.0
    points = max(norm_point, fc2_point)
    if points:
        stage = max(stage, points - ctx.cp_release_per_row)
    if ctx.tp1_structural and layer.mlp == MlpKind.DENSE:
        # a plain dense model's TP1 layer at its FC1 backward, in place of the fitted stage
        # (layout_terms.tp1_fc1_point_per_row)
        stage = (layout_terms.tp1_fc1_point_per_row(t, widths, rope_per_row=rope_rows, at_tp1=True)
                 + ctx.qk_structural_per_row - ctx.cp_release_per_row)
    if layer.mlp == MlpKind.MOE and ctx.sp_div > 1 and ctx.kernels.sp_point:
        # a MoE layer under TP with SP at its MoE backward point (moe_terms), in place of
        # the TP1-fitted stage sum; the attention's own backward (mixer, norms) comes after
        point = (moe_terms.sp_layer_point_per_row(ctx.widths_r, tp=ctx.tp, rope_per_row=rope_rows,
                                                   heads=g.attention.num_heads / ctx.tp)
                 + ctx.qk_norm_per_row - ctx.cp_release_per_row + moe_terms.sp_shared_expert_point_per_row(widths, tp=ctx.tp)
                 + terms.moe_routed_stage_per_row(t, widths, ep_skew=ctx.ep_skew,
                                                  local_experts=ctx.local_experts,
                                                  etp=ctx.etp, sp_div=ctx.sp_div))
        return max(point, mixer + norms), True
    return stage, False


def full_gdn_point_per_row(ctx: LayerContext, layer: LayerSpec) -> float | None:
    """Full recompute at CP1 on a table with the structural terms (`ctx.gdn_backward_point`): a
    recomputed GDN layer's workspace per row at its backward peak, by what it holds
    (`gdn_terms`); None where the layer is not so priced (a MoE MLP needs TP1 or SP, and
    the table's SP point)."""
    g, t, widths, sp_div = ctx.geometry, ctx.table, ctx.widths, ctx.sp_div
    if not (ctx.gdn_backward_point and layer.mixer == MixerKind.GDN and (layer.mlp == MlpKind.DENSE or (
            (sp_div > 1 or ctx.tp == 1) and ctx.kernels.sp_point))):
        return None
    # a recomputed GDN layer at its backward peak, by what it holds (gdn_terms), in
    # place of the TP1-fitted stage sum and the layout residual fitted without it
    kw = dict(tp=ctx.tp, sp_div=sp_div, rope_per_row=rope_cache_per_row(g, g.layers))
    if layer.mlp == MlpKind.DENSE:
        return gdn_terms.full_gdn_dense_point_per_row(ctx.widths_r, g.gdn, **kw)
    point = (gdn_terms.full_gdn_moe_point_per_row(ctx.widths_r, g.gdn, **kw)
             + gdn_terms.full_gdn_shared_expert_per_row(widths, sp_div=sp_div)
             + terms.moe_routed_stage_per_row(t, widths, ep_skew=ctx.ep_skew,
                                              local_experts=ctx.local_experts,
                                              etp=ctx.etp, sp_div=sp_div))
    return max(point, gdn_terms.full_gdn_norm_point_per_row(ctx.widths_r, g.gdn, **kw))


def layer_stage_per_row(ctx: LayerContext, layer: LayerSpec) -> tuple[float, bool]:
    """The layer's stage workspace per row before its routed and feature extras: the TP1-fitted
    stage sum (mixer, MLP, norms and residual), raised or replaced under full recompute by its
    structural points (`attention_points_per_row`, `full_gdn_point_per_row`); and whether it is
    priced at a structural point (then no layout residual is added beside it)."""
    mixer = mixer_stage_per_row(ctx, layer)
    mlp = mlp_stage_per_row(ctx, layer)
    norms = terms.norm_and_residual_per_row(ctx.table, ctx.widths, sp_div=ctx.sp_div)
    stage, structural = mixer + mlp + norms, False
    if ctx.mode == RecomputeMode.FULL and layer.mixer == MixerKind.ATTENTION:
        stage, structural = attention_points_per_row(ctx, layer, stage=stage, mixer=mixer, norms=norms)
    point = full_gdn_point_per_row(ctx, layer)
    if point is not None:
        stage, structural = point, True
    return stage, structural


# --- the layer's retained activations (selective or no recompute) ----------------------------


def keeps_core(ctx: LayerContext, layer: LayerSpec) -> bool:
    """Whether the layer keeps its core attention output: the output gate's multiply keeps the
    core output: selective recompute frees nothing of a gated attention layer, at any TP
    (docs/memory-model.md#gdn-sp-retained)."""
    return layer.mixer == MixerKind.ATTENTION and ctx.geometry.attention.output_gate


def charged_unsharded(ctx: LayerContext, layer: LayerSpec) -> bool:
    """Whether the layer's fitted retained terms are charged unsharded under SP (a table without
    the structural GDN terms): a GDN layer (`RetainedBy.GDN_UNSHARDED`), and every layer of a GDN
    hybrid with MoE MLPs (`RetainedBy.ALL_UNSHARDED`)."""
    return ctx.retained_by == RetainedBy.ALL_UNSHARDED or (
        ctx.retained_by == RetainedBy.GDN_UNSHARDED and layer.mixer == MixerKind.GDN)


def base_retained_per_row(ctx: LayerContext, layer: LayerSpec, *, extra: float) -> float:
    """The layer's base retained activations per row, before the SP replacements of
    `retained_layer_per_row`: the TP1-fitted layer (`terms`) with its q/k norms, less what ring
    attention releases without recompute, plus the gated attention's undiscounted core; for a
    GDN layer, in place of the fitted layer, the structural `gdn_terms` replacements under
    `ctx.retained_by == RetainedBy.STRUCTURAL` (with a dense MLP, or a MoE MLP at TP1), or the fitted layer unsharded under
    `RetainedBy.GDN_UNSHARDED` (every layer of a GDN hybrid with MoE MLPs under `ALL_UNSHARDED`);
    plus the features' `extra`. Under full recompute this is what a multi-layer chunk
    re-materialises per layer."""
    g, t, widths, widths_r, mode = ctx.geometry, ctx.table, ctx.widths, ctx.widths_r, ctx.mode
    layer_retained = terms.retained_layer_per_row(
        t, widths_r, layer.mixer, layer.mlp, sp_div=1 if charged_unsharded(ctx, layer) else ctx.sp_div,
        selective=mode == RecomputeMode.SELECTIVE, ep_skew=ctx.ep_skew)
    if layer.mixer == MixerKind.ATTENTION:
        layer_retained += ctx.qk_norm_per_row - (ctx.cp_release_per_row if mode == RecomputeMode.NONE else 0.0)
    if keeps_core(ctx, layer) and mode == RecomputeMode.SELECTIVE:
        # selective recompute frees nothing of a gated attention layer (`keeps_core`)
        layer_retained += table_discount(t, widths)
    if ctx.retained_by == RetainedBy.STRUCTURAL and layer.mixer == MixerKind.GDN and layer.mlp == MlpKind.DENSE:
        # in place of the TP1-fitted layer, whose hidden-wide part is mostly per-head memory
        layer_retained = gdn_terms.tp_retained_gdn_layer_per_row(widths_r, g.gdn, tp=ctx.tp,
                                                                 sp_div=ctx.sp_div)
    elif ctx.retained_by == RetainedBy.STRUCTURAL and layer.mixer == MixerKind.GDN and ctx.tp == 1:
        # a GDN layer with a MoE MLP at TP1, by what it holds (gdn_terms)
        layer_retained = gdn_terms.retained_gdn_moe_layer_per_row(widths_r, g.gdn,
                                                                  routed=g.moe.top_k * ctx.ep_skew)
    if extra:
        layer_retained += extra
    return layer_retained


def sp_layer_release_per_row(ctx: LayerContext, layer: LayerSpec) -> float:
    """What a retained attention layer under TP with SP holds less than its structural term
    (`moe_terms.sp_retained_moe_layer_per_row`, `layout_terms.sp_retained_layer_per_row`) per
    row: without recompute what ring attention releases (`ctx.cp_release_per_row`), with
    selective recompute the core-attention discount (`table_discount`; none where the layer
    keeps its core, `keeps_core`); less the output gate's fp32 sigmoid a GDN hybrid's gated
    attention layer also keeps (`gdn_terms.output_gate_per_row`, docs/memory-model.md#gdn-sp-retained)."""
    less = (ctx.cp_release_per_row if ctx.mode == RecomputeMode.NONE else
            0.0 if keeps_core(ctx, layer) else table_discount(ctx.table, ctx.widths))
    if ctx.retained_by == RetainedBy.STRUCTURAL and keeps_core(ctx, layer):
        less -= gdn_terms.output_gate_per_row(ctx.widths)
    return less


def sp_moe_retained_per_row(ctx: LayerContext, index: int, layer: LayerSpec, *, extra: float,
                            moe_extra: float) -> tuple[float, float]:
    """A retained MoE layer under TP with SP (`moe_terms.sp_retained_moe_layer_per_row`) on a
    table with the SP structural terms: its retained activations and its forward peak per row,
    in place of the TP1-fitted layer (`index`: the first layer also holds the embedding's
    output)."""
    g = ctx.geometry
    # a retained MoE layer under TP with SP (moe_terms), replacing the TP1-fitted layer
    # where the table carries the SP structural terms (torch-cpu; te-gpu keeps its own)
    less = sp_layer_release_per_row(ctx, layer)
    kw = dict(tp=ctx.tp, etp=ctx.etp, routed=g.moe.top_k * ctx.ep_skew,
              rope_per_row=rope_cache_per_row(g, [layer]), first=index == 0)
    kept = (moe_terms.sp_retained_moe_layer_per_row(ctx.widths_r, **kw)
            - less + ctx.qk_structural_per_row + extra)
    forward = (moe_terms.sp_retained_moe_layer_per_row(ctx.widths_r, forward=True, **kw)
               - less + ctx.qk_structural_per_row + extra + moe_extra)
    return kept, forward


def sp_gdn_moe_retained_per_row(ctx: LayerContext, *, extra: float, moe_extra: float) -> tuple[float, float]:
    """A retained GDN layer with a MoE MLP under TP with SP (`gdn_terms.sp_retained_gdn_moe_layer_per_row`)
    on a table with the SP structural terms: its retained activations and its forward peak (the
    MoE combine, with the dispatcher's copies `moe_extra`) per row, in place of the TP1-fitted
    layer (docs/memory-model.md#gdn-moe-sp-retained)."""
    g = ctx.geometry
    kw = dict(tp=ctx.tp, etp=ctx.etp, routed=g.moe.top_k * ctx.ep_skew)
    kept = gdn_terms.sp_retained_gdn_moe_layer_per_row(ctx.widths_r, g.gdn, **kw) + extra
    forward = gdn_terms.sp_retained_gdn_moe_layer_per_row(ctx.widths_r, g.gdn, forward=True, **kw) + extra + moe_extra
    return kept, forward


def sp_dense_retained_per_row(ctx: LayerContext, layer: LayerSpec, *,
                              fitted: float) -> tuple[float, float]:
    """A retained attention layer with a dense MLP under TP with SP: what it keeps gathered
    (`layout_terms.sp_retained_layer_per_row`) against the TP1-fitted layer (`fitted`): its
    retained activations (the larger) and its forward peak per row (0 without the entry).
    At a credited TP1 with `ctx.tp1_structural` (the TP1 structural layer) the structural term
    at TP = 1 replaces the fitted layer (`fitted` then carries only the features' extra)."""
    g, t = ctx.geometry, ctx.table
    # what an SP layer keeps gathered (layout_terms), against the TP1-fitted layer
    less = sp_layer_release_per_row(ctx, layer)
    kw = dict(tp=ctx.tp, rope_per_row=rope_cache_per_row(g, [layer]),
              sequence_parallel=ctx.sp_div > 1, at_tp1=ctx.tp1_structural)
    sp_layer = layout_terms.sp_retained_layer_per_row(t, ctx.widths_r, **kw)
    sp_layer = sp_layer - less + ctx.qk_structural_per_row if sp_layer else 0.0
    sp_forward = layout_terms.sp_retained_layer_per_row(t, ctx.widths_r, forward=True, **kw)
    sp_forward = sp_forward - less + ctx.qk_structural_per_row if sp_forward else 0.0
    return max(fitted, sp_layer), sp_forward


def retained_layer_per_row(ctx: LayerContext, index: int, layer: LayerSpec, *, extra: float,
                           moe_extra: float) -> tuple[float, float]:
    """The layer's retained activations per row (`base_retained_per_row`, replaced or raised
    under TP with SP without full recompute by `sp_moe_retained_per_row`,
    `sp_gdn_moe_retained_per_row` or `sp_dense_retained_per_row`, and at TP1 replaced by the
    TP1 structural layer, `ctx.tp1_structural`), and its structural forward peak per row (0
    without one)."""
    if (ctx.retained_by == RetainedBy.STRUCTURAL and ctx.sp_div > 1 and layer.mixer == MixerKind.GDN
            and layer.mlp == MlpKind.MOE):
        return sp_gdn_moe_retained_per_row(ctx, extra=extra, moe_extra=moe_extra)
    if ctx.tp1_structural and not ctx.full:
        # the TP1 structural layer in place of the TP1-fitted one (layout_terms.structural_at_tp1)
        kept, forward = sp_dense_retained_per_row(ctx, layer, fitted=0.0)
        return kept + extra, forward + extra
    layer_retained = base_retained_per_row(ctx, layer, extra=extra)
    retains = ctx.mode != RecomputeMode.FULL and layer.mixer == MixerKind.ATTENTION and ctx.sp_div > 1
    moe_sp = (retains and layer.mlp == MlpKind.MOE
              and ctx.kernels.structural)
    if moe_sp:
        return sp_moe_retained_per_row(ctx, index, layer, extra=extra, moe_extra=moe_extra)
    if retains and layer.mlp == MlpKind.DENSE:
        return sp_dense_retained_per_row(ctx, layer, fitted=layer_retained)
    return layer_retained, 0.0


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
    workspace (`layer_stage_per_row`) and no-grad forward transient, each with the dispatcher's
    routed extra and the features' extra; its GDN state; under full recompute its boundary
    activation retained (and a multi-layer chunk's re-materialised layers in the workspace),
    else its retained activations (`retained_layer_per_row`), its own forward peak and its
    retained backward in the workspace."""
    g, t, widths, mode = ctx.geometry, ctx.table, ctx.widths, ctx.mode
    workspace, structural = layer_stage_per_row(ctx, layer)
    nograd = terms.nograd_stage_per_row(t, widths, layer.mlp, ep_skew=ctx.ep_skew,
                                        local_experts=ctx.local_experts)
    moe_extra = ctx.routed_extra if layer.mlp == MlpKind.MOE else 0.0
    if moe_extra:
        workspace += moe_extra
        nograd = nograd + moe_extra
    # model-family features: their extra tensors live in the stage, the forward
    # transient and (without full recompute) the retained activations alike
    extra = feature_terms.layer_extra_per_row(g, widths, layer, tp=ctx.tp,
                                              sp_div=ctx.sp_div, ep_skew=ctx.ep_skew)
    if extra:
        workspace += extra
        nograd = nograd + extra
    gdn_state = (terms.gdn_state_per_segment(t, g.gdn, tp=ctx.tp)
                 if layer.mixer == MixerKind.GDN else 0.0)
    layer_retained, sp_forward = retained_layer_per_row(ctx, index, layer, extra=extra,
                                                        moe_extra=moe_extra)
    if mode == RecomputeMode.FULL:
        retained = terms.boundary_per_row(t, widths, sp_div=ctx.sp_div)
        if ctx.recompute.num_layers > 1 or ctx.recompute.method == "block":
            # a multi-layer recompute chunk re-materialises num_layers layers at once
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
    return LayerRow(retained=layer_retained, workspace=workspace, nograd=max(nograd, own),
                    nograd_plain=nograd, retained_forward=own, gdn_state=gdn_state,
                    structural_point=structural)


# --- beside the layers: the layout residual, the CP RoPE cache, the GDN chunk padding ---------


def covered_by_structural_terms(ctx: LayerContext, layer: LayerSpec) -> bool:
    """Whether the structural layout terms cover the layer, so that it takes the layout residual
    fitted with them (the others take the one fitted without them, `bare`): an attention layer
    with a dense MLP, or with a MoE MLP under TP with SP (under full recompute its TP+SP point
    `moe_terms.tp_backward_point_per_routed_row`; retaining its activations on a table with the
    SP structural terms, `moe_terms.sp_retained_moe_layer_per_row`); a retained GDN layer priced
    by what it holds (`ctx.retained_by == RetainedBy.STRUCTURAL`, `gdn_terms`) with a dense MLP, or a MoE MLP under SP."""
    moe_point = ctx.sp_div > 1 and (ctx.mode == RecomputeMode.FULL
                                    or ctx.kernels.structural)
    if ctx.tp == 1:
        # a layer at TP1 takes the TP1 residual only beside the TP1 structural layer or point
        return ctx.tp1_structural
    if layer.mixer == MixerKind.ATTENTION:
        return layer.mlp == MlpKind.DENSE or (layer.mlp == MlpKind.MOE and moe_point)
    return (layer.mixer == MixerKind.GDN and ctx.retained_by == RetainedBy.STRUCTURAL
            and (layer.mlp == MlpKind.DENSE or ctx.sp_div > 1))


def layout_residual_per_layer(ctx: LayerContext) -> np.ndarray:
    """What the layout leaves unsharded (`layout_terms.layout_residual_per_row`), per layer and
    row, at the credited layout's class: the residual fitted with the structural layout terms
    for the layers they cover (`covered_by_structural_terms`), the one fitted without them
    (`bare`) for the others."""
    g, t, mode, c = ctx.geometry, ctx.table, ctx.mode, ctx.credit
    # a GDN layer charged unsharded under SP (`RetainedBy.GDN_UNSHARDED`; every layer of a GDN
    # hybrid with MoE MLPs, `ALL_UNSHARDED`) holds no more than without SP: it takes the
    # residual of the class without SP
    return np.array([layout_terms.layout_residual_per_row(
        t, ctx.widths, tp=c.tp, cp=c.cp, retained=mode != RecomputeMode.FULL,
        sequence_parallel=c.sequence_parallel and not charged_unsharded(ctx, layer),
        bare=not covered_by_structural_terms(ctx, layer))
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
    rope = layout_terms.cp_rope_cache_per_row(entry, cp=ctx.rows_cp)
    if ctx.gdn_retained_structural:
        # the entry's own rows, which the fitted layer the GDN term replaces absorbed (gdn_terms)
        rope += gdn_terms.rope_cache_entry_per_row(entry)
    elif ctx.mode != RecomputeMode.FULL or (ctx.geometry.moe is None and ctx.geometry.gdn is None):
        # ... and beside the SP structural terms (layout_terms; under full recompute the MoE and
        # GDN layers' structural points carry the entry's rows themselves)
        rope += layout_terms.sp_rope_entry_per_row(ctx.table, rope_per_row=entry, tp=ctx.tp,
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
    entry = rope_cache_per_row(g, g.layers)   # one entry row (the walk's RoPE charges)
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
