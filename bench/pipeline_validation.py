"""Pipeline stages: traced peaks (Megatron-core's 1F1B schedule on gloo ranks) beside priced ones.

    python bench/pipeline_validation.py trace    # trace the cells missing from traces_pipeline.jsonl
    python bench/pipeline_validation.py report   # priced vs traced per stage -> pipeline_validation.txt

`trace` runs each cell with `waveplan.pricing.measure.pipeline_trace.trace_pipeline` (TP x PP
processes over gloo, one micro-batch per wave, variable lengths) and appends one record
(`{"cell", "trace"}`) to bench/results/traces_pipeline.jsonl, rewritten sorted by cell key
(a cell already there is skipped, so the command resumes after an interruption). `report`
never traces: it prices every stage of each cell with today's model
(`stage_price.price_stages`: the torch-cpu table, head full-native, 2-byte adapter gradients
as the trace holds them, safety 1.0, no first-execution allowance, the first wave carrying
the slot's pending gradients as the traced step's first backward allocates them, the step's
longest sequence bounding each wave's RoPE cache entry) and writes
bench/results/pipeline_validation.txt: stage, traced, priced, ratio, and the median and
minimum ratio. The claim checked: no stage under its trace, median within 3% over.

Shapes: a small dense model (hidden 512, FFN 1536, 8 heads in 4 KV groups, vocabulary 4096,
8 layers); waves of different lengths in two orders (heavy and light alternating, and growing).
The whole grid traces in a few minutes on two busy cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from waveplan.pricing.atomic_io import write_text_atomic

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

RESULTS = Path(__file__).resolve().parent / "results"
TRACES = RESULTS / "traces_pipeline.jsonl"
SUMMARY = RESULTS / "pipeline_validation.txt"

DENSE = {"name": "pp-dense-h512", "hidden": 512, "ffn": 1536, "vocab": 4096, "dtype": "bf16",
         "gated_mlp": True, "tied_embeddings": False, "layers": [["attention", "dense"]] * 8,
         "attention": {"num_heads": 8, "num_kv_groups": 4, "head_dim": 64, "output_gate": False},
         "gdn": None, "moe": None}
# heavy and light waves alternating; then growing waves (the last window is the heaviest)
WAVES = {"alternating": ((768, 256), (128,), (512, 384, 128), (64, 64), (640,), (96, 32)),
         "growing": ((64,), (128, 64), (256, 128), (384, 256), (512, 384))}
# (layout kwargs, wave sets, recompute modes)
CELLS = (
    ({"pp": 2}, ("alternating", "growing"), ("full",)),
    ({"pp": 4}, ("alternating", "growing"), ("full",)),
    ({"pp": 2, "tp": 2, "sequence_parallel": True}, ("alternating",), ("full",)),
)
LORA_RANK = 16
NUM_LAYERS = 8


def cell_key(cell: dict) -> str:
    return json.dumps({k: cell[k] for k in ("model", "num_layers", "recompute", "lora_rank",
                                            "waves", "layout")}, sort_keys=True)


def _load(path: Path = TRACES) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write(records: list[dict], path: Path = TRACES) -> None:
    records = sorted(records, key=lambda r: cell_key(r["cell"]))
    write_text_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))


def planned() -> list[tuple[dict, str, str]]:
    """(layout kwargs, wave set, recompute) of every cell, in order."""
    return [(lay, w, rc) for lay, sets, rcs in CELLS for w in sets for rc in rcs]


def priced(cell: dict):
    """Today's stage peaks of a traced cell (`StagePeak`s; raw bytes, safety 1.0)."""
    import dataclasses

    from waveplan.pricing.coefficients import load_table
    from waveplan.pricing.geometry import ModelGeometry
    from waveplan.pricing.lora import LoraConfig, LoraSlot
    from waveplan.pricing.model import PricingModel
    from waveplan.pricing.parallel import ParallelLayout, Recompute
    from waveplan.pricing.price import GroupLoad
    from waveplan.pricing.stage_price import price_stages

    g = ModelGeometry.from_dict(cell["geometry"])
    g = dataclasses.replace(g, layers=g.layers[:cell["num_layers"]])
    layout = ParallelLayout(**cell["layout"])
    model = PricingModel(geometry=g, parallel=layout, recompute=Recompute(mode=cell["recompute"]),
                         lora=LoraConfig(slots=(LoraSlot(rank=cell["lora_rank"]),), grad_bytes=2),
                         table=load_table("torch-cpu"), head="full-native", safety=1.0)
    waves = []
    for i, w in enumerate(cell["waves"]):
        rows = sum(w)
        load = GroupLoad(packed_rows=rows, padded_rows=rows, logical_rows=rows, segments=len(w))
        waves.append(([load], frozenset({"default"}) if i == 0 else frozenset()))
    longest = max(max(w) for w in cell["waves"])
    return price_stages(model, waves, [2**62] * layout.pp, profiled=True, max_len=longest)


