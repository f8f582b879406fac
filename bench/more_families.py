"""Granite, InternLM2, OLMo 2, Qwen2-MoE and SmolLM3: cpu-fake traces at real width (2 layers,
TP1, full recompute) of the configs in tests/data/hf_more, against the shipped torch-cpu table.

    python bench/more_families.py trace    # append missing cells to traces_more_families_cpu_fake.jsonl
    python bench/more_families.py report   # -> more_families_validation.txt

Each cell is traced on what Megatron-core 0.16.1 builds for the config: InternLM2 and SmolLM3
as GQA decoders (every SmolLM3 layer with RoPE: the builder has no NoPE layer), Qwen2-MoE with
Megatron's own sigmoid-gated shared expert (`moe_shared_expert_gate`), Granite and OLMo 2
without their multipliers and post-norms (Megatron-core has neither). The report gives two
ratios per cell: the estimate of the traced model (the baseline terms on these shapes), and
the estimate as priced (every feature term charged: the conservative margin of what no trace
covers). Targets, as for the other families: no cell under, median within 3 % over.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from validation_study import RESULTS, _line, _stats, cell_key, cell_model, load_traces  # noqa: E402

from waveplan.pricing.atomic_io import write_text_atomic  # noqa: E402

TRACES = RESULTS / "traces_more_families_cpu_fake.jsonl"
CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "hf_more"
FAMILIES = ("granite-4.0-micro", "internlm2-chat-1_8b", "olmo-2-0425-1b", "qwen1.5-moe-a2.7b",
            "smollm3-3b")
WAVES = ([1024], [2048, 2048], [512] * 4, [3000, 1000])
RANKS = (8, 16, 32, 64)
# what Megatron-core builds none of: traced without, priced with
UNBUILT = {"residual_scale": False, "logit_scale": False, "post_norms": False, "nope_layers": 0,
           "embedding_scale": False}


def geometries(name: str):
    """(as priced, as traced) geometry of one config."""
    from waveplan.pricing.hf_config import load_hf_config

    priced = load_hf_config(CONFIGS / f"{name}.json", name=name)
    traced = dataclasses.replace(priced, features=dataclasses.replace(priced.features, **UNBUILT))
    return priced, traced


def cells() -> list[dict]:
    out = []
    i = 0
    for name in FAMILIES:
        _, traced = geometries(name)
        for lens in WAVES:
            out.append({"model": name, "geometry": traced.to_dict(), "num_layers": 2,
                        "recompute": "full", "lora_rank": RANKS[i % 4], "seq_lens": list(lens)})
            i += 1
    return out


def cmd_trace(args) -> int:
    from waveplan.pricing.measure.trace import trace_wave
    from waveplan.pricing.parallel import Recompute

    done = {cell_key(r["cell"]) for r in load_traces(args.traces)}
    todo = [c for c in cells() if cell_key(c) not in done]
    print(f"{len(cells())} cells, {len(todo)} to trace", flush=True)
    for n, cell in enumerate(todo, 1):
        t0 = time.perf_counter()
        res = trace_wave(cell_model(cell), seq_lens=cell["seq_lens"], num_layers=cell["num_layers"],
                         device="cpu-fake", recompute=Recompute(mode=cell["recompute"]),
                         lora_rank=cell["lora_rank"], head="full-native")
        dt = time.perf_counter() - t0
        args.traces.parent.mkdir(parents=True, exist_ok=True)
        with args.traces.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({"cell": cell, "trace": res.to_dict(), "seconds": round(dt, 2)},
                                sort_keys=True) + "\n")
        print(f"[{n}/{len(todo)}] {cell['model']} {cell['seq_lens']} peak={res.peak_bytes} {dt:.1f}s",
              flush=True)
    return 0


def cmd_report(args) -> int:
    from waveplan.pricing.coefficients import load_table
    from waveplan.pricing.measure import calibrate

    table = load_table("torch-cpu")
    records = {cell_key(r["cell"]): r for r in load_traces(args.traces)}
    grid = [records[cell_key(c)] for c in cells() if cell_key(c) in records]
    if not grid:
        print(f"no traces in {args.traces}", file=sys.stderr)
        return 2
    lines = [f"more families: {len(grid)} cpu-fake cells at real width (2 layers, TP1, full recompute, "
             "full-native head) of tests/data/hf_more, against the shipped torch-cpu table (held out); "
             "traced = the estimate of the model Megatron-core builds, priced = with every feature term "
             "charged; over = estimate / measured - 1 (raw)", ""]
    rows = []
    for rec in grid:
        c, tr = rec["cell"], rec["trace"]
        priced, _ = geometries(c["model"])
        as_priced = dict(rec, cell=dict(c, geometry=priced.to_dict()))
        base, full = calibrate.estimate(table, rec), calibrate.estimate(table, as_priced)
        rows.append((c["model"], base["peak"] / tr["peak_bytes"] - 1,
                     base["decoder"] / tr["decoder_peak_bytes"] - 1,
                     full["peak"] / tr["peak_bytes"] - 1, full["decoder"] / tr["decoder_peak_bytes"] - 1))
        lines.append(f"  {c['model']:20s} lens={str(c['seq_lens']):22s} rank={c['lora_rank']:2d} "
                     f"traced: peak {rows[-1][1]:+7.2%} decoder {rows[-1][2]:+7.2%}   "
                     f"priced: peak {rows[-1][3]:+7.2%} decoder {rows[-1][4]:+7.2%}")
    lines.append("")
    for what, i in (("traced peak", 1), ("traced decoder", 2), ("priced peak", 3), ("priced decoder", 4)):
        lines.append(_line(f"{what} (all)", _stats([r[i] for r in rows])))
        for name in FAMILIES:
            part = [r[i] for r in rows if r[0] == name]
            if part:
                lines.append(_line(f"    {name}", _stats(part)))
    text = "\n".join(lines) + "\n"
    write_text_atomic(RESULTS / "more_families_validation.txt", text)
    print(text)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, func in (("trace", cmd_trace), ("report", cmd_report)):
        p = sub.add_parser(name)
        p.add_argument("--traces", type=Path, default=TRACES)
        p.set_defaults(func=func)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
