"""Prefix-tree building and layout counting on a GRPO step (8 prompts x 8 completions).

The step is token form, about 280,000 tokens, generated with a fixed seed; prompts differ at
their first token and completions at their first token after the prompt. Target: building
the tree (Step.from_requests + layout of all requests) in a median <= 2 ms.
"""

from __future__ import annotations

import numpy as np
import pytest
from make_steps import grpo_lines

from waveplan.pricing.layout import layout
from waveplan.pricing.step import Request, Step, materialize_tokens


@pytest.fixture(scope="module")
def grpo_tokens() -> Step:
    lines = grpo_lines(8, 8, seed=8_8, target_tokens=280_000)
    step = Step.from_requests(
        Request(id=x["id"], prompt=x["prompt"], num_prompt_tokens=x["prompt_tokens"],
                num_tokens=x["prompt_tokens"] + x["completion_tokens"]) for x in lines)
    tokens = materialize_tokens(step, seed=0)
    assert abs(tokens.num_logical_rows - 280_000) < 2_800
    assert len({int(r.tokens[0]) for r in tokens.requests}) == 8  # prompts differ at token 0
    assert layout(tokens, np.arange(64)) == layout(step, np.arange(64))
    return tokens


def test_build_prefix_tree(benchmark, grpo_tokens):
    requests = grpo_tokens.requests
    everything = np.arange(len(requests))

    def build():
        step = Step.from_requests(requests)
        return layout(step, everything)

    counts = benchmark(build)
    assert counts.num_requests == 64 and counts.segments == 72 and counts.num_sequences == 8


def test_layout_of_a_subset(benchmark, grpo_tokens):
    # The search's hot path: counts of one candidate wave (here 24 of the 64 requests).
    subset = np.random.default_rng(0).choice(64, size=24, replace=False)
    counts = benchmark(layout, grpo_tokens, subset)
    assert counts.num_requests == 24


def test_layout_of_all_64(benchmark, grpo_tokens):
    counts = benchmark(layout, grpo_tokens, np.arange(64))
    assert counts.packed_rows < counts.logical_rows
