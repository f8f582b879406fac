"""Train a small Megatron-core GPT with LoRA on the CPU, letting waveplan plan every step.

Each step is GRPO-style: a few prompts, each with several completions of different lengths.
Per step, `Planner.plan` cuts the step into waves that fit a memory budget; each wave then
runs for real (forward and backward on the wave's sequences, packed as prefix trees so a
shared prompt's rows run once, as the planner prices them; full recompute as Megatron
configures it; base frozen, LoRA adapters trainable) while the tracer's live-storage count
measures its peak, and `Planner.observe` learns from that peak. After the step's last wave
AdamW updates the adapters. The printed table shows, per wave, the estimate it was planned
with, the measured peak, and the estimate after `observe`: the estimates tighten towards
the measurements and the planning estimate (admitted, with the safety factor) never falls
below a measured peak. The static estimate alone (the table, before any observation) covers
every measured peak too: the table's calibration cells include this model's shape, and the
prefix-tree attention (`pricing.measure.training_wave.run_training_wave`) keeps, as a varlen flash kernel
does, only the packed queries/keys/values, not per-segment copies joined to the prompt's.

The planner's geometry, layout, recompute and LoRA settings are read from the live model
(`geometry_from_megatron`); prices use the `torch-cpu` coefficient table (fitted to traces
counted the same way) and the `full-native` head (Megatron's own cross entropy on full
logits, which is what the model runs).

Run:  .venv/bin/python examples/train_lora_cpu.py [--steps N] [--budget-mib X] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

MIB = 2**20
PATTERN = 32  # completions use token ids 0..31


@dataclass(frozen=True)
class TrainConfig:
    """A small model and a few GRPO-style steps; the defaults run in seconds on two cores."""

    steps: int = 6
    layers: int = 2
    hidden: int = 128
    ffn: int = 384
    vocab: int = 512
    heads: int = 4
    kv_groups: int = 2
    lora_rank: int = 8
    prompts_per_step: int = 3
    completions_per_prompt: int = 4
    prompt_tokens: tuple[int, int] = (32, 96)        # uniform range, inclusive
    completion_tokens: tuple[int, int] = (16, 160)
    budget_bytes: int = 5 * MIB                      # free bytes per wave: needs several waves
    lr: float = 1e-2
    seed: int = 0
    backend: str = "torch-cpu"
    head: str = "full-native"
    threads: int = 1   # torch intra-op threads while training (tiny matmuls: one is fastest)


@dataclass(frozen=True)
class WaveRecord:
    """One wave as planned, measured and re-priced. Bytes throughout.

    `raw_before`/`admitted_before`: the price the plan used (admitted = raw x safety is what
    must fit the budget); `basis_before` is "profile" once the wave's signature has been
    observed. `static_raw`: the static model's raw price (no profile). `measured`: the
    wave's real peak. `raw_after`/`admitted_after`: the same wave re-priced after observing
    it. `earlier_rope`: the RoPE cache entries of the step's earlier waves the plan charged
    beside it (in `raw_before`; the peak is measured above them)."""

    step: int
    wave: int
    requests: tuple[str, ...]
    packed_rows: int
    logical_rows: int
    segments: int
    first: bool
    basis_before: str
    raw_before: int
    admitted_before: int
    static_raw: int
    measured: int
    raw_after: int
    admitted_after: int
    loss_sum: float
    loss_tokens: int
    earlier_rope: int = 0


@dataclass
class TrainResult:
    config: TrainConfig
    waves: list[WaveRecord] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)
    waves_per_step: list[int] = field(default_factory=list)
    plans_checked: int = 0
    seconds: float = 0.0
    geometry: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"config": asdict(self.config), "geometry": self.geometry,
                "waves": [asdict(w) for w in self.waves], "step_losses": self.step_losses,
                "waves_per_step": self.waves_per_step, "plans_checked": self.plans_checked,
                "seconds": self.seconds}


# --- data -------------------------------------------------------------------------------------


def make_step(config: TrainConfig, step: int, rng):
    """A GRPO-style step: requests in length form (prompt key, prompt and total length) and
    the token ids behind them. Prompts are random tokens; completions count up through the
    first `PATTERN` token ids (t -> t + 1 mod PATTERN) from a random start, a rule the
    adapters can pick up in a few steps."""
    from waveplan.pricing.step import Request, Step

    requests, prompts, completions = [], {}, {}
    lo_p, hi_p = config.prompt_tokens
    lo_c, hi_c = config.completion_tokens
    for g in range(config.prompts_per_step):
        key = f"s{step}-p{g}"
        prompts[key] = tuple(int(t) for t in rng.integers(0, config.vocab, int(rng.integers(lo_p, hi_p + 1))))
        for c in range(config.completions_per_prompt):
            rid = f"{key}-c{c}"
            n = int(rng.integers(lo_c, hi_c + 1))
            start = int(rng.integers(0, PATTERN))
            completions[rid] = tuple((start + j) % PATTERN for j in range(n))
            requests.append(Request(id=rid, num_tokens=len(prompts[key]) + n, prompt=key,
                                    num_prompt_tokens=len(prompts[key])))
    return Step.from_requests(requests), prompts, completions


def wave_children(step, wave, prompts, completions):
    """The wave's forward calls as `PromptGroup` lists (one per child, prompts in order)."""
    from waveplan.pricing.measure.training_wave import PromptGroup

    children = []
    for child in wave.children:
        groups: dict[str, list[str]] = {}
        for i in child:
            request = step.requests[int(i)]
            groups.setdefault(request.prompt, []).append(request.id)
        children.append([PromptGroup(prompt=prompts[key], completions=tuple(completions[r] for r in ids))
                         for key, ids in groups.items()])
    return children


