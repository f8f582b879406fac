"""Fit a backend's coefficient table to traced wave peaks (`waveplan calibrate`): one factor per
group of terms, minimising the mean estimate/measured with every estimate >= (1 + `MARGIN`) x
its trace (a linear programme over the walk's points, `cell_points`).
See docs/measurement.md#calibrate.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from .. import entries, layout_terms
from ..atomic_io import write_text_atomic
from ..coefficients import (
    DEFAULT_BACKEND,
    CoefficientTable,
    covering_after_rounding,
    load_table,
    table_from_dict,
)
from ..errors import ConfigError, bad
from ..tolerances import (
    BINDING_RATIO_EPS,
    DOMINANCE_EPS,
    FIT_RATIO_EPS,
    MOVE_GAIN_EPS,
    SETTLE_GAIN_EPS,
)
from .simplex import simplex

_RET_ATT, _RET_GDN = "retained_attention_layer:per_row", "retained_gdn_layer:per_row"
# group -> the base terms it scales ("term", "term:key" for one key of the entry, or
# "term:key:width" for one coefficient)
GROUPS: dict[str, tuple[str, ...]] = {
    "boundary": ("boundary",),
    "input_gradient": ("input_gradient",),
    "norms": ("residual_norm_shards", "norm_gathered"),
    "dense_stage": ("mlp_dense_grad_stage", "mlp_dense_nograd"),
    "attention_stage": ("attention_stage",),
    "gdn_stage": ("gdn_stage",),
    "gdn_state": ("gdn_state_bytes:value",),
    "moe_stage": ("moe_routed", "moe_router", "moe_shared_expert"),
    "retained": tuple(f"{_RET_ATT}:{w}" for w in ("H", "qkv", "core", "rank")),
    "retained_gdn": tuple(f"{_RET_GDN}:{w}" for w in ("H", "in_proj", "conv", "value", "rank")),
    "retained_ffn": (f"{_RET_ATT}:F", f"{_RET_GDN}:F"),
    "selective_discount": ("selective_core_attn_discount",),
    "retained_moe": ("retained_moe_mlp",),
    # head_full_te is structural and checked on its own traces (bench/full_te_check.py,
    # docs/memory-model.md#head-full-te): the full-native fit does not scale it
    "head": ("head_full_native:retained_per_row_vocab", "head_chunk"),
    "head_transient": ("head_full_native:transient_per_row_vocab",),
}
# group -> (term, its structural unit entry, evidence): terms a base table may lack. The
# fitted entry is factor x unit. Units are the cpu-fake anatomy's decomposition
# (bench/results/validation_anatomy.txt).
UNITS: dict[str, tuple[str, dict, str]] = {
    "qk_norm": ("qk_norm", {"per_row": {"qkv": 2, "core": 2}},
                "query/key norms keep their inputs in fp32: 4 bytes x (query + key widths)"),
    "final_norm": ("final_norm", {"per_row": {"H": 4}},
                   "the final norm's input kept in fp32 for its backward (4H per row)"),
    "final_norm_backward": ("final_norm_backward", {"per_row": {"H": 20}},
                            "the final norm's fp32 backward intermediates (20H per row)"),
    "moe_nograd": ("moe_nograd", {"per_routed_row": {"H": 6}, "per_row": {"experts": 8}},
                   "a MoE layer's forward transient: the permuted rows, the experts' outputs "
                   "and their concatenation (3 x 2H per routed row) and the router's fp32 "
                   "probabilities"),
    "retained_forward": ("retained_forward", {"value": 1.0, "per_routed_row": {"H": 6},
                                              "per_row": {"experts": 8}},
                         "a retained layer's forward peak: its own retained activations "
                         "(value = the fraction live) plus, for MoE, the permuted rows, the "
                         "experts' outputs and their concatenation (3 x 2H per routed row) and "
                         "the router's fp32 probabilities"),
    "retained_backward": ("retained_backward",
                          {"per_row": {"F": 4, "rank": 40}, "per_routed_row": {"H": 2}},
                          "a retained layer's backward transient: the MLP's gradients (4F "
                          "dense, 2H per routed row MoE) plus rank-wide LoRA gradients"),
}
ALL_GROUPS = tuple(GROUPS) + tuple(UNITS)
FACTOR_BOUNDS = (0.0, 8.0)
# the L1 pull towards factor 1, per unit of factor, against the mean estimate/measured ratio:
# a factor leaves 1 only where each unit of change lowers the mean over-estimate by > 0.1 %
TIE_BREAK = 0.001
# every fit cell's estimate is at least (1 + MARGIN) x its trace (see the module doc)
MARGIN = 0.005
ZEROED = {"first_execution": "value", "caller_per_logical_token": "value"}
_NUMERIC_KEYS = ("per_row", "per_routed_row")
_SCALARS = ("value", "per_row_vocab", "retained_per_row_vocab", "transient_per_row_vocab")
HEAD = "full-native"
LOGITS_GROUPS = ("head", "head_transient")


def load_base(backend: str = DEFAULT_BACKEND) -> CoefficientTable:
    return load_table(backend)


def record_from_trace(obj: dict) -> dict:
    """A calibration record from one `waveplan trace --json` object (a `TraceResult.to_dict()`
    with the traced `model` name and, from `waveplan trace`, its `geometry` inline): the cell
    is what the trace ran (model, traced layers, recompute mode, LoRA rank, sequence lengths),
    the trace is the object itself."""
    recompute = obj.get("recompute")
    cell = {"model": obj.get("model"), "num_layers": obj.get("num_layers"),
            "recompute": recompute.get("mode") if isinstance(recompute, dict) else recompute,
            "lora_rank": obj.get("lora_rank") or 0, "seq_lens": obj.get("seq_lens")}
    if "geometry" in obj:
        cell["geometry"] = obj["geometry"]
    if isinstance(obj.get("layout"), dict):
        cell["layout"] = obj["layout"]
    return {"cell": {k: v for k, v in cell.items() if v is not None}, "trace": obj}


def read_traces(path: str | Path) -> list[dict]:
    """Trace records of a JSON Lines file; ConfigError on anything unreadable. A line is a
    record `{cell, trace}` (bench/validation_study.py) or a `waveplan trace --json` object
    (`record_from_trace`)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise bad(ConfigError, "traces", str(path), f"cannot read: {exc.strerror}") from None
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise bad(ConfigError, "traces", f"{path}:{n}", "not a JSON object") from None
        if isinstance(rec, dict) and "cell" not in rec and "peak_bytes" in rec:
            rec = record_from_trace(rec)
        _check_record(rec, f"{path}:{n}")
        records.append(rec)
    if not records:
        raise bad(ConfigError, "traces", str(path), "holds no trace records")
    return records


