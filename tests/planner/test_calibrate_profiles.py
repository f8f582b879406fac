"""`waveplan calibrate --profiles`: fit a table to the peaks a training run observed.

* the fit covers every observed peak, never lowers a group below the least uniform factor,
  keeps groups no observation depends on at the base, and raises the table when the base
  under-priced;
* profiles learned with another model are refused with one line (re-pricing check), and
  profiles of another configuration are skipped;
* end to end on the CPU: a small real Megatron-core GPT with LoRA trained through the
  Megatron driver observes its waves' peaks, `calibrate --profiles` fits a table from the
  saved profiles, and `plan --coefficients` plans with it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from waveplan.planner import Planner
from waveplan.planner import profile_fit as pf
from waveplan.planner.cli import main
from waveplan.planner.profiles import ProfileStore
from waveplan.pricing.coefficients import load_table
from waveplan.pricing.errors import ConfigError

STEP = "pricing/data/steps/grpo-8x8.jsonl"
GIB = 2**30


def _observed(planner: Planner, ratios) -> Planner:
    plan = planner.plan(STEP, 20 * GIB, deterministic=True)
    for k, wave in enumerate(plan.waves):
        planner.observe(wave, peak_bytes=int(wave.static_raw_bytes * ratios[k % len(ratios)]))
    return planner


@pytest.fixture(scope="module")
def tight():
    """qwen3-8b TP1: every wave observed at 88-93% of its static price."""
    return _observed(Planner.from_preset("qwen3-8b"), (0.88, 0.93, 0.9))


def test_fit_covers_every_peak_and_tightens_only_what_binds(tight):
    fit = pf.fit_profiles(tight.profiles, tight.model, backend="mine")
    assert fit.table.backend == "mine" and len(fit.cells) >= 3
    assert min(fit.ratios) >= 1 + pf.MARGIN and max(fit.ratios) < 1.10
    assert fit.uniform < 1.0
    for group, s in fit.scales.items():   # never below the uniform factor, never above the base
        assert fit.uniform - 1e-9 <= s <= 1.0, group
    # qwen3-8b has no GDN and no experts: those groups have no evidence and stay at the base
    for group in ("gdn_stage", "gdn_state", "moe_stage", "retained_gdn", "retained_moe"):
        assert fit.scales[group] == 1.0
    # the written table, loaded back, prices every observed wave above its peak
    model = tight.model.__class__(geometry=tight.model.geometry, parallel=tight.model.parallel,
                                  recompute=tight.model.recompute, lora=tight.model.lora,
                                  table=fit.table, head=tight.model.head)
    for cell in fit.cells:
        assert pf._price(model, cell) >= cell.peak_bytes


def test_fit_raises_a_base_that_under_priced():
    planner = _observed(Planner.from_preset("qwen3-8b"), (1.2, 1.1))
    fit = pf.fit_profiles(planner.profiles, planner.model, backend="raised")
    assert fit.uniform > 1.1 and min(fit.ratios) >= 1 + pf.MARGIN
    assert all(s >= 1.0 for s in fit.scales.values())   # nothing goes below the base
    assert fit.scales["moe_stage"] == pytest.approx(fit.uniform)   # no evidence: raised with the rest


def test_fit_is_deterministic(tight):
    a = pf.fit_profiles(tight.profiles, tight.model, backend="x")
    b = pf.fit_profiles(ProfileStore.from_dict(tight.profiles.to_dict()), tight.model, backend="x")
    assert a.scales == b.scales and a.table.terms == b.table.terms


def test_profiles_of_another_model_are_refused(tight):
    other = Planner.from_preset("qwen3-8b", lora_rank=16).model   # same key ...
    data = tight.profiles.to_dict()
    data["profiles"][0]["observations"][0]["static_raw_bytes"] += 10**6   # ... another price
    with pytest.raises(ConfigError, match=r"observations\[0\]\.static_raw_bytes.*another model"):
        pf.fit_cells(ProfileStore.from_dict(data), other)
    with pytest.raises(ConfigError, match="none was learned with this configuration"):
        pf.fit_cells(tight.profiles, Planner.from_preset("qwen3-8b", tp=2).model)


def test_cli_calibrate_profiles(tight, tmp_path, capsys):
    profiles = tight.save_profiles(tmp_path / "p.json")
    out = tmp_path / "t.json"
    assert main(["calibrate", "--profiles", str(profiles), "--model", "qwen3-8b",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"wrote {out}:" in text and "held out:" in text and "under 0" in text
    table = load_table(str(out))
    assert table.backend == "te-gpu-profiled"
    assert json.loads(out.read_text())["fit_scales"]["boundary"] < 1.0
    # the table plans: fewer or equal waves than the base on the same step
    assert main(["plan", STEP, "--model", "qwen3-8b", "--free-gib", "20", "--deterministic",
                 "--json"]) == 0
    base = json.loads(capsys.readouterr().out)
    assert main(["plan", STEP, "--model", "qwen3-8b", "--free-gib", "20", "--deterministic",
                 "--coefficients", str(out), "--json"]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert len(fitted["waves"]) <= len(base["waves"])


@pytest.mark.parametrize("argv, field", [
    (["--model", "qwen3-8b"], "traces"),                                 # neither source
    (["--profiles", "missing.json", "--model", "qwen3-8b"], "--profiles"),
    (["--profiles", "{p}"], "--model"),                                  # no model
    (["--profiles", "{p}", "--model", "qwen3-8b", "--tp", "2"], "profiles"),  # other layout
])
def test_cli_calibrate_profiles_bad_input(tight, tmp_path, capsys, argv, field):
    profiles = tight.save_profiles(tmp_path / "p.json")
    argv = [a.replace("{p}", str(profiles)) for a in argv]
    assert main(["calibrate", *argv, "--out", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and field in err and "Traceback" not in err
    assert not (tmp_path / "t.json").exists()


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_megatron_run_profiles_calibrate_then_plan(tmp_path, capsys):
    """A real (tiny) Megatron-core LoRA training run on the CPU observes its waves' peaks (the
    tracer's count); the saved profiles fit a table that covers every one of them."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    import megatron_tiny as tiny

    from waveplan.planner.integrations.megatron import StepData, train_step
    from waveplan.pricing.measure.megatron_shim import init_single_process

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with init_single_process(1):
            model, planner = tiny.build()
            rng = np.random.default_rng(3)
            for _ in range(3):   # three training steps, each planned and observed
                seqs, plens = tiny.grpo(rng)
                data = StepData.from_sequences(seqs, prompt_lengths=plens)
                run = train_step(model, planner, data, 3 * 2**20, tiny.loss_func)
                assert all(p > 0 for p in run.peaks)
    finally:
        torch.set_num_threads(threads)
    observed = sum(p.count for p in planner.profiles)
    assert observed >= 6
    fit = pf.fit_profiles(planner.profiles, planner.model, backend="tiny-profiled")
    assert min(fit.ratios) >= 1 + pf.MARGIN   # every kept observation covered
    for profile in planner.profiles:           # ... and every peak ever observed stays under
        for obs in profile.observations:        # the fitted table's price
            assert any(c.peak_bytes == obs.peak_bytes for c in fit.cells)
