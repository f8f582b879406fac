"""Anatomy of a flash_attention_2 FSDP2 wave's peak: which storages are live at the busiest
moment, labelled (pass, module, aten op, shape, dtype), beside the price's terms at its binding
point. One gloo rank (FSDP1: no collectives to wait on) or more; the evidence of the flash terms
in pricing/fsdp/terms.py (docs/memory-model.md#fsdp-attention).

    TORCHDYNAMO_DISABLE=1 nice python bench/fsdp_flash_anatomy.py SET FAMILY ckpt|nockpt [FSDP]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _rank(rank: int, spec: dict, out: str) -> None:
    import gc

    import torch
    import torch.distributed as dist

    from waveplan.pricing.measure import fsdp_trace as ft
    from waveplan.pricing.measure.hf_flash import flash_attention_2
    from waveplan.pricing.measure.live_anatomy import anatomy_tracker_class, module_stack

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=spec["port"])
    dist.init_process_group("gloo", rank=rank, world_size=spec["fsdp"])
    model, opt = ft.build_fsdp_model(spec)
    vocab = int(spec["config"]["vocab_size"])
    base = anatomy_tracker_class()

    class Tracker(base):
        """The anatomy tracker with FSDP2's all-gather outputs polled by size (as the tracer's):
        a peak counts them, and the snapshot records them as one row."""

        def __init__(self, polled):
            super().__init__()
            self.polled = polled
            for st in polled:
                self.ignored[id(st)] = st
            self.where = None
            self.top = 0
            self.at_top = 0

        def _snapshot(self):   # snapshots are taken at the polled peak only (below)
            pass

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            now = sum(st.nbytes() for st in self.polled)
            if self.current + now > self.top:
                self.top = self.current + now
                self.at_top = now
                self.snap = {k: (self.info.get(k), n) for k, n in self.live.items()}
                self.where = (self.phase, self.stack[-1] if self.stack else "(autograd)")
            return out

    res = {}
    with flash_attention_2():
        def run(lens, tracker=None):
            ids, pos, labels = ft.wave_inputs(lens, vocab, "cpu")
            o = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
            loss = o.loss
            del o
            if tracker is not None:
                tracker.phase = "backward"
            loss.backward()

        run(spec["jobs"][0])
        opt.step()
        opt.zero_grad(set_to_none=True)
        for lens in spec["jobs"]:
            gc.collect()
            polled, others = ft.rest_storages(model, torch)
            tr = Tracker(polled)
            tr.ignore(others)
            del others
            with module_stack(model, tr.stack), tr:
                tr.reset_peak()
                tr.top = tr.current + sum(st.nbytes() for st in polled)
                b = tr.top
                run(lens, tr)
            res[str(lens)] = dict(peak=tr.top - b, where=tr.where,
                                  groups=[[tr.at_top, "gathered", "FSDP2 all-gather outputs"]]
                                  + tr.peak_groups(60))
            opt.zero_grad(set_to_none=True)
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def main() -> None:
    import tempfile

    import fsdp_validation as fv
    import torch.multiprocessing as mp

    which, fam, ck = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "ckpt"
    fsdp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    families, waves, rank = fv.SETS[which]
    spec = {"config": dict(families[fam]), "attn": "flash", "checkpointing": ck, "lora_rank": rank,
            "reshard_after_forward": True, "device": "cpu", "fsdp": fsdp,
            "jobs": [list(w) for w in waves], "port": os.environ.get("ANATOMY_PORT", "29677")}
    out = tempfile.mktemp(suffix=".json")
    mp.spawn(_rank, args=(spec, out), nprocs=fsdp)
    res = json.loads(Path(out).read_text())
    from waveplan.pricing.fsdp.check import price_record

    for lens, r in res.items():
        rec = {"config": spec["config"], "fsdp": fsdp, "attn": "flash", "checkpointing": ck,
               "lora_rank": rank, "seq_lens": json.loads(lens)}
        b = price_record(rec)
        print(f"== {fam} {'ckpt' if ck else 'nockpt'} fsdp{fsdp} {lens}: peak {r['peak']} at "
              f"{r['where']}; priced {b.raw_bytes} ({100 * (b.raw_bytes / r['peak'] - 1):+.1f}%) "
              f"at {b.binding}")
        print("   terms:", {k: v for k, v in b.terms.items() if v})
        for row in r["groups"]:
            print("  ", row)


if __name__ == "__main__":
    main()
