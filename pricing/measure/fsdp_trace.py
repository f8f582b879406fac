"""Measure one wave's peak above rest on Hugging Face transformers + PEFT LoRA under FSDP2.

`trace_fsdp` spawns one gloo process per rank of the shard group (`torch.multiprocessing`,
"spawn"); each builds the transformers model from a config (`AutoModelForCausalLM.from_config`,
fp32 master weights), wraps it in PEFT LoRA (rank r on every linear layer but the head, base
frozen), optionally enables transformers' per-decoder-layer gradient checkpointing
(non-reentrant), and shards it with FSDP2 (`fully_shard` on every decoder layer and on the root,
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, `reshard_after_forward` as asked)
over a CPU device mesh. After one warm-up step (forward, backward, AdamW step, grads set to
None) the rank is *at rest*: sharded fp32 weights and optimizer states resident. Each traced
wave then runs one forward (its sequences packed in one row, position_ids restarting per
sequence, as veRL's remove-padding path feeds them), the loss as transformers computes it
(`ForCausalLMLoss`: all logits, fp32 upcast), and one backward; the peak is measured above rest
(docs/memory-model.md#fsdp2-with-hugging-face-transformers).

Counting on "cpu": `trace._tracker_class`'s live-storage tracker (every storage an aten op
creates, by nbytes, until its Python object dies; collectives on untracked copies), plus the
FSDP all-gather output storages, which FSDP2 grows and frees with `UntypedStorage.resize_`
(not an aten op): their current nbytes are read after every op. "cuda":
`torch.cuda.max_memory_allocated()` above the allocation at rest (nccl; not run here).

attn "flash" runs transformers' flash_attention_2 path: on the CPU (and on CUDA without
flash-attn) with `hf_flash`'s stand-in for flash-attn 2's kernels, an allocation model read from
its source (what `mha_varlen_fwd` saves, what `mha_varlen_bwd` allocates; values computed
uncounted); on CUDA with flash-attn installed, the real kernels. Every wave is called with
`use_cache=False`, as veRL's FSDP actor and TRL call it (docs/memory-model.md#fsdp-attention).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

from ..errors import ConfigError, bad
from .gloo_launch import spawn

DEVICES = ("cpu", "cuda")
TRACE_ATTN = ("sdpa", "eager")
# trace_fsdp also runs transformers' flash_attention_2 path (`hf_flash`)
FSDP_TRACE_ATTN = TRACE_ATTN + ("flash",)
DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class FsdpTraceJob:
    """One wave to trace."""

    seq_lens: tuple[int, ...]
    """The wave's sequence lengths (tokens), packed in one row."""


@dataclass(frozen=True)
class FsdpTrace:
    """One traced wave on every rank of the shard group."""

    config: dict
    """The transformers config the model was built from (`to_dict` of it, text fields only)."""
    seq_lens: tuple[int, ...]
    """The wave's sequences, packed in one row."""
    fsdp: int
    """Shard group size (ranks)."""
    attn: str
    """Attention implementation traced (sdpa or eager)."""
    checkpointing: bool
    """Per-decoder-layer gradient checkpointing on."""
    lora_rank: int
    """LoRA rank on every linear layer."""
    reshard_after_forward: bool
    """FSDP2's reshard_after_forward on the decoder layers."""
    device: str
    """cpu (live-storage count) or cuda (allocator peak)."""
    peaks: tuple[int, ...]
    """Each rank's peak bytes above rest during the wave's forward and backward."""
    rest: tuple[int, ...]
    """Each rank's bytes at rest (the storages alive before the wave)."""
    forward_peaks: tuple[int, ...] = ()
    """Each rank's peak above rest during the forward and loss only."""
    notes: tuple[str, ...] = field(default=())
    """What the trace changed or assumed."""
    remove_padding: bool = True
    """The wave's sequences packed in one row (True), or padded [B, L] rows with an attention
    mask as veRL's `use_remove_padding=False` runs them (False)."""

    @property
    def peak_bytes(self) -> int:
        """The busiest rank's peak above rest."""
        return max(self.peaks)

    @property
    def tokens(self) -> int:
        return sum(self.seq_lens)

    def to_dict(self) -> dict:
        return {"framework": "fsdp", "config": self.config, "seq_lens": list(self.seq_lens),
                "tokens": self.tokens, "fsdp": self.fsdp, "attn": self.attn,
                "checkpointing": self.checkpointing, "lora_rank": self.lora_rank,
                "reshard_after_forward": self.reshard_after_forward, "device": self.device,
                "peak_bytes": self.peak_bytes, "peaks": list(self.peaks), "rest": list(self.rest),
                "forward_peaks": list(self.forward_peaks), "notes": list(self.notes),
                **({"remove_padding": False} if not self.remove_padding else {})}


