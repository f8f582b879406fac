"""Misses (waveplan.planner.misses): `Planner.observe` returns an observation; a peak above a
wave's estimate is warned about once per signature and kind and appended, one whole JSON line
each, to the misses file; `waveplan misses` reads the file back, re-prices every record to
the estimate it recorded (profiles and the earlier waves' RoPE cache entries included) and
names each bad record in one line. In-process through `main([...])`."""

from __future__ import annotations

import json
import logging
import threading

import numpy as np
import pytest

from waveplan.planner import Planner
from waveplan.planner.cli import main
from waveplan.planner.misses import (
    MissKind,
    miss_kind,
    misses,
    observe_waves,
    read_misses,
    reprice,
)
from waveplan.pricing.atomic_io import append_line_atomic
from waveplan.pricing.errors import ConfigError
from waveplan.pricing.step import Step

GIB = 2**30
LENGTHS = [1000, 2000, 3000, 4000, 500, 600, 700, 800]


@pytest.fixture(scope="module")
def step():
    return Step.from_lengths(np.zeros(len(LENGTHS), np.int64), np.array(LENGTHS))


def _plan(planner, step, gib=12):
    return planner.plan(step, gib * GIB, deterministic=True)


def _warnings(caplog):
    return [r for r in caplog.records if r.name == "waveplan" and r.levelno == logging.WARNING]


def _lines(path):
    return path.read_text().splitlines()


