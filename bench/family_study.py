"""Family study: cpu-fake traces at real size (a few layers, TP1) of one representative per
model family, validated against the shipped torch-cpu table, and feature ablations.

    python bench/family_study.py trace    # append missing cells to traces_families_cpu_fake.jsonl
    python bench/family_study.py report   # held-out validation and ablations -> family_validation.txt

Every grid cell is held out: the torch-cpu table was fitted on the Qwen3/Llama grid of
`validation_study.py` and is not refitted here, so each family's cells test the shipped
coefficients plus the family's feature terms (`pricing.feature_terms`). Targets, as for the
fitted families: no cell under its trace, median within 3 % over.

Ablation pairs trace one representative with one feature switched off (the geometry inline in
the cell): the difference of the two peaks is what the feature allocates, the evidence the
feature terms cite. Features Megatron-core lacks run as `megatron_build` models them.
`trace` is cached like `validation_study.py trace`; `report` never traces.
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

TRACES = RESULTS / "traces_families_cpu_fake.jsonl"
# one representative per family; layers: enough for each layer kind the family has
FAMILIES = (
    ("qwen2.5-7b", 2), ("mistral-7b", 2), ("phi-4", 2), ("gemma-2-9b", 2), ("gemma-3-27b", 2),
    ("mixtral-8x7b", 2), ("deepseek-v2-lite", 2), ("deepseek-v3", 4), ("gpt-oss-20b", 2),
)
WAVES = ([1024], [2048, 2048], [512] * 4, [3000, 1000])
RANKS = (8, 16, 32, 64)
# (label, preset, features switched off): each traced with and without
ABLATIONS = (
    ("q/k/v biases", "qwen2.5-7b", {"qkv_bias": False}),
    ("GeGLU (vs SwiGLU)", "gemma-3-27b", {"mlp_activation": "swiglu"}),
    ("sandwich norms", "gemma-3-27b", {"sandwich_norms": False}),
    ("sandwich norms", "gemma-2-9b", {"sandwich_norms": False}),
    ("final-logit soft-cap", "gemma-2-9b", {"final_softcap": 0.0}),
    ("attention sinks", "gpt-oss-20b", {"attention_sinks": False}),
    ("biases on every linear", "gpt-oss-20b", {"linear_bias": False}),
    ("clamped SwiGLU (vs SwiGLU)", "gpt-oss-20b", {"mlp_activation": "swiglu"}),
)
ABLATION_WAVE = [1024]


def cells() -> list[dict]:
    out = []
    i = 0
    for model, layers in FAMILIES:
        for lens in WAVES:
            out.append({"model": model, "num_layers": layers, "recompute": "full",
                        "lora_rank": RANKS[i % 4], "seq_lens": list(lens)})
            i += 1
    return out


def ablation_cells() -> list[tuple[str, dict, dict]]:
    """(label, cell with the feature, cell without it)."""
    from waveplan.pricing.presets import load_preset

    out = []
    for label, preset, off in ABLATIONS:
        g = load_preset(preset)
        plain = dataclasses.replace(g, features=dataclasses.replace(g.features, **off))
        on = {"model": preset, "num_layers": 2, "recompute": "full", "lora_rank": 16,
              "seq_lens": ABLATION_WAVE}
        without = dict(on, model=f"{preset} without {label}", geometry=plain.to_dict())
        out.append((label, on, without))
    return out


def cmd_trace(args) -> int:
    from waveplan.pricing.measure.trace import trace_wave
    from waveplan.pricing.parallel import Recompute

    done = {cell_key(r["cell"]) for r in load_traces(args.traces)}
    grid = cells() + [c for _, on, off in ablation_cells() for c in (on, off)]
    seen, todo = set(), []
    for c in grid:
        if cell_key(c) not in done and cell_key(c) not in seen:
            seen.add(cell_key(c))
            todo.append(c)
    print(f"{len(grid)} cells, {len(todo)} to trace", flush=True)
    from waveplan.planner.progress import progress_bar

    bar = progress_bar(len(todo), "family grid", unit="cell")
    for n, cell in enumerate(todo, 1):
        t0 = time.perf_counter()
        res = trace_wave(cell_model(cell), seq_lens=cell["seq_lens"], num_layers=cell["num_layers"],
                         device="cpu-fake", recompute=Recompute(mode=cell["recompute"]),
                         lora_rank=cell["lora_rank"], head="full-native")
        dt = time.perf_counter() - t0
        with args.traces.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({"cell": cell, "trace": res.to_dict(), "seconds": round(dt, 2)},
                                sort_keys=True) + "\n")
        print(f"[{n}/{len(todo)}] {cell['model']} {cell['seq_lens']} peak={res.peak_bytes} {dt:.1f}s",
              flush=True)
        bar.update(1)
    bar.close()
    return 0


def cmd_report(args) -> int:
    from waveplan.pricing.coefficients import load_table
    from waveplan.pricing.measure import calibrate

    table = load_table("torch-cpu")
    records = {cell_key(r["cell"]): r for r in load_traces(args.traces)}
    grid = [records[cell_key(c)] for c in cells() if cell_key(c) in records]
    if not grid:
        print(f"no family traces in {args.traces}", file=sys.stderr)
        return 2
    lines = [f"family study: {len(grid)} cpu-fake cells at real width (2 layers, 4 for DeepSeek-V3; TP1, full "
             "recompute), against the shipped torch-cpu table (fitted on the Qwen3/Llama grid; its MoE "
             "routed-row entries on every MoE trace, these MoE families' cells included: "
             "bench/moe_fit.py); over = estimate / measured - 1 (raw)", ""]
    rows = []
    for rec in grid:
        est = calibrate.estimate(table, rec)
        tr, c = rec["trace"], rec["cell"]
        rows.append((c, est["peak"], tr["peak_bytes"], est["decoder"], tr["decoder_peak_bytes"],
                     rec.get("seconds")))
        lines.append(f"  {c['model']:18s} lens={str(c['seq_lens']):22s} rank={c['lora_rank']:2d} "
                     f"peak est/measured {est['peak']:>12,} / {tr['peak_bytes']:>12,} "
                     f"({est['peak'] / tr['peak_bytes'] - 1:+7.2%})  decoder {est['decoder']:>12,} / "
                     f"{tr['decoder_peak_bytes']:>12,} ({est['decoder'] / tr['decoder_peak_bytes'] - 1:+7.2%})")
    lines.append("")
    for what, i in (("peak", 1), ("decoder", 3)):
        lines.append(_line(f"{what} (all)", _stats([r[i] / r[i + 1] - 1 for r in rows])))
        for model, _ in FAMILIES:
            part = [r[i] / r[i + 1] - 1 for r in rows if r[0]["model"] == model]
            if part:
                lines.append(_line(f"    {model}", _stats(part)))
    lines += ["", "ablations (one feature switched off; decoder-only and whole peaks, bytes per row):"]
    for label, on, off in ablation_cells():
        a, b = records.get(cell_key(on)), records.get(cell_key(off))
        if a is None or b is None:
            lines.append(f"  {label}: not traced")
            continue
        rows_ = sum(on["seq_lens"])
        dd = (a["trace"]["decoder_peak_bytes"] - b["trace"]["decoder_peak_bytes"]) / rows_
        dp = (a["trace"]["peak_bytes"] - b["trace"]["peak_bytes"]) / rows_
        g = cell_model(on)
        est = calibrate.estimate(table, b)  # the estimate without the feature, on its trace
        lines.append(f"  {label:22s} ({on['model']}, H={g.hidden}, F={g.ffn}, V={g.vocab}): "
                     f"decoder peak +{dd:,.0f} B/row ({dd / g.hidden:.2f} H), whole peak +{dp:,.0f} "
                     f"B/row ({dp / g.vocab:.2f} V); without it est/measured decoder "
                     f"{est['decoder'] / b['trace']['decoder_peak_bytes'] - 1:+.2%}, whole "
                     f"{est['peak'] / b['trace']['peak_bytes'] - 1:+.2%}")
    text = "\n".join(lines) + "\n"
    write_text_atomic(RESULTS / "family_validation.txt", text)
    print(text)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, fn in (("trace", cmd_trace), ("report", cmd_report)):
        p = sub.add_parser(name)
        p.add_argument("--traces", type=Path, default=TRACES)
        p.set_defaults(func=fn)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