def _check_record(rec: object, where: str) -> None:
    if not isinstance(rec, dict) or not isinstance(rec.get("cell"), dict) or not isinstance(rec.get("trace"), dict):
        raise bad(ConfigError, "traces", where, "each line needs 'cell' and 'trace' objects")
    cell, trace = rec["cell"], rec["trace"]
    for key in ("model", "num_layers", "recompute", "lora_rank", "seq_lens"):
        if key not in cell:
            raise bad(ConfigError, "traces", where, f"cell lacks '{key}'")
    if "geometry" in cell:
        if not isinstance(cell["geometry"], dict):
            raise bad(ConfigError, "traces", where, "cell.geometry must be a model geometry object")
        from ..geometry import ModelGeometry

        try:
            ModelGeometry.from_dict(cell["geometry"])
        except (ConfigError, KeyError, TypeError, ValueError) as exc:
            raise bad(ConfigError, "traces", where, f"cell.geometry is not a model geometry: {exc}") from None
    if "layout" in cell:
        cell_layout(cell, where)
    for key in ("peak_bytes", "decoder_peak_bytes"):
        value = trace.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise bad(ConfigError, "traces", where, f"trace.{key} must be a positive integer")
    if trace.get("head", HEAD) != HEAD:
        raise bad(ConfigError, "traces", where, f"only '{HEAD}' traces can be fitted")


# --- pricing one cell -----------------------------------------------------------------------

_GEOMETRY_CACHE: dict = {}


def cell_geometry(cell: dict):
    """The traced geometry of a cell, cut to its traced layer count: the inline `geometry`
    (a `ModelGeometry.to_dict()` object, for shapes no preset has, e.g. small models) when
    the cell carries one, else the preset or model file that `model` names."""
    inline = cell.get("geometry")
    num_layers = int(cell["num_layers"])
    key = (json.dumps(inline, sort_keys=True) if inline is not None else cell["model"], num_layers)
    if key not in _GEOMETRY_CACHE:
        if inline is not None:
            from ..geometry import ModelGeometry

            g = ModelGeometry.from_dict(inline)
        else:
            from ..model_source import load_model

            g = load_model(cell["model"])
        _GEOMETRY_CACHE[key] = dataclasses.replace(g, layers=g.layers[:num_layers])
    return _GEOMETRY_CACHE[key]


def cell_layout(cell: dict, where: str = "cell"):
    """The parallel layout a record was traced at: `cell.layout` (a `ParallelLayout.to_dict()`
    object, what the multi-rank tracer writes; TP1 when absent). Each cell is priced at its own
    layout, its busiest rank against the trace's busiest rank. ConfigError naming the field
    when it is not a layout or has pipeline stages (a trace covers one stage's ranks only)."""
    from ..parallel import ParallelLayout

    raw = cell.get("layout")
    if raw is None:
        return ParallelLayout()
    try:
        if not isinstance(raw, dict):
            raise TypeError("not an object")
        layout = ParallelLayout(**raw)
    except (ConfigError, TypeError, ValueError) as exc:
        raise bad(ConfigError, "cell.layout", raw, f"{where}: not a parallel layout ({exc})") from None
    if layout.pp != 1:
        raise bad(ConfigError, "cell.layout.pp", layout.pp, f"{where}: calibrate fits one pipeline stage (pp 1)")
    return layout


