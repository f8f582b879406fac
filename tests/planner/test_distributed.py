"""plan_distributed on 4 gloo processes (DP2 x TP2), timeout-guarded so a hang fails (the
kernels are compiled before the ranks start, and the timeout leaves room for a cold compile)."""

from __future__ import annotations

import re
import textwrap

import pytest
from gloo_ranks import run_ranks, warm_script

pytest.importorskip("torch.distributed")

GIB = 2**30
# Room for a cold numba compile on a busy machine: a rank is only killed (after dumping its
# stack) when it is clearly stuck, never because it compiled slowly.
TIMEOUT_S = 600
CASES = ("ok", "infeasible", "mismatch")

WORKER = textwrap.dedent("""
    import faulthandler, json, os, sys
    faulthandler.dump_traceback_later(TIMEOUT_S - 30, exit=True)
    from waveplan.planner import Planner
    from waveplan.planner.distributed import plan_distributed, plan_hash
    from waveplan.planner.planner import budget_from_free_bytes
    from waveplan.pricing.errors import WaveplanError
    from waveplan.pricing.step import Request, Step
    from waveplan.search import check_plan


    def inputs(rank, case):
        dp_rank = rank // 2  # ranks {0,1} and {2,3} are TP groups (they share data)
        planner = Planner.from_preset("qwen3-8b", tp=2, sequence_parallel=True, recompute="full")
        if dp_rank == 0:  # many short requests, a generous budget
            reqs = [Request(id=f"a{i}", num_tokens=1024 + 64 * i, prompt=f"p{i // 4}",
                            num_prompt_tokens=512) for i in range(24)]
            free = [60 * 2**30, 55 * 2**30][rank % 2]
        else:  # few long requests, a tight budget
            reqs = [Request(id=f"b{i}", num_tokens=8192 + 2048 * i) for i in range(6)]
            free = [24 * 2**30, 20 * 2**30][rank % 2]
        if case == "infeasible" and rank == 2:
            reqs = reqs + [Request(id="huge", num_tokens=4_000_000)]
        if case == "infeasible" and rank == 3:
            reqs = reqs + [Request(id="huge", num_tokens=4_000_000)]
        if case == "mismatch" and rank == 1:  # a TP peer of rank 0 with another step
            reqs = reqs[:-1] + [Request(id="other", num_tokens=300)]
        if case == "mismatch" and rank == 3:  # a TP peer of rank 2 with another safety margin
            planner = Planner.from_preset("qwen3-8b", tp=2, sequence_parallel=True,
                                          recompute="full", safety=1.5)
        return planner, Step.from_requests(reqs), free


    def check(planner, step, plan):
        check_plan(step, planner.pricer(step), plan, budget_bytes=plan.budget_bytes)


    if sys.argv[1] == "warm":
        # One process plans every rank's inputs (and a re-plan to a forced wave count, as
        # plan_distributed does) without torch.distributed, so the kernels the ranks use are
        # compiled and cached before four processes would compile them at once.
        for case in sys.argv[2:]:
            for rank in range(4):
                planner, step, free = inputs(rank, case)
                budget = budget_from_free_bytes(free)
                try:
                    plan = planner.plan(step, budget, time_budget_ms=20.0, deterministic=True)
                    check(planner, step, plan)
                    plan = planner.plan(step, budget, time_budget_ms=20.0, deterministic=True,
                                        num_waves=plan.num_waves + 1)
                    check(planner, step, plan)
                except WaveplanError:
                    pass
        sys.exit(0)

    import torch.distributed as dist

    rank, world, port, case, out = int(sys.argv[1]), 4, sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    planner, step, free = inputs(rank, case)
    result = {"rank": rank}
    try:
        plan = plan_distributed(planner, step, free, model_parallel_group=[[0, 1], [2, 3]],
                                time_budget_ms=20.0)
        check(planner, step, plan)
        result.update(waves=plan.num_waves, hash=plan_hash(plan), budget=plan.budget_bytes)
    except Exception as exc:
        result.update(error=type(exc).__name__, message=str(exc))
    with open(out, "w") as f:
        json.dump(result, f)
    # every rank gets here (plan_distributed returns or raises on all alike). Gloo's
    # teardown sometimes aborts a process ("terminate called without an active exception")
    # after its result is written, under load even after a barrier; the result is on disk,
    # so leave without running destructors.
    dist.barrier()
    os._exit(0)
""").replace("TIMEOUT_S", str(TIMEOUT_S))


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """The rank script, after one process has compiled (or loaded) every kernel it uses."""
    return warm_script(tmp_path_factory.mktemp("gloo"), WORKER, *CASES, timeout_s=TIMEOUT_S)


def _run(script, tmp_path, case: str) -> list[dict]:
    return run_ranks(script, tmp_path, 4, lambda r, port, out: [str(r), str(port), case, str(out)],
                     TIMEOUT_S, what=f"plan_distributed ({case})")


@pytest.mark.slow
def test_dp2_tp2_agree_on_wave_count_and_tp_peers_share_a_plan(worker, tmp_path):
    res = _run(worker, tmp_path, "ok")
    assert all("error" not in r for r in res), res
    assert len({r["waves"] for r in res}) == 1, res  # both DP groups: same wave count
    assert res[0]["hash"] == res[1]["hash"] and res[2]["hash"] == res[3]["hash"]
    assert res[0]["budget"] == 55 * GIB and res[2]["budget"] == 20 * GIB  # MIN over TP


@pytest.mark.slow
def test_one_infeasible_dp_rank_makes_every_rank_raise_the_same_error(worker, tmp_path):
    res = _run(worker, tmp_path, "infeasible")
    assert {r.get("error") for r in res} == {"InfeasibleError"}, res
    assert len({r["message"] for r in res}) == 1, res
    assert res[0]["message"].startswith("rank 2: ")


@pytest.mark.slow
def test_tp_peers_with_different_inputs_make_every_rank_raise_the_same_error(worker, tmp_path):
    # the same-inputs assumption broken in both TP groups: rank 1 plans another step, rank 3
    # another safety margin; their hashes differ from their peers'. Every rank raises the
    # error of the lowest failing rank (0), which names the ranks and their hashes.
    res = _run(worker, tmp_path, "mismatch")
    assert {r.get("error") for r in res} == {"DistributedPlanError"}, res
    assert len({r["message"] for r in res}) == 1, res
    msg = res[0]["message"]
    assert msg.startswith("rank 0: plan_hash: model-parallel peers [0, 1] planned differently"), msg
    assert re.search(r"ranks \[0\] planned [0-9a-f]{12}; ranks \[1\] planned [0-9a-f]{12}", msg), msg


def test_hash_mismatch_names_each_hash_with_its_ranks():
    from waveplan.planner.distributed import DistributedPlanError, _hash_mismatch

    a, b = "a" * 64, "b" * 64
    assert _hash_mismatch([a, a, a], [4, 5, 6]) is None
    err = _hash_mismatch([a, b, a, a], [8, 9, 10, 11])
    assert isinstance(err, DistributedPlanError)
    assert str(err).startswith("plan_hash: model-parallel peers [8, 9, 10, 11] planned differently "
                               f"(ranks [8, 10, 11] planned {a[:12]}; ranks [9] planned {b[:12]})")
