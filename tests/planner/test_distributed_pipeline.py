"""plan_distributed across the two stages of a pipeline (2 gloo processes): each stage's budget
is the minimum over its ranks, every rank plans with the same stage budgets and gets the same
plan (the same hash check as tensor-parallel peers); a missing stage fails on every rank."""

from __future__ import annotations

import textwrap

import pytest
from gloo_ranks import run_ranks, warm_script

pytest.importorskip("torch.distributed")

# Room for a cold numba compile on a busy machine: a hang guard only.
TIMEOUT_S = 600
GIB = 2**30

WORKER = textwrap.dedent("""
    import faulthandler, json, os, sys
    faulthandler.dump_traceback_later(TIMEOUT_S - 30, exit=True)
    from waveplan.planner import Planner
    from waveplan.pricing.step import bundled_step, load_step

    planner = Planner.from_preset("qwen3-32b", tp=4, pp=2, sequence_parallel=True)
    step = load_step(bundled_step("grpo-8x8"))
    FREE = [20 * 2**30, 26 * 2**30]
    if sys.argv[1] == "warm":
        planner.plan(step, FREE[0], time_budget_ms=20.0, deterministic=True,
                     stage_free_bytes=FREE)
        sys.exit(0)

    import torch.distributed as dist
    from waveplan.planner.distributed import plan_distributed, plan_hash

    rank, port, case, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    stage = rank if case == "ok" else 0
    result = {"rank": rank}
    try:
        plan = plan_distributed(planner, step, FREE[rank], model_parallel_group=[[0, 1]],
                                pipeline_stage=stage, time_budget_ms=20.0)
        result.update(hash=plan_hash(plan), budgets=[s["budget_bytes"] for s in plan.stages],
                      fits=all(s["peak_bytes"] <= s["budget_bytes"] for s in plan.stages),
                      budget=plan.budget_bytes)
    except Exception as exc:
        result.update(error=type(exc).__name__, message=str(exc))
    with open(out, "w") as f:
        json.dump(result, f)
    dist.barrier()
    os._exit(0)
""").replace("TIMEOUT_S", str(TIMEOUT_S))


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    return warm_script(tmp_path_factory.mktemp("gloo-pp"), WORKER, timeout_s=TIMEOUT_S)


def _run(script, tmp_path, case):
    return run_ranks(script, tmp_path, 2, lambda r, port, out: [str(r), str(port), case, str(out)],
                     TIMEOUT_S, what=f"plan_distributed pipeline ({case})")


@pytest.mark.slow
def test_pipeline_stages_share_one_plan_with_their_own_budgets(worker, tmp_path):
    got = _run(worker, tmp_path, "ok")
    assert all("error" not in r for r in got), got
    assert got[0]["hash"] == got[1]["hash"]
    assert got[0]["budgets"] == got[1]["budgets"] == [20 * GIB, 26 * GIB]
    assert got[0]["budget"] == 20 * GIB and got[0]["fits"]


@pytest.mark.slow
def test_a_missing_stage_fails_on_every_rank(worker, tmp_path):
    got = _run(worker, tmp_path, "missing")
    assert [r.get("error") for r in got] == ["ConfigError"] * 2
    assert got[0]["message"] == got[1]["message"]
    assert "no rank of the model-parallel group is stage 1" in got[0]["message"]
