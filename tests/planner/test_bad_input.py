"""Bad input through the CLI: exit 2, exactly one line on stderr, no traceback, and the message
names the field and the value (and file:line where there is one).

Already covered elsewhere (not repeated): --free-gib 0 / nan / -3, an unknown preset, a request
that fits no budget (--free-gib 0.5), --packer / --num-waves (tests/planner/test_cli_plan.py); a
truncated report and another schema for `replay` (test_cli_plan.py, test_report.py); a corrupt
profiles file set aside (test_cli_plan.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from waveplan.planner.cli import main

HF = Path(__file__).resolve().parents[1] / "data" / "hf"
FAST = ["--model", "qwen3-8b", "--tp", "1", "--no-sp", "--packer", "greedy"]


def _fails(capsys, argv: list[str], *needles: str) -> str:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse errors
        code = exc.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _step(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "step.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


GOOD = '{"id": "a", "completion_tokens": 100}'


def test_malformed_json_line(tmp_path, capsys):
    path = _step(tmp_path, GOOD, '{"id": "b", "completion_tokens": 1')
    _fails(capsys, ["plan", path, *FAST], "step.jsonl:2", "invalid JSON")


def test_missing_field(tmp_path, capsys):
    path = _step(tmp_path, GOOD, '{"id": "b"}')
    _fails(capsys, ["plan", path, *FAST], "step.jsonl:2", "completion_tokens", "missing field")


def test_unknown_field(tmp_path, capsys):
    path = _step(tmp_path, '{"id": "a", "completion_tokens": 100, "colour": "red"}')
    _fails(capsys, ["plan", path, *FAST], "step.jsonl:1", "colour='red'", "unknown field")


@pytest.mark.parametrize("length", [-5, 0])
def test_non_positive_length(tmp_path, capsys, length):
    path = _step(tmp_path, GOOD, f'{{"id": "b", "completion_tokens": {length}}}')
    _fails(capsys, ["plan", path, *FAST], "step.jsonl:2", f"completion_tokens={length}")


def test_non_positive_prompt_length(tmp_path, capsys):
    path = _step(tmp_path, '{"id": "a", "prompt": "p", "prompt_tokens": 0, "completion_tokens": 9}')
    _fails(capsys, ["plan", path, *FAST], "step.jsonl:1", "prompt_tokens=0")


def test_duplicate_ids(tmp_path, capsys):
    path = _step(tmp_path, GOOD, '{"id": "b", "completion_tokens": 5}', GOOD)
    _fails(capsys, ["plan", path, *FAST], "step.jsonl:3", "id='a'", "duplicate", "line 1")


def test_unknown_model_type_in_config_json(tmp_path, capsys):
    data = json.loads((HF / "qwen3-8b.json").read_text())
    data["model_type"] = "gpt-banana"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    _fails(capsys, ["plan", "--model", str(path), "--tp", "1", "--no-sp"], "model_type", "gpt-banana")


def test_inconsistent_geometry_tp3(capsys):
    _fails(capsys, ["plan", "--model", "qwen3-8b", "--tp", "3"], "tp=3", "num_heads")


def test_free_gib_minus_one(capsys):
    _fails(capsys, ["plan", *FAST, "--free-gib", "-1"], "free_gib", "-1")


def test_free_gib_absurdly_large(capsys):
    _fails(capsys, ["plan", *FAST, "--free-gib", "1e12"], "free_gib", "1e12")


def test_free_gib_not_a_number(capsys):
    _fails(capsys, ["plan", *FAST, "--free-gib", "lots"], "free_gib", "lots")


def test_request_larger_than_any_budget(tmp_path, capsys):
    path = _step(tmp_path, '{"id": "whale", "completion_tokens": 4000000}')
    _fails(capsys, ["plan", path, *FAST, "--free-gib", "1"], "whale")


def test_unreadable_profiles_file(tmp_path, capsys, monkeypatch):
    """An unreadable profile file is set aside (kept, renamed) with a warning, and planning
    continues from the static model: exit 0."""
    prof = tmp_path / "prof.json"
    prof.write_text('{"schema": 1, "profiles": []}')
    prof.chmod(0)
    if os.access(prof, os.R_OK):  # root reads any file: make the read fail as it would
        real = Path.read_text

        def read_text(self, *args, **kwargs):
            if self == prof:
                raise PermissionError(13, "Permission denied", str(self))
            return real(self, *args, **kwargs)

        monkeypatch.setattr(Path, "read_text", read_text)
    try:
        with pytest.warns(RuntimeWarning, match="prof.json.*cannot read profile file.*set aside as prof.json.corrupt"):
            code = main(["plan", *FAST, "--profiles", str(prof)])
    finally:
        for path in (prof, tmp_path / "prof.json.corrupt"):
            if path.exists():
                path.chmod(0o644)
    assert code == 0
    assert "Traceback" not in capsys.readouterr().err
    assert not prof.exists()
    assert (tmp_path / "prof.json.corrupt").read_text() == '{"schema": 1, "profiles": []}'


def test_unreadable_profiles_path_is_set_aside_and_planning_continues(tmp_path, capsys):
    prof = tmp_path / "profdir"  # a directory: reading it fails like an unreadable file
    prof.mkdir()
    with pytest.warns(RuntimeWarning, match="cannot read profile file"):
        assert main(["plan", *FAST, "--profiles", str(prof)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert (tmp_path / "profdir.corrupt").is_dir()


def test_truncated_profiles_file_is_set_aside(tmp_path, capsys):
    good = tmp_path / "good.json"
    assert main(["plan", *FAST, "--json", "--profiles", str(good)]) == 0
    capsys.readouterr()
    prof = tmp_path / "prof.json"
    prof.write_text('{"schema": 1, "profi')
    with pytest.warns(RuntimeWarning, match="prof.json"):
        assert main(["plan", *FAST, "--profiles", str(prof)]) == 0
    assert (tmp_path / "prof.json.corrupt").exists()


def test_replay_report_that_is_not_an_object(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text("[1, 2]")
    _fails(capsys, ["replay", str(path)], "r.json")


def test_etp_not_a_positive_integer(capsys):
    _fails(capsys, ["price", "grpo-8x8", "--model", "qwen3-30b-a3b", "--tp", "4", "--sp", "--etp", "0"],
           "parallel.etp", "positive integer")


def test_etp_above_tp(capsys):
    _fails(capsys, ["price", "grpo-8x8", "--model", "qwen3-30b-a3b", "--tp", "2", "--sp", "--etp", "4"],
           "parallel.etp", "must not exceed")


def test_etp_on_a_dense_model(capsys):
    _fails(capsys, ["price", "grpo-8x8", "--model", "qwen3-8b", "--tp", "2", "--etp", "1"],
           "--etp", "dense model")
