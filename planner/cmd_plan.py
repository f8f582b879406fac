"""`waveplan plan`: cut a step into waves that fit the free memory, print or save the plan."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from waveplan.pricing.errors import ConfigError
from waveplan.pricing.step import Step, bundled_step, list_bundled_steps, load_step
from waveplan.search import DEFAULT_PACKER, DEFAULT_SEED, DEFAULT_TIME_BUDGET_MS, PackerKind

from .cli_common import add_model_args, gib, model_from_args, parse_gib
from .plan import Plan
from .planner import Planner
from .report import PlanOptions, write_report

DEFAULT_STEP = "grpo-8x8"
DEFAULT_FREE_GIB = "40"  # typical room left per H200 rank after a 27B model's TP4 shard and optimizer


def register(sub) -> None:
    parser = sub.add_parser(
        "plan", help="plan a step's waves",
        description="Cut STEP's requests into waves that fit --free-gib on every rank, in as few "
                    "waves as possible, and print the plan with its lower bound. With no arguments: "
                    f"the bundled {DEFAULT_STEP} step on qwen3.8-27b, TP4 with sequence parallelism, "
                    f"full recompute, LoRA rank 16, {DEFAULT_FREE_GIB} GiB free per rank.")
    parser.add_argument("step", nargs="?", default=DEFAULT_STEP,
                        help="step file (JSON Lines) or a bundled step "
                             f"({', '.join(list_bundled_steps())}; default {DEFAULT_STEP})")
    add_model_args(parser, default_tp=4, default_sp=True)
    parser.add_argument("--free-gib", default=DEFAULT_FREE_GIB, metavar="X",
                        help=f"free GiB per rank (default {DEFAULT_FREE_GIB})")
    parser.add_argument("--packer", default=DEFAULT_PACKER.value, choices=[k.value for k in PackerKind],
                        help=f"packer (default {DEFAULT_PACKER.value})")
    parser.add_argument("--time-budget-ms", type=float, default=DEFAULT_TIME_BUDGET_MS, metavar="T",
                        help=f"planning time budget in ms (default {DEFAULT_TIME_BUDGET_MS:g})")
    parser.add_argument("--num-waves", type=int, default=None, metavar="N",
                        help="exactly N waves (all data-parallel ranks run the same count)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the randomised search")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--report", metavar="FILE", help="write a replayable report (JSON)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the plan")
    parser.add_argument("--profiles", metavar="FILE",
                        help="learned profiles (JSON); a corrupt file is set aside as FILE.corrupt")
    parser.set_defaults(func=run)


def resolve_step(spec: str) -> Step:
    """An existing file wins over a bundled step of the same name."""
    path = Path(spec)
    if not path.is_file() and spec.removesuffix(".jsonl") in list_bundled_steps():
        path = bundled_step(spec)
    return load_step(path)


def run(args: argparse.Namespace) -> int:
    budget = int(parse_gib(args.free_gib, "free_gib") * 2**30)
    planner = Planner.from_model(model_from_args(args), profiles_path=args.profiles)
    step = resolve_step(args.step)
    options = PlanOptions(packer=args.packer, time_budget_ms=args.time_budget_ms,
                          num_waves=args.num_waves, seed=args.seed)
    plan = planner.plan(step, free_bytes=budget, **options.kwargs())
    if args.report:
        write_report(args.report, planner, step, plan, options)
    if args.plot:
        plot_plan(plan.to_dict(), args.plot)
    if args.json:
        print(plan.to_json())
    else:
        print_table(planner, plan)
    return 0


def plot_plan(plan_dict: dict, path: str) -> None:
    try:
        module = importlib.import_module("waveplan.planner.plot")
    except ModuleNotFoundError as exc:
        if exc.name not in ("waveplan.planner.plot", "matplotlib"):
            raise
        raise ConfigError(f"plot={path!r}: plotting is unavailable ({exc.name} is not installed)") from None
    module.plot_plan(plan_dict, path)


def print_table(planner: Planner, plan: Plan) -> None:
    m = planner.model
    print(f"model {m.geometry.name}  TP{m.parallel.tp} CP{m.parallel.cp}"
          f"{' SP' if m.parallel.sequence_parallel else ''}  {m.recompute.mode.value} recompute  "
          f"head {m.head}  backend {m.table.backend}  safety x{m.safety}")
    print(f"{'wave':>4} {'requests':>8} {'packed':>9} {'logical':>9} {'admitted GiB':>12} "
          f"{'budget GiB':>10}  binding")
    for w in plan.waves:
        size = w.size
        note = f"  [{len(w.children)} children]" if w.is_split else ""
        first = f"  first:{','.join(sorted(w.first_slots))}" if w.first_slots else ""
        print(f"{w.index:>4} {len(w.request_ids):>8} {size.packed_rows:>9} {size.logical_rows:>9} "
              f"{gib(w.admitted_bytes):>12} {gib(w.budget_bytes):>10}  {w.breakdown.binding} "
              f"({w.breakdown.basis}){first}{note}")
    verdict = "proven optimal" if plan.proven_optimal else "not proven optimal"
    print(f"{plan.num_waves} waves; lower bound {plan.lower_bound_waves}: {verdict}  "
          f"({plan.packer}, {plan.planning_ms:.2f} ms)")
    if plan.compile_ms > 0:
        print(f"compiled kernels first: {plan.compile_ms / 1e3:.2f} s (once per machine; "
              "`waveplan warmup` pays it ahead)")
