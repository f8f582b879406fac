"""Waves priced at their expert-parallel peers' concurrent rows (MoE with EP > 1).

A MoE layer's all-to-all is a collective over the expert-parallel group, so wave i of every EP
peer runs at the same time, and the busiest rank's routed rows at wave i come from every peer's
wave i: at most EP x min(top_k, E/EP) x the largest concurrent forward call's rows in the worst
case, at most moe_load x top_k x their mean with an assumed load
(docs/memory-model.md#expert-parallel, "Unequal waves across the EP group"). The single-rank
price assumes no peer's call is larger than this rank's own. When ranks plan different steps
that does not hold, so a plan is checked here with each of its forward calls raised to the
largest concurrent call of its peers (`peer_rows[i]`, the largest call of wave i over the
group): every term that grows with the rows, the routed ones included, is then priced at least
at what a peer-sized call holds, an upper bound of the busiest rank's routed rows under either
load. `planner.distributed.plan_distributed` gathers the peers' rows over the data-parallel group
(a superset of the EP group: expert parallelism is carved out of the data- and
context-parallel ranks, and context-parallel peers run the same wave) and adds waves until
every rank's check passes.

Which calls run side by side: a wave runs one forward call per (child, class) group load, each
with its own all-to-alls, so wave i's calls pair with the peers' wave-i calls only when every peer
runs as many calls in wave i (`concurrent_rows`); where the counts differ, a call may pair with a
peer's call of another wave, and every wave is checked at the largest call of the whole step.
Two upper bounds, and a wave fits when either does (PP1): (a) every call of the wave and every
term of it raised to the peers' rows (a wave of k small calls priced as k peer-sized calls);
(b) the wave as it is, with only the routed rows raised: the busiest rank's routed rows of each
call bound by the peers' largest concurrent call, `peer_row_scale` = peers' rows over the
wave's smallest call (`PricingModel.peer_row_scale`, which multiplies the busiest-rank load of
every routed-row term and the dispatcher's buffers); what does not go through the all-to-all
(attention, norms, the head, the shared expert, the boundaries, the adapter gradients) depends
on this rank's own rows only. (b) is the tighter one when the wave has one call or calls of
like size, (a) when a small call sits beside a large one.
With pipeline parallelism a stage holds several waves in flight, so the check is the plan's
1F1B windows, every wave raised as in (a), against each stage's budget (`search.pipeline`'s
exact check), not each wave alone.

Torch-free: the caller gathers the peers' rows and call counts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from waveplan.pricing import rope_cache
from waveplan.pricing.model import PricingModel
from waveplan.pricing.price import GroupLoad
from waveplan.pricing.stage_price import StagePricer
from waveplan.pricing.step import Step
from waveplan.search.contract import StagedPricer

from .plan import Plan


def ep_peers_matter(model: PricingModel) -> bool:
    """Whether a wave's price depends on its EP peers' concurrent waves: a MoE model at EP > 1."""
    return model.geometry.moe is not None and model.parallel.ep > 1


def single_rank_note(model: PricingModel) -> str | None:
    """What a plan made on one rank assumes at EP > 1 (None otherwise), for the plan table: its
    waves are priced with no EP peer running a larger concurrent wave."""
    if not ep_peers_matter(model):
        return None
    return (f"EP{model.parallel.ep}: each wave is priced with no expert-parallel peer running a larger "
            f"concurrent wave; data-parallel ranks with different steps must plan through "
            f"plan_distributed, which checks it (docs/memory-model.md#expert-parallel)")


def wave_call_rows(plan: Plan) -> list[int]:
    """Per wave, the padded rows of its largest forward call (a (child, class) group load): what
    this rank sends into the all-to-all of wave i at most. O(group loads)."""
    return [_own_rows(w) for w in plan.waves]


def _own_rows(wave) -> int:
    """The padded rows of a wave's largest forward call."""
    return max((int(g.padded_rows) for g in wave.loads), default=0)


def wave_calls(plan: Plan) -> list[int]:
    """Per wave, its forward calls (group loads): how many all-to-all rounds it runs. O(waves)."""
    return [len(w.loads) for w in plan.waves]


