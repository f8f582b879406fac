"""Multi-rank traces on the CPU: one process per rank of a TP/SP/CP/EP layout, real Megatron-core
parallel layers and collectives over gloo, every rank's peak (`trace_multirank`).
See docs/measurement.md#multirank.
"""

from __future__ import annotations

import contextlib
import gc
import math
from dataclasses import dataclass, field

from ..errors import ConfigError, bad
from ..geometry import MixerKind, MlpKind, ModelGeometry
from ..parallel import ParallelLayout, Recompute
from .gloo_launch import spawn

ROUTINGS = ("balanced", "router")
DEFAULT_TIMEOUT_S = 1800.0
COUNTED = ("live untyped storages created by aten ops during the step on each rank (real CPU "
           "tensors, gloo collectives), above weights, buffers and inputs")


# --- results -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankPeak:
    """One rank's peaks, in bytes above its `baseline_bytes` (weights, buffers, inputs).

    `rows`: the packed rows this rank ran through the layers' attention (the wave's padded
    rows / CP); under sequence parallelism a rank holds rows / TP of them between layers."""

    rank: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    ep_rank: int
    rows: int
    peak_forward_bytes: int
    peak_backward_bytes: int
    baseline_bytes: int
    decoder_peak_forward_bytes: int | None
    decoder_peak_backward_bytes: int | None
    loss_sum: float
    anatomy: dict | None = field(default=None, compare=False, repr=False)
    max_rss_bytes: int = field(default=0, compare=False)

    @property
    def peak_bytes(self) -> int:
        return max(self.peak_forward_bytes, self.peak_backward_bytes)

    @property
    def decoder_peak_bytes(self) -> int | None:
        if self.decoder_peak_forward_bytes is None:
            return None
        return max(self.decoder_peak_forward_bytes, self.decoder_peak_backward_bytes)

    def to_dict(self) -> dict:
        """Deterministic fields only (no loss, no anatomy)."""
        return {"rank": self.rank, "tp_rank": self.tp_rank, "cp_rank": self.cp_rank,
                "dp_rank": self.dp_rank, "ep_rank": self.ep_rank, "rows": self.rows,
                "peak_forward_bytes": self.peak_forward_bytes,
                "peak_backward_bytes": self.peak_backward_bytes, "peak_bytes": self.peak_bytes,
                "baseline_bytes": self.baseline_bytes,
                "decoder_peak_forward_bytes": self.decoder_peak_forward_bytes,
                "decoder_peak_backward_bytes": self.decoder_peak_backward_bytes,
                "decoder_peak_bytes": self.decoder_peak_bytes}


@dataclass(frozen=True)
class MultiRankTrace:
    """Every rank's peaks of one traced wave, and the busiest rank.

    `busiest_rank`: the rank with the largest `peak_bytes` (the lowest such rank on a tie);
    its peaks are the trace's `peak_*` (what a planner's budget must cover).
    `decoder_busiest_rank`: the same for the decoder-only pass. `to_dict` is a
    `TraceResult.to_dict()`-shaped object (so `waveplan calibrate` can read the record) plus
    `layout`, `world_size`, `routing`, the busiest ranks and `ranks`."""

    layout: ParallelLayout
    ranks: tuple[RankPeak, ...]
    num_layers: int
    model_layers: int
    seq_lens: tuple[int, ...]
    recompute: dict
    lora_rank: int | None
    routing: str
    head: str = "full-native"
    packed: str = "thd"
    counted: str = COUNTED
    notes: tuple[str, ...] = field(default=())
    kernels: str = "torch-cpu"

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def busiest_rank(self) -> int:
        return max(self.ranks, key=lambda r: (r.peak_bytes, -r.rank)).rank

    @property
    def decoder_busiest_rank(self) -> int | None:
        if self.ranks[0].decoder_peak_bytes is None:
            return None
        return max(self.ranks, key=lambda r: (r.decoder_peak_bytes, -r.rank)).rank

    @property
    def busiest(self) -> RankPeak:
        return self.ranks[self.busiest_rank]

    @property
    def peak_bytes(self) -> int:
        return self.busiest.peak_bytes

    @property
    def decoder_peak_bytes(self) -> int | None:
        b = self.decoder_busiest_rank
        return None if b is None else self.ranks[b].decoder_peak_bytes

    def to_dict(self) -> dict:
        b = self.busiest
        d = None if self.decoder_busiest_rank is None else self.ranks[self.decoder_busiest_rank]
        dec = self.decoder_peak_bytes
        return {
            "peak_forward_bytes": b.peak_forward_bytes,
            "peak_backward_bytes": b.peak_backward_bytes,
            "peak_bytes": b.peak_bytes,
            "baseline_bytes": b.baseline_bytes,
            "decoder_peak_forward_bytes": None if d is None else d.decoder_peak_forward_bytes,
            "decoder_peak_backward_bytes": None if d is None else d.decoder_peak_backward_bytes,
            "decoder_peak_bytes": dec,
            "head_bytes": None if dec is None else b.peak_bytes - dec,
            "num_layers": self.num_layers, "model_layers": self.model_layers,
            "tokens": self.tokens, "seq_lens": list(self.seq_lens), "device": "cpu",
            "recompute": self.recompute, "lora_rank": self.lora_rank, "head": self.head,
            "packed": self.packed, "counted": self.counted, "notes": list(self.notes),
            "layout": self.layout.to_dict(), "world_size": self.world_size,
            "routing": self.routing, "busiest_rank": self.busiest_rank,
            "decoder_busiest_rank": self.decoder_busiest_rank,
            "ranks": [r.to_dict() for r in self.ranks],
        } | ({} if self.kernels == "torch-cpu" else {"kernels": self.kernels})


