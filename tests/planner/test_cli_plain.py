"""The CLI without surprises: plain defaults, one-line errors that say what to do, empty
completions, STEP names and stdin, --num-waves wording, bare `waveplan`, replay's summary,
logging, progress and the table legend. In-process through `main([...])`."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest

from waveplan.planner import cli, cmd_study
from waveplan.planner.cli import main
from waveplan.planner.progress import LineProgress, progress_bar
from waveplan.pricing.step import load_step

FAST = ["--model", "qwen3-8b", "--packer", "greedy"]


def _plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("waveplan: error: ")
    return lines[0]


def test_defaults_are_plain_tp1_without_sp(capsys):
    code, out, _ = _plan(capsys, *FAST, "--tp", "1")   # used to fail: sequence_parallel=True
    assert code == 0
    header = out.splitlines()[0]
    assert "TP1 CP1" in header and " SP" not in header
    code, out2, _ = _plan(capsys, *FAST)
    assert code == 0 and out2.splitlines()[0] == header


def test_help_shows_every_default():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in ("plan", "price", "study"):
        text = sub.choices[name].format_help()
        assert "(default: 1)" in text          # --tp, --cp, --pp, --ep
        for action in sub.choices[name]._actions:
            if action.default in (None, False) or action.help == "==SUPPRESS==" or action.dest == "help":
                continue
            assert "default" in (action.help or "") or action.help is None or \
                "%(default)s" in sub.choices[name]._get_formatter()._get_help_string(action), \
                (name, action.dest)


def test_infeasible_step_is_one_line_in_gib_with_every_request_and_what_to_do(tmp_path, capsys):
    step = tmp_path / "s.jsonl"
    step.write_text('{"id": "small", "completion_tokens": 50}\n'
                    '{"id": "whale-1", "completion_tokens": 200000}\n'
                    '{"id": "whale-2", "completion_tokens": 300000}\n')
    code, _, err = _plan(capsys, str(step), *FAST, "--free-gib", "8")
    assert code == 2
    line = _one_error_line(err)
    assert line.startswith("waveplan: error: 2 requests do not fit")   # the count leads
    assert "whale-2, whale-1" in line and "small" not in line            # largest first
    assert "GiB" in line and "bytes" not in line and "[" not in line
    assert "--free-gib" in line and "--tp or --cp" in line and "truncate" in line
    assert line.index("largest needs") < line.index("--free-gib") < line.index("whale-2")


def test_infeasible_error_is_short_on_a_large_step(capsys):
    code, _, err = _plan(capsys, "grpo-32x16", *FAST, "--free-gib", "4")
    line = _one_error_line(err)
    assert code == 2 and len(line) < 400, len(line)
    count = int(line.removeprefix("waveplan: error: ").split()[0])
    assert count > 5 and f"(+{count - 5} more)" in line


@pytest.mark.parametrize("flag", ["--plot", "--report"])
def test_output_into_a_missing_folder_exits_2_before_planning(tmp_path, capsys, monkeypatch, flag):
    monkeypatch.setattr("waveplan.planner.cmd_plan.Planner.plan",
                        lambda *a, **k: pytest.fail("planned before checking the output"))
    code, _, err = _plan(capsys, *FAST, flag, str(tmp_path / "missing" / "out"))
    assert code == 2
    assert "does not exist" in _one_error_line(err)


def test_study_plot_without_matplotlib_exits_2_before_the_study(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # find_spec -> None: not installed
    monkeypatch.setattr(cmd_study, "run_study", lambda *a, **k: pytest.fail("the study ran"))
    code = main(["study", "--generate", "sft", "--count", "1", "--requests", "4", "--free-gib", "20",
                 "--plot", str(tmp_path / "s.png")])
    assert code == 2
    assert "matplotlib" in _one_error_line(capsys.readouterr().err)


def test_empty_completion_is_its_prompt(tmp_path, capsys):
    path = tmp_path / "s.jsonl"
    path.write_text('{"id": "a", "prompt": "p", "prompt_tokens": 100, "completion_tokens": 20}\n'
                    '{"id": "aborted", "prompt": "p", "prompt_tokens": 100, "completion_tokens": 0}\n')
    step = load_step(path)
    aborted = step.requests[1]
    assert aborted.num_tokens == 100 and aborted.prompt is None
    code, out, _ = _plan(capsys, str(path), *FAST)
    assert code == 0 and "1 wave;" in out    # singular


def test_empty_completion_without_a_prompt_is_refused(tmp_path, capsys):
    path = tmp_path / "s.jsonl"
    path.write_text('{"id": "a", "completion_tokens": 0}\n')
    code, _, err = _plan(capsys, str(path), *FAST)
    assert code == 2 and "completion_tokens=0" in _one_error_line(err)


def test_price_takes_bundled_names_and_stdin(capsys, monkeypatch):
    assert main(["price", "sft-64", "--model", "qwen3-8b", "--json"]) == 0
    bundled = json.loads(capsys.readouterr().out)
    from waveplan.pricing.step import bundled_step

    monkeypatch.setattr(sys, "stdin", io.StringIO(bundled_step("sft-64").read_text()))
    assert main(["price", "-", "--model", "qwen3-8b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == bundled


def test_plan_reads_stdin_and_names_it_in_errors(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"id": "a", "completion_tokens": 300}\n{oops\n'))
    code, _, err = _plan(capsys, "-", *FAST)
    assert code == 2 and "<stdin>:2" in _one_error_line(err)


def test_trace_reads_stdin_and_names_it_in_errors(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"id": "a", "completion_tokens": 300}\n{oops\n'))
    assert main(["trace", "-", "--model", "qwen3-8b"]) == 2
    assert "<stdin>:2" in _one_error_line(capsys.readouterr().err)


def test_ep_on_a_dense_model_is_an_error(capsys):
    code, _, err = _plan(capsys, *FAST, "--ep", "2")
    assert code == 2
    line = _one_error_line(err)
    assert "--ep=2" in line and "dense" in line


def test_num_waves_is_not_reported_as_a_failure(capsys):
    code, out, _ = _plan(capsys, "sft-64", *FAST, "--num-waves", "6")
    assert code == 0
    assert "6 waves as asked (--num-waves)" in out and "proven optimal" not in out


def test_bare_waveplan_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "usage: waveplan" in captured.err and "plan" in captured.err


def test_replay_prints_a_summary_and_at_most_20_differences(tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["plan", "sft-64", *FAST, "--free-gib", "10", "--report", str(report)]) == 0
    capsys.readouterr()
    data = json.loads(report.read_text())
    data["model"]["coefficients"]["terms"]["boundary"]["per_row"]["H"] = 4
    report.write_text(json.dumps(data))
    assert main(["replay", str(report)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert "differences (first 20 shown):" in err[0] and "waves" in err[0]
    assert len(err) == 21 and all(line.startswith("  ") for line in err[1:])


def test_verbose_logs(capsys, caplog):
    with caplog.at_level(logging.INFO, logger="waveplan"):
        assert main(["-v", "plan", "sft-64", *FAST]) == 0
    assert any(r.name == "waveplan.plan" and "64 requests" in r.getMessage() for r in caplog.records)


def test_table_has_a_legend(capsys):
    code, out, _ = _plan(capsys, "sft-64", *FAST)
    lines = out.splitlines()
    legend = lines[lines.index(next(x for x in lines if x.startswith("wave  "))):]
    text = "\n".join(legend)
    assert code == 0 and len(legend) > 4 and all(len(x) <= 100 for x in legend)
    for word in ("binding", "first:S", "lower bound", "proven optimal", "conservative"):
        assert word in text, word


def test_table_shows_each_waves_requests(capsys):
    code, out, _ = _plan(capsys, "sft-64", *FAST, "--free-gib", "20")
    rows = [x for x in out.splitlines() if x[:4].strip().isdigit()]
    held = []
    for row in rows:
        for part in row.rsplit("holds #", 1)[1].split(","):
            lo, _, hi = part.partition("-")
            held.extend(range(int(lo), int(hi or lo) + 1))
    assert code == 0 and len(rows) > 1 and sorted(held) == list(range(64))


def test_verbose_after_the_subcommand(capsys, caplog):
    with caplog.at_level(logging.INFO, logger="waveplan"):
        assert main(["plan", "sft-64", *FAST, "-v"]) == 0
    assert any(r.name == "waveplan.plan" and "64 requests" in r.getMessage() for r in caplog.records)


def test_no_model_says_which_it_priced(capsys):
    code, out, err = _plan(capsys, "sft-64", "--packer", "greedy")
    assert code == 0 and "no --model given" in err and "qwen3.8-27b" in err
    assert out.startswith("model qwen3.8-27b")
    code, _, err = _plan(capsys, "sft-64", "--packer", "greedy", "--free-gib", "0.5")
    line = _one_error_line(err)
    assert code == 2 and line.endswith("(no --model given: priced the default qwen3.8-27b)")


def test_help_lists_presets_and_bundled_steps():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    text = " ".join(sub.choices["plan"].format_help().split())
    assert "qwen3-8b" in text and "llama-3.1-8b" in text and "grpo-8x8" in text
    assert "cmd_" not in parser.format_help() and "%%" not in sub.choices["calibrate"].format_help()


def test_mistyped_bundled_step_lists_the_bundled_names(capsys):
    code, _, err = _plan(capsys, "grpo-8x9", *FAST)
    line = _one_error_line(err)
    assert code == 2 and "grpo-8x9" in line and "grpo-8x8" in line and "sft-64" in line


def test_load_step_accepts_bundled_names():
    assert load_step("grpo-8x8").num_requests == 64


def test_line_progress_without_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)          # import tqdm -> ImportError
    bar = progress_bar(3, "study", unit="plan")
    assert isinstance(bar, LineProgress)
    stream = io.StringIO()
    with LineProgress(3, "study", unit="plan", stream=stream, min_interval_s=0.0) as line:
        for _ in range(3):
            line.update()
        assert "study 3/3 100% plans" in stream.getvalue()
    assert stream.getvalue().endswith("\r")                # cleared on close
    assert progress_bar(3, "study", enabled=False) is None


def test_a_conservative_plan_names_its_reasons_once_under_the_waves(capsys):
    """Each wave's row points to a note; the reasons are printed once, under the waves."""
    # flash on a MoE family: no held-out MoE flash set, so every wave is conservative
    code, out, _ = _plan(capsys, "grpo-8x8", "--model", "qwen3-30b-a3b", "--packer", "greedy",
                         "--framework", "fsdp", "--free-gib", "40")
    lines = out.splitlines()
    rows = [x for x in lines if x[:4].strip().isdigit()]
    notes = [x for x in lines if x.startswith("[1] conservative: ")]
    assert code == 0 and len(rows) > 1 and all("(conservative [1])" in r for r in rows)
    assert len(notes) == 1 and "flash_attention_2" in notes[0]
    assert not any(x.startswith("[2] ") for x in lines)
