"""The memory model of one rank: geometry, layout, recompute, LoRA and coefficients, reduced to
the per-layer arrays the jitted schedule walk reads.

Fail closed (docs/memory-model.md#basis): an unmeasured configuration gets a conservative bound
(rows not divided by CP, widths not divided by TP) and `basis` says "conservative" with the reasons. No term is ever dropped to 0 by a gate.
With PP > 1 each stage is priced under the 1F1B schedule (`pipeline`): the arrays hold every
stage's charges and, for the per-wave walk, their fold; the basis stays "conservative".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import feature_terms, gdn_terms, layout_terms, moe_terms, terms
from .coefficients import DEFAULT_BACKEND, CoefficientTable, load_table
from .errors import ConfigError, bad
from .geometry import MlpKind, ModelGeometry
from .layer_arrays import layer_arrays, layer_context
from .lora import LoraConfig, adapter_param_counts
from .parallel import ParallelLayout, Recompute, RecomputeMode
from .pipeline import (
    fold_stages,
    received_activation_per_row,
    rope_cache_per_row,
    stage_bounds,
    stage_charges,
)

DEFAULT_SAFETY = 1.10
DEFAULT_HEAD = "chunked:512"   # the output head computes logits in chunks of 512 rows


def parse_head(head: str) -> tuple[str, int]:
    """'chunked:512' -> ('chunked', 512); 'full-native' -> ('full-native', 0)."""
    if head in ("full-native", "full-te"):
        return head, 0
    if head.startswith("chunked:"):
        rows = head.split(":", 1)[1]
        if rows.isdigit() and int(rows) > 0:
            return "chunked", int(rows)
    raise bad(ConfigError, "head", head, "must be chunked:N (N > 0), full-native or full-te")


def evidence_gaps(geometry: ModelGeometry, parallel: ParallelLayout, recompute: Recompute,
                  table: CoefficientTable | None = None) -> list[str]:
    """Why this configuration lies outside the measured evidence (empty: it is covered).

    Covered (docs/memory-model.md#basis): the multi-rank traced layouts (`layout_gaps`) with
    one-layer full recompute, or selective/no recompute for dense models (GDN hybrids at TP1);
    PP1 (PP > 1: `pipeline_gaps`); MoE at any EP (the busiest EP rank's load is the worst case,
    `moe_terms.busiest_rank_load`; traced at EP2/4/8). Model-family features no trace covers are listed too (`feature_terms.feature_gaps`); they are priced by explicit
    conservative terms and keep the layout's TP and CP credit (see `PricingModel.conservative`).
    """
    return (layout_gaps(geometry, parallel, recompute, table) + pipeline_gaps(parallel)
            + expert_tp_gaps(geometry, parallel) + feature_terms.feature_gaps(geometry))


def expert_tp_gaps(geometry: ModelGeometry, parallel: ParallelLayout) -> list[str]:
    """An expert TP other than TP (Megatron's `expert_tensor_parallel_size`) that no trace
    covers: one that does not divide TP, or one between 1 and TP with EP > 1 (traced: ETP 1 and
    2 at TP4+SP and ETP1 at TP2+SP, EP1; ETP1 at TP2+SP with EP2: docs/memory-model.md#moe-tp-point,
    #moe-etp). Priced as a bound that keeps the layout's credit (`PricingModel.expert_row_share`
    = 1): the experts 1/ETP wide (`layer_widths`) on every gathered routed row, although each
    rank's experts see only its expert-TP group's share of them."""
    etp, tp = parallel.expert_tp, parallel.tp
    if geometry.moe is None or etp == tp or (tp % etp == 0 and (parallel.ep == 1 or etp == 1)):
        return []
    where = f"ETP{etp} at TP{tp}" + ("" if tp % etp else f" with EP{parallel.ep}")
    why = ("an expert TP that does not divide TP" if tp % etp else
           "an expert TP between 1 and TP is traced at EP1 only")
    return [f"{where} (no trace: {why}): experts priced {etp}-way sharded on every gathered routed row"]


def pipeline_gaps(parallel: ParallelLayout) -> list[str]:
    """PP > 1: every stage is priced under the 1F1B schedule (`pricing.pipeline`), keeping the
    layout's TP and CP credit; CPU pipeline traces validate it (full recompute, PP2 and PP4,
    docs/memory-model.md#pipeline-traces), no GPU source does yet."""
    if parallel.pp > 1:
        return [f"PP{parallel.pp} (stages priced under 1F1B, validated on CPU pipeline traces "
                f"only)"]
    return []


# Layout classes traced with GDN or MoE layers (docs/memory-model.md#boundaries: the 27B hybrid
# at TP4+SP on GPU; TP1 at CP1/CP2 on the CPU grid); the multi-rank CPU grid's other layouts
# (bench/results/traces_multirank.jsonl) traced dense layers only.
_MIXED_TRACED = frozenset({"tp1-cp1", "tp1-cp2", "tp4sp-cp1"})
# MoE layers also at TP2+SP, and under CP at every traced CP class (TP1, TP2+SP, TP4+SP with CP2
# and CP4; the EP grid's CP cells, bench/ep_grid.py; docs/memory-model.md#moe-cp)
_MOE_TRACED = _MIXED_TRACED | {"tp2sp-cp1", "tp2sp-cp2", "tp4sp-cp2", "tp1-cp4", "tp2sp-cp4", "tp4sp-cp4"}
# Layout classes whose MoE layers are traced retaining their activations (selective and no
# recompute; CPU traces only: bench/results/moe_validation.txt), at Megatron's default expert TP;
# under CP at TP1, TP2+SP and TP4+SP with CP2 and CP4 (#moe-cp)
_MOE_RETAINED_TRACED = frozenset({"tp1-cp1", "tp2sp-cp1", "tp4sp-cp1", "tp1-cp2", "tp2sp-cp2", "tp4sp-cp2",
                                  "tp1-cp4", "tp2sp-cp4", "tp4sp-cp4"})
# GDN layers also at TP2, TP2+SP and TP4: the GDN grid's multi-rank CPU cells, every recompute
# mode (bench/gdn_grid.py, bench/results/layout_validation.txt; docs/memory-model.md#gdn-tp, and
# without full recompute at TP > 1 priced by `gdn_terms`, docs/memory-model.md#gdn-sp-retained)
_GDN_TRACED = _MIXED_TRACED | {"tp2-cp1", "tp2sp-cp1", "tp4-cp1"}
# GDN and MoE layers traced together also at TP2+SP (full recompute): the GDN grid's GDN+MoE
# hybrid at TP1, TP2+SP and TP4+SP (bench/gdn_grid.py; docs/memory-model.md#gdn-moe-tp)
_GDN_MOE_TRACED = _MIXED_TRACED | {"tp2sp-cp1"}
# ... and retaining their activations (selective and no recompute) under TP with SP: the same
# hybrid at TP2+SP and TP4+SP, both waves, and a held-out geometry (torch-cpu prices them by
# `gdn_terms`, on evidence; te-gpu credits them: docs/memory-model.md#gdn-moe-sp-retained); at
# TP1 CP1 the grid's anatomy cell and qwen3.6-35b-a3b's cpu-fake cells, whose held-out half of
# bench/validation_study.py is 2.0-2.4 % over (bench/results/validation_summary.txt;
# docs/memory-model.md#gdn-sp-retained, "At TP1")
_GDN_MOE_RETAINED_TRACED = frozenset({"tp1-cp1", "tp2sp-cp1", "tp4sp-cp1"})


def _mixed_traced(geometry: ModelGeometry) -> frozenset[str] | None:
    """The layout classes traced with this geometry's GDN or MoE layers (None: a dense
    geometry, every traced class applies). MoE also at TP2+SP (the EP grid's TP2+SP+EP2
    cells, bench/results/moe_validation.txt) and with CP (TP1, TP2+SP, TP4+SP at CP2 and CP4:
    docs/memory-model.md#moe-cp); GDN (with a dense MLP) also at TP2, TP2+SP and
    TP4 (`_GDN_TRACED`); a GDN hybrid with MoE layers only where both were traced together
    (`_GDN_MOE_TRACED`: TP1 at CP1/CP2, TP2+SP, TP4+SP)."""
    if geometry.gdn is not None:
        return _GDN_MOE_TRACED if geometry.moe is not None else _GDN_TRACED
    if geometry.moe is not None:
        return _MOE_TRACED
    return None


def layout_gaps(geometry: ModelGeometry, parallel: ParallelLayout, recompute: Recompute,
                table: CoefficientTable | None = None) -> list[str]:
    """The parallel layout's and recompute's part of `evidence_gaps`.

    Covered layouts are those `table` (default: the torch-cpu table, whose multi-rank traces
    fitted them) has a `layout_residual` entry for (`layout_terms.traced_layouts`: TP1/2/4/8
    with and without SP at CP1, TP1 at CP2 and CP4, TP2, TP4 and TP8 with SP at CP2 and CP4),
    for every recompute mode; MoE and GDN layers only at the layouts in `_mixed_traced`. Without
    full recompute MoE layers are on evidence where `_moe_retained_on_evidence` says (torch-cpu,
    its traced classes and expert TPs), conservative otherwise (te-gpu: CPU traces only); GDN layers with dense MLPs at TP > 1 are covered where the table carries the structural
    terms that price them (torch-cpu: `gdn_terms`, docs/memory-model.md#gdn-sp-retained) and
    conservative with the layout's credit otherwise (te-gpu: no GPU trace); with MoE MLPs the same
    under TP with SP (`_GDN_MOE_RETAINED_TRACED`, docs/memory-model.md#gdn-moe-sp-retained) and
    conservative without credit without SP (no trace); multi-latent attention only at TP1."""
    table = table or load_table("torch-cpu")
    gaps = []
    key = layout_terms.layout_key(parallel.tp, parallel.sequence_parallel, parallel.cp)
    traced = layout_terms.traced_layouts(table)
    if key not in traced:
        gaps.append(f"TP{parallel.tp}{' SP' if parallel.sequence_parallel else ''} CP{parallel.cp} "
                    f"(no multi-rank trace; traced: {', '.join(sorted(traced))})")
    elif (mixed := _mixed_traced(geometry)) is not None and key not in mixed:
        kind = "GDN" if geometry.gdn is not None else "MoE"
        gaps.append(f"{kind} layers at TP{parallel.tp}{' SP' if parallel.sequence_parallel else ''} "
                    f"CP{parallel.cp} (the multi-rank traces cover dense layers; {kind} is traced "
                    f"at {', '.join(sorted(mixed))})")
    if parallel.tp > 1 and geometry.attention is not None and geometry.attention.mla is not None:
        gaps.append(f"multi-latent attention at TP{parallel.tp} (no trace; Megatron-core's local "
                    "spec splits the down projections that Transformer Engine and the pricing "
                    "replicate): priced without TP credit")
    if recompute.mode == RecomputeMode.FULL:
        if not recompute.is_one_layer_full:
            gaps.append(f"full/{recompute.method}/{recompute.num_layers} recompute (traced: full/uniform/1)")
    else:
        if geometry.moe is not None and not _moe_retained_on_evidence(geometry, parallel, table):
            why = ("traced on the CPU only: bench/results/moe_validation.txt"
                   if layout_terms.SP_RETAINED not in table.terms else
                   "no CPU trace of a retained MoE layer at this layout class and expert TP")
            gaps.append(f"MoE with {recompute.mode.value} recompute ({why})")
        if parallel.tp > 1 and geometry.gdn is not None:
            mode = recompute.mode.value
            if geometry.moe is not None and not parallel.sequence_parallel:
                gaps.append(f"GDN layers with MoE MLPs at TP{parallel.tp} with {mode} recompute "
                            "(traced at TP1, and under TP with SP only)")
            elif geometry.moe is not None and layout_terms.SP_RETAINED not in table.terms:
                gaps.append(f"GDN layers with MoE MLPs at TP{parallel.tp} with {mode} recompute (traced on the "
                            "CPU only: torch-cpu's structural terms, docs/memory-model.md#gdn-moe-sp-retained): "
                            "this table's retained GDN terms with the layout's credit")
            elif geometry.moe is None and layout_terms.SP_RETAINED not in table.terms:
                gaps.append(f"GDN layers at TP{parallel.tp} with {mode} recompute (traced on the CPU only: "
                            "torch-cpu's structural terms, docs/memory-model.md#gdn-sp-retained): "
                            "this table's retained GDN terms with the layout's credit")
    return gaps


def _moe_retained_on_evidence(geometry: ModelGeometry, parallel: ParallelLayout,
                              table: CoefficientTable) -> bool:
    """Whether MoE layers retaining their activations (selective or no recompute) are priced on
    evidence: on a table fitted to the CPU traces, which carries their structural terms
    (torch-cpu: `retained_moe_mlp` fitted by bench/moe_fit.py, `moe_terms.sp_retained_moe_layer_per_row`
    under TP with SP), at a layout class and expert TP its multi-rank traces cover (every such
    class meets the targets on held-out cells: bench/results/moe_validation.txt,
    docs/memory-model.md#moe-sp-retained), for a model without GDN layers; a GDN hybrid with MoE
    MLPs at the classes its GDN+MoE cells were traced retaining at (`_GDN_MOE_RETAINED_TRACED`:
    TP1, TP2+SP and TP4+SP, at Megatron's default expert TP; docs/memory-model.md#gdn-moe-sp-retained).
    The te-gpu table has no GPU trace of a retained MoE layer: conservative."""
    key = layout_terms.layout_key(parallel.tp, parallel.sequence_parallel, parallel.cp)
    if layout_terms.SP_RETAINED not in table.terms:
        return False
    if geometry.gdn is not None:
        return key in _GDN_MOE_RETAINED_TRACED and parallel.expert_tp == parallel.tp
    return key in _MOE_RETAINED_TRACED and _expert_tp_retained_traced(parallel)


def _expert_tp_retained_traced(parallel: ParallelLayout) -> bool:
    """Whether retained MoE layers (selective or no recompute) are traced at this expert TP: at
    Megatron's default (ETP = TP), or below TP dividing it at EP1 (TP2+SP ETP1, TP4+SP ETP1 and
    ETP2; docs/memory-model.md#moe-etp)."""
    etp, tp = parallel.expert_tp, parallel.tp
    return etp == tp or (tp % etp == 0 and parallel.ep == 1)


def credit_layout(geometry: ModelGeometry, parallel: ParallelLayout, recompute: Recompute,
                  table: CoefficientTable | None = None) -> ParallelLayout:
    """The layout whose sharding an uncovered layout is credited with (docs/memory-model.md#basis).

    When the only gap is an untraced (TP, SP, CP) class, the rank is priced as the largest
    traced class that divides it: TP' | TP, CP' | CP, SP' only with SP; among classes of as many
    ranks, the one with SP, then the one with more CP (CP shards every row, the gathered
    hidden-wide tensors too: qwen3-32b TP8+SP+CP2 on grpo-8x8 is 36.6 GiB as TP4+SP+CP2 against
    42.2 as TP8+SP). Per-rank memory never grows with more TP, SP or CP (the layout properties
    the traces show and the tests check), so any such class's price bounds the uncovered layout
    from above. MoE without full recompute (traced on
    the CPU only) keeps the credit of the classes its CPU traces cover (`_MOE_RETAINED_TRACED`,
    at the default expert TP and below it at EP1, `_expert_tp_retained_traced`;
    docs/memory-model.md#moe-sp-retained, #moe-etp), and so do GDN hybrids without full recompute
    on a table without the structural GDN terms (te-gpu; docs/memory-model.md#gdn-sp-retained),
    with MoE MLPs under TP with SP (`_GDN_MOE_RETAINED_TRACED`, docs/memory-model.md#gdn-moe-sp-retained).
    Any other gap (recompute schedule, GDN with MoE MLPs without full recompute at TP > 1 without
    SP, multi-latent attention at TP > 1) gets no credit: TP1, CP1.
    O(divisors)."""
    table = table or load_table("torch-cpu")
    none = ParallelLayout(tp=1, cp=1, pp=parallel.pp, ep=parallel.ep, dp=parallel.dp)
    key = layout_terms.layout_key(parallel.tp, parallel.sequence_parallel, parallel.cp)
    gaps = layout_gaps(geometry, parallel, recompute, table)
    untraced = [g for g in gaps if "(no multi-rank trace" in g or "(the multi-rank traces cover" in g]
    moe_retained = [g for g in gaps if g.startswith("MoE with ") and _expert_tp_retained_traced(parallel)]
    gdn_retained = [g for g in gaps if g.startswith(("GDN layers at TP", "GDN layers with MoE MLPs at TP"))
                    and "(traced on the CPU only" in g]
    if len(untraced) + len(moe_retained) + len(gdn_retained) != len(gaps):
        return none
    covered = layout_terms.traced_layouts(table)
    mixed = _mixed_traced(geometry)
    if mixed is not None:
        covered = covered & mixed
    if moe_retained:
        covered = covered & _MOE_RETAINED_TRACED
    if (moe_retained or gdn_retained) and key in covered:
        return parallel
    best = none
    for tp in (d for d in range(1, parallel.tp + 1) if parallel.tp % d == 0):
        for cp in (d for d in range(1, parallel.cp + 1) if parallel.cp % d == 0):
            for sp in ((False, True) if (parallel.sequence_parallel and tp > 1) else (False,)):
                cand = layout_terms.layout_key(tp, sp, cp)
                if cand == key or cand not in covered:
                    continue
                rank = (tp * cp, sp, cp)
                if rank > (best.tp * best.cp, best.sequence_parallel, best.cp):
                    best = ParallelLayout(tp=tp, cp=cp, sequence_parallel=sp, pp=parallel.pp,
                                          ep=parallel.ep, dp=parallel.dp)
    return best


def has_qk_norm(geometry: ModelGeometry) -> bool:
    """Whether attention layers normalise queries and keys: `extra["qk_layernorm"]` when the
    geometry says (a live Megatron model does), else its features' explicit flag, else the
    Megatron builder's own default (`measure.megatron_build`: on for Qwen models). Multi-latent
    attention normalises its latents instead (priced by `feature_terms.mla_stage_per_row`)."""
    if geometry.attention is not None and geometry.attention.mla is not None:
        return False
    flag = (geometry.extra or {}).get("qk_layernorm")
    if flag is not None:
        return bool(flag)
    return geometry.qk_norm


def layer_widths(geometry: ModelGeometry, *, tp: int, etp: int | None = None) -> dict[str, float]:
    """Per-rank widths the coefficient table multiplies. `tp=1` gives the unsharded widths.

    `etp`: the experts' TP size (Megatron's `expert_tensor_parallel_size`; None: `tp`, its
    default): each rank holds expert_ffn / etp of every local expert's FFN (Megatron-core's
    experts `divide` FC1's output and FC2's input by it), so every per-routed-row expert term
    (the FC1 output and activation, the expert backward, the features' activation copies) is
    that wide. Evidence: the TP4+SP MoE trace's expert tensors (`linear_fc1` [rows, 2F/4],
    activations [rows, F/4]; bench/results/moe_tp_sp_findings.txt). The shared expert is a
    plain TP-sharded MLP (`shared_ffn` / tp). O(1)."""
    att, gdn, moe = geometry.attention, geometry.gdn, geometry.moe
    etp = tp if etp is None else etp
    return {
        "H": geometry.hidden,
        "F": geometry.ffn / tp,
        "qkv": att.qkv_width_per_rank(tp) if att else 0.0,
        "core": att.core_width / tp if att else 0.0,
        "in_proj": gdn.in_proj_width / tp if gdn else 0.0,
        "conv": gdn.conv_width / tp if gdn else 0.0,
        "value": gdn.value_width / tp if gdn else 0.0,
        "expert_ffn": moe.expert_ffn / etp if moe else 0.0,
        "shared_ffn": moe.shared_expert_ffn / tp if moe else 0.0,
        "experts": moe.num_experts if moe else 0.0,
        "top_k": moe.top_k if moe else 0.0,
        "vocab": math.ceil(geometry.vocab / tp),
        "rank": 0.0,
    }


@dataclass(frozen=True, kw_only=True)
class PricingModel:
    """Everything needed to price a wave on one rank, precomputed once per configuration."""

    geometry: ModelGeometry
    parallel: ParallelLayout
    recompute: Recompute
    lora: LoraConfig
    table: CoefficientTable
    head: str = DEFAULT_HEAD
    safety: float = DEFAULT_SAFETY
    # opt-in: the busiest EP rank's routed rows over rows x top_k the caller guarantees (None:
    # the worst case any router can produce, `moe_terms.busiest_rank_load`)
    moe_load: float | None = None
    # internal (planner.ep_peers): the busiest EP rank's routed rows raised this many times, for
    # a wave whose EP peers run forward calls up to this many times this rank's smallest
    peer_row_scale: float = 1.0
    # derived (set in __post_init__)
    basis: str = field(init=False)
    gaps: tuple[str, ...] = field(init=False)
    assumptions: tuple[str, ...] = field(init=False)
    layout_gaps: tuple[str, ...] = field(init=False)
    credit: ParallelLayout = field(init=False)
    slot_names: tuple[str, ...] = field(init=False)
    arrays: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.safety, int | float) and math.isfinite(self.safety) and self.safety >= 1.0):
            raise bad(ConfigError, "safety", self.safety, "must be a finite number >= 1.0")
        self.parallel.validate_for(self.geometry)
        parse_head(self.head)
        moe_terms.check_assumed_load(self.moe_load)
        moe_terms.check_peer_row_scale(self.peer_row_scale)
        lgaps = tuple(layout_gaps(self.geometry, self.parallel, self.recompute, self.table))
        gaps = lgaps + tuple(pipeline_gaps(self.parallel) + expert_tp_gaps(self.geometry, self.parallel)
                             + feature_terms.feature_gaps(self.geometry))
        object.__setattr__(self, "gaps", gaps)
        object.__setattr__(self, "layout_gaps", lgaps)
        object.__setattr__(self, "credit", credit_layout(self.geometry, self.parallel, self.recompute,
                                                         self.table) if lgaps else self.parallel)
        object.__setattr__(self, "assumptions", self._assumptions())
        object.__setattr__(self, "basis", "conservative" if gaps else
                           "assumed" if self.assumptions else "evidence")
        object.__setattr__(self, "slot_names", tuple(s.name for s in self.lora.slots))
        object.__setattr__(self, "arrays", self._build_arrays())

    @classmethod
    def build(cls, geometry: ModelGeometry, *, parallel: ParallelLayout | None = None,
              recompute: Recompute | None = None, lora: LoraConfig | None = None,
              backend: str = DEFAULT_BACKEND, head: str = DEFAULT_HEAD,
              safety: float = DEFAULT_SAFETY, moe_load: float | None = None) -> PricingModel:
        return cls(geometry=geometry, parallel=parallel or ParallelLayout(),
                   recompute=recompute or Recompute(), lora=lora or LoraConfig(),
                   table=load_table(backend), head=head, safety=safety, moe_load=moe_load)

    def _assumptions(self) -> tuple[str, ...]:
        """Opt-in assumptions the price rests on instead of a bound (basis "assumed" when the
        configuration has no gap): an assumed MoE load at EP > 1 (`moe_load`)."""
        moe, ep = self.geometry.moe, self.parallel.ep
        if self.moe_load is None or moe is None or ep == 1:
            return ()
        worst = moe_terms.worst_case_load(moe, ep)
        used = moe_terms.busiest_rank_load(moe, ep, self.moe_load)
        return (f"MoE load {used:g} assumed (opt-in moe_load: the caller's bound on the busiest EP{ep} "
                f"rank's routed rows over rows x top_k; without it the worst case {worst:g} is priced)",)

    @property
    def reasons(self) -> tuple[str, ...]:
        """Why the basis is not "evidence": the gaps, then the opt-in assumptions."""
        return self.gaps + self.assumptions

    @property
    def conservative(self) -> bool:
        """Whether the layout or recompute lies outside the evidence: then widths get no TP
        credit and rows no CP credit. Feature gaps alone make the basis "conservative" but
        keep these credits (their terms are explicit bounds)."""
        return bool(self.layout_gaps)

    @property
    def width_tp(self) -> int:
        """TP divisor of widths: the credited layout's TP (`credit_layout`; this layout's own
        when it is covered)."""
        return self.credit.tp

    @property
    def width_etp(self) -> int:
        """Expert-TP divisor of the experts' widths: the layout's expert TP (`ParallelLayout.expert_tp`),
        never above the credited layout's TP (no TP credit, no expert-TP credit either)."""
        return min(self.parallel.expert_tp, self.credit.tp)

    @property
    def expert_row_share(self) -> float:
        """The share of a wave's gathered routed rows one expert-TP group runs: ETP / TP under
        the credited layout with sequence parallelism (each rank routes its 1/TP sequence shard
        and the dispatcher gathers them over the expert TP only), 1 otherwise (no credit, or
        an expert TP `expert_tp_gaps` names: the gathered rows, a bound). Evidence: the TP4+SP
        traces at ETP 4, 2 and 1 (docs/memory-model.md#moe-tp-point)."""
        p, c = self.parallel, self.credit
        if not c.sequence_parallel or expert_tp_gaps(self.geometry, p):
            return 1.0
        return self.width_etp / c.tp

    @property
    def sp_div(self) -> int:
        """Sequence-parallel divisor of hidden-wide terms under the credited layout."""
        return self.credit.tp if self.credit.sequence_parallel else 1

    @property
    def rows_cp(self) -> int:
        """CP divisor of a wave's rows on the busiest rank under the credited layout."""
        return self.credit.cp

    @property
    def num_stage_layers(self) -> int:
        """Layers of the largest pipeline stage (`pipeline.stage_bounds`)."""
        return max(hi - lo for lo, hi in stage_bounds(self.geometry.num_layers, self.parallel.pp))

    def _build_arrays(self) -> dict:
        """The arrays the jitted walk reads (`self.arrays`): the decoder layers' per-layer arrays
        (`layer_arrays`: retained, workspace, no-grad, GDN state and chunk padding, with the
        layout residual and the CP RoPE cache), each LoRA slot's pending gradients per layer, the
        head's and the final norm's charges (`head_*`, with their parts for calibration), the
        input gradient, the caller's and first execution's bytes; under PP > 1 also each stage's
        charges (`stage_charges`) and their folded per-wave proxy (`fold_stages`).
        O(layers x slots)."""
        g, p, t = self.geometry, self.parallel, self.table
        widths = layer_widths(g, tp=self.width_tp, etp=self.width_etp)
        sp_div = self.sp_div
        # the decoder layers' arrays (`layer_arrays`): each layer's stage, retained and forward
        # charges, the layout residual, the CP RoPE cache and the GDN chunk padding
        ctx = layer_context(self, widths, qk_norm=has_qk_norm(g))
        decoder = layer_arrays(ctx)
        n = g.num_layers   # every layer; PP > 1 restricts them to stages below
        full = ctx.full   # full recompute
        # the layout residual and the CP RoPE cache beside the head's backward (full recompute)
        beside_head = decoder.residual + decoder.rope if full else 0.0
        pending = np.zeros((len(self.lora.slots), n))
        for s, slot in enumerate(self.lora.slots):
            counts = adapter_param_counts(g, self.lora, slot.name, self.width_tp)[:n]
            pending[s] = counts * self.lora.grad_bytes
        kind, chunk = parse_head(self.head)
        logits_ret, logits_tr = terms.head_per_row(t, widths, self.head if kind != "chunked" else "chunked")
        head_const = terms.head_chunk_bytes(t, widths, chunk) if kind == "chunked" else 0.0
        if feature_terms.scales_logits(g.features):
            if kind == "chunked":
                head_const += chunk * feature_terms.final_softcap_chunk_per_row(widths)
            else:
                cap_ret, cap_tr = feature_terms.final_softcap_per_row(widths)
                logits_ret, logits_tr = logits_ret + cap_ret, logits_tr + cap_tr
        # the final norm's saved input lives beside the head's; its backward runs after the
        # head's backward has released the logits, so the transient is the larger of the two
        norm_saved, norm_bwd = terms.final_norm_per_row(t, widths, sp_div=sp_div)
        if norm_bwd and ctx.structural_gdn:
            # what the norm's backward allocates, beside the structural layer terms (gdn_terms)
            norm_bwd = max(norm_bwd, gdn_terms.final_norm_backward_per_row(widths, sp_div=sp_div))
        head_ret = logits_ret + norm_saved
        # the norm's backward runs after the logits are released: priced so when TP shards the
        # vocabulary, for TE's head at any TP (its terms are structural, not calibrate-fitted), and
        # beside the structural GDN layer terms at TP1 too (gdn_terms: the TP1 fit's logits at the
        # norm covered what its fitted layers fall short of; these layers are charged what they hold)
        released = self.width_tp > 1 or kind == "full-te" or ctx.structural_gdn
        head_tr = (layout_terms.head_point_transient(logits_ret, logits_tr, norm_bwd, released=released)
                   + beside_head)
        # what the full-native head holds at its forward under TP with SP (both logits copies, the
        # final norm's tensors, the embedding's output), charged where above head_ret; beside the
        # wave's RoPE cache charge (in the retained layers without full recompute, here with it)
        head_fwd = (layout_terms.sp_head_forward_per_row(t, widths, tp=sp_div, sequence_parallel=sp_div > 1,
                                                         at_tp1=ctx.structural_tp1)
                    if kind == "full-native" else 0.0)
        if head_fwd and full:
            head_fwd += decoder.rope
        arrays = {
            "retained": decoder.retained, "workspace": decoder.workspace, "nograd": decoder.nograd,
            "gdn_state": decoder.gdn_state, "pending": pending, "pad_retained": decoder.pad_retained,
            "pad_point": decoder.pad_point, "chunk": float(decoder.gdn_chunk),
            "input_grad": terms.input_gradient_per_row(t, widths, sp_div=sp_div),
            "head_retained": head_ret, "head_transient": head_tr, "head_const": head_const,
            "head_forward": head_fwd,
            "head_chunk_rows": chunk,
            # the head's parts before they are combined (calibration reads them)
            "head_parts": {"logits_retained": logits_ret, "logits_transient": logits_tr,
                           "norm_saved": norm_saved, "norm_backward": norm_bwd,
                           "layout_residual": beside_head,
                           "logits_at_norm": 0.0 if released else logits_ret},
            "forward_parts": {"nograd": decoder.nograd_plain,
                              "retained_forward": decoder.retained_forward},
            "caller": terms.caller_per_logical_token(t),
            "first_exec": terms.first_execution_bytes(t),
            "has_mlp_moe": any(layer.mlp == MlpKind.MOE for layer in g.layers),
            # the CP RoPE cache bound above (per rank row, where the arrays carry it) and one
            # entry row: the walk credits what a call's longest sequence does not hold
            # (`walk.rope_credit`) and charges the other calls' entries at a call's points;
            # none under PP > 1, whose stage walks keep the bound and charge the entries apart
            "rope_cp": layout_terms.cp_rope_cache_per_row(decoder.rope_entry, cp=self.rows_cp)
            if p.pp == 1 else 0.0,
            "rope_entry": decoder.rope_entry if p.pp == 1 else 0.0,
            "rope_kept": not full,
        }
        if p.pp > 1:
            # the per-layer arrays, each stage's charges, and the folded per-wave proxy
            arrays["layers"] = {name: arrays[name] for name in
                                ("retained", "workspace", "nograd", "gdn_state", "pending",
                                 "pad_retained", "pad_point")}
            boundary = terms.boundary_per_row(t, widths, sp_div=sp_div)
            stage_rope = [rope_cache_per_row(g, g.layers[lo:hi]) for lo, hi in stage_bounds(n, p.pp)]
            stages = stage_charges(arrays, pp=p.pp, boundary_per_row=boundary,
                                   received_per_row=received_activation_per_row(
                                       boundary, full_recompute=full),
                                   rope_per_row=stage_rope, rows_cp=self.rows_cp)
            arrays["stages"] = stages
            arrays.update(fold_stages(stages))
        return arrays

    def slot_index(self, name: str) -> int:
        try:
            return self.slot_names.index(name)
        except ValueError:
            raise bad(ConfigError, "slot", name, f"no such LoRA slot; known: {list(self.slot_names)}") from None

    def to_dict(self) -> dict:
        """Everything needed to rebuild this model (for reports)."""
        doc = {"geometry": self.geometry.to_dict(), "parallel": self.parallel.to_dict(),
               "recompute": self.recompute.to_dict(), "lora": self.lora.to_dict(),
               "coefficients": self.table.to_dict(), "head": self.head, "safety": self.safety}
        if self.moe_load is not None:
            doc["moe_load"] = self.moe_load
        if self.peer_row_scale != 1.0:
            doc["peer_row_scale"] = self.peer_row_scale
        return doc

