"""The memory model of one rank: geometry, layout, recompute, LoRA and coefficients, reduced to
the charges the jitted schedule walk reads (`charges.Charges`), once per configuration.

The configuration's coverage (`coverage.assess`) sets the credited layout and the basis: an
unmeasured configuration is priced as a conservative bound with its reasons, no term dropped
(docs/memory-model.md#basis). PP > 1: every stage under 1F1B (docs/memory-model.md#pipeline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import feature_terms, gdn_terms, layout_terms, moe_terms, terms
from .charges import Charges, ForwardParts, HeadParts
from .coefficients import DEFAULT_BACKEND, CoefficientTable, load_table, table_from_dict
from .coverage import Coverage, assess, dtype_scale
from .errors import ConfigError, bad
from .geometry import MlpKind, ModelGeometry
from .kernel_set import Framework
from .layer_arrays import layer_arrays
from .layers.context import LayerContext, layer_context
from .lora import LoraConfig, adapter_param_counts
from .parallel import ParallelLayout, Recompute
from .pipeline import (
    fold_stages,
    received_activation_per_row,
    rope_cache_instances,
    rope_cache_per_row,
    stage_bounds,
    stage_charges,
)
from .walk import WalkCharges

DEFAULT_SAFETY = 1.10
DEFAULT_HEAD = "chunked:512"   # the output head computes logits in chunks of 512 rows


_UNSCALED = frozenset({"chunk", "rope_kept", "rope_cp", "rope_entry"})
"""WalkCharges fields that are not bf16 tensors' bytes: the GDN chunk, a flag, the fp32 RoPE
cache (the same bytes at any model dtype)."""


def _scaled_walk(walk: WalkCharges, factor: float) -> WalkCharges:
    """`walk` with every byte charge but `_UNSCALED` times `factor` (itself at 1). O(layers)."""
    if factor == 1.0:
        return walk
    return walk._replace(**{k: v * factor for k, v in walk._asdict().items() if k not in _UNSCALED})


def parse_head(head: str) -> tuple[str, int]:
    """'chunked:512' -> ('chunked', 512); 'full-native' -> ('full-native', 0)."""
    if head in ("full-native", "full-te"):
        return head, 0
    if head.startswith("chunked:"):
        rows = head.split(":", 1)[1]
        if rows.isdigit() and int(rows) > 0:
            return "chunked", int(rows)
    raise bad(ConfigError, "head", head, "must be chunked:N (N > 0), full-native or full-te")


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
    """Per-rank widths the coefficient table multiplies; `tp=1` gives the unsharded widths.

    F, qkv, core, the GDN widths and vocab / TP; the experts' FFN / `etp` (Megatron's
    `expert_tensor_parallel_size`, None: `tp`), the shared expert's FFN / TP
    (docs/memory-model.md#moe-tp-point). O(1)."""
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
    coverage: Coverage = field(init=False, repr=False, compare=False)
    gaps: tuple[str, ...] = field(init=False)
    assumptions: tuple[str, ...] = field(init=False)
    layout_gaps: tuple[str, ...] = field(init=False)
    credit: ParallelLayout = field(init=False)
    slot_names: tuple[str, ...] = field(init=False)
    charges: Charges = field(init=False, repr=False, compare=False)
    memo: dict = field(init=False, repr=False, compare=False)
    """The pricers' derived objects shared across steps (envelopes, the fast walk's arrays,
    clique points), keyed by what they depend on; never charges."""

    def __post_init__(self) -> None:
        if not (isinstance(self.safety, int | float) and math.isfinite(self.safety) and self.safety >= 1.0):
            raise bad(ConfigError, "safety", self.safety, "must be a finite number >= 1.0")
        self.parallel.validate_for(self.geometry)
        parse_head(self.head)
        moe_terms.check_assumed_load(self.moe_load)
        moe_terms.check_peer_row_scale(self.peer_row_scale)
        coverage = assess(self.geometry, self.parallel, self.recompute, self.table)
        object.__setattr__(self, "coverage", coverage)
        object.__setattr__(self, "gaps", coverage.reasons)
        object.__setattr__(self, "layout_gaps", tuple(g.detail for g in coverage.layout_gaps))
        object.__setattr__(self, "credit", coverage.credit)
        object.__setattr__(self, "assumptions", self._assumptions())
        object.__setattr__(self, "basis", "conservative" if coverage.gaps else
                           "assumed" if self.assumptions else "evidence")
        object.__setattr__(self, "slot_names", tuple(s.name for s in self.lora.slots))
        object.__setattr__(self, "charges", self._build_charges())
        object.__setattr__(self, "memo", {})

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
    def framework(self) -> Framework:
        """The training framework this model prices (Megatron-core here; `FsdpPricingModel`:
        FSDP), the one place callers learn it. docs/architecture.md."""
        return Framework.MEGATRON

    @property
    def kernel_basis(self) -> tuple[str, ...]:
        """Which figures rest on the fused kernels' allocation models rather than GPU traces
        (`KernelSet.kernel_models`; empty for plain PyTorch kernels): one 'kernel-model: ...'
        line each (docs/memory-model.md#gpu-kernel-allocation-models). O(layers)."""
        kernels = self.table.kernels
        if not kernels.fused:
            return ()
        ctx = self.layer_context()
        names = ", ".join(kernels.kernel_models)
        lines = ["kernel-model: the final norm's saved input and backward (te-rmsnorm)"]
        if ctx.fused_point:
            lines.append(f"kernel-model: the recomputed layers' peak, FC1's or FC2's recomputed forward "
                         f"({names}; tp1_fc1_point)")
        if ctx.fused_retained:
            lines.append(f"kernel-model: the retained layers' tensors, backward and own forward peaks "
                         f"({names}; fused_retained_layer)")
        if ctx.fused_moe_retained:
            lines.append(f"kernel-model: the retained MoE layers' tensors and own forward peaks "
                         f"({names}; fused_retained_layer moe_ keys)")
        if ctx.fused_mla and any(layer.mlp == MlpKind.DENSE for layer in self.geometry.layers):
            lines.append(f"kernel-model: the multi-latent-attention layers with a dense MLP, "
                         f"retained or recomputed ({names}; fused_mla_layer; flash-attn's model, "
                         f"where TE runs cuDNN's fused attention for MLA)")
        if ctx.fused_mla and ctx.fused_moe_retained:
            lines.append(f"kernel-model: the retained multi-latent-attention layers with a MoE MLP, MLA's "
                         f"and the retained MoE layer's terms composed ({names}; fused_mla_layer, "
                         f"fused_retained_layer moe_ keys)")
        if ctx.fused_gdn_retained:
            lines.append(f"kernel-model: the retained GDN and gated attention layers' tensors, backward "
                         f"and own forward peaks (FLA's gated delta rule and L2 norm, {names}; fused_gdn_layer)")
        if ctx.fused_gdn_point:
            lines.append(f"kernel-model: the recomputed GDN and gated attention layers' points, FC1's "
                         f"recomputed forward or FLA's backward (FLA's gated delta rule and L2 norm, "
                         f"{names}; fused_gdn_point)")
        if parse_head(self.head)[0] == "full-native" and self.charges.walk.head_forward:
            lines.append("kernel-model: the head's forward beside the final norm's bf16 tensors "
                         "(te-rmsnorm; sp_head_forward)")
        return tuple(lines)

    @property
    def reasons(self) -> tuple[str, ...]:
        """Why the basis is not "evidence": the gaps, then the opt-in assumptions."""
        return self.gaps + self.assumptions

    @property
    def conservative(self) -> bool:
        """Whether widths and rows lose (part of) their credit (`Coverage.conservative`)."""
        return self.coverage.conservative

    @property
    def width_tp(self) -> int:
        """TP divisor of widths (`Coverage.width_tp`)."""
        return self.coverage.width_tp

    @property
    def width_etp(self) -> int:
        """Expert-TP divisor of the experts' widths (`Coverage.width_etp`)."""
        return self.coverage.width_etp

    @property
    def expert_row_share(self) -> float:
        """The share of the gathered routed rows one expert-TP group runs
        (`Coverage.expert_row_share`)."""
        return self.coverage.expert_row_share

    @property
    def sp_div(self) -> int:
        """Sequence-parallel divisor of hidden-wide terms (`Coverage.sp_div`)."""
        return self.coverage.sp_div

    @property
    def rows_cp(self) -> int:
        """CP divisor of a wave's rows on the busiest rank (`Coverage.rows_cp`)."""
        return self.coverage.rows_cp

    @property
    def num_stage_layers(self) -> int:
        """Layers of the largest pipeline stage (`pipeline.stage_bounds`)."""
        return max(hi - lo for lo, hi in stage_bounds(self.geometry.num_layers, self.parallel.pp))

    def layer_context(self, widths: dict | None = None) -> LayerContext:
        """What this model's decoder layers are priced with (`layer_arrays.layer_context`),
        at its credited widths unless `widths` is given. O(layers)."""
        g = self.geometry
        if widths is None:
            widths = layer_widths(g, tp=self.width_tp, etp=self.width_etp)
        return layer_context(self.coverage, geometry=g, table=self.table, recompute=self.recompute,
                             widths=widths, qk_norm=has_qk_norm(g),
                             max_rank=max((s.rank for s in self.lora.slots), default=0),
                             moe_load=self.moe_load, peer_row_scale=self.peer_row_scale)

    def _build_charges(self) -> Charges:
        """The model's charges (`Charges`), built once: the decoder layers' per-layer arrays
        (`layer_arrays`: retained, workspace, no-grad, GDN state and chunk padding, with the
        layout residual and the CP RoPE cache), each LoRA slot's pending gradients per layer, the
        head's and the final norm's charges (with their parts for calibration), the input
        gradient, the caller's and first execution's bytes; under PP > 1 also each stage's
        charges (`stage_charges`) and their folded per-wave proxy (`fold_stages`).
        O(layers x slots)."""
        g, p, t = self.geometry, self.parallel, self.table
        widths = layer_widths(g, tp=self.width_tp, etp=self.width_etp)
        sp_div = self.sp_div
        # the decoder layers' arrays (`layer_arrays`): each layer's stage, retained and forward
        # charges, the layout residual, the CP RoPE cache and the GDN chunk padding
        ctx = self.layer_context(widths)
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
        # the head and caller priced by what the kernels hold, or with the seeds' margins beside
        # fitted GDN (head and caller) and MoE (caller) layers on te-gpu (KernelSet); MoE layers
        # retained by the kernel models (`LayerContext.fused_moe_retained`) keep no fitted term
        # (GDN layers retained or recomputed on FLA's and the fused kernels' models,
        # `LayerContext.gdn_on_kernels`, too)
        fitted_gdn = g.gdn is not None and not ctx.gdn_on_kernels
        margins = not t.kernels.priced_by_models(has_gdn=fitted_gdn)
        fitted_moe = g.moe is not None and not ctx.fused_moe_retained
        every_head = not t.kernels.caller_by_heads(fitted_layers=fitted_gdn or fitted_moe)
        logits_ret, logits_tr = terms.head_per_row(t, widths, self.head if kind != "chunked" else "chunked",
                                                   margins=margins)
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
        if norm_bwd and ctx.gdn_retained_structural:
            # what the norm's backward allocates, beside the structural layer terms (gdn_terms)
            norm_bwd = max(norm_bwd, gdn_terms.final_norm_backward_per_row(widths, sp_div=sp_div))
        head_ret = logits_ret + norm_saved
        # the norm's backward runs after the logits are released: priced so when TP shards the
        # vocabulary, for TE's head at any TP (its terms are structural, not calibrate-fitted), and
        # beside the structural GDN layer terms at TP1 too (gdn_terms: the TP1 fit's logits at the
        # norm covered what its fitted layers fall short of; these layers are charged what they hold)
        released = self.width_tp > 1 or kind == "full-te" or ctx.gdn_retained_structural
        head_tr = (layout_terms.head_point_transient(logits_ret, logits_tr, norm_bwd, released=released)
                   + beside_head)
        # what the full-native head holds at its forward under TP with SP (both logits copies, the
        # final norm's tensors, the embedding's output), charged where above head_ret; beside the
        # wave's RoPE cache charge (in the retained layers without full recompute, here with it)
        # (with the fused kernels' layer terms at any TP: `tp` is the SP divisor, so without SP the
        # hidden-wide part is whole and the vocabulary the rank's share)
        head_fwd = (layout_terms.sp_head_forward_per_row(
            t, widths, tp=sp_div, sequence_parallel=sp_div > 1,
            at_tp1=ctx.tp1_structural or ctx.on_kernel_models)
                    if kind == "full-native" else 0.0)
        if head_fwd and full:
            head_fwd += decoder.rope
        walk = WalkCharges(
            retained=decoder.retained, workspace=decoder.workspace, nograd=decoder.nograd,
            gdn_state=decoder.gdn_state, pending=pending,
            input_grad=terms.input_gradient_per_row(t, widths, sp_div=sp_div),
            head_retained=head_ret, head_transient=head_tr, head_const=head_const,
            caller=terms.caller_per_logical_token(t, kind, every_head=every_head), pad_retained=decoder.pad_retained,
            pad_point=decoder.pad_point, chunk=float(decoder.gdn_chunk),
            # the CP RoPE cache bound above (per rank row, where the arrays carry it) and one
            # entry row: the walk credits what a call's longest sequence does not hold
            # (`walk.rope_credit`) and charges the other calls' entries at a call's points;
            # none under PP > 1, whose stage walks keep the bound and charge the entries apart
            rope_cp=layout_terms.cp_rope_cache_per_row(decoder.rope_entry, cp=self.rows_cp)
            if p.pp == 1 else 0.0,
            rope_entry=decoder.rope_entry if p.pp == 1 else 0.0,
            rope_kept=not full, head_forward=head_fwd)
        # an fp32 model: every charge of the bf16 traces scaled (`coverage.dtype_scale`)
        f = dtype_scale(g)
        walk = _scaled_walk(walk, f)
        parts = dict(
            head=HeadParts(logits_retained=f * logits_ret, logits_transient=f * logits_tr,
                           norm_saved=f * norm_saved, norm_backward=f * norm_bwd,
                           layout_residual=f * beside_head,
                           logits_at_norm=0.0 if released else f * logits_ret),
            forward=ForwardParts(nograd=f * decoder.nograd_plain,
                                 retained_forward=f * decoder.retained_forward),
            first_exec=f * terms.first_execution_bytes(t))
        if p.pp == 1:
            return Charges(walk=walk, **parts)
        # each stage's charges from every layer's, and their folded per-wave proxy
        boundary = f * terms.boundary_per_row(t, widths, sp_div=sp_div)
        stage_rope = [rope_cache_per_row(g, g.layers[lo:hi]) * rope_cache_instances(g, g.layers[lo:hi])
                      for lo, hi in stage_bounds(n, p.pp)]
        stages = stage_charges(walk, pp=p.pp, boundary_per_row=boundary,
                               received_per_row=received_activation_per_row(
                                   boundary, full_recompute=full),
                               rope_per_row=stage_rope, rows_cp=self.rows_cp)
        return Charges(walk=walk._replace(**fold_stages(stages)), layers=walk, stages=stages,
                       **parts)

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

    @classmethod
    def from_dict(cls, data: dict) -> PricingModel:
        """Inverse of `to_dict` (no preset or coefficient file needed; reports, misses files)."""
        return cls(**common_fields(data), moe_load=data.get("moe_load"))


def common_fields(data: object) -> dict:
    """The fields every framework's model dict carries (`PricingModel.to_dict`), rebuilt."""
    if not isinstance(data, dict):
        raise bad(ConfigError, "model", type(data).__name__, "must be an object")
    recompute = dict(data["recompute"])
    recompute["modules"] = tuple(recompute.get("modules", ()))
    return dict(geometry=ModelGeometry.from_dict(data["geometry"]),
                parallel=ParallelLayout(**data["parallel"]),
                recompute=Recompute(**recompute), lora=LoraConfig.from_dict(data["lora"]),
                table=table_from_dict(data["coefficients"]), head=data["head"],
                safety=data["safety"])

