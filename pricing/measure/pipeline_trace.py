"""Pipeline traces on the CPU: Megatron-core's own 1F1B schedule over gloo, every stage's peak
and when it happened (`trace_pipeline`).
See docs/measurement.md#pipeline-trace.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

from ..errors import ConfigError, bad
from ..geometry import MlpKind, ModelGeometry
from ..parallel import ParallelLayout, Recompute
from ..pipeline import check_schedule
from .gloo_launch import spawn
from .multirank import DEFAULT_TIMEOUT_S, padded_lens, spec_geometry

COUNTED = ("live untyped storages created by aten ops during the pipeline step on each rank "
           "(real CPU tensors, gloo p2p), above the stage's weights and the micro-batches' inputs")


@dataclass(frozen=True)
class StageRankPeak:
    """One rank's peak over the schedule, in bytes above its `baseline_bytes`.

    `peak_at`: (micro-batch, phase) when the peak was reached; `phases`: the peak of every
    (micro-batch, phase) in the order the schedule ran them."""

    rank: int
    stage: int
    tp_rank: int
    layers: tuple[int, int]
    peak_bytes: int
    peak_at: tuple[int, str]
    baseline_bytes: int
    phases: tuple[tuple[int, str, int], ...]
    loss_sum: float = field(default=0.0, compare=False)

    def to_dict(self) -> dict:
        """Deterministic fields only (no loss)."""
        return {"rank": self.rank, "stage": self.stage, "tp_rank": self.tp_rank,
                "layers": list(self.layers), "peak_bytes": self.peak_bytes,
                "peak_at": {"microbatch": self.peak_at[0], "phase": self.peak_at[1]},
                "baseline_bytes": self.baseline_bytes,
                "phases": [[m, ph, b] for m, ph, b in self.phases]}


@dataclass(frozen=True)
class PipelineTrace:
    """Every rank's peak of one pipeline step; `stage_peaks`: per stage, its busiest rank."""

    layout: ParallelLayout
    ranks: tuple[StageRankPeak, ...]
    waves: tuple[tuple[int, ...], ...]
    num_layers: int
    model_layers: int
    recompute: dict
    lora_rank: int | None
    schedule: str = "1f1b"
    counted: str = COUNTED
    notes: tuple[str, ...] = ()

    @property
    def stage_peaks(self) -> tuple[StageRankPeak, ...]:
        """Each stage's busiest rank (the lowest rank on a tie), stage by stage."""
        out = []
        for s in range(self.layout.pp):
            mine = [r for r in self.ranks if r.stage == s]
            out.append(max(mine, key=lambda r: (r.peak_bytes, -r.rank)))
        return tuple(out)

    def to_dict(self) -> dict:
        return {"layout": self.layout.to_dict(), "schedule": self.schedule,
                "waves": [list(w) for w in self.waves], "num_layers": self.num_layers,
                "model_layers": self.model_layers, "recompute": self.recompute,
                "lora_rank": self.lora_rank, "device": "cpu", "packed": "thd",
                "counted": self.counted, "notes": list(self.notes),
                "stages": [{"stage": r.stage, "rank": r.rank, "layers": list(r.layers),
                            "peak_bytes": r.peak_bytes,
                            "peak_at": {"microbatch": r.peak_at[0], "phase": r.peak_at[1]}}
                           for r in self.stage_peaks],
                "ranks": [r.to_dict() for r in self.ranks]}


def _check(geometry: ModelGeometry, layout: ParallelLayout, waves, num_layers, timeout_s,
           virtual_stages: int = 1):
    check_schedule(virtual_stages, layout.pp)
    if layout.pp < 2:
        raise bad(ConfigError, "parallel.pp", layout.pp, "a pipeline trace needs pp >= 2")
    if layout.cp > 1 or layout.ep > 1 or layout.expert_tp != layout.tp:
        raise bad(ConfigError, "parallel", layout.to_dict(),
                  "pipeline traces run TP (and SP) x PP only (CP, EP and an expert TP other than TP: "
                  "PP = 1 traces)")
    layout.validate_for(geometry)
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int)
                                   or num_layers <= 0):
        raise bad(ConfigError, "num_layers", num_layers, "must be a positive integer")
    n = geometry.num_layers if num_layers is None else min(num_layers, geometry.num_layers)
    if n < layout.pp:
        raise bad(ConfigError, "num_layers", n, f"needs at least one layer per stage (pp={layout.pp})")
    layers = geometry.layers[:n]
    if any(s.mlp == MlpKind.MOE for s in layers):
        raise bad(ConfigError, "geometry", geometry.name, "pipeline traces run dense layers only")
    waves = [tuple(w) for w in waves]
    if not waves or any(not w or any(isinstance(x, bool) or not isinstance(x, int) or x <= 0
                                     for x in w) for w in waves):
        raise bad(ConfigError, "waves", waves, "must be a non-empty list of non-empty lists of "
                  "positive integers (one micro-batch per wave)")
    if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
        raise bad(ConfigError, "timeout_s", timeout_s, "must be a positive number of seconds")
    return n, waves


