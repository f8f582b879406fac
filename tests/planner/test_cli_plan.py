"""`waveplan plan` and `waveplan replay`: output, files and exit codes (0, 1, 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from waveplan.planner import Planner
from waveplan.planner.cli import main

GIB = 2**30
COLD_START_S = 600  # a subprocess may compile numba's kernels first (cold cache, busy machine)


EXAMPLE = ["plan", "grpo-8x8", "--model", "qwen3.8-27b", "--tp", "4", "--sp", "--recompute", "full",
           "--lora-rank", "16", "--free-gib", "40"]   # `make example`, every flag explicit


def test_bundled_example_prints_a_table(capsys):
    assert main(EXAMPLE) == 0
    out = capsys.readouterr().out
    assert "qwen3.8-27b" in out and "TP4" in out and "SP" in out
    assert "admitted GiB" in out and "binding" in out
    assert "lower bound" in out and "proven optimal" in out
    assert "40.00" in out   # the default budget


def test_the_table_says_what_a_single_rank_ep_plan_assumes(capsys):
    """A MoE model at EP > 1 planned on one rank: the table names the EP peers' assumption and
    the way to have it checked (plan_distributed); at EP1 no such line."""
    argv = ["plan", "grpo-8x8", "--model", "qwen3-30b-a3b", "--recompute", "full", "--free-gib", "60"]
    assert main(argv + ["--ep", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    note = [ln for ln in lines if ln.startswith("EP2: ")]
    assert len(note) == 1 and "plan_distributed" in note[0] and "#expert-parallel" in note[0]
    assert main(argv) == 0
    assert not any(ln.startswith("EP") for ln in capsys.readouterr().out.splitlines())


def test_plan_json(capsys):
    assert main(["plan", "grpo-8x8", "--free-gib", "30", "--json", "--packer", "greedy"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == 1 and data["packer"] == "greedy"
    assert all(w["budget_bytes"] == 30 * GIB for w in data["waves"])


def test_plan_help_names_the_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "40 GiB" in out and "grpo-8x8" in out


def test_report_then_replay_identical_and_drifted(tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["plan", "--report", str(report), "--free-gib", "35"]) == 0
    capsys.readouterr()
    assert main(["replay", str(report)]) == 0
    assert "identical" in capsys.readouterr().out
    data = json.loads(report.read_text())
    data["model"]["coefficients"]["terms"]["boundary"]["per_row"]["H"] = 4
    drifted = tmp_path / "drifted.json"
    drifted.write_text(json.dumps(data))
    assert main(["replay", str(drifted)]) == 1
    err = capsys.readouterr().err
    assert "differs" in err and "wave 0: raw_bytes" in err


@pytest.mark.parametrize("argv", [
    ["plan", "--free-gib", "0"],
    ["plan", "--free-gib", "nan"],
    ["plan", "--free-gib", "-3"],
    ["plan", "--model", "no-such-model"],
    ["plan", "no-such-step.jsonl"],
    ["plan", "--free-gib", "0.5"],            # infeasible: a request fits no split
    ["plan", "--packer", "magic"],
    ["plan", "--num-waves", "0"],
])
def test_bad_input_exits_2_with_one_line(argv, capsys):
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("waveplan: error:")


def _exit_code(argv):
    """main's return value, or argparse's SystemExit code for a bad argument."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def test_bad_report_files_exit_2(tmp_path, capsys):
    cut = tmp_path / "cut.json"
    cut.write_text('{"schema": 1, "kind": "waveplan-report", "mod')
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": 7, "kind": "waveplan-report"}))
    for path, needle in ((cut, "truncated"), (other, "schema=7"), (tmp_path / "none.json", "cannot read")):
        assert main(["replay", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0]


def test_corrupt_profiles_file_is_set_aside_and_plan_continues(tmp_path, capsys):
    prof = tmp_path / "prof.json"
    prof.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="corrupt"):
        assert main(["plan", "--profiles", str(prof)]) == 0
    assert (tmp_path / "prof.json.corrupt").read_text() == "{not json"
    assert "(evidence)" in capsys.readouterr().out


def test_plan_uses_a_profiles_file(tmp_path, capsys):
    planner = Planner.from_preset("qwen3.8-27b", tp=4, sequence_parallel=True, profiles_path=tmp_path / "p.json")
    from waveplan.pricing.step import bundled_step, load_step
    for wave in planner.plan(load_step(bundled_step("grpo-8x8")), free_bytes=40 * GIB).waves:
        planner.observe(wave, peak_bytes=0.95 * wave.static_raw_bytes)
    planner.save_profiles()
    assert main(["plan", "--tp", "4", "--sp", "--profiles", str(tmp_path / "p.json"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {w["basis"] for w in data["waves"]} == {"profile"}


def test_plot_missing_module_is_a_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "waveplan.planner.plot", None)   # import fails
    assert main(["plan", "--plot", str(tmp_path / "p.png")]) == 2
    assert "plot" in capsys.readouterr().err


@pytest.mark.slow
def test_subprocess_plan_and_replay(tmp_path):
    report = tmp_path / "r.json"
    env = dict(os.environ)
    run = [sys.executable, "-m", "waveplan.planner.cli"]
    done = subprocess.run(run + ["plan", "--report", str(report)], capture_output=True, text=True,
                          env=env, timeout=COLD_START_S)
    assert done.returncode == 0, done.stderr
    assert "proven optimal" in done.stdout
    done = subprocess.run(run + ["replay", str(report)], capture_output=True, text=True, env=env, timeout=COLD_START_S)
    assert done.returncode == 0, done.stderr
    done = subprocess.run(run + ["plan", "--free-gib", "inf"], capture_output=True, text=True, env=env,
                          timeout=COLD_START_S)
    assert done.returncode == 2 and "Traceback" not in done.stderr
