"""Megatron-core: run one planned step through Megatron-core's own `get_forward_backward_func()`.

    data = StepData.from_sequences(token_lists, prompt_lengths=prompts)   # the step's sequences
    run = train_step(model, planner, data, free_bytes, loss_func)      # plan, run, observe
    optimizer.step()

`train_step` plans the step (`plan_step`: `plan_distributed` on a `torch.distributed` job with
more than one rank, so every data-parallel replica runs the same number of waves) and runs it
(`run_plan`): one Megatron micro-batch per wave, in the plan's order, through
`get_forward_backward_func()` (no pipelining with PP = 1). A wave's sequences are packed as
THD (`PackedSeqParams`, one segment per sequence, any lengths); a wave with split children runs
each child as its own forward and the children's losses as one backward (the output tensor
handed to Megatron is the children's per-token losses, concatenated). With `share_prompts`, the
sequences of one prompt group in one child run their prompt once, as a prefix tree (this needs
an attention that runs prefix trees: `waveplan.pricing.measure.training_wave.use_prefix_tree_attention`
switches the CPU SDPA attention of `megatron_build.build_gpt` models); the step is then priced
with the same sharing, and without it every sequence is priced on its own.

The caller's `loss_func(loss_mask, output_tensor)` is Megatron's: `output_tensor` holds the
wave's per-token losses (`[1, tokens]`, from `GPTModel(..., labels=...)`), `loss_mask` (float,
one per token) marks the positions that count; it returns what Megatron's schedule accepts
(`(loss, num_tokens, logged)` or `(loss, logged)`). Use `(loss_sum, num_tokens, ...)` with
`config.calculate_per_token_loss = True` for a step whose loss and gradients do not depend on
how it is cut into waves.

Each wave's peak is measured (on a GPU: `torch.cuda.max_memory_allocated()` above the
allocation at the wave's start; on the CPU: the tracer's count of live storages created by
aten ops, as `training_wave.run_training_wave` counts, above everything alive at the wave's
start) and fed to `planner.observe` (`misses.observe_waves`): `StepRun.observations` holds what
it returned, `StepRun.misses` the waves whose peak went above their estimate (each warned about
and recorded by the planner, docs/faq.md#a-wave-missed-its-estimate). On the CPU, Megatron's
schedule also allocates a CUDA token counter; `run_plan` places it on the CPU.

torch and Megatron-core are imported when called.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from waveplan.pricing.errors import ConfigError, StepError, bad
from waveplan.pricing.step import Step

from ..misses import WaveObservation, misses, observe_waves
from ..plan import Plan
from ..planner import Planner


@dataclass(frozen=True, eq=False)
class StepData:
    """The sequences of one training step and the `Step` that prices them as they run.

    `tokens[i]`: the token ids of sequence i (prompt then completion). `loss_masks[i][t]`: 1
    where the loss counts predicting token t + 1 from position t (the last position predicts
    nothing and is always 0). `prompt_lengths[i]`, `groups[i]`: the prompt and its group key
    (sequences of one group share their prompt). `share_prompts`: run a group's prompt once
    per child (prefix tree). Build it with `from_sequences`."""

    tokens: tuple[np.ndarray, ...]
    loss_masks: tuple[np.ndarray, ...]
    prompt_lengths: np.ndarray
    share_prompts: bool
    step: Step

    @classmethod
    def from_sequences(cls, sequences, *, prompt_lengths=None, groups=None, loss_masks=None,
                       share_prompts: bool = False, ids=None) -> StepData:
        """Sequences as lists, arrays or 1-D tensors; `prompt_lengths` (default 0 each),
        `groups` (default: sequences with equal prompt tokens share a group) and `loss_masks`
        (default: the positions that predict each completion token after the first -- a
        shared prompt's last position has no single next token, so the default is the same
        with and without `share_prompts`). With `share_prompts`, a loss mask must be 0 on
        the prompt's positions. O(total tokens)."""
        from waveplan.pricing import batch_input as bi

        rows = bi.token_rows(sequences)
        n = len(rows)
        lengths = np.array([r.size for r in rows], np.int64)
        prompt = np.zeros(n, np.int64) if prompt_lengths is None else \
            bi.lengths("prompt_lengths", prompt_lengths, n, minimum=0)
        over = np.flatnonzero(prompt >= lengths)
        if over.size:
            i = int(over[0])
            raise bad(StepError, f"prompt_lengths[{i}]", int(prompt[i]),
                      f"must leave at least one completion token (the sequence has {int(lengths[i])})")
        if groups is None:
            seen: dict[bytes, int] = {}
            groups = [seen.setdefault(rows[i][:prompt[i]].tobytes(), i) if prompt[i] else None
                      for i in range(n)]
        keys = bi.group_keys(groups, n)
        first: dict[str, int] = {}
        for i in range(n):
            j = first.setdefault(keys[i], i) if keys[i] is not None else i
            if j != i and not np.array_equal(rows[i][:prompt[i]], rows[j][:prompt[j]]):
                raise bad(StepError, f"groups[{i}]", keys[i],
                          f"sequence {i} and sequence {j} share the group but not the prompt tokens")
        if loss_masks is None:
            masks = []
            for i in range(n):
                m = np.zeros(lengths[i], np.float32)
                m[prompt[i]:lengths[i] - 1] = 1.0
                masks.append(m)
        else:
            if isinstance(loss_masks, str | bytes) or len(loss_masks) != n:
                raise bad(StepError, "loss_masks", type(loss_masks).__name__,
                          f"must hold one mask per sequence ({n})")
            masks = []
            for i, m in enumerate(loss_masks):
                m = bi.int_array(f"loss_masks[{i}]", m, ndim=1, allow_bool=True).astype(np.float32)
                if m.size != lengths[i]:
                    raise bad(StepError, f"loss_masks[{i}]", f"<{m.size} values>",
                              f"needs one value per token ({int(lengths[i])})")
                if share_prompts and keys[i] is not None and m[:prompt[i]].any():
                    raise bad(StepError, f"loss_masks[{i}]", "<prompt positions>",
                              "must be 0 on a shared prompt's positions (share_prompts=True)")
                m = m.copy()
                m[-1] = 0.0
                masks.append(m)
        if share_prompts:
            step = Step.from_lengths(prompt, lengths - prompt, keys, ids)
        else:
            step = Step.from_lengths(np.zeros(n, np.int64), lengths, None, ids)
        return cls(tokens=tuple(rows), loss_masks=tuple(masks), prompt_lengths=prompt,
                   share_prompts=bool(share_prompts), step=step)

    @property
    def num_loss_tokens(self) -> int:
        return int(sum(m.sum() for m in self.loss_masks))


