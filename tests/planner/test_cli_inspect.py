"""`waveplan inspect`: text, --json, and exit 2 with one line on a bad step file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from waveplan.planner.cli import main


def test_inspect_text_defaults(capsys):
    assert main(["inspect"]) == 0
    out = capsys.readouterr().out
    assert "qwen3.8-27b" in out
    assert "48 gdn/dense, 16 attention/dense" in out
    assert "hidden     5,120" in out
    assert "grpo-8x8.jsonl" in out
    assert "64 in 8 prefix groups" in out
    assert "segments   72 (full sharing" in out


def test_inspect_json(capsys):
    assert main(["inspect", "--json", "--model", "qwen3-8b", "--step", "sft-64"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["name"] == "qwen3-8b" and data["model"]["hidden"] > 0
    assert data["requests"] == 64 and data["groups"] == 64
    assert data["packed_tokens"] == data["logical_tokens"]  # nothing shared
    assert data["segments"] == 64


def test_inspect_json_step_file(tmp_path, capsys):
    path = tmp_path / "s.jsonl"
    path.write_text('{"id": "a", "tokens": [1, 2, 3]}\n{"id": "b", "tokens": [1, 2, 4, 5]}\n')
    assert main(["inspect", "--json", "--step", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {k: data[k] for k in ("requests", "groups", "packed_tokens", "logical_tokens", "segments")} == {
        "requests": 2, "groups": 1, "packed_tokens": 5, "logical_tokens": 7, "segments": 3}
    assert data["step"] == str(path)


def test_inspect_bad_step_file_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "tokens": [1]}\n{"id": "b", "prompt_tokens": 3}\n')
    assert main(["inspect", "--step", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}:2: " in err and "Traceback" not in err


@pytest.mark.slow
def test_inspect_subprocess(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "waveplan.planner.cli", "inspect", "--json"],
                        capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["requests"] == 64
    path = tmp_path / "bad.jsonl"
    path.write_text("{not json\n")
    bad = subprocess.run([sys.executable, "-m", "waveplan.planner.cli", "inspect", "--model", "qwen3.8-27b",
                          "--step", str(path)],
                         capture_output=True, text=True, check=False)
    assert bad.returncode == 2
    assert bad.stderr.strip() == f"waveplan: error: {path}:1: invalid JSON: " \
        "Expecting property name enclosed in double quotes (column 2)"


def test_inspect_names_the_ep_peers_assumption_at_ep_above_one(capsys):
    """A MoE model at EP > 1: inspect says what a plan made on one rank assumes (text and JSON)."""
    assert main(["inspect", "--model", "qwen3-30b-a3b", "--ep", "2"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ep peers")]
    assert len(lines) == 1 and "EP2: " in lines[0] and "plan_distributed" in lines[0]
    assert main(["inspect", "--json", "--model", "qwen3-30b-a3b", "--ep", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["ep_peers"].startswith("EP2: ")
    assert main(["inspect", "--json", "--model", "qwen3-30b-a3b"]) == 0
    assert "ep_peers" not in json.loads(capsys.readouterr().out)


def test_inspect_prints_the_conservative_reason_on_the_basis_line(capsys):
    """An untraced layout: the basis line says conservative, why, and the layout it is credited as."""
    assert main(["inspect", "--model", "qwen3-32b", "--tp", "8", "--sp", "--cp", "8"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("basis")]
    assert len(lines) == 1
    assert lines[0].startswith("basis      conservative (TP8 SP CP8, full recompute, te-gpu): TP8 SP CP8 (no multi-rank trace")
    assert lines[0].endswith("priced as TP8 SP CP4")
    assert main(["inspect", "--model", "qwen3-32b", "--tp", "4", "--sp"]) == 0
    assert "basis      evidence (TP4 SP CP1, full recompute, te-gpu)\n" in capsys.readouterr().out
    assert main(["inspect", "--json", "--model", "qwen3-32b", "--pp", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["basis"] == "conservative"
    assert data["reasons"] == ["PP2 (stages priced under 1F1B, validated on CPU pipeline traces only)"]