def concurrent_rows(peer_rows: Sequence[int], calls_min: Sequence[int],
                    calls_max: Sequence[int]) -> list[int]:
    """The rows each wave's calls are checked at: per wave, the peers' largest call of that wave
    (`peer_rows`, the MAX over the group) when every peer runs as many calls in every wave
    (`calls_min` == `calls_max`, the MIN and MAX over the group), else the largest call of the
    whole step for every wave (the calls pair across waves). O(waves)."""
    if list(calls_min) == list(calls_max):
        return [int(r) for r in peer_rows]
    top = max((int(r) for r in peer_rows), default=0)
    return [top] * len(peer_rows)


def raise_to_peer_rows(loads: Sequence[GroupLoad], peer_rows: int) -> tuple[GroupLoad, ...]:
    """`loads` with each forward call's rows raised to `peer_rows` where it has fewer: packed,
    padded and logical rows grow by the same difference (the added rows are padding: no new
    segments, so no new GDN states); the peer's longest sequence is unknown, so a raised call
    is priced as one sequence (`GroupLoad.longest_rows` None). O(loads)."""
    out = []
    for g in loads:
        extra = max(0, int(peer_rows) - int(g.padded_rows))
        out.append(g if extra == 0 else dataclasses.replace(
            g, packed_rows=g.packed_rows + extra, padded_rows=g.padded_rows + extra,
            logical_rows=g.logical_rows + extra, longest_rows=None))
    return tuple(out)


@dataclass(frozen=True)
class PeerOverflow:
    """What of a plan does not fit once its calls are raised to the peers' rows: a wave (PP1), or
    a pipeline stage's window of waves (PP > 1)."""

    wave: int
    peer_rows: int
    own_rows: int
    admitted_bytes: int
    budget_bytes: int
    stage: int | None = None
    window: tuple[int, int] | None = None

    def message(self) -> str:
        where = (f"wave {self.wave}" if self.stage is None else
                 f"pipeline stage {self.stage}'s window of waves {list(self.window)}")
        return (f"{where}: priced at its expert-parallel peers' largest concurrent forward call "
                f"({self.peer_rows} rows against its own {self.own_rows}) it admits "
                f"{self.admitted_bytes} bytes > budget {self.budget_bytes}")


def peer_row_scale(wave, peer_rows: int) -> float | None:
    """The factor bound (b) raises the busiest rank's routed rows by: the peers' largest
    concurrent call over the wave's smallest call (at least 1); None when the wave has a call
    of no rows (no finite factor bounds it: bound (a) alone applies). O(loads)."""
    smallest = min((int(g.padded_rows) for g in wave.loads), default=0)
    return max(1.0, int(peer_rows) / smallest) if smallest > 0 else None


def routed_pricers(planner, step: Step):
    """The `routed_pricer` of `peer_overflow` for `planner` (a `Planner`) and its `step`: for a
    scale, the step's pricer of the planner's model with `peer_row_scale=scale`, under the
    planner's profiles; one model per distinct scale, kept for the calls that follow."""
    cache: dict[float, object] = {}

    def routed(scale: float):
        if scale not in cache:
            cache[scale] = planner.pricer(step, model=dataclasses.replace(planner.model, peer_row_scale=scale))
        return cache[scale]
    return routed


