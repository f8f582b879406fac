"""`waveplan plan`: cut a step into waves that fit the free memory, print or save the plan."""

from __future__ import annotations

import argparse
import importlib
import logging
import time

import numpy as np

from waveplan.pricing.errors import ConfigError, InfeasibleError, bad
from waveplan.pricing.step import Step, list_bundled_steps
from waveplan.search import DEFAULT_PACKER, DEFAULT_SEED, DEFAULT_TIME_BUDGET_MS, PackerKind
from waveplan.search.options import DEFAULT_MS_PER_REQUEST

from . import cold_start
from .cli_common import (
    STEP_HELP,
    add_model_args,
    check_output,
    fsdp_words,
    gib,
    model_from_args,
    parse_gib,
    read_step,
)
from .ep_peers import single_rank_note
from .plan import Plan
from .planner import Planner
from .report import PlanOptions, write_report

DEFAULT_STEP = "grpo-8x8"
DEFAULT_FREE_GIB = "40"  # typical room left per H200 rank after a 27B model's TP4 shard and optimizer
log = logging.getLogger("waveplan.plan")
SHOWN_IDS = 5   # ids named in the does-not-fit error, largest first

LEGEND = (
    "wave         run order; holds #I-J: its requests by position in the step (0-based; ids in --json)",
    "requests     requests in the wave",
    "packed       token rows run, a shared prompt prefix once; logical: the rows without sharing",
    "admitted     estimated peak x safety, <= budget (GiB per rank)",
    "binding      the point of the pass where the peak sits (phase:layer:mixer/mlp), then the basis",
    "             of its price: evidence (a traced layout), conservative (no trace covers it:",
    "             priced high), assumed (--moe-load), profile (learned from peaks); [k]: the",
    "             reasons, in note [k] under the waves",
    "first:S      the wave is the first of LoRA slots S and also holds their adapter gradients",
    "lower bound  no plan within the budget packed against has fewer waves; proven optimal: the",
    "             plan meets it; not proven: see the line above and docs/faq.md#lower-bound",
)

NOT_PROVEN = {   # why a plan above its bound is not proven (search.packers.not_proven_why)
    "time": "the time budget ran out first: try a larger --time-budget-ms or --packer exact",
    "model size": "too large for the exact packer's model: a larger --time-budget-ms may still help",
    "bound": "no envelope plan has fewer waves: the bound under exact prices may be loose",
}


def legend(*, fixed_count: bool = False) -> str:
    """The table's legend, one column per line; under --num-waves without the lower-bound line
    (the count was asked for, its optimality is not the question)."""
    return "\n".join(LEGEND[:-2] if fixed_count else LEGEND)


def ranges(indices) -> str:
    """Sorted positions as compact ranges: `#0-7,12,40-44`."""
    parts: list[str] = []
    values = sorted(int(i) for i in indices)
    start = prev = values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(f"{start}-{prev}" if prev > start else f"{start}")
        if v is not None:
            start = prev = v
    return "#" + ",".join(parts)


def register(sub) -> None:
    parser = sub.add_parser(
        "plan", help="plan a step's waves",
        description="Cut STEP's requests into waves that fit --free-gib on every rank, in as few "
                    "waves as possible, and print the plan with its lower bound. With no arguments: "
                    f"the bundled {DEFAULT_STEP} step on qwen3.8-27b, TP1, no sequence parallelism, "
                    f"full recompute, LoRA rank 16, {DEFAULT_FREE_GIB} GiB free per rank; every "
                    "default is shown below.")
    parser.add_argument("step", nargs="?", default=DEFAULT_STEP,
                        help=STEP_HELP.format(", ".join(list_bundled_steps())))
    add_model_args(parser)
    parser.add_argument("--free-gib", default=DEFAULT_FREE_GIB, metavar="X",
                        help=f"free GiB per rank (default {DEFAULT_FREE_GIB})")
    parser.add_argument("--packer", default=DEFAULT_PACKER.value, choices=[k.value for k in PackerKind],
                        help=f"packer (default {DEFAULT_PACKER.value})")
    parser.add_argument("--time-budget-ms", type=float, default=None, metavar="T",
                        help=f"planning time budget in ms (default: {DEFAULT_TIME_BUDGET_MS:g}, or "
                             f"{DEFAULT_MS_PER_REQUEST:g} per request on steps of more than "
                             f"{DEFAULT_TIME_BUDGET_MS / DEFAULT_MS_PER_REQUEST:.0f}; docs/faq.md)")
    parser.add_argument("--num-waves", type=int, default=None, metavar="N",
                        help="exactly N waves (all data-parallel ranks run the same count)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the randomised search")
    parser.add_argument("--deterministic", action="store_true",
                        help="never read the clock: the iteration cap implied by --time-budget-ms "
                             "alone decides, so the same inputs give the same plan byte for byte")
    parser.add_argument("--dp", type=int, default=None, metavar="N",
                        help="plan the batch of N data-parallel ranks at once: equal wave counts, "
                             "each rank's waves fit --free-gib (one number, or N comma-separated), "
                             "balanced predicted time; --json gives 'ranks', one plan per rank")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--report", metavar="FILE", help="write a replayable report (JSON)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the plan")
    parser.add_argument("--profiles", metavar="FILE",
                        help="learned profiles (JSON); a corrupt file is set aside as FILE.corrupt")
    parser.set_defaults(func=run)


