"""Waves priced at their expert-parallel peers' concurrent rows (planner.ep_peers), on one
process, and plan_distributed's step 3b on two gloo ranks (DP2 = EP2) planning unequal steps."""

from __future__ import annotations

import dataclasses
import textwrap
from types import SimpleNamespace

import pytest
from gloo_ranks import run_ranks, warm_script

from waveplan.planner import Planner
from waveplan.planner.ep_peers import (
    concurrent_rows,
    ep_peers_matter,
    peer_overflow,
    peer_row_scale,
    raise_to_peer_rows,
    routed_pricers,
    wave_call_rows,
    wave_calls,
)
from waveplan.pricing.errors import ConfigError
from waveplan.pricing.model import PricingModel
from waveplan.pricing.price import GroupLoad
from waveplan.pricing.step import Request, Step

GIB = 2**30
TIMEOUT_S = 600


def _long() -> Step:   # few long requests: large waves
    return Step.from_requests([Request(id=f"b{i}", num_tokens=16384 + 2048 * i) for i in range(6)])


def _short() -> Step:  # many short requests
    return Step.from_requests([Request(id=f"a{i}", num_tokens=1024 + 64 * i) for i in range(48)])


@pytest.fixture(scope="module")
def moe_ep2():
    return Planner.from_preset("qwen3-30b-a3b", ep=2, recompute="full")


def test_only_moe_at_ep_above_one_depends_on_its_peers(moe_ep2):
    assert ep_peers_matter(moe_ep2.model)
    assert not ep_peers_matter(Planner.from_preset("qwen3-30b-a3b", recompute="full").model)
    assert not ep_peers_matter(Planner.from_preset("qwen3-8b", tp=2, recompute="full").model)


def test_raising_a_call_adds_padding_rows_only_where_it_has_fewer():
    g = GroupLoad(slot="s", grad=True, packed_rows=100, padded_rows=104, logical_rows=120, segments=3)
    small, = raise_to_peer_rows([g], 50)
    assert small is g
    big, = raise_to_peer_rows([g], 204)
    assert (big.packed_rows, big.padded_rows, big.logical_rows, big.segments) == (200, 204, 220, 3)
    assert (big.slot, big.grad) == ("s", True)


def test_calls_pair_within_a_wave_only_when_every_peer_runs_as_many():
    assert concurrent_rows([300, 100, 200], [1, 2, 1], [1, 2, 1]) == [300, 100, 200]
    # a peer runs two calls in wave 1 where another runs one: calls pair across waves, so every
    # wave is checked at the step's largest call
    assert concurrent_rows([300, 100, 200], [1, 1, 1], [1, 2, 1]) == [300, 300, 300]
    assert concurrent_rows([], [], []) == []


def test_a_plan_checked_at_its_own_rows_never_overflows(moe_ep2):
    step = _short()
    plan = moe_ep2.plan(step, 24 * GIB, deterministic=True, time_budget_ms=20.0)
    assert peer_overflow(moe_ep2.pricer(step), plan, wave_call_rows(plan)) is None


def test_a_wave_beside_a_larger_peer_call_is_priced_at_the_peer_rows(moe_ep2):
    # the short step at 20 GiB, its waves beside the long step's at 80 GiB (same wave count):
    # some wave of the short plan no longer fits once priced at its peer's rows
    short, long_ = _short(), _long()
    small = moe_ep2.plan(short, 20 * GIB, deterministic=True, time_budget_ms=20.0)
    big = moe_ep2.plan(long_, 80 * GIB, deterministic=True, time_budget_ms=20.0,
                       num_waves=small.num_waves)
    peer = [max(a, b) for a, b in zip(wave_call_rows(big), wave_call_rows(small), strict=True)]
    pricer = moe_ep2.pricer(short)
    over = peer_overflow(pricer, small, peer)
    assert over is not None and over.admitted_bytes > small.budget_bytes
    assert over.peer_rows == peer[over.wave] > over.own_rows == wave_call_rows(small)[over.wave]
    wave = small.waves[over.wave]
    assert over.admitted_bytes > wave.breakdown.admitted_bytes   # the peer's rows cost more
    assert "expert-parallel peers' largest concurrent forward call" in over.message()
    assert peer_overflow(moe_ep2.pricer(long_), big, peer) is None   # the larger rank: unchanged
    with pytest.raises(ValueError, match="peer_rows"):
        peer_overflow(pricer, small, peer[:-1])