@dataclass(frozen=True)
class StepRun:
    """One step as Megatron ran it: the plan, Megatron's `forward_data_store` (what the loss
    function logged, one entry per wave), each wave's measured peak in bytes and what
    `Planner.observe` returned for it (None where nothing was observed)."""

    plan: Plan
    logged: list
    peaks: tuple[int, ...]
    measured: str
    observations: tuple[WaveObservation | None, ...] = ()

    @property
    def misses(self) -> tuple[WaveObservation, ...]:
        """The observed waves whose peak went above their estimate."""
        return misses(self.observations)


# --- packing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Packed:
    """One forward call: THD tensors, their PackedSeqParams and the loss mask."""

    ids: object
    positions: object
    labels: object
    loss_mask: object
    params: object
    cu: object
    bounds: list
    tree: list | None


def _pack_child(torch, data: StepData, child: Sequence[int], device) -> _Packed:
    """A child's sequences as one THD forward: plain segments, or, with `share_prompts`,
    each prompt group's prompt once with its completions as child segments."""
    from megatron.core.packed_seq_params import PackedSeqParams

    ids, pos, labels, mask = [], [], [], []
    segments: list[tuple[int, int, tuple[int, int] | None]] = []
    longest = 1

    def add(tokens, loss, first, parent):
        start = len(ids)
        ids.extend(tokens.tolist())
        pos.extend(range(first, first + tokens.size))
        labels.extend(tokens[1:].tolist() + [0])
        mask.extend(loss.tolist())
        segments.append((start, len(ids), parent))
        return start, len(ids)

    order: dict[object, list[int]] = {}
    for i in child:
        request = data.step.requests[int(i)]
        key = request.prompt if data.share_prompts and request.prompt is not None else ("", int(i))
        order.setdefault(key, []).append(int(i))
    for members in order.values():
        if len(members) > 1:
            p = int(data.prompt_lengths[members[0]])
            parent = add(data.tokens[members[0]][:p], np.zeros(p, np.float32), 0, None)
            for i in members:
                add(data.tokens[i][p:], data.loss_masks[i][p:], p, parent)
                longest = max(longest, data.tokens[i].size)
        else:
            i = members[0]
            add(data.tokens[i], data.loss_masks[i], 0, None)
            longest = max(longest, data.tokens[i].size)
    bounds = [a for a, _, _ in segments] + [len(ids)]
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    tree = segments if any(parent is not None for _, _, parent in segments) else None
    return _Packed(ids=torch.tensor([ids], dtype=torch.long, device=device),
                   positions=torch.tensor([pos], dtype=torch.long, device=device),
                   labels=torch.tensor([labels], dtype=torch.long, device=device),
                   loss_mask=torch.tensor(mask, dtype=torch.float32, device=device),
                   params=params, cu=cu, bounds=bounds, tree=tree)


