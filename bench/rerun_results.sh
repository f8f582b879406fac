#!/usr/bin/env bash
# Regenerates the search results under bench/results/ (deterministic; ~10 min on 2 cores):
# search quality over 100 seeded steps per size, and the GRPO and SFT packer studies.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
export TORCHDYNAMO_DISABLE=1  # numba caches where waveplan.pricing.jit_cache says
$BIN/python bench/search_quality.py --out bench/results/search_quality.csv
for kind in grpo sft; do
  $BIN/waveplan study --generate "$kind" --count 50 --seed 0 --model qwen3.8-27b --tp 4 --sp \
    --recompute full --free-gib 40 --packers auto,ffd,kk,uniform-width --compare-safety 1.05 \
    --deterministic --no-progress --csv "bench/results/study_${kind}_qwen3.8-27b.csv" \
    --plot "bench/results/study_${kind}_qwen3.8-27b.png" > "bench/results/study_${kind}_qwen3.8-27b.txt"
done
