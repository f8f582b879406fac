"""Plans carry micro-batch index lists (positions in the step), per wave and per child."""

from __future__ import annotations

import json

from waveplan.planner import Planner, load_step
from waveplan.pricing.step import bundled_step

GIB = 2**30


def check_indices(plan, step):
    data = json.loads(plan.to_json())
    seen = []
    for wave, d in zip(plan.waves, data["waves"], strict=True):
        assert list(wave.request_indices) == d["request_indices"] == sorted(d["request_indices"])
        assert [step.ids[j] for j in wave.request_indices] == list(wave.request_ids) == d["requests"]
        assert [[step.ids[j] for j in c] for c in wave.child_indices] == [list(c) for c in wave.child_ids]
        if wave.is_split:
            assert d["child_indices"] == [list(c) for c in wave.child_indices]
            assert [[step.ids[j] for j in c] for c in d["child_indices"]] == d["children"]
        else:
            assert d["child_indices"] == [] and wave.child_indices == (tuple(wave.request_indices),)
        seen += d["request_indices"]
    assert sorted(seen) == list(range(step.num_requests))   # every request exactly once


def test_flat_and_split_waves_carry_their_positions():
    planner = Planner.from_preset("qwen3.8-27b", tp=4, sequence_parallel=True, recompute="full",
                                  lora_rank=16)
    step = load_step(bundled_step("grpo-8x8"))
    check_indices(planner.plan(step, free_bytes=40 * GIB), step)
    split = planner.plan(step, free_bytes=12 * GIB, atomic_units=[list(range(8))])
    assert any(w.is_split for w in split.waves)
    check_indices(split, step)
