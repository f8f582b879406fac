"""Anatomy of a dense FSDP wave's traced peak (the evidence of the sdpa/eager terms in
waveplan.pricing.fsdp.terms, docs/memory-model.md#fsdp-attention): one cell of
bench/fsdp_validation.py traced as `fsdp_trace` traces it (same model build, warm-up, rest and
inputs, `use_cache=False`), with the live-storage tracker labelling every storage (pass, module,
aten op, shape, dtype; `live_anatomy`) and FSDP2's all-gather outputs polled by size. Prints
the busiest rank's peak, where it fell, and what was live there, largest first; with
`--json PATH` writes them (bench/results/fsdp_dense_anatomy.txt: its output for set 1's
llama/nockpt/sdpa/fsdp2, 160 + 96 + 64 tokens).

    TORCHDYNAMO_DISABLE=1 nice python bench/fsdp_dense_anatomy.py CLASS [WAVE_INDEX] [--json PATH]

CLASS is a class of bench/results/fsdp_traces.jsonl (e.g. llama/nockpt/sdpa/fsdp2); the wave is
its WAVE_INDEX-th record (default 0).
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

TRACES = Path(__file__).resolve().parent / "results" / "fsdp_traces.jsonl"


def rank(spec: dict) -> list[dict]:
    """This rank's peak above rest, where it fell and what was live there."""
    import torch

    from waveplan.pricing.measure.fsdp_trace import (
        build_fsdp_model,
        rest_storages,
        wave_inputs,
    )
    from waveplan.pricing.measure.live_anatomy import anatomy_tracker_class, module_stack

    model, opt = build_fsdp_model(spec)
    vocab = int(spec["config"].get("vocab_size", 32000))
    lens = spec["jobs"][0]

    def run(phase=None):
        ids, pos, labels = wave_inputs(lens, vocab, "cpu")
        out = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
        loss = out.loss
        del out
        if phase is not None:
            phase()
        loss.backward()
        del loss, ids, pos, labels

    run()
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    polled, others = rest_storages(model, torch)

    class Tracker(anatomy_tracker_class()):
        def __init__(self) -> None:
            super().__init__()
            for st in polled:
                self.ignored[id(st)] = st
            self.polled_now = 0
            self.where_peak = ""

        def _poll(self) -> None:
            self.polled_now = sum(st.nbytes() for st in polled)
            if self.current + self.polled_now > self.peak:
                self.peak = self.current + self.polled_now
                self._snapshot()

        def _snapshot(self) -> None:
            super()._snapshot()
            self.where_peak = f"{self.phase}:{self.stack[-1] if self.stack else '(autograd)'}"
            self.snap[-1] = (("(fsdp)", "all-gather outputs", "polled", (), "bf16"), self.polled_now)

        def _track(self, t) -> None:
            super()._track(t)
            if self.current + self.polled_now > self.peak:
                self.peak = self.current + self.polled_now

        def reset_peak(self) -> None:
            self.polled_now = sum(st.nbytes() for st in polled)
            self.peak = self.current + self.polled_now
            self._snapshot()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self._poll()
            return out

    tracker = Tracker()
    tracker.ignore(others)
    del others
    stack: list[str] = []
    tracker.stack = stack
    with module_stack(model, stack), tracker:
        tracker.reset_peak()
        base = tracker.peak
        run(phase=lambda: setattr(tracker, "phase", "backward"))
    groups = tracker.peak_groups(top=45)
    return [{"peak": int(tracker.peak - base), "base": int(base), "where": tracker.where_peak,
             "groups": groups}]


def main() -> None:
    from waveplan.pricing.measure.gloo_launch import spawn

    parser = argparse.ArgumentParser()
    parser.add_argument("cls")
    parser.add_argument("wave", nargs="?", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    recs = [json.loads(line) for line in TRACES.read_text().splitlines()]
    recs = [r for r in recs if r["class"] == args.cls]
    if not recs:
        raise SystemExit(f"cls: {args.cls!r} is not a class of {TRACES.name}")
    rec = recs[args.wave]
    spec = {"config": rec["config"], "attn": rec["attn"], "checkpointing": rec["checkpointing"],
            "lora_rank": rec["lora_rank"], "reshard_after_forward": rec.get("reshard_after_forward", True),
            "device": "cpu", "fsdp": rec["fsdp"], "jobs": [rec["seq_lens"]], "timeout_s": 1800.0}
    per_rank = spawn(spec, rec["fsdp"], 1800.0, entry=f"{Path(__file__).stem}:rank")
    busiest = max((r[0] for r in per_rank), key=lambda r: r["peak"])
    print(f"{args.cls} {rec['seq_lens']}: peak {busiest['peak']} (committed trace {rec['peak_bytes']}) "
          f"at {busiest['where']}")
    for n, ph, where, op, shape, dt in busiest["groups"]:
        print(f"{n:>10}  {ph:<8} {where:<40} {op:<28} {str(shape):<20} {dt}")
    if args.json:
        Path(args.json).write_text(json.dumps(busiest, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
