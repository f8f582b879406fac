"""Planning across the ranks of an initialised `torch.distributed` job.

Every rank calls `plan_distributed` with its own step and free memory; the ranks agree on the
budget, the wave count and the plan, or all raise the same documented error. torch is imported
lazily: `waveplan` itself does not need it.

Collectives, in order (`W` = `group`, every rank of the job; `MP` = this rank's
model-parallel group, the TP x CP x PP ranks that run a wave together; `DP` = this rank's
data-parallel group, one rank per model-parallel replica):

1. local check of `free_bytes`                   -> error flag: all_reduce MAX over W
2. budget:     all_reduce MIN (int64) over MP; then each rank plans -> error flag over W
3. wave count: all_reduce MAX (int64) over DP; each rank with fewer waves re-plans with
   `num_waves=max` (the search balances the requests over the extra waves; no empty or
   over-budget wave is ever added)                -> error flag over W
3b. MoE at EP > 1 only: each wave's largest forward call, all_reduce MAX over DP, and its call
   count, all_reduce MIN and MAX over DP (`ep_peers.concurrent_rows`); each rank checks its
   waves (PP > 1: its stages' windows) raised to those rows; at PP1 a wave fits when all its
   calls raised or its routed rows alone raised fit (`ep_peers.peer_overflow`)
   -> overflow flag: all_reduce
   MAX over W; while set, every rank re-plans with one wave more (at most `EP_ROUNDS` times,
   then InfeasibleError)                        -> error flag over W
4. plan hash:  all_gather of the sha256 of `plan.to_json()` without `planning_ms` over MP;
   all must agree (same inputs, same plan)       -> error flag over W; a mismatch is a
   `DistributedPlanError` naming each distinct hash and the global ranks that planned it.
   MP includes the pipeline stages: they run the same micro-batch sequence, and a PP plan's
   `stages` are part of the hashed JSON.

Error flag: one all_reduce MAX of a 0/1 flag over W after each local step and before the next
collective, so a failing rank never leaves its peers blocked. When it is set, one all_gather of
a fixed-size message buffer over W follows; every rank then raises the error of the lowest
failing rank: the same class (`ConfigError`, `StepError`, `InfeasibleError`, `WaveplanError`,
`DistributedPlanError`) and the same message, prefixed with `rank R: `. An exception that is
not a `WaveplanError` becomes a `DistributedPlanError` naming its type.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Sequence

from waveplan.pricing.errors import ConfigError, InfeasibleError, StepError, WaveplanError, bad

from .ep_peers import (
    concurrent_rows,
    ep_peers_matter,
    peer_overflow,
    routed_pricers,
    wave_call_rows,
    wave_calls,
)
from .plan import Plan
from .planner import Planner, budget_from_free_bytes

_MSG_BYTES = 1024
# re-plans with one wave more that step 3b tries before the overflowing ranks raise
EP_ROUNDS = 8


class DistributedPlanError(WaveplanError):
    """Ranks that should agree do not (different plans for the same inputs), or a rank failed
    with an undocumented exception; raised on every rank alike."""


_CODES: tuple[type[WaveplanError], ...] = (WaveplanError, ConfigError, StepError, InfeasibleError,
                                           DistributedPlanError)


def plan_hash(plan: Plan) -> str:
    """sha256 of the plan's JSON without the timings `planning_ms` and `compile_ms` (the only
    fields that may differ)."""
    data = plan.to_dict()
    data.pop("planning_ms", None)
    data.pop("compile_ms", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _hash_mismatch(hashes: Sequence[str], ranks: Sequence[int], *,
                   who: str = "model-parallel peers",
                   rule: str = "every peer of a model-parallel group must plan the same step "
                               "with the same settings") -> DistributedPlanError | None:
    """The error for model-parallel peers whose plan hashes differ (None when all agree): names
    each distinct hash (first 12 hex digits) with the global ranks that planned it, the
    majority first."""
    by_hash: dict[str, list[int]] = {}
    for h, r in zip(hashes, ranks, strict=True):
        by_hash.setdefault(h, []).append(int(r))
    if len(by_hash) <= 1:
        return None
    parts = sorted(by_hash.items(), key=lambda kv: (-len(kv[1]), kv[1]))
    detail = "; ".join(f"ranks {rs} planned {h[:12]}" for h, rs in parts)
    return DistributedPlanError(
        f"plan_hash: {who} {sorted(int(r) for r in ranks)} planned differently "
        f"({detail}): their steps, planner settings or plan options differ ({rule})")


def _rank_lists(spec: object, field: str) -> list[list[int]] | None:
    if spec is None or not isinstance(spec, Sequence) or isinstance(spec, str | bytes):
        return None
    lists = [list(r) for r in spec]
    if not lists or any(not r for r in lists) or any(
            isinstance(x, bool) or not isinstance(x, int) for r in lists for x in r):
        raise bad(ConfigError, field, spec, "must be a process group or a non-empty list of "
                  "non-empty lists of ranks")
    return lists


def _resolve(dist, spec, field: str, rank: int, world: int, world_group):
    """A process group for `spec` (a group, or rank lists: one group per list, made with
    `dist.new_group` on every rank in the same order). Returns (group, ranks or None)."""
    lists = _rank_lists(spec, field)
    if lists is None:
        return spec, None
    flat = sorted(x for r in lists for x in r)
    if flat != list(range(world)):
        raise bad(ConfigError, field, lists, f"the lists must partition ranks 0..{world - 1}")
    mine = None
    for r in lists:
        g = dist.new_group(ranks=sorted(r)) if len(r) < world else world_group
        if rank in r:
            mine = (g, sorted(r))
    return mine


def plan_distributed(planner: Planner, step, free_bytes, *, group=None, model_parallel_group=None,
                     dp_group=None, pipeline_stage: int | None = None, **plan_kwargs) -> Plan:
    """Plan `step` on every rank so that the model-parallel peers share one budget and one plan
    and every data-parallel replica runs the same number of waves (see the module docstring for
    the collectives and the error protocol).

    `group`: every rank taking part (default: the world). `model_parallel_group`: this rank's
    TP x CP x PP group, as a process group or as rank lists partitioning `group` (default: each
    rank alone). `dp_group`: this rank's data-parallel group, likewise (default: derived from
    rank lists of `model_parallel_group`, the i-th rank of every list together; otherwise
    every rank of `group`, which is right only when each model-parallel group is one rank).
    With expert parallelism (a MoE model at EP > 1) the waves' rows differ between the ranks,
    so every wave is also checked at its data-parallel peers' largest concurrent forward call,
    adding waves until all fit (step 3b, `planner.ep_peers`; docs/memory-model.md#expert-parallel,
    "Unequal waves across the EP group").
    `plan_kwargs` go to `Planner.plan`; `deterministic` defaults to True so that model-parallel
    peers with the same inputs compute byte-identical plans. Ranks are global ranks of the
    default group. `pipeline_stage` (PP > 1): this rank's pipeline stage; then each stage's
    budget is the minimum over its ranks of the model-parallel group (one all_gather over MP),
    and every rank plans with those `stage_free_bytes` (the same on every rank).
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError("torch.distributed: no process group is initialised "
                          "(call torch.distributed.init_process_group first)")
    world_group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank()
    world = dist.get_world_size(world_group)
    plan_kwargs.setdefault("deterministic", True)

    flag = _error_flag(dist, torch, world_group, rank, world)

    def step_local(fn):
        try:
            value, exc = fn(), None
        except Exception as e:  # every rank must learn of it; re-raised documented below
            value, exc = None, e
        flag(exc)
        return value

    # 0. groups (rank lists need dist.new_group, itself a collective on every rank)
    mp, dp = step_local(lambda: _groups(dist, rank, world, world_group, model_parallel_group,
                                        dp_group))
    if dp is None:
        flag(ConfigError("dp_group=None: give dp_group when model_parallel_group is a process group"))

    # 1. budget: MIN over the model-parallel group
    budget = step_local(lambda: budget_from_free_bytes(free_bytes))
    if pipeline_stage is not None:
        stage_budgets = _stage_budgets(dist, torch, mp, pipeline_stage, budget, planner)
        plan_kwargs = dict(plan_kwargs, stage_free_bytes=step_local(stage_budgets))
    t = torch.tensor([budget], dtype=torch.int64)
    if mp is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=mp)
    budget = int(t.item())

    # 2. plan locally
    plan = step_local(lambda: planner.plan(step, budget, **plan_kwargs))

    # 3. wave count: MAX over the data-parallel group; fewer -> re-plan, balanced
    t = torch.tensor([plan.num_waves], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp)
    target = int(t.item())
    if plan.num_waves < target:
        kwargs = dict(plan_kwargs, num_waves=target)
        plan = step_local(lambda: planner.plan(step, budget, **kwargs))
    else:
        step_local(lambda: None)

    # 3b. MoE at EP > 1: every wave priced at its peers' largest concurrent call (ep_peers)
    plan = _ep_peer_rounds(dist, torch, planner, step, plan, budget, plan_kwargs,
                           dp=dp, world_group=world_group, step_local=step_local, flag=flag)

    # 4. same inputs, same plan: all_gather of the hash over the model-parallel group
    if mp is not None:
        mine = torch.frombuffer(bytearray(bytes.fromhex(plan_hash(plan))), dtype=torch.uint8).clone()
        size = dist.get_world_size(mp)
        out = [torch.zeros_like(mine) for _ in range(size)]
        dist.all_gather(out, mine, group=mp)
        hashes = [bytes(o.tolist()).hex() for o in out]
        flag(_hash_mismatch(hashes, dist.get_process_group_ranks(mp)))
    else:
        flag(None)
    return plan


