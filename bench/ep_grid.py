"""Expert-parallel grid for issue 12: multi-rank CPU traces of a MoE shape with Qwen3-30B-A3B's
proportions (top 8 of many experts, expert FFN 0.375 x hidden), at EP1/2/4/8.

    python bench/ep_grid.py     # trace the cells missing from bench/results/traces_multirank_ep.jsonl

The shape (inline; no preset has it): hidden 512, 32 experts, top 8, expert FFN 192, 8 heads in
4 KV groups of 64, vocabulary 2048 (its layers bind, not its head), 2 layers; at EP8 each rank
holds 4 local experts (fewer than top 8, so the worst-case load is EP x 4 / 8 = 4). Its expert
FFN / hidden ratio differs from the grid's two MoE shapes (both 512-wide experts), so its cells
are held out of the torch-cpu MoE coefficients that bench/moe_validation.py checks. The grid's
wide MoE shape is also traced at TP4+SP (EP1), the layout MoE layers are credited with, and this
shape too (full recompute), to validate the TP+SP MoE point on a second geometry; both shapes
at TP2+SP and this one at TP4+SP also retaining their activations (selective and no recompute:
docs/memory-model.md#moe-sp-retained); below the default expert TP (ETP1 and ETP2 at TP4+SP, ETP1 at TP2+SP,
both shapes, every recompute mode; ETP1 with EP2 at TP2+SP, full: docs/memory-model.md#moe-etp);
under context parallelism (ring attention's allocation model): TP1, TP2+SP and TP4+SP with CP2 and
CP4 (this shape; the wide one at TP1+CP2 and TP2+SP+CP2), every recompute mode, and EP2 with CP2
(docs/memory-model.md#moe-cp). The wide shape with a shared expert of FFN 1024
(grid-moe-shared-h1024) at TP1, TP2+SP and TP4+SP, every recompute mode: what an attention layer's
shared expert holds under TP+SP and retained (docs/memory-model.md#moe-shared-sp).
Waves, recompute modes, LoRA rank and record form are bench/multirank_grid.py's; the cells are
appended to their own file so traces_multirank.jsonl stays as traced.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import multirank_grid as grid  # noqa: E402

MOE_A3B = {"name": "grid-moe-a3b-h512", "hidden": 512, "ffn": 0, "vocab": 2048, "dtype": "bf16",
           "gated_mlp": True, "tied_embeddings": False, "layers": [["attention", "moe"]] * 2,
           "attention": {"num_heads": 8, "num_kv_groups": 4, "head_dim": 64, "output_gate": False},
           "gdn": None,
           "moe": {"num_experts": 32, "top_k": 8, "expert_ffn": 192, "shared_expert_ffn": 0}}
# the wide shape with a shared expert (hidden 1024, 16 experts top 4, expert FFN 512, a shared
# expert of FFN 1024, 16 heads in 8 KV groups): what an attention layer's shared expert holds at
# the MoE backward point under TP+SP (pricing.moe_terms.sp_shared_expert_point_per_row;
# docs/memory-model.md#moe-shared-sp)
MOE_SHARED = dict(grid.MOE_WIDE, name="grid-moe-shared-h1024",
                  moe=dict(grid.MOE_WIDE["moe"], shared_expert_ffn=1024))
TRACES = grid.RESULTS / "traces_multirank_ep.jsonl"
LAYOUTS = (
    ("MoE-a3b TP1", MOE_A3B, {}, "balanced", grid.RECOMPUTES),
    ("MoE-a3b EP2", MOE_A3B, {"ep": 2}, "balanced", grid.RECOMPUTES),
    ("MoE-a3b EP4", MOE_A3B, {"ep": 4}, "balanced", grid.RECOMPUTES),
    ("MoE-a3b EP8", MOE_A3B, {"ep": 8}, "balanced", grid.RECOMPUTES),
    ("MoE-a3b EP8 router", MOE_A3B, {"ep": 8}, "router", ("full",)),
    # MoE under TP with SP and no EP: the layout the basis credits MoE with (TP4+SP)
    ("MoE-wide TP4+SP", grid.MOE_WIDE, {"tp": 4, "sequence_parallel": True}, "balanced", grid.RECOMPUTES),
    # a second MoE shape at TP4+SP (top 8 at TP4: routed rows / TP differ from rows), held out of
    # the TP+SP MoE point (pricing.moe_terms.tp_backward_point_per_routed_row), full recompute
    ("MoE-a3b TP4+SP", MOE_A3B, {"tp": 4, "sequence_parallel": True}, "balanced", grid.RECOMPUTES),
    # the experts unsplit under TP4+SP (Megatron's expert_tensor_parallel_size = 1), both shapes
    # (selective and none: retained MoE layers below the default expert TP, docs/memory-model.md#moe-etp)
    ("MoE-wide TP4+SP ETP1", grid.MOE_WIDE, {"tp": 4, "sequence_parallel": True, "etp": 1}, "balanced",
     grid.RECOMPUTES),
    ("MoE-a3b TP4+SP ETP1", MOE_A3B, {"tp": 4, "sequence_parallel": True, "etp": 1}, "balanced",
     grid.RECOMPUTES),
    ("MoE-wide TP4+SP ETP2", grid.MOE_WIDE, {"tp": 4, "sequence_parallel": True, "etp": 2}, "balanced",
     grid.RECOMPUTES),
    # expert TP below TP on the second shape and at TP2+SP (held out of the MoE TP+SP layer point,
    # pricing.moe_terms; docs/memory-model.md#moe-etp), and ETP1 with EP2 (the usual MoE layout)
    ("MoE-a3b TP4+SP ETP2", MOE_A3B, {"tp": 4, "sequence_parallel": True, "etp": 2}, "balanced", ("full",)),
    ("MoE-wide TP2+SP ETP1", grid.MOE_WIDE, {"tp": 2, "sequence_parallel": True, "etp": 1}, "balanced",
     grid.RECOMPUTES),
    ("MoE-a3b TP2+SP ETP1", MOE_A3B, {"tp": 2, "sequence_parallel": True, "etp": 1}, "balanced",
     grid.RECOMPUTES),
    ("MoE-wide TP2+SP+EP2 ETP1", grid.MOE_WIDE, {"tp": 2, "sequence_parallel": True, "ep": 2, "etp": 1},
     "balanced", ("full",)),
    # a second MoE shape at TP2+SP (the wide one is traced there with EP2), held out of every
    # MoE term: with it MoE layers at TP2+SP are priced on evidence (pricing.model._MOE_TRACED)
    ("MoE-a3b TP2+SP", MOE_A3B, {"tp": 2, "sequence_parallel": True}, "balanced", grid.RECOMPUTES),
    # the wide shape at TP2+SP without EP, retained layers (selective and no recompute): with the
    # a3b shape's TP2+SP and TP4+SP cells they price retained MoE layers under TP+SP
    # (pricing.moe_terms.sp_retained_moe_layer_per_row)
    ("MoE-wide TP2+SP", grid.MOE_WIDE, {"tp": 2, "sequence_parallel": True}, "balanced", ("selective", "none")),
    # MoE layers under context parallelism (ring attention's allocation model; each rank routes
    # its CP share of the rows): with them MoE at TP1+CP2, TP2+SP+CP2 and TP4+SP+CP2 is priced
    # on evidence (pricing.model._MOE_TRACED; docs/memory-model.md#moe-cp)
    ("MoE-a3b CP2", MOE_A3B, {"cp": 2}, "balanced", grid.RECOMPUTES),
    ("MoE-a3b TP2+SP+CP2", MOE_A3B, {"tp": 2, "sequence_parallel": True, "cp": 2}, "balanced", grid.RECOMPUTES),
    ("MoE-wide TP2+SP+CP2", grid.MOE_WIDE, {"tp": 2, "sequence_parallel": True, "cp": 2}, "balanced",
     grid.RECOMPUTES),
    ("MoE-wide CP2", grid.MOE_WIDE, {"cp": 2}, "balanced", grid.RECOMPUTES),
    ("MoE-a3b TP4+SP+CP2", MOE_A3B, {"tp": 4, "sequence_parallel": True, "cp": 2}, "balanced", grid.RECOMPUTES),
    # CP4 (TP1+CP4, TP2+SP+CP4, TP4+SP+CP4: 4, 8 and 16 gloo ranks), the a3b shape
    ("MoE-a3b CP4", MOE_A3B, {"cp": 4}, "balanced", grid.RECOMPUTES),
    ("MoE-a3b TP2+SP+CP4", MOE_A3B, {"tp": 2, "sequence_parallel": True, "cp": 4}, "balanced", grid.RECOMPUTES),
    ("MoE-a3b TP4+SP+CP4", MOE_A3B, {"tp": 4, "sequence_parallel": True, "cp": 4}, "balanced", grid.RECOMPUTES),
    # EP with CP: Megatron carves the expert-parallel group out of DP x CP, so at CP2 EP2 the
    # all-to-all runs between the two CP ranks (different rows of the same sequences)
    ("MoE-a3b CP2+EP2", MOE_A3B, {"cp": 2, "ep": 2}, "balanced", ("full",)),
    ("MoE-a3b TP2+SP+CP2+EP2", MOE_A3B, {"tp": 2, "sequence_parallel": True, "cp": 2, "ep": 2}, "balanced",
     ("full",)),
    # attention + MoE layers with a shared expert at TP1, TP2+SP and TP4+SP
    ("MoE-shared TP1", MOE_SHARED, {}, "balanced", grid.RECOMPUTES),
    ("MoE-shared TP2+SP", MOE_SHARED, {"tp": 2, "sequence_parallel": True}, "balanced", grid.RECOMPUTES),
    ("MoE-shared TP4+SP", MOE_SHARED, {"tp": 4, "sequence_parallel": True}, "balanced", grid.RECOMPUTES),
)


def main(argv=None) -> int:
    grid.LAYOUTS = LAYOUTS
    return grid.main(["trace", "--traces", str(TRACES)] + list(argv or sys.argv[1:]))


if __name__ == "__main__":
    raise SystemExit(main())
