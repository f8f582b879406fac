"""Fit the fsdp framework's four calibration factors to peaks measured on the user's own
hardware: `waveplan calibrate` on `trace --framework fsdp` records, and `calibrate --profiles`
for an FSDP model (docs/memory-model.md#fsdp-calibration).

A table's optional entries `fsdp_layer`, `fsdp_attention`, `fsdp_head` and `fsdp_constants`
(`pricing.entries`) each carry a factor (`value`) on one group of the fsdp terms: the
decoder-layer bytes per row, the packed-row S x S bytes, the head's bytes per row, and the
gathered parameters, gradient buffers and pending adapter gradients. A table without them
prices the derived terms (factor 1). Every price is monotone in every factor, so the fit is
`planner.profile_fit`'s: the least uniform factor s0 that covers every peak with the margin
(bisection), then each group lowered in turn as far as every peak stays covered.
"""

from __future__ import annotations

import copy
import dataclasses

from ..coefficients import CoefficientTable, covering_after_rounding, covering_scales
from ..errors import ConfigError, bad
from .terms import CALIBRATION_GROUPS as GROUPS
from .terms import calibration_factors as factors

MARGIN = 0.005          # every fitted estimate >= (1 + MARGIN) x its peak
FACTOR_MAX = 8.0


def scaled_table(base: CoefficientTable, scales: dict[str, float], *, note: str | None = None,
                 backend: str | None = None) -> CoefficientTable:
    """`base` with each group's factor multiplied by its scale (groups not named kept); every
    other entry kept. `note` says where the factors come from."""
    terms = copy.deepcopy(base.terms)
    have = factors(base)
    for g, s in scales.items():
        if g not in GROUPS:
            continue
        terms[g] = {"value": round(have[g] * s, 6),
                    "source": note or f"fsdp calibration factor x {s:.4f}"}
    return CoefficientTable(backend=backend or base.backend, terms=terms)


def fit_scales(price, peaks, base: CoefficientTable, *, margin: float = MARGIN,
               where=None) -> tuple[dict[str, float], float]:
    """(group factors, s0): the least factors covering every peak at (1 + margin) x, where
    `price(table)` gives each cell's raw price with `table` and `peaks` each cell's peak.
    Deterministic (`coefficients.covering_scales`)."""
    def ratios(scales):
        return [p / k for p, k in zip(price(scaled_table(base, scales)), peaks, strict=True)]

    def refuse(r):
        i = min(range(len(r)), key=r.__getitem__)
        raise bad(ConfigError, f"{where[i] if where else f'cells[{i}]'}.peak_bytes", peaks[i],
                  f"even {FACTOR_MAX:g}x the fsdp terms price this wave at {r[i]:.3f}x its peak; "
                  "the peak was not measured on the wave (or with other memory counted)")

    return covering_scales(list(GROUPS), ratios, margin=margin, factor_max=FACTOR_MAX, refuse=refuse)


def device_table(table: CoefficientTable, device: str) -> CoefficientTable:
    """`table`'s fsdp factors on the shipped table of the device a trace ran on: the head's
    dtypes are the device's (`verl_head.gpu_dtypes`: a CPU trace of a veRL head holds bf16 where
    a GPU holds fp32), whatever base the fit starts from; `table` itself when they agree."""
    from ..coefficients import load_table
    from .verl_head import gpu_dtypes

    gpu = str(device).startswith("cuda")
    if gpu_dtypes(table) == gpu:
        return table
    return scaled_table(load_table("te-gpu" if gpu else "torch-cpu"), factors(table),
                        note="fsdp calibration factor", backend=table.backend)


def record_pricer(records: list[dict]):
    """`price(table)` for `fit_scales`: each fsdp trace record's raw price with `table`'s
    factors on its own configuration and layout (shard group, attention, checkpointing,
    Ulysses, head: `check.price_record`) and its device's head dtypes (`device_table`)."""
    from .check import price_record

    def price(table: CoefficientTable) -> list[int]:
        return [price_record(r, table=device_table(table, r.get("device", "cpu"))).raw_bytes
                for r in records]

    return price


def read_fsdp_traces(lines: list[str], source: str) -> list[dict] | None:
    """The fsdp trace records of a JSON Lines text (`trace --framework fsdp --json` lines or
    bench/results/fsdp_traces.jsonl), or None when none of them is an fsdp record. A file that
    mixes fsdp and Megatron records fails with one line."""
    import json

    recs = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise bad(ConfigError, f"{source}:{i + 1}", line[:40], "is not JSON") from None
        recs.append((i, obj))
    fsdp = [(i, o) for i, o in recs if isinstance(o, dict) and o.get("framework") == "fsdp"]
    if not fsdp:
        return None
    if len(fsdp) != len(recs):
        i = next(i for i, o in recs if not (isinstance(o, dict) and o.get("framework") == "fsdp"))
        other = recs[[j for j, _ in recs].index(i)][1]
        raise bad(ConfigError, f"{source}:{i + 1}.framework",
                  other.get("framework") if isinstance(other, dict) else None,
                  "fsdp and Megatron records in one file")
    for i, o in fsdp:
        for key in ("config", "seq_lens", "fsdp", "attn", "checkpointing", "lora_rank", "peak_bytes"):
            if key not in o:
                raise bad(ConfigError, f"{source}:{i + 1}.{key}", None, "missing in an fsdp trace record")
        if not (isinstance(o["peak_bytes"], int) and o["peak_bytes"] > 0):
            raise bad(ConfigError, f"{source}:{i + 1}.peak_bytes", o["peak_bytes"], "must be a positive integer")
    return [o for _, o in fsdp]


def fit_traces(records: list[dict], base: CoefficientTable, *, backend: str,
               source_label: str, margin: float = MARGIN) -> tuple[CoefficientTable, list[float]]:
    """A table named `backend`: `base` with the fsdp factors fitted to `records`, and each
    record's fitted estimate / peak."""
    price = record_pricer(records)
    peaks = [int(r["peak_bytes"]) for r in records]
    scales, _ = fit_scales(price, peaks, base, margin=margin,
                           where=[f"{source_label}[{i}]" for i in range(len(records))])
    note = f"fitted by waveplan calibrate to {len(records)} fsdp traces of {source_label}"
    table, _, ratios = covering_after_rounding(
        scales, lambda sc: scaled_table(base, sc, note=note, backend=backend),
        lambda t: [p / k for p, k in zip(price(t), peaks, strict=True)], margin=margin,
        field=source_label, value=len(records), why="could not raise the fit above every peak")
    return table, ratios


def with_table(model, table: CoefficientTable):
    """`model` priced from `table` (its charges rebuilt with the table's factors)."""
    return dataclasses.replace(model, table=table)