# --- the layout's processes ----------------------------------------------------------------


def rank_world(layout: ParallelLayout) -> ParallelLayout:
    """The layout with the data-parallel size the traced world needs: the smallest DP with
    EP dividing DP x CP. World size = TP x CP x DP (PP must be 1)."""
    dp = layout.ep // math.gcd(layout.ep, layout.cp)
    return ParallelLayout(tp=layout.tp, cp=layout.cp, pp=layout.pp, ep=layout.ep, dp=dp,
                          sequence_parallel=layout.sequence_parallel, etp=layout.etp)


def padded_lens(seq_lens, layout: ParallelLayout) -> tuple[int, ...]:
    """Each sequence padded to the layout's row multiple (2 x CP, times TP under SP)."""
    m = layout.row_multiple
    return tuple(-(-int(n) // m) * m for n in seq_lens)


@dataclass(frozen=True)
class TraceJob:
    """One wave to trace on a layout's ranks."""

    seq_lens: tuple[int, ...]
    recompute: Recompute = field(default_factory=Recompute)
    lora_rank: int | None = 16

    def __post_init__(self) -> None:
        lens = tuple(self.seq_lens)
        if not lens or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in lens):
            raise bad(ConfigError, "seq_lens", list(lens), "must be a non-empty list of positive integers")
        object.__setattr__(self, "seq_lens", lens)
        if self.lora_rank is not None and (isinstance(self.lora_rank, bool)
                                           or not isinstance(self.lora_rank, int)
                                           or self.lora_rank <= 0):
            raise bad(ConfigError, "lora_rank", self.lora_rank, "must be a positive integer or None")


def _check(geometry: ModelGeometry, layout: ParallelLayout, num_layers, routing, timeout_s):
    if layout.pp != 1:
        raise bad(ConfigError, "parallel.pp", layout.pp, "multi-rank traces run PP = 1 (a "
                  "pipeline runs its schedule: pipeline_trace.trace_pipeline, trace --pp)")
    layout.validate_for(geometry)
    if routing not in ROUTINGS:
        raise bad(ConfigError, "routing", routing, f"must be one of {', '.join(ROUTINGS)}")
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int)
                                   or num_layers <= 0):
        raise bad(ConfigError, "num_layers", num_layers, "must be a positive integer")
    layers = geometry.layers if num_layers is None else geometry.layers[:num_layers]
    if layout.cp > 1 and any(s.mixer == MixerKind.GDN for s in layers):
        raise bad(ConfigError, "parallel.cp", layout.cp,
                  "context parallelism is traced for attention layers only (GatedDeltaNet has "
                  "no CP on the CPU)")
    if layout.ep > 1 and not any(s.mlp == MlpKind.MOE for s in layers):
        raise bad(ConfigError, "parallel.ep", layout.ep, "EP > 1 needs a MoE layer in the traced layers")
    if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
        raise bad(ConfigError, "timeout_s", timeout_s, "must be a positive number of seconds")
    return layers