def checked_jobs(jobs, config, attn: str, device: str,
                 attns: tuple[str, ...] = TRACE_ATTN) -> list[FsdpTraceJob]:
    """`jobs` as `FsdpTraceJob`s, with the tracer's inputs checked (one line naming the field;
    `attns`: the attention implementations the tracer runs). Shared by `trace_fsdp` and
    `fsdp_verl_trace.trace_fsdp_verl`."""
    jobs = [j if isinstance(j, FsdpTraceJob) else FsdpTraceJob(tuple(int(x) for x in j))
            for j in jobs]
    if not jobs:
        raise bad(ConfigError, "jobs", jobs, "must name at least one wave")
    for j in jobs:
        if not j.seq_lens or any(n < 2 for n in j.seq_lens):
            raise bad(ConfigError, "seq_lens", list(j.seq_lens), "every sequence needs >= 2 tokens")
    if not isinstance(config, dict) or "model_type" not in config:
        raise bad(ConfigError, "config", type(config).__name__, "must be a dict with model_type")
    if attn not in attns:
        raise bad(ConfigError, "attn", attn, f"this tracer runs {', '.join(attns)}")
    if device not in DEVICES:
        raise bad(ConfigError, "device", device, f"must be one of {', '.join(DEVICES)}")
    return jobs


def trace_fsdp(config: dict, *, jobs, fsdp: int = 2, attn: str = "sdpa",
               checkpointing: bool = True, lora_rank: int = 8,
               reshard_after_forward: bool = True, device: str = "cpu",
               timeout_s: float = DEFAULT_TIMEOUT_S, remove_padding: bool = True) -> list[FsdpTrace]:
    """Trace each job's wave on `fsdp` gloo ranks (one process each); one `FsdpTrace` per job.

    `config`: a transformers config as a dict with its `model_type` (small widths on the CPU:
    every tensor is real). `remove_padding=False`: the wave as veRL's padded rows
    (`padded_inputs`). O(jobs) waves per rank, one model build."""
    jobs = checked_jobs(jobs, config, attn, device, FSDP_TRACE_ATTN)
    if not (isinstance(fsdp, int) and 1 <= fsdp <= 64):
        raise bad(ConfigError, "fsdp", fsdp, "must be an integer in [1, 64]")
    if not (isinstance(lora_rank, int) and lora_rank >= 1):
        raise bad(ConfigError, "lora_rank", lora_rank, "must be an integer >= 1")
    if attn == "flash" and device == "cuda" and not real_flash(device):
        raise bad(ConfigError, "attn", attn, "on cuda needs flash-attn installed (the stand-in "
                  "counts its allocations on the CPU only)")
    spec = {"config": dict(config), "attn": attn, "checkpointing": bool(checkpointing),
            "lora_rank": int(lora_rank), "reshard_after_forward": bool(reshard_after_forward),
            "device": device, "fsdp": fsdp, "timeout_s": float(timeout_s),
            "jobs": [list(j.seq_lens) for j in jobs], "remove_padding": bool(remove_padding)}
    per_rank = spawn(spec, fsdp, timeout_s, entry=f"{__name__}:trace_rank",
                     backend="nccl" if device == "cuda" else "gloo")
    notes = ("sequences packed in one row, position_ids restarting per sequence" if remove_padding
             else "sequences padded to [B, longest] with an attention mask (veRL use_remove_padding=False)",
             "loss: transformers' ForCausalLMLoss on all logits (fp32 upcast)")
    if attn == "flash":
        notes += (flash_note(device),)
    out = []
    for k, job in enumerate(jobs):
        ranks = [per_rank[r][k] for r in range(fsdp)]
        out.append(FsdpTrace(
            config=dict(config), seq_lens=job.seq_lens, fsdp=fsdp, attn=attn,
            checkpointing=bool(checkpointing), lora_rank=lora_rank,
            reshard_after_forward=bool(reshard_after_forward), device=device,
            peaks=tuple(r["peak"] for r in ranks), rest=tuple(r["rest"] for r in ranks),
            forward_peaks=tuple(r["forward_peak"] for r in ranks), notes=notes,
            remove_padding=bool(remove_padding)))
    return out


