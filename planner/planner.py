"""The per-step API: `Planner(...).plan(step, free_bytes=...)`, then `observe` each wave's peak.

A planner is a fixed pricing configuration (geometry, parallel layout, recompute, LoRA,
backend, head, safety) plus a mutable store of learned profiles (see `profiles`). The pricer
it hands the search decides what the search may take for exact: without profiles the plain
`WavePricer` (every capability of the contract, its fast admitted path included); with
profiles a `_ProfiledPricer`, which has no fast path (a profile prices from the full
breakdown), so the search keeps every full price it computes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from waveplan.pricing.atomic_io import write_json_atomic
from waveplan.pricing.coefficients import DEFAULT_BACKEND
from waveplan.pricing.compile_clock import CompileClock
from waveplan.pricing.envelope import Envelope
from waveplan.pricing.errors import ConfigError, bad
from waveplan.pricing.geometry import ModelGeometry
from waveplan.pricing.hf_config import load_hf_config
from waveplan.pricing.lora import LoraConfig, LoraSlot
from waveplan.pricing.model import DEFAULT_HEAD, DEFAULT_SAFETY, PricingModel
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.presets import load_preset
from waveplan.pricing.price import Breakdown, GroupLoad
from waveplan.pricing.step import Request, Step, load_step
from waveplan.pricing.time_model import WaveTimeModel, check_seconds, wave_work
from waveplan.pricing.wave_pricer import WavePricer
from waveplan.search import (
    DEFAULT_PACKER,
    DEFAULT_SEED,
    PackerKind,
    SearchOptions,
    pack,
)

from .misses import MissLog, WaveObservation, default_misses_path
from .plan import Plan, PlanWave
from .profiles import (
    ProfileAdjust,
    ProfileStore,
    config_key,
    load_profiles,
    static_raw_without_first_exec,
)
from .warmup import ensure_warm, warmup

MAX_BUDGET_BYTES = 2**50  # 1 PiB: anything above is a unit mistake, not a GPU


class _ProfiledPricer:
    """A step's pricer with learned profiles: a `WavePricer` whose prices pass through the
    profiles (`adjust`), seen through the search contract without the fast admitted path
    (`contract.AdmittedPricer`): a profile prices from the full breakdown, so the search
    keeps the full prices it computes instead of pricing each wave twice. Its envelope is
    scaled by the largest learned ratio (> 1), so that the search still packs against an
    upper bound when profiles raise prices. Every other capability is the WavePricer's."""

    def __init__(self, pricer: WavePricer, envelope_scale: float) -> None:
        self._pricer = pricer
        self.envelope_scale = envelope_scale

    @property
    def num_classes(self) -> int:
        return self._pricer.num_classes

    @property
    def class_of(self) -> np.ndarray:
        return self._pricer.class_of

    @property
    def class_slot(self) -> tuple[str, ...]:
        return self._pricer.class_slot

    @property
    def class_grad(self) -> tuple[bool, ...]:
        return self._pricer.class_grad

    def envelope(self) -> Envelope:
        env = self._pricer.envelope()
        if self.envelope_scale <= 1.0:
            return env
        s = self.envelope_scale
        return dataclasses.replace(
            env, const=env.const * s, presence=env.presence * s, coef=env.coef * s,
            pad=None if env.pad is None else env.pad * s,
            seg=None if env.seg is None else env.seg * s,
            pending=None if env.pending is None else env.pending * s)

    def price(self, children: Sequence[np.ndarray], *,
              first_slots: frozenset[str] = frozenset()) -> Breakdown:
        return self._pricer.price(children, first_slots=first_slots)

    def group_loads(self, children: Sequence[np.ndarray]) -> list[GroupLoad]:
        return self._pricer.group_loads(children)

    def price_loads(self, loads: Sequence[GroupLoad], *,
                    first_slots: frozenset[str] = frozenset()) -> Breakdown:
        return self._pricer.price_loads(loads, first_slots=first_slots)

    def earlier_entries(self, waves: Sequence[Sequence[GroupLoad]]) -> list[float]:
        return self._pricer.earlier_entries(waves)

    def plus_earlier(self, price: Breakdown, extra: float) -> Breakdown:
        return self._pricer.plus_earlier(price, extra)

    def earlier_reserve_bytes(self) -> int:
        return self._pricer.earlier_reserve_bytes()

    def pending_bytes(self, slot: str) -> float:
        return self._pricer.pending_bytes(slot)

    def lower_bound_waves(self, budget_bytes: float, requests: np.ndarray | None = None) -> int:
        return self._pricer.lower_bound_waves(budget_bytes, requests)

    def stages(self):
        return self._pricer.stages()