def test_raising_only_the_routed_rows_is_a_tighter_bound_than_raising_every_term(moe_ep2):
    # bound (b): the wave as it is, the busiest rank's routed rows x peers' rows / its smallest call;
    # on one-call waves it lies between the wave's own price and bound (a), every term raised
    short, long_ = _short(), _long()
    small = moe_ep2.plan(short, 20 * GIB, deterministic=True, time_budget_ms=20.0)
    big = moe_ep2.plan(long_, 80 * GIB, deterministic=True, time_budget_ms=20.0, num_waves=small.num_waves)
    peer = [max(a, b) for a, b in zip(wave_call_rows(big), wave_call_rows(small), strict=True)]
    routed, pricer = routed_pricers(moe_ep2, short), moe_ep2.pricer(short)
    raised_waves = 0
    for i, wave in enumerate(small.waves):
        assert len(wave.loads) == 1
        scale = peer_row_scale(wave, peer[i])
        assert scale == max(1.0, peer[i] / wave.loads[0].padded_rows)
        # the wave's own price (the plan's also carries the earlier waves' RoPE cache entries)
        own = pricer.price(list(wave.children), first_slots=wave.first_slots).admitted_bytes
        b = routed(scale).price_loads(tuple(wave.loads), first_slots=wave.first_slots).admitted_bytes
        a = pricer.price_loads(raise_to_peer_rows(wave.loads, peer[i]), first_slots=wave.first_slots).admitted_bytes
        if scale == 1.0:
            assert a == b == own
            continue
        raised_waves += 1
        assert own < b < a
    assert raised_waves >= 1
    # a budget between the two bounds: (a) alone overflows, either bound fitting is enough
    i = max(range(small.num_waves), key=lambda j: pricer.price_loads(
        raise_to_peer_rows(small.waves[j].loads, peer[j]), first_slots=small.waves[j].first_slots).admitted_bytes)
    wave = small.waves[i]
    only = [peer[j] if j == i else wave_call_rows(small)[j] for j in range(small.num_waves)]
    # both bounds carry the RoPE cache entries the earlier waves' raised calls leave
    extra = pricer.earlier_entries([raise_to_peer_rows(w.loads, only[j]) for j, w in enumerate(small.waves)])[i]
    a = pricer.plus_earlier(pricer.price_loads(raise_to_peer_rows(wave.loads, peer[i]), first_slots=wave.first_slots),
                            extra).admitted_bytes
    b = pricer.plus_earlier(routed(peer_row_scale(wave, peer[i])).price_loads(tuple(wave.loads),
                                                                             first_slots=wave.first_slots),
                            extra).admitted_bytes
    roomy = dataclasses.replace(small, budget_bytes=max(int((a + b) // 2), max(w.breakdown.admitted_bytes
                                                                              for w in small.waves)))
    assert peer_overflow(pricer, roomy, only).admitted_bytes == a
    assert peer_overflow(pricer, roomy, only, routed_pricer=routed) is None
    tight = dataclasses.replace(small, budget_bytes=int(b) - 1)
    assert peer_overflow(pricer, tight, only, routed_pricer=routed).admitted_bytes == b   # the smaller bound


def test_the_peer_row_scale_moves_routed_rows_only():
    # a dense model has no routed rows: its price does not move with the scale
    dense = Planner.from_preset("qwen3-8b", recompute="full")
    step = _short()
    wave = dense.plan(step, 24 * GIB, deterministic=True, time_budget_ms=20.0).waves[0]
    scaled = routed_pricers(dense, step)(3.0)
    assert scaled.price_loads(tuple(wave.loads), first_slots=wave.first_slots).admitted_bytes == \
        wave.breakdown.admitted_bytes


def test_the_peer_row_scale_multiplies_the_busiest_rank_load_and_nothing_else():
    # a MoE model at an assumed load L with peer_row_scale s is the same model at load L x s:
    # the scale reaches exactly the terms the busiest-rank load reaches (the routed rows)
    step = _short()
    at = {load: Planner.from_preset("qwen3-30b-a3b", ep=4, recompute="full", moe_load=load) for load in (1.0, 1.5)}
    wave = at[1.0].plan(step, 24 * GIB, deterministic=True, time_budget_ms=20.0).waves[0]
    scaled = routed_pricers(at[1.0], step)(1.5)
    direct = at[1.5].pricer(step)
    price = lambda p: p.price_loads(tuple(wave.loads), first_slots=wave.first_slots).admitted_bytes  # noqa: E731
    assert price(scaled) == price(direct) > price(at[1.0].pricer(step))
    assert peer_row_scale(wave, 0) == 1.0
    assert peer_row_scale(SimpleNamespace(loads=()), 100) is None   # no call: bound (a) alone


def test_the_peer_row_scale_is_validated_naming_the_field(moe_ep2):
    for bad_scale in (0.5, float("inf"), True, "2"):
        with pytest.raises(ConfigError, match="peer_row_scale"):
            dataclasses.replace(moe_ep2.model, peer_row_scale=bad_scale)
    assert isinstance(dataclasses.replace(moe_ep2.model, peer_row_scale=2), PricingModel)
    assert "peer_row_scale" not in moe_ep2.model.to_dict()


