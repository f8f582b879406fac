"""The te-gpu grid: traces with the GPU kernels' allocation models, beside the te-gpu table.

    python bench/te_gpu_grid.py trace     # trace the cells missing from traces_te_gpu.jsonl
    python bench/te_gpu_grid.py report    # per class: te-gpu (and torch-cpu) estimate / trace
    python bench/te_gpu_grid.py trace --heldout    # the held-out cells (traces_te_gpu_heldout.jsonl)
    python bench/te_gpu_grid.py report --heldout   # ... bench/results/te_gpu_heldout.txt

`trace` runs each cell with `trace_wave(kernels="te-gpu")` (pricing/measure/gpu_kernels.py: TE
RMSNorm, flash attention varlen, TE fused RoPE, fused bias-SwiGLU in place of torch's ops;
the rest is the same Megatron-core code) on "cpu-fake" (full-size shapes at no memory cost),
one rank: a TP layout runs rank 0's shard with torch's fake process group (every TP rank of a
wave holds the same; the collectives' outputs Megatron allocates are allocated as on a GPU).
It appends one record per cell (`{"cell", "trace"}`) to bench/results/traces_te_gpu.jsonl and
rewrites the file sorted by cell key, so a re-run completes an interrupted one. `report`
never traces: it prices each cell with today's tables (`multirank_grid.current_estimate`:
WavePricer, one first gradient wave, 2-byte adapter gradients, safety 1.0) and writes
bench/results/te_gpu_grid.txt. Context parallelism (TP1 under CP2 and CP4, dense shapes) runs on
the multi-rank tracer (`multirank.trace_multirank_batch(kernels="te-gpu")`, the ring attention
model, one set of rank processes per model and layout, minutes on a 2-core machine), and so do
the classes that keep fitted terms which the one-rank tracer cannot run (`multi_rank`: MoE at TP2+SP
and EP2, TP2 under CP2).

Model kinds: the layout grid's dense shapes (hidden 1024 and the Qwen3-shaped 1536), the GDN
hybrid of bench/gdn_grid.py, and presets at 2 layers: qwen3-8b, llama-3.1-8b, qwen2.5-7b
(dense), qwen3-30b-a3b (MoE), deepseek-v2-lite (MLA, dense then MoE), qwen3.8-27b (the seed's
GDN hybrid), gemma-2-9b (GeGLU, sandwich norms, soft-capping), and two-layer dense-MLP MLA shapes
(grid-mla-h1024; held out grid-mla-h768 and grid-mla-dsv2). One wave of 2048 tokens (1024, 640, 384).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gdn_grid import GDN  # noqa: E402
from gdn_grid import HELDOUT as GDN_HELDOUT  # noqa: E402
from multirank_grid import DENSE, DENSE2, DENSE3, MOE, MOE_WIDE, current_estimate  # noqa: E402

from waveplan.pricing.atomic_io import write_text_atomic  # noqa: E402

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

RESULTS = Path(__file__).resolve().parent / "results"
TRACES = RESULTS / "traces_te_gpu.jsonl"
SUMMARY = RESULTS / "te_gpu_grid.txt"
# held out (`--heldout`): traced after the te-gpu terms were final, never used to derive them
HELDOUT_TRACES = RESULTS / "traces_te_gpu_heldout.jsonl"
HELDOUT_SUMMARY = RESULTS / "te_gpu_heldout.txt"
HELDOUT_WAVE = (1536, 1024, 440)
HELDOUT_PRESETS = ("mistral-7b", "phi-4", "qwen3-32b", "llama-3.1-70b")
WAVE = (1024, 640, 384)
LORA_RANK = 16
RECOMPUTES = ("full", "selective", "none")
PRESETS = ("qwen3-8b", "llama-3.1-8b", "qwen2.5-7b", "qwen3-30b-a3b", "deepseek-v2-lite",
           "qwen3.8-27b", "gemma-2-9b")
# a MoE shape of its own, traced after the MoE layers' kernel-model terms were final (held out):
# another hidden, GQA ratio, expert count, top-k and expert width, a small vocabulary (the layers bind)
MOE_HELDOUT = {"name": "grid-moe-h768", "hidden": 768, "ffn": 0, "vocab": 3072, "dtype": "bf16",
               "gated_mlp": True, "tied_embeddings": False, "layers": [["attention", "moe"]] * 2,
               "attention": {"num_heads": 12, "num_kv_groups": 4, "head_dim": 64, "output_gate": False},
               "gdn": None, "moe": {"num_experts": 32, "top_k": 6, "expert_ffn": 384, "shared_expert_ffn": 0}}
# a dense shape of its own for context parallelism, traced after the ring's flash-form terms were
# final (held out): head width 80 (flash-attn's dq accumulator rounds it to 96), GQA 4, hidden 640
DENSE_CP_HELDOUT = {"name": "grid-dense-h640", "hidden": 640, "ffn": 1792, "vocab": 3072, "dtype": "bf16",
                    "gated_mlp": True, "tied_embeddings": False, "layers": [["attention", "dense"]] * 2,
                    "attention": {"num_heads": 8, "num_kv_groups": 2, "head_dim": 80, "output_gate": False},
                    "gdn": None, "moe": None}
# multi-latent attention with dense MLPs (so no MoE layer binds): a tuning shape (no query latent,
# as deepseek-v2-lite) and a held-out one (a query latent, other head widths, rope width and
# vocabulary), priced by the fused kernels' MLA terms (docs/memory-model.md#mla-kernel-models)
MLA_DENSE = {"name": "grid-mla-h1024", "hidden": 1024, "ffn": 2816, "vocab": 4096, "dtype": "bf16",
             "gated_mlp": True, "tied_embeddings": False, "layers": [["attention", "dense"]] * 2,
             "attention": {"num_heads": 8, "num_kv_groups": 8, "head_dim": 96, "output_gate": False,
                           "mla": {"kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
                                   "v_head_dim": 64, "q_lora_rank": 0}},
             "gdn": None, "moe": None}
MLA_HELDOUT = {"name": "grid-mla-h768", "hidden": 768, "ffn": 2048, "vocab": 3072, "dtype": "bf16",
               "gated_mlp": True, "tied_embeddings": False, "layers": [["attention", "dense"]] * 2,
               "attention": {"num_heads": 12, "num_kv_groups": 12, "head_dim": 64, "output_gate": False,
                             "mla": {"kv_lora_rank": 192, "qk_nope_head_dim": 48, "qk_rope_head_dim": 16,
                                     "v_head_dim": 48, "q_lora_rank": 384}},
               "gdn": None, "moe": None}
# deepseek-v2-lite's dense first layer twice (its MLA widths: 16 heads, qk 128 + 64 rope, v 128,
# kv latent 512; FFN 10944), a small vocabulary so the layers bind: held out
MLA_DSV2 = {"name": "grid-mla-dsv2", "hidden": 2048, "ffn": 10944, "vocab": 4096, "dtype": "bf16",
            "gated_mlp": True, "tied_embeddings": False, "layers": [["attention", "dense"]] * 2,
            "attention": {"num_heads": 16, "num_kv_groups": 16, "head_dim": 192, "output_gate": False,
                          "mla": {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                                  "v_head_dim": 128, "q_lora_rank": 0}},
            "gdn": None, "moe": None}
# a GDN hybrid of its own for full recompute (grid-gdn-h896b: not tegdn2's grid-gdn-h896), traced after the recomputed GDN layers' kernel-model
# point (fused_gdn_point) was final (held out): hidden 896, 2 key and 8 value heads of 128 (1:4,
# against 1:3 and 1:2), gated attention with 4 heads of 128 in 2 KV groups, FFN 2560 (2.86 H),
# vocabulary 1024 (its layers bind)
GDN_FULL_HELDOUT = dict(GDN, name="grid-gdn-h896b", hidden=896, ffn=2560, vocab=1024,
                        attention=dict(GDN["attention"], num_heads=4, num_kv_groups=2),
                        gdn=dict(GDN["gdn"], num_key_heads=2, num_value_heads=8))
SHAPES = {s["name"]: s for s in (DENSE, DENSE2, DENSE3, GDN, MOE, MOE_WIDE, MOE_HELDOUT, MLA_DENSE,
                                 MLA_HELDOUT, MLA_DSV2, GDN_HELDOUT, DENSE_CP_HELDOUT)}
# a GDN hybrid of its own, held out for the retained GDN kernel-model terms (fused_gdn_layer) after
# grid-gdn-h768 became a tuning shape (its walk points were read while they were tightened): hidden
# 1280; GDN with 8 key and 16 value heads of 128 (1:2; key width 0.8 H, value width 1.6 H); gated
# attention with 10 heads of 128 in 2 KV groups (GQA 5); FFN 4352 (3.4 H); a small vocabulary (its
# layers bind); traced at TP1 none and selective after the terms were final
GDN_HELDOUT2 = {"name": "grid-gdn-h1280", "hidden": 1280, "ffn": 4352, "vocab": 1536, "dtype": "bf16",
                "gated_mlp": True, "tied_embeddings": False, "layers": [["gdn", "dense"], ["attention", "dense"]],
                "attention": {"num_heads": 10, "num_kv_groups": 2, "head_dim": 128, "output_gate": True},
                "gdn": {"num_key_heads": 8, "num_value_heads": 16, "key_head_dim": 128, "value_head_dim": 128,
                        "conv_kernel": 4},
                "moe": None}
SHAPES[GDN_HELDOUT2["name"]] = GDN_HELDOUT2
# and one with as many key as value heads (FLA's rule takes the L2 norm's outputs: no repeated q and k
# copies), multi-head gated attention with 7 heads of 128, FFN 3 H; defined after the terms were final
GDN_HELDOUT3 = dict(GDN_HELDOUT2, name="grid-gdn-h896", hidden=896, ffn=2688, vocab=1024,
                    attention=dict(GDN_HELDOUT2["attention"], num_heads=7, num_kv_groups=7),
                    gdn=dict(GDN_HELDOUT2["gdn"], num_key_heads=8, num_value_heads=8))
SHAPES[GDN_HELDOUT3["name"]] = GDN_HELDOUT3
SHAPES[GDN_FULL_HELDOUT["name"]] = GDN_FULL_HELDOUT
# multi-latent attention with MoE MLPs (deepseek-v2-lite's layer kind): grid-mla-h768's MLA widths
# with grid-moe-h768's experts and a shared expert, a small vocabulary (the layers bind); held out
# for the composed MLA + retained MoE kernel terms (docs/memory-model.md#mla-moe-kernel-models)
MLA_MOE_HELDOUT = {"name": "grid-mla-moe-h768", "hidden": 768, "ffn": 0, "vocab": 3072, "dtype": "bf16",
                   "gated_mlp": True, "tied_embeddings": False, "layers": [["attention", "moe"]] * 2,
                   "attention": dict(MLA_HELDOUT["attention"]), "gdn": None,
                   "moe": {"num_experts": 32, "top_k": 6, "expert_ffn": 384, "shared_expert_ffn": 768}}
# a second held-out MLA + MoE shape, traced after the shared expert's kept term was corrected on
# grid-mla-moe-h768's anatomy (which is then no longer held out): other hidden, heads, MLA widths,
# experts, top-k and shared expert, no query latent
MLA_MOE_HELDOUT2 = {"name": "grid-mla-moe-h640", "hidden": 640, "ffn": 0, "vocab": 2560, "dtype": "bf16",
                    "gated_mlp": True, "tied_embeddings": False, "layers": [["attention", "moe"]] * 2,
                    "attention": {"num_heads": 10, "num_kv_groups": 10, "head_dim": 48, "output_gate": False,
                                  "mla": {"kv_lora_rank": 160, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
                                          "v_head_dim": 32, "q_lora_rank": 0}},
                    "gdn": None, "moe": {"num_experts": 16, "top_k": 4, "expert_ffn": 320, "shared_expert_ffn": 640}}
# grid-mla-moe-h768 and grid-mla-moe-h640 became tuning cells when the tracer's shared expert took
# the fused SwiGLU (both re-traced); two held-out MLA + MoE shapes defined after the shared expert's
# terms were final, each binding at a layer, not the head (small vocabulary): h896 at the last
# layer's forward point (rope 32, a query latent, 24 experts top 4), h512 at its backward (the
# routed experts' transient; a shared expert twice the hidden width)
MLA_MOE_HELDOUT3 = {"name": "grid-mla-moe-h896", "hidden": 896, "ffn": 0, "vocab": 1792, "dtype": "bf16",
                    "gated_mlp": True, "tied_embeddings": False, "layers": [["attention", "moe"]] * 2,
                    "attention": {"num_heads": 14, "num_kv_groups": 14, "head_dim": 64, "output_gate": False,
                                  "mla": {"kv_lora_rank": 224, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32,
                                          "v_head_dim": 64, "q_lora_rank": 448}},
                    "gdn": None, "moe": {"num_experts": 24, "top_k": 4, "expert_ffn": 448, "shared_expert_ffn": 896}}
MLA_MOE_HELDOUT4 = {"name": "grid-mla-moe-h512", "hidden": 512, "ffn": 0, "vocab": 1024, "dtype": "bf16",
                    "gated_mlp": True, "tied_embeddings": False, "layers": [["attention", "moe"]] * 2,
                    "attention": {"num_heads": 8, "num_kv_groups": 8, "head_dim": 64, "output_gate": False,
                                  "mla": {"kv_lora_rank": 128, "qk_nope_head_dim": 48, "qk_rope_head_dim": 16,
                                          "v_head_dim": 48, "q_lora_rank": 256}},
                    "gdn": None, "moe": {"num_experts": 16, "top_k": 4, "expert_ffn": 512, "shared_expert_ffn": 1024}}
# plain attention with MoE MLPs and a shared expert (Qwen2-MoE's kind without the gate: shared FFN
# 4 x the experts'), held out for the shared expert's terms on the retained MoE kernel path at TP1,
# defined after those terms were final; it binds at the last layer's backward (the shared expert's)
MOE_SHARED_HELDOUT = {"name": "grid-moe-shared-h832", "hidden": 832, "ffn": 0, "vocab": 1664, "dtype": "bf16",
                      "gated_mlp": True, "tied_embeddings": False, "layers": [["attention", "moe"]] * 2,
                      "attention": {"num_heads": 13, "num_kv_groups": 13, "head_dim": 64, "output_gate": False},
                      "gdn": None,
                      "moe": {"num_experts": 20, "top_k": 4, "expert_ffn": 416, "shared_expert_ffn": 1664}}
for _shape in (MLA_MOE_HELDOUT, MLA_MOE_HELDOUT2, MLA_MOE_HELDOUT3, MLA_MOE_HELDOUT4,
               MOE_SHARED_HELDOUT):
    SHAPES[_shape["name"]] = _shape
TP_LAYOUTS = ({"tp": 2}, {"tp": 2, "sequence_parallel": True}, {"tp": 4},
              {"tp": 4, "sequence_parallel": True}, {"tp": 8}, {"tp": 8, "sequence_parallel": True})


def _cell(model: str, layout: dict, recompute: str, head: str = "full-native",
          wave: tuple = WAVE) -> dict:
    return {"model": model, "kernels": "te-gpu", "num_layers": 2, "recompute": recompute,
            "lora_rank": LORA_RANK, "seq_lens": list(wave), "layout": layout, "head": head}


def planned_heldout() -> list[dict]:
    """The held-out cells: other presets, the hidden-768 multi-head shape and another wave
    (3000 tokens), full recompute at TP1 (both heads) and TP2/4/8 with and without SP."""
    cells = []
    for model in HELDOUT_PRESETS:
        for head in ("full-native", "full-te"):
            cells.append(_cell(model, {}, "full", head=head, wave=HELDOUT_WAVE))
    for model in (DENSE2["name"], DENSE["name"]):
        cells.append(_cell(model, {}, "full", wave=HELDOUT_WAVE))
        for lay in TP_LAYOUTS:
            cells.append(_cell(model, lay, "full", wave=HELDOUT_WAVE))
    for lay in ({"tp": 4, "sequence_parallel": True}, {"tp": 8}):
        cells.append(_cell("qwen3-8b", lay, "full", wave=HELDOUT_WAVE))
    # traced after the q/k norms' term was corrected on qwen3-32b's TP1 full-te cell above
    for lay in ({"tp": 2}, {"tp": 4, "sequence_parallel": True}, {"tp": 8, "sequence_parallel": True}):
        cells.append(_cell("qwen3-32b", lay, "full", wave=HELDOUT_WAVE))
    cells.append(_cell("qwen3-8b", {"tp": 2}, "full", head="full-te", wave=HELDOUT_WAVE))
    # traced after the retained layer's kernel-model terms (fused_retained_layer) were written
    for model in ("mistral-7b", "qwen3-32b"):
        for rc in ("selective", "none"):
            cells.append(_cell(model, {}, rc, wave=HELDOUT_WAVE))
    for lay in ({}, {"tp": 2}, {"tp": 4, "sequence_parallel": True}, {"tp": 8}):
        for rc in ("selective", "none"):
            cells.append(_cell(DENSE2["name"], lay, rc, wave=HELDOUT_WAVE))
    cells.append(_cell("qwen3-8b", {"tp": 2, "sequence_parallel": True}, "selective", wave=HELDOUT_WAVE))
    cells.append(_cell("qwen3-32b", {"tp": 8, "sequence_parallel": True}, "none", wave=HELDOUT_WAVE))
    # traced after the ring attention's release (fused_retained_layer ring_release) was written:
    # TP1 under CP on the multi-rank tracer, the other dense shapes
    for rc in RECOMPUTES:
        cells.append(_cell(DENSE2["name"], {"cp": 2}, rc, wave=HELDOUT_WAVE))
    for model, cp, rc in ((DENSE3["name"], 2, "none"), (DENSE3["name"], 2, "selective"),
                          (DENSE2["name"], 4, "none")):
        cells.append(_cell(model, {"cp": cp}, rc, wave=HELDOUT_WAVE))
    # traced after the MoE layers' kept tensors (fused_retained_layer moe_ keys) were written; their
    # backward, forward point and caller were corrected on these cells' estimates (not held out
    # for those: docs/memory-model.md#gpu-kernel-allocation-models)
    for model in ("mixtral-8x7b", "qwen3-235b-a22b", MOE_WIDE["name"], MOE["name"]):
        for rc in ("selective", "none"):
            cells.append(_cell(model, {}, rc, wave=HELDOUT_WAVE))
    # traced after every MoE term was final
    for model in (MOE_HELDOUT["name"], "qwen3-30b-a3b"):
        for rc in ("selective", "none"):
            cells.append(_cell(model, {}, rc, wave=HELDOUT_WAVE))
    # MoE under full recompute (fitted terms; docs/memory-model.md#gpu-kernel-allocation-models)
    for model in (MOE_HELDOUT["name"], "mixtral-8x7b", "qwen3-235b-a22b", "qwen3-30b-a3b"):
        cells.append(_cell(model, {}, "full", wave=HELDOUT_WAVE))
    # traced after retained plain-attention MoE layers under TP with SP took the kernel-model
    # terms (fused_retained_layer moe_gathered, moe_sharded): the held-out MoE shape at TP2+SP
    for rc in ("none", "selective"):
        cells.append(_cell(MOE_HELDOUT["name"], {"tp": 2, "sequence_parallel": True}, rc, wave=HELDOUT_WAVE))
    # traced after TP > 1 under CP took the kernel-model terms (layers.context: fused_point,
    # fused_retained at any TP under CP; layout_residual tp2-cp2): another dense shape
    for rc in RECOMPUTES:
        cells.append(_cell(DENSE2["name"], {"tp": 2, "cp": 2}, rc, wave=HELDOUT_WAVE))
    # traced after the MLA layers' kernel-model terms (fused_mla_layer) were final: the held-out
    # MLA shape (a query latent) and deepseek-v2-lite's dense-MLA layer, at the held-out wave
    for model in (MLA_HELDOUT["name"], MLA_DSV2["name"]):
        for rc in RECOMPUTES:
            cells.append(_cell(model, {}, rc, wave=HELDOUT_WAVE))
    # GDN hybrids: traced after the retained GDN and gated attention layers took the kernel-model
    # terms (fused_gdn_layer, TP1 CP1): bench/gdn_grid.py's held-out shape (hidden 768, 4 key and 8
    # value heads, multi-head gated attention), never traced with the te-gpu kernels before
    # (its TP1 none and selective cells are tuning cells since the terms were tightened on their
    # walk points: `planned`)
    cells.append(_cell(GDN_HELDOUT["name"], {}, "full", wave=HELDOUT_WAVE))
    cells.append(_cell(GDN_HELDOUT["name"], {"tp": 2, "sequence_parallel": True}, "full", wave=HELDOUT_WAVE))
    # traced after retained plain-attention MoE layers under TP with SP took the kernel-model terms
    # written from grid-moe-h768's anatomy at TP2+SP (fused_retained_layer moe_gathered,
    # moe_sharded, moe_sp_*): the hidden-1024 MoE shape at TP2+SP (its layers bind)
    for rc in ("none", "selective"):
        cells.append(_cell(MOE_WIDE["name"], {"tp": 2, "sequence_parallel": True}, rc, wave=HELDOUT_WAVE))
    # traced after retained MoE layers under EP at TP1 took the kernel-model terms (written from
    # grid-moe-h1024 EP2 none): the held-out MoE shape at EP2 (its layers bind)
    cells.append(_cell(MOE_HELDOUT["name"], {"ep": 2}, "none", wave=HELDOUT_WAVE))
    # traced after the te-gpu ring model ran flash-attn's varlen kernel at each step and the ring's
    # terms took its form (ring_backward_flash, ring_mlp_freed, ring_recomputed_release): a CP shape
    # of its own
    for rc in RECOMPUTES:
        cells.append(_cell(DENSE_CP_HELDOUT["name"], {"cp": 2}, rc, wave=HELDOUT_WAVE))
    # traced after the retained GDN hybrid's terms were tightened on grid-gdn-h1024's window anatomy
    # (fused_gdn_layer attention_forward, mlp_output_freed, mlp_freed, gate_per_row): a GDN shape of
    # its own at TP1 (its layers bind)
    for rc in ("none", "selective"):
        cells.append(_cell(GDN_HELDOUT2["name"], {}, rc, wave=HELDOUT_WAVE))
    for rc in ("none", "selective"):
        cells.append(_cell(GDN_HELDOUT3["name"], {}, rc, wave=HELDOUT_WAVE))
    # traced after GDN hybrids under full recompute took the kernel-model point (fused_gdn_point,
    # written from grid-gdn-h1024's anatomy): a GDN shape of its own, and the 27B at the held-out
    # wave (it binds at the head, which dropped the seeds' GDN margin)
    cells.append(_cell(GDN_FULL_HELDOUT["name"], {}, "full", wave=HELDOUT_WAVE))
    cells.append(_cell("qwen3.8-27b", {}, "full", wave=HELDOUT_WAVE))
    return cells


def planned() -> list[dict]:
    """Every cell of the grid, in order (seq_lens before padding to the layout's rows)."""
    cells = []
    for model in PRESETS + (DENSE["name"], DENSE3["name"], GDN["name"]):
        for rc in RECOMPUTES:
            cells.append(_cell(model, {}, rc))
    for model in ("qwen3-8b", "llama-3.1-8b", "qwen2.5-7b", DENSE["name"]):
        cells.append(_cell(model, {}, "full", head="full-te"))
    for model in (DENSE["name"], DENSE3["name"]):
        for lay in TP_LAYOUTS:
            for rc in RECOMPUTES:
                cells.append(_cell(model, lay, rc))
    for lay in ({"tp": 2, "sequence_parallel": True}, {"tp": 4, "sequence_parallel": True}):
        cells.append(_cell(GDN["name"], lay, "full"))
    for rc in ("full", "selective"):
        cells.append(_cell("qwen3.8-27b", {"tp": 4, "sequence_parallel": True}, rc))
    for cp in (2, 4):   # context parallelism: the multi-rank tracer (ring attention model)
        for rc in RECOMPUTES:
            cells.append(_cell(DENSE["name"], {"cp": cp}, rc))
    # the classes that keep fitted terms, traced as evidence of them: MoE under full recompute at
    # TP1 (one rank), and on the multi-rank tracer MoE at TP2+SP and EP2, TP2 under CP2
    for model in (MOE["name"], MOE_WIDE["name"]):
        cells.append(_cell(model, {}, "full"))
    for lay in ({"tp": 2, "sequence_parallel": True}, {"ep": 2}):
        for rc in RECOMPUTES:
            cells.append(_cell(MOE["name"], lay, rc))
    for rc in RECOMPUTES:
        cells.append(_cell(DENSE["name"], {"tp": 2, "cp": 2}, rc))
    # multi-latent attention with dense MLPs (the MLA layers' kernel-model terms were written on these)
    for rc in RECOMPUTES:
        cells.append(_cell(MLA_DENSE["name"], {}, rc))
    # retained MoE under EP whose layers bind (grid-moe-h512's EP2 cells bind at the head): the
    # anatomy the EP kernel-model terms were written from (fused_moe_retained at TP1 with EP)
    cells.append(_cell(MOE_WIDE["name"], {"ep": 2}, "none"))
    # grid-gdn-h768 retained at TP1 (held out until its walk points were read while the retained
    # GDN terms were tightened; traced at the held-out wave)
    for rc in ("none", "selective"):
        cells.append(_cell(GDN_HELDOUT["name"], {}, rc, wave=HELDOUT_WAVE))
    return cells


def tp1_cell(model: str, recompute: str) -> dict:
    """The first TP1 cell (held out, then the grid) of `model` at `recompute`; exits with a line
    naming them when there is none (the anatomy scripts' cell)."""
    for cell in planned_heldout() + planned():
        if cell["model"] == model and cell["recompute"] == recompute and not cell["layout"]:
            return cell
    raise SystemExit(f"model/recompute: no TP1 te-gpu grid cell {model} {recompute}")


def geometry_of(model: str):
    from waveplan.pricing.geometry import ModelGeometry
    from waveplan.pricing.presets import load_preset

    return (ModelGeometry.from_dict(SHAPES[model]) if model in SHAPES else load_preset(model))


def cell_key(cell: dict) -> str:
    """The cell's identity: model, layout (as `ParallelLayout` spells it, with the data-parallel
    ranks the multi-rank tracer adds for EP: `multirank.rank_world`), recompute, head."""
    from waveplan.pricing.measure.multirank import rank_world
    from waveplan.pricing.parallel import ParallelLayout

    layout = rank_world(ParallelLayout(**cell["layout"])).to_dict()
    return json.dumps([cell["model"], layout, cell["recompute"], cell["head"],
                       cell["lora_rank"], cell["num_layers"]], sort_keys=True)


def _load(path: Path | None = None) -> list[dict]:
    path = path or TRACES
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write(records: list[dict], path: Path | None = None) -> None:
    path = path or TRACES
    records = sorted(records, key=lambda r: cell_key(r["cell"]))
    write_text_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))


