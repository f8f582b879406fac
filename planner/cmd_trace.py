"""`waveplan trace`: measure the activation peak of a step run as one wave.

Every request of STEP runs as one packed wave (its full `num_tokens`; no prefix sharing)
through a Megatron-core model with the geometry of `--model`, LoRA adapters trainable, in
one forward and one backward (`waveplan.pricing.measure.trace.trace_wave`). Needs torch and
megatron-core (`pip install 'waveplan[megatron]'`).

With `--tp`, `--cp` or `--ep` above 1 the wave runs on every rank of that layout, one process
per rank over gloo, with real tensors (`waveplan.pricing.measure.multirank`): the output lists
every rank's peak and the busiest rank, and `--json` prints one record in the form
`waveplan calibrate` reads (`{"cell": ..., "trace": ...}`).

With `--pp` above 1 the step runs through Megatron-core's own pipeline schedule (1F1B,
variable-length micro-batches) on TP x PP gloo processes
(`waveplan.pricing.measure.pipeline_trace`): the requests are cut, in file order, into
`--micro-batches` consecutive micro-batches (one per wave), and the output lists each stage's
peak and when it happened (micro-batch and phase).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from waveplan.pricing.errors import ConfigError, bad
from waveplan.pricing.presets import list_presets

GIB = 1 << 30


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "trace", help="measure a step's activation peak as one wave on a Megatron-core model",
        description="Run every request of STEP as one packed wave (full lengths, no prefix "
                    "sharing) through a Megatron-core model with the model's geometry: one "
                    "forward and one backward, LoRA adapters trainable, base frozen, loss = "
                    "Megatron's cross entropy on the full logits. Peaks are bytes above the "
                    "weights (what a wave adds). cpu-fake traces full-size models at no memory "
                    "cost. Needs torch and megatron-core.")
    parser.add_argument("step", help="step file (JSON Lines), a bundled step name, or - for "
                                     "standard input")
    parser.add_argument("--model", required=True, metavar="PRESET|config.json",
                        help=f"a preset ({', '.join(list_presets())}) or a Hugging Face config.json")
    parser.add_argument("--layers", type=int, default=None, metavar="N",
                        help="trace only the first N decoder layers (default: all)")
    parser.add_argument("--device", choices=("cpu-fake", "cpu", "cuda"), default=None,
                        help="cpu-fake: fake tensors (default for one rank); cpu: real tensors "
                             "(the only device of a multi-rank trace); cuda: a GPU")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (multi-rank)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    parser.add_argument("--cp", type=int, default=1,
                        help="context parallel size (multi-rank; ring attention allocation model)")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size (multi-rank, MoE)")
    parser.add_argument("--etp", type=int, default=None,
                        help="expert tensor parallel size (multi-rank, MoE; default: --tp)")
    parser.add_argument("--pp", type=int, default=1,
                        help="pipeline parallel size: run the step through Megatron-core's 1F1B "
                             "schedule on TP x PP ranks")
    parser.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                        help="with --pp: model chunks per rank; more than 1 (the interleaved "
                             "schedule) is refused")
    parser.add_argument("--micro-batches", type=int, default=None, metavar="M",
                        help="with --pp: cut the requests, in order, into M consecutive "
                             "micro-batches (default 2 x PP, at most one per request)")
    parser.add_argument("--routing", choices=("balanced", "router"), default="balanced",
                        help="MoE routing of a multi-rank trace: balanced (default) or "
                             "Megatron's top-k router on the random weights")
    parser.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                        help="multi-rank: stop every rank after S seconds (default 1800)")
    parser.add_argument("--recompute", choices=("full", "selective", "none"), default="full",
                        help="activation recompute (default full, uniform, 1 layer)")
    parser.add_argument("--lora-rank", type=int, default=16, metavar="R",
                        help="LoRA rank on every linear layer (default 16; 0: no adapters)")
    parser.add_argument("--no-decoder-pass", action="store_true",
                        help="skip the second, decoder-only pass (no head and loss)")
    parser.add_argument("--head", choices=("full-native", "full-te", "transformers", "verl",
                                           "verl-chunked"), default="full-native",
                        help="loss on the full logits: Megatron's native cross entropy (bf16 logits "
                             "and an fp32 copy; default) or Transformer Engine's (gradient written "
                             "into the bf16 logits; on the CPU an allocation model of it); one rank. "
                             "--framework fsdp: transformers (default), verl or verl-chunked "
                             "(veRL's FSDP actor log-probs and entropy)"),
    parser.add_argument("--framework", choices=("megatron", "fsdp"), default="megatron",
                        help="fsdp: Hugging Face transformers + PEFT LoRA under FSDP2 on --fsdp gloo "
                             "ranks (--model must be a config.json; real tensors: keep it small)")
    parser.add_argument("--fsdp", type=int, default=1, metavar="N",
                        help="--framework fsdp: shard group size (one process per rank)")
    parser.add_argument("--ulysses", type=int, default=1, metavar="N",
                        help="--framework fsdp: veRL's Ulysses sequence parallel size (divides --fsdp; "
                             "veRL's all-to-all around the traced sdpa/eager attention)")
    parser.add_argument("--attn", choices=("sdpa", "eager", "flash"), default="sdpa",
                        help="--framework fsdp: attention implementation traced (flash: transformers' "
                             "flash_attention_2 path on packed rows; on the CPU with flash-attn 2's "
                             "kernels replaced by their allocation model, pricing/measure/hf_flash.py)")
    parser.add_argument("--no-reshard-after-forward", dest="no_reshard", action="store_true",
                        help="--framework fsdp: trace FSDP2's reshard_after_forward=False")
    parser.add_argument("--kernels", choices=("torch-cpu", "te-gpu"), default="torch-cpu",
                        help="kernel set on the CPU: torch's ops (default) or te-gpu, allocation "
                             "models of the fused GPU kernels (TE RMSNorm, flash attention, fused "
                             "RoPE and SwiGLU; pricing/measure/gpu_kernels.py)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def _load_step(spec: str):
    """STEP: a file, a bundled step name, or `-` for standard input (`cli_common.read_step`)."""
    from .cli_common import read_step

    return read_step(spec)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:8.3f} GiB"


def run(args) -> int:
    from waveplan.pricing.model_source import load_model
    from waveplan.pricing.parallel import Recompute

    if args.layers is not None and args.layers <= 0:
        raise ConfigError(f"--layers={args.layers}: must be a positive integer")
    if args.lora_rank < 0:
        raise ConfigError(f"--lora-rank={args.lora_rank}: must be >= 0")
    from waveplan.pricing.pipeline import check_schedule

    check_schedule(args.virtual_stages, args.pp)
    if args.framework == "fsdp":
        if args.kernels != "torch-cpu":
            raise bad(ConfigError, "--kernels", args.kernels,
                      "the fsdp tracer runs transformers' own kernels (--attn flash: flash-attn's "
                      "allocation model); trace te-gpu with --framework megatron")
        return _run_fsdp(args)
    if args.no_reshard:
        raise bad(ConfigError, "--no-reshard-after-forward", True, "applies to --framework fsdp only")
    if args.head not in ("full-native", "full-te"):
        raise bad(ConfigError, "--head", args.head, "--framework megatron: full-native or full-te")
    geometry = load_model(args.model)
    step = _load_step(args.step)
    for name in ("torch", "megatron.core"):
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ConfigError(f"waveplan trace needs torch and megatron-core ({name} is not "
                              "installed): pip install 'waveplan[megatron]'")
    import warnings

    from waveplan.pricing.measure.trace import trace_wave

    warnings.filterwarnings("ignore", category=UserWarning)

    seq_lens = [int(r.num_tokens) for r in step.requests]
    layers = args.layers
    if layers is not None and layers >= geometry.num_layers:
        layers = None
    if args.pp > 1:
        if args.kernels != "torch-cpu":
            raise ConfigError(f"--kernels={args.kernels}: pipeline traces run the torch-cpu "
                              "kernels; trace te-gpu without --pp")
        return _run_pipeline(args, geometry, step, seq_lens, layers)
    if args.pp != 1:
        raise ConfigError(f"--pp={args.pp}: must be a positive integer")
    if args.micro_batches is not None:
        raise ConfigError(f"--micro-batches={args.micro_batches}: needs --pp > 1")
    if args.tp * args.cp * args.ep > 1 or args.sp:
        if args.head != "full-native":
            raise ConfigError(f"--head={args.head}: multi-rank traces run the full-native head; "
                              "trace full-te on one rank")
        return _run_multirank(args, geometry, step, seq_lens, layers)
    result = trace_wave(geometry, seq_lens=seq_lens, num_layers=layers,
                        device=args.device or "cpu-fake", head=args.head,
                        recompute=Recompute(mode=args.recompute),
                        lora_rank=args.lora_rank or None,
                        decoder_only=not args.no_decoder_pass, kernels=args.kernels)
    notes = list(result.notes)
    if any(not r.grad for r in step.requests):
        notes.append("requests with grad=false were traced with gradients like the others")
    notes.append("each request runs its full num_tokens (no prefix sharing)")
    out = result.to_dict()
    out["notes"] = notes
    out["model"] = geometry.name
    out["geometry"] = geometry.to_dict()  # so that `waveplan calibrate` can price the cell
    if args.json:
        print(json.dumps(out, sort_keys=False))
        return 0
    print(f"trace {geometry.name}: {result.num_layers} of {result.model_layers} layers, "
          f"{result.tokens} tokens in {len(result.seq_lens)} sequences ({result.packed}), "
          f"device {result.device}, recompute {result.recompute['mode']}, "
          f"LoRA rank {result.lora_rank or 'none'}, head {result.head}"
          + ("" if result.kernels == "torch-cpu" else f", kernels {result.kernels}"))
    rows = [("peak forward", result.peak_forward_bytes),
            ("peak backward", result.peak_backward_bytes),
            ("peak", result.peak_bytes),
            ("decoder-only peak", result.decoder_peak_bytes),
            ("head adds", result.head_bytes),
            ("baseline (not in peaks)", result.baseline_bytes)]
    for label, value in rows:
        shown = "-" if value is None else f"{value:>15,d} B"
        print(f"  {label:<24}{shown:>19}  {_gib(value)}")
    print(f"  counted: {result.counted}")
    for note in notes:
        print(f"  note: {note}")
    return 0


def _step_notes(step) -> list[str]:
    notes = []
    if any(not r.grad for r in step.requests):
        notes.append("requests with grad=false were traced with gradients like the others")
    notes.append("each request runs its full num_tokens (no prefix sharing)")
    return notes


def _run_multirank(args, geometry, step, seq_lens, layers) -> int:
    from waveplan.pricing.measure.multirank import trace_multirank, trace_record
    from waveplan.pricing.parallel import ParallelLayout, Recompute

    if args.device not in (None, "cpu"):
        raise ConfigError(f"--device={args.device}: a multi-rank trace runs on real CPU "
                          "tensors (--device cpu)")
    layout = ParallelLayout(tp=args.tp, cp=args.cp, ep=args.ep, sequence_parallel=args.sp, etp=args.etp)
    result = trace_multirank(geometry, layout=layout, seq_lens=seq_lens, num_layers=layers,
                             recompute=Recompute(mode=args.recompute),
                             lora_rank=args.lora_rank or None, routing=args.routing,
                             decoder_only=not args.no_decoder_pass, timeout_s=args.timeout,
                             kernels=args.kernels)
    preset = args.model.strip().lower() if args.model.strip().lower() in list_presets() else None
    record = trace_record(result, geometry, model=preset, step=Path(args.step).name)
    record["trace"]["notes"] = list(result.notes) + _step_notes(step)
    if args.json:
        print(json.dumps(record))
        return 0
    lay = result.layout
    print(f"trace {geometry.name}: {result.num_layers} of {result.model_layers} layers, "
          f"{result.tokens} tokens in {len(result.seq_lens)} sequences (thd), TP{lay.tp}"
          f"{' SP' if lay.sequence_parallel else ''} CP{lay.cp} EP{lay.ep} DP{lay.dp} "
          f"({result.world_size} ranks, gloo), recompute {result.recompute['mode']}, "
          f"LoRA rank {result.lora_rank or 'none'}, head {result.head}")
    print(f"  {'rank':>4} {'tp':>3} {'cp':>3} {'dp':>3} {'ep':>3} {'rows':>7} "
          f"{'peak forward':>16} {'peak backward':>16} {'peak':>16} {'decoder peak':>16}")
    for r in result.ranks:
        dec = "-" if r.decoder_peak_bytes is None else f"{r.decoder_peak_bytes:,d}"
        mark = "  <- busiest" if r.rank == result.busiest_rank else ""
        print(f"  {r.rank:>4} {r.tp_rank:>3} {r.cp_rank:>3} {r.dp_rank:>3} {r.ep_rank:>3} "
              f"{r.rows:>7} {r.peak_forward_bytes:>16,d} {r.peak_backward_bytes:>16,d} "
              f"{r.peak_bytes:>16,d} {dec:>16}{mark}")
    print(f"  busiest rank {result.busiest_rank}: peak {result.peak_bytes:,d} B "
          f"({_gib(result.peak_bytes).strip()}); baseline (not in peaks) "
          f"{result.busiest.baseline_bytes:,d} B")
    print(f"  counted: {result.counted}")
    for note in record["trace"]["notes"]:
        print(f"  note: {note}")
    return 0


def micro_batches(seq_lens: list[int], count: int) -> list[list[int]]:
    """`seq_lens` cut, in order, into `count` consecutive runs as even in number as possible."""
    out, start = [], 0
    for i in range(count):
        end = start + (len(seq_lens) - start) // (count - i)
        out.append(seq_lens[start:end])
        start = end
    return out


def _run_pipeline(args, geometry, step, seq_lens, layers) -> int:
    from waveplan.pricing.measure.pipeline_trace import pipeline_record, trace_pipeline
    from waveplan.pricing.parallel import ParallelLayout, Recompute

    if args.device not in (None, "cpu"):
        raise ConfigError(f"--device={args.device}: a pipeline trace runs on real CPU tensors "
                          "(--device cpu)")
    count = args.micro_batches if args.micro_batches is not None else 2 * args.pp
    if count <= 0:
        raise ConfigError(f"--micro-batches={count}: must be a positive integer")
    count = min(count, len(seq_lens))
    layout = ParallelLayout(tp=args.tp, cp=args.cp, pp=args.pp, ep=args.ep,
                            sequence_parallel=args.sp, etp=args.etp)
    result = trace_pipeline(geometry, layout=layout, waves=micro_batches(seq_lens, count),
                            num_layers=layers, recompute=Recompute(mode=args.recompute),
                            lora_rank=args.lora_rank or None, timeout_s=args.timeout,
                            virtual_stages=args.virtual_stages)
    preset = args.model.strip().lower() if args.model.strip().lower() in list_presets() else None
    record = pipeline_record(result, geometry, model=preset)
    record["cell"]["step"] = Path(args.step).name
    record["trace"]["notes"] = list(result.notes) + _step_notes(step)
    if args.json:
        print(json.dumps(record))
        return 0
    print(f"trace {geometry.name}: {result.num_layers} of {result.model_layers} layers, "
          f"{len(result.waves)} micro-batches of {[sum(w) for w in result.waves]} tokens (thd), "
          f"PP{layout.pp} TP{layout.tp}{' SP' if layout.sequence_parallel else ''} "
          f"({len(result.ranks)} ranks, gloo, 1F1B), recompute {result.recompute['mode']}, "
          f"LoRA rank {result.lora_rank or 'none'}")
    print(f"  {'stage':>5} {'rank':>4} {'layers':>7} {'peak':>16} {'':>10}  peak at")
    for r in result.stage_peaks:
        print(f"  {r.stage:>5} {r.rank:>4} {'{}-{}'.format(*r.layers):>7} {r.peak_bytes:>16,d} "
              f"{_gib(r.peak_bytes)}  micro-batch {r.peak_at[0]} {r.peak_at[1]}")
    print(f"  counted: {result.counted}")
    for note in record["trace"]["notes"]:
        print(f"  note: {note}")
    return 0


def _run_fsdp(args) -> int:
    """`trace --framework fsdp`: the step as one packed wave of a transformers model built from
    the config.json, PEFT LoRA, FSDP2 over --fsdp gloo ranks (`measure.fsdp_trace`); each rank's
    peak above rest, and the price beside it (`pricing.fsdp.check.price_record`)."""
    from waveplan.pricing.errors import bad
    from waveplan.pricing.fsdp.check import price_record
    from waveplan.pricing.hf_config import load_hf_config

    path = Path(args.model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise bad(ConfigError, "--model", args.model,
                  "--framework fsdp traces a transformers config.json (real tensors: a small one)")
    config = json.loads(path.read_text(encoding="utf-8"))
    load_hf_config(config)   # one clear line for a config the pricing cannot read
    if args.layers is not None:
        config["num_hidden_layers"] = args.layers
    for flag, value in (("--tp", args.tp), ("--cp", args.cp), ("--pp", args.pp), ("--ep", args.ep)):
        if value != 1:
            raise bad(ConfigError, flag, value, "--framework fsdp shards parameters only (use --fsdp N)")
    if args.recompute == "selective":
        raise bad(ConfigError, "--recompute", "selective", "--framework fsdp: full or none")
    if args.lora_rank < 1:
        raise bad(ConfigError, "--lora-rank", args.lora_rank, "--framework fsdp needs LoRA rank >= 1")
    device = args.device or "cpu"
    if device == "cpu-fake":
        raise bad(ConfigError, "--device", device, "--framework fsdp runs real tensors: cpu or cuda")
    from waveplan.pricing.measure.fsdp_trace import trace_fsdp

    step = _load_step(args.step)
    seq_lens = tuple(int(r.num_tokens) for r in step.requests)
    ulysses = getattr(args, "ulysses", 1)
    head = "transformers" if args.head == "full-native" else args.head
    if head not in ("transformers", "verl", "verl-chunked"):
        raise bad(ConfigError, "--head", args.head,
                  "--framework fsdp traces transformers, verl or verl-chunked (verl-fused is Triton)")
    if ulysses != 1 or head != "transformers":
        if args.attn == "flash":
            raise bad(ConfigError, "--attn", "flash",
                      "traced without --ulysses and veRL heads only (those tracers run sdpa or eager)")
        if args.no_reshard:
            raise bad(ConfigError, "--no-reshard-after-forward", True,
                      "traced with the default reshard only under --ulysses or a veRL head")
        from waveplan.pricing.fsdp.ulysses import validate
        from waveplan.pricing.measure.fsdp_verl_trace import trace_fsdp_verl

        validate(load_hf_config(config), args.fsdp, ulysses)
        trace = trace_fsdp_verl(config, jobs=[seq_lens], fsdp=args.fsdp, ulysses=ulysses, head=head,
                                attn=args.attn, checkpointing=args.recompute == "full",
                                lora_rank=args.lora_rank, device=device, timeout_s=args.timeout)[0]
    else:
        trace = trace_fsdp(config, jobs=[seq_lens], fsdp=args.fsdp, attn=args.attn,
                           checkpointing=args.recompute == "full", lora_rank=args.lora_rank,
                           reshard_after_forward=not args.no_reshard,
                           device=device, timeout_s=args.timeout)[0]
    record = trace.to_dict()
    price = price_record(record)
    record["priced_raw_bytes"] = price.raw_bytes
    if args.json:
        print(json.dumps(record, sort_keys=True))
        return 0
    print(f"fsdp trace: {path.name} ({config.get('model_type')}), {len(seq_lens)} sequences, "
          f"{sum(seq_lens)} tokens, FSDP{args.fsdp}, "
          f"{f'Ulysses {ulysses}, ' if ulysses != 1 else ''}"
          f"{f'head {head}, ' if head != 'transformers' else ''}attn {args.attn}, "
          f"checkpointing {'on' if trace.checkpointing else 'off'}, LoRA rank {args.lora_rank}, {device}")
    for r, (peak, rest) in enumerate(zip(trace.peaks, trace.rest, strict=True)):
        print(f"  rank {r}: peak above rest {peak / GIB:.4f} GiB ({peak} B), at rest {rest} B")
    print(f"priced raw {price.raw_bytes} B ({100 * (price.raw_bytes / trace.peak_bytes - 1):+.1f}% "
          f"vs the busiest rank), binding {price.binding}, basis {price.basis}")
    return 0