def resolve_step(spec: str) -> Step:
    """The STEP argument (see `cli_common.read_step`)."""
    return read_step(spec)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "dp", None) is not None:
        from .cmd_plan_group import check_args
        budget = check_args(args)   # one budget, or one per data-parallel rank
    else:
        budget = int(parse_gib(args.free_gib, "free_gib") * 2**30)
    check_output(args.report, "--report")
    check_output(args.plot, "--plot", needs_matplotlib=True)
    planner = Planner.from_model(model_from_args(args), profiles_path=args.profiles)
    step = resolve_step(args.step)
    if cold_start.current().interpreted:   # interpreted kernels: the clock would buy ~1% of the work
        args.deterministic = True
    log.info("step %s: %d requests, %d logical rows", args.step, step.num_requests, step.num_logical_rows)
    if getattr(args, "dp", None) is not None:
        from .cmd_plan_group import run_group
        return run_group(args, planner, step, budget)
    options = PlanOptions(packer=args.packer, time_budget_ms=args.time_budget_ms,
                          num_waves=args.num_waves, seed=args.seed, deterministic=args.deterministic)
    start = time.perf_counter()
    try:
        plan = planner.plan(step, free_bytes=budget, **options.kwargs())
    except InfeasibleError as exc:
        raise infeasible_error(planner, step, budget, exc) from None
    log.info("planned in %.0f ms wall (planning_ms %.2f)", (time.perf_counter() - start) * 1e3,
             plan.planning_ms)
    if args.report:
        write_report(args.report, planner, step, plan, options)
    if args.plot:
        plot_plan(plan.to_dict(), args.plot)
    if args.json:
        print(plan.to_json())
    else:
        print_table(planner, plan, args.num_waves)
    return 0


def plot_plan(plan_dict: dict, path: str) -> None:
    try:
        module = importlib.import_module("waveplan.planner.plot")
    except ModuleNotFoundError as exc:
        if exc.name not in ("waveplan.planner.plot", "matplotlib"):
            raise
        raise bad(ConfigError, "plot", path, f"plotting is unavailable ({exc.name} is not installed)") from None
    module.plot_plan(plan_dict, path)


def _basis(breakdown, notes: dict[str, int]) -> str:
    """The basis as a wave's row prints it: a conservative or assumed price points to a note
    under the table that names its reasons, each set of reasons printed once (`notes`, filled
    in order of first use)."""
    if breakdown.basis in ("conservative", "assumed") and breakdown.reasons:
        text = f"{breakdown.basis}: {'; '.join(breakdown.reasons)}"
        return f"{breakdown.basis} [{notes.setdefault(text, len(notes) + 1)}]"
    return breakdown.basis


