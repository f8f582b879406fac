"""Fit a backend's coefficient table to traced wave peaks (`waveplan calibrate`).

A trace record is one JSON object per line: `{"cell": {...}, "trace": TraceResult.to_dict()}`
where the cell names the model (preset name), `num_layers` traced, `recompute` mode,
`lora_rank` and `seq_lens` (what `bench/validation_study.py trace` writes).

The fit keeps the base table's structure and multiplies each *group* of terms by one scale
factor (`GROUPS`): few parameters, so a handful of traces cannot over-fit. Each cell is priced
with the real pricing model (one gradient group of the wave's packed rows, head
"full-native", `profiled=True`) on the geometry cut to the traced layer count. The
decoder-only peak of a cell is priced the same way with the head's per-row terms set to
zero (the walk then charges no logits), against the trace's decoder-only pass. The scales
minimise the median over-estimate (log coordinate search, no scipy); then every scale is
raised by one common factor until no training cell, whole peak or decoder-only, is under its
trace: the fitted table never under-prices the cells it was fitted on.

CPU traces have no first-execution transients and no caller loss buffers (the full-native
head is traced), so `first_execution` and `caller_per_logical_token` are set to 0.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

from .atomic_io import write_text_atomic
from .coefficients import CoefficientTable, load_table, table_from_dict
from .errors import ConfigError, bad

GROUPS: dict[str, tuple[str, ...]] = {
    "boundary": ("boundary",),
    "input_gradient": ("input_gradient",),
    "retained": ("retained_attention_layer", "retained_gdn_layer", "selective_core_attn_discount"),
    "retained_moe": ("retained_moe_mlp",),
    "dense_stage": ("mlp_dense_grad_stage", "mlp_dense_nograd", "residual_norm_shards", "norm_gathered"),
    "attention_stage": ("attention_stage",),
    "gdn_stage": ("gdn_stage",),
    "moe_stage": ("moe_routed", "moe_router", "moe_shared_expert"),
    "head": ("head_full_native:retained_per_row_vocab", "head_full_te:retained_per_row_vocab",
             "head_chunk"),
    "head_transient": ("head_full_native:transient_per_row_vocab",
                       "head_full_te:transient_per_row_vocab"),
}
# A group's scale stays within these bounds (before the common raise): structural terms such
# as the saved boundary (rows x H x 2) are real memory even where short traces cannot see them.
SCALE_BOUNDS = (0.5, 4.0)
ZEROED = {"first_execution": "value", "caller_per_logical_token": "value"}
_NUMERIC_KEYS = ("per_row", "per_routed_row")
_SCALARS = ("per_row_vocab", "retained_per_row_vocab", "transient_per_row_vocab")
HEAD = "full-native"


def load_base(backend: str = "te-gpu") -> CoefficientTable:
    return load_table(backend)


def read_traces(path: str | Path) -> list[dict]:
    """Trace records of a JSON Lines file; ConfigError on anything unreadable."""
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
    for key in ("peak_bytes", "decoder_peak_bytes"):
        value = trace.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise bad(ConfigError, "traces", where, f"trace.{key} must be a positive integer")
    if trace.get("head", HEAD) != HEAD:
        raise bad(ConfigError, "traces", where, f"only '{HEAD}' traces can be fitted")


# --- pricing one cell -----------------------------------------------------------------------

_GEOMETRY_CACHE: dict = {}


def _geometry(name: str, num_layers: int):
    key = (name, num_layers)
    if key not in _GEOMETRY_CACHE:
        from .model_source import load_model

        g = load_model(name)
        _GEOMETRY_CACHE[key] = dataclasses.replace(g, layers=g.layers[:num_layers])
    return _GEOMETRY_CACHE[key]


def _price(table: CoefficientTable, cell: dict) -> int:
    from .lora import LoraConfig, LoraSlot
    from .model import PricingModel
    from .parallel import Recompute
    from .price import GroupLoad, price_groups

    geometry = _geometry(cell["model"], int(cell["num_layers"]))
    model = PricingModel(geometry=geometry, parallel=_layout(), recompute=Recompute(mode=cell["recompute"]),
                         lora=LoraConfig(slots=(LoraSlot(rank=int(cell["lora_rank"]) or 1),)),
                         table=table, head=HEAD, safety=1.0)
    rows = int(sum(cell["seq_lens"]))
    group = GroupLoad(packed_rows=rows, padded_rows=rows, logical_rows=rows,
                      segments=len(cell["seq_lens"]))
    return price_groups(model, [group], first_slots=frozenset({"default"}), profiled=True).raw_bytes


def _layout():
    from .parallel import ParallelLayout

    return ParallelLayout()


def decoder_table(table: CoefficientTable) -> CoefficientTable:
    """The same table with the head's per-row terms zeroed (prices the decoder-only peak)."""
    return _scaled(table, {"head": 0.0, "head_transient": 0.0}, note=None)


def estimate(table: CoefficientTable, record: dict) -> dict:
    """Raw estimates of one trace record: whole peak and decoder-only peak, in bytes."""
    return {"peak": _price(table, record["cell"]), "decoder": _price(decoder_table(table), record["cell"])}


# --- scaling a table ------------------------------------------------------------------------


