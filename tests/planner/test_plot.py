"""Plan and study figures: valid PNGs written atomically; clear errors without matplotlib."""

from __future__ import annotations

import builtins

import pytest

from waveplan.planner import plot
from waveplan.planner.study import StudyResult, StudyRow
from waveplan.pricing.errors import ConfigError

pytest.importorskip("matplotlib")

GIB = 2**30
PNG = b"\x89PNG\r\n\x1a\n"


def plan_dict() -> dict:
    def wave(retained, workspace, first=False):
        terms = {"retained": retained * GIB, "workspace": workspace * GIB, "head": 0,
                 "pending_gradients": (0.5 * GIB if first else 0)}
        raw = sum(terms.values())
        return {"terms": terms, "raw_bytes": raw, "admitted_bytes": int(raw * 1.1)}

    return {"budget_bytes": 40 * GIB, "waves": [wave(20, 12, True), wave(18, 11), wave(9, 6)]}


def study_result() -> StudyResult:
    rows = []
    for i, (a, b, bound) in enumerate([(10, 11, 10), (9, 9, 9), (12, 14, 11)]):
        for name, waves in (("auto", a), ("ffd", b)):
            rows.append(StudyRow(step=f"s{i}", variant=name, packer=name, packer_used=name,
                                 num_requests=64, logical_rows=100_000, waves=waves,
                                 lower_bound=bound, proven_optimal=waves == bound, plan_ms=1.0))
    rows.append(StudyRow(step="s3", variant="auto", packer="auto", packer_used="", num_requests=1,
                         logical_rows=1, waves=None, lower_bound=None, proven_optimal=False,
                         plan_ms=0.1, error="does not fit"))
    rows.append(StudyRow(step="s3", variant="ffd", packer="ffd", packer_used="", num_requests=1,
                         logical_rows=1, waves=None, lower_bound=None, proven_optimal=False,
                         plan_ms=0.1, error="does not fit"))
    return StudyResult(steps=("s0", "s1", "s2", "s3"), variants=("auto", "ffd"), rows=tuple(rows),
                       budget_bytes=40 * GIB, time_budget_ms=5.0)


def check_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > 10_000  # a drawn figure, not an empty canvas
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # temp file renamed away


def test_plot_plan_writes_a_png(tmp_path):
    path = tmp_path / "plan.png"
    plot.plot_plan(plan_dict(), path)
    check_png(path)


def test_plot_plan_reads_nested_prices_and_per_wave_budgets(tmp_path):
    plan = plan_dict()
    plan["waves"] = [{"price": w, "budget_bytes": (38 + i) * GIB} for i, w in enumerate(plan.pop("waves"))]
    path = tmp_path / "plan.png"
    plot.plot_plan(plan, path)
    check_png(path)


@pytest.mark.parametrize(("plan", "field"), [
    ({"waves": []}, "plan.waves"),
    ({"waves": [{"admitted_bytes": 1}]}, r"plan.waves\[0\].terms"),
    ({"waves": [{"terms": {"retained": "x"}}]}, r"plan.waves\[0\].terms.retained"),
])
def test_plot_plan_bad_plan_names_the_field(plan, field, tmp_path):
    with pytest.raises(ConfigError, match=f"^{field}="):
        plot.plot_plan(plan, tmp_path / "bad.png")
    assert not list(tmp_path.iterdir())


def test_plot_study_writes_a_png(tmp_path):
    path = tmp_path / "study.png"
    plot.plot_study(study_result(), path)
    check_png(path)
    assert study_result().compare("auto", "ffd") == (2, 0, 1)


def test_missing_matplotlib_is_a_config_error(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ConfigError, match="plot extra"):
        plot.plot_plan(plan_dict(), tmp_path / "plan.png")
