"""The `waveplan` command line: one subcommand per module `cmd_*.py`.

Every documented error (`WaveplanError`) and every bad argument exits 2 with one line on
stderr and no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from waveplan.pricing.errors import WaveplanError

from . import cold_start

DESCRIPTION = """Plan LoRA training steps into waves (micro-batches) that fit each GPU rank's free memory,
in as few waves as possible. Start with:
  waveplan plan grpo-8x8 --model qwen3-8b --free-gib 40     plan a bundled step
  waveplan plan my-step.jsonl --model config.json --tp 4 --sp --free-gib 40
  waveplan inspect --model qwen3-8b                          what a model is priced as
  waveplan COMMAND --help                                    every flag and default
Docs: README.md and docs/ in the source tree."""

# Subcommand modules, each exposing `register(subparsers)` that sets `func` on its parser.
_COMMANDS = ("inspect", "price", "plan", "replay", "study", "trace", "calibrate", "warmup", "misses")


class _Formatter(argparse.HelpFormatter):
    """Appends "(default: X)" to every option whose help does not already state its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, False, argparse.SUPPRESS)
                or not (action.option_strings or action.nargs in ("?", "*"))):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        print(f"waveplan: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("waveplan")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="waveplan", description=DESCRIPTION,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"waveplan {_version()}")
    _add_verbose(parser)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"waveplan.planner.cmd_{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"waveplan.planner.cmd_{name}":
                continue  # not built yet
            raise
        module.register(sub)
    for command in sub.choices.values():   # -v also after the subcommand: `waveplan plan -v`
        _add_verbose(command, dest="verbose_after")
    return parser


def _add_verbose(parser: argparse.ArgumentParser, dest: str = "verbose") -> None:
    parser.add_argument("-v", "--verbose", dest=dest, action="count", default=0,
                        help="log what each step does to stderr (-vv: debug)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:   # before build_parser imports the kernel modules: numba decides when it decorates
        cold_start.prepare(argv)
    except WaveplanError as exc:
        print(f"waveplan: error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:  # bare `waveplan`: a usage error
        parser.print_help(sys.stderr)
        return 2
    verbose = args.verbose + getattr(args, "verbose_after", 0)
    if verbose:
        logging.basicConfig(level=logging.DEBUG if verbose > 1 else logging.INFO,
                            format="waveplan: %(name)s: %(message)s", stream=sys.stderr)
    try:
        code = int(args.func(args) or 0)
    except WaveplanError as exc:
        default = getattr(args, "defaulted_model", None)   # priced without --model: say which
        said = f" (no --model given: priced the default {default})" if default else ""
        print(f"waveplan: error: {exc}{said}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    if code == 0:
        for note in getattr(args, "notes", ()):   # e.g. the default model a command priced
            print(note, file=sys.stderr)
    if code == 0 and (note := cold_start.finish()):
        print(note, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