def _wave(record: dict) -> tuple[int, int]:
    """(rows, GDN segments) of a traced wave, as the trace ran it: sequences concatenated into
    one causal row (GDN hybrids) are one segment; packed (THD) sequences one each."""
    cell, trace = record["cell"], record.get("trace", {})
    lens = [int(n) for n in trace.get("seq_lens") or cell["seq_lens"]]
    segments = 1 if trace.get("packed") == "concatenated" else len(lens)
    return sum(lens), segments


def _model(table: CoefficientTable, cell: dict):
    from ..lora import LoraConfig, LoraSlot
    from ..model import PricingModel
    from ..parallel import Recompute

    geometry = cell_geometry(cell)
    if cell.get("layout") is None:   # a single-rank trace: its MoE makes no sort copy
        table = traced_dispatcher_table(table)
    if geometry.features.final_softcap and not table.scalar("head_full_native", "retained_per_row_vocab"):
        # a table without logits terms prices the decoder-only pass: no logits to soft-cap
        geometry = dataclasses.replace(
            geometry, features=dataclasses.replace(geometry.features, final_softcap=0.0))
    # the traced adapters are bf16 parameters with plain autograd gradients: 2 bytes each
    return PricingModel(geometry=geometry, parallel=cell_layout(cell),
                        recompute=Recompute(mode=cell["recompute"]),
                        lora=LoraConfig(slots=(LoraSlot(rank=int(cell["lora_rank"]) or 1),),
                                        grad_bytes=2),
                        table=table, head=HEAD, safety=1.0)


_STAND_IN_CACHE: dict = {}


def traced_dispatcher_table(table: CoefficientTable) -> CoefficientTable:
    """`table` as the single-rank tracer's MoE runs (a record without `cell.layout`): without
    `moe_permutation` (the stand-in dispatcher, `measure.trace._BalancedDispatcher`, copies
    each token once per choice but makes no sort-by-local-expert copy, which Megatron's
    all-to-all dispatcher, traced by the multi-rank tracer, and the pricing add:
    `moe_terms.permutation_per_routed_row`). The table itself when it has no such entry
    (te-gpu). O(terms), cached per table."""
    from ..moe_terms import PERMUTATION

    if not table.kernels.permutation:
        return table
    key = id(table)
    hit = _STAND_IN_CACHE.get(key)
    if hit is None or hit[0] is not table:
        terms = {n: e for n, e in table.terms.items() if n != PERMUTATION}
        hit = (table, CoefficientTable(backend=table.backend, terms=terms, path=table.path))
        if len(_STAND_IN_CACHE) > 64:
            _STAND_IN_CACHE.clear()
        _STAND_IN_CACHE[key] = hit
    return hit[1]


def _price(table: CoefficientTable, record: dict) -> int:
    from ..price import GroupLoad, price_groups

    rows, segments = _wave(record)
    group = GroupLoad(packed_rows=rows, padded_rows=rows, logical_rows=rows, segments=segments)
    model = _model(table, record["cell"])
    return price_groups(model, [group], first_slots=frozenset({"default"}), profiled=True).raw_bytes


def decoder_table(table: CoefficientTable) -> CoefficientTable:
    """The same table with the head's logits terms zeroed (prices the decoder-only peak: the
    decoder's own final norm stays), the logits of the structural head-forward term too
    (`layout_terms.sp_head_forward_per_row`: its hidden-wide part stays)."""
    out = _scaled(table, {g: 0.0 for g in LOGITS_GROUPS}, note=None)
    forward = entries.entry(out, layout_terms.SP_HEAD)
    if forward is not None:
        forward = dict(forward, per_row={w: 0.0 if w == "vocab" else c for w, c in forward["per_row"].items()})
        out = dataclasses.replace(out, terms=dict(out.terms, **{layout_terms.SP_HEAD: forward}))
    return out


def estimate(table: CoefficientTable, record: dict) -> dict:
    """Raw estimates of one trace record: whole peak and decoder-only peak, in bytes."""
    return {"peak": _price(table, record), "decoder": _price(decoder_table(table), record)}


def point_phases(num_layers: int) -> np.ndarray:
    """True for the forward-pass points of `cell_points` (layers' forward points and the head's
    forward), False for the backward ones."""
    n = num_layers
    return np.array([True] * (2 * n) + [False] * n + [True, False, False])


def cell_points(table: CoefficientTable, record: dict) -> np.ndarray:
    """Every walk point of the record's one-group wave, in bytes (`model_points` of the
    record's model and wave). Its maximum is the wave's raw price. O(layers)."""
    from ..price import rank_rows

    rows, segments = _wave(record)
    model = _model(table, record["cell"])
    # the busiest CP rank's rows (all of them at CP1); the caller's tensors hold every row
    return model_points(model, rank_rows(model, rows), segments, logical_rows=rows)