def pipeline_spec(geometry: ModelGeometry, *, layout: ParallelLayout, waves,
                  num_layers: int | None = None, recompute: Recompute | None = None,
                  lora_rank: int | None = 16, timeout_s: float = DEFAULT_TIMEOUT_S,
                  virtual_stages: int = 1) -> dict:
    """What every rank process of a pipeline trace reads (`trace_pipeline_rank`): the checked
    inputs, each sequence padded to the layout's row multiple. `virtual_stages` > 1 (the
    interleaved schedule) is refused (`pipeline.check_schedule`). O(sequences)."""
    n, waves = _check(geometry, layout, waves, num_layers, timeout_s, virtual_stages)
    recompute = recompute or Recompute()
    return {"pipeline": True, "geometry": geometry.to_dict(), "extra": dict(geometry.extra or {}),
            "num_layers": n, "layout": layout.to_dict(), "timeout_s": float(timeout_s),
            "jobs": [{"waves": [list(padded_lens(w, layout)) for w in waves],
                      "recompute": recompute.to_dict(), "lora_rank": lora_rank}]}


def trace_pipeline(geometry: ModelGeometry, *, layout: ParallelLayout, waves,
                   num_layers: int | None = None, recompute: Recompute | None = None,
                   lora_rank: int | None = 16, timeout_s: float = DEFAULT_TIMEOUT_S,
                   virtual_stages: int = 1) -> PipelineTrace:
    """Run `waves` (each a list of sequence lengths: one micro-batch) through Megatron-core's
    1F1B schedule on TP x PP gloo ranks; see the module doc. Each sequence is padded to the
    layout's row multiple."""

    spec = pipeline_spec(geometry, layout=layout, waves=waves, num_layers=num_layers,
                         recompute=recompute, lora_rank=lora_rank, timeout_s=timeout_s,
                         virtual_stages=virtual_stages)
    n, waves = _check(geometry, layout, waves, num_layers, timeout_s)
    padded = [padded_lens(w, layout) for w in waves]
    notes = []
    if n < geometry.num_layers:
        notes.append(f"layer count reduced: traced {n} of {geometry.num_layers} layers")
    if padded != waves:
        notes.append(f"each sequence padded to a multiple of {layout.row_multiple} rows")
    recompute = recompute or Recompute()
    size = layout.tp * layout.pp
    per_rank = spawn(spec, size, timeout_s, entry=f"{__name__}:trace_pipeline_rank")
    ranks = []
    for r in range(size):
        d = per_rank[r][0]
        ranks.append(StageRankPeak(
            rank=d["rank"], stage=d["stage"], tp_rank=d["tp_rank"], layers=tuple(d["layers"]),
            peak_bytes=d["peak_bytes"], peak_at=tuple(d["peak_at"]),
            baseline_bytes=d["baseline_bytes"], phases=tuple(tuple(p) for p in d["phases"]),
            loss_sum=d["loss_sum"]))
    return PipelineTrace(layout=layout, ranks=tuple(ranks), waves=tuple(padded), num_layers=n,
                         model_layers=geometry.num_layers, recompute=recompute.to_dict(),
                         lora_rank=lora_rank, notes=tuple(notes))


def pipeline_record(trace: PipelineTrace, geometry: ModelGeometry, *,
                    model: str | None = None) -> dict:
    """The JSON Lines record of a pipeline trace: `{"cell": {...}, "trace": trace.to_dict()}`;
    the cell names the model (inline `geometry` unless `model` names a preset), traced layer
    count, recompute mode, LoRA rank, waves and layout. Deterministic: bytes and shapes only."""
    cell: dict = {"model": model or geometry.name}
    if model is None:
        cell["geometry"] = geometry.to_dict()
    cell.update(num_layers=trace.num_layers, recompute=trace.recompute["mode"],
                lora_rank=trace.lora_rank or 0, waves=[list(w) for w in trace.waves],
                layout=trace.layout.to_dict(), schedule=trace.schedule)
    return {"cell": cell, "trace": trace.to_dict()}


# --- inside a rank process -----------------------------------------------------------------


