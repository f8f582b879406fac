"""Packing and pricing studies: plan many steps under several variants and compare wave counts.

A `Variant` is a name, a `PricingModel` and a packer kind, so one study can compare packers
(auto vs first-fit-decreasing vs ...) and pricing settings (another coefficient backend, head
mode or safety factor) on the same steps. It answers "does A need 10 waves where B needs 11?".

Steps come from a directory of `*.jsonl` step files (`steps_from_dir`) or from a seeded
generator (`GeneratorSpec`): `grpo` (P prompts x C completions, heavy-tailed completions
clustered per prompt) or `sft` (every request its own prompt, nothing shared).
"""

from __future__ import annotations

import csv
import io
import logging
import math
import statistics
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from waveplan.pricing.atomic_io import write_text_atomic
from waveplan.pricing.errors import ConfigError, InfeasibleError, StepError, bad
from waveplan.pricing.model import PricingModel
from waveplan.pricing.step import Request, Step, load_step
from waveplan.pricing.wave_pricer import WavePricer
from waveplan.search import DEFAULT_PACKER, DEFAULT_TIME_BUDGET_MS, PackerKind, pack

from .progress import progress_bar

log = logging.getLogger("waveplan.study")
DISTRIBUTIONS = ("grpo", "sft")

# --- step sources -----------------------------------------------------------------------------


def _lognormal(rng: np.random.Generator, median, sigma: float, size, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.rint(median * np.exp(sigma * rng.standard_normal(size))), lo, hi).astype(np.int64)


def grpo_step(*, prompts: int, completions: int, seed: int, prefix: str = "") -> Step:
    """A length-form GRPO step: `prompts` prompts (~256-4096 tokens, log-normal), each with
    `completions` completions (64-8192 tokens, log-normal around a per-prompt median, so the
    long tails cluster on hard prompts). Same distribution as `bench/make_steps.py`."""
    rng = np.random.default_rng(seed)
    prompt_len = _lognormal(rng, 1100, 0.6, prompts, 256, 4096)
    medians = 1800 * np.exp(0.5 * rng.standard_normal(prompts))
    completion_len = _lognormal(rng, medians[:, None], 0.8, (prompts, completions), 64, 8192)
    return Step.from_requests(
        Request(id=f"{prefix}g{g}-c{c}", prompt=f"{prefix}g{g}", num_prompt_tokens=int(prompt_len[g]),
                num_tokens=int(prompt_len[g] + completion_len[g, c]))
        for g in range(prompts) for c in range(completions))


def sft_step(*, requests: int, seed: int, prefix: str = "") -> Step:
    """A length-form SFT step: every request has its own prompt, nothing is shared."""
    rng = np.random.default_rng(seed)
    prompt_len = _lognormal(rng, 600, 0.7, requests, 64, 4096)
    completion_len = _lognormal(rng, 900, 0.9, requests, 64, 8192)
    return Step.from_requests(
        Request(id=f"{prefix}s{i}", prompt=f"{prefix}p{i}", num_prompt_tokens=int(prompt_len[i]),
                num_tokens=int(prompt_len[i] + completion_len[i]))
        for i in range(requests))


