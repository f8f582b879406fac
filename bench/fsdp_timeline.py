"""Timeline anatomy of one FSDP cell of bench/fsdp_validation.py, dense or MoE (the evidence of
the points in waveplan.pricing.fsdp.terms: docs/memory-model.md#fsdp-dense-points,
#fsdp-moe-points): the cell traced as `fsdp_trace` traces it (same model build, warm-up, rest and
inputs, `use_cache=False`), every storage labelled with the module region that made it (fwd:
forward, bwdrc: the checkpoint's recompute, bwdpost: after the recompute stops, bwd: a module's
backward; labels cleared when a storage dies; the recompute bracketed through torch's
`_recomputation_hook`). Prints the busiest rank's peak above rest, where it fell, each region's
own peak, the live set at the peak and at the named regions' peaks, largest first, and the named
regions' op timeline.

    TORCHDYNAMO_DISABLE=1 nice python bench/fsdp_timeline.py SET FAMILY ckpt|nockpt ATTN FSDP \
        [REGION,REGION...] [WAVE_INDEX] [skew]

`skew` (MoE) routes every row to the first top_k experts (the most uneven routing the router can
give) in place of the router's choice, the scores kept.

e.g. `bench/fsdp_timeline.py 4 qwen3_moe ckpt sdpa 2 "" 0` (set 4's 160 + 96 + 64 tokens),
`bench/fsdp_timeline.py 26 qwen3 ckpt sdpa 2 bwd:layers.1.self_attn 1`. The runs behind the terms:
bench/results/fsdp_dense_timelines.txt, fsdp_moe_eager_anatomy.txt (made by the two scripts this
one replaces, fsdp_dense_timeline.py and fsdp_moe_anatomy.py, with the same tracker).
"""
import gc
import sys

import torch
from torch.utils._pytree import tree_leaves


def rank_entry(spec):
    from waveplan.pricing.measure import fsdp_trace as ft
    model, opt = ft.build_fsdp_model(spec)
    if spec.get("skew"):   # the most uneven routing: every row to the first top_k experts
        for m in model.modules():
            if type(m).__name__.endswith("TopKRouter"):
                def skewed(h, _orig=m.forward):
                    logits, scores, idx = _orig(h)
                    first = torch.arange(idx.shape[-1], device=idx.device).expand_as(idx).contiguous()
                    return logits, scores, first
                m.forward = skewed
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
            self.timeline = []
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
            if lab in want:   # the named regions' timeline: op, its first output, the total after it
                first = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
                self.timeline.append((lab, func.overloadpacket.__name__,
                                      tuple(first.shape) if first is not None else (), tot))
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
        polled, others = ft.rest_storages(model, torch)
        tr = T(polled)
        tr.ignore(others)
        del others
        with tr:
            tr.reset_peak()
            base = tr.current + tr.polled_now
            state["label"] = "start"
            run(lens)
        res.append({"peak": tr.gpeak - base, "base": base, "at": tr.snap_label, "polled": tr.snap_polled,
                    "regions": {k: (v[0] - base, v[1]) for k, v in tr.region.items()}, "top": group(tr.snap),
                    "rtop": {k: group(v) for k, v in tr.rsnap.items()},
                    "timeline": [(lab, op, shape, tot - base) for lab, op, shape, tot in tr.timeline]})
    return res


if __name__ == "__main__":
    import os
    from pathlib import Path
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import fsdp_validation as fv

    from waveplan.pricing.measure.gloo_launch import spawn
    setno, fam, ckpt, attn, fsdp = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "ckpt", sys.argv[4], int(sys.argv[5])
    regions = sys.argv[6].split(",") if len(sys.argv) > 6 and sys.argv[6] else []
    wave = int(sys.argv[7]) if len(sys.argv) > 7 else -1
    fams, waves, rank = fv.SETS[setno]
    spec = {"config": dict(fams[fam]), "attn": attn, "checkpointing": ckpt, "lora_rank": rank,
            "reshard_after_forward": True, "device": "cpu", "fsdp": fsdp, "timeout_s": 900.0,
            "jobs": [list(waves[wave])], "regions": regions,
            "skew": len(sys.argv) > 8 and sys.argv[8] == "skew"}
    out = spawn(spec, fsdp, 900.0, entry=f"{Path(__file__).stem}:rank_entry")
    for r, rr in enumerate(out):
        for j in rr:
            print("rank", r, "peak", j["peak"], "at", j["at"], "polled", j["polled"])
            for k, v in sorted(j["regions"].items(), key=lambda kv: -kv[1][0])[:40]:
                print(f"   {v[0]:>10} polled {v[1]:>9}  {k}")
            print("  top live at peak:")
            for k, v in j["top"][:400]:
                print(f"   {v:>10}  {k}")
            print("  timeline of the named regions (op, first output, total above rest after it):")
            for lab, op, shape, tot in j["timeline"]:
                print(f"   {tot:>10}  {lab}  {op} {shape}")
            for lab, top in j["rtop"].items():
                print("  live at region peak", lab, "sum", sum(v for _, v in top))
                for k, v in top[:45]:
                    print(f"   {v:>10}  {k}")
        break