def model_points(model, rows: float, segments: float, *, logical_rows: float) -> np.ndarray:
    """Every walk point of a one-group gradient wave of `rows` rank rows, `logical_rows` logical
    rows (all ranks) and `segments`, its longest sequence unknown, that carries its slot's pending
    gradients: raw bytes without the first execution, `pricing.walk`'s schedule in numpy with the
    head's backward split in its logits and final-norm moments (what calibration fits against).
    Its maximum is `price_groups`' raw price (tests/pricing/test_schedule_forms.py). O(layers)."""
    a, c = model.charges.walk, model.charges
    ret, ws, gdn = a.retained, a.workspace, a.gdn_state
    cum = np.cumsum(ret)
    total = float(ret.sum())
    # a GDN kernel's chunk padding rows (`walk`: the call's rows up to a multiple of the chunk)
    pad = math.ceil(rows / a.chunk) * a.chunk - rows if a.chunk > 1.0 else 0.0
    cum_pad = np.cumsum(a.pad_retained)
    total_pad = float(a.pad_retained.sum())
    suffix = np.cumsum(a.pending[0][::-1])[::-1] if a.pending.size else np.zeros(len(ret))
    parts, ig, const = c.head, a.input_grad, a.head_const
    head_ret = parts.logits_retained + parts.norm_saved
    late = ig + parts.layout_residual   # beside the head's backward (the residual: full recompute)
    fwd = c.forward
    held = rows * total + pad * total_pad   # every layer's retained rows, at the head
    before = rows * (cum - ret) + pad * (cum_pad - a.pad_retained + a.pad_point)
    # in this order (`point_phases` says which pass each runs in)
    points = [before + rows * fwd.nograd + segments * gdn,
              before + rows * fwd.retained_forward + segments * gdn,
              rows * (cum + ws + ig) + pad * (cum_pad + a.pad_point) + suffix + segments * gdn,
              [held + rows * max(head_ret, a.head_forward) + const,
               held + rows * (late + head_ret + parts.logits_transient) + const,
               # the final norm's backward, with the logits still charged at TP1
               # (`layout_terms.head_point_transient`)
               held + rows * (late + parts.norm_saved + parts.logits_at_norm
                              + parts.norm_backward) + const]]
    # the caller's tensors: per logical row, as the walk charges them (not divided by CP)
    return np.concatenate([np.asarray(p, dtype=np.float64) for p in points]) + a.caller * logical_rows


# --- scaling a table ------------------------------------------------------------------------


def scaled_table(base: CoefficientTable, scales: dict[str, float], *, note: str | None = None,
                 backend: str | None = None) -> CoefficientTable:
    """`base` with each group's coefficients (`GROUPS`) multiplied by its scale (default 1);
    every other entry kept, first execution and caller included (for fits to peaks measured
    where those exist: `waveplan calibrate --profiles`). `note` marks the sources."""
    return _scaled(base, {g: s for g, s in scales.items() if g in GROUPS}, note=note,
                   backend=backend, cpu_zeroed=False)


# the entries a fused-kernel table (`KernelSet.fused`) writes from the kernels' allocation models
KERNEL_MODEL_ENTRIES = ("kernel_models", "fused_retained_layer", "fused_mla_layer", "tp1_fc1_point",
                        "sp_head_forward", "final_norm", "final_norm_backward", "fused_gdn_layer",
                        "fused_gdn_point")


def fitted_base(base: CoefficientTable) -> CoefficientTable:
    """The fitted terms of a base table that CPU traces scale (`waveplan calibrate`): a table
    priced by the fused kernels' allocation models (te-gpu, `KernelSet.fused`) without its
    kernel-model entries, with its seeds' head (the `gdn` values), its layout residuals fitted
    without the kernel-model terms (`full_bare`, `retained_bare`) and its caller for every head;
    any other table as it is (docs/memory-model.md#gpu-kernel-allocation-models). O(terms)."""
    if not base.kernels.fused:
        return base
    terms = {k: v for k, v in base.terms.items() if k not in KERNEL_MODEL_ENTRIES}
    head = terms["head_full_native"]
    if "gdn" in head:
        terms["head_full_native"] = dict(head["gdn"], source=head["source"])
    residual = terms.get("layout_residual")
    if residual is not None and "full_bare" in residual:
        terms["layout_residual"] = {"full": residual["full_bare"],
                                    "retained": residual.get("retained_bare", residual["retained"]),
                                    "source": residual["source"]}
    terms["caller_per_logical_token"] = {k: v for k, v in terms["caller_per_logical_token"].items()
                                         if k != "heads"}
    return CoefficientTable(backend=base.backend, terms=terms, path=base.path)