def trace_multirank(geometry: ModelGeometry, *, layout: ParallelLayout, seq_lens,
                    num_layers: int | None = None, recompute: Recompute | None = None,
                    lora_rank: int | None = 16, routing: str = "balanced",
                    decoder_only: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S,
                    anatomy: bool = False, anatomy_top: int = 40,
                    kernels: str = "torch-cpu") -> MultiRankTrace:
    """Trace one wave of `seq_lens` sequences on every rank of `layout`; see the module doc.
    Spawns TP x CP x DP processes (`rank_world`). `anatomy=True` also records, per rank and
    pass, what is live at the peak (`RankPeak.anatomy`, see `live_anatomy`): its `anatomy_top`
    largest groups, the rest summed in one row. `kernels="te-gpu"`: the fused GPU kernels'
    allocation models (`gpu_kernels`) in place of torch's ops."""
    job = TraceJob(seq_lens=tuple(int(n) for n in seq_lens), recompute=recompute or Recompute(),
                   lora_rank=lora_rank)
    return trace_multirank_batch(geometry, layout=layout, jobs=[job], num_layers=num_layers,
                                 routing=routing, decoder_only=decoder_only,
                                 timeout_s=timeout_s, anatomy=anatomy, anatomy_top=anatomy_top,
                                 kernels=kernels)[0]


def trace_multirank_batch(geometry: ModelGeometry, *, layout: ParallelLayout, jobs,
                          num_layers: int | None = None, routing: str = "balanced",
                          decoder_only: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S,
                          anatomy: bool = False, anatomy_top: int = 40,
                          kernels: str = "torch-cpu") -> list[MultiRankTrace]:
    """`trace_multirank` for several waves on one layout, in one set of rank processes (the
    model is rebuilt per job; process start and imports are paid once). O(jobs) traces."""
    jobs = list(jobs)
    if not jobs or not all(isinstance(j, TraceJob) for j in jobs):
        raise bad(ConfigError, "jobs", jobs, "must be a non-empty list of TraceJob")
    layers = _check(geometry, layout, num_layers, routing, timeout_s)
    from .trace import KERNELS

    if kernels not in KERNELS:
        raise bad(ConfigError, "kernels", kernels, f"must be one of {', '.join(KERNELS)}")
    world = rank_world(layout)
    size = world.tp * world.cp * world.dp
    notes = []
    if kernels == "te-gpu":
        notes.append("te-gpu kernel set: allocation models of TE RMSNorm, flash attention "
                     "(varlen, also as the CP ring's step kernel), TE fused RoPE, the fused SwiGLU/GeGLU, the experts' grouped GEMM "
                     "and FLA's gated delta rule where the model has them "
                     "(pricing/measure/gpu_kernels.py)")
    if num_layers is not None and num_layers < geometry.num_layers:
        notes.append(f"layer count reduced: traced {len(layers)} of {geometry.num_layers} layers")
    has_moe = any(s.mlp == MlpKind.MOE for s in layers)
    if has_moe:
        notes.append("MoE routing: " + ("balanced router (every expert the same load)"
                                        if routing == "balanced" else
                                        "Megatron's top-k router on random weights"))
    if layout.cp > 1:
        notes.append("context parallelism: ring attention allocation model of Transformer "
                     "Engine's P2P kernel (pricing/measure/ring_attention.py)")
    if world.dp > 1:
        notes.append(f"DP={world.dp} ranks added for EP={layout.ep}: each runs the same wave")
    packed = not any(s.mixer == MixerKind.GDN for s in layers)
    if not packed:
        notes.append("sequences concatenated into one causal row (batch 1, no THD): "
                     "GatedDeltaNet takes no packed input")
    spec = {
        "geometry": geometry.to_dict(), "extra": dict(geometry.extra or {}),
        "num_layers": len(layers), "layout": world.to_dict(), "routing": routing,
        "decoder_only": bool(decoder_only), "timeout_s": float(timeout_s),
        "anatomy": bool(anatomy), "anatomy_top": int(anatomy_top), "packed": packed,
        "kernels": kernels,
        "jobs": [{"seq_lens": list(padded_lens(j.seq_lens, layout)),
                  "recompute": j.recompute.to_dict(), "lora_rank": j.lora_rank} for j in jobs],
    }
    per_rank = spawn(spec, size, timeout_s, entry=f"{__name__}:trace_rank")
    out = []
    for k, job in enumerate(jobs):
        lens = padded_lens(job.seq_lens, layout)
        job_notes = list(notes)
        if lens != job.seq_lens:
            job_notes.append(f"each sequence padded to a multiple of {layout.row_multiple} rows")
        ranks = tuple(RankPeak(**per_rank[r][k]) for r in range(size))
        out.append(MultiRankTrace(
            layout=world, ranks=ranks, num_layers=len(layers), model_layers=geometry.num_layers,
            seq_lens=lens, recompute=job.recompute.to_dict(), lora_rank=job.lora_rank,
            routing=routing if has_moe else "none", packed="thd" if packed else "concatenated",
            notes=tuple(job_notes), kernels=kernels))
    return out


