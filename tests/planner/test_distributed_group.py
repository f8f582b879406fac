"""`plan_group_distributed` on two gloo ranks that each hold the whole batch: both compute
the same group plan from their gathered budgets (the group's JSON hashes agree), each gets its
own share with the same wave count, the shares cover the batch once; ranks that hold
different batches all raise the same `DistributedPlanError`."""

from __future__ import annotations

import textwrap

import pytest
from gloo_ranks import run_ranks

pytest.importorskip("torch.distributed")

GIB = 2**30
TIMEOUT_S = 600

WORKER = textwrap.dedent("""
    import faulthandler, json, os, sys
    faulthandler.dump_traceback_later(570, exit=True)
    import torch.distributed as dist
    from waveplan.planner import Planner
    from waveplan.planner.distributed import plan_group_distributed
    from waveplan.pricing.errors import WaveplanError
    from waveplan.pricing.step import Request, Step

    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    planner = Planner.from_preset("qwen3-8b", recompute="full")

    def batch(extra):
        return Step.from_requests(
            Request(id=f"g{g}-{c}", prompt=f"g{g}", num_prompt_tokens=300 + 50 * g,
                    num_tokens=300 + 50 * g + 200 + 700 * ((g * 7 + c * 3) % 11) + extra)
            for g in range(6) for c in range(4))

    free = [8, 6][rank] * 2**30
    group = plan_group_distributed(planner, batch(0), free, return_group=True)
    mine = plan_group_distributed(planner, batch(0), free)
    res = {"waves": [p.num_waves for p in group.ranks], "shares": [list(s) for s in group.shares],
           "budgets": [p.budget_bytes for p in group.ranks],
           "mine": sorted(i for w in mine.waves for i in w.request_indices)}
    try:
        plan_group_distributed(planner, batch(rank), free)
    except WaveplanError as exc:
        res["error"] = type(exc).__name__
        res["message"] = str(exc)
    with open(out, "w") as f:
        json.dump(res, f)
    # gloo's teardown sometimes aborts a process ("terminate called without an active
    # exception") under load; the result is on disk, so leave without running destructors
    dist.barrier()
    os._exit(0)
""")


@pytest.mark.slow
def test_every_rank_computes_the_same_group_plan(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    res = run_ranks(script, tmp_path, 2, lambda r, port, out: [str(r), str(port), str(out)],
                    TIMEOUT_S, what="plan_group_distributed")
    assert res[0]["shares"] == res[1]["shares"] and res[0]["waves"] == res[1]["waves"]
    assert len(set(res[0]["waves"])) == 1
    assert res[0]["budgets"] == [8 * GIB, 6 * GIB]
    shares = res[0]["shares"]
    assert sorted(i for s in shares for i in s) == list(range(24))
    assert res[0]["mine"] == shares[0] and res[1]["mine"] == shares[1]
    assert {r["error"] for r in res} == {"DistributedPlanError"}
    assert res[0]["message"] == res[1]["message"]
    assert "plan_hash: ranks [0, 1] planned differently" in res[0]["message"]