def _scaled(base: CoefficientTable, scales: dict[str, float], *, note: str | None,
            backend: str | None = None, cpu_zeroed: bool = True) -> CoefficientTable:
    """`base` with each group's coefficients multiplied by its scale (default 1) and each
    unit group's term set to factor x unit (default: the base's own entry, or none).
    `cpu_zeroed`: first execution and caller set to 0, as CPU traces show them, and the base's
    fitted terms alone (`fitted_base`)."""
    if cpu_zeroed:
        base = fitted_base(base)
    terms = copy.deepcopy(base.terms)
    for group, names in GROUPS.items():
        s = scales.get(group, 1.0)
        for spec in names:
            name, only, width = (spec.split(":") + ["", ""])[:3]
            entry = terms[name]
            for key in _NUMERIC_KEYS:
                if key in entry and only in ("", key):
                    entry[key] = {w: _round(c * s) if width in ("", w) else c
                                  for w, c in entry[key].items()}
            for key in _SCALARS:
                if key in entry and only in ("", key):
                    entry[key] = _round(entry[key] * s)
            if note is not None and not entry["source"].startswith(note):
                entry["source"] = f"{note}: group '{group}' x {s:.4f} of the base ({entry['source']})"
            elif note is not None:
                entry["source"] += f"; group '{group}' x {s:.4f}"
    for group, (name, unit, evidence) in UNITS.items():
        if group not in scales:
            continue
        s = scales[group]
        entry = {key: ({w: _round(c * s) for w, c in coefs.items()} if isinstance(coefs, dict)
                       else _round(coefs * s)) for key, coefs in unit.items()}
        entry["source"] = (f"{note}: group '{group}' = {s:.4f} x the structural unit "
                           f"{json.dumps(unit)}: {evidence}" if note is not None else "fit")
        terms[name] = entry
    zeroed = ZEROED if cpu_zeroed else {}
    if note is not None:
        for name, key in zeroed.items():
            terms[name] = {key: 0, "source": f"{note}: 0 (CPU traces show no first-execution "
                                             f"transients or caller loss buffers; the full-native "
                                             f"head is traced and priced by head_full_native)"}
        fitted = {spec.split(":")[0] for g in GROUPS.values() for spec in g} | set(zeroed) \
            | {UNITS[g][0] for g in UNITS if g in scales}
        for name in terms:
            if name not in fitted:
                terms[name] = dict(terms[name], source=f"{note}: kept from the base "
                                                       f"({terms[name]['source']})")
    else:
        for name, key in zeroed.items():
            terms[name] = dict(terms[name], **{key: 0})
    return CoefficientTable(backend=backend or base.backend, terms=terms)


def _round(x: float) -> float:
    return float(f"{x:.6g}")


# --- the MoE routed point's branches --------------------------------------------------------

_EXPERT_BACKWARD = "moe_expert_backward"


def moe_point_branches(cell: dict) -> tuple[tuple[str | None, str], ...]:
    """How `_Linear` gives a cell's points: (table variant, anchor) pairs whose points' largest
    is the pricer's point. A cell with MoE layers under full recompute prices each one's routed
    rows (in its recomputed stage) at the largest of point A (`moe_routed`, which `moe_stage`
    scales), B and C (structural constants: `terms.moe_routed_stage_per_row`), not affine in
    `moe_stage`; so it is given with point A alone (`"a"`: B's entry zeroed, linearised at
    `moe_stage` = the top of `FACTOR_BOUNDS`, where x A >= C wherever A binds) and with B and C
    alone (`"bc"`: A's entry zeroed, at the zero anchor). Other cells (a retained layer's backward is `retained_backward`, without the
    stage): the table as it is. O(layers)."""
    from ..geometry import MlpKind

    moe = any(s.mlp == MlpKind.MOE for s in cell_geometry(cell).layers)
    if not moe or cell["recompute"] != "full":
        return ((None, "zero"),)
    return (("a", "moe_a"), ("bc", "zero"))


def _variant(table: CoefficientTable, variant: str | None) -> CoefficientTable:
    """`table` with one side of the MoE routed point's maximum (`moe_point_branches`): `"a"`
    zeroes point B (`moe_expert_backward`, te-gpu's missing entry charged as the CPU units),
    `"bc"` zeroes point A (`moe_routed`); None: `table` itself. O(terms)."""
    if variant is None:
        return table
    terms = dict(table.terms)
    if variant == "a":
        terms[_EXPERT_BACKWARD] = {"per_routed_row": {}, "per_expert_row": {},
                                   "source": "calibrate: point B left out (point A's branch)"}
    else:
        entry = terms["moe_routed"]
        terms["moe_routed"] = dict(entry, per_routed_row={w: 0 for w in entry.get("per_routed_row", {})})
    return CoefficientTable(backend=table.backend, terms=terms, path=table.path)


# --- the fit --------------------------------------------------------------------------------


def _ratios(base: CoefficientTable, scales: dict, records: list[dict]) -> list[float]:
    """estimate / measured of every record, whole peak then decoder-only, under `scales`."""
    table = _scaled(base, scales, note=None)
    dec = decoder_table(table)
    out = []
    for rec in records:
        out.append(_price(table, rec) / rec["trace"]["peak_bytes"])
        out.append(_price(dec, rec) / rec["trace"]["decoder_peak_bytes"])
    return out


