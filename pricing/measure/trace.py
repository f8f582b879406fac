"""One wave's activation peak above the pre-step baseline (weights, buffers, inputs) on a
Megatron-core model, on fake tensors, real CPU tensors or CUDA (`trace_wave`).
See docs/measurement.md#trace.
"""

from __future__ import annotations

import contextlib
import gc
import os
import weakref
from dataclasses import dataclass, field

from ..errors import ConfigError, bad
from ..geometry import MixerKind, MlpKind, ModelGeometry
from ..parallel import ParallelLayout, Recompute
from .thd import packed_params, rope_patch
from .uncounted import ACTIVE as _UNCOUNTED

DEVICES = ("cpu-fake", "cpu", "cuda")
HEADS = ("full-native", "full-te")
KERNELS = ("torch-cpu", "te-gpu")


@dataclass(frozen=True)
class TraceResult:
    """Peaks of one traced wave, in bytes above `baseline_bytes` (what lived before the step).

    `peak_forward_bytes`: max during the forward and the loss; `peak_backward_bytes`: max
    during the backward (it includes what the forward left alive: saved boundaries, the
    loss's saved tensors, adapter gradients as they appear); `peak_bytes` the larger.
    `decoder_peak_*`: the same wave without the output layer and loss (None if not run).
    `head_bytes`: peak minus decoder peak (what the full-native head adds at its peak).
    `kernels`: the kernel set traced ("te-gpu": `gpu_kernels`' allocation models).
    """

    peak_forward_bytes: int
    peak_backward_bytes: int
    peak_bytes: int
    baseline_bytes: int
    decoder_peak_forward_bytes: int | None
    decoder_peak_backward_bytes: int | None
    num_layers: int
    model_layers: int
    tokens: int
    seq_lens: tuple[int, ...]
    device: str
    recompute: dict
    lora_rank: int | None
    head: str
    packed: str
    counted: str
    notes: tuple[str, ...] = field(default=())
    kernels: str = "torch-cpu"

    @property
    def decoder_peak_bytes(self) -> int | None:
        if self.decoder_peak_forward_bytes is None:
            return None
        return max(self.decoder_peak_forward_bytes, self.decoder_peak_backward_bytes)

    @property
    def head_bytes(self) -> int | None:
        dec = self.decoder_peak_bytes
        return None if dec is None else self.peak_bytes - dec

    def to_dict(self) -> dict:
        return {
            "peak_forward_bytes": self.peak_forward_bytes,
            "peak_backward_bytes": self.peak_backward_bytes,
            "peak_bytes": self.peak_bytes,
            "baseline_bytes": self.baseline_bytes,
            "decoder_peak_forward_bytes": self.decoder_peak_forward_bytes,
            "decoder_peak_backward_bytes": self.decoder_peak_backward_bytes,
            "decoder_peak_bytes": self.decoder_peak_bytes,
            "head_bytes": self.head_bytes,
            "num_layers": self.num_layers, "model_layers": self.model_layers,
            "tokens": self.tokens, "seq_lens": list(self.seq_lens), "device": self.device,
            "recompute": self.recompute, "lora_rank": self.lora_rank, "head": self.head,
            "packed": self.packed, "counted": self.counted, "notes": list(self.notes),
        } | ({} if self.kernels == "torch-cpu" else {"kernels": self.kernels})