def _scaled(base: CoefficientTable, scales: dict[str, float], *, note: str | None,
            backend: str | None = None) -> CoefficientTable:
    terms = copy.deepcopy(base.terms)
    for group, names in GROUPS.items():
        s = scales.get(group, 1.0)
        for spec in names:
            name, _, only = spec.partition(":")
            entry = terms[name]
            for key in _NUMERIC_KEYS:
                if key in entry and only in ("", key):
                    entry[key] = {w: _round(c * s) for w, c in entry[key].items()}
            for key in _SCALARS:
                if key in entry and only in ("", key):
                    entry[key] = _round(entry[key] * s)
            if note is not None and not entry["source"].startswith(note):
                entry["source"] = f"{note}: group '{group}' x {s:.4f} of the base ({entry['source']})"
            elif note is not None:
                entry["source"] += f"; group '{group}' x {s:.4f}"
    if note is not None:
        for name, key in ZEROED.items():
            terms[name] = {key: 0, "source": f"{note}: 0 (CPU traces show no first-execution "
                                             f"transients or caller loss buffers; the full-native "
                                             f"head is traced and priced by head_full_native)"}
        for name in terms:
            if name not in ZEROED and not any(spec.split(":")[0] == name for g in GROUPS.values() for spec in g):
                terms[name] = dict(terms[name], source=f"{note}: kept from the base "
                                                       f"({terms[name]['source']})")
    else:
        for name, key in ZEROED.items():
            terms[name] = dict(terms[name], **{key: 0})
    return CoefficientTable(backend=backend or base.backend, terms=terms)


def _round(x: float) -> float:
    return float(f"{x:.6g}")


# --- the fit --------------------------------------------------------------------------------


def _ratios(base: CoefficientTable, scales: dict, records: list[dict]) -> list[float]:
    table = _scaled(base, scales, note=None)
    dec = decoder_table(table)
    out = []
    for rec in records:
        out.append(_price(table, rec["cell"]) / rec["trace"]["peak_bytes"])
        out.append(_price(dec, rec["cell"]) / rec["trace"]["decoder_peak_bytes"])
    return out


def _objective(ratios: list[float]) -> float:
    """Median over-estimate after the common raise that lifts the lowest ratio to 1 (with a
    small weight on the mean, to break ties)."""
    lo = min(ratios)
    if lo <= 0:
        return math.inf
    rel = sorted(r / lo for r in ratios)
    med = rel[len(rel) // 2]
    return med + 0.25 * sum(rel) / len(rel)


def _used_groups(records: list[dict]) -> list[str]:
    from .geometry import MixerKind, MlpKind

    used = {"boundary", "input_gradient", "head", "head_transient", "dense_stage"}
    for rec in records:
        cell = rec["cell"]
        g = _geometry(cell["model"], int(cell["num_layers"]))
        if any(s.mixer == MixerKind.ATTENTION for s in g.layers):
            used.add("attention_stage")
        if any(s.mixer == MixerKind.GDN for s in g.layers):
            used.add("gdn_stage")
        if any(s.mlp == MlpKind.MOE for s in g.layers):
            used.add("moe_stage")
            if cell["recompute"] != "full":
                used.add("retained_moe")
        if cell["recompute"] != "full":
            used.add("retained")
    return [g for g in GROUPS if g in used]


def fit_scales(records: list[dict], base: CoefficientTable, *, rounds: int = 6) -> dict[str, float]:
    """Per-group scales (see the module doc), raised so no record is under-priced."""
    if not records:
        raise bad(ConfigError, "traces", "[]", "need at least one trace record to fit")
    groups = _used_groups(records)
    scales = {g: 1.0 for g in GROUPS}
    best = _objective(_ratios(base, scales, records))
    step = 0.5
    for _ in range(rounds):
        for g in groups:
            improved = True
            while improved:
                improved = False
                for factor in (math.exp(step), math.exp(-step)):
                    new = scales[g] * factor
                    if not SCALE_BOUNDS[0] <= new <= SCALE_BOUNDS[1]:
                        continue
                    trial = dict(scales, **{g: new})
                    value = _objective(_ratios(base, trial, records))
                    if value < best - 1e-6:
                        scales, best, improved = trial, value, True
                        break
        step /= 2
    # the common raise: iterate (pending adapter gradients are not scaled, so one raise by the
    # lowest ratio may fall a hair short)
    for _ in range(20):
        lo = min(_ratios(base, scales, records))
        if lo >= 1.0:
            break
        scales = {g: s / lo * 1.0005 for g, s in scales.items()}
    else:  # pragma: no cover - the raise converges in a few iterations
        raise bad(ConfigError, "traces", len(records), "could not raise the fit above every trace")
    return scales


def fit_table(traces: list[dict], base_table: CoefficientTable, *, backend: str = "torch-cpu",
              source_label: str = "traces") -> CoefficientTable:
    """A table for `backend` fitted to `traces` (records as `read_traces` returns)."""
    for n, rec in enumerate(traces):
        _check_record(rec, f"record {n}")
    scales = fit_scales(traces, base_table)
    note = f"fitted by waveplan.pricing.calibrate to {len(traces)} traced cells of {source_label}"
    table = _scaled(base_table, scales, note=note, backend=backend)
    object.__setattr__(table, "_fit_scales", {g: round(s, 4) for g, s in scales.items()})
    # rounding the coefficients to 6 significant digits may lower a ratio by ~1e-6: check
    ratios = _ratios(table, {}, traces)
    if min(ratios) < 1.0:
        table = _scaled(table, {g: 1.0 / min(ratios) * 1.0001 for g in GROUPS}, note=None, backend=backend)
        table = CoefficientTable(backend=backend, terms=_with_sources(table.terms, note, scales))
        object.__setattr__(table, "_fit_scales", {g: round(s, 4) for g, s in scales.items()})
    return table


def _with_sources(terms: dict, note: str, scales: dict) -> dict:
    out = copy.deepcopy(terms)
    for entry in out.values():
        if not entry.get("source"):
            entry["source"] = note
    return out


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