def build_fsdp_model(spec: dict):
    """The rank's PEFT-wrapped, FSDP2-sharded transformers model and its AdamW optimizer.
    Call inside an initialised process group."""
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(spec["config"])
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    dev = spec["device"]
    stand_in = spec["attn"] == "flash" and not real_flash(dev)
    # transformers refuses flash_attention_2 without flash-attn: the stand-in's model is built
    # with sdpa and switched before it runs (`hf_flash.use_flash`)
    impl = {"flash": "sdpa" if stand_in else "flash_attention_2"}.get(spec["attn"], spec["attn"])
    config._attn_implementation = impl
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32,
                                             attn_implementation=impl)
    if stand_in:
        from .hf_flash import use_flash

        use_flash(model)
    if dev == "cuda":
        model = model.cuda()
    if spec["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=spec["lora_rank"], lora_alpha=2 * spec["lora_rank"],
                                             lora_dropout=0.0, target_modules="all-linear"))
    if spec["checkpointing"]:
        model.enable_input_require_grads()
    mesh = init_device_mesh(dev, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raf = spec["reshard_after_forward"]
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    return model, opt


def real_flash(device: str) -> bool:
    """Whether a flash trace on `device` runs flash-attn itself (CUDA with flash-attn installed)
    rather than `hf_flash`'s stand-in."""
    import importlib.util

    return device == "cuda" and importlib.util.find_spec("flash_attn") is not None


def flash_note(device: str) -> str:
    """The trace note of a flash_attention_2 trace."""
    if real_flash(device):
        return "attention: transformers' flash_attention_2 on flash-attn 2 (varlen on packed rows)"
    return ("attention: transformers' flash_attention_2 path with flash-attn 2's kernels replaced "
            "by their allocation model (pricing/measure/hf_flash.py; values computed uncounted)")


def decoder_layers(model):
    """The decoder layers of a (PEFT-wrapped) transformers causal LM."""
    inner = model
    for attr in ("base_model", "model"):
        while hasattr(inner, attr) and not hasattr(inner, "layers"):
            inner = getattr(inner, attr)
    if not hasattr(inner, "layers"):
        raise bad(ConfigError, "model", type(model).__name__, "has no decoder `layers`")
    return list(inner.layers)


def wave_inputs(lens, vocab: int, device: str):
    """One packed row: input ids, position ids restarting per sequence, labels = ids."""
    import torch

    gen = torch.Generator().manual_seed(sum(lens) * 31 + len(lens))
    total = sum(lens)
    ids = torch.randint(0, vocab, (1, total), generator=gen).to(device)
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0).to(device)
    return ids, pos, ids.clone()


def padded_inputs(lens, vocab: int, device: str):
    """The wave as veRL's `use_remove_padding=False` feeds it (`prepare_model_inputs`): ids
    [B, L] right-padded with 0 (L the longest), the int32 attention mask
    (`build_attention_mask_from_nested`), position ids per row (0 on padding), labels = ids with
    -100 on padding; the ids are `wave_inputs`' packed ids, row by row."""
    import torch

    ids, _, _ = wave_inputs(lens, vocab, "cpu")
    width = max(lens)
    rows = torch.zeros(len(lens), width, dtype=torch.long)
    mask = torch.zeros(len(lens), width, dtype=torch.int32)
    pos = torch.zeros(len(lens), width, dtype=torch.long)
    start = 0
    for r, n in enumerate(lens):
        rows[r, :n] = ids[0, start:start + n]
        mask[r, :n] = 1
        pos[r, :n] = torch.arange(n)
        start += n
    labels = rows.masked_fill(mask == 0, -100)
    return rows.to(device), mask.to(device), pos.to(device), labels.to(device)


def _fsdp_params(model):
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            if group is not None:
                out.extend(group.fsdp_params)
    return out


