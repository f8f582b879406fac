"""Studies: generated and directory step sources, counts, CSV and table, and the CLI."""

from __future__ import annotations

import csv
import json

import pytest

from waveplan.planner.cli import main
from waveplan.planner.study import GeneratorSpec, StudyResult, Variant, run_study, steps_from_dir
from waveplan.pricing.errors import ConfigError, StepError
from waveplan.pricing.model import PricingModel
from waveplan.pricing.model_source import load_model
from waveplan.pricing.parallel import ParallelLayout

GIB = 2**30
FREE = 40 * GIB


@pytest.fixture(scope="module")
def model() -> PricingModel:
    return PricingModel.build(load_model("qwen3.8-27b"),
                              parallel=ParallelLayout(tp=4, sequence_parallel=True))


@pytest.fixture(scope="module")
def small_grpo() -> GeneratorSpec:
    return GeneratorSpec(distribution="grpo", count=3, seed=1, prompts=8, completions=8)


@pytest.fixture(scope="module")
def result(model, small_grpo) -> StudyResult:
    variants = [Variant(name="auto", model=model, packer="auto"),
                Variant(name="ffd", model=model, packer="ffd")]
    return run_study(small_grpo, variants, budget_bytes=FREE, time_budget_ms=2.0, progress=False)


def test_generator_is_seeded_and_shaped(small_grpo):
    first = list(small_grpo)
    again = list(GeneratorSpec(distribution="grpo", count=3, seed=1, prompts=8, completions=8))
    assert [n for n, _ in first] == [n for n, _ in again]
    assert all(a.requests == b.requests for (_, a), (_, b) in zip(first, again, strict=True))
    assert all(s.num_requests == 64 and s.num_groups == 8 for _, s in first)
    assert first[0][1].requests != first[1][1].requests
    sft = list(GeneratorSpec(distribution="sft", count=2, seed=0, requests=10))
    assert all(s.num_requests == 10 and s.num_groups == 10 for _, s in sft)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"distribution": "zipf", "count": 2}, "distribution"),
    ({"distribution": "grpo", "count": 0}, "count"),
    ({"distribution": "grpo", "count": 2, "seed": -1}, "seed"),
    ({"distribution": "grpo", "count": 2, "prompts": 0}, "prompts"),
    ({"distribution": "sft", "count": True}, "count"),
])
def test_bad_generator_args_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=rf"^{field}="):
        GeneratorSpec(**kwargs)


def test_counts_are_consistent(result, small_grpo, tmp_path):
    assert result.variants == ("auto", "ffd") and len(result.steps) == 3
    assert len(result.rows) == 3 * 2
    for row in result.rows:
        assert not row.error and row.waves >= row.lower_bound >= 1
        assert row.proven_optimal == (row.waves == row.lower_bound)
        assert row.plan_ms > 0 and row.num_requests == 64
    summary = result.summary("auto")
    assert summary.total_waves == sum(result.waves_of("auto")) and summary.failed == 0
    fewer, more, equal = result.compare("auto", "ffd")
    assert fewer + more + equal == 3
    assert result.compare("ffd", "auto") == (more, fewer, equal)

    path = tmp_path / "study.csv"
    result.to_csv(path)
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == 3 * 2
    assert {r["variant"] for r in rows} == {"auto", "ffd"}
    assert all(int(r["waves"]) >= int(r["lower_bound"]) for r in rows)
    assert [p.name for p in tmp_path.iterdir()] == ["study.csv"]  # no temp file left behind

    table = result.table()
    assert "auto" in table and "ffd" in table
    assert f"auto needs fewer waves than ffd on {fewer} steps, more on {more}" in table
    for row in result.rows:   # per step: waves, bound, settled (meets the bound) or open
        assert row.status == ("settled" if row.waves == row.lower_bound else "open")
        assert f"{row.step}  {row.variant:<7} {row.waves:>6} {row.lower_bound:>6}  {row.status}" \
            in table
    assert [r["status"] for r in rows] == [r.status for r in result.rows]
    assert "settled = the plan meets its lower bound" in table and "open = above the bound" in table


def test_study_from_a_directory(model, tmp_path):
    for i, n in enumerate((3, 5)):
        lines = [{"id": f"r{j}", "prompt": "p", "prompt_tokens": 1000, "completion_tokens": 2000 + 100 * j}
                 for j in range(n)]
        (tmp_path / f"step{i}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "notes.txt").write_text("ignored")
    steps = steps_from_dir(tmp_path)
    assert [name for name, _ in steps] == ["step0", "step1"]
    result = run_study(steps, [Variant(name="greedy", model=model, packer="greedy")],
                       budget_bytes=FREE, time_budget_ms=1.0)
    assert [r.num_requests for r in result.rows] == [3, 5]
    assert all(r.waves >= r.lower_bound for r in result.rows)


def test_bad_study_inputs(model, tmp_path):
    with pytest.raises(StepError, match="^steps="):
        steps_from_dir(tmp_path)  # no step files
    with pytest.raises(ConfigError, match="^packer="):
        Variant(name="x", model=model, packer="best")
    twice = [Variant(name="a", model=model), Variant(name="a", model=model, packer="ffd")]
    with pytest.raises(ConfigError, match="^variants="):
        run_study(GeneratorSpec(distribution="sft", count=1, requests=2), twice, budget_bytes=FREE)
    with pytest.raises(ConfigError, match="^budget_bytes="):
        run_study(GeneratorSpec(distribution="sft", count=1, requests=2), twice[:1], budget_bytes=0)


def test_cli_study(tmp_path, capsys):
    out_csv, out_png = tmp_path / "s.csv", tmp_path / "s.png"
    code = main(["study", "--generate", "sft", "--count", "2", "--requests", "12", "--free-gib", "20",
                 "--packers", "auto,ffd", "--compare-safety", "1.05", "--time-budget-ms", "1",
                 "--csv", str(out_csv), "--plot", str(out_png), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0
    for name in ("auto", "ffd", "auto+safety=1.05"):
        assert name in printed
    assert len(list(csv.DictReader(out_csv.open()))) == 2 * 3
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv", [
    ["--generate", "sft", "--count", "0", "--free-gib", "20"],
    ["--generate", "sft", "--free-gib", "-1"],
    ["--generate", "sft", "--free-gib", "20", "--packers", "auto,best"],
    ["--generate", "sft", "--free-gib", "20", "--compare-safety", "0.9"],
    ["--steps", "/nonexistent/dir", "--free-gib", "20"],
    ["--free-gib", "20"],  # no step source
])
def test_cli_study_bad_input_exits_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        code = main(["study", *argv, "--no-progress"])
        raise SystemExit(code)
    assert exc.value.code == 2
    assert "waveplan: error:" in capsys.readouterr().err