def spec_geometry(spec: dict) -> ModelGeometry:
    """The geometry a rank process was sent: `spec["geometry"]` with `spec["extra"]` (the
    live-build switches, e.g. qk_layernorm) put back."""
    geometry = ModelGeometry.from_dict(spec["geometry"])
    if spec["extra"]:
        import dataclasses

        geometry = dataclasses.replace(geometry, extra=dict(spec["extra"]))
    return geometry


def trace_rank(spec: dict) -> list[dict]:
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    from .megatron_shim import install_cpu_shim, shim_device

    install_cpu_shim()
    lay = spec["layout"]
    layout = ParallelLayout(**lay)
    ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp,
                                 pipeline_model_parallel_size=1,
                                 context_parallel_size=layout.cp,
                                 expert_model_parallel_size=layout.ep,
                                 expert_tensor_parallel_size=layout.etp,
                                 create_gloo_process_groups=False)
    with shim_device("cpu"):
        mrandom.model_parallel_cuda_manual_seed(1234)
    geometry = spec_geometry(spec)
    ranks = {"tp_rank": ps.get_tensor_model_parallel_rank(),
             "cp_rank": ps.get_context_parallel_rank(),
             "dp_rank": ps.get_data_parallel_rank(),
             "ep_rank": ps.get_expert_model_parallel_rank()}
    out = []
    for job in spec["jobs"]:
        res = _trace_job(torch, geometry, layout, spec, job)
        out.append(dict(res, rank=torch.distributed.get_rank(), **ranks))
    return out


