"""`waveplan price`: price a whole step file as one wave."""

from __future__ import annotations

import argparse
import json

import numpy as np

from waveplan.pricing.fsdp.model import for_step
from waveplan.pricing.step import list_bundled_steps
from waveplan.pricing.wave_pricer import WavePricer

from .cli_common import STEP_HELP, add_model_args, fsdp_words, gib, model_from_args, read_step


def register(sub) -> None:
    parser = sub.add_parser(
        "price", help="price a step file as one wave",
        description="Price every request of STEP as one wave (each request's grad flag respected). "
                    "By default the wave is the step's first gradient wave, so the pending adapter "
                    "gradients of every slot count. LoRA defaults to rank 16 on every linear layer.")
    parser.add_argument("step", help=STEP_HELP.format(", ".join(list_bundled_steps())))
    add_model_args(parser)
    parser.add_argument("--not-first", action="store_true",
                        help="price a later wave: the adapter gradients are already allocated")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # the fsdp framework prices the step's sequences unshared, S x S terms at its rows
    model, step = for_step(model_from_args(args), read_step(args.step))
    pricer = WavePricer.build(step, model)
    first = frozenset() if args.not_first else frozenset(
        r.slot for r in step.requests if r.grad)
    breakdown = pricer.price([np.arange(len(step.requests))], first_slots=first)
    if args.json:
        print(json.dumps(breakdown.to_dict(), indent=1))
        return 0
    fsdp = fsdp_words(model)
    if fsdp is not None:
        print(f"model {model.geometry.name}  {fsdp}  backend {model.table.backend}")
    else:
        print(f"model {model.geometry.name}  TP{model.parallel.tp} CP{model.parallel.cp} "
              f"{'SP ' if model.parallel.sequence_parallel else ''}"
              f"{f'EP{model.parallel.ep} ' if model.parallel.ep > 1 else ''}"
              f"{f'ETP{model.parallel.etp} ' if model.parallel.etp is not None else ''}{model.recompute.mode.value} recompute  "
              f"head {model.head}  backend {model.table.backend}")
    print(f"{len(step.requests)} requests as one wave; binding point: {breakdown.binding}")
    for name, value in breakdown.terms.items():
        print(f"  {name:<20} {gib(value):>10} GiB")
    print(f"raw {gib(breakdown.raw_bytes)} GiB, admitted {gib(breakdown.admitted_bytes)} GiB "
          f"(x{model.safety}); basis: {breakdown.basis}")
    for reason in breakdown.reasons:
        print(f"  {'assumed' if reason in model.assumptions else 'conservative'}: {reason}")
    return 0
