"""veRL: micro-batches priced by memory instead of a token budget.

veRL's dynamic batch size (`use_dynamic_bsz`) splits each mini-batch with
`verl.utils.seqlen_balancing.rearrange_micro_batches(batch, max_token_len, dp_group, ...)`:
as many micro-batches as a token budget asks for, balanced by an attention-workload
estimate, the count agreed as the maximum over the data-parallel group. The token budget knows
no memory: set high, a micro-batch runs out of memory; set low enough for the worst micro-batch
(the first, which also allocates the adapter gradients), every other micro-batch wastes room.

`rearrange_micro_batches` here keeps veRL's contract (returns the micro-batches, as veRL
selects them, and the index lists that veRL's `restore_dynamic_batch` / `get_reverse_idx`
undo) and veRL's options, but cuts the batch into the waves of a `Planner` plan: one
micro-batch per wave, in the plan's order (the first wave is the one priced with the adapter
gradients, so veRL's workload reordering, `use_dynamic_bsz_balance`, is not applied). Each
sequence runs on its own (veRL packs sequences without sharing prompts), so the step is
priced without prefix sharing. With `dp_group` (and `same_micro_num_in_dp`, as in veRL) the
ranks agree through `plan_distributed`: the budget over `model_parallel_group`, the wave count
as the maximum over `dp_group`.

`install(planner, free_bytes)` puts it under veRL's own engine (the engine's
`prepare_micro_batches` and `prepare_dynamic_batch` call it instead of the token-budget
version; `max_token_len` is then ignored). See docs/integration.md for the plugin module and
the veRL configuration.

Peaks: measure each micro-batch's peak as it runs (e.g. `torch.cuda.max_memory_allocated()`
above `memory_allocated()` at its start) and pass them, in the plan's order, to
`observe_micro_batches(planner, plan, peaks)` or `handle.observe(peaks)`: the planner learns
from them, and a micro-batch whose peak went above its estimate is warned about and recorded
(`Planner.observe`, docs/faq.md#a-wave-missed-its-estimate).

`balance_batch` replaces the driver's data-parallel balance (`RayPPOTrainer._balance_batch`:
Karmarkar-Karp on 24576 s + s^2, equal counts, no memory priced) with the group plan
(`planner.group.plan_group`, equal counts, sequences unshared): the batch is reordered so that
the dispatch's equal chunks are the group plan's shares; `install(..., balance_dp=True)` puts
it in the driver.

torch and veRL are imported when called.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from waveplan.pricing.errors import ConfigError, InfeasibleError, bad
from waveplan.pricing.step import Step

from ..group import GroupPlan, plan_group
from ..misses import WaveObservation, misses, observe_waves
from ..plan import Plan
from ..planner import Planner


def sequence_lengths(batch) -> np.ndarray:
    """Each sequence's token count, read as veRL reads it: the offsets of a nested
    `input_ids`, else the row sums of `attention_mask`. O(B x S)."""
    try:
        input_ids = batch["input_ids"]
    except (KeyError, TypeError):
        raise bad(ConfigError, "batch", type(batch).__name__,
                  "must be a TensorDict (or dict) holding input_ids") from None
    if getattr(input_ids, "is_nested", False):
        lengths = input_ids.offsets().diff()
    else:
        try:
            lengths = batch["attention_mask"].sum(dim=1)
        except KeyError:
            raise bad(ConfigError, "batch", "attention_mask",
                      "a padded input_ids needs an attention_mask") from None
    return np.asarray(lengths.detach().cpu().numpy(), dtype=np.int64)


def _budget(free_bytes):
    return free_bytes() if callable(free_bytes) else free_bytes


def _units(n: int, force_group_size: int) -> list[list[int]]:
    if isinstance(force_group_size, bool) or not isinstance(force_group_size, int) or force_group_size < 1:
        raise bad(ConfigError, "force_group_size", force_group_size, "must be an integer >= 1")
    if n % force_group_size:
        raise bad(ConfigError, "force_group_size", force_group_size,
                  f"must divide the batch size {n}")
    if force_group_size == 1:
        return []
    return [list(range(i, i + force_group_size)) for i in range(0, n, force_group_size)]


def _wave_count(n: int, min_num_micro_batch, num_batches_divided_by) -> int:
    if min_num_micro_batch is not None:
        n = max(n, int(min_num_micro_batch))
    if num_batches_divided_by is not None:
        n = math.ceil(n / num_batches_divided_by) * num_batches_divided_by
    return n


def plan_micro_batches(batch, *, planner: Planner, free_bytes, dp_group=None,
                       model_parallel_group=None, group=None, num_batches_divided_by=None,
                       same_micro_num_in_dp: bool = True, min_num_micro_batch=None,
                       force_group_size: int = 1, grad: bool = True,
                       time_budget_ms: float | None = None) -> Plan:
    """The plan behind `rearrange_micro_batches`: the batch's sequences, unshared, cut into
    waves that fit `free_bytes` (bytes per rank; a number, one per rank, or a callable
    returning either, called once).

    With `dp_group` (and `same_micro_num_in_dp`) on an initialised `torch.distributed` job,
    every rank plans through `plan_distributed` (`group`, `model_parallel_group`, `dp_group`
    as there). The wave count is then raised to `min_num_micro_batch` and rounded up to a
    multiple of `num_batches_divided_by` (the same on every rank) and the step re-planned for
    exactly that count. `force_group_size` consecutive sequences stay in one wave (veRL's
    reward-model pairs); a group that would need split children is an `InfeasibleError`.
    O(planning) -- a few milliseconds for typical batches."""
    _check_padding(batch, planner)
    lengths = sequence_lengths(batch)
    n = int(lengths.size)
    units = _units(n, force_group_size)
    step = Step.from_lengths(np.zeros(n, np.int64), lengths, grads=grad)
    free = _budget(free_bytes)
    options = dict(atomic_units=units, time_budget_ms=time_budget_ms, deterministic=True)
    sync = same_micro_num_in_dp and dp_group is not None and _dist_ready()
    if sync:
        from ..distributed import plan_distributed

        def make(**extra):
            return plan_distributed(planner, step, free, group=group,
                                    model_parallel_group=model_parallel_group,
                                    dp_group=dp_group, **options, **extra)
    else:
        def make(**extra):
            return planner.plan(step, free, **options, **extra)
    plan = make()
    target = _wave_count(plan.num_waves, min_num_micro_batch, num_batches_divided_by)
    if target != plan.num_waves:
        if target > n:
            raise bad(InfeasibleError, "num_micro_batches", target,
                      f"the batch has only {n} sequences (min_num_micro_batch="
                      f"{min_num_micro_batch}, num_batches_divided_by={num_batches_divided_by})")
        plan = make(num_waves=target)
    split = [w.index for w in plan.waves if w.is_split]
    if split:
        raise bad(InfeasibleError, "force_group_size", force_group_size,
                  f"wave {split[0]} holds a group that does not fit the budget in one micro-batch")
    return plan


def _check_padding(batch, planner: Planner) -> None:
    """Refuse a batch veRL marks `use_remove_padding=False` (padded [B, S] rows) when the planner
    prices packed rows: a wave's padded rows are B x its longest, above its tokens, so its price
    would be under (docs/memory-model.md#fsdp-verl-options). O(1)."""
    layout = getattr(planner.model, "fsdp_layout", None)
    if layout is None or not layout.remove_padding:
        return
    try:
        flag = batch["use_remove_padding"]
    except (KeyError, TypeError, AttributeError):
        return
    flag = getattr(flag, "data", flag)   # tensordict's NonTensorData
    if flag is False or (not isinstance(flag, bool) and hasattr(flag, "item") and not flag.item()):
        raise bad(ConfigError, "use_remove_padding", False,
                  "the batch runs padded rows but the planner prices packed ones: build it with "
                  "remove_padding=False (install(..., remove_padding=False))")


def observe_micro_batches(planner: Planner, plan: Plan, peak_bytes) -> tuple[WaveObservation | None, ...]:
    """Feed each micro-batch's measured peak (bytes, in the plan's order; a number or one per
    rank; None or 0: not measured, skipped) to `planner.observe`. Returns the observations
    (`misses.misses` filters the misses, each already warned about and recorded). O(waves)."""
    if not isinstance(plan, Plan):
        raise bad(ConfigError, "plan", type(plan).__name__, "must be the Plan the micro-batches came from")
    return observe_waves(planner, plan.waves, peak_bytes)


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _select(batch, indices: list[int]):
    """veRL's own row selection (`tensordict_utils.index_select_tensor_dict`)."""
    from verl.utils import tensordict_utils as tu

    return tu.index_select_tensor_dict(batch, indices)


def rearrange_micro_batches(batch, *, planner: Planner, free_bytes, dp_group=None,
                            num_batches_divided_by=None, same_micro_num_in_dp: bool = True,
                            min_num_micro_batch=None, use_dynamic_bsz_balance: bool = True,
                            force_group_size: int = 1, model_parallel_group=None, group=None,
                            grad: bool = True, time_budget_ms: float | None = None):
    """Split a veRL batch (a TensorDict with `input_ids`, nested or padded with an
    `attention_mask`) into memory-priced micro-batches.

    Returns `(micro_batches, micro_bsz_idx)` as `verl.utils.seqlen_balancing.
    rearrange_micro_batches` does: the micro-batches (selected by veRL's
    `index_select_tensor_dict`) and, for each, the positions of its rows in `batch`
    (`restore_dynamic_batch(outputs, micro_bsz_idx)` puts the outputs back in order). One
    micro-batch per wave of `plan_micro_batches` (see there for the options); the plan's order
    is kept, so `use_dynamic_bsz_balance` (accepted for veRL's signature) reorders nothing."""
    del use_dynamic_bsz_balance  # the plan's order carries the adapter gradients first
    plan = plan_micro_batches(batch, planner=planner, free_bytes=free_bytes, dp_group=dp_group,
                              model_parallel_group=model_parallel_group, group=group,
                              num_batches_divided_by=num_batches_divided_by,
                              same_micro_num_in_dp=same_micro_num_in_dp,
                              min_num_micro_batch=min_num_micro_batch,
                              force_group_size=force_group_size, grad=grad,
                              time_budget_ms=time_budget_ms)
    indices = [list(w.request_indices) for w in plan.waves]
    return [_select(batch, idx) for idx in indices], indices


# --- the driver's data-parallel balance -------------------------------------------------------


def balance_batch(batch, dp: int, *, planner: Planner, free_bytes, metrics: dict | None = None,
                  logging_prefix: str = "global_seqlen", grad: bool = True,
                  time_budget_ms: float = 5.0) -> GroupPlan:
    """Reorder a veRL `DataProto` (its `attention_mask` gives each sequence's length, as
    `_balance_batch` reads it) in place so that its `dp` equal chunks, as veRL's dispatch cuts
    them, are the shares of the group plan: equal counts, every rank the same number of
    waves of `free_bytes` (a number, or one per data-parallel rank), balanced predicted time.
    Each share is planned as `plan_micro_batches` plans it on its rank (sequences unshared,
    the same `grad` and `time_budget_ms`), so the ranks' own plans need the group's wave count.
    `metrics` gets veRL's `log_seqlen_unbalance` figures. Returns the group plan. O(plan_group)."""
    import torch
    from verl.utils.seqlen_balancing import log_seqlen_unbalance

    mask = batch.batch["attention_mask"]
    lengths = mask.view(mask.shape[0], -1).sum(-1)
    n = int(lengths.numel())
    step = Step.from_lengths(np.zeros(n, np.int64), lengths.cpu().numpy().astype(np.int64), grads=grad)
    group = plan_group(planner, step, dp, _budget(free_bytes), keep_groups=False, equal_counts=True,
                       time_budget_ms=time_budget_ms)
    batch.reorder(torch.tensor([i for share in group.shares for i in share]))
    if metrics is not None:
        metrics.update(log_seqlen_unbalance(seqlen_list=lengths.tolist(),
                                            partitions=[list(s) for s in group.shares],
                                            prefix=logging_prefix))
    return group


# --- under veRL's engine --------------------------------------------------------------------

_PATCHED = ("verl.utils.seqlen_balancing", "verl.workers.engine.utils")


@dataclass
class Installed:
    """What `install` put in place: the planner and budget every call uses, the last plan
    made, how many calls were planned and what `observe` returned for the last plan's
    micro-batches. `restore()` puts veRL's token-budget function back."""

    planner: Planner
    free_bytes: object
    options: dict
    last_plan: Plan | None = None
    calls: int = 0
    last_observations: tuple[WaveObservation | None, ...] = ()
    _original: Callable | None = field(default=None, repr=False)
    last_group: GroupPlan | None = None
    _original_balance: Callable | None = field(default=None, repr=False)

    def balance(self, trainer, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        """`RayPPOTrainer._balance_batch`'s signature (`trainer` is the driver): the group
        plan's shares (`balance_batch`); veRL's own balance where the group plan does not
        apply (`keep_minibatch`, the prefix grouper)."""
        if keep_minibatch or getattr(trainer, "use_prefix_grouper", False):
            return self._original_balance(trainer, batch, metrics, logging_prefix=logging_prefix,
                                          keep_minibatch=keep_minibatch)
        dp = trainer._get_dp_size(trainer.actor_rollout_wg, "actor")
        self.last_group = balance_batch(batch, dp, planner=self.planner, free_bytes=self.free_bytes,
                                        metrics=metrics, logging_prefix=logging_prefix,
                                        grad=self.options["grad"],
                                        time_budget_ms=self.options["time_budget_ms"])

    def observe(self, peak_bytes) -> tuple[WaveObservation, ...]:
        """The last plan's micro-batch peaks (`observe_micro_batches`); returns the misses."""
        if self.last_plan is None:
            raise bad(ConfigError, "last_plan", None, "no micro-batches were planned yet")
        self.last_observations = observe_micro_batches(self.planner, self.last_plan, peak_bytes)
        return misses(self.last_observations)

    def rearrange(self, batch, max_token_len=None, dp_group=None, num_batches_divided_by=None,
                  same_micro_num_in_dp=True, min_num_micro_batch=None,
                  use_dynamic_bsz_balance=True, force_group_size=1):
        """veRL's `rearrange_micro_batches` signature; `max_token_len` is ignored."""
        del max_token_len
        options = {k: v() if k.endswith("group") and callable(v) else v
                   for k, v in self.options.items()}
        self.last_plan = plan_micro_batches(
            batch, planner=self.planner, free_bytes=self.free_bytes, dp_group=dp_group,
            num_batches_divided_by=num_batches_divided_by,
            same_micro_num_in_dp=same_micro_num_in_dp, min_num_micro_batch=min_num_micro_batch,
            force_group_size=force_group_size, **options)
        self.calls += 1
        indices = [list(w.request_indices) for w in self.last_plan.waves]
        return [_select(batch, idx) for idx in indices], indices

    def restore(self) -> None:
        import sys

        for name in _PATCHED:
            module = sys.modules.get(name)
            if module is not None and module.rearrange_micro_batches == self.rearrange:
                module.rearrange_micro_batches = self._original
        if self._original_balance is not None:
            trainer = sys.modules[_DRIVER].RayPPOTrainer
            trainer._balance_batch = self._original_balance
            self._original_balance = None


_DRIVER = "verl.trainer.ppo.ray_trainer"


def install(planner: Planner | object, free_bytes: object | Callable[[], object], *,
            model_parallel_group=None, group=None, grad: bool = True,
            time_budget_ms: float | None = None, balance_dp: bool = False,
            fsdp: int | None = None, remove_padding: bool = True,
            entropy_checkpointing: bool = False, liger: bool = False) -> Installed:
    """Make veRL's engine plan its dynamic micro-batches with `planner`: replaces
    `rearrange_micro_batches` in `verl.utils.seqlen_balancing` (used by
    `prepare_dynamic_batch`) and in `verl.workers.engine.utils` (used by the engine's
    `prepare_micro_batches`; also when that module is imported later, since it binds the name
    at import). `free_bytes` may be a callable, called at every split (e.g. free device
    memory minus a reserve); so may `model_parallel_group` and `group` (process groups that
    exist only once the engine has set up Megatron's parallel state, e.g.
    `parallel_state.get_model_parallel_group`, needed with TP/PP/CP > 1 so that
    model-parallel peers share one budget and one plan). Call it in every worker process,
    e.g. from a plugin module that veRL imports (`VERL_USE_EXTERNAL_MODULES`; see
    docs/integration.md). `balance_dp=True` (in the driver process): also replaces the driver's
    data-parallel balance, `RayPPOTrainer._balance_batch`, with the group plan
    (`Installed.balance`, `balance_batch`); `free_bytes` is then each rank's free bytes as the
    driver knows them (a number, or one per data-parallel rank). Under veRL's FSDP engine
    (strategy fsdp or fsdp2) `planner` may be the worker's live transformers model itself
    (PEFT-wrapped, `fully_shard`ed or not): the planner is then
    `Planner.from_hf_model(model, fsdp=fsdp)` (framework "fsdp"; `fsdp`: the shard group size
    when the model is not sharded yet; `remove_padding`, `entropy_checkpointing`, `liger`: the
    actor's `use_remove_padding`, `entropy_checkpointing` and `use_liger`, which the model does
    not carry, docs/memory-model.md#fsdp-verl-options). A micro-batch veRL marks
    `use_remove_padding=False` is refused by a planner that prices packed rows (its padded rows
    would be priced under)."""
    import importlib
    import sys

    import verl.utils.seqlen_balancing as balancing

    if not isinstance(planner, Planner):
        # veRL's FSDP engine (strategies fsdp, fsdp2): the worker's live transformers model
        planner = Planner.from_hf_model(planner, fsdp=fsdp, remove_padding=remove_padding,
                                        entropy_checkpointing=entropy_checkpointing, liger=liger)
    handle = Installed(planner=planner, free_bytes=free_bytes,
                       options=dict(model_parallel_group=model_parallel_group, group=group,
                                    grad=grad, time_budget_ms=time_budget_ms))
    handle._original = balancing.rearrange_micro_batches
    for name in _PATCHED:
        module = sys.modules.get(name)
        if module is not None:
            module.rearrange_micro_batches = handle.rearrange
    if balance_dp:
        trainer = importlib.import_module(_DRIVER).RayPPOTrainer
        handle._original_balance = trainer._balance_batch
        balance = handle.balance

        def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
            return balance(self, batch, metrics, logging_prefix=logging_prefix,
                           keep_minibatch=keep_minibatch)

        trainer._balance_batch = _balance_batch
    return handle