def cmd_trace(args) -> int:
    from waveplan.pricing.measure.trace import trace_wave
    from waveplan.pricing.parallel import ParallelLayout, Recompute

    path = HELDOUT_TRACES if args.heldout else TRACES
    records = _load(path)
    have = {cell_key(r["cell"]) for r in records}
    todo = [c for c in (planned_heldout() if args.heldout else planned()) if cell_key(c) not in have
            and (not args.only or c["model"] in args.only)]
    t_all = time.monotonic()
    multi = [c for c in todo if multi_rank(c)]
    groups: dict[str, list[dict]] = {}   # one set of rank processes per model and layout
    for c in multi:
        groups.setdefault(json.dumps([c["model"], c["layout"]], sort_keys=True), []).append(c)
    for cell in todo:
        if cell in multi:
            continue
        t0 = time.monotonic()
        layout = ParallelLayout(**cell["layout"])
        tr = trace_wave(geometry_of(cell["model"]), seq_lens=cell["seq_lens"], num_layers=2,
                        device="cpu-fake", recompute=Recompute(mode=cell["recompute"]),
                        lora_rank=LORA_RANK, head=cell["head"], layout=layout, kernels="te-gpu")
        rec_cell = dict(cell, seq_lens=list(tr.seq_lens), layout=layout.to_dict())
        records.append({"cell": rec_cell, "trace": tr.to_dict()})
        _write(records, path)
        print(f"{cell['model']} {cell['layout']} {cell['recompute']} {cell['head']}: "
              f"{tr.peak_bytes / 2**20:.1f} MiB, {time.monotonic() - t0:.0f} s", flush=True)
    for group in groups.values():
        from waveplan.pricing.measure.multirank import TraceJob, trace_multirank_batch, trace_record

        t0 = time.monotonic()
        layout = ParallelLayout(**group[0]["layout"])
        jobs = [TraceJob(seq_lens=tuple(c["seq_lens"]), recompute=Recompute(mode=c["recompute"]),
                         lora_rank=LORA_RANK) for c in group]
        traces = trace_multirank_batch(geometry_of(group[0]["model"]), layout=layout, jobs=jobs,
                                       num_layers=2, kernels="te-gpu", timeout_s=3600.0)
        for cell, tr in zip(group, traces, strict=True):
            rec = trace_record(tr, geometry_of(cell["model"]), model=cell["model"])
            records.append({"cell": dict(cell, seq_lens=rec["cell"]["seq_lens"],
                                         layout=rec["cell"]["layout"]), "trace": rec["trace"]})
        _write(records, path)
        print(f"{group[0]['model']} {group[0]['layout']}: {len(group)} multi-rank cells, "
              f"{time.monotonic() - t0:.0f} s", flush=True)
    print(f"{len(todo)} cells traced in {time.monotonic() - t_all:.0f} s")
    return 0