# --- measuring --------------------------------------------------------------------------------


class _CudaPeaks:
    """Per-wave peaks from CUDA's allocator statistics."""

    name = "cuda max_memory_allocated above the allocation at the wave's start"

    def __init__(self, torch) -> None:
        self.torch = torch
        self.start = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def begin(self) -> None:
        self.torch.cuda.synchronize()
        self.torch.cuda.reset_peak_memory_stats()
        self.start = self.torch.cuda.memory_allocated()

    def end(self) -> int:
        self.torch.cuda.synchronize()
        return int(self.torch.cuda.max_memory_allocated() - self.start)


class _TracedPeaks:
    """Per-wave peaks counted as the tracer counts (live storages created by aten ops) above
    everything alive at the wave's start; parameters, buffers, gradients and the packed
    inputs are never counted."""

    name = ("live untyped storages created by aten ops during the wave (the tracer's count), "
            "above everything alive at the wave's start")

    def __init__(self, model, packs) -> None:
        from waveplan.pricing.measure.trace import _tracker_class

        params = list(model.parameters())
        self.tracker = _tracker_class()()
        self.tracker.ignore(params + list(model.buffers())
                            + [p.grad for p in params if p.grad is not None])
        self.tracker.ignore([t for p in packs for t in (p.ids, p.positions, p.labels,
                                                         p.loss_mask, p.cu)])
        self.start = 0

    def __enter__(self):
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.tracker.__exit__(*exc)

    def begin(self) -> None:
        self.tracker.reset_peak()
        self.start = self.tracker.current

    def end(self) -> int:
        return int(self.tracker.peak - self.start)


