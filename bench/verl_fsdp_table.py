"""Micro-batches per step under veRL's FSDP engine: veRL's token budget vs waveplan (framework
"fsdp"), on the same batches and the same memory.

The model: Qwen3-8B as Hugging Face transformers runs it with PEFT LoRA (rank 16, all linear)
under FSDP2 over 8 ranks, flash_attention_2 on packed rows, gradient checkpointing
(`Planner.from_hf_config(..., framework="fsdp")`). veRL's side: `verl.utils.seqlen_balancing.
rearrange_micro_batches` with the largest `ppo_max_token_len_per_gpu` under which any micro-batch
of the run's sequence lengths fits the free memory as the step's first micro-batch (priced by the
same model: the budget a careful user would have to set); waveplan's side: the adapter's
`plan_micro_batches` at the same free memory. Writes bench/results/verl_fsdp_table.txt.

    TORCHDYNAMO_DISABLE=1 python bench/verl_fsdp_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict
from verl.utils import seqlen_balancing as vsb

from waveplan.planner import Planner
from waveplan.planner.integrations import verl as adapter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from verl_token_budget import memory_safe_token_budget  # noqa: E402

GIB = 2**30
OUT = Path(__file__).resolve().parent / "results" / "verl_fsdp_table.txt"
# (name, sequences, shortest, longest, free GiB)
BATCHES = [("long", 64, 4096, 8192, 40), ("mixed", 64, 128, 8192, 40), ("short", 256, 128, 1024, 40),
           ("long", 48, 4096, 8192, 24), ("mixed", 96, 128, 8192, 24)]
LO, HI = 128, 8192
# Qwen/Qwen3-8B's config.json (the fields the pricing reads)
QWEN3_8B = dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                tie_word_embeddings=False)


def batch_of(lengths):
    width = max(lengths)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
    return TensorDict({"input_ids": mask.clone(), "attention_mask": mask}, batch_size=len(lengths))


def main() -> None:
    planner = Planner.from_hf_config(QWEN3_8B, framework="fsdp", fsdp=8, lora_rank=16)
    lines = ["# veRL FSDP engine: micro-batches per step, veRL's memory-safe token budget vs waveplan",
             "# Qwen3-8B, PEFT LoRA r16 all-linear, FSDP2 x8, flash_attention_2, gradient checkpointing",
             "batch   n  tokens  free_GiB  token_budget  veRL  waveplan  lower_bound"]
    for seed, (name, n, lo, hi, gib) in enumerate(BATCHES):
        free = gib * GIB
        budget = memory_safe_token_budget(planner, LO, HI, free)
        lengths = [int(x) for x in np.random.default_rng(100 + seed).integers(lo, hi + 1, n)]
        batch = batch_of(lengths)
        _, theirs = vsb.rearrange_micro_batches(batch, max_token_len=budget)
        plan = adapter.plan_micro_batches(batch, planner=planner, free_bytes=free)
        lines.append(f"{name:<6} {n:>3} {sum(lengths):>7} {gib:>9} {budget:>13} {len(theirs):>5} "
                     f"{plan.num_waves:>9} {plan.lower_bound_waves:>12}")
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
