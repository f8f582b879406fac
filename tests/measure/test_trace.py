"""Wave traces: fake-tensor peaks equal real CPU peaks; full-size traces are cheap."""

from __future__ import annotations

import json
import warnings

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from waveplan.pricing.errors import ConfigError  # noqa: E402
from waveplan.pricing.geometry import (  # noqa: E402
    AttentionSpec,
    GdnSpec,
    MixerKind,
    MlpKind,
    ModelGeometry,
    MoeSpec,
)
from waveplan.pricing.parallel import Recompute  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

A, G = MixerKind.ATTENTION, MixerKind.GDN
D, M = MlpKind.DENSE, MlpKind.MOE

TINY = ModelGeometry(name="tiny", hidden=256, ffn=768, vocab=1024, layers=((A, D),) * 2,
                     attention=AttentionSpec(4, 2, 64))


def _trace(geometry, **kw):
    from waveplan.pricing.measure.trace import trace_wave

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace_wave(geometry, **kw)


def _close(a: int, b: int, rel: float = 0.01) -> bool:
    return abs(a - b) <= rel * max(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "none"])
def test_fake_and_real_cpu_peaks_agree(mode):
    kw = dict(seq_lens=[200, 312], recompute=Recompute(mode=mode))  # 512 tokens, THD
    fake = _trace(TINY, device="cpu-fake", **kw)
    real = _trace(TINY, device="cpu", **kw)
    for name in ("peak_forward_bytes", "peak_backward_bytes", "peak_bytes",
                 "decoder_peak_forward_bytes", "decoder_peak_backward_bytes"):
        assert _close(getattr(fake, name), getattr(real, name)), name
    assert fake.baseline_bytes == real.baseline_bytes
    assert fake.packed == "thd" and fake.num_layers == 2 and fake.notes == ()
    assert fake.peak_bytes > 0 and fake.decoder_peak_bytes < fake.peak_bytes


def test_recompute_lowers_the_decoder_peak():
    lens = [256, 256]
    full = _trace(TINY, seq_lens=lens, recompute=Recompute(mode="full"))
    none = _trace(TINY, seq_lens=lens, recompute=Recompute(mode="none"))
    assert full.decoder_peak_bytes < none.decoder_peak_bytes


@pytest.mark.slow
def test_moe_fake_and_real_agree():
    geometry = ModelGeometry(name="tiny-moe", hidden=128, ffn=0, vocab=512,
                             layers=((A, M),) * 2, attention=AttentionSpec(4, 2, 32),
                             moe=MoeSpec(num_experts=8, top_k=2, expert_ffn=64,
                                         shared_expert_ffn=64))
    fake = _trace(geometry, seq_lens=[100, 156], device="cpu-fake")
    real = _trace(geometry, seq_lens=[100, 156], device="cpu")
    assert _close(fake.peak_bytes, real.peak_bytes)
    assert _close(fake.decoder_peak_bytes, real.decoder_peak_bytes)
    assert any("balanced router" in n for n in fake.notes)


@pytest.mark.slow
def test_gdn_hybrid_fake_and_real_agree():
    geometry = ModelGeometry(name="tiny-hybrid", hidden=128, ffn=256, vocab=512,
                             layers=((G, D), (A, D)), attention=AttentionSpec(4, 2, 32, True),
                             gdn=GdnSpec(2, 4, 32, 32, 4))
    fake = _trace(geometry, seq_lens=[64, 128], device="cpu-fake")
    real = _trace(geometry, seq_lens=[64, 128], device="cpu")
    assert _close(fake.peak_bytes, real.peak_bytes)
    assert fake.packed == "concatenated"
    assert any("GatedDeltaNet" in n for n in fake.notes)
    with pytest.raises(ConfigError, match="packed"):
        _trace(geometry, seq_lens=[64], packed=True)


def test_full_size_qwen3_8b_layers_trace_on_fake_tensors():
    from waveplan.pricing.presets import load_preset

    geometry = load_preset("qwen3-8b")
    tokens = 2048
    result = _trace(geometry, seq_lens=[1024, 1024], num_layers=2)
    logits = tokens * geometry.vocab * (2 + 4)  # bf16 logits + Megatron's fp32 copy
    assert logits <= result.peak_forward_bytes < logits * 1.2
    assert result.decoder_peak_bytes < result.peak_bytes - logits // 2
    assert result.num_layers == 2 and result.model_layers == 36
    assert any("reduced" in n for n in result.notes)
    # The weights are the baseline, not part of the peak.
    assert result.baseline_bytes > 2 * geometry.vocab * geometry.hidden * 2


def test_bad_arguments_raise_config_errors():
    with pytest.raises(ConfigError, match="device"):
        _trace(TINY, seq_lens=[8], device="tpu")
    with pytest.raises(ConfigError, match="seq_lens"):
        _trace(TINY, seq_lens=[])
    with pytest.raises(ConfigError, match="num_layers"):
        _trace(TINY, seq_lens=[8], num_layers=0)


def test_cli_trace_json(tmp_path, capsys):
    from waveplan.planner.cli import main

    step = tmp_path / "step.jsonl"
    step.write_text('{"id": "a", "completion_tokens": 100}\n'
                    '{"id": "b", "completion_tokens": 60}\n')
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "vocab_size": 1024, "torch_dtype": "bfloat16"}))
    rc = main(["trace", str(step), "--model", str(config), "--layers", "1", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("peak_forward_bytes", "peak_backward_bytes", "peak_bytes", "num_layers",
                "device", "notes"):
        assert key in out
    assert out["num_layers"] == 1 and out["device"] == "cpu-fake" and out["tokens"] == 160


def test_tensor_parallel_shard_traces_with_the_fake_process_group():
    from waveplan.pricing.parallel import ParallelLayout

    one = _trace(TINY, seq_lens=[255, 256])
    tp2 = _trace(TINY, seq_lens=[255, 256], layout=ParallelLayout(tp=2, sequence_parallel=True))
    assert tp2.seq_lens == (256, 256)  # padded to the TP multiple under sequence parallelism
    assert any("padded" in n for n in tp2.notes) and any("TP=2" in n for n in tp2.notes)
    assert tp2.decoder_peak_bytes < one.decoder_peak_bytes
    assert tp2.baseline_bytes < one.baseline_bytes