@contextlib.contextmanager
def _cuda_factories_on_cpu():
    """Megatron's schedule allocates `torch.zeros(..., device="cuda")` for its token count;
    on a machine without CUDA, create such tensors on the CPU instead."""
    from torch.overrides import TorchFunctionMode

    class CpuForCuda(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            device = kwargs.get("device")
            if device is not None and str(device).startswith("cuda"):
                kwargs = dict(kwargs, device="cpu")
            return func(*args, **kwargs)

    with CpuForCuda():
        yield


# --- planning and running ---------------------------------------------------------------------


def plan_step(planner: Planner, data: StepData, free_bytes, *, dp_group=None,
              model_parallel_group=None, group=None, **plan_kwargs) -> Plan:
    """Plan `data.step`: on an initialised `torch.distributed` job of more than one rank,
    through `plan_distributed` (the ranks agree on the budget and the wave count; the groups
    as there), else with `planner.plan`. `deterministic` defaults to True."""
    import torch.distributed as dist

    plan_kwargs.setdefault("deterministic", True)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from ..distributed import plan_distributed

        return plan_distributed(planner, data.step, free_bytes, group=group,
                                model_parallel_group=model_parallel_group, dp_group=dp_group,
                                **plan_kwargs)
    return planner.plan(data.step, free_bytes, **plan_kwargs)


def run_plan(model, plan: Plan, data: StepData, loss_func: Callable, *,
             planner: Planner | None = None, forward_only: bool = False) -> StepRun:
    """Run `plan` over `data` through Megatron-core's `get_forward_backward_func()`: one
    micro-batch per wave, in order; each wave's peak is measured and, with `planner` and
    not `forward_only`, fed to `planner.observe`. Gradients accumulate into the model's
    parameters (call the optimizer afterwards). O(tokens) packing plus the model's work."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from waveplan.pricing.measure import thd

    ids = set(data.step.ids)
    if not isinstance(plan, Plan) or any(r not in ids for w in plan.waves for r in w.request_ids) \
            or sum(len(w.request_ids) for w in plan.waves) != data.step.num_requests:
        raise bad(ConfigError, "plan", getattr(plan, "num_waves", type(plan).__name__),
                  "must be a plan of exactly this step's requests")
    first = next(model.parameters())
    device = first.device
    packs = [[_pack_child(torch, data, child, device) for child in wave.child_indices]
             for wave in plan.waves]
    trees = any(p.tree is not None for wave in packs for p in wave)
    if trees:
        from waveplan.pricing.measure.training_wave import use_prefix_tree_attention

        if use_prefix_tree_attention(model) == 0:
            raise bad(ConfigError, "share_prompts", True,
                      "the model has no attention that runs prefix trees (build it with "
                      "megatron_build.build_gpt, or plan with share_prompts=False)")
    for wave in packs:
        for p in wave:
            thd.register(p.cu, p.bounds, p.tree)
    on_cuda = device.type == "cuda"
    peaks_of = _CudaPeaks(torch) if on_cuda else _TracedPeaks(model, [p for w in packs for p in w])
    peaks: list[int] = []
    order = iter(range(len(plan.waves)))

    def forward_step(data_iterator, model_):
        i = next(data_iterator)
        if i > 0:
            peaks.append(peaks_of.end())
        peaks_of.begin()
        outputs, masks = [], []
        for p in packs[i]:
            outputs.append(model_(p.ids, p.positions, None, labels=p.labels,
                                  packed_seq_params=p.params))
            masks.append(p.loss_mask)
        output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        mask = masks[0] if len(masks) == 1 else torch.cat(masks)
        return output, functools.partial(loss_func, mask)

    contexts = contextlib.ExitStack()
    try:
        with contexts:
            if not on_cuda:
                contexts.enter_context(_cuda_factories_on_cpu())
            if not on_cuda or trees:
                contexts.enter_context(thd.rope_patch())
            contexts.enter_context(peaks_of)
            model.train(not forward_only)
            logged = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=order, model=model,
                num_microbatches=len(plan.waves),
                seq_length=max(int(p.ids.shape[1]) for w in packs for p in w),
                micro_batch_size=1, forward_only=forward_only)
            peaks.append(peaks_of.end())
    finally:
        for wave in packs:
            for p in wave:
                thd.forget(p.cu)
    observations = ()
    if planner is not None and not forward_only:
        observations = observe_waves(planner, plan.waves, [p if p > 0 else None for p in peaks])
    return StepRun(plan=plan, logged=list(logged), peaks=tuple(peaks), measured=peaks_of.name,
                   observations=observations)


def train_step(model, planner: Planner, data: StepData, free_bytes, loss_func: Callable, *,
               dp_group=None, model_parallel_group=None, group=None,
               observe: bool = True, **plan_kwargs) -> StepRun:
    """`plan_step` then `run_plan` (peaks observed unless `observe=False`)."""
    plan = plan_step(planner, data, free_bytes, dp_group=dp_group,
                     model_parallel_group=model_parallel_group, group=group, **plan_kwargs)
    return run_plan(model, plan, data, loss_func, planner=planner if observe else None)


__all__ = ["StepData", "StepRun", "plan_step", "run_plan", "train_step"]
