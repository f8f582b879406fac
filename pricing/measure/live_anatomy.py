"""What is live at a traced peak: the tracer's storage count, with who made each storage.

`anatomy_tracker_class()` extends the tracer's `StorageTracker` (`trace._tracker_class`): each
storage it counts is labelled (pass, module, aten op, shape, dtype) when an op creates it,
the module being the innermost one whose forward is running (named by `module_names`:
decoder layers as L0, L1, ...; expert indices folded into "*"), or "(autograd)" for the
backward's own ops. At every new peak the live storages are snapshotted, so `peak_groups()`
lists what the peak holds, grouped by label, largest first. `module_stack(model)` installs
the global module hooks that keep the innermost module's name while it runs.

Used by the multi-rank tracer when asked for an anatomy (`multirank`, `anatomy=True`): it is
how each layout term's bytes are identified on the busiest rank. Imports torch.
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch.utils._pytree import tree_leaves

from .trace import _tracker_class


def module_names(model) -> dict:
    """module -> short name (decoder.layers.N -> LN, local_experts.N -> local_experts.*)."""
    out = {}
    for name, module in model.named_modules():
        short = re.sub(r"decoder\.layers\.(\d+)", r"L\1", name)
        out[module] = re.sub(r"local_experts\.\d+", "local_experts.*", short) or "model"
    return out


@contextlib.contextmanager
def module_stack(model, stack: list[str]):
    """Keep `stack[-1]` the name of the innermost running module of `model` (global hooks)."""
    names = module_names(model)

    def enter(module, inputs):
        stack.append(names.get(module, type(module).__name__))

    def leave(module, inputs, output):
        if stack:
            stack.pop()

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
             torch.nn.modules.module.register_module_forward_hook(leave)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def anatomy_tracker_class():
    """A `StorageTracker` that labels storages and snapshots the live set at each peak.
    Set `tracker.stack` (the module stack) and `tracker.phase` ("forward"/"backward")."""
    base = _tracker_class()

    class AnatomyTracker(base):
        def __init__(self) -> None:
            super().__init__()
            self.info: dict[int, tuple] = {}
            self.snap: dict[int, tuple] = {}
            self.stack: list[str] = []
            self.phase = "forward"

        def _snapshot(self) -> None:
            self.snap = {k: (self.info.get(k), n) for k, n in self.live.items()}

        def reset_peak(self) -> None:
            super().reset_peak()
            self._snapshot()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = self._call(func, args, kwargs)
            where = self.stack[-1] if self.stack else "(autograd)"
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    key = id(t.untyped_storage())
                    new = key not in self.live and key not in self.ignored
                    before = self.peak
                    self._track(t)
                    if new and key in self.live:
                        self.info[key] = (self.phase, where, func.overloadpacket.__name__,
                                          tuple(t.shape), str(t.dtype).replace("torch.", ""))
                    if self.peak > before:
                        self._snapshot()
            return out

        def peak_groups(self, top: int = 40) -> list[list]:
            """[[bytes, pass, module, op, shape, dtype], ...] of the last peak's live set,
            grouped by label, largest first; the rest summed in one ["(rest)"] row."""
            totals: dict = {}
            for info, nbytes in self.snap.values():
                label = info or ("?", "?", "?", (), "?")
                totals[label] = totals.get(label, 0) + nbytes
            items = sorted(totals.items(), key=lambda kv: (-kv[1], str(kv[0])))
            rows = [[n, ph, where, op, list(shape), dt] for (ph, where, op, shape, dt), n in items[:top]]
            rest = sum(n for _, n in items[top:])
            if rest:
                rows.append([rest, "(rest)", f"{len(items) - top} groups", "", [], ""])
            return rows

    return AnatomyTracker
