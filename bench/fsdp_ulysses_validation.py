"""Held-out validation of Ulysses sequence parallelism under FSDP2 (veRL's layout) against CPU
traces: transformers + PEFT LoRA + FSDP2 on gloo ranks, veRL's pad-and-slice and all-to-all
around transformers' sdpa/eager (`waveplan.pricing.measure.fsdp_verl_trace`).

The Ulysses terms (`waveplan.pricing.fsdp.ulysses`) were read from anatomies of one Llama shape
(hidden 128, 4 heads, 2 kv heads, vocabulary 2048, LoRA rank 8, FSDP2 x Ulysses 2). The shapes
here (hidden 256, vocabulary 4096 and 3584, rank 16, Ulysses 2 and 4, an odd-length wave that
veRL pads) were traced after those terms were final: the held-out set. Writes
bench/results/fsdp_ulysses_traces.jsonl (resumable) and bench/results/fsdp_ulysses_validation.txt.

    TORCHDYNAMO_DISABLE=1 nice python bench/fsdp_ulysses_validation.py [--heads] [--classes N] [--table-only]

`--heads` traces veRL's log-prob/entropy heads (`fsdp.verl_head`, read from one hidden-128
Llama's isolated head anatomy) on the same shapes with longer waves. Those two sets then named
three more terms (eager's all-to-all at its points, sdpa without a mask on one sequence, veRL's
head holding no gathered layer), so they are not held out for them; `--held-out` traces new
shapes (hidden 192 and 160, three layers, vocabulary 5120 and 6144, LoRA rank 8; verl and
verl-chunked, checkpointing on and off, sdpa and eager, Ulysses 1 and 2) after those terms.

    TORCHDYNAMO_DISABLE=1 nice python bench/fsdp_ulysses_validation.py --held-out
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TRACES = RESULTS / "fsdp_ulysses_traces.jsonl"
TABLE = RESULTS / "fsdp_ulysses_validation.txt"

_BASE = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, vocab_size=4096, tie_word_embeddings=False)
FAMILIES = {
    "llama": dict(_BASE, model_type="llama"),
    "qwen3": dict(_BASE, model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  vocab_size=3584),
    # the held-out shapes of `--held-out` (traced after the Ulysses all-to-all, kept-mask and
    # veRL-head terms were final)
    "llama-b": dict(model_type="llama", hidden_size=192, intermediate_size=512, num_hidden_layers=3,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=32, vocab_size=5120,
                    tie_word_embeddings=False),
    "qwen3-b": dict(model_type="qwen3", hidden_size=160, intermediate_size=448, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=48, vocab_size=6144,
                    tie_word_embeddings=False),
}
# the second wave's 251 tokens are not a multiple of 2 or 4: veRL pads the packed row
WAVES = [(200, 120, 40, 40), (161, 90)]
LORA_RANK = 16
HEAD = "transformers"


def classes():
    """(family, checkpointing, attention, fsdp, ulysses, head)."""
    out = [("llama", ckpt, attn, 2, 2, HEAD) for ckpt in (True, False) for attn in ("sdpa", "eager")]
    out += [("qwen3", True, "sdpa", 2, 2, HEAD), ("qwen3", False, "eager", 2, 2, HEAD)]
    out += [("llama", True, "sdpa", 4, 2, HEAD), ("llama", True, "sdpa", 4, 4, HEAD)]
    return out


# veRL's heads (`--heads`): traced after `fsdp.verl_head`'s terms were final, longer waves
HEAD_WAVES = [(600, 400, 24), (1000,)]


# `--held-out`: new shapes, LoRA rank 8, waves with one sequence and with three
HELD_WAVES = [(500, 300, 40), (700,)]
HELD_RANK = 8


def held_out_classes():
    """(family, checkpointing, attention, fsdp, ulysses, head) of the held-out set."""
    return [("llama-b", True, "sdpa", 2, 1, "verl"), ("llama-b", False, "eager", 2, 1, "verl"),
            ("llama-b", False, "sdpa", 2, 1, "verl-chunked"), ("llama-b", True, "eager", 2, 2, "verl-chunked"),
            ("qwen3-b", True, "sdpa", 2, 2, "verl"), ("qwen3-b", False, "eager", 2, 2, "verl"),
            ("llama-b", True, "eager", 2, 2, HEAD)]


def head_classes():
    """(family, checkpointing, attention, fsdp, ulysses, head) of the veRL head set."""
    return [("llama", True, "sdpa", 2, 1, "verl"), ("llama", False, "sdpa", 2, 1, "verl"),
            ("llama", True, "sdpa", 2, 1, "verl-chunked"), ("qwen3", True, "eager", 2, 2, "verl")]


def key(fam, ckpt, attn, fsdp, ulysses, head):
    return (f"{fam}/{'ckpt' if ckpt else 'nockpt'}/{attn}/fsdp{fsdp}/ulysses{ulysses}"
            + ("" if head == HEAD else f"/{head}"))


def run_traces(limit: int | None, device: str, todo_classes) -> None:
    from waveplan.pricing.measure.fsdp_verl_trace import trace_fsdp_verl

    done = set()
    if TRACES.exists():
        for line in TRACES.read_text().splitlines():
            done.add(json.loads(line)["class"])
    todo = [c for c in todo_classes if key(*c) not in done][:limit]
    for fam, ckpt, attn, fsdp, ulysses, head in todo:
        name = key(fam, ckpt, attn, fsdp, ulysses, head)
        held = fam.endswith("-b")
        jobs = HELD_WAVES if held else WAVES if head == HEAD else HEAD_WAVES
        traces = trace_fsdp_verl(FAMILIES[fam], jobs=jobs, fsdp=fsdp, ulysses=ulysses, head=head,
                                 attn=attn, checkpointing=ckpt, device=device,
                                 lora_rank=HELD_RANK if held else LORA_RANK)
        with TRACES.open("a", encoding="utf-8") as fh:
            for t in traces:
                fh.write(json.dumps(dict(t.to_dict(), family=fam, **{"class": name}),
                                    sort_keys=True) + "\n")
        print("traced", name, flush=True)


def table() -> str:
    from waveplan.pricing.fsdp.check import price_record

    rows, ratios = [], {}
    for line in TRACES.read_text().splitlines():
        rec = json.loads(line)
        b = price_record(rec)
        r = b.raw_bytes / rec["peak_bytes"]
        ratios.setdefault(rec["class"], []).append(r)
        rows.append(f"{rec['class']:<40} {str(rec['seq_lens']):<18} {rec['peak_bytes']:>11} "
                    f"{b.raw_bytes:>11} {100 * (r - 1):+6.1f}%  {b.binding}")
    lines = ["# fsdp framework, Ulysses (veRL's all-to-all) and veRL's heads: raw price vs traced peak "
             "above rest (busiest rank), CPU gloo traces",
             "# generated by bench/fsdp_ulysses_validation.py; sets 1 and 2 were traced before the eager "
             "all-to-all, sdpa one-sequence and veRL-head constant terms were set (not held out for them); "
             "the -b classes were traced after (held out)",
             f"{'class':<40} {'waves':<18} {'traced':>11} {'priced':>11} {'over':>7}  binding", *rows, "",
             f"{'class':<40} {'cells':>5} {'under':>5} {'median':>8} {'worst':>8}"]
    for c, v in sorted(ratios.items()):
        lines.append(f"{c:<40} {len(v):>5} {sum(x < 1 for x in v):>5} "
                     f"{100 * (statistics.median(v) - 1):+7.1f}% {100 * (max(v) - 1):+7.1f}%")
    for label, pick in (("Ulysses, transformers' loss (set 1)", lambda c: "/verl" not in c and "-b/" not in c),
                        ("veRL heads (set 2)", lambda c: "/verl" in c and "-b/" not in c),
                        ("held out (--held-out)", lambda c: "-b/" in c)):
        part = [r for c, v in ratios.items() if pick(c) for r in v]
        if part:
            lines.append(f"{label:<40} {len(part):>5} {sum(x < 1 for x in part):>5} "
                         f"{100 * (statistics.median(part) - 1):+7.1f}% {100 * (max(part) - 1):+7.1f}%")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--classes", type=int, default=None, help="trace at most N new classes")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--heads", action="store_true", help="trace the veRL head set")
    parser.add_argument("--held-out", action="store_true", help="trace the held-out set (new shapes)")
    args = parser.parse_args()
    if not args.table_only:
        todo = held_out_classes() if args.held_out else head_classes() if args.heads else classes()
        run_traces(args.classes, args.device, todo)
    text = table()
    TABLE.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
