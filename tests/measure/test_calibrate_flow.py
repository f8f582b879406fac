"""Calibrate on your own machine: `waveplan trace --json` lines go straight into
`waveplan calibrate`, and `waveplan plan --coefficients` plans with the fitted table."""

from __future__ import annotations

import json

import pytest

from waveplan.planner.cli import main
from waveplan.pricing.coefficients import load_table
from waveplan.pricing.measure import calibrate

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore::UserWarning")]

CONFIG = {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 384,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "vocab_size": 1024, "torch_dtype": "bfloat16"}


def _step(path, lengths):
    path.write_text("".join(json.dumps({"id": f"r{i}", "completion_tokens": n}) + "\n"
                            for i, n in enumerate(lengths)))
    return path


@pytest.mark.slow
def test_trace_json_lines_calibrate_then_plan(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    traces = tmp_path / "traces.jsonl"
    grid = [[256], [128, 384], [64] * 6, [512, 256, 128]]
    for k, lengths in enumerate(grid):   # a small grid, traced as a user would on their device
        step = _step(tmp_path / f"s{k}.jsonl", lengths)
        assert main(["trace", str(step), "--model", str(config), "--device", "cpu-fake",
                     "--lora-rank", "8", "--json"]) == 0
        line = capsys.readouterr().out.strip()
        assert "\n" not in line   # one JSON object per line: append it
        with traces.open("a") as f:
            f.write(line + "\n")
    table = tmp_path / "table.json"
    assert main(["calibrate", str(traces), "--base", "torch-cpu", "--backend", "my-cpu",
                 "--out", str(table)]) == 0
    assert f"wrote {table}: {len(grid)} cells" in capsys.readouterr().out
    fitted = load_table(str(table))
    assert fitted.backend == "my-cpu"
    for rec in calibrate.read_traces(traces):   # the fit covers every trace it was fitted on
        assert rec["cell"]["geometry"]["hidden"] == 128 and rec["cell"]["lora_rank"] == 8
        est = calibrate.estimate(fitted, rec)
        assert est["peak"] >= rec["trace"]["peak_bytes"]
        assert est["decoder"] >= rec["trace"]["decoder_peak_bytes"]
    step = _step(tmp_path / "plan.jsonl", [300, 200, 500, 100, 250, 400])
    args = ["plan", str(step), "--model", str(config), "--tp", "1", "--no-sp", "--lora-rank", "8",
            "--head", "full-native",
            "--free-gib", "0.008", "--json"]
    assert main(args + ["--coefficients", str(table)]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert main(args + ["--backend", str(table)]) == 0   # the same option, two names
    again = json.loads(capsys.readouterr().out)
    planned.pop("planning_ms", None)
    again.pop("planning_ms", None)
    planned.pop("compile_ms", None)
    again.pop("compile_ms", None)
    assert planned == again and len(planned["waves"]) > 1
    assert main(args + ["--backend", "torch-cpu"]) == 0   # the base table prices differently
    shipped = json.loads(capsys.readouterr().out)
    assert [w["raw_bytes"] for w in shipped["waves"]] != [w["raw_bytes"] for w in planned["waves"]]


def test_a_trace_without_its_decoder_pass_cannot_be_fitted(tmp_path):
    from waveplan.pricing.errors import ConfigError

    line = {"peak_bytes": 10, "decoder_peak_bytes": None, "model": "qwen3-8b", "num_layers": 1,
            "recompute": {"mode": "full"}, "lora_rank": 16, "seq_lens": [8], "head": "full-native"}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ConfigError, match=r"trace.decoder_peak_bytes must be a positive integer"):
        calibrate.read_traces(path)
    rec = calibrate.record_from_trace(dict(line, decoder_peak_bytes=5))
    assert rec["cell"] == {"model": "qwen3-8b", "num_layers": 1, "recompute": "full",
                           "lora_rank": 16, "seq_lens": [8]}
