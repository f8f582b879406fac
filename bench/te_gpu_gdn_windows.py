"""What is live at the highest point of every backward window of one TP1 te-gpu grid cell.

    python bench/te_gpu_gdn_windows.py grid-gdn-h1024 none [--out FILE]

Runs the cell (bench/te_gpu_grid.py's grid or held-out cell at TP1) with `trace_wave(kernels=
"te-gpu")` under the anatomy tracker (pricing/measure/live_anatomy.py). A window opens when a
kernel model's autograd backward starts (gpu_kernels: the fused SwiGLU, TE RMSNorm, flash varlen,
fused RoPE, FLA's chunked gated delta rule and L2 norm), so each layer's MLP, attention or GDN
backward has windows of its own; for each window (the forward is window 0) the live storages at
its highest point are listed by (pass, module class, op, shape, dtype), in bytes per row of the
wave. Storages made before a window opened keep the pass they were made in. The evidence behind
the retained GDN hybrid's backward and forward-point keys (docs/memory-model.md#te-gpu-gdn;
bench/results/te_gpu_gdn_windows.txt). Imports torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

MiB = 2 ** 20


def run(model: str, recompute: str, top: int = 30) -> list[str]:
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
            self.window = (0, "forward")
            self.highest: dict = {}   # window -> (live bytes, {storage: (label, bytes)})

        def _track(self, t) -> None:
            super()._track(t)
            best = self.highest.get(self.window)
            if best is None or self.current > best[0]:
                self.highest[self.window] = (self.current, {k: (self.info.get(k), n)
                                                            for k, n in self.live.items()})

    classes = (G.FusedGLU, G.TeRMSNorm, G.FlashVarlen, G.FusedRoPE, G.FlaChunkGatedDeltaRule,
               G.FlaL2Norm)
    saved = {c: c.backward for c in classes}
    opened = [0]

    def opening(c, backward):
        def wrapped(ctx, *grads):
            if trackers:
                opened[0] += 1
                trackers[-1].phase = "backward"
                trackers[-1].window = (opened[0], c.__name__)
            return backward(ctx, *grads)
        return staticmethod(wrapped)

    def enter(module, inputs):
        if trackers:
            trackers[-1].stack.append(type(module).__name__)

    def leave(module, inputs, output):
        if trackers and trackers[-1].stack:
            trackers[-1].stack.pop()

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
             torch.nn.modules.module.register_module_forward_hook(leave)]
    saved_cls = T._tracker_class
    T._tracker_class = lambda: Tracker
    for c in classes:
        c.backward = opening(c, saved[c])
    try:
        tr = T.trace_wave(grid.geometry_of(model), seq_lens=list(cell["seq_lens"]), num_layers=2,
                          device="cpu-fake", recompute=Recompute(mode=recompute),
                          lora_rank=cell["lora_rank"], head=cell["head"], kernels="te-gpu")
    finally:
        T._tracker_class = saved_cls
        for c in classes:
            c.backward = saved[c]
        for h in hooks:
            h.remove()
    rows = sum(tr.seq_lens)
    lines = [f"te-gpu window anatomy: {model} TP1 {recompute}, wave {list(tr.seq_lens)} ({rows} rows), "
             f"traced peak {tr.peak_bytes / MiB:.2f} MiB (forward {tr.peak_forward_bytes / MiB:.2f}, "
             f"backward {tr.peak_backward_bytes / MiB:.2f}); B per row; MiB = 2**20 bytes"]
    best = max(trackers, key=lambda t: t.peak)
    for window in sorted(best.highest):
        live, snap = best.highest[window]
        lines.append(f"\n== window {window[0]} ({window[1]}{' backward' if window[0] else ''}): "
                     f"{live / MiB:.2f} MiB, {live / rows:.1f} B per row")
        groups: dict = {}
        for label, n in snap.values():
            groups[label or ("?",)] = groups.get(label or ("?",), 0) + n
        items = sorted(groups.items(), key=lambda kv: (-kv[1], str(kv[0])))
        lines += [f"  {n / rows:9.1f}  {' '.join(str(x) for x in label)}" for label, n in items[:top]]
        rest = sum(n for _, n in items[top:])
        if rest:
            lines.append(f"  {rest / rows:9.1f}  ({len(items) - top} more groups)")
    return lines


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
