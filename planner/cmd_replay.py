"""`waveplan replay`: rebuild a plan report's inputs, re-plan, and report any difference."""

from __future__ import annotations

import argparse
import json
import sys

from .report import replay

MAX_SHOWN = 20  # differences printed; the summary line counts them all


def register(sub) -> None:
    parser = sub.add_parser(
        "replay", help="re-plan a report and compare",
        description="Rebuild everything from a report written by `waveplan plan --report` (model, "
                    "coefficients, profiles, requests, budget, options; no preset needed), plan "
                    "again and compare, ignoring planning_ms. Exit 0: identical; 1: different "
                    "(each difference is printed); 2: the report cannot be read.")
    parser.add_argument("report", help="report file (JSON)")
    parser.add_argument("--json", action="store_true", help="print the new plan as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan, differences = replay(args.report)
    if args.json:
        print(json.dumps(plan, sort_keys=True, indent=1))
    if differences:
        old = read_report_plan(args.report)
        print(f"replay differs from {args.report}: report {_count(old)}, replay {_count(plan)}; "
              f"{len(differences)} difference{'' if len(differences) == 1 else 's'}"
              f"{f' (first {MAX_SHOWN} shown)' if len(differences) > MAX_SHOWN else ''}:",
              file=sys.stderr)
        for line in differences[:MAX_SHOWN]:
            print(f"  {line}", file=sys.stderr)
        return 1
    if not args.json:
        print(f"replay identical: {len(plan['waves'])} waves, lower bound {plan['lower_bound_waves']}")
    return 0


def read_report_plan(path: str) -> dict:
    """The report's stored plan (already read once by `replay`, so readable)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("plan", {})


def _count(plan: dict) -> str:
    waves = plan.get("waves") if isinstance(plan, dict) else None
    n = len(waves) if isinstance(waves, list) else "?"
    return f"{n} wave{'' if n == 1 else 's'}, lower bound {plan.get('lower_bound_waves', '?')}"