def test_peak_at_or_below_the_estimate_records_nothing(step, tmp_path, caplog):
    planner = Planner.from_preset("qwen3-8b", misses_path=tmp_path / "m.jsonl")
    wave = _plan(planner, step).waves[0]
    with caplog.at_level(logging.WARNING, logger="waveplan"):
        for peak in (wave.raw_bytes // 2, wave.raw_bytes):
            obs = planner.observe(wave, peak_bytes=peak)
            assert obs.kind is MissKind.NONE and not obs.is_miss and obs.record is None
            assert (obs.raw_bytes, obs.admitted_bytes, obs.peak_bytes) == (wave.raw_bytes, wave.admitted_bytes, peak)
            assert obs.wave == 0 and obs.binding == wave.breakdown.binding and obs.basis == "evidence"
    assert not (tmp_path / "m.jsonl").exists()
    assert _warnings(caplog) == []
    assert sum(p.count for p in planner.profiles) == 2   # still learned from


def test_miss_kinds():
    assert miss_kind(100, 100, 110) is MissKind.NONE
    assert miss_kind(101, 100, 110) is MissKind.OVER_RAW
    assert miss_kind(110, 100, 110) is MissKind.OVER_RAW
    assert miss_kind(111, 100, 110) is MissKind.OVER_ADMITTED


def test_over_admitted_warns_once_and_cli_reprices_to_the_recorded_estimate(step, tmp_path, caplog, capsys):
    planner = Planner.from_preset("qwen3-8b", profiles_path=tmp_path / "profiles.json")
    path = tmp_path / "profiles.misses.jsonl"
    assert planner.misses_path == path   # beside the profiles file by default
    plan = _plan(planner, step)
    wave = plan.waves[0]
    peak = int(wave.admitted_bytes * 1.2)
    with caplog.at_level(logging.WARNING, logger="waveplan"):
        obs = planner.observe(wave, peak_bytes=[peak // 2, peak])   # one per rank: the largest binds
        again = planner.observe(wave, peak_bytes=peak + 1)          # same signature and kind: no warning
    assert obs.kind is MissKind.OVER_ADMITTED and obs.record == path and obs.peak_bytes == peak
    assert obs.ratio == pytest.approx(peak / wave.raw_bytes)
    assert again.kind is MissKind.OVER_ADMITTED
    (warning,) = _warnings(caplog)
    text = warning.getMessage()
    for part in ("wave 0", f"{obs.ratio:.4f}x", wave.breakdown.binding, "basis evidence", str(path),
                 "qwen3-8b TP1 full recompute [default:grad]", "safety margin was not enough"):
        assert part in text, part
    lines = _lines(path)
    assert len(lines) == 2
    record = json.loads(lines[0])
    assert record["miss"] == "over_admitted" and record["peak_bytes"] == peak
    assert record["estimate"]["raw_bytes"] == wave.raw_bytes and record["wave"]["requests"] == list(wave.request_ids)
    assert record["model"]["geometry"]["name"] == "qwen3-8b" and record["coefficients"]["shipped"] is True
    assert {"waveplan", "torch", "framework"} <= set(record["versions"])
    # read back: re-priced with today's model to the very estimate recorded
    assert main(["misses", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["misses"] == 2 and out["by_kind"] == {"over_admitted": 2} and out["bad"] == []
    assert out["by_basis"] == {"evidence": 2}
    assert out["by_class"] == {"qwen3-8b TP1 full recompute [default:grad]": 2}
    assert [e["line"] for e in out["worst"]] == [2, 1]   # worst ratio first
    for e in out["records"]:
        assert e["today"]["same_estimate"] and e["today"]["same_table"]
        assert e["today"]["raw_bytes"] == wave.raw_bytes and e["today"]["kind"] == "over_admitted"
    assert main(["misses", str(path)]) == 0
    text = capsys.readouterr().out
    assert "2 misses (2 over_admitted, 0 over_raw)" in text and "2 of 2 the same estimate" in text
    assert "today's shipped te-gpu" in text


def test_over_raw_is_its_own_kind_and_warns_once(step, tmp_path, caplog):
    planner = Planner.from_preset("qwen3-8b", misses_path=tmp_path / "m.jsonl")
    plan = _plan(planner, step)
    wave = plan.waves[0]
    inside = (wave.raw_bytes + wave.admitted_bytes) // 2
    with caplog.at_level(logging.WARNING, logger="waveplan"):
        kinds = [planner.observe(wave, peak_bytes=inside).kind,
                 planner.observe(wave, peak_bytes=inside).kind,
                 planner.observe(wave, peak_bytes=wave.admitted_bytes + 1).kind]
    assert kinds == [MissKind.OVER_RAW, MissKind.OVER_RAW, MissKind.OVER_ADMITTED]
    messages = [r.getMessage() for r in _warnings(caplog)]
    assert len(messages) == 2   # once per signature and kind
    assert "the safety margin absorbed it" in messages[0] and "was not enough" in messages[1]
    assert len(_lines(tmp_path / "m.jsonl")) == 3


def test_profiled_and_rope_cache_waves_reprice_to_the_recorded_estimate(tmp_path):
    # CP2: the waves after the first carry the earlier waves' RoPE cache entries; the second
    # plan is priced through the profiles the first plan's misses taught
    lengths = np.array(LENGTHS * 3)
    step = Step.from_lengths(np.zeros(lengths.size, np.int64), lengths)
    planner = Planner.from_preset("qwen3-8b", cp=2, misses_path=tmp_path / "m.jsonl")
    first = planner.plan(step, 6 * GIB, deterministic=True)
    assert first.num_waves > 1 and any(w.breakdown.terms.get("rope_cache_earlier_waves") for w in first.waves)
    for w in first.waves:
        assert planner.observe(w, peak_bytes=int(w.admitted_bytes * 1.05)).kind is MissKind.OVER_ADMITTED
    second = planner.plan(step, 6 * GIB, deterministic=True)
    assert {w.breakdown.basis for w in second.waves} == {"profile"}
    for w in second.waves:
        assert planner.observe(w, peak_bytes=w.raw_bytes + 2**20).kind is MissKind.OVER_RAW
    records, bad = read_misses(tmp_path / "m.jsonl")
    assert bad == [] and len(records) == first.num_waves + second.num_waves
    assert sum(r.data["profile"] is not None for r in records) == second.num_waves
    for r in records:
        today = reprice(r)
        assert today.same_estimate(r), r.line
        assert today.kind is r.kind


def test_without_a_path_a_miss_is_warned_not_recorded(step, tmp_path, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    planner = Planner.from_preset("qwen3-8b")
    wave = _plan(planner, step).waves[0]
    with caplog.at_level(logging.WARNING, logger="waveplan"):
        obs = planner.observe(wave, peak_bytes=2 * wave.admitted_bytes)
    assert planner.misses_path is None and obs.is_miss and obs.record is None
    (warning,) = _warnings(caplog)
    assert "not recorded: the planner has no misses_path" in warning.getMessage()
    assert list(tmp_path.iterdir()) == []


def test_a_record_that_cannot_be_written_is_warned_and_training_goes_on(step, tmp_path, caplog):
    planner = Planner.from_preset("qwen3-8b", misses_path=tmp_path / "missing" / "m.jsonl")
    wave = _plan(planner, step).waves[0]
    with caplog.at_level(logging.WARNING, logger="waveplan"):
        obs = planner.observe(wave, peak_bytes=2 * wave.admitted_bytes)
        planner.observe(wave, peak_bytes=2 * wave.admitted_bytes)
    assert obs.kind is MissKind.OVER_ADMITTED and obs.record is None
    assert len(_warnings(caplog)) == 2 and all("could not append it" in r.getMessage() for r in _warnings(caplog))


def test_observe_waves_skips_unmeasured_peaks_and_checks_the_count(step, tmp_path):
    planner = Planner.from_preset("qwen3-8b", misses_path=tmp_path / "m.jsonl")
    plan = _plan(planner, step, gib=6)
    assert plan.num_waves >= 2
    peaks = [None] * plan.num_waves
    peaks[1] = 3 * plan.waves[1].admitted_bytes
    obs = observe_waves(planner, plan.waves, peaks)
    assert obs[0] is None and obs[1].kind is MissKind.OVER_ADMITTED
    assert misses(obs) == (obs[1],)
    with pytest.raises(ConfigError, match=r"peaks='<1 values>': needs one peak per wave"):
        observe_waves(planner, plan.waves, [1])


def test_appends_stay_whole_lines(tmp_path):
    path = tmp_path / "lines.jsonl"
    path.write_text('{"cut": "by a killed wri')   # a writer died mid-line
    threads = [threading.Thread(target=lambda k=k: [append_line_atomic(path, json.dumps({"t": k, "i": i, "pad": "x" * 5000}))
                                                    for i in range(40)]) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = _lines(path)
    assert lines[0] == '{"cut": "by a killed wri' and len(lines) == 1 + 160
    got = sorted((d["t"], d["i"]) for d in map(json.loads, lines[1:]))
    assert got == [(k, i) for k in range(4) for i in range(40)]
    with pytest.raises(ValueError, match="must not contain a newline"):
        append_line_atomic(path, "a\nb")


def _bad_file(planner, step, tmp_path):
    """A misses file with one good record and one of each kind of bad one."""
    path = tmp_path / "m.jsonl"
    planner._misses.path = path   # noqa: SLF001 (a second file for this planner's records)
    wave = _plan(planner, step).waves[0]
    planner.observe(wave, peak_bytes=2 * wave.admitted_bytes)
    good = _lines(path)[0]
    record = json.loads(good)
    wrong_schema = dict(record, schema=99)
    unknown_model = dict(record, model=dict(record["model"], geometry={"name": "no-such-model"}))
    bad_slot = dict(record, first_slots=["nope"])
    path.write_text("\n".join([good, good[: len(good) // 2], json.dumps(wrong_schema), "[1, 2]",
                               json.dumps(unknown_model), json.dumps(bad_slot), ""]) + "\n")
    return path


def test_bad_records_get_one_line_each_and_exit_2(step, tmp_path, capsys):
    planner = Planner.from_preset("qwen3-8b", misses_path=tmp_path / "unused.jsonl")
    path = _bad_file(planner, step, tmp_path)
    assert main(["misses", str(path)]) == 2
    captured = capsys.readouterr()
    assert "1 miss (1 over_admitted, 0 over_raw)" in captured.out   # the good record still summarised
    errors = captured.err.strip().splitlines()
    assert len(errors) == 5 and all(e.startswith(f"waveplan: error: {path} line ") for e in errors)
    assert "line 2: not valid JSON (truncated or corrupt?)" in errors[0]
    assert "line 3: schema=99: this waveplan reads miss schema 1 only" in errors[1]
    assert "line 4: record='list': must be a JSON object" in errors[2]
    assert "line 5: model: model.hidden=None: missing field" in errors[3]
    assert "line 6: slot='nope': no such LoRA slot" in errors[4]
    assert "Traceback" not in captured.err


def test_cli_errors(tmp_path, capsys, step):
    assert main(["misses", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "misses=" in err[0] and "cannot read" in err[0]
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["misses", str(tmp_path / "empty.jsonl")]) == 0
    assert "0 misses" in capsys.readouterr().out
    assert main(["misses", str(tmp_path / "empty.jsonl"), "--backend", "no-such"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "backend='no-such': unknown backend" in err[0]


def test_reprice_with_another_table_says_so(step, tmp_path, capsys):
    planner = Planner.from_preset("qwen3-8b", misses_path=tmp_path / "m.jsonl")
    wave = _plan(planner, step).waves[0]
    planner.observe(wave, peak_bytes=2 * wave.admitted_bytes)
    assert main(["misses", str(tmp_path / "m.jsonl"), "--backend", "torch-cpu", "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["records"]
    assert entry["today"]["coefficients"] == "torch-cpu" and not entry["today"]["same_table"]
    assert not entry["today"]["same_estimate"] and entry["today"]["raw_bytes"] != wave.raw_bytes
