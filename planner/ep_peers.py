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

Torch-free: the caller gathers `peer_rows`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from waveplan.pricing.model import PricingModel
from waveplan.pricing.price import GroupLoad

from .plan import Plan


def ep_peers_matter(model: PricingModel) -> bool:
    """Whether a wave's price depends on its EP peers' concurrent waves: a MoE model at EP > 1."""
    return model.geometry.moe is not None and model.parallel.ep > 1


def wave_call_rows(plan: Plan) -> list[int]:
    """Per wave, the padded rows of its largest forward call (a (child, class) group load): what
    this rank sends into the all-to-all of wave i at most. O(group loads)."""
    return [max((int(g.padded_rows) for g in w.loads), default=0) for w in plan.waves]


def raise_to_peer_rows(loads: Sequence[GroupLoad], peer_rows: int) -> tuple[GroupLoad, ...]:
    """`loads` with each forward call's rows raised to `peer_rows` where it has fewer: packed,
    padded and logical rows grow by the same difference (the added rows are padding: no new
    segments, so no new GDN states). O(loads)."""
    out = []
    for g in loads:
        extra = max(0, int(peer_rows) - int(g.padded_rows))
        out.append(g if extra == 0 else dataclasses.replace(
            g, packed_rows=g.packed_rows + extra, padded_rows=g.padded_rows + extra,
            logical_rows=g.logical_rows + extra))
    return tuple(out)


@dataclass(frozen=True)
class PeerOverflow:
    """The first wave of a plan whose price at its peers' concurrent rows exceeds the budget."""

    wave: int
    peer_rows: int
    own_rows: int
    admitted_bytes: int
    budget_bytes: int

    def message(self) -> str:
        return (f"wave {self.wave}: priced at its expert-parallel peers' largest concurrent forward "
                f"call ({self.peer_rows} rows against its own {self.own_rows}) it admits "
                f"{self.admitted_bytes} bytes > budget {self.budget_bytes}")


def peer_overflow(pricer, plan: Plan, peer_rows: Sequence[int]) -> PeerOverflow | None:
    """The first wave of `plan` that does not fit `plan.budget_bytes` once its forward calls are
    raised to `peer_rows[i]` (see the module docstring), or None when every wave fits. `pricer`
    is the step's pricer (`Planner.pricer(step)`): learned profiles apply as they do to the
    plan. Waves whose calls all reach their peers' rows keep their price. O(waves x loads)
    plus one walk per raised wave."""
    if len(peer_rows) != plan.num_waves:
        raise ValueError(f"peer_rows: {len(peer_rows)} entries for {plan.num_waves} waves")
    for i, wave in enumerate(plan.waves):
        raised = raise_to_peer_rows(wave.loads, peer_rows[i])
        if raised == tuple(wave.loads):
            continue
        admitted = int(pricer.price_loads(raised, first_slots=wave.first_slots).admitted_bytes)
        if admitted > plan.budget_bytes:
            return PeerOverflow(wave=i, peer_rows=int(peer_rows[i]),
                                own_rows=max((int(g.padded_rows) for g in wave.loads), default=0),
                                admitted_bytes=admitted, budget_bytes=int(plan.budget_bytes))
    return None