def _tracker_class():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class StorageTracker(TorchDispatchMode):
        """Live bytes of the untyped storages that aten ops create, and their peak.

        Storages that exist before (registered with `ignore`) are never counted, so views
        of weights cost nothing. A storage is counted once, by its nbytes (updated if an op
        resizes it), and dropped when its Python object dies with the storage. Collectives
        on CPU tensors run on untracked copies (`_staged_collective`), so that a storage
        dies when the traced program drops it, not when gloo's worker thread does.
        """

        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, int] = {}
            self.ignored: dict[int, object] = {}
            self.current = 0
            self.peak = 0

        def ignore(self, tensors) -> int:
            """Mark these tensors' storages as baseline; returns their unique bytes."""
            total = 0
            for t in tensors:
                if t is None:
                    continue
                st = t.untyped_storage()
                key = id(st)
                if key not in self.ignored:
                    self.ignored[key] = weakref.ref(st)
                    total += st.nbytes()
            return total

        def reset_peak(self) -> None:
            self.peak = self.current

        def _drop(self, key: int) -> None:
            self.current -= self.live.pop(key, 0)

        def _track(self, t) -> None:
            if _UNCOUNTED[0]:   # inside `uncounted.uncounted()`
                return
            st = t.untyped_storage()
            key = id(st)
            if key in self.ignored:
                return
            n = st.nbytes()
            old = self.live.get(key)
            if old is None:
                self.live[key] = n
                self.current += n
                weakref.finalize(st, self._drop, key)
            elif old != n:
                self.live[key] = n
                self.current += n - old
            if self.current > self.peak:
                self.peak = self.current

        @staticmethod
        def _call(func, args, kwargs):
            """`func(*args, **kwargs)`; a c10d op on CPU tensors through `_staged_collective`."""
            kwargs = kwargs or {}
            if func.namespace == "c10d" and all(
                    t.device.type == "cpu" for t in tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor)):
                return _staged_collective(func, args, kwargs)
            return func(*args, **kwargs)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = self._call(func, args, kwargs)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._track(t)
            return out

    return StorageTracker


def _staged_collective(func, args, kwargs):
    """Run the c10d op `func` (a collective or point-to-point op on CPU tensors, i.e. gloo's,
    or the fake process group's) on copies of its tensors; the work it returns is wrapped so
    that waiting on it copies the result back into the caller's output tensors (the op's
    first argument, for the c10d ops whose name ends in "_": allreduce_, _allgather_base_,
    _reduce_scatter_base_, alltoall_base_, broadcast_, recv_, ...). The copies are made
    inside the tracker's dispatch, so they are not counted (as gloo's own staging is not);
    the caller's tensors are counted as before, from the op that created them until the
    caller drops them. O(bytes of the op's tensors) copying per collective.

    Why: gloo runs a collective on a worker thread, and the work object that thread runs
    holds the op's tensors (the all-gather output's chunks, the reduce-scatter input) until
    the thread drops it, just *after* it has signalled completion to the caller. When the
    caller drops such a tensor first (Megatron's sequence-parallel all-gather output, right
    after the matmul that used it), the storage died on the worker thread at a moment that
    raced the caller's next allocations, so a pass's peak sometimes held one more [rows, h]
    tensor (a TP2+SP decoder-only peak came out one gathered buffer above the whole
    model's). On copies, nothing the worker thread holds is a counted storage."""
    import torch
    from torch.utils._pytree import tree_leaves, tree_map_only

    copies: dict = {}

    def stage(t):
        c = t.clone()
        copies[id(c)] = (c, t)
        return c

    staged_args = tree_map_only(torch.Tensor, stage, tuple(args))
    staged_kwargs = tree_map_only(torch.Tensor, stage, dict(kwargs))
    back = []
    if func.overloadpacket.__name__.endswith("_") and staged_args:
        back = [(copies[id(c)][1], c) for c in tree_leaves(staged_args[0])
                if isinstance(c, torch.Tensor)]
    out = func(*staged_args, **staged_kwargs)
    del staged_args, staged_kwargs

    def original(x):
        if isinstance(x, torch.Tensor):
            hit = copies.get(id(x))
            return hit[1] if hit is not None and hit[0] is x else x
        if isinstance(x, torch.ScriptObject):   # the op's Work
            return _copy_back_work(x, back)
        return x

    return tree_map_only((torch.Tensor, torch.ScriptObject), original, out)