def has_gdn(cell: dict) -> bool:
    from waveplan.pricing.geometry import MixerKind

    return any(s.mixer == MixerKind.GDN for s in geometry_of(cell["model"]).layers[:cell["num_layers"]])


def has_moe(cell: dict) -> bool:
    from waveplan.pricing.geometry import MlpKind

    return any(s.mlp == MlpKind.MOE for s in geometry_of(cell["model"]).layers[:cell["num_layers"]])


def has_mla(cell: dict) -> bool:
    att = geometry_of(cell["model"]).attention
    return att is not None and att.mla is not None


def multi_rank(cell: dict) -> bool:
    """Whether the cell runs on the multi-rank tracer: CP or EP > 1, or MoE at TP > 1 (the
    one-rank tracer's fake process group runs MoE at TP = EP = 1 only)."""
    lay = cell["layout"]
    return (lay.get("cp", 1) > 1 or lay.get("ep", 1) > 1
            or (lay.get("tp", 1) > 1 and has_moe(cell)))


def class_of(cell: dict) -> str:
    """The cell's class (GDN hybrids apart: their GDN layers run FLA's allocation model; retained
    at TP1 CP1 they are priced by the kernel models, recomputed at TP1 CP1 by the kernel models'
    point, elsewhere by the fitted terms)."""
    lay = cell["layout"]
    if has_gdn(cell):
        kernel = lay.get("tp", 1) == 1 and lay.get("cp", 1) == 1 and not has_moe(cell)
        if kernel and cell["recompute"] == "full":
            return "GDN hybrids TP1 full (kernel models)"
        return "GDN hybrids " + ("TP1 retained (kernel models)" if kernel else "(fitted)")
    tp = lay.get("tp", 1)
    if lay.get("cp", 1) > 1:
        return "TP1 under CP2/4 (multi-rank)" if tp == 1 else "TP2 under CP2 (multi-rank)"
    kept = "full (fitted)" if cell["recompute"] == "full" else "retained (multi-rank)"
    if lay.get("ep", 1) > 1:
        return "MoE EP2 " + kept
    if tp > 1 and has_moe(cell):
        return "MoE TP2+SP " + kept
    if tp == 1 and has_mla(cell) and not has_moe(cell):
        return "MLA TP1 dense MLP " + ("full" if cell["recompute"] == "full" else "selective/none")
    if cell["recompute"] == "full":
        if tp == 1 and has_moe(cell):
            return "MoE TP1 full (fitted)"
        if tp == 1:
            return "TP1 full, " + ("TE cross entropy" if cell["head"] == "full-te" else "native CE")
        return "TP2/4/8 full" + (" +SP" if lay.get("sequence_parallel") else "")
    return ("TP1" if tp == 1 else "TP2/4/8") + " selective/none"