def _used_groups(records: list[dict]) -> list[str]:
    from ..geometry import MixerKind, MlpKind
    from ..model import has_qk_norm

    used = {"boundary", "input_gradient", "head", "head_transient", "norms", "final_norm",
            "final_norm_backward"}
    for rec in records:
        cell = rec["cell"]
        g = cell_geometry(cell)
        attention = any(s.mixer == MixerKind.ATTENTION for s in g.layers)
        gdn = any(s.mixer == MixerKind.GDN for s in g.layers)
        if attention:
            used |= {"attention_stage", "qk_norm"} if has_qk_norm(g) else {"attention_stage"}
        if gdn:
            used |= {"gdn_stage", "gdn_state"}
        moe = any(s.mlp == MlpKind.MOE for s in g.layers)
        dense = any(s.mlp == MlpKind.DENSE for s in g.layers)
        if moe:
            used |= {"moe_stage", "moe_nograd"}
        if dense:
            used.add("dense_stage")
        if cell["recompute"] != "full":
            used |= {"retained_backward", "retained_forward"}
            for flag, group in ((attention, "retained"), (gdn, "retained_gdn"), (dense, "retained_ffn"),
                                (moe, "retained_moe"),
                                (attention and cell["recompute"] == "selective", "selective_discount")):
                if flag:
                    used.add(group)
    return [g for g in ALL_GROUPS if g in used]


class _Linear:
    """The walk points of every (record, whole | decoder) pair as affine functions of the
    fitted factors: points = const + coef @ factors (one row per point), exactly as the pricer
    prices them (`cell_points`, whose maximum is `price_groups`' price) for every factor vector
    in `FACTOR_BOUNDS`.

    A point is affine in the factors but for a recomputed MoE layer's routed point, the largest
    of point A (`moe_routed`, scaled by `moe_stage`) and the structural points B and C
    (`terms.moe_routed_stage_per_row`: constants of the pricer, not fitted). Such a record's
    points are given twice (`moe_point_branches`): with point A alone, linearised at the top of
    `FACTOR_BOUNDS` (where it is affine whenever it can bind), and with points B and C alone
    (constants); the largest of the two is the pricer's point at every factor vector."""

    def __init__(self, base: CoefficientTable, records: list[dict], groups: list[str]) -> None:
        self.groups = groups
        anchors = {"zero": np.zeros(len(groups))}
        if "moe_stage" in groups:
            anchors["moe_a"] = np.where(np.array(groups) == "moe_stage", FACTOR_BOUNDS[1], 0.0)
        # per anchor: the table at the anchor, then the anchor with each group's factor + 1
        tables = {name: [_scaled(base, dict(zip(groups, a, strict=True)), note=None)]
                  + [_scaled(base, dict(zip(groups, a + (np.arange(len(groups)) == j), strict=True)),
                             note=None) for j in range(len(groups))]
                  for name, a in anchors.items()}
        self.items = []  # (const[P], coef[P, G], measured)
        self.classes: dict[tuple, list[int]] = {}  # items whose points correspond
        self.phase_points: list[np.ndarray] = []
        for rec in records:
            cell = rec["cell"]
            branches = moe_point_branches(cell) if "moe_a" in anchors else ((None, "zero"),)
            for decoder, measured in ((False, rec["trace"]["peak_bytes"]),
                                      (True, rec["trace"]["decoder_peak_bytes"])):
                consts, coefs = [], []
                for variant, anchor in branches:
                    pts = [cell_points(_variant(decoder_table(t) if decoder else t, variant), rec)
                           for t in tables[anchor]]
                    coef = np.stack([p - pts[0] for p in pts[1:]], axis=1)
                    consts.append(pts[0] - coef @ anchors[anchor])
                    coefs.append(coef)
                const, coef = np.concatenate(consts), np.concatenate(coefs)
                keep = _undominated(const, coef)
                const, coef = const[keep], coef[keep]
                phases = np.tile(point_phases(int(cell["num_layers"])), len(branches))[keep]
                tr = rec["trace"]
                forward = decoder and tr.get("decoder_peak_forward_bytes", 0) > tr.get(
                    "decoder_peak_backward_bytes", 0)
                # the points of the pass the trace's peak fell in (decoder-only: the whole
                # step's walk folds the loss's forward peak into the head's backward point)
                self.phase_points.append(np.flatnonzero(phases == forward) if decoder and
                                         (phases == forward).any() else np.arange(len(keep)))
                key = (cell["model"], int(cell["num_layers"]), cell["recompute"], decoder, const.shape[0])
                self.classes.setdefault(key, []).append(len(self.items))
                self.items.append((const, coef, float(measured)))

    def ratios(self, x: np.ndarray) -> np.ndarray:
        return np.array([(c + k @ x).max() / m for c, k, m in self.items])

    def binding(self, x: np.ndarray, *, by_phase: bool = False) -> list[int]:
        """The highest point of each item (`by_phase`: among the points of the pass where its
        trace peaked)."""
        if not by_phase:
            return [int(np.argmax(c + k @ x)) for c, k, _ in self.items]
        return [int(p[np.argmax((c + k @ x)[p])]) for (c, k, _), p in zip(self.items, self.phase_points,
                                                                          strict=True)]