def _copy_back_work(boxed, back: list):
    """A Work (boxed, as a c10d op returns it) whose `wait` waits on `boxed` and then copies
    each (output, copy) pair of `back` into the output, once (no autograd version bump: the
    op itself writes its output in place without one). The real wait runs with the dispatch
    modes off: what gloo does in it (its reduce-scatter copies its result into the output
    there, on the caller's thread) is its own staging, not counted."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    c10d = torch._C._distributed_c10d
    real = c10d.Work.unbox(boxed)

    def wait(timeout):
        with _disable_current_modes():
            done = real.wait(timeout)
        with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
            for dst, src in back:
                dst.copy_(src)
        back.clear()
        return done

    return c10d.PythonCallbackWork(wait).boxed()


# --- MoE: balanced routing ----------------------------------------------------------------


@contextlib.contextmanager
def _balanced_router():
    """Route token t's j-th choice to expert (t * k + j) mod E, with the router's own
    scores as weights, so every shape is known without data (fake tensors)."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    original = TopKRouter.routing

    def routing(self, logits, *args, **kwargs):
        logits = logits.view(-1, self.config.num_moe_experts)
        tokens, experts = logits.shape
        k = self.topk
        idx = (torch.arange(tokens, device=logits.device).unsqueeze(1) * k
               + torch.arange(k, device=logits.device).unsqueeze(0)) % experts
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        picked = torch.gather(scores, 1, idx)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
        probs = torch.zeros_like(scores).scatter(1, idx, picked)
        return probs, routing_map

    TopKRouter.routing = routing
    try:
        yield
    finally:
        TopKRouter.routing = original


class _KnownCounts:
    """Tokens per expert known in Python (what `SequentialMLP` reads with `.tolist()`)."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def tolist(self) -> list[int]:
        return list(self.counts)

    def sum(self):  # pragma: no cover - not used by SequentialMLP
        return sum(self.counts)


class _BalancedDispatcher:
    """A one-rank (EP = TP = 1) token dispatcher for the balanced router.

    Same tensors as Megatron's all-to-all dispatcher without EP: tokens permuted by expert
    with `index_select` ([T*k, h]), probabilities gathered ([T*k] fp32), and an unpermute by
    `scatter_add` into zeros ([T, h]); counts per expert are known without data.
    """

    def __init__(self, num_experts: int, top_k: int) -> None:
        self.num_experts = num_experts
        self.top_k = top_k

    def dispatch_preprocess(self, hidden, routing_map, probs):
        import torch

        self.hidden_shape = hidden.shape
        hidden = hidden.view(-1, hidden.shape[-1])
        tokens, k, experts = hidden.shape[0], self.top_k, self.num_experts
        choice = (torch.arange(tokens, device=hidden.device).unsqueeze(1) * k
                  + torch.arange(k, device=hidden.device).unsqueeze(0)) % experts
        order = torch.argsort(choice.reshape(-1), stable=True)
        self.token_index = torch.div(order, k, rounding_mode="floor")
        n = tokens * k
        self.counts = [n // experts + (1 if e < n % experts else 0) for e in range(experts)]
        permuted_probs = probs.view(tokens, experts).gather(1, choice).reshape(-1)[order]
        return hidden.index_select(0, self.token_index), permuted_probs

    def token_dispatch(self, hidden, probs):
        return hidden, probs

    def dispatch_postprocess(self, hidden, probs):
        return hidden, _KnownCounts(self.counts), probs

    def combine_preprocess(self, output):
        return output

    def token_combine(self, output):
        return output

    def combine_postprocess(self, output):
        import torch

        h = output.shape[-1]
        rows = self.hidden_shape.numel() // self.hidden_shape[-1]
        out = torch.zeros(rows, h, dtype=output.dtype, device=output.device)
        out = out.scatter_add(0, self.token_index.unsqueeze(1).expand(-1, h), output)
        return out.view(self.hidden_shape)


def _install_balanced_dispatch(model, layout: ParallelLayout) -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            if layout.tp != 1 or layout.ep != 1:
                raise bad(ConfigError, "layout", layout.to_dict(),
                          f"{name}: MoE traces on the CPU run one rank (TP = EP = 1)")
            module.token_dispatcher = _BalancedDispatcher(module.config.num_moe_experts,
                                                          module.router.topk)


# --- the trace ----------------------------------------------------------------------------


def _check(geometry: ModelGeometry, seq_lens, num_layers, device, head):
    if device not in DEVICES:
        raise bad(ConfigError, "device", device, f"must be one of {', '.join(DEVICES)}")
    if head not in HEADS:
        raise bad(ConfigError, "head", head, f"must be one of {', '.join(HEADS)}")
    lens = tuple(int(n) for n in seq_lens)
    if not lens or any(n <= 0 for n in lens):
        raise bad(ConfigError, "seq_lens", list(seq_lens), "must be a non-empty list of positive lengths")
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int)
                                   or not 0 < num_layers):
        raise bad(ConfigError, "num_layers", num_layers, "must be a positive integer")
    return lens


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied weights counted
    once): a model's weights, the baseline every traced peak is measured above. O(tensors)."""
    return sum(t.untyped_storage().nbytes()
               for t in {id(t.untyped_storage()): t for t in tensors}.values())


