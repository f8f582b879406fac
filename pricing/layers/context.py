"""What every decoder layer of one configuration is priced with, computed once from its
coverage (`coverage.Coverage`) and the table's kernel set: the credited widths and divisors,
the busiest EP rank's load, and the typed choices of which terms price the layers
(docs/memory-model.md#basis).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import layout_terms, moe_terms, terms
from ..coefficients import CoefficientTable
from ..compat import StrEnum
from ..coverage import Coverage
from ..geometry import LayerSpec, MixerKind, MlpActivation, MlpKind, ModelGeometry
from ..kernel_set import KernelSet
from ..parallel import ParallelLayout, Recompute, RecomputeMode


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
    fused_retained: bool = False
    """A plain dense model's retained layers (selective, none) priced by what the fused kernels
    keep (`KernelSet.fused_retained`), at any credited TP with CP1 and under CP without SP (ring
    attention's, `ring_saves`) (docs/memory-model.md#gpu-kernel-allocation-models)."""
    fused_moe_retained: bool = False
    """A plain-attention MoE model's retained layers (selective, none) priced by what the fused
    kernels keep (`KernelSet.fused_retained`: TE's grouped GEMM and the fused weighted SwiGLU of the
    experts, the dispatcher's plain PyTorch, under TP with SP the combine's fp32 tensors), on a
    CP1 layout at TP1 (with or without EP) or under TP with SP without EP (expert TP = TP; no
    shared expert); and
    a multi-latent-attention model's MoE layers at `fused_mla`'s layout (TP1 CP1 EP1; `mla_moe`)
    (docs/memory-model.md#gpu-kernel-allocation-models, #mla-moe-kernel-models)."""
    fused_gdn_retained: bool = False
    """A GDN hybrid's retained layers (selective, none; GDN and gated attention layers with dense
    SwiGLU MLPs, `gdn_dense_hybrid`) priced by what FLA's kernels and the fused kernels keep
    (`KernelSet.fused_gdn`, `gdn_kernel_terms`), on a TP1 CP1 layout (PP allowed); TP > 1 and CP
    keep the fitted terms (no te-gpu trace) (docs/memory-model.md#te-gpu-gdn)."""
    fused_gdn_point: bool = False
    """A GDN hybrid's layers (`gdn_dense_hybrid`) recomputed under full recompute priced at the
    points FLA's kernels and the fused kernels hold (`KernelSet.fused_gdn_point`,
    `gdn_kernel_terms.fused_gdn_point_per_row`; the gated attention layers at the fused dense
    layer's point with their output gate), on a TP1 CP1 layout (PP allowed); TP > 1 and CP keep
    the fitted terms (docs/memory-model.md#te-gpu-gdn-full)."""
    fused_point: bool = False
    """A plain dense model's recomputed layers priced at the point written from the fused
    kernels' allocation models (`KernelSet.fused` with `tp1_point`), at any credited TP with CP1
    and under CP without SP; they take the layout residual fitted beside it, every other layer of the
    table the one fitted without it (docs/memory-model.md#gpu-kernel-allocation-models)."""

    fused_mla: bool = False
    """A multi-latent-attention model's layers with a dense MLP priced by what the fused kernels
    keep and hold at their points (`KernelSet.fused_mla`; retained and recomputed), on a TP1 CP1
    layout without EP; MLA layers with a MoE MLP take the composed terms where retained
    (`fused_moe_retained`), the fitted ones under full recompute
    (docs/memory-model.md#mla-kernel-models, #mla-moe-kernel-models)."""

    @property
    def mode(self) -> RecomputeMode:
        """The recompute mode (`recompute.mode`)."""
        return self.recompute.mode

    @property
    def kernel_retained(self) -> bool:
        """Whether the retained layers are priced by what the fused kernels keep (dense or MoE)."""
        return self.fused_retained or self.fused_moe_retained or self.fused_gdn_retained

    @property
    def gdn_on_kernels(self) -> bool:
        """Whether a GDN hybrid's layers are priced by FLA's and the fused kernels' models,
        retained (`fused_gdn_retained`) or recomputed (`fused_gdn_point`): its head and caller then
        drop the seeds' GDN margins."""
        return self.fused_gdn_retained or self.fused_gdn_point

    @property
    def ring_saves(self) -> bool:
        """Whether the attention's saved tensors are ring attention's (no recompute under CP):
        the ring keeps its own k/v buffer in place of the projection's output."""
        return self.rows_cp > 1 and self.mode == RecomputeMode.NONE

    @property
    def mla_on_kernels(self) -> bool:
        """Whether every layer is priced by the fused kernels' MLA terms (`fused_mla`: dense MLPs,
        and MoE MLPs where `fused_moe_retained`): the head's forward point and the RoPE entry are
        then charged as beside the plain kernel-model layers; a model with fitted MoE-MLP layers
        keeps the fitted layers' margins."""
        return self.fused_mla and all(layer.mlp == MlpKind.DENSE or self.fused_moe_retained
                                      for layer in self.geometry.layers)

    @property
    def on_kernel_models(self) -> bool:
        """Whether the model's layers are priced by what the fused kernels keep and hold (the
        recomputed point, the retained terms, or MLA's): the head's forward point and the wave's
        RoPE entry are then charged as beside them, one place for that decision
        (docs/memory-model.md#gpu-kernel-allocation-models)."""
        return self.fused_point or self.kernel_retained or self.mla_on_kernels or self.fused_gdn_point

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
    qk_structural = (layout_terms.structural_qk_norm_per_row(widths, t.kernels) if qk_norm
                     else 0.0)
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
    # under CP at any TP without SP (the multi-rank traces at TP1 and TP2 under CP); TP with SP
    # under CP has no te-gpu trace and keeps the fitted terms
    kernel_layout = rows_cp == 1 or sp_div == 1
    fused_point = (mode == RecomputeMode.FULL and kernels.fused and kernels.tp1_point
                   and g.plain_dense and kernel_layout)
    fused_retained = (mode != RecomputeMode.FULL and kernels.fused and kernels.fused_retained
                      and kernels.tp1_point and g.plain_dense and kernel_layout)
    # MLA's dense layers at TP1 CP1 without EP (the te-gpu traces' layout), any recompute
    fused_mla = (kernels.fused and kernels.fused_mla and g.attention is not None
                 and g.attention.mla is not None and g.gdn is None and p.tp == 1 and width_tp == 1
                 and rows_cp == 1 and p.ep == 1)
    # at TP1 (with EP too: the busiest rank's routed rows, the combine's all-to-all output in
    # `routed_extra`), and under TP with SP without EP where the credited TP and expert TP are the
    # layout's (the combine's fp32 tensors); written from the multi-rank anatomies
    fused_moe_retained = (mode != RecomputeMode.FULL and kernels.fused and kernels.fused_retained
                          and ((plain_moe(g) and rows_cp == 1
                                and (p.tp == 1 or (sp_div > 1 and p.ep == 1 and width_tp == p.tp
                                                   and coverage.width_etp == width_tp
                                                   and not g.moe.shared_expert_ffn)))
                               # MLA layers with MoE MLPs: at fused_mla's layout (TP1 CP1 EP1)
                               or (fused_mla and mla_moe(g))))
    fused_gdn_retained = (mode != RecomputeMode.FULL and kernels.fused and kernels.fused_gdn
                          and gdn_dense_hybrid(g) and p.tp == 1 and rows_cp == 1)
    # at TP1 only: under TP with SP the point prices the seed's 27B TP4+SP GPU wave 7.2% over
    # its measurement (docs/memory-model.md#te-gpu-gdn-full), so TP > 1 keeps the fitted terms
    fused_gdn_point = (mode == RecomputeMode.FULL and kernels.fused and kernels.fused_gdn_point
                       and gdn_dense_hybrid(g) and p.tp == 1 and width_tp == 1 and rows_cp == 1)
    return LayerContext(
        geometry=g, table=t, recompute=recompute, credit=coverage.credit,
        widths=widths, widths_r=widths_r, tp=width_tp, etp=coverage.width_etp, sp_div=sp_div,
        rows_cp=rows_cp, ep_skew=ep_skew, routed_extra=routed_extra, local_experts=local_experts,
        qk_norm_per_row=qk, qk_structural_per_row=qk_structural, cp_release_per_row=cp_release,
        kernels=kernels, retained_by=retained_by, gdn_retained_structural=gdn_retained_structural,
        gdn_backward_point=gdn_backward_point, tp1_structural=tp1_structural,
        fused_point=fused_point, fused_retained=fused_retained,
        fused_moe_retained=fused_moe_retained, fused_mla=fused_mla,
        fused_gdn_retained=fused_gdn_retained, fused_gdn_point=fused_gdn_point)


def plain_moe(g: ModelGeometry) -> bool:
    """Whether every layer is plain attention (no output gate, no multi-latent attention) with a
    MoE MLP whose experts run TE's grouped GEMM and the fused weighted SwiGLU (no biases, SwiGLU),
    and the model has no GDN spec and no shared-expert gate: the MoE layers the fused kernels'
    retained term was written for (`layout_terms.fused_retained_moe_layer_per_row`; a shared
    expert's `fused_moe_shared_expert_per_row` at TP1 only, no term under TP with SP). O(layers)."""
    att, f = g.attention, g.features
    return (att is not None and not att.output_gate and att.mla is None and g.gdn is None
            and g.moe is not None and not f.shared_expert_gate
            and not f.linear_bias and f.mlp_activation == MlpActivation.SWIGLU
            and all(layer.mixer == MixerKind.ATTENTION and layer.mlp == MlpKind.MOE
                    for layer in g.layers))


def mla_moe(g: ModelGeometry) -> bool:
    """Whether every layer is multi-latent attention (no output gate, no GDN spec) with a dense
    MLP or a MoE MLP whose experts run TE's grouped GEMM and the fused weighted SwiGLU (no biases,
    SwiGLU, no shared-expert gate), and some layer has a MoE MLP: the layers the composed MLA and
    retained MoE kernel terms price (`layers.mla.moe_kernel_layer_per_row`). O(layers)."""
    att, f = g.attention, g.features
    return (att is not None and att.mla is not None and not att.output_gate and g.gdn is None
            and g.moe is not None and not f.linear_bias and f.mlp_activation == MlpActivation.SWIGLU
            and not f.shared_expert_gate
            and all(layer.mixer == MixerKind.ATTENTION for layer in g.layers)
            and any(layer.mlp == MlpKind.MOE for layer in g.layers))


def gdn_dense_hybrid(g: ModelGeometry) -> bool:
    """Whether the model is a GDN hybrid whose layers are GDN or gated or plain attention (no
    multi-latent attention) each with a dense SwiGLU MLP without biases: the layers FLA's and the
    fused kernels' retained terms were written for (`gdn_kernel_terms`). O(layers)."""
    att, f = g.attention, g.features
    return (g.gdn is not None and g.moe is None and (att is None or att.mla is None)
            and not f.linear_bias and f.mlp_activation == MlpActivation.SWIGLU
            and all(layer.mlp == MlpKind.DENSE for layer in g.layers))


def table_discount(table: CoefficientTable, widths: dict) -> float:
    """The selective core-attention recompute's discount of a retained attention layer
    (`selective_core_attn_discount`; 0 without the entry)."""
    return table.per_row("selective_core_attn_discount", widths)


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
