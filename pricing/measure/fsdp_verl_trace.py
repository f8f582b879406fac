"""Measure one wave's peak above rest as veRL's FSDP engine runs it: Ulysses sequence
parallelism (veRL's all-to-all) and veRL's log-prob / entropy heads, on transformers + PEFT
LoRA under FSDP2 (docs/memory-model.md#fsdp-ulysses, #fsdp-verl-head).

The rank is `fsdp_trace`'s (the same model build, warm-up, rest and live-storage count); what
changes is the wave:

- Ulysses N > 1: the FSDP mesh spans every rank (veRL's `create_device_mesh`) and a second
  (dp, sp) mesh of shape (world / N, N) gives the sequence-parallel group
  (`verl.utils.ulysses.set_ulysses_sequence_parallel_group`), as veRL's FSDP engine builds them.
  Every rank of an sp group gets the same packed row; `verl.utils.ulysses.
  ulysses_pad_and_slice_inputs` pads it to a multiple of N and slices this rank's part of
  input_ids and position_ids. veRL patches the all-to-all around flash_attention_2 only, which
  does not run on the CPU: here transformers' own sdpa or eager attention function is wrapped
  the same way (`_ulysses_attention`): query, key and value moved to veRL's [b, s, h, d] view as
  transformers' flash integration hands them, veRL's `repeat_kv` and `gather_seq_scatter_heads`
  (all-to-all: whole sequence, heads / N), transformers' sdpa/eager on the gathered tensors, and
  veRL's `gather_heads_scatter_seq` back. sdpa/eager need the whole packed row's block-causal
  mask (bool for sdpa, bf16 additive for eager): the caller builds it from the full position ids
  and hands it to the model as a 4-D mask (transformers builds the same mask itself without
  Ulysses).
- head "transformers": transformers' ForCausalLMLoss on the local logits (labels = ids).
  "verl", "verl-chunked": the model returns the local logits (bf16) and the rank runs veRL's
  `prepare_model_outputs` remove-padding branch: temperature division (out of place),
  `verl.utils.torch_functional.entropy_from_logits` (or `entropy_from_logits_with_chunking`,
  chunk 2048), `logprobs_from_logits` on the rolled labels (inplace_backward False: entropy is
  computed), `gather_outputs_and_unpad` over the sp group, and a loss of the PPO form
  -(mean log-prob) - 0.01 x mean entropy. "verl-fused" (Triton) does not run on the CPU.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..errors import ConfigError, bad
from .fsdp_trace import (
    DEFAULT_TIMEOUT_S,
    FsdpTrace,
    build_fsdp_model,
    checked_jobs,
    decoder_layers,
)
from .gloo_launch import spawn

TRACE_HEADS = ("transformers", "verl", "verl-chunked")
ENTROPY_CHUNK = 2048
"""veRL's default `entropy_from_logits_chunk_size`."""
ENTROPY_COEF = 0.01
TEMPERATURE = 0.7


@dataclass(frozen=True)
class VerlFsdpTrace(FsdpTrace):
    """One traced wave with veRL's Ulysses layout and head."""

    ulysses: int = 1
    """Ulysses sequence-parallel group size."""
    head: str = "transformers"
    """The loss traced (`TRACE_HEADS`)."""
    losses: tuple[float, ...] = ()
    """Each rank's loss of the traced wave."""
    warmup_losses: tuple[float, ...] = ()
    """Each rank's loss of the warm-up wave (the first job), before any optimizer step: with a
    veRL head, the same for every Ulysses size (its log-probs are gathered over the sp group)."""

    def to_dict(self) -> dict:
        doc = super().to_dict()
        doc["ulysses"] = self.ulysses
        doc["head"] = self.head
        doc["losses"] = list(self.losses)
        doc["warmup_losses"] = list(self.warmup_losses)
        return doc


