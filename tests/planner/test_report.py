"""Plan reports and replay: identical, drifted, and unreadable reports."""

from __future__ import annotations

import json

import numpy as np
import pytest

from waveplan.planner import Planner, load_step
from waveplan.planner.cli import main
from waveplan.planner.report import (
    PlanOptions,
    build_report,
    diff_plans,
    read_report,
    replay,
    write_report,
)
from waveplan.pricing.errors import ConfigError
from waveplan.pricing.step import Request, Step, bundled_step, materialize_tokens

GIB = 2**30


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A report with a learned profile in it, and its plan."""
    planner = Planner.from_preset("qwen3.8-27b", tp=4, sequence_parallel=True)
    step = load_step(bundled_step("grpo-8x8"))
    first = planner.plan(step, free_bytes=40 * GIB)
    planner.observe(first.waves[0], peak_bytes=0.9 * first.waves[0].static_raw_bytes)
    options = PlanOptions(time_budget_ms=5.0, seed=3)
    plan = planner.plan(step, free_bytes=40 * GIB, **options.kwargs())
    path = tmp_path_factory.mktemp("report") / "report.json"
    write_report(path, planner, step, plan, options)
    return path, plan


def _edited(tmp_path, source, edit) -> str:
    data = json.loads(source.read_text())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


def test_report_has_every_input(written):
    path, plan = written
    data = json.loads(path.read_text())
    assert set(data) == {"schema", "kind", "model", "profiles", "requests", "budget_bytes", "options", "plan"}
    assert data["schema"] == 1 and data["kind"] == "waveplan-report"
    assert data["budget_bytes"] == 40 * GIB
    assert set(data["options"]) >= {"packer", "time_budget_ms", "num_waves", "atomic_units", "seed"}
    assert data["profiles"]["schema"] == 1 and len(data["profiles"]["profiles"]) == 1
    assert data["plan"] == plan.to_dict()
    assert data["model"]["coefficients"]["backend"] == "te-gpu"
    assert any(w["basis"] == "profile" for w in data["plan"]["waves"])


def test_replay_identical(written):
    path, plan = written
    new, differences = replay(path)
    assert differences == []
    timing = {"planning_ms", "compile_ms"}
    assert {k: v for k, v in new.items() if k not in timing} == \
        {k: v for k, v in plan.to_dict().items() if k not in timing}


def test_replay_needs_no_presets(written, monkeypatch):
    import waveplan.planner.planner as planner_module
    import waveplan.pricing.coefficients as coefficients
    import waveplan.pricing.model as model_module
    import waveplan.pricing.presets as presets

    def refuse(*args, **kwargs):
        raise AssertionError("replay read a preset or a shipped coefficient table")

    for module, name in ((presets, "load_preset"), (planner_module, "load_preset"),
                         (coefficients, "load_table"), (model_module, "load_table")):
        monkeypatch.setattr(module, name, refuse)
    assert replay(written[0])[1] == []


def test_replay_reports_a_drifted_coefficient(written, tmp_path):
    def edit(data):
        data["model"]["coefficients"]["terms"]["boundary"]["per_row"]["H"] = 3
    _, differences = replay(_edited(tmp_path, written[0], edit))
    assert differences
    assert any(line.startswith("wave 0: raw_bytes") for line in differences)
    assert any("terms.retained" in line for line in differences)


def test_replay_reports_a_drifted_budget(written, tmp_path):
    def edit(data):
        data["budget_bytes"] = 20 * GIB
    _, differences = replay(_edited(tmp_path, written[0], edit))
    assert any("budget_bytes" in line for line in differences)
    assert any(line.startswith("waves: report has") or "lower_bound_waves" in line for line in differences)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.update(schema=2), "schema=2"),
    (lambda d: d.update(kind="something-else"), "not a waveplan report"),
    (lambda d: d.pop("requests"), "requests: missing field"),
    (lambda d: d["model"].pop("geometry"), "malformed"),
    (lambda d: d["requests"][0].update(completion_tokens="many"), "requests\\[0\\]"),
    (lambda d: d["profiles"].update(schema=9), "profiles.schema"),
])
def test_refused_reports_name_the_problem(written, tmp_path, edit, message):
    path = _edited(tmp_path, written[0], edit)
    before = path.read_text()
    with pytest.raises(ConfigError, match=message):
        read_report(path)
    assert path.read_text() == before


def test_truncated_report_is_a_clear_error(written, tmp_path):
    text = written[0].read_text()
    path = tmp_path / "cut.json"
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ConfigError, match="cut.json.*truncated or corrupt"):
        read_report(path)
    with pytest.raises(ConfigError, match="cannot read"):
        read_report(tmp_path / "missing.json")


def test_diff_names_wave_and_field():
    old = {"packer": "auto", "waves": [{"index": 0, "raw_bytes": 1, "terms": {"a": 1}}]}
    new = {"packer": "greedy", "waves": [{"index": 0, "raw_bytes": 2, "terms": {"a": 2}}, {"index": 1}]}
    lines = diff_plans(old, new)
    assert "packer: report 'auto', replay 'greedy'" in lines
    assert "wave 0: raw_bytes: report 1, replay 2" in lines
    assert "wave 0: terms.a: report 1, replay 2" in lines
    assert "waves: report has 1, replay has 2" in lines


def test_build_report_round_trips_the_model(written):
    loaded = read_report(written[0])
    planner = Planner.from_preset("qwen3.8-27b", tp=4, sequence_parallel=True)
    assert loaded.planner.model.to_dict() == planner.model.to_dict()
    report = build_report(loaded.planner, loaded.step, written[1], loaded.options)
    assert report["requests"] == loaded.step.to_length_form()


def _nested_token_step() -> Step:
    """Token form with nested sharing: a system prompt under every request, three prompts
    under it, completions under each (one pair of duplicates, one completion that is a prefix
    of another), and two requests that share nothing."""
    rng = np.random.default_rng(7)
    system = rng.integers(0, 1000, 600)
    requests = []
    for p in range(3):
        prompt = np.concatenate([system, rng.integers(0, 1000, 900 + 300 * p)])
        tails = [rng.integers(0, 1000, int(k)) for k in rng.integers(500, 4000, 5)]
        tails.append(tails[0])                        # a duplicate
        tails.append(np.concatenate([tails[1], rng.integers(0, 1000, 700)]))  # extends another
        for c, tail in enumerate(tails):
            requests.append(Request.from_tokens(f"p{p}-c{c}", np.concatenate([prompt, tail]),
                                                grad=c != 3))
    requests += [Request.from_tokens(f"solo{k}", rng.integers(1000, 2000, 3000)) for k in range(2)]
    return Step.from_requests(requests)


@pytest.mark.parametrize("form", ["length", "token-materialized", "token-nested"])
def test_report_round_trip_replays_identically(form, tmp_path):
    """Both forms, with shared prefixes: the stored requests rebuild the same step and the
    replay is identical (a token-form report used to store lossy length-form lines)."""
    step = load_step(bundled_step("grpo-8x8"))
    if form == "token-materialized":
        step = materialize_tokens(step)
    elif form == "token-nested":
        step = _nested_token_step()
    planner = Planner.from_preset("qwen3.8-27b", tp=4, sequence_parallel=True)
    options = PlanOptions(seed=1, deterministic=True)
    plan = planner.plan(step, free_bytes=(10 if form == "token-nested" else 30) * GIB, **options.kwargs())
    assert len(plan.waves) >= 2
    path = tmp_path / "report.json"
    write_report(path, planner, step, plan, options)
    data = json.loads(path.read_text())
    assert ("tree_position" in data["requests"][0]) == step.is_token_form
    loaded = read_report(path)
    assert loaded.step.is_token_form == step.is_token_form and loaded.step.ids == step.ids
    for name in ("group_of", "prefix_rows", "own_rows", "rank", "lcp_table", "length_at", "slots", "grads"):
        assert getattr(loaded.step, name).tolist() == getattr(step, name).tolist(), name
    assert replay(path)[1] == []


def test_cli_token_form_report_replays_with_exit_0(tmp_path, capsys):
    """The reported bug: `waveplan plan TOKENS.jsonl --report r.json`, then `waveplan replay`."""
    steps = tmp_path / "tokens.jsonl"
    steps.write_text("".join(json.dumps({"id": r.id, "tokens": r.tokens.tolist(), "grad": r.grad}) + "\n"
                             for r in _nested_token_step().requests))
    report = tmp_path / "r.json"
    assert main(["plan", str(steps), "--free-gib", "10", "--report", str(report)]) == 0
    capsys.readouterr()
    assert main(["replay", str(report)]) == 0
    assert "replay identical" in capsys.readouterr().out
