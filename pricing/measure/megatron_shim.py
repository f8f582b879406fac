"""Run Megatron-core on a machine without CUDA: a small, idempotent shim (`install_cpu_shim`),
and Megatron's `parallel_state` in one process (`init_single_process`).
See docs/measurement.md#megatron-shim.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

_INSTALLED = False
_DEVICE = ["cpu"]


def _import_torch():
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import torch

    return torch


class _NullEvent:
    """Stands in for `torch.cuda.Event` (what `_NullStream.record_event` returns)."""

    def synchronize(self) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullStream:
    """Stands in for `torch.cuda.Stream` on a machine without CUDA."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args, **kwargs) -> _NullEvent:
        return _NullEvent()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NullStream)

    def __hash__(self) -> int:
        return 0


def install_cpu_shim() -> None:
    """Patch torch.cuda and Megatron's RNG helpers so Megatron-core runs on the CPU.

    Idempotent: a second call does nothing.
    """
    global _INSTALLED
    if _INSTALLED:
        return
    torch = _import_torch()
    try:
        import torch._dynamo

        torch._dynamo.config.disable = True
    except Exception:  # pragma: no cover - dynamo absent or already disabled
        pass

    def current_device() -> str:
        return _DEVICE[0]

    def get_rng_state(device: object = "cuda") -> object:
        return torch.get_rng_state()

    def set_rng_state(new_state: object, device: object = "cuda") -> None:
        torch.set_rng_state(new_state)

    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    null_stream = _NullStream()
    torch.cuda.current_device = current_device
    torch.cuda.get_rng_state = get_rng_state
    torch.cuda.set_rng_state = set_rng_state
    torch.cuda.manual_seed = manual_seed
    torch.cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls it
    torch.cuda.Stream = _NullStream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a, **k: null_stream
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.random.get_rng_state = get_rng_state
    torch.cuda.random.set_rng_state = set_rng_state

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        yield

    mrandom.CudaRNGStatesTracker.fork = fork

    # megatron-core 0.16.1 names `te_general_gemm` in the MoE router without defining it
    # when Transformer Engine is absent.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _patch_dtoh(moe_utils)
    _INSTALLED = True


def _patch_dtoh(moe_utils) -> None:
    """`maybe_move_tensor_to_cpu` for tensors already on the CPU: numpy when asked, as the
    CUDA branch returns (the dispatcher's split sizes reach gloo as sequences, not tensors)."""
    from megatron.core.transformer.moe import token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        torch = _import_torch()
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def shim_installed() -> bool:
    return _INSTALLED


@contextlib.contextmanager
def shim_device(device: str) -> Iterator[None]:
    """Make `torch.cuda.current_device()` answer `device` ("cpu" or "meta") inside."""
    install_cpu_shim()
    previous = _DEVICE[0]
    _DEVICE[0] = device
    try:
        yield
    finally:
        _DEVICE[0] = previous


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def init_single_process(tp: int = 1, *, pp: int = 1, cp: int = 1, ep: int = 1,
                        seed: int = 1234, cpu: bool = True) -> Iterator[None]:
    """Initialise torch.distributed and Megatron's parallel state in this process.

    World size is tp x pp x cp (EP folds into the data-parallel ranks of that world, so
    ep must divide it); this process is rank 0. A world of 1 uses a real gloo group; a
    larger one uses torch's fake process group, whose collectives do nothing, so a model
    gets the per-rank shapes of the layout (use it for geometry and memory traces only).
    If torch.distributed or Megatron's parallel state is already initialised, it is used
    as is and left alone (a `ConfigError` if its sizes differ from the ones asked for).
    `cpu=True` installs the CPU shim first.
    """
    torch = _import_torch()
    if cpu:
        install_cpu_shim()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    world = tp * pp * cp
    if world % ep:
        # EP ranks are carved out of the DP x CP x TP ranks; grow the world as Megatron
        # would (a data-parallel dimension) so that ep fits.
        world = world * ep
    created_pg = False
    if not dist.is_initialized():
        if world == 1:
            backend = "gloo" if cpu or not torch.cuda.is_available() else "nccl"
            with tempfile.NamedTemporaryFile(prefix="waveplan-pg-", delete=False) as handle:
                init_file = handle.name
            dist.init_process_group(backend, rank=0, world_size=1,
                                    init_method=f"file://{init_file}")
        else:
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        created_pg = True
    created_mp = False
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_context_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())
        if have != (tp, pp, cp, ep):
            from ..errors import ConfigError

            raise ConfigError(f"init_single_process(tp={tp}, pp={pp}, cp={cp}, ep={ep}): "
                              f"Megatron's parallel state is already (tp, pp, cp, ep)={have}")
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            context_parallel_size=cp, expert_model_parallel_size=ep,
            create_gloo_process_groups=world == 1)
        created_mp = True
    if cpu:
        with shim_device("cpu"):
            mrandom.model_parallel_cuda_manual_seed(seed)
    else:
        mrandom.model_parallel_cuda_manual_seed(seed)
    try:
        yield
    finally:
        if created_mp:
            parallel_state.destroy_model_parallel()
        if created_pg:
            dist.destroy_process_group()
            if world == 1:
                with contextlib.suppress(OSError):
                    os.unlink(init_file)


class _CpuTorch:
    """`torch` as Megatron's pipeline schedules see it on the CPU: every attribute is torch's,
    except the constructors that the schedules call with `device="cuda"` (the token counter
    `torch.zeros([], dtype=torch.int, device="cuda")`), which build on the CPU."""

    def __init__(self, torch) -> None:
        self._torch = torch

    def __getattr__(self, name: str):
        value = getattr(self._torch, name)
        if name in ("zeros", "ones", "empty", "tensor"):
            def build(*args, _f=value, **kwargs):
                if str(kwargs.get("device", "")).startswith("cuda"):
                    kwargs["device"] = "cpu"
                return _f(*args, **kwargs)

            return build
        return value


def install_pipeline_shim() -> None:
    """Let Megatron-core's pipeline schedules (`forward_backward_pipelining_without_
    interleaving`) run over gloo on the CPU. Idempotent. What megatron-core 0.16.1 needs:

    - the schedules' token counter is made with `device="cuda"`: the schedules module sees
      `_CpuTorch` (those constructors build on the CPU);
    - its point-to-point communication (`p2p_communication.P2PCommunicator`: shapes exchange
      under `variable_seq_lengths`, then the tensors) allocates its receive buffers on
      `torch.cuda.current_device()`, which `install_cpu_shim` already answers "cpu", and calls
      `torch.cuda.synchronize()`, a no-op there; `batch_isend_irecv` and plain isend/irecv
      work on gloo as they are (gloo's send/recv need contiguous CPU tensors: Megatron's
      are). Nothing else is patched."""
    install_cpu_shim()
    torch = _import_torch()
    from megatron.core.pipeline_parallel import schedules

    if not isinstance(schedules.torch, _CpuTorch):
        schedules.torch = _CpuTorch(torch)
