"""`waveplan inspect`: a model's geometry, the basis its prices get at a layout (with a
conservative basis's reasons on the line), and a step's prefix-tree statistics."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np

from waveplan.pricing.geometry import ModelGeometry
from waveplan.pricing.kernel_set import Framework
from waveplan.pricing.layout import layout
from waveplan.pricing.step import Step, bundled_step, list_bundled_steps, load_step

from .cli_common import add_model_args, fsdp_words, model_from_args
from .ep_peers import single_rank_note

DEFAULT_MODEL = "qwen3.8-27b"
DEFAULT_STEP = "grpo-8x8"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect", help="show a model's geometry and a step's statistics",
        description="Show a model's geometry and a step's prefix-tree statistics.")
    add_model_args(parser, default_model=DEFAULT_MODEL)
    parser.add_argument("--step", default=DEFAULT_STEP, metavar="FILE",
                        help="a step file (JSON Lines) or a bundled step name "
                             f"({', '.join(list_bundled_steps())}; default {DEFAULT_STEP})")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def resolve_step(spec: str) -> tuple[Step, str]:
    """(step, where it came from): an existing file wins over a bundled name of the same name."""
    path = Path(spec)
    if not path.is_file() and spec.removesuffix(".jsonl") in list_bundled_steps():
        path = bundled_step(spec)
    return load_step(path), str(path)


def step_stats(step: Step) -> dict:
    """Step statistics; counts are for full sharing of all the step's requests."""
    full = layout(step, np.arange(step.num_requests))
    return {
        "requests": step.num_requests,
        "groups": step.num_groups,
        "packed_tokens": full.packed_rows,
        "logical_tokens": full.logical_rows,
        "segments": full.segments,
        "sequences": full.num_sequences,
        "slots": list(step.slot_names),
        "grad_requests": int(step.grads.sum()),
        "form": "token" if step.is_token_form else "length",
    }


def _layer_kinds(geometry: ModelGeometry) -> str:
    kinds = Counter(f"{layer.mixer.value}/{layer.mlp.value}" for layer in geometry.layers)
    return ", ".join(f"{count} {kind}" for kind, count in kinds.items())


def geometry_lines(geometry: ModelGeometry) -> list[str]:
    g = geometry
    lines = [
        f"model      {g.name} ({g.dtype})",
        f"layers     {g.num_layers}: {_layer_kinds(g)}",
        f"hidden     {g.hidden:,}",
        f"ffn        {g.ffn:,}" + (" (gated)" if g.gated_mlp and g.ffn else ""),
        f"vocab      {g.vocab:,}" + (" (tied embeddings)" if g.tied_embeddings else ""),
    ]
    if g.attention is not None and g.attention.mla is not None:
        a, m = g.attention, g.attention.mla
        lines.append(f"attention  multi-latent, {a.num_heads} heads, q/k head dim {m.qk_nope_head_dim}"
                     f"+{m.qk_rope_head_dim} (rotary), v head dim {m.v_head_dim}, kv latent "
                     f"{m.kv_lora_rank}, " + (f"q latent {m.q_lora_rank}" if m.q_lora_rank
                                              else "no q latent"))
    elif g.attention is not None:
        a = g.attention
        lines.append(f"attention  {a.num_heads} heads, {a.num_kv_groups} KV groups, head dim "
                     f"{a.head_dim}" + (", output gate" if a.output_gate else ""))
    if g.gdn is not None:
        d = g.gdn
        lines.append(f"gdn        {d.num_key_heads} key heads x {d.key_head_dim}, "
                     f"{d.num_value_heads} value heads x {d.value_head_dim}, "
                     f"conv kernel {d.conv_kernel}")
    if g.moe is not None:
        m = g.moe
        lines.append(f"moe        {m.num_experts} experts, top {m.top_k}, expert ffn {m.expert_ffn:,}"
                     + (f", shared expert ffn {m.shared_expert_ffn:,}" if m.shared_expert_ffn else ""))
    features = feature_words(g)
    if features:
        lines.append(f"features   {', '.join(features)}")
    return lines