# --- the loop ---------------------------------------------------------------------------------


def build_model(config: TrainConfig):
    """The GPT (bf16, full recompute, LoRA on every linear layer, base frozen). Call inside
    `init_single_process`."""
    import torch

    from waveplan.pricing.geometry import AttentionSpec, MixerKind, MlpKind, ModelGeometry
    from waveplan.pricing.measure.megatron_build import build_gpt
    from waveplan.pricing.parallel import Recompute

    torch.manual_seed(config.seed)
    geometry = ModelGeometry(
        name="tiny-lora-cpu", hidden=config.hidden, ffn=config.ffn, vocab=config.vocab,
        layers=((MixerKind.ATTENTION, MlpKind.DENSE),) * config.layers,
        attention=AttentionSpec(config.heads, config.kv_groups, config.hidden // config.heads))
    longest = config.prompt_tokens[1] + config.completion_tokens[1]
    return build_gpt(geometry, device="cpu", lora_rank=config.lora_rank,
                     recompute=Recompute(mode="full"), seq_len=longest)


def train(config: TrainConfig = TrainConfig(), *, log: Callable[[str], None] | None = print,
          check_plans: bool = True) -> TrainResult:
    """Train for `config.steps` steps; returns every wave's estimates and measurement."""
    import numpy as np
    import torch

    say = log or (lambda _line: None)
    t0 = time.perf_counter()
    result = TrainResult(config=config)
    rng = np.random.default_rng(config.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        _train(config, result, rng, say, check_plans)
    finally:
        torch.set_num_threads(threads)
    result.seconds = time.perf_counter() - t0
    return result


def _train(config: TrainConfig, result: TrainResult, rng, say: Callable[[str], None],
           check_plans: bool) -> None:
    import torch

    from waveplan.planner import Planner
    from waveplan.pricing import rope_cache
    from waveplan.pricing.measure.live_geometry import geometry_from_megatron
    from waveplan.pricing.measure.megatron_shim import init_single_process
    from waveplan.pricing.measure.training_wave import run_training_wave
    from waveplan.search import check_plan

    with init_single_process(1):
        model = build_model(config)
        geometry, layout, recompute, lora = geometry_from_megatron(model)
        result.geometry = {"geometry": geometry.to_dict(), "parallel": layout.to_dict(),
                           "recompute": recompute.to_dict(), "lora": lora.to_dict()}
        planner = Planner(geometry=geometry, parallel=layout, recompute=recompute, lora=lora,
                          backend=config.backend, head=config.head)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=0.0)
        say(f"model: {config.layers} layers, hidden {config.hidden}, vocab {config.vocab}, "
            f"LoRA rank {config.lora_rank} ({sum(p.numel() for p in trainable)} trainable "
            f"parameters), recompute {recompute.mode.value}; backend {config.backend}, head "
            f"{config.head}; budget {config.budget_bytes / MIB:.2f} MiB")
        say(f"{'step':>4} {'wave':>4} {'reqs':>4} {'rows':>9} {'1st':>3} {'basis':>8} "
            f"{'static':>8} {'est raw':>8} {'est adm':>8} {'measured':>8} "
            f"{'after raw':>9} {'after adm':>9}   (KiB; rows packed/logical)")
        for s in range(config.steps):
            step, prompts, completions = make_step(config, s, rng)
            plan = planner.plan(step, free_bytes=config.budget_bytes, deterministic=True)
            if check_plans:
                check_plan(step, planner.pricer(step), plan,
                           budget_bytes=config.budget_bytes)
                result.plans_checked += 1
            loss_tokens = sum(len(c) - 1 for c in completions.values())
            step_loss = 0.0
            for wave in plan.waves:
                children = wave_children(step, wave, prompts, completions)
                measured = run_training_wave(model, children, loss_scale=1.0 / loss_tokens)
                planner.observe(wave, peak_bytes=measured.peak_bytes)
                after = planner.pricer(step).price(list(wave.children), first_slots=wave.first_slots)
                record = WaveRecord(
                    step=s, wave=wave.index, requests=wave.request_ids,
                    packed_rows=wave.size.packed_rows, logical_rows=wave.size.logical_rows,
                    segments=wave.size.segments,
                    first=bool(wave.first_slots), basis_before=wave.breakdown.basis,
                    raw_before=wave.raw_bytes, admitted_before=wave.admitted_bytes,
                    static_raw=wave.static_raw_bytes, measured=measured.peak_bytes,
                    raw_after=after.raw_bytes, admitted_after=after.admitted_bytes,
                    loss_sum=measured.loss_sum, loss_tokens=measured.loss_tokens,
                    earlier_rope=wave.breakdown.terms.get(rope_cache.TERM, 0))
                if measured.packed_rows != record.packed_rows:
                    raise AssertionError(f"step {s} wave {wave.index}: ran {measured.packed_rows} "
                                         f"rows, planned {record.packed_rows}")
                result.waves.append(record)
                step_loss += measured.loss_sum
                say(f"{s:>4} {wave.index:>4} {len(wave.request_ids):>4} "
                    f"{record.packed_rows:>4}/{record.logical_rows:<4} "
                    f"{'y' if record.first else '':>3} {record.basis_before:>8} "
                    + " ".join(f"{v / 1024:>8.0f}" for v in (
                        record.static_raw, record.raw_before, record.admitted_before,
                        record.measured))
                    + f" {record.raw_after / 1024:>9.0f} {record.admitted_after / 1024:>9.0f}")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            result.waves_per_step.append(plan.num_waves)
            result.step_losses.append(step_loss / loss_tokens)
            say(f"step {s}: {plan.num_waves} waves (lower bound {plan.lower_bound_waves}), "
                f"loss {result.step_losses[-1]:.4f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--budget-mib", type=float, default=TrainConfig.budget_bytes / MIB)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    config = TrainConfig(steps=args.steps, budget_bytes=int(args.budget_mib * MIB), seed=args.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron warns about missing Transformer Engine/Apex
        result = train(config, log=None if args.json else print)
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=1)
        print()
    else:
        print(f"{len(result.waves)} waves in {result.seconds:.1f} s; "
              f"losses {', '.join(f'{x:.3f}' for x in result.step_losses)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