def _check_bytes(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise bad(ConfigError, field, value, "must be a number of bytes")
    v = float(value)
    if not math.isfinite(v) or v <= 0 or v > MAX_BUDGET_BYTES:
        raise bad(ConfigError, field, value, f"must be a finite number of bytes in (0, {MAX_BUDGET_BYTES}] (1 PiB)")
    return v


def budget_from_free_bytes(free_bytes: object) -> int:
    """The wave budget: the minimum over ranks (the busiest rank binds)."""
    if isinstance(free_bytes, Sequence | np.ndarray) and not isinstance(free_bytes, str | bytes):
        values = list(free_bytes)
        if not values:
            raise bad(ConfigError, "free_bytes", values, "needs at least one rank")
        return int(min(_check_bytes(f"free_bytes[{i}]", v) for i, v in enumerate(values)))
    return int(_check_bytes("free_bytes", free_bytes))


def _peak(peak_bytes: object) -> int:
    """Observed peak: a number or one per rank (the largest binds)."""
    if isinstance(peak_bytes, Sequence | np.ndarray) and not isinstance(peak_bytes, str | bytes):
        values = list(peak_bytes)
        if not values:
            raise bad(ConfigError, "peak_bytes", values, "needs at least one rank")
        return int(math.ceil(max(_check_bytes(f"peak_bytes[{i}]", v) for i, v in enumerate(values))))
    return int(math.ceil(_check_bytes("peak_bytes", peak_bytes)))


def _as_step(step: object) -> Step:
    if isinstance(step, Step):
        return step
    if isinstance(step, str | os.PathLike):
        return load_step(step)
    if isinstance(step, Sequence) and all(isinstance(r, Request) for r in step):
        return Step.from_requests(step)
    raise bad(ConfigError, "step", type(step).__name__, "must be a Step, a step file or a list of Requests")


def _set_aside(path: Path) -> Path:
    """Rename a bad file to `<name>.corrupt` (or `.corrupt.N`): never overwrite evidence."""
    target = path.with_name(path.name + ".corrupt")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.corrupt.{n}")
        n += 1
    os.replace(path, target)
    return target


class Planner:
    """Plans the waves of training steps for one model configuration and learns from peaks.

    Example::

        planner = Planner.from_preset("qwen3.8-27b", tp=4, sequence_parallel=True)
        plan = planner.plan(step, free_bytes=[40 * 2**30] * 4)
        for wave in plan.waves:
            ...run it...
            planner.observe(wave, peak_bytes=torch_peaks)
        planner.save_profiles("profiles.json")
    """

    def __init__(self, *, geometry: ModelGeometry, parallel: ParallelLayout | None = None,
                 recompute: Recompute | str | None = None, lora: LoraConfig | None = None,
                 backend: str = DEFAULT_BACKEND, head: str = DEFAULT_HEAD, safety: float = DEFAULT_SAFETY,
                 profiles_path: str | os.PathLike | None = None, moe_load: float | None = None,
                 misses_path: str | os.PathLike | None = None) -> None:
        if isinstance(recompute, str):
            recompute = Recompute(mode=recompute)
        model = PricingModel.build(geometry, parallel=parallel, recompute=recompute, lora=lora,
                                   backend=backend, head=head, safety=safety, moe_load=moe_load)
        self._setup(model, None, profiles_path, misses_path)

    @classmethod
    def from_preset(cls, name: str, *, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1,
                    etp: int | None = None, sequence_parallel: bool = False, recompute: Recompute | str = "full",
                    lora_rank: int = 16, lora: LoraConfig | None = None, backend: str = DEFAULT_BACKEND,
                    head: str = DEFAULT_HEAD, safety: float = DEFAULT_SAFETY,
                    profiles_path: str | os.PathLike | None = None,
                    moe_load: float | None = None, misses_path: str | os.PathLike | None = None) -> Planner:
        """A planner for a bundled preset; LoRA is one slot 'default' of `lora_rank` on every
        linear layer unless `lora` is given. `moe_load` (opt-in): the busiest EP rank's routed
        rows over rows x top_k that the caller guarantees (`pricing.moe_terms.busiest_rank_load`;
        default: the worst case any router can produce). `etp`: Megatron's
        expert_tensor_parallel_size (None: its default, `tp`)."""
        return cls(geometry=load_preset(name),
                   parallel=ParallelLayout(tp=tp, cp=cp, pp=pp, ep=ep, sequence_parallel=sequence_parallel,
                                           etp=etp),
                   recompute=recompute, lora=lora or LoraConfig(slots=(LoraSlot(rank=lora_rank),)),
                   backend=backend, head=head, safety=safety, profiles_path=profiles_path,
                   moe_load=moe_load, misses_path=misses_path)

    @classmethod
    def from_hf_config(cls, config: object, *, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1,
                       etp: int | None = None, sequence_parallel: bool = False, recompute: Recompute | str = "full",
                       lora_rank: int = 16, lora: LoraConfig | None = None,
                       backend: str = DEFAULT_BACKEND, head: str = DEFAULT_HEAD,
                       safety: float = DEFAULT_SAFETY,
                       profiles_path: str | os.PathLike | None = None,
                       name: str | None = None, moe_load: float | None = None,
                       misses_path: str | os.PathLike | None = None,
                       as_family: str | None = None) -> Planner:
        """A planner for a Hugging Face config: a config.json, a checkpoint directory, its dict
        or a `transformers` config object (`pricing.hf_config.load_hf_config`; `as_family`
        opts an unsupported model_type into a supported family's reading, conservatively);
        the other arguments as `from_preset`."""
        return cls(geometry=load_hf_config(config, name=name, as_family=as_family),
                   parallel=ParallelLayout(tp=tp, cp=cp, pp=pp, ep=ep, sequence_parallel=sequence_parallel,
                                           etp=etp),
                   recompute=recompute, lora=lora or LoraConfig(slots=(LoraSlot(rank=lora_rank),)),
                   backend=backend, head=head, safety=safety, profiles_path=profiles_path,
                   moe_load=moe_load, misses_path=misses_path)

    @classmethod
    def from_megatron(cls, model: object, *, backend: str = DEFAULT_BACKEND, head: str = DEFAULT_HEAD,
                      safety: float = DEFAULT_SAFETY,
                      profiles_path: str | os.PathLike | None = None,
                      misses_path: str | os.PathLike | None = None) -> Planner:
        """A planner for a live Megatron-core model (a `GPTModel`, its decoder, or a wrapper of
        either; a `meta`-device build costs no memory): geometry, parallel layout, recompute and
        LoRA adapters are read from its `TransformerConfig` and modules
        (`pricing.measure.live_geometry.geometry_from_megatron`). Needs the megatron extra. A
        bare `TransformerConfig` is refused: it lacks the vocabulary and the adapters."""
        if type(model).__name__.endswith("TransformerConfig"):
            raise bad(ConfigError, "model", type(model).__name__,
                      "needs the model, not its config (build it on the meta device: "
                      "the vocabulary and LoRA adapters live on the modules)")
        from waveplan.pricing.measure.live_geometry import geometry_from_megatron

        geometry, parallel, recompute, lora = geometry_from_megatron(model)
        return cls(geometry=geometry, parallel=parallel, recompute=recompute, lora=lora,
                   backend=backend, head=head, safety=safety, profiles_path=profiles_path,
                   misses_path=misses_path)

    @classmethod
    def from_model(cls, model: PricingModel, *, profiles: ProfileStore | None = None,
                   profiles_path: str | os.PathLike | None = None,
                   misses_path: str | os.PathLike | None = None) -> Planner:
        """A planner for an already built pricing model (replay uses this)."""
        self = cls.__new__(cls)
        self._setup(model, profiles, profiles_path, misses_path)
        return self

    def _setup(self, model: PricingModel, profiles: ProfileStore | None,
               profiles_path: str | os.PathLike | None,
               misses_path: str | os.PathLike | None = None) -> None:
        self._model = model
        self._config = config_key(model)
        self._profiles_path = None if profiles_path is None else Path(profiles_path)
        # misses (`misses.MissLog`): `misses_path`, else beside the profiles file
        self._misses = MissLog(Path(misses_path) if misses_path is not None
                               else default_misses_path(self._profiles_path))
        if profiles is None:
            profiles = self._open_profiles()
        self._store = profiles

    def _open_profiles(self) -> ProfileStore:
        path = self._profiles_path
        if path is None or not path.exists():
            return ProfileStore()
        try:
            return load_profiles(path)
        except ConfigError as exc:
            # A bad file must not stop training: keep it for inspection, price statically.
            moved = _set_aside(path)
            warnings.warn(f"{exc}; set aside as {moved.name}, continuing from the static model",
                          RuntimeWarning, stacklevel=3)
            return ProfileStore()

    # --- properties ---------------------------------------------------------------------

    @property
    def model(self) -> PricingModel:
        return self._model

    @property
    def profiles(self) -> ProfileStore:
        return self._store

    @property
    def profiles_path(self) -> Path | None:
        return self._profiles_path

    @property
    def misses_path(self) -> Path | None:
        """Where misses are appended (`misses.miss_record`); None: they are only warned about."""
        return self._misses.path

    @property
    def time_model(self) -> WaveTimeModel:
        """Predicted seconds of a wave (`pricing.time_model`), its scale learned by
        `observe(wave, seconds=...)`; docs/faq.md#time-model."""
        if getattr(self, "_time_model", None) is None:
            self._time_model = WaveTimeModel.from_model(self._model)
        return self._time_model

    @time_model.setter
    def time_model(self, value: WaveTimeModel) -> None:
        if not isinstance(value, WaveTimeModel):
            raise bad(ConfigError, "time_model", type(value).__name__, "must be a WaveTimeModel")
        self._time_model = value

    # --- planning -----------------------------------------------------------------------

    def pricer(self, step: Step, *, model: PricingModel | None = None) -> WavePricer | _ProfiledPricer:
        """The step's pricer with the learned profiles applied: the plain `WavePricer` while
        the planner has none (the search may use its fast admitted path), else one that
        prices through them (no fast path; see `_ProfiledPricer`). `model`: price with it
        instead of the planner's own, under the planner's profiles (`planner.ep_peers`: the
        same model with its routed rows raised to the EP peers' calls)."""
        model = self._model if model is None else model
        if not len(self._store):
            return WavePricer(step=step, model=model)
        adjust = ProfileAdjust(store=self._store, config=self._config, safety=model.safety)
        return _ProfiledPricer(WavePricer(step=step, model=model, adjust=adjust),
                               envelope_scale=self._store.max_ratio(self._config))

    def _stage_budgets(self, stage_free_bytes) -> tuple[int, ...]:
        """One budget per pipeline stage from `stage_free_bytes`. O(ranks)."""
        pp = self.model.parallel.pp
        if isinstance(stage_free_bytes, str | bytes) or not isinstance(stage_free_bytes, Sequence):
            raise bad(ConfigError, "stage_free_bytes", stage_free_bytes,
                      "must be a list with one entry per pipeline stage")
        if pp == 1 or len(stage_free_bytes) != pp:
            raise bad(ConfigError, "stage_free_bytes", list(stage_free_bytes),
                      f"needs one entry per pipeline stage (pp={pp}, and pp > 1)")
        return tuple(budget_from_free_bytes(f) for f in stage_free_bytes)

    def plan(self, step: Step | Sequence[Request] | str | os.PathLike, free_bytes, *,
             packer: PackerKind | str = DEFAULT_PACKER,
             time_budget_ms: float | None = None,
             atomic_units: Sequence[Sequence[int]] = (), num_waves: int | None = None,
             seed: int = DEFAULT_SEED, deterministic: bool = False,
             stage_free_bytes: Sequence | None = None) -> Plan:
        """Cut `step` into waves that fit `free_bytes` (bytes free per rank: a number or one per
        rank; the minimum binds). `atomic_units` are lists of request indices that must share
        a wave; `num_waves` asks for exactly that many waves. `deterministic=True` never reads
        the clock (the work `time_budget_ms` buys by estimate decides: same inputs, same plan);
        without it, the clock left of the budget after that work improves the plan further
        (never more waves than the deterministic plan). `stage_free_bytes` (PP > 1
        only): the free bytes of each pipeline stage (a number or one per rank of the stage);
        each stage's in-flight windows are checked against its own budget, each wave against
        the smallest of them and `free_bytes`'s. `time_budget_ms` None: the default rule
        (`search.default_time_budget_ms`, 5 ms up to 200 requests, 0.025 ms a request above;
        docs/faq.md#time-budget)."""
        budget = budget_from_free_bytes(free_bytes)
        stage_budgets = None
        if stage_free_bytes is not None:
            stage_budgets = self._stage_budgets(stage_free_bytes)
            budget = min(budget, *stage_budgets)
        options = SearchOptions(packer=packer, time_budget_ms=time_budget_ms,
                                atomic_units=atomic_units, num_waves=num_waves, seed=seed,
                                deterministic=deterministic, stage_budgets=stage_budgets,
                                earlier_entries=True)
        step = _as_step(step)
        with CompileClock() as warm_clock:
            # the first plan of a process compiles (or loads) every kernel, in parallel
            # worker processes when cold (their compile time: `wait_s`)
            warm = ensure_warm(Planner)
        wait_s = warm.wait_s if warm is not None else 0.0
        t0 = time.perf_counter()
        with CompileClock() as clock:
            pricer = self.pricer(step)
            # the search charges the earlier waves' RoPE cache entries (the pricer's
            # `earlier_entries`, search.earlier) and reports the bound it packed against
            result = pack(step, pricer, budget_bytes=budget, options=options)
            waves = self._waves(step, result, budget)
        # planning only: the warm-up and the time inside numba's compiler (compiling, or
        # loading from the cache) are reported apart, as compile_ms (compiling) and
        # stats["jit_ms"] (both)
        planning_ms = max(0.0, (time.perf_counter() - t0 - clock.jit_s) * 1e3)
        compile_s = warm_clock.compile_s + clock.compile_s + wait_s
        stats = dict(result.stats)
        stats["compile_ms"] = compile_s * 1e3
        stats["jit_ms"] = (warm_clock.jit_s + clock.jit_s + wait_s) * 1e3
        return Plan(waves=waves, packer=result.packer, planning_ms=planning_ms,
                    lower_bound_waves=int(result.lower_bound_waves),
                    proven_optimal=bool(result.proven_optimal), budget_bytes=budget,
                    stats=stats, compile_ms=compile_s * 1e3)

    def _waves(self, step: Step, result, budget: int) -> tuple[PlanWave, ...]:
        """The plan's waves from the search result. O(waves x groups)."""
        ids = step.ids
        signer = ProfileAdjust(store=self._store, config=self._config, safety=self._model.safety)
        waves = []
        for i, w in enumerate(result.waves):
            if w.loads is None:   # the planner's pricers always give them
                raise AssertionError("internal: a packed wave without its group loads")
            signature = signer.signature(w.loads)
            waves.append(PlanWave.of(i, w, ids, budget_bytes=budget, signature=signature,
                                     static_raw_bytes=static_raw_without_first_exec(w.price),
                                     profile=self._store.get(signature),
                                     work=wave_work(step, w.children)))
        return tuple(waves)

    @staticmethod
    def warmup(*, force: bool = False):
        """Compile (or load from the cache) every kernel a plan can need, now, instead of in
        the first plan: for trainers that pay it at start-up. Once per process unless `force`;
        returns a `WarmupReport`, or None when the process was warm already (or numba's JIT
        is disabled: nothing to compile). See `waveplan.planner.warmup`."""
        return warmup(Planner, force=force)

    # --- learning -----------------------------------------------------------------------

    def observe(self, wave: PlanWave, *, peak_bytes=None, seconds=None) -> WaveObservation | None:
        """Learn from a wave's observed peak (bytes; a number or one per rank, the largest
        binds). The next plans of the same signature are priced with it. Returns the
        observation: the wave's estimate, the peak and the kind of miss; a miss is warned
        about on the `waveplan` logger (once per signature and kind) and appended to
        `misses_path` (`waveplan.planner.misses`, docs/faq.md#a-wave-missed-its-estimate).
        `seconds`: the wave's measured time, which rescales `time_model` (alone, or with
        `peak_bytes`; alone, None is returned)."""
        if seconds is not None:
            self._observe_seconds(wave, seconds)
            if peak_bytes is None:
                return None
        if not isinstance(wave, PlanWave):
            raise bad(ConfigError, "wave", type(wave).__name__, "must be a wave of a Plan from this planner")
        if wave.signature.config != self._config:
            raise bad(ConfigError, "wave", wave.index, "was planned for another model configuration")
        peak = _peak(peak_bytes)
        self._store.observe(wave.signature, wave.loads, static_raw_bytes=wave.static_raw_bytes,
                            peak_bytes=peak)
        return self._misses.observe(self._model, wave, peak)

    def _observe_seconds(self, wave: PlanWave, seconds) -> None:
        """A wave's measured seconds (a number, or one per rank: the slowest binds)."""
        if not isinstance(wave, PlanWave) or wave.work is None:
            raise bad(ConfigError, "wave", type(wave).__name__, "must be a wave of a Plan from this planner")
        if isinstance(seconds, Sequence | np.ndarray) and not isinstance(seconds, str | bytes):
            values = list(seconds)
            if not values:
                raise bad(ConfigError, "seconds", values, "needs at least one rank")
            seconds = max(check_seconds(f"seconds[{i}]", v) for i, v in enumerate(values))
        self.time_model = self.time_model.observed(*wave.work, seconds)

    def save_profiles(self, path: str | os.PathLike | None = None) -> Path:
        """Write the profiles atomically (to `profiles_path` when `path` is None)."""
        target = Path(path) if path is not None else self._profiles_path
        if target is None:
            raise bad(ConfigError, "path", None, "no path given and the planner has no profiles_path")
        write_json_atomic(target, self._store.to_dict())
        return target