def _groups(dist, rank: int, world: int, world_group, model_parallel_group, dp_group):
    """(model-parallel group or None, data-parallel group or None) from the arguments of
    `plan_distributed` (see there for the defaults)."""
    mp, mp_ranks = _resolve(dist, model_parallel_group, "model_parallel_group", rank, world,
                            world_group)
    dp_spec = dp_group
    if dp_spec is None and mp_ranks is not None:
        lists = _rank_lists(model_parallel_group, "model_parallel_group")
        sizes = {len(r) for r in lists}
        if len(sizes) != 1:
            raise bad(ConfigError, "model_parallel_group", lists, "groups of different sizes; "
                      "give dp_group")
        dp_spec = [[sorted(r)[i] for r in lists] for i in range(sizes.pop())]
    if dp_spec is None:
        dp = world_group if model_parallel_group is None else None
    else:
        dp, _ = _resolve(dist, dp_spec, "dp_group", rank, world, world_group)
    return mp, dp


def plan_group_distributed(planner: Planner, step, free_bytes, *, group=None,
                           model_parallel_group=None, dp_group=None, return_group: bool = False,
                           **group_kwargs):
    """For trainers where every rank holds the whole batch: every rank computes the same group
    plan (`planner.group.plan_group`) and runs its own share. Collectives: the groups and the
    error flag as `plan_distributed`; the budget, MIN over the model-parallel group; each
    data-parallel rank's budget, all_gather over DP (in DP-group rank order); the group plan's
    hash, all_gather over every rank (a mismatch is a `DistributedPlanError`). Returns this
    rank's `Plan` (request indices are positions in the whole step), or with `return_group`
    the whole `GroupPlan`. `group_kwargs` go to `plan_group`."""
    import torch
    import torch.distributed as dist

    from .group import plan_group

    if not dist.is_initialized():
        raise ConfigError("torch.distributed: no process group is initialised "
                          "(call torch.distributed.init_process_group first)")
    world_group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank()
    world = dist.get_world_size(world_group)
    flag = _error_flag(dist, torch, world_group, rank, world)

    def step_local(fn):
        try:
            value, exc = fn(), None
        except Exception as e:  # every rank must learn of it
            value, exc = None, e
        flag(exc)
        return value

    mp, dp = step_local(lambda: _groups(dist, rank, world, world_group, model_parallel_group,
                                        dp_group))
    if dp is None:
        flag(ConfigError("dp_group=None: give dp_group when model_parallel_group is a process group"))
    budget = step_local(lambda: budget_from_free_bytes(free_bytes))
    t = torch.tensor([budget], dtype=torch.int64)
    if mp is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=mp)
    size = dist.get_world_size(dp)
    out = [torch.zeros_like(t) for _ in range(size)]
    dist.all_gather(out, t, group=dp)
    budgets = [int(o.item()) for o in out]
    me = dist.get_rank(dp)
    grouped = step_local(lambda: plan_group(planner, step, size, budgets, **group_kwargs))
    data = grouped.to_dict()
    data.pop("planning_ms", None)
    for r in data["ranks"]:
        r.pop("planning_ms", None)
        r.pop("compile_ms", None)
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
    mine = torch.frombuffer(bytearray(bytes.fromhex(digest)), dtype=torch.uint8).clone()
    hashes = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(hashes, mine, group=world_group)
    flag(_hash_mismatch([bytes(h.tolist()).hex() for h in hashes],
                        dist.get_process_group_ranks(world_group), who="ranks",
                        rule="every rank must plan the whole batch with the same settings"))
    return grouped if return_group else grouped.ranks[me]


