"""`waveplan replay`: rebuild a plan report's inputs, re-plan, and report any difference."""

from __future__ import annotations

import argparse
import json
import sys

from .report import replay


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
        print(f"replay differs from {args.report} ({len(differences)} differences):", file=sys.stderr)
        for line in differences:
            print(f"  {line}", file=sys.stderr)
        return 1
    if not args.json:
        print(f"replay identical: {len(plan['waves'])} waves, lower bound {plan['lower_bound_waves']}")
    return 0