def _labelled_tracker_class():
    from .trace import _tracker_class

    base = _tracker_class()

    class LabelledTracker(base):
        """`StorageTracker` that also keeps the label (micro-batch, phase) current when the
        peak was reached, and each label's own peak."""

        def __init__(self) -> None:
            super().__init__()
            self.label = (-1, "start")
            self.peak_at = self.label
            self.by_label: dict = {}

        def _track(self, t) -> None:
            before = self.peak
            super()._track(t)
            if self.peak > before:
                self.peak_at = self.label
            if self.current > self.by_label.get(self.label, -1):
                self.by_label[self.label] = self.current

        def set_label(self, label) -> None:
            self.label = label
            if self.current > self.by_label.get(label, -1):
                self.by_label[label] = self.current

    return LabelledTracker


def trace_pipeline_rank(spec: dict) -> list[dict]:
    """This rank's results, one per job (`pipeline_spec`), in a process whose gloo group
    (TP x PP ranks) is initialised (`gloo_launch._rank_main` does it)."""

    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    from .megatron_shim import install_pipeline_shim, shim_device

    install_pipeline_shim()
    layout = ParallelLayout(**spec["layout"])
    ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp,
                                 pipeline_model_parallel_size=layout.pp,
                                 create_gloo_process_groups=False)
    with shim_device("cpu"):
        mrandom.model_parallel_cuda_manual_seed(1234)
    geometry = spec_geometry(spec)
    return [_run_job(torch, geometry, layout, spec, job) for job in spec["jobs"]]


def _run_job(torch, geometry: ModelGeometry, layout: ParallelLayout, spec: dict, job: dict) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules

    from . import thd
    from .megatron_build import build_gpt
    from .multirank import rank_inputs, standard_strides
    from .trace import storage_bytes

    waves = [[int(n) for n in w] for w in job["waves"]]
    recompute = Recompute(**{k: (tuple(v) if k == "modules" else v)
                             for k, v in job["recompute"].items()})
    stage, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    n = spec["num_layers"]
    lo, hi = stage * n // pp, (stage + 1) * n // pp
    tracker = _labelled_tracker_class()()
    with contextlib.ExitStack() as stack:
        stack.enter_context(thd.rope_patch())
        model = build_gpt(geometry, num_layers=n, device="cpu", lora_rank=job["lora_rank"],
                          recompute=recompute, layout=layout,
                          seq_len=max(sum(w) for w in waves), perform_initialization=True)
        model.config.variable_seq_lengths = True
        model.config.deallocate_pipeline_outputs = True
        if model.pre_process:
            model.embedding.register_forward_hook(standard_strides, prepend=True)
        model.train()
        params = list(model.parameters()) + list(model.buffers())
        weights = storage_bytes(params)
        tracker.ignore(params)
        batches = [rank_inputs(torch, w, geometry.vocab, layout, 0) for w in waves]
        inputs = [t for ids, pos, labels, _, cu in batches for t in (ids, pos, labels, cu)]
        base = tracker.ignore(inputs)
        counter = {"forward": 0, "backward": 0}
        losses: list = []
        original_forward, original_backward = schedules.forward_step, schedules.backward_step

        def labelled(phase, original):
            """`original` (the schedule's forward_step or backward_step), labelling the
            tracker with (micro-batch, phase) while it runs and (micro-batch, after phase)
            once it returns."""
            def step(*args, **kwargs):
                i = counter[phase]
                tracker.set_label((i, phase))
                out = original(*args, **kwargs)
                counter[phase] += 1
                tracker.set_label((i, f"after {phase}"))
                return out
            return step

        forward_step = labelled("forward", original_forward)
        backward_step = labelled("backward", original_backward)

        def step_func(data_iterator, model):
            ids, pos, labels, packed, _ = next(data_iterator)
            out = model(ids, pos, None, labels=labels if model.post_process else None,
                        packed_seq_params=packed)

            def loss_func(output):
                loss = output.sum()
                losses.append(float(loss.detach().float()))
                return loss, {}

            return out, loss_func

        schedules.forward_step, schedules.backward_step = forward_step, backward_step
        stack.callback(setattr, schedules, "forward_step", original_forward)
        stack.callback(setattr, schedules, "backward_step", original_backward)
        for p in model.parameters():
            p.grad = None
        run = get_forward_backward_func()
        with tracker:
            tracker.reset_peak()
            run(forward_step_func=step_func, data_iterator=iter(batches), model=[model],
                num_microbatches=len(waves), seq_length=max(sum(w) for w in waves),
                micro_batch_size=1, forward_only=False)
        for _, _, _, _, cu in batches:
            thd.forget(cu)
    return {"rank": torch.distributed.get_rank(), "stage": stage,
            "tp_rank": ps.get_tensor_model_parallel_rank(), "layers": [lo, hi],
            "peak_bytes": int(tracker.peak), "peak_at": list(tracker.peak_at),
            "baseline_bytes": int(weights + base),
            "phases": [[m, ph, int(b)] for (m, ph), b in tracker.by_label.items() if m >= 0],
            "loss_sum": sum(losses)}
