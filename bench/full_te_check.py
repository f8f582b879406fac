"""The full-te head (Transformer Engine's parallel cross entropy) against traced peaks.

    python bench/full_te_check.py trace    # trace the cells missing from traces_full_te.jsonl
    python bench/full_te_check.py          # price every cell, write bench/results/full_te_check.txt

`trace` runs `trace_wave(head="full-te")` (cpu-fake, the allocation model of TE's cross entropy
in `pricing/measure/te_cross_entropy.py`: bf16 logits overwritten by their gradient, fp32 loss
and per-row statistics) on a few presets cut to their first layers, TP1, TP2 and TP4+SP (rank 0
of torch's fake process group), full/selective/none recompute, and appends one record per cell
to bench/results/traces_full_te.jsonl. The report prices each cell as one first gradient wave
with head full-te (torch-cpu table, 2-byte adapter gradients, safety 1.0: the raw estimate) and
writes estimate / trace per cell, with the basis. O(cells) traces and pricing calls.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np

from waveplan.pricing.atomic_io import write_text_atomic

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

RESULTS = Path(__file__).resolve().parent / "results"
TRACES = RESULTS / "traces_full_te.jsonl"
OUT = RESULTS / "full_te_check.txt"
# (preset, traced layers, sequence lengths, layout)
CELLS = (("qwen3-8b", 2, (1024, 512), {}), ("qwen3-30b-a3b", 2, (1024,), {}),
         ("llama-3.1-8b", 2, (2048,), {}), ("qwen3-8b", 2, (4096,), {}),
         ("qwen3-8b", 2, (1024, 512), {"tp": 2}),
         ("qwen3-8b", 2, (1024, 512), {"tp": 4, "sequence_parallel": True}),
         ("qwen3.8-27b", 4, (2048,), {}), ("qwen3-30b-a3b", 2, (512, 512, 512), {}))
RECOMPUTES = ("full", "selective", "none")


def _key(preset, layers, lens, layout, rc) -> str:
    return json.dumps([preset, layers, list(lens), layout, rc], sort_keys=True)


def _geometry(preset: str, layers: int):
    from waveplan.pricing.model_source import load_model

    g = load_model(preset)
    return dataclasses.replace(g, layers=g.layers[:layers])


def cmd_trace() -> int:
    from waveplan.pricing.measure.trace import trace_wave
    from waveplan.pricing.parallel import ParallelLayout, Recompute

    records = [json.loads(x) for x in TRACES.read_text().splitlines()] if TRACES.exists() else []
    have = {r["key"] for r in records}
    for preset, layers, lens, layout, in CELLS:
        for rc in RECOMPUTES:
            key = _key(preset, layers, lens, layout, rc)
            if key in have:
                continue
            tr = trace_wave(_geometry(preset, layers), seq_lens=list(lens), num_layers=layers,
                            device="cpu-fake", recompute=Recompute(mode=rc), head="full-te",
                            decoder_only=False, layout=ParallelLayout(**layout))
            records.append({"key": key, "preset": preset, "layers": layers, "seq_lens": list(tr.seq_lens),
                            "layout": layout, "recompute": rc, "peak_bytes": tr.peak_bytes,
                            "peak_forward_bytes": tr.peak_forward_bytes,
                            "peak_backward_bytes": tr.peak_backward_bytes, "notes": list(tr.notes)})
            write_text_atomic(TRACES, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
            print(preset, layout, rc, tr.peak_bytes, flush=True)
    return 0


def estimate(rec: dict, backend: str = "torch-cpu") -> tuple[int, str]:
    from waveplan.pricing.lora import LoraConfig, LoraSlot
    from waveplan.pricing.model import PricingModel
    from waveplan.pricing.parallel import ParallelLayout, Recompute
    from waveplan.pricing.step import Request, Step
    from waveplan.pricing.wave_pricer import WavePricer

    model = PricingModel.build(_geometry(rec["preset"], rec["layers"]),
                               parallel=ParallelLayout(**rec["layout"]),
                               recompute=Recompute(mode=rec["recompute"]),
                               lora=LoraConfig(slots=(LoraSlot(rank=16),), grad_bytes=2),
                               backend=backend, head="full-te", safety=1.0)
    step = Step.from_requests([Request(id=f"r{i}", num_tokens=int(n)) for i, n in enumerate(rec["seq_lens"])])
    b = WavePricer.build(step, model, profiled=True).price([np.arange(len(step.requests))],
                                                          first_slots=frozenset({"default"}))
    return b.raw_bytes, b.basis


def report() -> list[str]:
    records = [json.loads(x) for x in TRACES.read_text().splitlines() if x.strip()]
    lines = ["full-te head: estimate / traced peak (bench/full_te_check.py; traces bench/results/",
             "traces_full_te.jsonl, cpu-fake, TE cross entropy allocation model; torch-cpu table, head",
             "full-te, safety 1.0). Target: no cell under.", "",
             f"{'preset':14s} {'layout':8s} {'recompute':9s} {'tokens':>6s} {'traced MiB':>10s} "
             f"{'ratio':>6s}  basis"]
    ratios = []
    for rec in records:
        raw, basis = estimate(rec)
        ratios.append(raw / rec["peak_bytes"])
        lay = f"TP{rec['layout'].get('tp', 1)}" + ("+SP" if rec["layout"].get("sequence_parallel") else "")
        lines.append(f"{rec['preset']:14s} {lay:8s} {rec['recompute']:9s} {sum(rec['seq_lens']):6d} "
                     f"{rec['peak_bytes'] / 2**20:10.1f} {ratios[-1]:6.3f}  {basis}")
    v = sorted(ratios)
    lines += ["", f"{len(v)} cells, {sum(r < 1 for r in v)} under; min {v[0]:.3f}, median "
                  f"{v[len(v) // 2]:.3f}, max {v[-1]:.3f}"]
    return lines


def main(argv: list[str]) -> int:
    if argv and argv[0] == "trace":
        return cmd_trace()
    lines = report()
    write_text_atomic(OUT, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
