"""`waveplan calibrate`: fit a backend's coefficient table to traced wave peaks."""

from __future__ import annotations

from pathlib import Path

from waveplan.pricing.coefficients import DEFAULT_BACKEND


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="fit a coefficient table to traced wave peaks (JSON Lines)",
        description="Fit the factors of the BASE table's term groups to the traced peaks in "
                    "TRACES (lines printed by `waveplan trace --json`, or records "
                    "{cell, trace} as bench/validation_study.py writes them) "
                    "as a linear programme: minimise the mean estimate/trace ratio with every "
                    "cell, whole peak and decoder-only, covered with a 0.5% margin. "
                    "Writes the table atomically.")
    parser.add_argument("traces", help="trace records, JSON Lines")
    parser.add_argument("--base", default=DEFAULT_BACKEND,
                        help=f"base table: backend name or JSON file (default {DEFAULT_BACKEND})")
    parser.add_argument("--backend", default="torch-cpu", help="backend name of the fitted table")
    parser.add_argument("--out", required=True, help="where to write the fitted table (JSON)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from waveplan.pricing.measure import calibrate

    records = calibrate.read_traces(args.traces)
    base = calibrate.load_base(args.base)
    devices = sorted({str(r["trace"].get("device", "cpu-fake")) for r in records})
    table = calibrate.fit_table(records, base, backend=args.backend,
                                source_label=f"{Path(args.traces).name} ({', '.join(devices)})")
    calibrate.write_table(table, args.out, description=(
        f"fitted by `waveplan calibrate` from {len(records)} traced cells of "
        f"{Path(args.traces).name}, base table {args.base}"))
    ratios = calibrate._ratios(table, {}, records)
    print(f"wrote {args.out}: {len(records)} cells, min estimate/trace {min(ratios):.4f}, "
          f"max {max(ratios):.4f}")
    return 0
