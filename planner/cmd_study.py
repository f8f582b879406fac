"""`waveplan study`: plan many steps under several packers and pricing settings, compare waves."""

from __future__ import annotations

import argparse
import math

from waveplan.pricing.errors import ConfigError, bad
from waveplan.search import DEFAULT_TIME_BUDGET_MS, PackerKind

from .cli_common import add_model_args, check_output, model_from_args, parse_gib
from .study import DISTRIBUTIONS, GeneratorSpec, Variant, run_study, steps_from_dir


def register(sub) -> None:
    parser = sub.add_parser(
        "study", help="compare packers and pricing settings over many steps",
        description="Plan every step under every variant (packer x pricing) and print, per "
                    "variant, total waves, waves above the lower bound, the share proven optimal, "
                    "planning times, and where one variant needs fewer waves than another; then per "
                    "step and variant its status: settled (the plan meets its lower bound: no plan "
                    "has fewer waves) or open (above the bound: fewer may exist).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--steps", metavar="DIR", help="a directory of *.jsonl step files")
    source.add_argument("--generate", choices=DISTRIBUTIONS,
                        help="generate steps: grpo (prompts x completions) or sft (unshared)")
    parser.add_argument("--count", type=int, default=20, help="generated steps (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument("--prompts", type=int, default=32, help="grpo: prompts per step (default 32)")
    parser.add_argument("--completions", type=int, default=16,
                        help="grpo: completions per prompt (default 16)")
    parser.add_argument("--requests", type=int, default=256, help="sft: requests per step (default 256)")
    add_model_args(parser)
    parser.add_argument("--free-gib", required=True, help="free memory per rank, GiB")
    parser.add_argument("--packers", default="auto,ffd",
                        help="comma-separated packer kinds, each a variant "
                             f"({', '.join(k.value for k in PackerKind)}; default auto,ffd)")
    parser.add_argument("--compare-backend", metavar="NAME",
                        help="add a variant: the first packer priced with this coefficient backend")
    parser.add_argument("--compare-safety", type=float, metavar="F",
                        help="add a variant: the first packer with this safety factor")
    parser.add_argument("--time-budget-ms", type=float, default=DEFAULT_TIME_BUDGET_MS,
                        help=f"search time budget per step, ms (default {DEFAULT_TIME_BUDGET_MS:g})")
    parser.add_argument("--deterministic", action="store_true",
                        help="search by iteration count, never the clock (same plans on any machine)")
    parser.add_argument("--csv", metavar="FILE", help="write one row per (step, variant)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw waves per step per variant")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (tqdm's when installed, else a one-line counter)")
    parser.set_defaults(func=run)


def parse_packers(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    known = {k.value for k in PackerKind}
    if not names:
        raise bad(ConfigError, "--packers", text, "must name at least one packer")
    for name in names:
        if name not in known:
            raise bad(ConfigError, "--packers", name, f"unknown packer (known: {', '.join(sorted(known))})")
    if len(set(names)) != len(names):
        raise bad(ConfigError, "--packers", text, "names a packer twice")
    return names


def build_variants(args: argparse.Namespace) -> list[Variant]:
    """One variant per packer on the base pricing, plus one per pricing comparison (first packer)."""
    base = model_from_args(args)
    packers = parse_packers(args.packers)
    variants = [Variant(name=p, model=base, packer=p) for p in packers]
    if args.compare_backend:
        model = model_from_args(argparse.Namespace(**{**vars(args), "backend": args.compare_backend}))
        variants.append(Variant(name=f"{packers[0]}+backend={args.compare_backend}", model=model,
                                packer=packers[0]))
    if args.compare_safety is not None:
        if not math.isfinite(args.compare_safety) or args.compare_safety < 1.0:
            raise bad(ConfigError, "--compare-safety", args.compare_safety, "must be a number >= 1.0")
        model = model_from_args(argparse.Namespace(**{**vars(args), "safety": args.compare_safety}))
        variants.append(Variant(name=f"{packers[0]}+safety={args.compare_safety:g}", model=model,
                                packer=packers[0]))
    return variants


def run(args: argparse.Namespace) -> int:
    budget = parse_gib(args.free_gib, "--free-gib") * 2**30
    if not math.isfinite(args.time_budget_ms) or args.time_budget_ms <= 0:
        raise bad(ConfigError, "--time-budget-ms", args.time_budget_ms, "must be a positive number")
    check_output(args.csv, "--csv")
    check_output(args.plot, "--plot", needs_matplotlib=True)  # before the study, not after it
    if args.steps:
        steps = steps_from_dir(args.steps)
        source = f"steps from {args.steps}"
    else:
        steps = GeneratorSpec(distribution=args.generate, count=args.count, seed=args.seed,
                              prompts=args.prompts, completions=args.completions, requests=args.requests)
        shape = (f"{args.prompts}x{args.completions}" if args.generate == "grpo"
                 else f"{args.requests} requests")
        source = f"generated {args.generate} ({shape}), count {args.count}, seed {args.seed}"
    variants = build_variants(args)
    model = variants[0].model
    result = run_study(steps, variants, budget_bytes=budget, time_budget_ms=args.time_budget_ms,
                       progress=not args.no_progress, deterministic=args.deterministic)
    print(f"model {model.geometry.name}  TP{model.parallel.tp} CP{model.parallel.cp} PP{model.parallel.pp} "
          f"{'SP ' if model.parallel.sequence_parallel else ''}{model.recompute.mode.value} recompute  "
          f"head {model.head}  backend {model.table.backend}  safety {model.safety}; {source}")
    print(result.table(), end="")
    if args.csv:
        result.to_csv(args.csv)
    if args.plot:
        from .plot import plot_study

        plot_study(result, args.plot)
    return 0
