"""Writes the bundled example steps (pricing/data/steps/*.jsonl), deterministically.

    .venv/bin/python bench/make_steps.py [--out DIR]

Lengths are typical of GRPO: prompts ~256-4096 tokens (log-normal), completions ~64-8192
(log-normal per prompt around a per-prompt median, so long tails cluster as they do when a
prompt is hard). Each file has its own fixed seed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from waveplan.pricing.atomic_io import write_text_atomic

OUT = Path(__file__).resolve().parent.parent / "pricing" / "data" / "steps"


def _lognormal(rng: np.random.Generator, median: float, sigma: float, size, lo: int, hi: int):
    return np.clip(np.rint(median * np.exp(sigma * rng.standard_normal(size))), lo, hi).astype(int)


def grpo_lines(num_prompts: int, num_completions: int, *, seed: int,
               target_tokens: int | None = None) -> list[dict]:
    """Length-form lines of a GRPO step; completions are rescaled (deterministically) so the
    logical total lands near `target_tokens` when given."""
    rng = np.random.default_rng(seed)
    prompts = _lognormal(rng, 1100, 0.6, num_prompts, 256, 4096)
    medians = 1800 * np.exp(0.5 * rng.standard_normal(num_prompts))
    raw = np.exp(0.8 * rng.standard_normal((num_prompts, num_completions))) * medians[:, None]
    scale = 1.0
    for _ in range(20):  # fixed-point on the clipped total
        completions = np.clip(np.rint(raw * scale), 64, 8192).astype(int)
        if target_tokens is None:
            break
        total = int(prompts.sum()) * num_completions + int(completions.sum())
        if abs(total - target_tokens) < 0.002 * target_tokens:
            break
        scale *= (target_tokens - int(prompts.sum()) * num_completions) / int(completions.sum())
    return [{"id": f"g{g}-c{c}", "prompt": f"g{g}", "prompt_tokens": int(prompts[g]),
             "completion_tokens": int(completions[g, c])}
            for g in range(num_prompts) for c in range(num_completions)]


def sft_lines(num_requests: int, *, seed: int) -> list[dict]:
    """Length-form lines of an SFT step: every request has its own prompt (nothing shared)."""
    rng = np.random.default_rng(seed)
    prompts = _lognormal(rng, 600, 0.7, num_requests, 64, 4096)
    completions = _lognormal(rng, 900, 0.9, num_requests, 64, 8192)
    return [{"id": f"s{i}", "prompt": f"p{i}", "prompt_tokens": int(prompts[i]),
             "completion_tokens": int(completions[i])} for i in range(num_requests)]


STEPS = {
    "grpo-8x8": lambda: grpo_lines(8, 8, seed=8_8, target_tokens=280_000),
    "grpo-32x16": lambda: grpo_lines(32, 16, seed=32_16),
    "sft-64": lambda: sft_lines(64, seed=64),
}


def write(out: Path = OUT) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, make in STEPS.items():
        path = out / f"{name}.jsonl"
        write_text_atomic(path, "".join(json.dumps(line) + "\n" for line in make()))
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    for path in write(parser.parse_args().out):
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        total = sum(x.get("prompt_tokens", 0) + x["completion_tokens"] for x in lines)
        print(f"{path}: {len(lines)} requests, {total} logical tokens")


if __name__ == "__main__":
    main()
