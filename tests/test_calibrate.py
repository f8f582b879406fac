"""Calibration: the fitted table validates, never under-prices its cells, and the CLI works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from waveplan.planner.cli import main
from waveplan.pricing import calibrate
from waveplan.pricing.coefficients import load_table

TRACES = Path(__file__).resolve().parents[1] / "bench" / "results" / "traces_cpu_fake.jsonl"


def _records() -> list[dict]:
    """One dense cell per recompute mode from the committed traces."""
    if not TRACES.exists():
        pytest.skip("bench/results/traces_cpu_fake.jsonl not present")
    picked: dict[str, dict] = {}
    for line in TRACES.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        cell = rec["cell"]
        if cell["model"] == "qwen3-8b" and cell["recompute"] not in picked:
            picked[cell["recompute"]] = rec
    return list(picked.values())


def test_fitted_table_never_under_prices(tmp_path):
    records = _records()
    table = calibrate.fit_table(records, load_table("te-gpu"), source_label="test")
    assert table.backend == "torch-cpu"
    out = tmp_path / "t.json"
    calibrate.write_table(table, out)
    reloaded = load_table(str(out))  # validates: every term present, every source set
    for rec in records:
        est = calibrate.estimate(reloaded, rec)
        assert est["peak"] >= rec["trace"]["peak_bytes"]
        assert est["decoder"] >= rec["trace"]["decoder_peak_bytes"]
    assert all("fitted" in e["source"] for e in reloaded.terms.values())


def test_shipped_torch_cpu_table_validates():
    table = load_table("torch-cpu")
    assert table.scalar("first_execution") == 0


def test_cli_calibrate(tmp_path, capsys):
    records = _records()
    traces = tmp_path / "t.jsonl"
    traces.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "fit.json"
    assert main(["calibrate", str(traces), "--base", "te-gpu", "--out", str(out)]) == 0
    assert load_table(str(out)).backend == "torch-cpu"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["calibrate", str(bad), "--out", str(tmp_path / "x.json")]) == 2
    assert main(["calibrate", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()