def feature_words(geometry: ModelGeometry) -> list[str]:
    """What the model's family changes beyond its shapes, in words (empty for the baseline)."""
    f = geometry.features
    words = []
    if f.qk_norm is not None:
        words.append("q/k norms" if f.qk_norm else "no q/k norms")
    if f.qkv_bias:
        words.append("q/k/v biases")
    if f.linear_bias:
        words.append("biases on every linear")
    if f.sliding_window:
        period = f.full_attention_interval
        words.append(f"sliding window {f.sliding_window:,}"
                     + (f" (full attention every {period} layers)" if period else " on every layer"))
    if f.attention_sinks:
        words.append("attention sinks")
    if f.attention_softcap:
        words.append(f"attention soft-cap {f.attention_softcap:g}")
    if f.final_softcap:
        words.append(f"final-logit soft-cap {f.final_softcap:g}")
    if f.embedding_scale:
        words.append("scaled embeddings")
    if f.sandwich_norms:
        words.append("sandwich norms")
    for flag, word in ((f.residual_scale, "scaled residual branches"), (f.logit_scale, "scaled logits"),
                       (f.post_norms, "post-norms"), (f.shared_expert_gate, "gated shared expert")):
        if flag:
            words.append(word)
    if f.nope_layers:
        words.append(f"{f.nope_layers} NoPE layers")
    if f.read_as:
        words.append(f"model_type {f.read_as} read by opt-in")
    if f.mlp_activation.value != "swiglu":
        words.append(f"{f.mlp_activation.value} MLP")
    if f.router_score.value != "softmax" or f.router_groups > 1:
        words.append(f"{f.router_score.value} routing"
                     + (f" in {f.router_group_top_k} of {f.router_groups} groups" if f.router_groups > 1 else ""))
    return words


def step_lines(step: Step, source: str, stats: dict) -> list[str]:
    lengths = step.lengths
    ratio = stats["logical_tokens"] / stats["packed_tokens"]
    return [
        f"step       {source} ({stats['form']} form)",
        f"requests   {stats['requests']} in {stats['groups']} prefix groups; "
        f"{stats['grad_requests']} with grad; slots {', '.join(stats['slots'])}",
        f"lengths    min {lengths.min():,}, median {int(np.median(lengths)):,}, max {lengths.max():,}",
        f"tokens     {stats['logical_tokens']:,} logical, {stats['packed_tokens']:,} packed "
        f"(full sharing, {ratio:.2f}x)",
        f"segments   {stats['segments']} (full sharing; {stats['requests']} without sharing) "
        f"in {stats['sequences']} packed sequences",
    ]


def layout_words(model) -> str:
    """'TP4 SP CP2, full recompute, te-gpu': the layout, recompute and table a basis is for."""
    fsdp = fsdp_words(model)
    if fsdp is not None:
        return f"{fsdp}, {model.table.backend}"
    p = model.parallel
    words = f"TP{p.tp}{' SP' if p.sequence_parallel else ''} CP{p.cp}"
    words += f" PP{p.pp}" if p.pp > 1 else ""
    words += f" EP{p.ep}" if p.ep > 1 else ""
    words += f" ETP{p.etp}" if p.etp is not None else ""
    return f"{words}, {model.recompute.mode.value} recompute, {model.table.backend}"


def basis_line(model) -> str:
    """The basis of the model's prices, with a conservative basis's reasons (and the layout an
    untraced one is credited as) on the same line, as the plan table prints them."""
    text = f"basis      {model.basis} ({layout_words(model)})"
    if model.basis != "conservative":
        return text
    c = model.credit
    credit = (f"; priced as TP{c.tp}{' SP' if c.sequence_parallel else ''} CP{c.cp}"
              if model.layout_gaps else "")
    return f"{text}: {'; '.join(model.gaps)}{credit}"


def run(args: argparse.Namespace) -> int:
    model = model_from_args(args)
    geometry = model.geometry
    step, source = resolve_step(args.step)
    stats = step_stats(step)
    ep_note = single_rank_note(model)   # what a plan made on one rank assumes at EP > 1
    fsdp = model.framework is Framework.FSDP
    if args.json:
        extra = {"ep_peers": ep_note} if ep_note is not None else {}
        if fsdp:
            from waveplan.pricing.fsdp.describe import fsdp_view

            extra["fsdp"] = fsdp_view(model)
        print(json.dumps({"model": geometry.to_dict(), "step": source, **stats, "basis": model.basis,
                          "reasons": list(model.gaps), "kernel_models": list(model.kernel_basis),
                          "layout": model.parallel.to_dict(),
                          "recompute": model.recompute.mode.value, **extra}, indent=2))
    else:
        notes = [f"ep peers   {ep_note}"] if ep_note is not None else []
        # the figures resting on the fused kernels' allocation models, not GPU traces
        notes += [f"kernels    {line}" for line in model.kernel_basis]
        if fsdp:
            from waveplan.pricing.fsdp.describe import fsdp_lines

            notes = fsdp_lines(model) + notes
        print("\n".join(geometry_lines(geometry) + [basis_line(model)] + notes + [""]
                        + step_lines(step, source, stats)))
    return 0
