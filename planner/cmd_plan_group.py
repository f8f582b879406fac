"""`waveplan plan STEP --dp N`: the data-parallel group's batch planned at once (`group`)."""

from __future__ import annotations

import argparse

from waveplan.pricing.errors import ConfigError, bad
from waveplan.pricing.step import Step

from .cli_common import gib, parse_gib
from .group import GroupPlan, plan_group
from .planner import Planner


def check_args(args: argparse.Namespace) -> int | list[int]:
    """The flags `--dp` plans with (one ConfigError line for the others) and the budget:
    `--free-gib` one number for every rank, or `--dp` comma-separated numbers, one per rank."""
    if isinstance(args.dp, bool) or not isinstance(args.dp, int) or args.dp < 1:
        raise bad(ConfigError, "--dp", args.dp, "must be an integer >= 1 (the data-parallel size)")
    for flag, value in (("--num-waves", args.num_waves), ("--report", args.report),
                        ("--plot", args.plot)):
        if value is not None:
            raise bad(ConfigError, flag, value, "is not available with --dp (each rank's plan is in --json)")
    parts = str(args.free_gib).split(",")
    if len(parts) == 1:
        return int(parse_gib(parts[0], "free_gib") * 2**30)
    if len(parts) != args.dp:
        raise bad(ConfigError, "--free-gib", args.free_gib,
                  f"needs one number, or {args.dp} comma-separated numbers (one per rank of --dp)")
    return [int(parse_gib(p.strip(), "free_gib") * 2**30) for p in parts]


def run_group(args: argparse.Namespace, planner: Planner, step: Step, budget) -> int:
    """Plan `step` over `args.dp` ranks (`budget`: bytes for each, or one per rank); print the
    table or the JSON."""
    group = plan_group(planner, step, args.dp, budget, packer=args.packer,
                       time_budget_ms=args.time_budget_ms, seed=args.seed)
    if args.json:
        print(group.to_json())
    else:
        print_group(group)
    return 0


def print_group(group: GroupPlan) -> None:
    print(f"{'rank':>4} {'wave':>4} {'requests':>8} {'packed':>9} {'admitted GiB':>12} "
          f"{'budget GiB':>10}  binding")
    for r, plan in enumerate(group.ranks):
        for w in plan.waves:
            print(f"{r:>4} {w.index:>4} {len(w.request_ids):>8} {w.size.packed_rows:>9} "
                  f"{gib(w.admitted_bytes):>12} {gib(w.budget_bytes):>10}  {w.breakdown.binding}")
        print(f"rank {r}: {len(group.shares[r])} requests, {plan.num_waves} waves, "
              f"predicted {group.rank_seconds[r]:.2f} s")
    verdict = "proven optimal" if group.proven_optimal else "not proven optimal"
    print(f"{group.dp} rank{'' if group.dp == 1 else 's'} x {group.num_waves} "
          f"wave{'' if group.num_waves == 1 else 's'}; lower bound {group.lower_bound_waves}: "
          f"{verdict}; predicted step {group.step_seconds:.2f} s (slowest rank); "
          f"prompt groups {'whole' if group.keep_groups else 'split by sequence'}; "
          f"start {group.start}  ({group.planning_ms:.0f} ms)")
    for name, b in sorted(group.baselines.items()):
        print(f"baseline {name} (veRL's balance, then each share planned, MAX): "
              f"{b['waves']} waves, predicted {b['seconds']:.2f} s")