def trace_fsdp_verl(config: dict, *, jobs, fsdp: int = 2, ulysses: int = 1, head: str = "transformers",
                    attn: str = "sdpa", checkpointing: bool = True, lora_rank: int = 8,
                    reshard_after_forward: bool = True, device: str = "cpu",
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> list[VerlFsdpTrace]:
    """Trace each job's wave on `fsdp` ranks with Ulysses group `ulysses` and head `head`; one
    `VerlFsdpTrace` per job. O(jobs) waves per rank, one model build."""
    jobs = checked_jobs(jobs, config, attn, device)
    if head not in TRACE_HEADS:
        raise bad(ConfigError, "head", head, f"traceable: {', '.join(TRACE_HEADS)} "
                  "(verl-fused runs Triton; it is priced by its allocation model)")
    if not (isinstance(fsdp, int) and 1 <= fsdp <= 64):
        raise bad(ConfigError, "fsdp", fsdp, "must be an integer in [1, 64]")
    if not (isinstance(ulysses, int) and ulysses >= 1 and fsdp % ulysses == 0):
        raise bad(ConfigError, "ulysses", ulysses, f"must be a positive divisor of fsdp={fsdp}")
    heads = int(config.get("num_attention_heads", 0))
    kv = int(config.get("num_key_value_heads", heads) or heads)
    if ulysses > 1 and (heads % ulysses or kv % ulysses):
        raise bad(ConfigError, "ulysses", ulysses, f"the tracer needs num_attention_heads={heads} and "
                  f"num_key_value_heads={kv} divisible by it")
    if not (isinstance(lora_rank, int) and lora_rank >= 1):
        raise bad(ConfigError, "lora_rank", lora_rank, "must be an integer >= 1")
    spec = {"config": dict(config), "attn": attn, "checkpointing": bool(checkpointing),
            "lora_rank": int(lora_rank), "reshard_after_forward": bool(reshard_after_forward),
            "device": device, "fsdp": fsdp, "ulysses": ulysses, "head": head,
            "timeout_s": float(timeout_s), "jobs": [list(j.seq_lens) for j in jobs]}
    per_rank = spawn(spec, fsdp, timeout_s, entry=f"{__name__}:trace_rank",
                     backend="nccl" if device == "cuda" else "gloo")
    notes = ["sequences packed in one row, position_ids restarting per sequence"]
    if ulysses > 1:
        notes.append(f"Ulysses {ulysses}: veRL's pad-and-slice and all-to-all around transformers' "
                     f"{attn} (veRL patches flash_attention_2 only); the packed row's block-causal "
                     "mask built by the caller from the full position ids")
    notes.append({"transformers": "loss: transformers' ForCausalLMLoss on the local logits",
                  "verl": "head: veRL's temperature division, entropy_from_logits, "
                          "logprobs_from_logits, gather over the sp group",
                  "verl-chunked": "head: veRL's temperature division, entropy_from_logits_with_"
                                  "chunking, logprobs_from_logits, gather over the sp group"}[head])
    out = []
    for k, job in enumerate(jobs):
        ranks = [per_rank[r][k] for r in range(fsdp)]
        out.append(VerlFsdpTrace(
            config=dict(config), seq_lens=job.seq_lens, fsdp=fsdp, attn=attn,
            checkpointing=bool(checkpointing), lora_rank=lora_rank,
            reshard_after_forward=bool(reshard_after_forward), device=device,
            peaks=tuple(r["peak"] for r in ranks), rest=tuple(r["rest"] for r in ranks),
            forward_peaks=tuple(r["forward_peak"] for r in ranks), notes=tuple(notes),
            ulysses=ulysses, head=head, losses=tuple(r["loss"] for r in ranks),
            warmup_losses=tuple(r["warmup_loss"] for r in ranks)))
    return out


def _ulysses_attention(inner, sp: int):
    """transformers' attention function `inner` (sdpa or eager) with veRL's Ulysses all-to-all
    around it, as `verl.models.transformers.monkey_patch._ulysses_flash_attention_forward` puts
    it around flash-attn: [b, heads, s/sp, d] in, the same out as transformers' functions return
    ([b, s/sp, heads, d])."""
    from verl.models.transformers.monkey_patch import repeat_kv
    from verl.utils.ulysses import gather_heads_scatter_seq, gather_seq_scatter_heads

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        # transformers' flash integration hands flash-attn [b, s, h, d] views
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        repeats = max(sp // k.size(2), 1)
        k = repeat_kv(k, repeats)
        v = repeat_kv(v, repeats)
        q = gather_seq_scatter_heads(q, seq_dim=1, head_dim=2)
        k = gather_seq_scatter_heads(k, seq_dim=1, head_dim=2)
        v = gather_seq_scatter_heads(v, seq_dim=1, head_dim=2)
        out, _ = inner(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                       attention_mask, *args, **kwargs)
        del q, k, v
        return gather_heads_scatter_seq(out, seq_dim=1, head_dim=2), None

    return attention


def _install_ulysses(model, spec: dict):
    """Build veRL's (dp, sp) mesh, set the sp group, and wrap the model's attention function."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.modeling_utils import AttentionInterface
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    sp = spec["ulysses"]
    world = dist.get_world_size()
    mesh = init_device_mesh(spec["device"], (world // sp, sp), mesh_dim_names=("dp", "sp"))
    set_ulysses_sequence_parallel_group(mesh["sp"].get_group())
    attn = spec["attn"]
    if attn == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as inner
    else:
        layer = decoder_layers(model)[0]
        inner = sys.modules[type(layer.self_attn).__module__].eager_attention_forward
    AttentionInterface.register(attn, _ulysses_attention(inner, sp))
    return mesh


def _block_causal_mask(pos, attn: str):
    """The packed row's block-causal mask from its full position ids [1, S] (a sequence starts
    where the position is 0): bool [1, 1, S, S] (True: attend) for sdpa, bf16 additive for eager."""
    import torch

    seq = (pos[0] == 0).cumsum(0)
    mask = seq[:, None] == seq[None, :]
    del seq
    mask.tril_()
    if attn == "sdpa":
        return mask[None, None]
    add = torch.full(mask.shape, torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16,
                     device=mask.device)
    add.masked_fill_(mask, 0.0)
    return add[None, None]


def _verl_head(logits, rolled, pad_size: int, head: str, sp: int):
    """veRL's remove-padding head on this rank's logits [1, s, V]: the loss to backward."""
    import torch
    from verl.utils import torch_functional as verl_F
    from verl.utils.ulysses import gather_outputs_and_unpad

    logits_rmpad = logits.squeeze(0)
    # `_scale_logits_by_temperature` at a temperature other than 1 (at 1 veRL skips it)
    temperature = torch.full((logits_rmpad.shape[0], 1), TEMPERATURE, dtype=torch.float32,
                             device=logits.device)
    logits_rmpad = logits_rmpad / temperature.clamp(min=1e-8).to(logits_rmpad.dtype)
    del temperature
    if head == "verl-chunked":
        entropy = verl_F.entropy_from_logits_with_chunking(logits_rmpad, chunk_size=ENTROPY_CHUNK)
    else:
        entropy = verl_F.entropy_from_logits(logits_rmpad)
    log_probs = verl_F.logprobs_from_logits(logits=logits_rmpad, labels=rolled, inplace_backward=False)
    del logits_rmpad
    if sp > 1:
        log_probs = gather_outputs_and_unpad(log_probs, gather_dim=0, unpad_dim=0, padding_size=pad_size)
        entropy = gather_outputs_and_unpad(entropy, gather_dim=0, unpad_dim=0, padding_size=pad_size)
    return -log_probs.mean() - ENTROPY_COEF * entropy.mean()


def trace_rank(spec: dict) -> list[dict]:
    """This rank's result for every job: peak above rest, rest, forward peak."""
    import torch
    from verl.utils.ulysses import ulysses_pad_and_slice_inputs

    from .fsdp_trace import measure_waves, wave_inputs

    model, opt = build_fsdp_model(spec)
    sp = spec["ulysses"]
    head = spec["head"]
    if sp > 1:
        _install_ulysses(model, spec)
    vocab = int(spec["config"].get("vocab_size", 32000))
    dev = spec["device"]

    def run(lens, phase=None):
        ids, pos, _ = wave_inputs(lens, vocab, dev)
        rolled = torch.roll(ids, shifts=-1, dims=1)
        mask = None
        pad = 0
        if sp > 1:
            full_ids, full_pos = ids, pos
            ids, pos, pad = ulysses_pad_and_slice_inputs(full_ids, full_pos, sp_size=sp)
            rolled, _, _ = ulysses_pad_and_slice_inputs(rolled, None, sp_size=sp)
            # the padded row's position ids (pad rows start a sequence of their own)
            full_pos = torch.cat([full_pos, torch.arange(pad, device=full_pos.device)[None]], dim=1)
            mask = _block_causal_mask(full_pos, spec["attn"])
            del full_pos
        if head == "transformers":
            # no KV cache, as trainers call it (with one, transformers keeps every layer's key
            # and value to the forward's end and does not detect packed sequences)
            out = model(input_ids=ids, position_ids=pos, attention_mask=mask, labels=ids,
                        use_cache=False)
            loss = out.loss
        else:
            # veRL's `forward_step`: the model, its head and the loss under bf16 autocast
            with torch.autocast(device_type=dev, dtype=torch.bfloat16):
                out = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False)
                logits = out.logits
                del out
                loss = _verl_head(logits, rolled.squeeze(0), pad, head, sp)
                del logits
        out = None
        value = float(loss.detach())
        if phase is not None:
            phase()
        loss.backward()
        del loss, ids, pos, rolled, mask, out
        return value

    return measure_waves(model, opt, spec["jobs"], run, dev)
