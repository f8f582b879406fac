"""GDN grid for issue 12: multi-rank CPU traces of a Gated DeltaNet hybrid with Qwen3.5/3.8's
proportions at TP1, TP2, TP2+SP, TP4 and TP4+SP.

    python bench/gdn_grid.py     # trace the cells missing from bench/results/traces_multirank_gdn.jsonl
    python bench/gdn_grid.py --heldout [--only "GDN TP2+SP" ...]
                                 # the held-out shape's cells (traces_multirank_gdn_heldout.jsonl)

The shape (inline; no preset has it): qwen3.8-27b's GDN and attention heads at head width 128
on hidden 1024: GDN with 4 key heads and 12 value heads of 128 (a key:value head ratio of 1:3, as
16:48; key width 0.5 H and value width 1.5 H against the 27B's 0.4 H and 1.2 H), conv kernel 4;
gated attention with 8 heads of 128 in 4 KV groups (an output gate, as the 27B's); dense gated
MLP of FFN 3456 (3.375 H, the 27B's 3.4 H); vocabulary 2048 (its layers bind, not its head);
2 layers, one GDN and one attention (the 27B repeats 3 GDN : 1 attention; under full recompute
one layer is materialised at a time, so each kind's point is seen). Key, value, attention and KV
heads divide TP up to 4. The head width is the 27B's: the chunked kernel's per-head [chunk,
chunk] fp32 intermediates scale with heads x 64 per row, which the per-width TP1 terms price
for 128-wide heads (a 64-wide-head shape, h640, traced at TP1 at 0.79 of its peak).
Every recompute mode (full, selective, none); full recompute's cells put GDN layers at TP2, TP2+SP
and TP4 on evidence (pricing.model._GDN_TRACED; bench/results/layout_validation.txt).
Waves, LoRA rank and record form are bench/multirank_grid.py's; the cells are appended to their
own file so traces_multirank.jsonl stays as traced.

The held-out shape (`--heldout`, bench/results/traces_multirank_gdn_heldout.jsonl): the retained
GDN terms (pricing/gdn_terms.py) were read on the anatomy of the grid above, so this second
geometry checks them where nothing was derived (docs/memory-model.md#gdn-sp-retained): hidden 768;
GDN with 4 key heads and 8 value heads of 128 (1:2, against 1:3; key width 0.67 H, value width
1.33 H), conv kernel 4; gated attention with 4 heads of 128 in 4 KV groups (multi-head, 0.67 H of
core, against GQA 2 and 1 H); dense gated MLP of FFN 2304 (3.0 H, against 3.375 H); vocabulary 1024.
Two waves: 1540 tokens (900 + 420 + 220: not a multiple of the kernel's 64-row chunk, so the wave
is padded by 60 rows, near the most there is) and 2560; TP1 (the TP1-fitted table's own check on
this shape), TP2, TP2+SP, TP4+SP and TP4, every recompute mode.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import multirank_grid as grid  # noqa: E402

GDN = {"name": "grid-gdn-h1024", "hidden": 1024, "ffn": 3456, "vocab": 2048, "dtype": "bf16",
       "gated_mlp": True, "tied_embeddings": False, "layers": [["gdn", "dense"], ["attention", "dense"]],
       "attention": {"num_heads": 8, "num_kv_groups": 4, "head_dim": 128, "output_gate": True},
       "gdn": {"num_key_heads": 4, "num_value_heads": 12, "key_head_dim": 128, "value_head_dim": 128,
               "conv_kernel": 4},
       "moe": None}
# the same hybrid with MoE MLPs (qwen3.6-35b-a3b's kinds together: GDN and gated attention layers,
# every MLP a MoE with a shared expert; expert FFN 0.25 H and a shared expert of 0.25 H, as the
# 35B's 512 on hidden 2048; 16 experts, top 4): MoE and GDN layers traced together under TP+SP
# (pricing.coverage.mixed_traced; docs/memory-model.md#gdn-moe-tp), every recompute mode at TP2+SP
# and TP4+SP (selective and none: pricing.model._GDN_MOE_RETAINED_TRACED,
# docs/memory-model.md#gdn-moe-sp-retained; `--only "GDN-MoE TP2+SP" "GDN-MoE TP4+SP"`)
GDN_MOE = dict(GDN, name="grid-gdn-moe-h1024", ffn=0, layers=[["gdn", "moe"], ["attention", "moe"]],
               moe={"num_experts": 16, "top_k": 4, "expert_ffn": 256, "shared_expert_ffn": 256})
TRACES = grid.RESULTS / "traces_multirank_gdn.jsonl"
HELDOUT = dict(GDN, name="grid-gdn-h768", hidden=768, ffn=2304, vocab=1024,
               attention=dict(GDN["attention"], num_heads=4),
               gdn=dict(GDN["gdn"], num_value_heads=8))
# the held-out shape with MoE MLPs: nothing of the GDN+MoE retained term
# (gdn_terms.sp_retained_gdn_moe_layer_per_row) was read on it; other MoE proportions than
# GDN_MOE's (8 experts, top 2, expert FFN 0.5 H, shared expert 0.25 H, against 16, 4, 0.25 H, 0.25 H)
HELDOUT_MOE = dict(HELDOUT, name="grid-gdn-moe-h768", ffn=0, layers=[["gdn", "moe"], ["attention", "moe"]],
                   moe={"num_experts": 8, "top_k": 2, "expert_ffn": 384, "shared_expert_ffn": 192})
HELDOUT_TRACES = grid.RESULTS / "traces_multirank_gdn_heldout.jsonl"
HELDOUT_WAVES = ((900, 420, 220), (1280, 768, 512))
LAYOUTS = (
    ("GDN TP1", GDN, {}, "balanced", grid.RECOMPUTES),
    ("GDN TP2", GDN, {"tp": 2}, "balanced", grid.RECOMPUTES),
    ("GDN TP2+SP", GDN, {"tp": 2, "sequence_parallel": True}, "balanced", grid.RECOMPUTES),
    ("GDN TP4", GDN, {"tp": 4}, "balanced", grid.RECOMPUTES),
    ("GDN TP4+SP", GDN, {"tp": 4, "sequence_parallel": True}, "balanced", grid.RECOMPUTES),
    ("GDN-MoE TP1", GDN_MOE, {}, "balanced", ("full",)),
    ("GDN-MoE TP2+SP", GDN_MOE, {"tp": 2, "sequence_parallel": True}, "balanced", grid.RECOMPUTES),
    ("GDN-MoE TP4+SP", GDN_MOE, {"tp": 4, "sequence_parallel": True}, "balanced", grid.RECOMPUTES),
)

HELDOUT_LAYOUTS = (
    ("GDN TP1", HELDOUT, {}, "balanced", grid.RECOMPUTES),
    ("GDN TP2+SP", HELDOUT, {"tp": 2, "sequence_parallel": True}, "balanced", grid.RECOMPUTES),
    ("GDN TP4+SP", HELDOUT, {"tp": 4, "sequence_parallel": True}, "balanced", grid.RECOMPUTES),
    ("GDN TP2", HELDOUT, {"tp": 2}, "balanced", grid.RECOMPUTES),
    ("GDN TP4", HELDOUT, {"tp": 4}, "balanced", grid.RECOMPUTES),
    ("GDN-MoE TP2+SP", HELDOUT_MOE, {"tp": 2, "sequence_parallel": True}, "balanced", grid.RECOMPUTES),
    ("GDN-MoE TP4+SP", HELDOUT_MOE, {"tp": 4, "sequence_parallel": True}, "balanced", grid.RECOMPUTES),
)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--heldout" in argv:
        argv.remove("--heldout")
        grid.LAYOUTS, grid.WAVES = HELDOUT_LAYOUTS, HELDOUT_WAVES
        return grid.main(["trace", "--traces", str(HELDOUT_TRACES)] + argv)
    grid.LAYOUTS = LAYOUTS
    return grid.main(["trace", "--traces", str(TRACES)] + argv)


if __name__ == "__main__":
    raise SystemExit(main())