def rank_inputs(torch, lens, vocab, layout: ParallelLayout, cp_rank: int, packed: bool = True):
    """Token ids, positions, labels and packed-sequence parameters of this rank: the whole
    wave (THD, global cu_seqlens) or, under CP, this rank's two chunks of each sequence
    (positions and RoPE continue at each chunk's global offset). `packed=False`: the wave
    concatenated into one causal row (positions 0..rows-1, no packed-sequence parameters)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from . import thd

    total = sum(lens)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, total), generator=gen)
    labels = torch.randint(0, vocab, (1, total), generator=gen)
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    if not packed:
        cu = torch.tensor(bounds, dtype=torch.int32)
        return ids.contiguous(), torch.arange(total).unsqueeze(0), labels.contiguous(), None, cu
    if layout.cp > 1:
        from .ring_attention import cp_split

        split = cp_split(lens, layout.cp, cp_rank)
        index = torch.tensor(split.global_index, dtype=torch.long)
        ids, labels = ids[:, index], labels[:, index]
        pos = torch.cat([torch.arange(off, off + (b - a)) for a, b, off in split.segments]).unsqueeze(0)
        tree = [(a, b, None if off == 0 else (0, off)) for a, b, off in split.segments]
    else:
        pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
        tree = None
    cu = torch.tensor(bounds, dtype=torch.int32)
    thd.register(cu, bounds, tree)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    return ids.contiguous(), pos, labels.contiguous(), params, cu


def _trace_job(torch, geometry: ModelGeometry, layout: ParallelLayout, spec: dict, job: dict) -> dict:
    """One job on this rank: the full pass and (optionally) the decoder-only pass."""
    from megatron.core import parallel_state as ps

    from . import thd
    from .megatron_build import build_gpt
    from .trace import _balanced_router, _seed_function, _tracker_class, storage_bytes

    lens = [int(n) for n in job["seq_lens"]]
    recompute = Recompute(**{k: (tuple(v) if k == "modules" else v)
                             for k, v in job["recompute"].items()})
    layers = geometry.layers[:spec["num_layers"]]
    has_moe = any(s.mlp == MlpKind.MOE for s in layers)
    cp_rank = ps.get_context_parallel_rank()
    if spec["anatomy"]:
        from .live_anatomy import anatomy_tracker_class, module_stack

        tracker_cls = anatomy_tracker_class()
    else:
        tracker_cls = _tracker_class()
    stack_names: list[str] = []
    anatomy: dict = {}
    results: dict = {}
    loss_sum = 0.0
    with contextlib.ExitStack() as stack:
        stack.enter_context(thd.rope_patch())
        if has_moe and spec["routing"] == "balanced":
            stack.enter_context(_balanced_router())
        model = build_gpt(geometry, num_layers=len(layers), device="cpu",
                          lora_rank=job["lora_rank"], recompute=recompute, layout=layout,
                          seq_len=max(lens), perform_initialization=True)
        if layout.cp > 1:
            from .ring_attention import install_ring_attention

            install_ring_attention(model)
        if spec.get("kernels", "torch-cpu") == "te-gpu":
            from .gpu_kernels import te_gpu_kernels

            stack.enter_context(te_gpu_kernels(model))
        if spec["anatomy"]:
            stack.enter_context(module_stack(model, stack_names))
        if model.pre_process:
            model.embedding.register_forward_hook(standard_strides, prepend=True)
        if not spec.get("packed", True):
            # one causal row (b = 1): the layers' transposes keep b = 1 strides
            for module in model.modules():
                if type(module).__name__.endswith("Linear"):
                    module.register_forward_pre_hook(_standard_input_strides)
                    module.register_forward_hook(_standard_grad_strides)
        model.train()
        params = list(model.parameters()) + list(model.buffers())
        weights = storage_bytes(params)
        runs = [("full", True)] + ([("decoder", False)] if spec["decoder_only"] else [])
        for name, full_head in runs:
            gc.collect()   # as `trace.trace_wave`: the collector's timing independent of the past
            tracker = tracker_cls()
            tracker.ignore(params)
            if spec["anatomy"]:
                tracker.stack = stack_names
            for p in model.parameters():
                p.grad = None
            peaks = {}
            with tracker:
                # as the single-rank tracer counts: the inputs are made inside the tracker
                # (so they stay in its live sum) and the peak starts after them
                ids, pos, labels, packed, cu = rank_inputs(torch, lens, geometry.vocab, layout,
                                                       cp_rank, spec.get("packed", True))
                base = tracker.ignore([ids, pos, labels, cu])
                tracker.reset_peak()
                if full_head:
                    out = model(ids, pos, None, labels=labels, packed_seq_params=packed)
                    loss = out.sum()
                    del out
                else:
                    model.post_process = False
                    try:
                        out = model(ids, pos, None, packed_seq_params=packed)
                    finally:
                        model.post_process = True
                    loss = _seed_function().apply(out)
                    del out
                peaks["forward"] = tracker.peak
                if spec["anatomy"]:
                    anatomy[name] = {"forward": tracker.peak_groups(spec.get("anatomy_top", 40))}
                    tracker.phase = "backward"
                tracker.reset_peak()
                loss.backward()
                peaks["backward"] = tracker.peak
                if spec["anatomy"]:
                    anatomy[name]["backward"] = tracker.peak_groups(spec.get("anatomy_top", 40))
            if full_head:
                loss_sum = float(loss.detach().float())
            del loss
            peaks["baseline"] = weights + base
            results[name] = peaks
            for p in model.parameters():
                p.grad = None
        rows = ids.shape[1]
    full, dec = results["full"], results.get("decoder")
    return {"rows": int(rows),
            "peak_forward_bytes": int(full["forward"]), "peak_backward_bytes": int(full["backward"]),
            "baseline_bytes": int(full["baseline"]),
            "decoder_peak_forward_bytes": None if dec is None else int(dec["forward"]),
            "decoder_peak_backward_bytes": None if dec is None else int(dec["backward"]),
            "loss_sum": loss_sum, "anatomy": anatomy or None,
            "max_rss_bytes": _max_rss_bytes()}


def standard_strides(module, inputs, output):
    """The embedding's output with row-major strides (a forward hook, before LoRA's).

    Megatron transposes the embedding [b, s, h] to [s, b, h] and calls `.contiguous()`, which
    keeps the transposed strides when b = 1. Every activation inherits them, and torch's CPU
    `matmul` cannot fold such an input into one matrix product when a TP shard's weight is
    involved: it broadcasts the weight over the s rows (a rows x out x in copy inside the op,
    gigabytes, uncounted but real, and minutes of work). The copy made here replaces the
    output (the original is released at once), so the counted bytes are unchanged."""
    import torch

    if isinstance(output, torch.Tensor) and output.dim() == 3 and output.shape[1] == 1 \
            and output.stride(1) != output.shape[2]:
        return output.clone(memory_format=torch.contiguous_format)
    return None


def _standard_input_strides(module, args):
    """A linear layer's [s, 1, x] input with row-major strides, as a view (a forward pre-hook,
    on the linears of a wave run as one causal row).

    Megatron's GatedDeltaNet (and the attention's core output) transposes [b, s, x] back to
    [s, b, x] and calls `.contiguous()`, which keeps the transposed strides when b = 1; torch's
    CPU `matmul` then broadcasts a TP shard's weight over the s rows (the copy
    `standard_strides` describes: gigabytes at 2048 rows, enough to kill a rank).
    `squeeze(1).unsqueeze(1)` gives the same storage row-major strides with no copy and a view's
    backward, so the counted bytes are unchanged."""
    view = _row_major_view(args[0]) if args else None
    return None if view is None else (view,) + tuple(args[1:])


def _row_major_view(x):
    """`x` ([s, 1, n]) with row-major strides, as a view; None when it has them already (or
    is not such a tensor)."""
    import torch

    if (not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1] != 1 or x.stride(2) != 1
            or x.stride(0) != x.shape[2] or x.stride(1) == x.shape[2]):
        return None
    return x.squeeze(1).unsqueeze(1)


_GRAD_STRIDES = None


def _standard_grad_strides(module, args, output):
    """A linear layer's output passed through an identity whose backward gives the incoming
    gradient row-major strides as a view (a forward hook, beside `_standard_input_strides`).

    GatedDeltaNet transposes its input projection's output [s, 1, x] to [1, s, x], so the
    gradient reaching the projection's backward has the transposed strides, and its
    `grad_output.matmul(weight)` broadcasts the weight over the s rows as in the forward
    (docs/measurement.md#multirank). The identity's forward is a view and it saves nothing,
    so the counted bytes are unchanged."""
    global _GRAD_STRIDES
    import torch

    if _GRAD_STRIDES is None:
        class GradStrides(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                view = _row_major_view(grad)
                return grad if view is None else view

        _GRAD_STRIDES = GradStrides
    first = output[0] if isinstance(output, tuple) else output
    if not (isinstance(first, torch.Tensor) and first.dim() == 3 and first.shape[1] == 1
            and first.requires_grad):
        return None
    wrapped = _GRAD_STRIDES.apply(first)
    return (wrapped,) + tuple(output[1:]) if isinstance(output, tuple) else wrapped


def _max_rss_bytes() -> int:
    """This process's resident-set high-water mark so far (Linux: ru_maxrss in KiB)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# --- records -------------------------------------------------------------------------------


def trace_record(trace: MultiRankTrace, geometry: ModelGeometry, *, model: str | None = None,
                 step: str | None = None) -> dict:
    """The JSON Lines record of a multi-rank trace, in the form `waveplan calibrate` reads:
    `{"cell": {...}, "trace": trace.to_dict()}`. The cell names the model (`model`, a preset
    name: the shapes then come from the preset; otherwise the shapes are inline as
    `geometry`), the traced layer count, recompute mode, LoRA rank, padded sequence lengths,
    the layout and the routing; `step` (a step file's name) is kept when given. Deterministic:
    bytes and shapes only."""
    cell: dict = {"model": model or geometry.name}
    if model is None:
        cell["geometry"] = geometry.to_dict()
    cell.update(num_layers=trace.num_layers, recompute=trace.recompute["mode"],
                lora_rank=trace.lora_rank or 0, seq_lens=list(trace.seq_lens),
                layout=trace.layout.to_dict(), routing=trace.routing)
    if trace.kernels != "torch-cpu":
        cell["kernels"] = trace.kernels
    if trace.recompute["mode"] == "selective":
        cell["recompute_modules"] = list(trace.recompute["modules"])
    if step is not None:
        cell["step"] = step
    return {"cell": cell, "trace": trace.to_dict()}