def _polled_tracker():
    """The live-storage tracker, plus storages read by nbytes after every op (FSDP2's
    all-gather outputs, resized outside aten)."""
    from .trace import _tracker_class

    base = _tracker_class()

    class PolledTracker(base):
        def __init__(self, polled) -> None:
            super().__init__()
            self.polled = list(polled)
            for st in self.polled:
                self.ignored[id(st)] = st   # never counted as op outputs
            self.polled_now = 0

        def _poll(self) -> None:
            self.polled_now = sum(st.nbytes() for st in self.polled)
            if self.current + self.polled_now > self.peak:
                self.peak = self.current + self.polled_now

        def _track(self, t) -> None:
            super()._track(t)
            self._poll()

        def reset_peak(self) -> None:
            self._poll()
            self.peak = self.current + self.polled_now

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self._poll()
            return out

    return PolledTracker


def _live_storages(torch):
    """Every tensor storage alive now (the rank at rest)."""
    seen = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                st = obj.untyped_storage()
                seen[id(st)] = obj
        except Exception:   # noqa: BLE001 - a tensor subclass without storage
            continue
    return seen


def rest_storages(model, torch):
    """The rank at rest, split for a tracker: FSDP2's all-gather outputs (`polled`: resized
    outside aten, read by nbytes) and every other live storage (`others`: to ignore, counted in
    rest). O(live objects)."""
    polled = [t.untyped_storage() for fp in _fsdp_params(model) for t in fp.all_gather_outputs]
    ids = {id(st) for st in polled}
    others = [o for k, o in _live_storages(torch).items() if k not in ids]
    return polled, others


def trace_rank(spec: dict) -> list[dict]:
    """This rank's result for every job: peak above rest, rest, forward peak."""

    model, opt = build_fsdp_model(spec)
    vocab = int(spec["config"].get("vocab_size", 32000))
    dev = spec["device"]

    flash = spec["attn"] == "flash"

    padded = not spec.get("remove_padding", True)

    def run(lens, phase=None):
        mask = None
        if padded:
            ids, mask, pos, labels = padded_inputs(lens, vocab, dev)
        else:
            ids, pos, labels = wave_inputs(lens, vocab, dev)
        # no KV cache, as trainers call it (veRL's FSDP actor, TRL): with one, transformers keeps
        # every layer's key and value to the forward's end, and `create_causal_mask` skips its
        # packed-sequence detection (sdpa/eager then ran plain causal attention over the row)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels,
                    use_cache=False)
        loss = out.loss
        del out
        if phase is not None:
            phase()
        loss.backward()
        del loss, ids, pos, labels, mask

    if flash and not real_flash(dev):
        from .hf_flash import flash_attention_2

        with flash_attention_2():
            return measure_waves(model, opt, spec["jobs"], run, dev)
    return measure_waves(model, opt, spec["jobs"], run, dev)


def measure_waves(model, opt, jobs, run, dev: str) -> list[dict]:
    """Every job's peak above rest, rest and forward peak, after one warm-up step (lazy init,
    first all-gathers, optimizer states created) of `run(jobs[0])`: CUDA peak statistics, or
    the live-storage tracker with FSDP2's all-gather outputs polled by size. A `run` returning
    its loss adds `loss` and `warmup_loss`. Shared by `fsdp_trace` and `fsdp_verl_trace`."""
    import torch

    warmup = run(jobs[0])
    opt.step()
    opt.zero_grad(set_to_none=True)
    results = []
    for lens in jobs:
        opt.zero_grad(set_to_none=True)
        gc.collect()
        if dev == "cuda":
            torch.cuda.synchronize()
            rest = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fwd = {}
            value = run(lens, phase=lambda f=fwd: f.update(p=torch.cuda.max_memory_allocated()))
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - rest
            record = {"peak": int(peak), "rest": int(rest), "forward_peak": int(fwd["p"] - rest)}
        else:
            polled, others = rest_storages(model, torch)
            rest = sum(o.untyped_storage().nbytes() for o in others)
            rest += sum(st.nbytes() for st in polled)
            tracker = _polled_tracker()(polled)
            tracker.ignore(others)
            del others
            fwd = {}
            with tracker:
                tracker.reset_peak()
                base = tracker.peak
                value = run(lens, phase=lambda f=fwd, t=tracker: f.update(p=t.peak))
            record = {"peak": int(tracker.peak - base), "rest": int(rest),
                      "forward_peak": int(fwd["p"] - base)}
            del tracker
        if value is not None:
            record.update(loss=value, warmup_loss=warmup)
        results.append(record)
    opt.zero_grad(set_to_none=True)
    return results