def _undominated(const: np.ndarray, coef: np.ndarray) -> list[int]:
    """Indices of the points not dominated: no larger than another point for every factor >= 0
    (coefficient-wise)."""
    flat = np.concatenate([const[:, None], coef], axis=1)
    keep = []
    for p in range(flat.shape[0]):
        dominated = False
        for q in range(flat.shape[0]):
            if q != p and np.all(flat[q] >= flat[p] - DOMINANCE_EPS) and (np.any(flat[q] > flat[p] + DOMINANCE_EPS) or q < p):
                dominated = True
                break
        if not dominated:
            keep.append(p)
    return keep


def _lp(lin: _Linear, binding: list[int], margin: float) -> np.ndarray | None:
    """One linear programme at fixed binding points; the factors, or None if infeasible.

    Variables: factors x (G), one ratio bound t per item (K), deviations u, v >= 0 with
    x - 1 = u - v. Minimise mean t + TIE_BREAK x sum (u + v) subject to every point / measured
    <= t, the binding point / measured >= 1 + margin, and FACTOR_BOUNDS.
    """
    n_g, n_k = len(lin.groups), len(lin.items)
    n = n_g + n_k + 2 * n_g
    rows, rhs = [], []
    for k, ((const, coef, m), b) in enumerate(zip(lin.items, binding, strict=True)):
        for p in range(const.shape[0]):
            row = np.zeros(n)
            row[:n_g] = coef[p] / m
            row[n_g + k] = -1.0
            rows.append(row)
            rhs.append(-const[p] / m)
        row = np.zeros(n)
        row[:n_g] = -coef[b] / m
        rows.append(row)
        rhs.append(const[b] / m - (1.0 + margin))
    for g in range(n_g):
        row = np.zeros(n)
        row[g] = 1.0
        rows.append(row)
        rhs.append(FACTOR_BOUNDS[1])
    eq = np.zeros((n_g, n))
    for g in range(n_g):
        eq[g, g] = 1.0
        eq[g, n_g + n_k + g] = -1.0
        eq[g, n_g + n_k + n_g + g] = 1.0
    cost = np.concatenate([np.zeros(n_g), np.full(n_k, 1.0 / n_k), np.full(2 * n_g, TIE_BREAK)])
    x = solve_lp(cost, np.array(rows), np.array(rhs), eq, np.ones(n_g))
    return None if x is None else x[:n_g]


def solve_lp(c: np.ndarray, a_ub: np.ndarray, b_ub: np.ndarray, a_eq: np.ndarray,
             b_eq: np.ndarray) -> np.ndarray | None:
    """min c.z subject to a_ub z <= b_ub, a_eq z = b_eq, z >= 0; None if infeasible.

    OR-Tools' GLOP when it is installed (the optional `solver` extra), else `simplex`."""
    try:
        from ortools.linear_solver import pywraplp
    except ImportError:
        return simplex(c, a_ub, b_ub, a_eq, b_eq)
    solver = pywraplp.Solver.CreateSolver("GLOP")
    if solver is None:  # pragma: no cover - GLOP ships with every OR-Tools wheel
        return simplex(c, a_ub, b_ub, a_eq, b_eq)
    z = [solver.NumVar(0.0, solver.infinity(), "") for _ in range(c.shape[0])]
    for a, b, is_eq in ((a_ub, b_ub, False), (a_eq, b_eq, True)):
        for i in range(a.shape[0]):
            cols = np.flatnonzero(a[i])
            lo = float(b[i]) if is_eq else -solver.infinity()
            ct = solver.Constraint(lo, float(b[i]))
            for j in cols:
                ct.SetCoefficient(z[j], float(a[i, j]))
    objective = solver.Objective()
    for j in np.flatnonzero(c):
        objective.SetCoefficient(z[j], float(c[j]))
    objective.SetMinimization()
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        return None
    return np.array([v.solution_value() for v in z])


