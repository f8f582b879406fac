"""The fsdp framework: Hugging Face transformers + PEFT LoRA under FSDP2 (pricing/fsdp,
pricing/measure/fsdp_trace.py; docs/memory-model.md#fsdp2-with-hugging-face-transformers)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from waveplan.planner import Planner
from waveplan.planner.cli import main
from waveplan.pricing.errors import ConfigError
from waveplan.pricing.fsdp import FsdpLayout, build_fsdp_model
from waveplan.pricing.fsdp.check import price_record
from waveplan.pricing.fsdp.model import for_step, unshared_step
from waveplan.pricing.model_source import load_model
from waveplan.pricing.step import Step, bundled_step, load_step
from waveplan.pricing.wave_pricer import WavePricer

TRACES = Path(__file__).resolve().parents[2] / "bench" / "results" / "fsdp_traces.jsonl"
SMALL = dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
             tie_word_embeddings=False)


def test_recorded_traces_never_under():
    """Every committed CPU trace (bench/fsdp_validation.py) is priced at or above its peak."""
    records = [json.loads(line) for line in TRACES.read_text().splitlines()]
    assert records
    for rec in records:
        assert price_record(rec).raw_bytes >= rec["peak_bytes"], rec["class"]


def test_unshared_step_runs_every_prompt_in_full():
    step = load_step(bundled_step("grpo-8x8"))
    flat = unshared_step(step)
    assert [r.id for r in flat.requests] == [r.id for r in step.requests]
    model = build_fsdp_model(load_model("qwen3-8b"), fsdp=8)
    pricer = WavePricer.build(flat, model)
    loads = pricer.group_loads([np.arange(len(flat.requests))])
    assert sum(g.padded_rows for g in loads) == sum(r.num_tokens for r in step.requests)


def test_price_grows_with_rows_and_never_with_shards():
    g = load_model("qwen3-8b")
    step = Step.from_lengths([0, 0], [4096, 2048])
    prices = {}
    for n in (2, 8):
        for rows in (1, 2):
            model, s = for_step(build_fsdp_model(g, fsdp=n), Step.from_lengths([0] * rows, [4096] * rows))
            prices[n, rows] = WavePricer.build(s, model).price([np.arange(rows)]).raw_bytes
    assert prices[2, 2] > prices[2, 1] and prices[8, 2] > prices[8, 1]
    assert prices[8, 1] <= prices[2, 1]   # the gathered layers are whole; the gradients shard
    model, s = for_step(build_fsdp_model(g, attn="sdpa", attn_rows=1), step)
    assert model.attn_rows == 6144


def test_planner_from_hf_config_plans_deterministically():
    cfg = dict(SMALL, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
               num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=32000)
    planner = Planner.from_hf_config(cfg, framework="fsdp", fsdp=4, attn="sdpa", recompute="full",
                                     lora_rank=8)
    step = load_step(bundled_step("grpo-8x8"))
    a = planner.plan(step, free_bytes=16 * 2**30, deterministic=True)
    b = planner.plan(step, free_bytes=16 * 2**30, deterministic=True)
    docs = [json.loads(p.to_json()) for p in (a, b)]
    for doc in docs:
        doc.pop("planning_ms")
        doc.pop("compile_ms", None)
        doc.get("stats", {}).pop("jit_ms", None)
    assert json.dumps(docs[0], sort_keys=True) == json.dumps(docs[1], sort_keys=True)
    assert all(w.price.admitted_bytes <= 16 * 2**30 for w in a.waves)
    assert len(a.waves) > 1


@pytest.mark.parametrize("argv, field", [
    (["--fsdp", "8", "--ulysses", "3"], "num_attention_heads"),
    (["--tp", "2"], "--tp"),
    (["--recompute", "selective"], "--recompute"),
])
def test_cli_refuses_what_fsdp_does_not_price(argv, field, capsys):
    code = main(["price", "grpo-8x8", "--model", "qwen3-8b", "--framework", "fsdp", *argv])
    assert code == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err


def test_cli_plan_and_price_json(capsys):
    assert main(["plan", "grpo-8x8", "--model", "qwen3-8b", "--framework", "fsdp",
                 "--free-gib", "40", "--deterministic"]) == 0
    out = capsys.readouterr().out
    assert "waves" in out
    assert main(["price", "grpo-8x8", "--model", "qwen3-8b", "--framework", "fsdp", "--fsdp", "8",
                 "--attn", "eager", "--recompute", "none", "--lora-rank", "8",
                 "--backend", "torch-cpu", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["terms"]["gathered_parameters"] > 0 and doc["basis"] == "evidence"


def test_layout_validation():
    with pytest.raises(ConfigError, match="attn"):
        FsdpLayout(attn="flash3")
    with pytest.raises(ConfigError, match="fsdp"):
        FsdpLayout(fsdp=0)
    with pytest.raises(ConfigError, match="attn_rows"):
        build_fsdp_model(load_model("qwen3-8b"), attn="eager")


def test_live_trace_is_never_above_the_price():
    """A real 2-rank gloo FSDP2 run of a small Llama with PEFT LoRA and checkpointing."""
    from waveplan.pricing.measure.fsdp_trace import trace_fsdp

    trace = trace_fsdp(SMALL, jobs=[(96, 64)], fsdp=2, attn="sdpa", checkpointing=True,
                       lora_rank=4)[0]
    assert len(trace.peaks) == 2 and trace.peak_bytes > 0
    priced = price_record(trace.to_dict()).raw_bytes
    assert priced >= trace.peak_bytes


def test_live_packed_sdpa_trace_without_checkpointing_holds_its_masks_and_is_priced_above():
    """Without checkpointing a packed row of two sequences runs transformers' block-causal mask:
    the tracer calls the model without a KV cache (with one, `create_causal_mask` skips its
    packed-sequence detection and sdpa runs no mask), every layer keeps the kernel's bf16 copy
    of the mask, and the price (the repeated key and value kept, the bool mask at the forward
    only) stays above the peak (docs/memory-model.md#fsdp-attention)."""
    from waveplan.pricing.measure.fsdp_trace import trace_fsdp

    packed, single = trace_fsdp(SMALL, jobs=[(96, 64), (160,)], fsdp=1, attn="sdpa",
                                checkpointing=False, lora_rank=4)
    rows, layers = 160, SMALL["num_hidden_layers"]
    # the same rows; the packed one adds at least every layer's kept bf16 mask (2 S^2 each)
    assert packed.peak_bytes - single.peak_bytes >= 2 * rows * rows * layers
    for trace in (packed, single):
        assert price_record(trace.to_dict()).raw_bytes >= trace.peak_bytes


def test_live_padded_rows_are_traced_and_priced_above():
    """veRL's `use_remove_padding=False`: the wave as [B, longest] rows with an attention mask
    (`padded_inputs`), priced with every sequence at the step's longest
    (docs/memory-model.md#fsdp-verl-options)."""
    from waveplan.pricing.measure.fsdp_trace import padded_inputs, trace_fsdp

    ids, mask, pos, labels = padded_inputs([5, 3], 512, "cpu")
    assert ids.shape == mask.shape == pos.shape == (2, 5) and mask.sum() == 8
    assert pos[1].tolist() == [0, 1, 2, 0, 0] and labels[1, 3:].tolist() == [-100, -100]
    trace = trace_fsdp(SMALL, jobs=[(120, 40)], fsdp=1, attn="sdpa", checkpointing=False,
                       lora_rank=4, remove_padding=False)[0]
    record = trace.to_dict()
    assert record["remove_padding"] is False and trace.peak_bytes > 0
    assert price_record(record).raw_bytes >= trace.peak_bytes


def test_report_replays_the_fsdp_plan(tmp_path, capsys):
    """A report of an fsdp plan rebuilds the same model (framework, layout, family) on replay."""
    path = tmp_path / "report.json"
    assert main(["plan", "grpo-8x8", "--model", "qwen3-8b", "--framework", "fsdp", "--fsdp", "8",
                 "--attn", "sdpa", "--free-gib", "40", "--deterministic", "--report", str(path)]) == 0
    capsys.readouterr()
    assert main(["replay", str(path)]) == 0
    assert "replay identical" in capsys.readouterr().out


def test_the_fast_admitted_path_charges_the_gathered_parameters_of_a_no_grad_wave():
    """The search's fast path prices every wave as `price` does: a wave of no-grad requests
    still holds the gathered parameters (`Charges.resident`), not only the first execution's
    allowance of a gradient wave."""
    from waveplan.pricing.step import Request

    planner = Planner.from_preset("qwen3-8b", framework="fsdp", fsdp=8)
    step = Step.from_requests([Request(id=f"r{i}", num_tokens=500 + 100 * i, grad=i % 2 == 0)
                               for i in range(6)])
    pricer = WavePricer(step=step, model=planner.model)
    assert planner.model.charges.resident > 0
    for idx in ([1, 3, 5], [0, 1], [2]):
        children = [np.array(idx)]
        assert pricer.admitted(children) == pricer.price(children).admitted_bytes, idx
