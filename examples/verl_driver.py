"""veRL's dynamic batching priced by waveplan, on the CPU: the plugin of docs/integration.md
(examples/waveplan_verl_plugin.py) installed by veRL itself.

veRL imports every module named in `VERL_USE_EXTERNAL_MODULES` when `verl` is imported; the
plugin builds a `Planner` from `WAVEPLAN_HF_CONFIG` and puts it under veRL's engine
(`prepare_micro_batches`). This driver sets those variables, imports veRL, and splits one
batch of random sequences the way veRL's actor does with `use_dynamic_bsz`: the micro-batches
are the waves of a plan. Without a GPU the plugin cannot ask the device for its free memory,
so `WAVEPLAN_FREE_GIB` (here `--free-gib`) states the budget per rank; on GPUs the plugin
uses `torch.cuda.mem_get_info()` less `WAVEPLAN_RESERVE_GIB` and the variable is not read.

Run:  .venv/bin/python examples/verl_driver.py [--config config.json] [--free-gib 12]
      [--sequences 32] [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE.parent / "tests" / "data" / "hf" / "qwen3-8b.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG),
                        help="the model's Hugging Face config.json (default: Qwen3-8B's)")
    parser.add_argument("--free-gib", default="12", help="budget per rank without a GPU (GiB)")
    parser.add_argument("--sequences", type=int, default=32, help="sequences in the batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    # what the veRL configuration's ray_kwargs.ray_init.runtime_env.env_vars sets on every worker
    os.environ.update(VERL_USE_EXTERNAL_MODULES="waveplan_verl_plugin",
                      WAVEPLAN_HF_CONFIG=args.config, WAVEPLAN_FREE_GIB=args.free_gib)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    sys.path.insert(0, str(HERE))          # the plugin's folder, as PYTHONPATH does for a worker

    import torch
    import verl  # noqa: F401  (imports waveplan_verl_plugin, which installs waveplan)
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine import utils as engine_utils

    plugin = sys.modules["waveplan_verl_plugin"]
    rng = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(512, 8192, (args.sequences,), generator=rng).tolist()
    rows = [torch.randint(1, 1000, (n,), generator=rng) for n in lengths]
    data = TensorDict({"input_ids": torch.nested.as_nested_tensor(rows, layout=torch.jagged)},
                      batch_size=len(rows))
    tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=16384)
    micro, indices = engine_utils.prepare_micro_batches(data=data, dp_group=None)

    plan = plugin.handle.last_plan
    result = {"sequences": len(rows), "tokens": sum(lengths), "micro_batches": len(micro),
              "plans": plugin.handle.calls,
              "waves": plan.num_waves, "lower_bound": plan.lower_bound_waves,
              "proven_optimal": plan.proven_optimal,
              "indices": [list(map(int, part)) for part in indices]}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['sequences']} sequences, {result['tokens']:,} tokens, {args.free_gib} GiB "
          f"per rank: {result['micro_batches']} micro-batches (waves; lower bound "
          f"{result['lower_bound']}{', proven optimal' if plan.proven_optimal else ''})")
    for i, part in enumerate(result["indices"]):
        print(f"  micro-batch {i}: {len(part)} sequences, "
              f"{sum(lengths[j] for j in part):,} tokens, admitted "
              f"{plan.waves[i].admitted_bytes / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
