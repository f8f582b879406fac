"""Arguments shared by the subcommands that price: model, parallel layout, recompute, LoRA."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

from waveplan.pricing.atomic_io import write_json_atomic  # noqa: F401  (re-exported for the subcommands)
from waveplan.pricing.coefficients import DEFAULT_BACKEND
from waveplan.pricing.errors import ConfigError, bad
from waveplan.pricing.kernel_set import Framework
from waveplan.pricing.lora import LoraConfig, LoraSlot
from waveplan.pricing.model import DEFAULT_HEAD, DEFAULT_SAFETY, PricingModel
from waveplan.pricing.model_source import load_model
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.pipeline import check_schedule
from waveplan.pricing.presets import list_presets
from waveplan.pricing.step import Step, load_step, parse_step

DEFAULT_MODEL = "qwen3.8-27b"


def add_model_args(parser: argparse.ArgumentParser, *, default_model: str | None = DEFAULT_MODEL,
                   default_tp: int = 1, default_sp: bool = False, table: bool = True) -> None:
    """The model flags; `table=False` leaves out --backend and --safety (for a command whose
    --backend means something else: `calibrate`)."""
    presets = ", ".join(list_presets())
    if default_model is None:
        model_help = f"a preset ({presets}), a Hugging Face config.json or a checkpoint folder"
    else:
        model_help = (f"a preset ({presets}), a Hugging Face config.json or a checkpoint folder; "
                      f"when left out: {default_model}, said on stderr")
    parser.add_argument("--model", default=None, metavar="PRESET|config.json", help=model_help)
    parser.set_defaults(default_model=default_model)
    parser.add_argument("--as-family", metavar="FAMILY", default=None,
                        help="opt-in: price a config.json whose model_type no family supports as "
                             "FAMILY (e.g. llama, for a decoder with the standard fields); basis "
                             "conservative, the assumption as its reason")
    parser.add_argument("--tp", type=int, default=default_tp, help="tensor parallel size")
    parser.add_argument("--cp", type=int, default=1, help="context parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    parser.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                        help="model chunks per pipeline rank: 1 (the 1F1B schedule); more "
                             "(the interleaved schedule) is refused, not priced")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size")
    parser.add_argument("--etp", type=int, default=None,
                        help="expert tensor parallel size (Megatron's expert_tensor_parallel_size; "
                             "default: --tp). Below --tp: traced at TP2+SP and TP4+SP (EP1 and, at ETP1, "
                             "TP2+SP EP2); elsewhere conservative")
    parser.add_argument("--moe-load", type=float, default=None, metavar="X",
                        help="opt-in: the busiest EP rank receives at most X x its balanced share of "
                             "routed rows (e.g. Megatron's moe_expert_capacity_factor with token "
                             "dropping); basis 'assumed'. Default: the worst case any router can produce")
    parser.add_argument("--sp", action=argparse.BooleanOptionalAction, default=default_sp,
                        help="sequence parallelism (needs --tp > 1)")
    parser.add_argument("--recompute", choices=("full", "selective", "none"), default="full",
                        help="activation recompute (full = full/uniform/1)")
    parser.add_argument("--lora-rank", type=int, default=16,
                        help="LoRA rank of the one slot 'default', on every linear layer "
                             "(linear_qkv, linear_proj, in_proj, out_proj, linear_fc1, linear_fc2)")
    parser.add_argument("--framework", choices=("megatron", "fsdp"), default="megatron",
                        help="megatron (Megatron-core, default) or fsdp (Hugging Face transformers + "
                             "PEFT LoRA under FSDP2; --recompute full|none = gradient checkpointing on/off)")
    parser.add_argument("--fsdp", type=int, default=1, metavar="N",
                        help="--framework fsdp: FSDP2 shard group size (default 1)")
    parser.add_argument("--attn", choices=("flash", "sdpa", "eager"), default="flash",
                        help="--framework fsdp: attention implementation (default flash: "
                             "flash_attention_2 on packed rows)")
    parser.add_argument("--ulysses", type=int, default=1, metavar="N",
                        help="--framework fsdp: veRL's Ulysses sequence parallel size (default 1; "
                             "divides --fsdp and the attention heads)")
    parser.add_argument("--no-reshard-after-forward", dest="no_reshard", action="store_true",
                        help="--framework fsdp: FSDP2's reshard_after_forward=False (every layer's "
                             "gathered parameters kept from its forward to its backward)")
    parser.add_argument("--head", default=DEFAULT_HEAD,
                        help=f"output head: chunked:N, full-native or full-te (default {DEFAULT_HEAD}); "
                             "--framework fsdp: transformers (default), verl, verl-chunked or "
                             "verl-fused (veRL's FSDP actor log-probs and entropy)")
    if not table:
        return
    parser.add_argument("--backend", "--coefficients", dest="backend", default=DEFAULT_BACKEND,
                        help="coefficient table: a shipped backend (te-gpu, torch-cpu) or a JSON file, "
                             f"e.g. one fitted by `waveplan calibrate` (default {DEFAULT_BACKEND})")
    parser.add_argument("--safety", type=float, default=DEFAULT_SAFETY,
                        help=f"admitted = raw x safety (default {DEFAULT_SAFETY:g})")


def model_spec(args: argparse.Namespace) -> str:
    """`--model`, or the command's default model with a note naming it, which `cli.main`
    prints on stderr once the command succeeded, or appends to its error line (never a
    silent guess)."""
    if args.model is None:
        default = getattr(args, "default_model", None)
        if default is None:
            raise bad(ConfigError, "--model", None,
                      f"give a preset ({', '.join(list_presets())}) or a config.json")
        args.notes = [*getattr(args, "notes", ()),
                      f"waveplan: note: no --model given, priced the default {default}; "
                      "pass --model PRESET or --model config.json"]
        args.model = args.defaulted_model = default
    return args.model


def model_from_args(args: argparse.Namespace) -> PricingModel:
    check_schedule(getattr(args, "virtual_stages", 1), args.pp)
    geometry = load_model(model_spec(args), as_family=getattr(args, "as_family", None))
    if getattr(args, "framework", "megatron") == "fsdp":
        return _fsdp_model_from_args(args, geometry)
    for flag, value, default in (("--fsdp", getattr(args, "fsdp", 1), 1),
                                 ("--attn", getattr(args, "attn", "flash"), "flash"),
                                 ("--ulysses", getattr(args, "ulysses", 1), 1),
                                 ("--no-reshard-after-forward", getattr(args, "no_reshard", False), False)):
        if value != default:
            raise bad(ConfigError, flag, value, "applies to --framework fsdp only")
    if args.ep != 1 and geometry.moe is None:
        raise bad(ConfigError, "--ep", args.ep,
                  f"{geometry.name} is a dense model (no experts); expert parallelism needs an MoE model")
    etp = getattr(args, "etp", None)
    if etp is not None and geometry.moe is None:
        raise bad(ConfigError, "--etp", etp,
                  f"{geometry.name} is a dense model (no experts); expert tensor parallelism needs an MoE model")
    return PricingModel.build(
        geometry,
        parallel=ParallelLayout(tp=args.tp, cp=args.cp, pp=args.pp, ep=args.ep, sequence_parallel=args.sp,
                                etp=etp),
        recompute=Recompute(mode=args.recompute),
        lora=LoraConfig(slots=(LoraSlot(rank=args.lora_rank),)),
        backend=args.backend, head=args.head, safety=args.safety, moe_load=args.moe_load)


STEP_HELP = "step file (JSON Lines), a bundled step ({}), or - for standard input"


def read_step(spec: str) -> Step:
    """STEP argument: `-` reads standard input; else `load_step` (an existing file wins over a
    bundled step of the same name)."""
    if spec == "-":
        return parse_step(sys.stdin.read(), source="<stdin>")
    return load_step(spec)


def check_output(path: str | None, flag: str, *, needs_matplotlib: bool = False) -> None:
    """Fail before any work when `path` cannot be written: its folder is missing, or (for a
    plot) matplotlib is not installed. One ConfigError line naming the flag."""
    if path is None:
        return
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise bad(ConfigError, flag, path, f"folder {str(folder)!r} does not exist (create it first)")
    if needs_matplotlib and importlib.util.find_spec("matplotlib") is None:
        raise bad(ConfigError, flag, path,
                  "plotting needs matplotlib, which is not installed: pip install 'waveplan[plot]'")


def gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


def parse_gib(text: str, field: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise bad(ConfigError, field, text, "must be a number of GiB") from None
    if not math.isfinite(value) or value <= 0 or value > 1 << 20:
        raise bad(ConfigError, field, text, "must be a finite number of GiB in (0, 1048576]")
    return value


def _fsdp_model_from_args(args: argparse.Namespace, geometry) -> PricingModel:
    """The fsdp framework's model (`pricing.fsdp`): TP/CP/PP/EP/SP and selective recompute
    refused with one line; sdpa/eager's S x S terms provisionally at 65536 rows (`price` and
    `plan` set them from the step and the budget, `fsdp.model.for_step`)."""
    from waveplan.pricing.fsdp import build_fsdp_model

    for flag, value in (("--tp", args.tp), ("--cp", args.cp), ("--pp", args.pp), ("--ep", args.ep)):
        if value != 1:
            raise bad(ConfigError, flag, value, "--framework fsdp shards parameters only (use --fsdp N)")
    if args.sp:
        raise bad(ConfigError, "--sp", True, "--framework fsdp has no sequence parallelism")
    if args.recompute == "selective":
        raise bad(ConfigError, "--recompute", "selective",
                  "--framework fsdp: full (gradient checkpointing) or none")
    from waveplan.pricing.fsdp.verl_head import FSDP_HEADS, fsdp_head

    if args.head != DEFAULT_HEAD and args.head not in FSDP_HEADS:
        raise bad(ConfigError, "--head", args.head,
                  f"--framework fsdp: one of {', '.join(FSDP_HEADS)} (default transformers)")
    return build_fsdp_model(
        geometry, fsdp=args.fsdp, attn=args.attn, checkpointing=args.recompute == "full",
        lora=LoraConfig(slots=(LoraSlot(rank=args.lora_rank),)),
        backend=getattr(args, "backend", DEFAULT_BACKEND),
        safety=getattr(args, "safety", DEFAULT_SAFETY), ulysses=args.ulysses,
        reshard_after_forward=not getattr(args, "no_reshard", False),
        head=fsdp_head(args.head),
        attn_rows=0 if args.attn == "flash" else 65536)


def fsdp_words(model: PricingModel) -> str | None:
    """'FSDP2 x8, attn flash, checkpointing' for an fsdp-framework model (the header its tables
    print in place of Megatron's TP/CP layout); None for Megatron-core."""
    if model.framework is not Framework.FSDP:
        return None
    layout = model.fsdp_layout
    words = f"FSDP2 x{layout.fsdp}, attn {layout.attn}, "
    words += "checkpointing" if layout.checkpointing else "no checkpointing"
    if layout.ulysses != 1:
        words += f", Ulysses {layout.ulysses}"
    if layout.head != "transformers":
        words += f", head {layout.head}"
    return words + ("" if layout.reshard_after_forward else ", no reshard after forward")