def _inputs(torch, lens, vocab, device, packed):
    total = sum(lens)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, total), generator=gen).to(device)
    labels = torch.randint(0, vocab, (1, total), generator=gen).to(device)
    if packed:
        pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0).to(device)
    else:
        pos = torch.arange(total).unsqueeze(0).to(device)
    return ids, pos, labels


def trace_wave(geometry: ModelGeometry, *, seq_lens: list[int], num_layers: int | None = None,
               device: str = "cpu-fake", recompute: Recompute | None = None,
               lora_rank: int | None = 16, head: str = "full-native",
               layout: ParallelLayout | None = None, decoder_only: bool = True,
               packed: bool | None = None, kernels: str = "torch-cpu") -> TraceResult:
    """Trace one forward + backward of a wave of `seq_lens` sequences; see the module doc.

    `num_layers` limits the model to its first layers (full size otherwise; the note says
    when it was reduced). `layout` may set TP (with or without sequence parallelism): rank
    0's shard runs with torch's fake process group (no communication is simulated); CP and
    PP must be 1, and MoE layers need TP = EP = 1. `packed=None` packs THD when the
    model has no GDN layer. `decoder_only` adds the decoder-only pass. `kernels="te-gpu"`
    runs the fused GPU kernels' allocation models (`gpu_kernels`) on the CPU.
    """
    lens = _check(geometry, seq_lens, num_layers, device, head)
    if kernels not in KERNELS:
        raise bad(ConfigError, "kernels", kernels, f"must be one of {', '.join(KERNELS)}")
    if kernels != "torch-cpu" and device == "cuda":
        raise bad(ConfigError, "kernels", kernels, "the te-gpu allocation models run on the CPU "
                  "(a cuda trace runs the GPU's own kernels)")
    recompute = recompute or Recompute()
    layout = layout or ParallelLayout()
    layers = geometry.layers if num_layers is None else geometry.layers[:num_layers]
    has_gdn = any(s.mixer == MixerKind.GDN for s in layers)
    has_moe = any(s.mlp == MlpKind.MOE for s in layers)
    notes: list[str] = []
    if num_layers is not None and num_layers < geometry.num_layers:
        notes.append(f"layer count reduced: traced {len(layers)} of {geometry.num_layers} layers")
    if packed is None:
        packed = not has_gdn
    elif packed and has_gdn:
        raise bad(ConfigError, "packed", True, "Megatron-core's GatedDeltaNet takes no packed (THD) input")
    if not packed:
        notes.append("sequences concatenated into one causal row (batch 1, no THD)"
                     + (": GatedDeltaNet takes no packed input" if has_gdn else ""))
    if has_gdn and kernels == "torch-cpu":
        notes.append("GDN runs Megatron's pure-torch chunked kernel (not FLA): its saved "
                     "tensors differ from a GPU run's")
    if has_moe and device != "cuda":
        notes.append("MoE routing replaced by a balanced router (fake tensors cannot route)")
    if geometry.features.attention_sinks and device == "cuda":
        notes.append("attention sinks not run (the SDPA stand-in applies them on the CPU only)")
    if layout.cp != 1 or layout.pp != 1:
        raise bad(ConfigError, "layout", layout.to_dict(),
                  "traces run CP = PP = 1 (context parallelism needs Transformer Engine's "
                  "attention; a PP stage has no head)")
    if layout.model_parallel_size > 1:
        notes.append(f"rank 0 of TP={layout.tp} with torch's fake process group: shapes are "
                     "per rank, collectives do nothing")
    multiple = layout.row_multiple
    if any(n % multiple for n in lens):
        lens = tuple(-(-n // multiple) * multiple for n in lens)
        notes.append(f"each sequence padded to a multiple of {multiple} rows")
    if device == "cuda":
        return _trace_cuda(geometry, lens, layers, recompute, lora_rank, head, layout,
                           decoder_only, packed, notes)
    return _trace_cpu(geometry, lens, layers, device, recompute, lora_rank, head, layout,
                      decoder_only, packed, has_moe, notes, kernels)


def _seed_function():
    import torch

    class Seed(torch.autograd.Function):
        """Scalar stand-in for the head: keeps nothing from the decoder output, and its
        backward hands the decoder one materialised gradient of the output's shape (as the
        output layer's backward would)."""

        @staticmethod
        def forward(ctx, x):
            ctx.shape, ctx.dtype = x.shape, x.dtype
            return x.new_zeros(())

        @staticmethod
        def backward(ctx, grad):
            return grad.to(ctx.dtype).expand(ctx.shape).contiguous()

    return Seed


def _run_step(torch, model, lens, vocab, dev, packed, full_head, phase):
    """One forward and backward; `phase(name)` is called at "forward" and "backward"."""
    ids, pos, labels = _inputs(torch, lens, vocab, dev, packed)
    kwargs = {}
    if packed:
        kwargs["packed_seq_params"], _cu = packed_params(torch, lens, dev)
    inputs = (ids, pos, labels) + ((kwargs["packed_seq_params"].cu_seqlens_q,) if packed else ())
    phase("forward", inputs)
    if full_head:
        out = model(ids, pos, None, labels=labels, **kwargs)
        loss = out.sum()
        del out
        phase("backward", ())
        loss.backward()
    else:
        model.post_process = False
        try:
            out = model(ids, pos, None, **kwargs)
        finally:
            model.post_process = True
        loss = _seed_function().apply(out)
        del out
        phase("backward", ())
        loss.backward()
    phase("done", ())


def _trace_cpu(geometry, lens, layers, device, recompute, lora_rank, head, layout,
               decoder_only, packed, has_moe, notes, kernels="torch-cpu"):
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import torch

    from .megatron_build import build_gpt
    from .megatron_shim import init_single_process

    tracker_cls = _tracker_class()
    fake = device == "cpu-fake"
    results = {}
    with init_single_process(layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep), \
            contextlib.ExitStack() as stack:
        if fake:
            from torch._subclasses.fake_tensor import FakeTensorMode

            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        if packed:
            stack.enter_context(rope_patch())
        if has_moe:
            stack.enter_context(_balanced_router())
        model = build_gpt(geometry, num_layers=len(layers), device="cpu", lora_rank=lora_rank,
                          recompute=recompute, layout=layout, seq_len=max(lens),
                          perform_initialization=not fake)
        model.train()
        if head == "full-te":
            from .te_cross_entropy import te_cross_entropy_head

            stack.enter_context(te_cross_entropy_head(model))
            notes.append("full-te head: an allocation model of Transformer Engine's parallel cross "
                         "entropy (bf16 logits overwritten by their gradient, fp32 loss and per-row "
                         "max/sum/target; its fp32 chunk scratch, standing for TE's registers, is not counted)")
        if has_moe:
            _install_balanced_dispatch(model, layout)
        if kernels == "te-gpu":
            from .gpu_kernels import kernels_note, te_gpu_kernels

            notes.append(kernels_note(stack.enter_context(te_gpu_kernels(model))))
        vocab = geometry.vocab
        baseline_weights = storage_bytes(list(model.parameters()) + list(model.buffers()))
        runs = [("full", True)] + ([("decoder", False)] if decoder_only else [])
        for name, full_head in runs:
            # garbage of earlier work collected, and the collector's counters reset, so that
            # when the cyclic collector runs inside the pass does not depend on what the
            # process did before (a pass's peak is the same whatever ran before it)
            gc.collect()
            tracker = tracker_cls()
            tracker.ignore(list(model.parameters()) + list(model.buffers()))
            peaks = {}
            baseline = [0]

            def phase(what, inputs, tracker=tracker, peaks=peaks, baseline=baseline):
                if what == "forward":
                    baseline[0] = tracker.ignore(inputs)
                    tracker.reset_peak()
                elif what == "backward":
                    peaks["forward"] = tracker.peak
                    tracker.reset_peak()
                else:
                    peaks["backward"] = tracker.peak

            for p in model.parameters():
                p.grad = None
            with tracker:
                _run_step(torch, model, lens, vocab, "cpu", packed, full_head, phase)
            peaks["baseline"] = baseline_weights + baseline[0]
            results[name] = peaks
            for p in model.parameters():
                p.grad = None
    return _result(
        results, geometry=geometry, num_layers=len(layers), lens=lens, device=device,
        recompute=recompute, lora_rank=lora_rank, head=head, packed=packed, notes=notes,
        kernels=kernels,
        counted=("live untyped storages created by aten ops during the step (fake tensors), "
                 "above weights, buffers and inputs" if fake else
                 "live untyped storages created by aten ops during the step (real CPU "
                 "tensors), above weights, buffers and inputs"))


def _trace_cuda(geometry, lens, layers, recompute, lora_rank, head, layout, decoder_only,
                packed, notes):
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import torch

    from .megatron_build import build_gpt
    from .megatron_shim import init_single_process, shim_installed

    if not torch.cuda.is_available():
        raise bad(ConfigError, "device", "cuda", "no CUDA device is available")
    if shim_installed():
        raise bad(ConfigError, "device", "cuda",
                  "the CPU shim is installed in this process; trace on CUDA in a fresh process")
    if layout.model_parallel_size != 1:
        raise bad(ConfigError, "layout", layout.to_dict(), "CUDA traces run one rank (TP=PP=CP=1)")
    results = {}
    with init_single_process(1, cpu=False), contextlib.ExitStack() as stack:
        if packed:
            stack.enter_context(rope_patch())
        model = build_gpt(geometry, num_layers=len(layers), device="cuda", lora_rank=lora_rank,
                          recompute=recompute, layout=layout, seq_len=max(lens),
                          perform_initialization=True)
        model.train()
        if head == "full-te":
            # Megatron's own TE fusion path (Transformer Engine must be installed)
            model.config.cross_entropy_loss_fusion = True
            model.config.cross_entropy_fusion_impl = "te"
        runs = [("full", True)] + ([("decoder", False)] if decoder_only else [])
        for name, full_head in runs:
            peaks = {}
            base = [0]

            def phase(what, inputs, peaks=peaks, base=base):
                torch.cuda.synchronize()
                if what == "forward":
                    base[0] = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                elif what == "backward":
                    peaks["forward"] = torch.cuda.max_memory_allocated() - base[0]
                    torch.cuda.reset_peak_memory_stats()
                else:
                    peaks["backward"] = torch.cuda.max_memory_allocated() - base[0]

            for p in model.parameters():
                p.grad = None
            _run_step(torch, model, lens, geometry.vocab, "cuda", packed, full_head, phase)
            peaks["baseline"] = base[0]
            results[name] = peaks
            for p in model.parameters():
                p.grad = None
            torch.cuda.empty_cache()
    return _result(
        results, geometry=geometry, num_layers=len(layers), lens=lens, device="cuda",
        recompute=recompute, lora_rank=lora_rank, head=head, packed=packed, notes=notes,
        counted="torch.cuda.max_memory_allocated() above the allocation before the step")


def _result(results: dict, *, geometry, num_layers, lens, device, recompute, lora_rank, head,
            packed, notes, counted, kernels="torch-cpu") -> TraceResult:
    """A TraceResult from the per-pass peaks ("full", and "decoder" when it ran)."""
    full = results["full"]
    dec = results.get("decoder")
    return TraceResult(
        peak_forward_bytes=int(full["forward"]), peak_backward_bytes=int(full["backward"]),
        peak_bytes=int(max(full["forward"], full["backward"])),
        baseline_bytes=int(full["baseline"]),
        decoder_peak_forward_bytes=None if dec is None else int(dec["forward"]),
        decoder_peak_backward_bytes=None if dec is None else int(dec["backward"]),
        num_layers=num_layers, model_layers=geometry.num_layers, tokens=sum(lens),
        seq_lens=lens, device=device, recompute=recompute.to_dict(), lora_rank=lora_rank,
        head=head, packed="thd" if packed else "concatenated", counted=counted,
        notes=tuple(notes), kernels=kernels)