def _error_flag(dist, torch, world_group, rank: int, world: int):
    """The error flag of the module docstring: a function every rank calls with its error (or
    None); it returns when no rank failed, else raises the lowest failing rank's error."""

    def flag(exc: BaseException | None) -> None:
        """All ranks: raise the lowest failing rank's error if any rank failed."""
        t = torch.tensor([0 if exc is None else 1], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world_group)
        if int(t.item()) == 0:
            return
        buf = torch.zeros(_MSG_BYTES, dtype=torch.uint8)
        if exc is not None:
            if isinstance(exc, WaveplanError):
                cls = next(c for c in reversed(_CODES) if isinstance(exc, c))
                text = str(exc)
            else:
                cls, text = DistributedPlanError, f"{type(exc).__name__}: {exc}"
            payload = f"rank {rank}: {text}".encode()[:_MSG_BYTES - 3]
            buf[0] = 1
            buf[1] = _CODES.index(cls)
            buf[2:2 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        out = [torch.zeros_like(buf) for _ in range(world)]
        dist.all_gather(out, buf, group=world_group)
        first = next(b for b in out if int(b[0]) == 1)
        raw = bytes(first[2:].tolist()).rstrip(b"\0").decode(errors="replace")
        err = _CODES[int(first[1])](raw)
        raise err from exc

    return flag


def _ep_peer_rounds(dist, torch, planner: Planner, step, plan: Plan, budget: int, plan_kwargs: dict,
                    *, dp, world_group, step_local, flag) -> Plan:
    """Step 3b (a MoE model at EP > 1; a no-op otherwise, with no collective): all_reduce MAX
    over DP of each wave's largest forward call (`ep_peers.wave_call_rows`) and MIN and MAX of
    its call count (`ep_peers.concurrent_rows`: unequal counts check every wave at the step's
    largest call), then each rank checks its waves, or with PP > 1 its stages' windows, raised
    to those rows (`ep_peers.peer_overflow`: at PP1 a wave fits when all its calls raised, or its
    routed rows alone raised, fit); all_reduce MAX of the
    overflow flag over W. While some rank overflows, every rank re-plans with one wave more (the
    search spreads the requests, so the peers' concurrent calls shrink), at most `EP_ROUNDS`
    times; then the overflowing ranks raise `InfeasibleError` (through the error flag). Every
    rank runs the same rounds. Returns the checked plan, its `stats["ep_peer_rounds"]` the
    re-plans it took. O(rounds x (waves x loads + one plan))."""
    if not ep_peers_matter(planner.model):
        return plan
    routed = routed_pricers(planner, step)   # bound (b): only the routed rows raised
    rounds = 0
    while True:
        rows = torch.tensor(wave_call_rows(plan), dtype=torch.int64)
        calls_min = torch.tensor(wave_calls(plan), dtype=torch.int64)
        calls_max = calls_min.clone()
        dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=dp)
        dist.all_reduce(calls_min, op=dist.ReduceOp.MIN, group=dp)
        dist.all_reduce(calls_max, op=dist.ReduceOp.MAX, group=dp)
        peer_rows = concurrent_rows(rows.tolist(), calls_min.tolist(), calls_max.tolist())
        over = step_local(lambda p=plan, r=peer_rows: peer_overflow(planner.pricer(step), p, r, step=step,
                                                                    routed_pricer=routed))
        t = torch.tensor([0 if over is None else 1], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world_group)
        if int(t.item()) == 0:
            break
        if rounds == EP_ROUNDS:
            # every rank calls flag (a collective); only the overflowing ranks pass an error
            flag(None if over is None else InfeasibleError(
                f"expert-parallel peers: {over.message()} after {rounds} re-plans with more waves; "
                f"plan steps of similar size on every data-parallel rank, or bound the routed rows "
                f"with moe_load (docs/memory-model.md#expert-parallel)"))
        rounds += 1
        kwargs = dict(plan_kwargs, num_waves=plan.num_waves + 1)
        plan = step_local(functools.partial(_replan_for_peers, planner, step, budget, kwargs))
    return dataclasses.replace(plan, stats={**plan.stats, "ep_peer_rounds": rounds})


