"""A tiny Megatron-core GPT with LoRA for the CPU integration tests (and their worker
processes): the model and its planner, Megatron's per-token loss, GRPO-style sequences."""

import numpy as np
import torch

from waveplan.planner import Planner
from waveplan.pricing.geometry import AttentionSpec, MixerKind, MlpKind, ModelGeometry
from waveplan.pricing.measure.megatron_build import build_gpt
from waveplan.pricing.parallel import Recompute


def build(seed=0):
    """A 2-layer GPT (hidden 64, fp32, full recompute), LoRA rank 4 on every linear layer,
    adapters randomised so that every adapter gradient is non-zero; and its planner."""
    torch.manual_seed(seed)
    geometry = ModelGeometry(name="tiny-fp32", hidden=64, ffn=192, vocab=256,
                             layers=((MixerKind.ATTENTION, MlpKind.DENSE),) * 2,
                             attention=AttentionSpec(4, 2, 16), dtype="fp32")
    model = build_gpt(geometry, device="cpu", lora_rank=4, recompute=Recompute(mode="full"),
                      seq_len=256, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0.0, 0.05)
    model.config.calculate_per_token_loss = True
    planner = Planner.from_megatron(model, backend="torch-cpu", head="full-native")
    return model, planner


def loss_func(loss_mask, output_tensor):
    """Megatron's per-token loss: (sum, tokens, logged)."""
    loss = torch.sum(output_tensor.view(-1).float() * loss_mask)
    tokens = loss_mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}


def grpo(rng, prompts=3, completions=4):
    """GRPO-style sequences: prompts of 16..48 tokens, completions of 8..80."""
    seqs, plens = [], []
    for _ in range(prompts):
        p = rng.integers(0, 256, int(rng.integers(16, 49)))
        for _ in range(completions):
            seqs.append(np.concatenate([p, rng.integers(0, 256, int(rng.integers(8, 81)))]))
            plens.append(p.size)
    return seqs, plens
