"""Train a small Hugging Face Llama with PEFT LoRA under FSDP2 on 2 gloo ranks (CPU), letting
waveplan plan every step.

Each rank builds the same transformers `LlamaForCausalLM` (sdpa attention, per-layer gradient
checkpointing), wraps it in PEFT LoRA on every linear layer and shards it with `fully_shard`
(every decoder layer and the root, bf16 parameters, fp32 reduce) over a CPU device mesh of the
two ranks. `Planner.from_hf_model` reads all of that from the live model (framework "fsdp").
Per step each rank draws its own sequences; `plan_distributed` cuts them into waves that fit the
budget, with the same wave count on both ranks (FSDP's collectives need every rank in every
wave). Each wave runs for real (its sequences packed in one row, position_ids restarting per
sequence, transformers' own loss; one unmeasured warm-up wave first brings the rank to rest
past FSDP2's lazy initialisation), while a live-storage count (the tracer's, with FSDP2's
all-gather storages read after every op) measures its peak above the memory before the wave;
`Planner.observe` learns from it. After the step's last wave AdamW updates the adapters.

The table shows, per rank and wave, the tokens, the planned (admitted) and raw prices and the
measured peak: the measured peak never exceeds the admitted price, which never exceeds the budget.

Run:  .venv/bin/python examples/train_lora_fsdp_cpu.py [--steps N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

CONFIG = dict(model_type="llama", hidden_size=96, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=24, vocab_size=1024,
              tie_word_embeddings=False)
WORLD = 2


def rank_main(rank: int, args: dict) -> None:
    import datetime
    import gc
    import warnings

    import numpy as np
    import torch
    import torch.distributed as dist

    from waveplan.planner import Planner
    from waveplan.planner.distributed import plan_distributed
    from waveplan.pricing.measure import fsdp_trace as ft
    from waveplan.pricing.step import Step

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args['init']}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=1800))
    spec = dict(config=CONFIG, attn="sdpa", checkpointing=True, lora_rank=8,
                reshard_after_forward=True, device="cpu")
    model, opt = ft.build_fsdp_model(spec)
    planner = Planner.from_hf_model(model, backend="torch-cpu")
    # FSDP2's lazy initialisation (its all-gather storages, made once and then resized) happens
    # in the first forward: one warm-up wave, unmeasured, brings the rank to rest
    ids, pos, labels = ft.wave_inputs([32], CONFIG["vocab_size"], "cpu")
    model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss.backward()
    opt.zero_grad(set_to_none=True)
    del ids, pos, labels
    rng = np.random.default_rng(100 + rank)
    rows = []
    for step_no in range(args["steps"]):
        lengths = [int(x) for x in rng.integers(24, 200, 8)]
        step = Step.from_lengths([0] * len(lengths), lengths)
        plan = plan_distributed(planner, step, args["budget"], dp_group=dist.group.WORLD,
                                deterministic=True)
        for wave in plan.waves:
            lens = [lengths[i] for i in wave.request_indices]
            gc.collect()
            polled = [t.untyped_storage() for fp in ft._fsdp_params(model) for t in fp.all_gather_outputs]
            pid = {id(s) for s in polled}
            live = ft._live_storages(torch)
            tracker = ft._polled_tracker()(polled)
            tracker.ignore([o for k, o in live.items() if k not in pid])
            del live
            with tracker:
                tracker.reset_peak()
                base = tracker.peak
                ids, pos, labels = ft.wave_inputs(lens, CONFIG["vocab_size"], "cpu")
                loss = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss
                loss.backward()
                del loss, ids, pos, labels
            peak = tracker.peak - base
            planner.observe(wave, peak_bytes=peak)
            rows.append({"rank": rank, "step": step_no, "wave": wave.index, "tokens": sum(lens),
                         "admitted": wave.price.admitted_bytes, "raw": wave.price.raw_bytes,
                         "peak": int(peak), "budget": plan.budget_bytes})
        opt.step()
        opt.zero_grad(set_to_none=True)
    with open(os.path.join(args["out"], f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(rows, fh)
    dist.barrier()
    os._exit(0)


def budget_bytes() -> int:
    """A budget about a third of the largest step's price as one wave (several waves a step)."""
    from waveplan.pricing.fsdp.check import price_record

    whole = price_record(dict(config=CONFIG, fsdp=WORLD, attn="sdpa", checkpointing=True,
                              lora_rank=8, seq_lens=[200] * 8)).admitted_bytes
    return int(whole // 3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args(argv)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="waveplan-fsdp-example-") as tmp:
        args = {"steps": ns.steps, "budget": budget_bytes(), "init": os.path.join(tmp, "init"),
                "out": tmp}
        mp.start_processes(rank_main, args=(args,), nprocs=WORLD, join=True, start_method="spawn")
        rows = []
        for r in range(WORLD):
            with open(os.path.join(tmp, f"rank{r}.json"), encoding="utf-8") as fh:
                rows.extend(json.load(fh))
    if ns.json:
        print(json.dumps(rows))
    else:
        print("rank step wave tokens  admitted       raw      peak    budget")
        for r in rows:
            print(f"{r['rank']:>4} {r['step']:>4} {r['wave']:>4} {r['tokens']:>6} {r['admitted']:>9} "
                  f"{r['raw']:>9} {r['peak']:>9} {r['budget']:>9}")
    bad = [r for r in rows if r["peak"] > r["admitted"] or r["admitted"] > r["budget"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
