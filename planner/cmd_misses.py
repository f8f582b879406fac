"""`waveplan misses`: summarise a misses file and re-price every record with today's model."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from waveplan.pricing.coefficients import load_table
from waveplan.pricing.errors import WaveplanError

from .cli_common import gib
from .misses import MissKind, MissRecord, Repriced, read_misses, reprice

DEFAULT_TOP = 10  # worst ratios listed


def register(sub) -> None:
    parser = sub.add_parser(
        "misses", help="summarise a misses file and re-price it with today's model",
        description="Read a misses file (JSON Lines that Planner.observe appends when a wave's peak "
                    "went above its estimate): the misses per kind, class and basis, the worst "
                    "peak/estimate ratios, and every record re-priced with today's model (today's "
                    "code with the coefficient table --backend names, else today's shipped table of "
                    "the recorded backend, else the recorded table), to check whether an upgrade or a "
                    "calibration fixed it. Exit 0: every record read; 2: the file cannot be read, or "
                    "a record is bad (one line each on stderr, after the summary of the others).")
    parser.add_argument("file", help="misses file (JSON Lines)")
    parser.add_argument("--backend", "--coefficients", dest="backend", default=None,
                        help="re-price with this coefficient table: a shipped backend or a JSON file, "
                             "e.g. one fitted by `waveplan calibrate`")
    parser.add_argument("--top", type=int, default=DEFAULT_TOP, help="worst ratios listed")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.backend is not None:
        load_table(args.backend)   # a bad --backend: one error line, before any record
    records, bad_lines = read_misses(args.file)
    rows: list[tuple[MissRecord, Repriced]] = []
    for record in records:
        try:
            rows.append((record, reprice(record, backend=args.backend)))
        except WaveplanError as exc:
            bad_lines.append((record.line, f"{args.file} line {record.line}: {exc}"))
    summary = summarise(args.file, rows, top=max(0, args.top))
    if args.json:
        summary["bad"] = [line for _, line in sorted(bad_lines)]
        print(json.dumps(summary, indent=1, sort_keys=True))
    else:
        print_summary(summary)
    for _, line in sorted(bad_lines):
        print(f"waveplan: error: {line}", file=sys.stderr)
    return 2 if bad_lines else 0


def summarise(path: str, rows: list[tuple[MissRecord, Repriced]], *, top: int) -> dict:
    """Counts per kind, class and basis; every record with its re-pricing, worst ratio first."""
    entries = []
    for record, today in rows:
        d = record.data
        estimate = d["estimate"]
        entries.append({
            "line": record.line, "wave": d["wave"].get("index"), "class": record.label,
            "kind": record.kind.value, "ratio": record.ratio, "peak_bytes": d["peak_bytes"],
            "raw_bytes": d["raw_bytes"], "admitted_bytes": d["admitted_bytes"],
            "binding": estimate.get("binding"), "basis": estimate.get("basis"),
            "time": d.get("time"), "versions": d.get("versions"),
            "today": {"raw_bytes": today.raw_bytes, "admitted_bytes": today.admitted_bytes,
                      "kind": today.kind.value, "same_estimate": today.same_estimate(record),
                      "coefficients": today.coefficients, "same_table": today.same_table,
                      "binding": today.breakdown.binding, "basis": today.breakdown.basis}})
    entries.sort(key=lambda e: (-e["ratio"], e["line"]))
    return {"file": str(path), "misses": len(entries),
            "by_kind": dict(Counter(e["kind"] for e in entries)),
            "by_class": dict(Counter(e["class"] for e in entries)),
            "by_basis": dict(Counter(e["basis"] for e in entries)),
            "today": {"same_estimate": sum(e["today"]["same_estimate"] for e in entries),
                      "by_kind": dict(Counter(e["today"]["kind"] for e in entries))},
            "worst": entries[:top], "records": entries}


def _counts(counter: dict) -> list[str]:
    return [f"  {n:6d}  {key}" for key, n in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))]


def print_summary(s: dict) -> None:
    kinds = ", ".join(f"{s['by_kind'].get(k.value, 0)} {k.value}"
                      for k in (MissKind.OVER_ADMITTED, MissKind.OVER_RAW))
    print(f"{s['file']}: {s['misses']} miss{'' if s['misses'] == 1 else 'es'} ({kinds})")
    if not s["misses"]:
        return
    print("by class:")
    print("\n".join(_counts(s["by_class"])))
    print("by basis:")
    print("\n".join(_counts(s["by_basis"])))
    today = s["today"]
    print(f"re-priced with today's model: {today['same_estimate']} of {s['misses']} the same estimate; "
          "against today's estimates: " + ", ".join(
              f"{today['by_kind'].get(k.value, 0)} {k.value}" for k in MissKind))
    print("worst ratios (peak / raw estimate), re-priced today:")
    for e in s["worst"]:
        t = e["today"]
        change = "same" if t["same_estimate"] else f"{(t['raw_bytes'] / e['raw_bytes'] - 1) * 100:+.2f}%"
        print(f"  {e['ratio']:.4f}  {e['kind']:<13}  line {e['line']}  wave {e['wave']}  {e['class']}  "
              f"peak {gib(e['peak_bytes'])} GiB, raw {gib(e['raw_bytes'])} GiB, admitted "
              f"{gib(e['admitted_bytes'])} GiB; binding {e['binding']}, basis {e['basis']}")
        print(f"          today: raw {gib(t['raw_bytes'])} GiB ({change}), admitted "
              f"{gib(t['admitted_bytes'])} GiB -> {t['kind']} ({t['coefficients']}"
              f"{'' if t['same_table'] else ', not the recorded table'})")