def cmd_trace(args) -> int:
    from waveplan.pricing.geometry import ModelGeometry
    from waveplan.pricing.measure.pipeline_trace import pipeline_record, trace_pipeline
    from waveplan.pricing.parallel import ParallelLayout, Recompute

    path = Path(args.traces)
    records = _load(path)
    have = {cell_key(r["cell"]) for r in records}
    g = ModelGeometry.from_dict(DENSE)
    t_all = time.monotonic()
    for lay, wset, rc in planned():
        layout = ParallelLayout(**lay)
        t0 = time.monotonic()
        tr = None
        probe = {"model": DENSE["name"], "num_layers": NUM_LAYERS, "recompute": rc,
                 "lora_rank": LORA_RANK, "layout": layout.to_dict(),
                 "waves": [list(w) for w in WAVES[wset]]}
        if cell_key(probe) in have:
            continue
        tr = trace_pipeline(g, layout=layout, waves=[list(w) for w in WAVES[wset]],
                            num_layers=NUM_LAYERS, recompute=Recompute(mode=rc),
                            lora_rank=LORA_RANK, timeout_s=args.timeout)
        rec = pipeline_record(tr, g)
        rec["cell"]["wave_set"] = wset
        records.append(rec)
        _write(records, path)
        print(f"PP{layout.pp} TP{layout.tp}{' SP' if layout.sequence_parallel else ''} {wset} "
              f"{rc}: {time.monotonic() - t0:.0f} s", flush=True)
    print(f"grid traced in {time.monotonic() - t_all:.0f} s")
    return 0


def report_lines(records: list[dict]) -> list[str]:
    lines = ["# Pipeline stages: traced (Megatron-core 1F1B on gloo ranks, CPU) vs priced",
             "# bytes above the stage's weights and inputs; priced: raw, safety 1.0, torch-cpu "
             "table, head full-native",
             "# peak at: micro-batch and phase of the traced peak; window: the priced binding "
             "window of waves",
             f"{'layout':<12} {'waves':<12} {'rc':<5} {'stage':>5} {'layers':>7} "
             f"{'traced':>12} {'priced':>12} {'ratio':>7}  {'peak at':<18} window"]
    ratios = []
    for rec in records:
        cell, trace = rec["cell"], rec["trace"]
        lay = cell["layout"]
        name = f"PP{lay['pp']} TP{lay['tp']}{' SP' if lay['sequence_parallel'] else ''}"
        for st, pr in zip(trace["stages"], priced(cell), strict=True):
            ratio = pr.peak_bytes / st["peak_bytes"]
            ratios.append(ratio)
            at = f"mb{st['peak_at']['microbatch']} {st['peak_at']['phase']}"
            lines.append(f"{name:<12} {cell.get('wave_set', '-'):<12} {cell['recompute']:<5} "
                         f"{st['stage']:>5} {'{}-{}'.format(*st['layers']):>7} "
                         f"{st['peak_bytes']:>12,d} {pr.peak_bytes:>12,d} {ratio:>7.4f}  "
                         f"{at:<18} {list(pr.window)}")
    if ratios:
        lines.append(f"# {len(ratios)} stages: median ratio {statistics.median(ratios):.4f}, "
                     f"min {min(ratios):.4f}, max {max(ratios):.4f}; "
                     f"under the trace: {sum(r < 1 for r in ratios)}")
    return lines


def cmd_report(args) -> int:
    lines = report_lines(_load(Path(args.traces)))
    text = "\n".join(lines) + "\n"
    if args.write:
        write_text_atomic(SUMMARY, text)
    print(text, end="")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trace")
    t.add_argument("--traces", default=str(TRACES))
    t.add_argument("--timeout", type=float, default=1200.0)
    t.set_defaults(func=cmd_trace)
    r = sub.add_parser("report")
    r.add_argument("--traces", default=str(TRACES))
    r.add_argument("--no-write", dest="write", action="store_false")
    r.set_defaults(func=cmd_report)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
