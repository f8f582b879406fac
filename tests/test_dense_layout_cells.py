"""The layout residuals as shipped (`layout_residual` in torch-cpu.json, fitted by
bench/layout_validation.py): every dense multi-rank CPU cell at TP > 1 or CP > 1 of both dense
geometries (2048 and 3072 tokens; 8192 tokens in the scale grid) is priced on evidence and never
under its busiest rank (docs/memory-model.md#layout-residuals)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from waveplan.pricing.coefficients import load_table
from waveplan.pricing.geometry import ModelGeometry
from waveplan.pricing.lora import LoraConfig, LoraSlot
from waveplan.pricing.model import PricingModel
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.step import Request, Step
from waveplan.pricing.wave_pricer import WavePricer

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
FILES = ("traces_multirank.jsonl", "traces_multirank_dense2.jsonl", "traces_multirank_scale.jsonl")


def _dense_cells() -> list[dict]:
    out = []
    for name in FILES:
        path = RESULTS / name
        if not path.exists():
            pytest.skip(f"bench/results/{name} not present")
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            cell = rec["cell"]
            if cell["geometry"]["moe"] or cell["geometry"].get("gdn"):
                continue
            if cell["layout"]["tp"] * cell["layout"]["cp"] > 1:
                out.append(rec)
    return out


def _price(cell: dict, table) -> tuple[int, PricingModel]:
    g = ModelGeometry.from_dict(cell["geometry"])
    g = dataclasses.replace(g, layers=g.layers[:cell["num_layers"]])
    model = PricingModel(geometry=g, parallel=ParallelLayout(**cell["layout"]),
                         recompute=Recompute(mode=cell["recompute"]),
                         lora=LoraConfig(slots=(LoraSlot(rank=cell["lora_rank"]),), grad_bytes=2),
                         table=table, head="full-native", safety=1.0)
    step = Step.from_requests([Request(id=f"r{i}", num_tokens=int(n)) for i, n in enumerate(cell["seq_lens"])])
    raw = WavePricer.build(step, model, profiled=True).price(
        [np.arange(len(step.requests))], first_slots=frozenset({"default"})).raw_bytes
    return raw, model


def test_every_dense_layout_cell_is_on_evidence_and_at_or_over_its_trace():
    table = load_table("torch-cpu")
    records = _dense_cells()
    seen = set()
    for rec in records:
        cell, trace = rec["cell"], rec["trace"]
        raw, model = _price(cell, table)
        assert model.basis == "evidence", (cell["layout"], cell["recompute"], model.gaps)
        assert raw >= trace["peak_bytes"], (cell["geometry"]["name"], cell["layout"], cell["recompute"],
                                            trace["tokens"], raw / trace["peak_bytes"])
        seen.add((cell["geometry"]["name"], trace["tokens"]))
    # both geometries, the fit wave, the held-out wave (h1024) and the scale wave
    assert {("grid-dense-h1024", 2048), ("grid-dense-h1024", 3072), ("grid-dense-h768", 2048),
            ("grid-dense-h1024", 8192), ("grid-dense-h768", 8192)} <= seen