def print_table(planner: Planner, plan: Plan, num_waves: int | None = None) -> None:
    m = planner.model
    fsdp = fsdp_words(m)
    if fsdp is not None:
        print(f"model {m.geometry.name}  {fsdp}  backend {m.table.backend}  safety x{m.safety}")
    else:
        print(f"model {m.geometry.name}  TP{m.parallel.tp} CP{m.parallel.cp}"
              f"{f' PP{m.parallel.pp}' if m.parallel.pp > 1 else ''}{f' EP{m.parallel.ep}' if m.parallel.ep > 1 else ''}"
              f"{' SP' if m.parallel.sequence_parallel else ''}  {m.recompute.mode.value} recompute  "
              f"head {m.head}  backend {m.table.backend}  safety x{m.safety}")
    print(f"{'wave':>4} {'requests':>8} {'packed':>9} {'logical':>9} {'admitted GiB':>12} "
          f"{'budget GiB':>10}  binding")
    notes: dict[str, int] = {}
    for w in plan.waves:
        size = w.size
        note = f"  [{len(w.children)} children]" if w.is_split else ""
        first = f"  first:{','.join(sorted(w.first_slots))}" if w.first_slots else ""
        print(f"{w.index:>4} {len(w.request_ids):>8} {size.packed_rows:>9} {size.logical_rows:>9} "
              f"{gib(w.admitted_bytes):>12} {gib(w.budget_bytes):>10}  {w.breakdown.binding} "
              f"({_basis(w.breakdown, notes)}){first}{note}  holds {ranges(w.request_indices)}")
    for text, k in notes.items():
        print(f"[{k}] {text}")
    for st in plan.stages:
        lo, hi = st["layers"]
        first, last = st["window"]
        print(f"stage {st['stage']}  layers {lo}-{hi - 1}  {st['in_flight']} in flight  "
              f"peak {gib(st['peak_bytes'])} GiB of {gib(st['budget_bytes'])}  "
              f"binding waves {first}-{last}")
    waves = f"{plan.num_waves} wave{'' if plan.num_waves == 1 else 's'}"
    if num_waves is not None:  # a fixed count: optimality of the count is not the question
        verdict = f"{waves} as asked (--num-waves); lower bound {plan.lower_bound_waves}"
    else:
        why = NOT_PROVEN.get(plan.stats.get("not_proven", ""), "")
        verdict = (f"{waves}; lower bound {plan.lower_bound_waves}: "
                   f"{'proven optimal' if plan.proven_optimal else 'not proven optimal'}"
                   f"{f' ({why})' if why and not plan.proven_optimal else ''}")
    reserve = plan.stats.get("rope_reserve_bytes", 0)
    budget_ms = plan.stats.get("time_budget_ms")
    print(f"{verdict}  ({plan.packer}, {plan.planning_ms:.2f} ms"
          f"{f' of a {budget_ms:g} ms budget' if budget_ms else ''}"
          f"{f'; bound of the budget less {gib(reserve)} GiB set aside for the RoPE cache' if reserve else ''})")
    if (ep_note := single_rank_note(m)) is not None:
        print(ep_note)
    if plan.compile_ms > 0:
        print(f"compiled kernels first: {plan.compile_ms / 1e3:.2f} s (once per machine; "
              "`waveplan warmup` pays it ahead)")
    print(legend(fixed_count=num_waves is not None))


def infeasible_error(planner: Planner, step: Step, budget: int, exc: InfeasibleError) -> ConfigError:
    """One line for a step with requests that fit under no split: how many requests do not fit
    alone (priced alone, without pending adapter gradients, then with its slot's), the largest
    one's price in GiB, what to do, then the first few ids, largest first. Falls back to the
    search's message when every request fits alone (the pending gradients of a slot are what
    does not fit). O(n) pricings."""
    pricer = planner.pricer(step)
    over: list[tuple[int, str]] = []
    for pending in (False, True):
        for i, req in enumerate(step.requests):
            slots = frozenset({req.slot}) if pending and req.grad else frozenset()
            admitted = pricer.price([np.array([i], dtype=np.int64)], first_slots=slots).admitted_bytes
            if admitted > budget:
                over.append((-int(admitted), req.id))
        if over:
            break
    if not over:
        if "num_waves" in str(exc):  # a count below the bound: the message says what to do
            return ConfigError(str(exc))
        return ConfigError(f"{exc}; raise --free-gib, raise --tp or --cp, or truncate the requests")
    over.sort()
    shown = [rid for _, rid in over[:SHOWN_IDS]]
    more = f" (+{len(over) - len(shown)} more)" if len(over) > len(shown) else ""
    noun = "1 request does" if len(over) == 1 else f"{len(over)} requests do"
    grads = " with its slot's adapter gradients" if pending else ""
    return ConfigError(
        f"{noun} not fit in {gib(budget)} GiB free per rank even alone{grads}; the largest needs "
        f"{gib(-over[0][0])} GiB admitted; raise --free-gib, raise --tp or --cp, or truncate them: "
        f"{', '.join(shown)}{more}")
