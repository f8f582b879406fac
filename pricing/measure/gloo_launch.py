"""The launcher of the multi-rank tracers (`multirank`, `pipeline_trace`, `fsdp_trace`): one
spawned process per rank, each joining a gloo (or, on GPUs, nccl) group through a file and
running the tracer's rank entry (named 'module:function', imported in the rank), every rank's
results as JSON.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import tempfile
import time
import traceback

from ..errors import ConfigError


@contextlib.contextmanager
def _child_env():
    """Environment the rank processes inherit (spawn copies os.environ at start)."""
    wanted = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "MKL_NUM_THREADS": "1",
              "PYTHONHASHSEED": "0"}
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn(spec: dict, size: int, timeout_s: float, *, entry: str,
          backend: str = "gloo") -> list[list[dict]]:
    """Run `entry` ('module:function', taking the spec and returning a rank's list of job
    results) on `size` ranks of a `backend` group (gloo; nccl puts rank r on GPU r);
    every rank's list."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="waveplan-ranks-") as tmp:
        spec = dict(spec, init_file=os.path.join(tmp, "pg-init"), out_dir=tmp, entry=entry,
                    world_size=size, backend=backend)
        with _child_env():
            ctx = mp.start_processes(_rank_main, args=(spec,), nprocs=size, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + timeout_s + 60.0
        try:
            while not ctx.join(timeout=2.0):
                if time.monotonic() > deadline:
                    raise ConfigError(f"multi-rank trace: the {size} rank processes did not "
                                      f"finish within timeout_s={timeout_s:g} s"
                                      + _errors(tmp, size))
        except ConfigError:
            _stop(ctx)
            raise
        except Exception as exc:  # a rank failed: ProcessRaisedException / ProcessExitedException
            _stop(ctx)
            raise ConfigError(f"multi-rank trace failed: {exc}".rstrip() + _errors(tmp, size)) from None
        results = []
        for r in range(size):
            path = os.path.join(tmp, f"rank{r}.json")
            if not os.path.exists(path):
                raise ConfigError(f"multi-rank trace: rank {r} wrote no result" + _errors(tmp, size))
            with open(path, encoding="utf-8") as fh:
                results.append(json.load(fh))
        return results


def _errors(tmp: str, size: int) -> str:
    """The first rank error file's text, for an error message."""
    for r in range(size):
        path = os.path.join(tmp, f"rank{r}.error")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                return f"\nrank {r}: " + fh.read()[-4000:]
    return ""


def _stop(ctx) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    for p in ctx.processes:
        p.join(10)


# --- inside a rank process -----------------------------------------------------------------


def _rank_main(rank: int, spec: dict) -> None:
    """Entry point of rank `rank` (spawned): joins the group, runs `spec["entry"]`.
    Writes rank{r}.json, or rank{r}.error and re-raises; leaves with os._exit after a final
    barrier (gloo's teardown can abort a process after its result is written)."""
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    import datetime
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if spec["backend"] == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=spec["timeout_s"])
    dist.init_process_group(spec["backend"], init_method=f"file://{spec['init_file']}", rank=rank,
                            world_size=spec["world_size"], timeout=timeout)
    try:
        module, func = spec["entry"].split(":")
        results = getattr(importlib.import_module(module), func)(spec)
    except BaseException:
        with open(os.path.join(spec["out_dir"], f"rank{rank}.error"), "w", encoding="utf-8") as fh:
            fh.write(traceback.format_exc())
        raise
    tmp = os.path.join(spec["out_dir"], f"rank{rank}.json.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(results, fh)
    os.replace(tmp, os.path.join(spec["out_dir"], f"rank{rank}.json"))
    dist.barrier()
    os._exit(0)
