"""Timeline anatomy of one FSDP trace cell (the evidence of the dense sdpa/eager points,
docs/memory-model.md#fsdp-dense-points): the cell of bench/fsdp_validation.py traced as
`fsdp_trace` traces it (same model build, warm-up, rest, inputs, `use_cache=False`), each
storage labelled by the module region that made it (`fwd:`, `bwd:`, `bwdrc:` the checkpoint's
recompute, `bwdpost:` after it
labels cleared when a storage dies), FSDP2's all-gather outputs
polled. Prints rank 0's peak, every region's peak, and the live storages at the peak and at the
named regions' peaks. Extends bench/fsdp_dense_anatomy.py (one snapshot) with regions
fsdpmoe2
wrote the tracker. bench/results/fsdp_dense_timelines.txt holds the runs the points were read from.

    TORCHDYNAMO_DISABLE=1 nice python bench/fsdp_dense_timeline.py SET FAMILY ckpt|nockpt ATTN FSDP \
        [REGION,REGION] [WAVE_INDEX]

e.g. `26 qwen3 ckpt sdpa 2 bwd:layers.1.self_attn 1`.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path


def rank_entry(spec):
    """This rank's peak, each region's peak and the labelled live storages at them."""
    import torch
    from torch.utils._pytree import tree_leaves

    from waveplan.pricing.measure import fsdp_trace as ft

    model, opt = ft.build_fsdp_model(spec)
    vocab = int(spec["config"].get("vocab_size", 32000))
    state = {"label": "pre", "stack": [], "bwd": False}
    names = {}
    for name, m in model.named_modules():
        short = name.replace("base_model.model.model.", "").replace("base_model.model.", "")
        last = short.split(".")[-1]
        if last in ("self_attn", "mlp", "block_sparse_moe", "lm_head", "experts", "gate",
                    "post_attention_layernorm", "input_layernorm", "post_feedforward_layernorm",
                    "pre_feedforward_layernorm") or (last.isdigit() and short.endswith("layers." + last)):
            names[m] = short
    def pre(m, inp):
        state["stack"].append(state["label"])
        state["label"] = ("bwdrc:" if state["bwd"] else "fwd:") + names[m]
    def post(m, inp, out):
        state["label"] = state["stack"].pop() if state["stack"] else "?"
    def bpre(m, gout):
        state["label"] = "bwd:" + names[m]
    for m in names:
        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)
        if not names[m].split(".")[-1].isdigit():
            m.register_full_backward_pre_hook(bpre)
    import torch.utils.checkpoint as _ck
    _rh = _ck._recomputation_hook
    _saved = []
    def _enter(self, _o=_rh.__enter__):
        _saved.append((state["label"], len(state["stack"])))
        return _o(self)
    def _exit(self, *a, _o=_rh.__exit__):
        lab, n = _saved.pop()
        del state["stack"][n:]
        state["label"] = "bwdpost:" + lab.split(":", 1)[1]
        return _o(self, *a)
    _rh.__enter__ = _enter
    _rh.__exit__ = _exit
    base_cls = ft._polled_tracker()
    def lab0():
        lab = state["label"]
        return lab
    want = set(spec.get("regions", []))

    class T(base_cls):
        def __init__(self, polled):
            super().__init__(polled)
            self.region = {}
            self.info = {}
            self.snap = {}
            self.rsnap = {}
            self.gpeak = 0
        def _drop(self, key):
            super()._drop(key)
            self.info.pop(key, None)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    k = id(t.untyped_storage())
                    if k in self.live and k not in self.info:
                        self.info[k] = (lab0(), func.overloadpacket.__name__, tuple(t.shape), str(t.dtype)[6:])
            tot = self.current + self.polled_now
            lab = state["label"]
            if tot > self.region.get(lab, (-1,))[0]:
                self.region[lab] = (tot, self.polled_now)
                if lab in want:
                    self.rsnap[lab] = {k: (self.info.get(k), n) for k, n in self.live.items()}
            if tot > self.gpeak:
                self.gpeak = tot
                self.snap = {k: (self.info.get(k), n) for k, n in self.live.items()}
                self.snap_label = lab
                self.snap_polled = self.polled_now
            return out

    def run(lens):
        ids, pos, labels = ft.wave_inputs(lens, vocab, spec["device"])
        state["bwd"] = False
        out = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
        loss = out.loss
        del out
        state["bwd"] = True
        state["label"] = "bwd:loss"
        loss.backward()
        state["bwd"] = False
        del loss, ids, pos, labels

    run(spec["jobs"][0])
    opt.step()
    opt.zero_grad(set_to_none=True)
    res = []
    def group(snap):
        groups = {}
        for info, n in snap.values():
            groups[str(info)] = groups.get(str(info), 0) + n
        return sorted(groups.items(), key=lambda kv: -kv[1])
    for lens in spec["jobs"]:
        opt.zero_grad(set_to_none=True)
        gc.collect()
        polled = []
        for fp in ft._fsdp_params(model):
            polled.extend(t.untyped_storage() for t in fp.all_gather_outputs)
        live = ft._live_storages(torch)
        pid = {id(s) for s in polled}
        tr = T(polled)
        tr.ignore([o for k, o in live.items() if k not in pid])
        del live
        with tr:
            tr.reset_peak()
            base = tr.current + tr.polled_now
            state["label"] = "start"
            run(lens)
        res.append({"peak": tr.gpeak - base, "base": base, "at": tr.snap_label, "polled": tr.snap_polled,
                    "regions": {k: (v[0] - base, v[1]) for k, v in tr.region.items()}, "top": group(tr.snap),
                    "rtop": {k: group(v) for k, v in tr.rsnap.items()}})
    return res



def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import fsdp_validation as fv

    from waveplan.pricing.measure.gloo_launch import spawn

    setno, fam, ckpt, attn, fsdp = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "ckpt", sys.argv[4], int(sys.argv[5])
    regions = sys.argv[6].split(",") if len(sys.argv) > 6 and sys.argv[6] else []
    wave = int(sys.argv[7]) if len(sys.argv) > 7 else -1
    fams, waves, rank = fv.SETS[setno]
    spec = {"config": dict(fams[fam]), "attn": attn, "checkpointing": ckpt, "lora_rank": rank,
            "reshard_after_forward": True, "device": "cpu", "fsdp": fsdp, "timeout_s": 1800.0,
            "jobs": [list(waves[wave])], "regions": regions}
    out = spawn(spec, fsdp, 1800.0, entry=f"{Path(__file__).stem}:rank_entry")
    for j in out[0]:
        print(f"set {setno} {fam} {sys.argv[3]} {attn} fsdp{fsdp} {list(waves[wave])}: rank 0 peak {j['peak']} "
              f"at {j['at']} polled {j['polled']}")
        for k, v in sorted(j["regions"].items(), key=lambda kv: -kv[1][0])[:40]:
            print(f"   {v[0]:>10} polled {v[1]:>9}  {k}")
        print("  top live at peak:")
        for k, v in j["top"][:45]:
            print(f"   {v:>10}  {k}")
        for lab, top in j["rtop"].items():
            print("  live at region peak", lab, "sum", sum(v for _, v in top))
            for k, v in top[:45]:
                print(f"   {v:>10}  {k}")


if __name__ == "__main__":
    main()
