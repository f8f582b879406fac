"""The layout residuals as shipped (`layout_residual` in torch-cpu.json, fitted by
bench/layout_validation.py): every dense multi-rank CPU cell at TP > 1 or CP > 1 of the three
dense geometries (2048 tokens, and 3072 at hidden 1024; 8192 tokens in the scale grid; one
12288-token sequence in the long grid) is priced on evidence and never under its busiest rank (docs/memory-model.md#layout-residuals)."""

from __future__ import annotations

import json

from bench_modules import BENCH, bench_module

from waveplan.pricing.coefficients import load_table

RESULTS = BENCH / "results"
FILES = ("traces_multirank.jsonl", "traces_multirank_dense2.jsonl", "traces_multirank_dense3.jsonl",
         "traces_multirank_scale.jsonl", "traces_multirank_long.jsonl")


def _dense_cells() -> list[dict]:
    out = []
    for name in FILES:
        path = RESULTS / name
        assert path.exists(), f"bench/results/{name} is missing"
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            cell = rec["cell"]
            if cell["geometry"]["moe"] or cell["geometry"].get("gdn"):
                continue
            if cell["layout"]["tp"] * cell["layout"]["cp"] > 1:
                out.append(rec)
    return out


def test_every_dense_layout_cell_is_on_evidence_and_at_or_over_its_trace():
    table = load_table("torch-cpu")
    estimate = bench_module("layout_validation").estimate
    seen = set()
    for rec in _dense_cells():
        cell, trace = rec["cell"], rec["trace"]
        raw, model = estimate(cell, table)
        assert model.basis == "evidence", (cell["layout"], cell["recompute"], model.gaps)
        assert raw >= trace["peak_bytes"], (cell["geometry"]["name"], cell["layout"], cell["recompute"],
                                            trace["tokens"], raw / trace["peak_bytes"])
        seen.add((cell["geometry"]["name"], trace["tokens"]))
    # the three geometries, the fit wave, the held-out wave (h1024), the scale wave and one long sequence
    assert {("grid-dense-h1024", 2048), ("grid-dense-h1024", 3072), ("grid-dense-h768", 2048),
            ("grid-dense-h1536", 2048),
            ("grid-dense-h1024", 8192), ("grid-dense-h768", 8192), ("grid-dense-h1024", 12288),
            ("grid-dense-h768", 12288)} <= seen