def _check_int(field: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise bad(ConfigError, field, value, f"must be an integer >= {low}")


@dataclass(frozen=True, kw_only=True)
class GeneratorSpec:
    """`count` generated steps of one distribution; step i is seeded by (seed, i), so a longer
    study extends a shorter one with the same seed. `prompts` x `completions` shape grpo
    steps, `requests` sizes sft steps."""

    distribution: str
    count: int
    seed: int = 0
    prompts: int = 32
    completions: int = 16
    requests: int = 256

    def __post_init__(self) -> None:
        if self.distribution not in DISTRIBUTIONS:
            raise bad(ConfigError, "distribution", self.distribution,
                      f"must be one of {', '.join(DISTRIBUTIONS)}")
        _check_int("count", self.count, 1)
        _check_int("seed", self.seed, 0)
        for name in ("prompts", "completions", "requests"):
            _check_int(name, getattr(self, name), 1)

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[tuple[str, Step]]:
        for i in range(self.count):
            name = f"{self.distribution}-s{self.seed}-{i:03d}"
            # SeedSequence mixes (seed, i): neighbouring seeds do not give shifted copies.
            seed = int(np.random.SeedSequence([self.seed, i]).generate_state(1)[0])
            if self.distribution == "grpo":
                yield name, grpo_step(prompts=self.prompts, completions=self.completions, seed=seed)
            else:
                yield name, sft_step(requests=self.requests, seed=seed)


def steps_from_dir(path: str | Path) -> list[tuple[str, Step]]:
    """Every `*.jsonl` step file of a directory, sorted by name; the name is the file stem."""
    path = Path(path)
    if not path.is_dir():
        raise bad(StepError, "steps", str(path), "must be a directory of *.jsonl step files")
    files = sorted(path.glob("*.jsonl"))
    if not files:
        raise bad(StepError, "steps", str(path), "holds no *.jsonl step files")
    return [(f.stem, load_step(f)) for f in files]


# --- variants and results ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One way to plan: a pricing model and a packer kind (a `PackerKind` value)."""

    name: str
    model: PricingModel
    packer: str = DEFAULT_PACKER.value

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "," in self.name:
            raise bad(ConfigError, "variant.name", self.name, "must be a non-empty string without ','")
        try:
            object.__setattr__(self, "packer", PackerKind(self.packer).value)
        except ValueError:
            raise bad(ConfigError, "packer", self.packer,
                      f"must be one of {', '.join(k.value for k in PackerKind)}") from None


@dataclass(frozen=True, kw_only=True)
class StudyRow:
    """One (step, variant) cell. `waves` and `lower_bound` are None when the step could not be
    planned (`error` says why, e.g. a request that fits no wave)."""

    step: str
    variant: str
    packer: str
    packer_used: str
    num_requests: int
    logical_rows: int
    waves: int | None
    lower_bound: int | None
    proven_optimal: bool
    plan_ms: float
    error: str = ""

    @property
    def above_bound(self) -> int | None:
        return None if self.waves is None else self.waves - self.lower_bound

    @property
    def status(self) -> str:
        """"settled" when the plan meets the lower bound (no plan has fewer waves), "open" when
        it is above it (fewer may or may not exist), "failed" when the step was not planned."""
        if self.waves is None:
            return "failed"
        return "settled" if self.waves <= self.lower_bound else "open"


CSV_FIELDS = ("step", "variant", "packer", "packer_used", "num_requests", "logical_rows", "waves",
              "lower_bound", "above_bound", "proven_optimal", "status", "plan_ms", "error")


@dataclass(frozen=True, kw_only=True)
class VariantSummary:
    """Aggregates of one variant over the steps it planned."""

    variant: str
    packer: str
    planned: int
    failed: int
    total_waves: int
    mean_above_bound: float
    frac_proven_optimal: float
    median_ms: float
    max_ms: float
    at_best: int  # steps where no other variant needs fewer waves


@dataclass(frozen=True, kw_only=True)
class StudyResult:
    """Every cell of a study, in (step, variant) order."""

    steps: tuple[str, ...]
    variants: tuple[str, ...]
    rows: tuple[StudyRow, ...]
    budget_bytes: int
    time_budget_ms: float
    deterministic: bool = False

    def cell(self, step: str, variant: str) -> StudyRow:
        return self._index()[(step, variant)]

    def _index(self) -> dict[tuple[str, str], StudyRow]:
        return {(r.step, r.variant): r for r in self.rows}

    def waves_of(self, variant: str) -> list[int | None]:
        """Waves per step (study order) for one variant."""
        index = self._index()
        return [index[(s, variant)].waves for s in self.steps]

    def compare(self, a: str, b: str) -> tuple[int, int, int]:
        """(steps where `a` needs fewer waves than `b`, more, as many), over steps both planned."""
        fewer = more = equal = 0
        for wa, wb in zip(self.waves_of(a), self.waves_of(b), strict=True):
            if wa is None or wb is None:
                continue
            fewer += wa < wb
            more += wa > wb
            equal += wa == wb
        return fewer, more, equal

    def summary(self, variant: str) -> VariantSummary:
        index = self._index()
        rows = [index[(s, variant)] for s in self.steps]
        ok = [r for r in rows if r.waves is not None]
        best = {s: min((w for v in self.variants if (w := index[(s, v)].waves) is not None), default=None)
                for s in self.steps}
        ms = [r.plan_ms for r in ok]
        return VariantSummary(
            variant=variant, packer=rows[0].packer, planned=len(ok), failed=len(rows) - len(ok),
            total_waves=sum(r.waves for r in ok),
            mean_above_bound=statistics.fmean(r.above_bound for r in ok) if ok else math.nan,
            frac_proven_optimal=sum(r.proven_optimal for r in ok) / len(ok) if ok else math.nan,
            median_ms=statistics.median(ms) if ms else math.nan, max_ms=max(ms, default=math.nan),
            at_best=sum(r.waves == best[r.step] for r in ok))

    def table(self) -> str:
        """A readable summary: one line per variant, then every pairwise comparison."""
        out = [f"{len(self.steps)} steps x {len(self.variants)} variants; budget "
               f"{self.budget_bytes / 2**30:.2f} GiB per rank; search time budget {self.time_budget_ms:g} ms"
               + (" (deterministic: iteration count, not the clock)" if self.deterministic else "")]
        width = max(len("variant"), *(len(v) for v in self.variants))
        head = (f"{'variant':<{width}}  {'packer':<13} {'waves':>6} {'above bound':>11} "
                f"{'proven opt':>10} {'at best':>7} {'median ms':>9} {'max ms':>8} {'failed':>6}")
        out += ["", head, "-" * len(head)]
        for v in self.variants:
            s = self.summary(v)
            out.append(f"{v:<{width}}  {s.packer:<13} {s.total_waves:>6} {s.mean_above_bound:>11.3f} "
                       f"{s.frac_proven_optimal:>10.1%} {s.at_best:>7} {s.median_ms:>9.2f} "
                       f"{s.max_ms:>8.2f} {s.failed:>6}")
        out.append("")
        out.append("above bound: mean waves over the variant's own lower bound; at best: steps where "
                   "no variant needs fewer waves")
        out += ["", *self.step_lines()]
        if len(self.variants) > 1:
            out.append("")
            for i, a in enumerate(self.variants):
                for b in self.variants[i + 1:]:
                    fewer, more, equal = self.compare(a, b)
                    out.append(f"{a} needs fewer waves than {b} on {fewer} steps, more on {more} "
                               f"(as many on {equal})")
        return "\n".join(out) + "\n"

    def step_lines(self) -> list[str]:
        """Per step and variant: waves, lower bound and whether that settles the step's wave count
        ("settled": the plan meets the bound; "open": a plan with fewer waves may exist)."""
        sw = max(len("step"), *(len(s) for s in self.steps))
        vw = max(len("variant"), *(len(v) for v in self.variants))
        head = f"{'step':<{sw}}  {'variant':<{vw}} {'waves':>6} {'bound':>6}  status"
        out = [head, "-" * len(head)]
        for r in self.rows:
            waves = "-" if r.waves is None else str(r.waves)
            bound = "-" if r.lower_bound is None else str(r.lower_bound)
            out.append(f"{r.step:<{sw}}  {r.variant:<{vw}} {waves:>6} {bound:>6}  {r.status}")
        out.append(STATUS_LEGEND)
        return out

    def to_csv(self, path: str | Path) -> None:
        """One row per (step, variant), written atomically."""
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(CSV_FIELDS)
        for r in self.rows:
            writer.writerow([r.step, r.variant, r.packer, r.packer_used, r.num_requests, r.logical_rows,
                             "" if r.waves is None else r.waves,
                             "" if r.lower_bound is None else r.lower_bound,
                             "" if r.above_bound is None else r.above_bound,
                             int(r.proven_optimal), r.status, f"{r.plan_ms:.3f}", r.error])
        write_text_atomic(path, buffer.getvalue())


STATUS_LEGEND = ("status: settled = the plan meets its lower bound, so no plan of the step has "
                 "fewer waves; open = above the bound, a plan with fewer waves may exist (or the "
                 "bound is loose); failed = the step could not be planned (its error is in --csv)")


# --- running ----------------------------------------------------------------------------------


def _plan(step: Step, variant: Variant, *, budget_bytes: int, time_budget_ms: float,
          deterministic: bool):
    """(SearchResult or None, error, ms): pricer build + pack, as the planner pays per step."""
    start = time.perf_counter()
    try:
        pricer = WavePricer.build(step, variant.model)
        result = pack(step, pricer, budget_bytes=budget_bytes, packer=PackerKind(variant.packer),
                      time_budget_ms=time_budget_ms, deterministic=deterministic)
    except InfeasibleError as exc:  # one impossible step must not sink the whole study
        return None, str(exc), (time.perf_counter() - start) * 1e3
    return result, "", (time.perf_counter() - start) * 1e3


def _progress_bar(total: int | None, enabled: bool):
    return progress_bar(total, "study", enabled=enabled, unit="plan")


def run_study(steps: Iterable[tuple[str, Step]], variants: Sequence[Variant], *,
              budget_bytes: int | float, time_budget_ms: float = DEFAULT_TIME_BUDGET_MS,
              progress: bool = False, deterministic: bool = False) -> StudyResult:
    """Plan every step under every variant and collect waves, bounds and planning times.

    `budget_bytes` is the free memory per rank. Planning time is measured per cell (pricer
    build plus search); each variant first plans the first step once untimed so numba's
    compile/cache load is not charged to it. `deterministic` makes the search count iterations
    instead of reading the clock (same plans on any machine). Cost: steps x variants searches.
    """
    variants = tuple(variants)
    if not variants:
        raise bad(ConfigError, "variants", [], "a study needs at least one variant")
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise bad(ConfigError, "variants", names, "variant names must be unique")
    if not (isinstance(budget_bytes, int | float) and math.isfinite(budget_bytes) and budget_bytes > 0):
        raise bad(ConfigError, "budget_bytes", budget_bytes, "must be a positive number of bytes")
    if not (isinstance(time_budget_ms, int | float) and math.isfinite(time_budget_ms) and time_budget_ms > 0):
        raise bad(ConfigError, "time_budget_ms", time_budget_ms, "must be a positive number")
    budget = int(budget_bytes)
    total = len(steps) * len(variants) if hasattr(steps, "__len__") else None
    bar = _progress_bar(total, progress)
    rows: list[StudyRow] = []
    step_names: list[str] = []
    try:
        for name, step in steps:
            if name in step_names:
                raise bad(StepError, "step", name, "duplicate step name in the study")
            if not step_names:
                # Warm-up, untimed. Deterministic so a clock cut short by compiling cannot skip
                # (and leave uncompiled) the later search stages, e.g. the multistart.
                for v in variants:
                    _plan(step, v, budget_bytes=budget, time_budget_ms=time_budget_ms,
                          deterministic=True)
            step_names.append(name)
            for v in variants:
                result, error, ms = _plan(step, v, budget_bytes=budget, time_budget_ms=time_budget_ms,
                          deterministic=deterministic)
                rows.append(StudyRow(
                    step=name, variant=v.name, packer=v.packer,
                    packer_used=result.packer if result else "", num_requests=step.num_requests,
                    logical_rows=step.num_logical_rows,
                    waves=result.num_waves if result else None,
                    lower_bound=result.lower_bound_waves if result else None,
                    proven_optimal=bool(result and result.proven_optimal), plan_ms=ms, error=error))
                log.info("step %s, variant %s: %s (%.1f ms)", name, v.name,
                         f"{result.num_waves} waves" if result else f"infeasible: {error}", ms)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    if not step_names:
        raise bad(StepError, "steps", [], "a study needs at least one step")
    return StudyResult(steps=tuple(step_names), variants=tuple(names), rows=tuple(rows),
                       budget_bytes=budget, time_budget_ms=float(time_budget_ms),
                       deterministic=bool(deterministic))
