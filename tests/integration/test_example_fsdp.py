"""examples/train_lora_fsdp_cpu.py: a small transformers Llama with PEFT LoRA under FSDP2 on 2
gloo ranks, every step planned by waveplan (framework "fsdp", read from the live model), every
wave run for real with its peak measured: no wave's peak above its admitted price, none above
the budget, both ranks the same wave count per step. No timing asserts; generous timeout for a
cold, busy machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_lora_fsdp_cpu.py"


def test_fsdp_example_runs_every_wave_within_its_price():
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    done = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "1", "--json"],
                          capture_output=True, text=True, timeout=3000, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert rows and {r["rank"] for r in rows} == {0, 1}
    for r in rows:
        assert 0 < r["peak"] <= r["admitted"] <= r["budget"], r
    waves = {rank: sum(1 for r in rows if r["rank"] == rank) for rank in (0, 1)}
    assert waves[0] == waves[1] >= 2
