"""The full-te head: the tracer's allocation model of Transformer Engine's parallel cross entropy
computes the real loss and gradient, keeps no fp32 copy of the logits, and the full-te price is
never under its traced peak."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from waveplan.pricing.lora import LoraConfig, LoraSlot  # noqa: E402
from waveplan.pricing.measure.te_cross_entropy import te_parallel_cross_entropy  # noqa: E402
from waveplan.pricing.measure.trace import trace_wave  # noqa: E402
from waveplan.pricing.model import PricingModel  # noqa: E402
from waveplan.pricing.model_source import load_model  # noqa: E402
from waveplan.pricing.parallel import ParallelLayout, Recompute  # noqa: E402
from waveplan.pricing.step import Request, Step  # noqa: E402
from waveplan.pricing.wave_pricer import WavePricer  # noqa: E402


def test_loss_and_gradient_are_torch_cross_entropy_and_the_gradient_is_in_place():
    gen = torch.Generator().manual_seed(0)
    s, vocab = 50, 333
    x = torch.randn(s, 1, vocab, dtype=torch.float64, generator=gen)
    labels = torch.randint(0, vocab, (s, 1), generator=gen)
    weights = torch.rand(s, 1, dtype=torch.float64, generator=gen)
    ref_in = x.clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(ref_in.view(-1, vocab), labels.view(-1), reduction="none").view(s, 1)
    (ref * weights).sum().backward()
    leaf = x.clone().requires_grad_(True)
    logits = leaf * 1.0
    loss = te_parallel_cross_entropy(logits, labels)
    assert loss.dtype == torch.float32 and loss.shape == (s, 1)   # TE's loss is fp32
    assert torch.allclose(loss.double(), ref, atol=1e-5)
    (loss.double() * weights).sum().backward()
    assert torch.allclose(leaf.grad, ref_in.grad, atol=1e-6)
    # the logits now hold their gradient: TE writes it in place, no second vocabulary-wide tensor
    assert torch.allclose(logits.detach(), ref_in.grad, atol=1e-6)


def _price(geometry, lens, rc, layout) -> int:
    model = PricingModel.build(geometry, parallel=layout, recompute=Recompute(mode=rc),
                               lora=LoraConfig(slots=(LoraSlot(rank=16),), grad_bytes=2),
                               backend="torch-cpu", head="full-te", safety=1.0)
    step = Step.from_requests([Request(id=f"r{i}", num_tokens=n) for i, n in enumerate(lens)])
    return WavePricer.build(step, model, profiled=True).price(
        [np.arange(len(lens))], first_slots=frozenset({"default"})).raw_bytes


@pytest.mark.parametrize("rc", ["full", "none"])
def test_full_te_trace_holds_two_bytes_per_logit_and_is_priced_over_it(rc):
    g = load_model("qwen3-8b")
    g = dataclasses.replace(g, layers=g.layers[:2])
    lens = [512, 256]
    te = trace_wave(g, seq_lens=lens, num_layers=2, device="cpu-fake", recompute=Recompute(mode=rc),
                    head="full-te", decoder_only=True)
    native = trace_wave(g, seq_lens=lens, num_layers=2, device="cpu-fake", recompute=Recompute(mode=rc),
                        decoder_only=False)
    rows = sum(lens)
    # native keeps bf16 logits and an fp32 copy (6 B per logit); TE the bf16 logits only (2 B)
    saved = (native.peak_bytes - te.peak_bytes) / (rows * g.vocab)
    assert 3.5 < saved < 4.5
    assert te.peak_bytes >= 2 * rows * g.vocab
    assert any("full-te head" in n for n in te.notes)
    assert _price(g, lens, rc, ParallelLayout()) >= te.peak_bytes


def test_committed_full_te_cells_are_never_under():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "results" / "traces_full_te.jsonl"
    if not path.exists():
        pytest.skip("bench/results/traces_full_te.jsonl not present")
    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    assert len(records) >= 24
    for rec in records:
        g = load_model(rec["preset"])
        g = dataclasses.replace(g, layers=g.layers[:rec["layers"]])
        assert _price(g, rec["seq_lens"], rec["recompute"], ParallelLayout(**rec["layout"])) >= rec["peak_bytes"]