def peer_overflow(pricer, plan: Plan, peer_rows: Sequence[int], *,
                  step: Step | None = None, routed_pricer=None) -> PeerOverflow | None:
    """The first wave of `plan` that does not fit `plan.budget_bytes` at its peers' rows
    `peer_rows[i]` (see the module docstring), or None when every wave fits. `pricer` is the
    step's pricer (`Planner.pricer(step)`): learned profiles apply as they do to the plan; it
    prices bound (a), every call raised. `routed_pricer(scale)`, when given, is the step's pricer
    of the same model with `peer_row_scale=scale` (bound (b), `routed_pricers`), asked only for
    waves (a) does not fit; a wave fits when either bound fits, and an overflow reports the smaller. Either
    bound carries the RoPE cache entries the earlier waves' raised calls leave (`rope_cache`),
    where the plan charges them (PP1). Waves whose calls all reach their peers' rows, and
    whose earlier waves' entries do not grow, keep their price. With PP > 1 (`step` required) the 1F1B
    windows of the waves raised as in (a), in the plan's order, are checked against each stage's
    budget instead (`stage_overflow`). O(waves x loads) plus one or two walks per raised wave
    (PP: one per wave and stage)."""
    if len(peer_rows) != plan.num_waves:
        raise ValueError(f"peer_rows: {len(peer_rows)} entries for {plan.num_waves} waves")
    stages = pricer.stages() if isinstance(pricer, StagedPricer) else None
    if stages is not None:
        if step is None:
            raise ValueError("step: needed to check a pipeline plan's windows")
        return stage_overflow(stages, step, plan, peer_rows)
    raised_all = [raise_to_peer_rows(w.loads, peer_rows[i]) for i, w in enumerate(plan.waves)]
    # the RoPE cache entries earlier waves leave on the rank (`rope_cache`), from the raised
    # calls (a raised call's longest sequence is unknown: its rows)
    charged = any(rope_cache.TERM in w.breakdown.terms for w in plan.waves)
    earlier = pricer.earlier_entries(raised_all) if charged else [0.0] * plan.num_waves
    for i, wave in enumerate(plan.waves):
        raised = raised_all[i]
        if raised == tuple(wave.loads) and math.ceil(earlier[i]) <= wave.breakdown.terms.get(rope_cache.TERM, 0):
            continue

        admitted = _with_earlier(pricer, pricer.price_loads(raised, first_slots=wave.first_slots),
                                 earlier[i], charged)
        if (admitted > plan.budget_bytes and routed_pricer is not None
                and (scale := peer_row_scale(wave, peer_rows[i])) is not None):
            routed = routed_pricer(scale).price_loads(tuple(wave.loads), first_slots=wave.first_slots)
            admitted = min(admitted, _with_earlier(pricer, routed, earlier[i], charged))
        if admitted > plan.budget_bytes:
            return PeerOverflow(wave=i, peer_rows=int(peer_rows[i]), own_rows=_own_rows(wave),
                                admitted_bytes=admitted, budget_bytes=int(plan.budget_bytes))
    return None


def _with_earlier(pricer, price, extra: float, charged: bool) -> int:
    """Admitted bytes of `price`, with `extra` bytes of earlier waves' RoPE cache entries where
    the plan charges them (`charged`). O(terms)."""
    return int((pricer.plus_earlier(price, extra) if charged else price).admitted_bytes)


def stage_overflow(stages: StagePricer, step: Step, plan: Plan,
                   peer_rows: Sequence[int]) -> PeerOverflow | None:
    """PP > 1: the first stage whose 1F1B window over the plan's waves, each raised to its
    peers' rows and run in the plan's order, exceeds the stage's budget (the budgets the plan
    was checked against, `plan.stages`), or None. The same exact check as the pipeline search's
    (`stage_price.price_parts`, `pipeline.peaks_from_parts`). O(p x W x (groups^2 + groups x L/p))."""
    budgets = [int(s["budget_bytes"]) for s in sorted(plan.stages, key=lambda s: s["stage"])]
    if len(budgets) != stages.num_stages:
        raise ValueError(f"plan.stages: {len(budgets)} stage budgets for pp={stages.num_stages}")
    raised = [(raise_to_peer_rows(w.loads, peer_rows[i]), w.first_slots) for i, w in enumerate(plan.waves)]
    parts = stages.parts(raised, max_len=stages.longest_sequence(step))
    for peak in stages.peaks(parts, budgets):
        if not peak.fits:
            lo, hi = peak.window
            waves = range(lo, hi + 1) if hi >= lo else range(plan.num_waves)
            worst = max(waves, key=lambda i: int(peer_rows[i]) - _own_rows(plan.waves[i]))
            return PeerOverflow(wave=worst, peer_rows=int(peer_rows[worst]),
                                own_rows=_own_rows(plan.waves[worst]), admitted_bytes=int(peak.peak_bytes),
                                budget_bytes=int(peak.budget_bytes), stage=peak.stage, window=(lo, hi))
    return None
