"""The per-step API: `Planner(...).plan(step, free_bytes=...)`, then `observe` each wave's peak.

A planner is a fixed pricing configuration (geometry, parallel layout, recompute, LoRA,
backend, head, safety) plus a mutable store of learned profiles (see `profiles`). The pricer
it hands the search decides what the search may take for exact: without profiles every
capability of the `WavePricer`, its fast admitted path included; with profiles the same pricer
seen without its fast path (a profile prices from the full breakdown, so the search keeps every
full price it computes), `Planner._search_view`.
"""

from __future__ import annotations

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
from waveplan.pricing.errors import ConfigError, bad
from waveplan.pricing.fsdp import FRAMEWORKS, build_fsdp_model
from waveplan.pricing.fsdp.model import for_step
from waveplan.pricing.geometry import ModelGeometry
from waveplan.pricing.hf_config import load_hf_config
from waveplan.pricing.lora import LoraConfig, LoraSlot
from waveplan.pricing.model import DEFAULT_HEAD, DEFAULT_SAFETY, PricingModel
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.presets import load_preset
from waveplan.pricing.step import Request, Step, load_step
from waveplan.pricing.time_model import WaveTimeModel, check_seconds, wave_work
from waveplan.pricing.wave_pricer import WavePricer
from waveplan.search import (
    DEFAULT_PACKER,
    DEFAULT_SEED,
    PackerKind,
    SearchOptions,
    SearchPricer,
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
                    moe_load: float | None = None, misses_path: str | os.PathLike | None = None,
                    framework: str = "megatron", fsdp: int = 1, attn: str = "flash",
                    reshard_after_forward: bool = True, ulysses: int = 1) -> Planner:
        """A planner for a bundled preset; LoRA is one slot 'default' of `lora_rank` on every
        linear layer unless `lora` is given. `moe_load` (opt-in): the busiest EP rank's routed
        rows over rows x top_k that the caller guarantees (`pricing.moe_terms.busiest_rank_load`;
        default: the worst case any router can produce). `etp`: Megatron's
        expert_tensor_parallel_size (None: its default, `tp`). `framework="fsdp"`: as in
        `from_hf_config`."""
        if framework != "megatron":
            return cls._fsdp(load_preset(name), framework=framework, tp=tp, cp=cp, pp=pp, ep=ep,
                             sequence_parallel=sequence_parallel, recompute=recompute,
                             lora=lora or LoraConfig(slots=(LoraSlot(rank=lora_rank),)),
                             backend=backend, safety=safety, profiles_path=profiles_path, fsdp=fsdp,
                             attn=attn, reshard_after_forward=reshard_after_forward, ulysses=ulysses,
                             misses_path=misses_path, head=head)
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
                       as_family: str | None = None,
                       framework: str = "megatron", fsdp: int = 1, attn: str = "flash",
                       reshard_after_forward: bool = True, ulysses: int = 1) -> Planner:
        """A planner for a Hugging Face config: a config.json, a checkpoint directory, its dict
        or a `transformers` config object (`pricing.hf_config.load_hf_config`; `as_family`
        opts an unsupported model_type into a supported family's reading, conservatively);
        the other arguments as `from_preset`. `framework="fsdp"`: the model as Hugging Face
        transformers with PEFT LoRA runs it under FSDP2 (`pricing.fsdp`): `fsdp` the shard group
        size, `attn` flash/sdpa/eager, `recompute` full (gradient checkpointing) or none,
        `ulysses` veRL's Ulysses size, `head` transformers (default), verl, verl-chunked or
        verl-fused;
        TP/CP/PP/EP refused."""
        geometry = load_hf_config(config, name=name, as_family=as_family)
        if framework != "megatron":
            return cls._fsdp(geometry, framework=framework, tp=tp, cp=cp, pp=pp, ep=ep,
                             sequence_parallel=sequence_parallel, recompute=recompute,
                             lora=lora or LoraConfig(slots=(LoraSlot(rank=lora_rank),)),
                             backend=backend, safety=safety, profiles_path=profiles_path, fsdp=fsdp,
                             attn=attn, reshard_after_forward=reshard_after_forward, ulysses=ulysses,
                             misses_path=misses_path, head=head)
        return cls(geometry=geometry,
                   parallel=ParallelLayout(tp=tp, cp=cp, pp=pp, ep=ep, sequence_parallel=sequence_parallel,
                                           etp=etp),
                   recompute=recompute, lora=lora or LoraConfig(slots=(LoraSlot(rank=lora_rank),)),
                   backend=backend, head=head, safety=safety, profiles_path=profiles_path,
                   moe_load=moe_load, misses_path=misses_path)

    @classmethod
    def _fsdp(cls, geometry: ModelGeometry, *, framework: str, tp: int, cp: int, pp: int, ep: int,
              sequence_parallel: bool, recompute, lora: LoraConfig, backend: str, safety: float,
              profiles_path, fsdp: int, attn: str, reshard_after_forward: bool,
              ulysses: int, misses_path: str | os.PathLike | None = None,
              head: str = DEFAULT_HEAD, remove_padding: bool = True,
              entropy_checkpointing: bool = False, liger: bool = False) -> Planner:
        """A planner for the fsdp framework (`pricing.fsdp.build_fsdp_model`); `head` the loss
        (`pricing.fsdp.verl_head.fsdp_head`: Megatron's default means transformers'); veRL's
        `use_remove_padding`, `entropy_checkpointing` and `use_liger` as `pricing.fsdp.FsdpLayout`."""
        from waveplan.pricing.fsdp.verl_head import fsdp_head

        if framework not in FRAMEWORKS:
            raise bad(ConfigError, "framework", framework, f"must be one of {', '.join(FRAMEWORKS)}")
        if (tp, cp, pp, ep, sequence_parallel) != (1, 1, 1, 1, False):
            raise bad(ConfigError, "framework", framework,
                      "FSDP shards parameters only: tp, cp, pp, ep must be 1 and sequence_parallel off")
        mode = recompute.mode.value if isinstance(recompute, Recompute) else str(recompute)
        if mode not in ("full", "none"):
            raise bad(ConfigError, "recompute", mode, "under FSDP: full (gradient checkpointing) or none")
        # sdpa/eager: a provisional S x S row count until `plan` prices them for its budget
        model = build_fsdp_model(geometry, fsdp=fsdp, attn=attn, checkpointing=mode == "full",
                                 reshard_after_forward=reshard_after_forward, lora=lora,
                                 backend=backend, safety=safety, ulysses=ulysses,
                                 head=fsdp_head(head), remove_padding=remove_padding,
                                 entropy_checkpointing=entropy_checkpointing, liger=liger,
                                 attn_rows=0 if attn == "flash" else 65536)
        return cls.from_model(model, profiles_path=profiles_path, misses_path=misses_path)

    @classmethod
    def from_hf_model(cls, model: object, *, backend: str = DEFAULT_BACKEND,
                      safety: float = DEFAULT_SAFETY, fsdp: int | None = None, ulysses: int = 1,
                      head: str = DEFAULT_HEAD,
                      profiles_path: str | os.PathLike | None = None,
                      misses_path: str | os.PathLike | None = None, remove_padding: bool = True,
                      entropy_checkpointing: bool = False, liger: bool = False) -> Planner:
        """A planner for a live Hugging Face transformers model under FSDP2 (framework "fsdp"):
        PEFT-wrapped, possibly `fully_shard`ed. Geometry from its config, LoRA slots and ranks
        from its PEFT adapters, attention from `config._attn_implementation`, checkpointing from
        `is_gradient_checkpointing`, the shard group from its sharded parameters' device mesh
        (`fsdp` overrides it, e.g. before sharding) (`pricing.fsdp.live.read_live_model`);
        `ulysses`: veRL's Ulysses sequence parallel size, `head` the loss (transformers, verl,
        verl-chunked, verl-fused): a live model carries neither; nor does it carry veRL's
        `use_remove_padding`, `entropy_checkpointing` and `use_liger` (`pricing.fsdp.FsdpLayout`)."""
        from waveplan.pricing.fsdp.live import read_live_model

        live = read_live_model(model)
        return cls._fsdp(load_hf_config(live["config"]), framework="fsdp", tp=1, cp=1, pp=1, ep=1,
                         sequence_parallel=False,
                         recompute="full" if live["checkpointing"] else "none", lora=live["lora"],
                         backend=backend, safety=safety, profiles_path=profiles_path,
                         fsdp=live["fsdp"] if fsdp is None else fsdp, attn=live["attn"],
                         reshard_after_forward=True, ulysses=ulysses, misses_path=misses_path,
                         head=head, remove_padding=remove_padding,
                         entropy_checkpointing=entropy_checkpointing, liger=liger)

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

    def pricer(self, step: Step, *, model: PricingModel | None = None) -> WavePricer:
        """The step's pricer with the learned profiles applied: the plain `WavePricer` while
        the planner has none, else one that prices through them (`adjust`) with its envelope
        scaled by their largest ratio. `model`: price with it instead of the planner's own,
        under the planner's profiles (`planner.ep_peers`: the same model with its routed rows
        raised to the EP peers' calls)."""
        model = self._model if model is None else model
        if not len(self._store):
            return WavePricer(step=step, model=model)
        adjust = ProfileAdjust(store=self._store, config=self._config, safety=model.safety)
        return WavePricer(step=step, model=model, adjust=adjust,
                          envelope_scale=self._store.max_ratio(self._config))

    @staticmethod
    def _search_view(pricer: WavePricer) -> SearchPricer:
        """What the search may use of the step's pricer: every capability, but with profiles
        not the fast admitted path (a profile prices from the full breakdown, so the search
        keeps the full prices it computes instead of pricing each wave twice)."""
        view = SearchPricer.of(pricer)
        return view if pricer.adjust is None else view.full_prices_only()

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
        (`search.default_time_budget_ms`, 20 ms up to 100 requests, 0.2 ms a request above;
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
        # the fsdp framework: sequences run unshared, S x S attention terms priced for the budget
        model, step = for_step(self._model, step, budget)
        with CompileClock() as warm_clock:
            # the first plan of a process compiles (or loads) every kernel, in parallel
            # worker processes when cold (their compile time: `wait_s`)
            warm = ensure_warm(Planner)
        wait_s = warm.wait_s if warm is not None else 0.0
        t0 = time.perf_counter()
        with CompileClock() as clock:
            pricer = self.pricer(step, model=model)
            # the search charges the earlier waves' RoPE cache entries (the pricer's
            # `earlier_entries`, search.earlier) and reports the bound it packed against
            result = pack(step, self._search_view(pricer), budget_bytes=budget, options=options)
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
