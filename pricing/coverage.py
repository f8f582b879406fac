"""What the evidence covers of one configuration, assessed once: the typed gaps, the credited
layout and the divisors every layer is priced with (docs/memory-model.md#basis).

`assess(geometry, parallel, recompute, table)` -> `Coverage`. A configuration with a layout gap
is priced as the largest traced class that divides it (`credit_layout`), or with no credit at
all; feature, pipeline and expert-TP gaps keep the layout's credit (their terms are explicit
bounds). Nothing downstream reads a gap's message: the kinds decide.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import feature_terms, layout_terms
from .coefficients import CoefficientTable
from .compat import StrEnum
from .geometry import ModelGeometry
from .kernel_set import KernelSet
from .parallel import ParallelLayout, Recompute, RecomputeMode


class GapKind(StrEnum):
    """Why a configuration lies outside the evidence (docs/memory-model.md#basis)."""

    UNTRACED_LAYOUT = "untraced-layout"
    """A (TP, SP, CP) class with no `layout_residual` entry in the table."""
    UNTRACED_LAYER_KIND = "untraced-layer-kind"
    """GDN or MoE layers at a traced class whose traces hold dense layers only."""
    MLA_TP = "mla-tp"
    """Multi-latent attention at TP > 1."""
    RECOMPUTE_SCHEDULE = "recompute-schedule"
    """Full recompute other than full/uniform/1."""
    MOE_RETAINED = "moe-retained"
    """MoE layers retaining their activations where no trace of this table covers them."""
    GDN_MOE_RETAINED_WITHOUT_SP = "gdn-moe-retained-without-sp"
    """Retained GDN layers with MoE MLPs at TP > 1 without SP."""
    GDN_RETAINED_CPU_ONLY = "gdn-retained-cpu-only"
    """Retained GDN layers at TP > 1 on a table without the structural GDN terms."""
    PIPELINE = "pipeline"
    """PP > 1: stages priced under 1F1B, validated on CPU pipeline traces only."""
    EXPERT_TP = "expert-tp"
    """An expert TP no trace covers."""
    FEATURE = "feature"
    """A model-family feature no trace covers (`feature_terms.feature_gaps`)."""
    FSDP = "fsdp"
    """Under FSDP (`fsdp.model`): a family, attention kernel or resharding no FSDP trace covers."""
    DTYPE = "dtype"
    """Activations wider than bf16/fp16 (fp32): every traced term is a bf16 model's, scaled."""


LAYOUT_GAP_KINDS = frozenset({
    GapKind.UNTRACED_LAYOUT, GapKind.UNTRACED_LAYER_KIND, GapKind.MLA_TP,
    GapKind.RECOMPUTE_SCHEDULE, GapKind.MOE_RETAINED, GapKind.GDN_MOE_RETAINED_WITHOUT_SP,
    GapKind.GDN_RETAINED_CPU_ONLY})
"""The gaps of the layout and recompute: they cost the layout its credit (`credit_layout`)."""


@dataclass(frozen=True)
class Gap:
    """One gap: its kind and the reason shown with the price."""

    kind: GapKind
    """What is not covered."""
    detail: str
    """The one-line reason a breakdown's `reasons` show."""


# Layout classes traced with GDN or MoE layers (docs/memory-model.md#boundaries); the multi-rank
# CPU grid's other layouts traced dense layers only.
_MIXED_TRACED = frozenset({"tp1-cp1", "tp1-cp2", "tp4sp-cp1"})
# MoE layers also at TP2+SP and under CP (docs/memory-model.md#moe-cp)
_MOE_TRACED = _MIXED_TRACED | {"tp2sp-cp1", "tp2sp-cp2", "tp4sp-cp2", "tp1-cp4", "tp2sp-cp4", "tp4sp-cp4"}
# MoE layers traced retaining their activations (selective and no recompute; CPU traces only,
# docs/memory-model.md#moe-sp-retained), at Megatron's default expert TP
_MOE_RETAINED_TRACED = frozenset({"tp1-cp1", "tp2sp-cp1", "tp4sp-cp1", "tp1-cp2", "tp2sp-cp2", "tp4sp-cp2",
                                  "tp1-cp4", "tp2sp-cp4", "tp4sp-cp4"})
# GDN layers also at TP2, TP2+SP and TP4 (docs/memory-model.md#gdn-tp)
_GDN_TRACED = _MIXED_TRACED | {"tp2-cp1", "tp2sp-cp1", "tp4-cp1"}
# GDN and MoE layers traced together (full recompute; docs/memory-model.md#gdn-moe-tp)
_GDN_MOE_TRACED = _MIXED_TRACED | {"tp2sp-cp1"}
# ... and retaining their activations under TP with SP (docs/memory-model.md#gdn-moe-sp-retained)
_GDN_MOE_RETAINED_TRACED = frozenset({"tp1-cp1", "tp2sp-cp1", "tp4sp-cp1"})


def mixed_traced(geometry: ModelGeometry) -> frozenset[str] | None:
    """The layout classes traced with this geometry's GDN or MoE layers (None: a dense
    geometry, every traced class applies)."""
    if geometry.gdn is not None:
        return _GDN_MOE_TRACED if geometry.moe is not None else _GDN_TRACED
    if geometry.moe is not None:
        return _MOE_TRACED
    return None


def _key(parallel: ParallelLayout) -> str:
    return layout_terms.layout_key(parallel.tp, parallel.sequence_parallel, parallel.cp)


def _name(parallel: ParallelLayout) -> str:
    return f"TP{parallel.tp}{' SP' if parallel.sequence_parallel else ''} CP{parallel.cp}"


def expert_tp_traced_retained(parallel: ParallelLayout) -> bool:
    """Whether retained MoE layers are traced at this expert TP: ETP = TP, or ETP dividing TP
    at EP1 (docs/memory-model.md#moe-etp)."""
    etp, tp = parallel.expert_tp, parallel.tp
    return etp == tp or (tp % etp == 0 and parallel.ep == 1)


def _moe_retained_on_evidence(geometry: ModelGeometry, parallel: ParallelLayout,
                              kernels: KernelSet) -> bool:
    """Whether retained MoE layers are priced on evidence: a table with the structural terms,
    at a class and expert TP the CPU traces cover (docs/memory-model.md#moe-sp-retained,
    #gdn-moe-sp-retained)."""
    if not kernels.structural:
        return False
    if geometry.gdn is not None:
        return _key(parallel) in _GDN_MOE_RETAINED_TRACED and parallel.expert_tp == parallel.tp
    return _key(parallel) in _MOE_RETAINED_TRACED and expert_tp_traced_retained(parallel)


def layout_gaps(geometry: ModelGeometry, parallel: ParallelLayout, recompute: Recompute,
                table: CoefficientTable) -> list[Gap]:
    """The layout's and recompute's gaps (`LAYOUT_GAP_KINDS`): an untraced class, GDN or MoE
    layers at a class traced with dense layers only, MLA at TP > 1, a recompute schedule other
    than full/uniform/1, retained MoE or GDN layers no trace of this table covers."""
    kernels = KernelSet.of(table)
    gaps = []
    key = _key(parallel)
    traced = layout_terms.traced_layouts(table)
    if key not in traced:
        gaps.append(Gap(GapKind.UNTRACED_LAYOUT, f"{_name(parallel)} "
                        f"(no multi-rank trace; traced: {', '.join(sorted(traced))})"))
    elif (mixed := mixed_traced(geometry)) is not None and key not in mixed:
        kind = "GDN" if geometry.gdn is not None else "MoE"
        gaps.append(Gap(GapKind.UNTRACED_LAYER_KIND, f"{kind} layers at {_name(parallel)} "
                        f"(the multi-rank traces cover dense layers; {kind} is traced "
                        f"at {', '.join(sorted(mixed))})"))
    if parallel.tp > 1 and geometry.attention is not None and geometry.attention.mla is not None:
        gaps.append(Gap(GapKind.MLA_TP, f"multi-latent attention at TP{parallel.tp} (no trace; "
                        "Megatron-core's local spec splits the down projections that Transformer "
                        "Engine and the pricing replicate): priced without TP credit"))
    if recompute.mode == RecomputeMode.FULL:
        if not recompute.is_one_layer_full:
            gaps.append(Gap(GapKind.RECOMPUTE_SCHEDULE, f"full/{recompute.method}/"
                            f"{recompute.num_layers} recompute (traced: full/uniform/1)"))
        return gaps
    mode = recompute.mode.value
    if geometry.moe is not None and not _moe_retained_on_evidence(geometry, parallel, kernels):
        why = ("traced on the CPU only: bench/results/moe_validation.txt" if not kernels.structural
               else "no CPU trace of a retained MoE layer at this layout class and expert TP")
        gaps.append(Gap(GapKind.MOE_RETAINED, f"MoE with {mode} recompute ({why})"))
    if parallel.tp > 1 and geometry.gdn is not None:
        if geometry.moe is not None and not parallel.sequence_parallel:
            gaps.append(Gap(GapKind.GDN_MOE_RETAINED_WITHOUT_SP,
                            f"GDN layers with MoE MLPs at TP{parallel.tp} with {mode} recompute "
                            "(traced at TP1, and under TP with SP only)"))
        elif not kernels.structural:
            what, anchor = (("GDN layers with MoE MLPs", "gdn-moe-sp-retained") if geometry.moe is not None
                            else ("GDN layers", "gdn-sp-retained"))
            gaps.append(Gap(GapKind.GDN_RETAINED_CPU_ONLY,
                            f"{what} at TP{parallel.tp} with {mode} recompute (traced on the CPU "
                            f"only: torch-cpu's structural terms, docs/memory-model.md#{anchor}): "
                            "this table's retained GDN terms with the layout's credit"))
    return gaps


def expert_tp_gaps(geometry: ModelGeometry, parallel: ParallelLayout) -> list[Gap]:
    """An expert TP no trace covers: one that does not divide TP, or one between 1 and TP with
    EP > 1 (docs/memory-model.md#moe-etp). Priced as a bound keeping the layout's credit: the
    experts 1/ETP wide on every gathered routed row (`Coverage.expert_row_share` = 1)."""
    etp, tp = parallel.expert_tp, parallel.tp
    if geometry.moe is None or etp == tp or (tp % etp == 0 and (parallel.ep == 1 or etp == 1)):
        return []
    where = f"ETP{etp} at TP{tp}" + ("" if tp % etp else f" with EP{parallel.ep}")
    why = ("an expert TP that does not divide TP" if tp % etp else
           "an expert TP between 1 and TP is traced at EP1 only")
    return [Gap(GapKind.EXPERT_TP,
                f"{where} (no trace: {why}): experts priced {etp}-way sharded on every gathered routed row")]


def pipeline_gaps(parallel: ParallelLayout) -> list[Gap]:
    """PP > 1: stages priced under 1F1B, keeping the layout's credit
    (docs/memory-model.md#pipeline-traces)."""
    if parallel.pp > 1:
        return [Gap(GapKind.PIPELINE, f"PP{parallel.pp} (stages priced under 1F1B, validated on "
                    f"CPU pipeline traces only)")]
    return []


def dtype_scale(geometry: ModelGeometry) -> float:
    """What every charge is multiplied by: dtype bytes / 2 (fp32: 2; bf16 and fp16: 1). The
    traces are of bf16 models; an fp32 model at most doubles each tensor they hold, so the
    scaled price is an upper bound (docs/memory-model.md#dtype)."""
    return max(1.0, geometry.dtype_bytes / 2)


def dtype_gaps(geometry: ModelGeometry) -> list[Gap]:
    """An fp32 model: no trace of its own dtype (`dtype_scale`)."""
    if dtype_scale(geometry) > 1.0:
        return [Gap(GapKind.DTYPE, f"dtype {geometry.dtype} (traced models are bf16: every charge "
                    f"x{dtype_scale(geometry):g}, an upper bound)")]
    return []


def credit_layout(geometry: ModelGeometry, parallel: ParallelLayout, gaps: list[Gap],
                  table: CoefficientTable) -> ParallelLayout:
    """The layout an uncovered layout (`gaps`, its layout gaps) is credited with.

    Only untraced classes and retained MoE/GDN layers traced on the CPU only keep a credit:
    the largest traced class dividing the layout (TP' | TP, CP' | CP, SP' only with SP; among
    as many ranks, SP first, then more CP), which bounds it from above since per-rank memory
    never grows with more TP, SP or CP. Any other gap: TP1, CP1. O(divisors)."""
    none = ParallelLayout(tp=1, cp=1, pp=parallel.pp, ep=parallel.ep, dp=parallel.dp)
    key = _key(parallel)
    kinds = [g.kind for g in gaps]
    moe_retained = GapKind.MOE_RETAINED in kinds and expert_tp_traced_retained(parallel)
    creditable = {GapKind.UNTRACED_LAYOUT, GapKind.UNTRACED_LAYER_KIND, GapKind.GDN_RETAINED_CPU_ONLY}
    if moe_retained:
        creditable.add(GapKind.MOE_RETAINED)
    if any(k not in creditable for k in kinds):
        return none
    covered = layout_terms.traced_layouts(table)
    mixed = mixed_traced(geometry)
    if mixed is not None:
        covered = covered & mixed
    if moe_retained:
        covered = covered & _MOE_RETAINED_TRACED
    if (moe_retained or GapKind.GDN_RETAINED_CPU_ONLY in kinds) and key in covered:
        return parallel
    best = none
    for tp in (d for d in range(1, parallel.tp + 1) if parallel.tp % d == 0):
        for cp in (d for d in range(1, parallel.cp + 1) if parallel.cp % d == 0):
            for sp in ((False, True) if (parallel.sequence_parallel and tp > 1) else (False,)):
                cand = layout_terms.layout_key(tp, sp, cp)
                if cand == key or cand not in covered:
                    continue
                if (tp * cp, sp, cp) > (best.tp * best.cp, best.sequence_parallel, best.cp):
                    best = ParallelLayout(tp=tp, cp=cp, sequence_parallel=sp, pp=parallel.pp,
                                          ep=parallel.ep, dp=parallel.dp)
    return best


@dataclass(frozen=True, kw_only=True)
class Coverage:
    """One configuration's coverage (`assess`): its gaps, the credited layout and the
    divisors every layer is priced with."""

    parallel: ParallelLayout
    """The configuration's own layout."""
    credit: ParallelLayout
    """The layout whose sharding the rank is credited with (`credit_layout`; `parallel` when
    it has no layout gap)."""
    gaps: tuple[Gap, ...]
    """Every gap: layout and recompute first, then pipeline, expert TP, features, dtype."""

    @property
    def layout_gaps(self) -> tuple[Gap, ...]:
        """The gaps that cost the layout its credit (`LAYOUT_GAP_KINDS`)."""
        return tuple(g for g in self.gaps if g.kind in LAYOUT_GAP_KINDS)

    @property
    def reasons(self) -> tuple[str, ...]:
        """The gaps' details, in order."""
        return tuple(g.detail for g in self.gaps)

    def has(self, kind: GapKind) -> bool:
        """Whether a gap of `kind` is present."""
        return any(g.kind == kind for g in self.gaps)

    @property
    def conservative(self) -> bool:
        """Whether widths and rows lose (part of) their credit: a layout gap."""
        return bool(self.layout_gaps)

    @property
    def width_tp(self) -> int:
        """TP divisor of widths: the credited TP."""
        return self.credit.tp

    @property
    def width_etp(self) -> int:
        """Expert-TP divisor of the experts' widths: the layout's expert TP, never above the
        credited TP."""
        return min(self.parallel.expert_tp, self.credit.tp)

    @property
    def expert_row_share(self) -> float:
        """The share of a wave's gathered routed rows one expert-TP group runs: ETP / TP under
        the credited layout with SP, 1 otherwise (docs/memory-model.md#moe-tp-point)."""
        if not self.credit.sequence_parallel or self.has(GapKind.EXPERT_TP):
            return 1.0
        return self.width_etp / self.credit.tp

    @property
    def sp_div(self) -> int:
        """Sequence-parallel divisor of hidden-wide terms under the credited layout."""
        return self.credit.tp if self.credit.sequence_parallel else 1

    @property
    def rows_cp(self) -> int:
        """CP divisor of a wave's rows on the busiest rank under the credited layout."""
        return self.credit.cp


def assess(geometry: ModelGeometry, parallel: ParallelLayout, recompute: Recompute,
           table: CoefficientTable) -> Coverage:
    """The configuration's `Coverage`, assessed once. O(divisors)."""
    lgaps = layout_gaps(geometry, parallel, recompute, table)
    gaps = (lgaps + pipeline_gaps(parallel) + expert_tp_gaps(geometry, parallel)
            + [Gap(GapKind.FEATURE, g) for g in feature_terms.feature_gaps(geometry)]
            + dtype_gaps(geometry))
    credit = credit_layout(geometry, parallel, lgaps, table) if lgaps else parallel
    return Coverage(parallel=parallel, credit=credit, gaps=tuple(gaps))