def test_a_pipeline_plan_is_checked_window_by_window(moe_ep2):
    # PP2: the stages' 1F1B windows of the raised waves against their budgets, not each wave alone
    pp = Planner.from_preset("qwen3-30b-a3b", ep=2, pp=2, recompute="full")
    step = _short()
    plan = pp.plan(step, 24 * GIB, deterministic=True, time_budget_ms=20.0)
    assert len(plan.stages) == 2
    pricer = pp.pricer(step)
    own = wave_call_rows(plan)
    assert wave_calls(plan) == [len(w.loads) for w in plan.waves]
    assert peer_overflow(pricer, plan, own, step=step) is None
    over = peer_overflow(pricer, plan, [4 * max(own)] * plan.num_waves, step=step)
    assert over is not None and over.stage in (0, 1) and over.window is not None
    assert over.admitted_bytes > over.budget_bytes
    assert over.message().startswith(f"pipeline stage {over.stage}'s window of waves")
    with pytest.raises(ValueError, match="step"):
        peer_overflow(pricer, plan, own)


WORKER = textwrap.dedent("""
    import faulthandler, json, os, sys
    faulthandler.dump_traceback_later(TIMEOUT_S - 30, exit=True)
    from waveplan.planner import Planner
    from waveplan.planner.distributed import plan_distributed
    from waveplan.planner.ep_peers import peer_overflow, routed_pricers, wave_call_rows
    from waveplan.pricing.errors import InfeasibleError
    from waveplan.pricing.step import Request, Step
    from waveplan.search import check_plan

    GIB = 2**30


    def inputs(rank, case):
        planner = Planner.from_preset("qwen3-30b-a3b", ep=2, recompute="full")
        if rank == 0 and case != "same":   # "stuck": five longer requests, so no sixth wave can be added
            n, base = (5, 40000) if case == "stuck" else (6, 16384)
            step = Step.from_requests([Request(id=f"b{i}", num_tokens=base + 2048 * i) for i in range(n)])
            return planner, step, 80 * GIB
        step = Step.from_requests([Request(id=f"a{i}", num_tokens=1024 + 64 * i) for i in range(48)])
        return planner, step, (80 * GIB if case == "same" else 20 * GIB)


    if sys.argv[1] == "warm":
        for case in sys.argv[2:]:
            for rank in range(2):
                planner, step, free = inputs(rank, case)
                for waves in (None, 5, 6):
                    try:
                        plan = planner.plan(step, free, time_budget_ms=20.0, deterministic=True,
                                            num_waves=waves)
                    except InfeasibleError:
                        continue
                    peer_overflow(planner.pricer(step), plan, [10**6] * plan.num_waves)
        sys.exit(0)

    import torch
    import torch.distributed as dist

    rank, port, case, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    planner, step, free = inputs(rank, case)
    try:
        plan = plan_distributed(planner, step, free, time_budget_ms=20.0)
    except InfeasibleError as exc:
        with open(out, "w") as f:
            json.dump({"error": type(exc).__name__, "message": str(exc)}, f)
        dist.barrier()
        os._exit(0)
    check_plan(step, planner.pricer(step), plan, budget_bytes=plan.budget_bytes)
    rows = torch.tensor(wave_call_rows(plan), dtype=torch.int64)
    dist.all_reduce(rows, op=dist.ReduceOp.MAX)
    over = peer_overflow(planner.pricer(step), plan, [int(x) for x in rows.tolist()],
                         routed_pricer=routed_pricers(planner, step))
    with open(out, "w") as f:
        json.dump({"waves": plan.num_waves, "rounds": plan.stats["ep_peer_rounds"],
                   "over": None if over is None else over.message()}, f)
    dist.barrier()
    os._exit(0)
""").replace("TIMEOUT_S", str(TIMEOUT_S))


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    return warm_script(tmp_path_factory.mktemp("gloo_ep"), WORKER, "unequal", "same", "stuck",
                       timeout_s=TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["unequal", "same"])
def test_plan_distributed_adds_waves_until_every_wave_fits_at_its_peers_rows(worker, tmp_path, case):
    res = run_ranks(worker, tmp_path, 2, lambda r, port, out: [str(r), str(port), case, str(out)],
                    TIMEOUT_S, what=f"plan_distributed EP ({case})")
    assert res[0]["waves"] == res[1]["waves"], res
    assert [r["over"] for r in res] == [None, None], res   # every wave fits at its peers' rows
    assert res[0]["rounds"] == res[1]["rounds"], res
    if case == "unequal":   # the 20 GiB rank's waves beside the 80 GiB rank's: re-planned
        assert res[0]["rounds"] >= 1, res
    else:                   # the same step and budget on both ranks: nothing changes
        assert res[0]["rounds"] == 0, res


@pytest.mark.slow
def test_plan_distributed_raises_on_every_rank_when_no_more_waves_can_be_added(worker, tmp_path):
    # the 80 GiB rank's five long requests beside the 20 GiB rank's waves: a sixth wave is needed
    # and the long step has no sixth request, so both ranks raise rank 0's error
    res = run_ranks(worker, tmp_path, 2, lambda r, port, out: [str(r), str(port), "stuck", str(out)],
                    TIMEOUT_S, what="plan_distributed EP (stuck)")
    assert {r.get("error") for r in res} == {"InfeasibleError"}, res
    assert res[0]["message"] == res[1]["message"], res
    assert res[0]["message"].startswith(
        "rank 0: expert-parallel peers: a wave of the group does not fit at its peers' largest "
        "concurrent forward call, and re-planning with 6 waves failed"), res