def fit_scales(records: list[dict], base: CoefficientTable, *, margin: float = MARGIN,
               passes: int = 4) -> dict[str, float]:
    """The groups' factors (see the module doc): no record is under-priced.

    The binding point of a cell depends on the factors, and a programme whose cells are held
    at the wrong points (say, a hybrid's attention layer where a GDN layer binds) is feasible
    but poor. So: solve at the points that bind under the base (all factors 1) and under the
    base with each group in turn x 4 (the highest points, and the highest among the points of
    the pass where a decoder-only trace peaked), re-solve each at the points that bind under its solution
    until they settle, keep the best; then move cells held at their bound to other points (a
    whole class of like cells at once, then single cells), keeping a move when the total
    improves (a local search, `passes` rounds at most). Deterministic.
    O((groups + cells x points) x passes) programmes.
    """
    if not records:
        raise bad(ConfigError, "traces", "[]", "need at least one trace record to fit")
    groups = _used_groups(records)
    lin = _Linear(base, records, groups)

    def value(x: np.ndarray) -> float:
        return float(lin.ratios(x).mean()) + TIE_BREAK * float(np.abs(x - 1.0).sum())

    def solve(binding: list[int]) -> np.ndarray | None:
        sol = _lp(lin, binding, margin)
        if sol is None:
            return None
        x = np.clip(sol, *FACTOR_BOUNDS)
        return x if lin.ratios(x).min() >= 1.0 + margin - FIT_RATIO_EPS else None

    def settle(binding: list[int]) -> tuple[np.ndarray | None, list[int]]:
        best_x, best_b = None, binding
        for _ in range(8):
            x = solve(binding)
            if x is None:
                break
            if best_x is None or value(x) < value(best_x) - SETTLE_GAIN_EPS:
                best_x, best_b = x, binding
            nxt = lin.binding(x)
            if nxt == binding:
                break
            binding = nxt
        return best_x, best_b

    x, binding, best = None, None, math.inf
    for start in range(len(groups) + 1):
        x0 = np.ones(len(groups))
        if start:
            x0[start - 1] = 4.0
        for by_phase in (False, True):
            sx, sb = settle(lin.binding(x0, by_phase=by_phase))
            if sx is not None and value(sx) < best - SETTLE_GAIN_EPS:
                x, binding, best = sx, sb, value(sx)
    if x is None:
        # the base structure cannot cover the traces from its factors alone: raise them all
        x = np.ones(len(groups))
        x = x / lin.ratios(x).min() * (1.0 + margin)
        return {g: float(v) for g, v in zip(groups, x, strict=True)}
    for _ in range(passes):
        improved = False
        # moves: every item of a class (same model, layers, recompute and peak) to one point,
        # then single items; only items held at their bound can gain from a move
        moves = [(ks, p) for ks in lin.classes.values()
                 for p in range(lin.items[ks[0]][0].shape[0])]
        moves += [([k], p) for k in range(len(lin.items)) for p in range(lin.items[k][0].shape[0])]
        for ks, p in moves:
            if all(binding[k] == p for k in ks):
                continue
            if not any((lin.items[k][0][binding[k]] + lin.items[k][1][binding[k]] @ x) / lin.items[k][2]
                       <= 1.0 + margin + BINDING_RATIO_EPS for k in ks):
                continue
            trial = list(binding)
            for k in ks:
                trial[k] = p
            tx, tb = settle(trial)
            if tx is not None and value(tx) < best - MOVE_GAIN_EPS:
                x, binding, best, improved = tx, tb, value(tx), True
        if not improved:
            break
    return {g: float(v) for g, v in zip(groups, x, strict=True)}


def fit_table(traces: list[dict], base_table: CoefficientTable, *, backend: str = "torch-cpu",
              source_label: str = "traces", margin: float = MARGIN) -> CoefficientTable:
    """A table for `backend` fitted to `traces` (records as `read_traces` returns)."""
    for n, rec in enumerate(traces):
        _check_record(rec, f"record {n}")
    scales = fit_scales(traces, base_table, margin=margin)
    note = f"fitted by waveplan.pricing.measure.calibrate to {len(traces)} traced cells of {source_label}"
    # checked by the pricer itself (`_ratios`: `price_groups`)
    table, _, _ = covering_after_rounding(
        scales, lambda s: _scaled(base_table, s, note=note, backend=backend),
        lambda t: _ratios(t, {}, traces), margin=margin, field="traces", value=len(traces),
        why="could not raise the fit above every trace")
    return table


def table_document(table: CoefficientTable, *, description: str = "") -> dict:
    doc = {"backend": table.backend}
    if description:
        doc["description"] = description
    scales = getattr(table, "_fit_scales", None)
    if scales:
        doc["fit_scales"] = scales
    doc["terms"] = table.terms
    return doc


def write_table(table: CoefficientTable, path: str | Path, *, description: str = "") -> None:
    """Write `table` as JSON atomically (temporary file in the same folder, then rename)."""
    path = Path(path)
    doc = table_document(table, description=description)
    table_from_dict(json.loads(json.dumps(doc)))  # validates before anything is replaced
    write_text_atomic(path, _format(doc))


def _format(doc: dict) -> str:
    """One term per line, like the shipped tables."""
    lines = ["{", f'  "backend": {json.dumps(doc["backend"])},']
    for key in ("description", "fit_scales"):
        if key in doc:
            lines.append(f"  {json.dumps(key)}: {json.dumps(doc[key])},")
    lines.append('  "terms": {')
    items = list(doc["terms"].items())
    for i, (name, entry) in enumerate(items):
        comma = "," if i < len(items) - 1 else ""
        lines.append(f"    {json.dumps(name)}: {json.dumps(entry)}{comma}")
    lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"