def _replan_for_peers(planner: Planner, step, budget: int, kwargs: dict) -> Plan:
    """Step 3b's re-plan with one wave more; its InfeasibleError says why it was asked for."""
    try:
        return planner.plan(step, budget, **kwargs)
    except InfeasibleError as exc:
        raise InfeasibleError(
            f"expert-parallel peers: a wave of the group does not fit at its peers' largest "
            f"concurrent forward call, and re-planning with {kwargs['num_waves']} waves failed: "
            f"{exc}") from exc


def _stage_budgets(dist, torch, mp, stage, budget: int, planner: Planner):
    """All_gather of (stage, budget) over the model-parallel group (collective: every rank
    calls it); returns a function that gives each stage's budget, the minimum over its ranks,
    or raises ConfigError (run through the error flag). O(MP)."""
    mine = torch.tensor([int(stage) if isinstance(stage, int) and not isinstance(stage, bool)
                         else -1, int(budget)], dtype=torch.int64)
    if mp is not None:
        out = [torch.zeros_like(mine) for _ in range(dist.get_world_size(mp))]
        dist.all_gather(out, mine, group=mp)
    else:
        out = [mine]
    pairs = [(int(o[0]), int(o[1])) for o in out]

    def stage_budgets() -> list[int]:
        pp = planner.model.parallel.pp
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < pp:
            raise bad(ConfigError, "pipeline_stage", stage, f"must be an integer in [0, {pp}) "
                      f"(the planner's pp={pp})")
        budgets = [min((b for s, b in pairs if s == k), default=None) for k in range(pp)]
        missing = [k for k, b in enumerate(budgets) if b is None]
        if missing:
            raise ConfigError(f"pipeline_stage: no rank of the model-parallel group is stage "
                              f"{missing[0]} (stages seen: {sorted({s for s, _ in pairs})})")
        return budgets

    return stage_budgets
