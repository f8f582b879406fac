"""`waveplan calibrate`: fit a backend's coefficient table to traced wave peaks, or to the peaks
a training run observed (`--profiles`)."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

from waveplan.pricing.coefficients import DEFAULT_BACKEND
from waveplan.pricing.errors import ConfigError, bad
from waveplan.pricing.model import DEFAULT_SAFETY

from .cli_common import add_model_args, model_from_args


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="fit a coefficient table to traced or observed wave peaks",
        description="Fit the factors of the BASE table's term groups. From TRACES (lines printed "
                    "by `waveplan trace --json`, or records {cell, trace} as "
                    "bench/validation_study.py writes them): a linear programme that minimises "
                    "the mean estimate/trace ratio with every cell, whole peak and decoder-only, "
                    "covered with a 0.5% margin; `trace --framework fsdp --json` records fit "
                    "the fsdp framework's four factors (docs/memory-model.md#fsdp-calibration). "
                    "From --profiles (what `Planner.save_profiles` / "
                    "`plan --profiles` wrote during a training run): give the model flags the "
                    "planner used and BASE = the table it planned with; every observed wave is "
                    "re-priced to check it was learned with that model, then each group is "
                    "lowered as far as every observed peak stays covered with a 0.5% margin "
                    "(docs/memory-model.md#calibration). Writes the table atomically.")
    parser.add_argument("traces", nargs="?", help="trace records, JSON Lines")
    parser.add_argument("--profiles", metavar="FILE",
                        help="fit to the peaks of a profile store instead of traces")
    parser.add_argument("--base", default=DEFAULT_BACKEND,
                        help="base table: backend name or JSON file; with --profiles, the table "
                             f"the planner priced with (default {DEFAULT_BACKEND})")
    parser.add_argument("--backend", default=None,
                        help="backend name of the fitted table (default: torch-cpu for traces, "
                             "BASE-profiled for --profiles)")
    parser.add_argument("--out", required=True, help="where to write the fitted table (JSON)")
    group = parser.add_argument_group("the model the profiles were learned with (--profiles only)")
    add_model_args(group, default_model=None, table=False)
    parser.set_defaults(func=run)


def run(args) -> int:
    from waveplan.pricing.measure import calibrate

    if (args.traces is None) == (args.profiles is None):
        raise bad(ConfigError, "traces", args.traces,
                  "give either a TRACES file or --profiles FILE (one of them)")
    if args.profiles is not None:
        return _run_profiles(args)
    fsdp = _fsdp_records(args.traces)
    if fsdp is not None:
        return _run_fsdp_traces(args, fsdp)
    records = calibrate.read_traces(args.traces)
    base = calibrate.load_base(args.base)
    devices = sorted({str(r["trace"].get("device", "cpu-fake")) for r in records})
    table = calibrate.fit_table(records, base, backend=args.backend or "torch-cpu",
                                source_label=f"{Path(args.traces).name} ({', '.join(devices)})")
    calibrate.write_table(table, args.out, description=(
        f"fitted by `waveplan calibrate` from {len(records)} traced cells of "
        f"{Path(args.traces).name}, base table {args.base}"))
    ratios = calibrate._ratios(table, {}, records)
    print(f"wrote {args.out}: {len(records)} cells, min estimate/trace {min(ratios):.4f}, "
          f"max {max(ratios):.4f}")
    return 0


def _fsdp_records(path: str) -> list[dict] | None:
    """The file's `trace --framework fsdp` records, or None when it holds Megatron records."""
    from waveplan.pricing.fsdp.calibrate import read_fsdp_traces

    p = Path(path)
    if not p.is_file():
        raise bad(ConfigError, "traces", path, "no such file")
    return read_fsdp_traces(p.read_text(encoding="utf-8").splitlines(), p.name)


def _run_fsdp_traces(args: argparse.Namespace, records: list[dict]) -> int:
    """Fit the fsdp framework's factors (`pricing.fsdp.calibrate`) to fsdp trace records."""
    from waveplan.pricing.fsdp import calibrate as fsdp_calibrate
    from waveplan.pricing.measure import calibrate

    from .profile_fit import summary

    base = calibrate.load_base(args.base)
    name = Path(args.traces).name
    devices = sorted({str(r.get("device", "cpu")) for r in records})
    table, ratios = fsdp_calibrate.fit_traces(records, base, backend=args.backend or f"{base.backend}-fsdp",
                                              source_label=f"{name} ({', '.join(devices)})")
    calibrate.write_table(table, args.out, description=(
        f"fitted by `waveplan calibrate` from {len(records)} fsdp traces of {name}, base table {args.base}"))
    scales = getattr(table, "_fit_scales", {})
    print(f"wrote {args.out}: {len(records)} fsdp traces, factors "
          + ", ".join(f"{g} {scales.get(g, 1.0):.4f}" for g in fsdp_calibrate.GROUPS))
    print(f"  fit: {summary(ratios)}")
    return 0


def _run_profiles(args: argparse.Namespace) -> int:
    from waveplan.pricing.measure import calibrate

    from . import profile_fit
    from .profiles import load_profiles

    if args.model is None:
        raise bad(ConfigError, "--model", None,
                  "--profiles needs the model the planner used (preset name or HF config.json)")
    path = Path(args.profiles)
    if not path.is_file():
        raise bad(ConfigError, "--profiles", args.profiles, "no such file")
    store = load_profiles(path)
    margs = copy.copy(args)
    margs.backend, margs.safety = args.base, DEFAULT_SAFETY
    model = model_from_args(margs)
    backend = args.backend or f"{model.table.backend}-profiled"
    fit = profile_fit.fit_profiles(store, model, backend=backend, source_label=path.name)
    calibrate.write_table(fit.table, args.out, description=(
        f"fitted by `waveplan calibrate --profiles` from {len(fit.cells)} observed waves of "
        f"{path.name} ({model.geometry.name}), base table {args.base}"))
    print(f"wrote {args.out}: {len(fit.cells)} observed waves of {path.name}; least uniform "
          f"factor {fit.uniform:.4f}")
    print(f"  fit:      {profile_fit.summary(fit.ratios)}")
    held = profile_fit.held_out(model, fit.cells)
    if held is None:
        print("  held out: too few waves to hold any out (need 4)")
    else:
        print(f"  held out: fitted on {held[0]}, priced the other {profile_fit.summary(held[1])}")
        if min(held[1]) < 1.0:
            print("  warning: a held-out wave priced under its peak: the waves observed do not "
                  "cover what the model will be asked to price; observe more before planning "
                  "with this table")
    if fit.skipped:
        print(f"  skipped {len(fit.skipped)} profiles of other configurations")
    return 0