def estimates(cell: dict, moe_load: float | None = None) -> dict:
    """te-gpu and torch-cpu raw estimates of a cell (under EP at the default worst-case routing
    load, or `moe_load`)."""
    g = geometry_of(cell["model"])
    return {t: current_estimate(cell, table=t, head=cell["head"], geometry=g, moe_load=moe_load)
            for t in ("te-gpu", "torch-cpu")}


def _summary(v: list[float]) -> str:
    v = sorted(v)
    return (f"{len(v):>3} {sum(1 for x in v if x < 1):>5}  {v[0]:.3f}  {statistics.median(v):.3f}  "
            f"{v[-1]:.3f}")


# EP cells priced at the routing the trace ran (balanced: moe_load 1) as well as at the default
# worst-case load: the first checks the layer terms, the second is the load bound
# (docs/memory-model.md#expert-parallel)
AT_TRACED_LOAD = " at the trace's load"


def report_lines(records: list[dict]) -> list[str]:
    lines = ["te-gpu grid: traces with the GPU kernels' allocation models (cpu-fake, one rank,",
             "kernels te-gpu; bench/results/traces_te_gpu.jsonl) beside today's raw estimates",
             "(WavePricer, one first gradient wave, safety 1.0). ratio = estimate / traced peak",
             "(< 1: under). MiB = 2**20 bytes.", "",
             f"{'model':<18} {'layout':<9} {'recompute':<9} {'head':<11} {'traced MiB':>10} "
             f"{'te-gpu':>7} {'cpu':>7}  te-gpu basis"]
    by_class: dict[str, dict[str, list[float]]] = {}
    for rec in sorted(records, key=lambda r: (class_of(r["cell"]), cell_key(r["cell"]))):
        cell, tr = rec["cell"], rec["trace"]
        est = estimates(cell)
        lay = cell["layout"]
        ratios = {t: e["raw_bytes"] / tr["peak_bytes"] for t, e in est.items()}
        for t, r in ratios.items():
            by_class.setdefault(class_of(cell), {}).setdefault(t, []).append(r)
        if lay.get("ep", 1) > 1:
            for t, e in estimates(cell, moe_load=1.0).items():
                by_class.setdefault(class_of(cell) + AT_TRACED_LOAD, {}).setdefault(t, []).append(
                    e["raw_bytes"] / tr["peak_bytes"])
        name = f"TP{lay['tp']}" + ("+SP" if lay["sequence_parallel"] else "") + (
            f"+CP{lay['cp']}" if lay["cp"] > 1 else "") + (f"+EP{lay['ep']}" if lay.get("ep", 1) > 1 else "")
        lines.append(f"{cell['model']:<18} {name:<9} {cell['recompute']:<9} {cell['head']:<11} "
                     f"{tr['peak_bytes'] / 2**20:>10.1f} {ratios['te-gpu']:>7.3f} "
                     f"{ratios['torch-cpu']:>7.3f}  {est['te-gpu']['basis']}")
    width = max(len(name) for name in by_class)
    lines += ["", "per class, estimate / traced: cells, under, min, median, max",
              f"  {'class':<{width}} {'te-gpu table':<36} torch-cpu table"]
    for name in sorted(by_class):
        c = by_class[name]
        lines.append(f"  {name:<{width}} {_summary(c['te-gpu']):<36} {_summary(c['torch-cpu'])}")
    return lines


def cmd_report(args) -> int:
    path, out = (HELDOUT_TRACES, HELDOUT_SUMMARY) if args.heldout else (TRACES, SUMMARY)
    records = _load(path)
    if not records:
        print(f"no traces in {path}; run `trace` first", file=sys.stderr)
        return 1
    lines = report_lines(records)
    if args.heldout:
        lines[0] = "te-gpu held-out grid (traced after the te-gpu terms were final): " + lines[0]
    write_text_atomic(out, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trace")
    t.add_argument("--only", nargs="*", default=None, help="models to trace (default all)")
    t.add_argument("--heldout", action="store_true", help="the held-out cells (planned_heldout)")
    t.set_defaults(func=cmd_trace)
    r = sub.add_parser("report")
    r.add_argument("--heldout", action="store_true", help="report the held-out cells")
    r.set_defaults(func=cmd_report)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
