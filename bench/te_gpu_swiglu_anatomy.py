"""What is live at each fused SwiGLU backward, and at the highest peak, of one te-gpu grid cell.

    python bench/te_gpu_swiglu_anatomy.py grid-mla-dsv2 none [--out FILE]

Runs the cell (bench/te_gpu_grid.py's grid or held-out cell at TP1) with `trace_wave(kernels=
"te-gpu")` under the anatomy tracker (pricing/measure/live_anatomy.py), the fused SwiGLU's
allocation model (gpu_kernels.FusedGLU) wrapped so that, once its backward has allocated its
input gradient, the live storages are listed by (pass, module, op, shape, dtype); modules are
named by class and a short id. The pass flips to "backward" at the first SwiGLU backward, so
the backward's storages made before it show as "forward" in module "(autograd)". The evidence
behind the retained dense layer's MLP backward key (docs/memory-model.md#mla-kernel-models;
bench/results/te_gpu_swiglu_anatomy.txt). Imports torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

MiB = 2 ** 20


def _rows(groups: dict, top: int) -> list[str]:
    items = sorted(groups.items(), key=lambda kv: (-kv[1], str(kv[0])))
    out = [f"  {n / MiB:9.2f}  {label}" for label, n in items[:top]]
    rest = sum(n for _, n in items[top:])
    if rest:
        out.append(f"  {rest / MiB:9.2f}  ({len(items) - top} more groups)")
    return out


def run(model: str, recompute: str, top: int = 25) -> list[str]:
    import te_gpu_grid as grid
    import torch

    from waveplan.pricing.measure import gpu_kernels as G
    from waveplan.pricing.measure import trace as T
    from waveplan.pricing.measure.live_anatomy import anatomy_tracker_class
    from waveplan.pricing.parallel import Recompute

    cell = grid.tp1_cell(model, recompute)
    base = anatomy_tracker_class()
    trackers: list = []

    class Tracker(base):
        def __init__(self) -> None:
            super().__init__()
            trackers.append(self)
            self.best, self.best_snap, self.best_stack = 0, {}, []

        def _snapshot(self) -> None:
            super()._snapshot()
            if self.peak > self.best:
                self.best, self.best_snap, self.best_stack = self.peak, dict(self.snap), list(self.stack)

    def group(tr, live: dict) -> dict:
        out: dict = {}
        for k, n in live.items():
            label = tr.info.get(k) or ("?",)
            out[label] = out.get(label, 0) + n
        return out

    lines: list[str] = []
    swiglu_backward = G.FusedGLU.backward

    def backward(ctx, g):
        tr = trackers[-1]
        tr.phase = "backward"
        (x,) = ctx.saved_tensors
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)   # what the model allocates
        lines.append(f"\n== fused SwiGLU backward, input gradient allocated: {tr.current / MiB:.1f} "
                     f"MiB live (input {list(x.shape)}, incoming gradient {list(g.shape)})")
        lines.extend(_rows(group(tr, tr.live), top))
        del dx
        return swiglu_backward(ctx, g)

    def enter(module, inputs):
        if trackers:
            trackers[-1].stack.append(f"{type(module).__name__}#{id(module) % 997}")

    def leave(module, inputs, output):
        if trackers and trackers[-1].stack:
            trackers[-1].stack.pop()

    saved_cls = T._tracker_class
    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
             torch.nn.modules.module.register_module_forward_hook(leave)]
    T._tracker_class = lambda: Tracker
    G.FusedGLU.backward = staticmethod(backward)
    try:
        tr = T.trace_wave(grid.geometry_of(model), seq_lens=list(cell["seq_lens"]), num_layers=2,
                          device="cpu-fake", recompute=Recompute(mode=recompute),
                          lora_rank=cell["lora_rank"], head=cell["head"], kernels="te-gpu")
    finally:
        T._tracker_class = saved_cls
        G.FusedGLU.backward = staticmethod(swiglu_backward)
        for h in hooks:
            h.remove()
    head = [f"te-gpu anatomy: {model} TP1 {recompute}, wave {cell['seq_lens']}, "
            f"traced peak {tr.peak_bytes / MiB:.1f} MiB (forward {tr.peak_forward_bytes / MiB:.1f}, "
            f"backward {tr.peak_backward_bytes / MiB:.1f}); MiB = 2**20 bytes"]
    best = max(trackers, key=lambda t: t.best)
    head.append(f"\n== highest peak: {best.best / MiB:.1f} MiB, module stack {best.best_stack}")
    at_peak: dict = {}
    for label, n in best.best_snap.values():   # labelled when the peak was reached
        at_peak[label or ("?",)] = at_peak.get(label or ("?",), 0) + n
    head.extend(_rows(at_peak, top))
    return head + lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("recompute", choices=("none", "selective", "full"))
    p.add_argument("--out", help="also write the listing to this file (atomically)")
    args = p.parse_args(argv)
    text = "\n".join(run(args.model, args.recompute)) + "\n"
    print(text, end="")
    if args.out:
        from waveplan.pricing.atomic_io import write_text_atomic
        write_text_atomic(Path(args.out), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
