"""Expert-parallel MoE terms (pricing/moe_terms.py): the busiest EP rank's load, the all-to-all
buffers, the opt-in assumed load, and the multi-rank MoE traces none of which may be priced under."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from waveplan.pricing import moe_terms
from waveplan.pricing.coefficients import load_table
from waveplan.pricing.errors import ConfigError
from waveplan.pricing.geometry import ModelGeometry, MoeSpec
from waveplan.pricing.lora import LoraConfig, LoraSlot
from waveplan.pricing.model import PricingModel, layer_widths
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.presets import load_preset
from waveplan.pricing.price import GroupLoad, price_groups
from waveplan.pricing.step import Request, Step
from waveplan.pricing.wave_pricer import WavePricer

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def test_worst_case_load_is_every_rank_sending_its_most_to_one_rank():
    moe = MoeSpec(num_experts=128, top_k=8, expert_ffn=768)
    assert moe_terms.worst_case_load(moe, 1) == 1.0
    # 64 / 32 / 16 local experts >= top 8: every choice of every rank's token can land on one rank
    assert [moe_terms.worst_case_load(moe, ep) for ep in (2, 4, 8)] == [2.0, 4.0, 8.0]
    # 4 local experts < top 8: at most 4 of a token's 8 distinct choices reach one rank
    small = MoeSpec(num_experts=32, top_k=8, expert_ffn=192)
    assert moe_terms.worst_case_load(small, 8) == 4.0
    assert moe_terms.worst_case_load(MoeSpec(num_experts=8, top_k=8, expert_ffn=64), 8) == 1.0


def test_assumed_load_is_capped_at_the_worst_case_and_checked():
    moe = MoeSpec(num_experts=16, top_k=4, expert_ffn=512)
    assert moe_terms.busiest_rank_load(moe, 4) == 4.0
    assert moe_terms.busiest_rank_load(moe, 4, 1.25) == 1.25
    assert moe_terms.busiest_rank_load(moe, 2, 9.0) == 2.0
    for bad_load in (0.5, float("nan"), float("inf"), True, "1.5"):
        with pytest.raises(ConfigError, match="moe_load"):
            moe_terms.check_assumed_load(bad_load)


def test_dispatch_buffer_only_with_an_all_to_all():
    widths = {"H": 1024}
    assert moe_terms.dispatch_per_routed_row(widths, 1) == 0.0
    assert moe_terms.dispatch_per_routed_row(widths, 2) == moe_terms.dispatch_per_routed_row(widths, 8) == 2048.0
    # under TP (with SP) each rank receives 1/TP of the routed rows, then all-gathers them over TP
    assert moe_terms.dispatch_per_routed_row(widths, 2, 2) == 2048.0 / 2 + 2048.0
    assert moe_terms.dispatch_per_routed_row(widths, 1, 4) == 2048.0
    # the sort copy: the CPU table carries it, te-gpu's fitted stage already holds it
    g = load_preset("qwen3-30b-a3b")
    w = layer_widths(g, tp=1)
    assert moe_terms.permutation_per_routed_row(load_table("torch-cpu"), w) == 2 * g.hidden
    assert moe_terms.permutation_per_routed_row(load_table("te-gpu"), w) == 0.0


def _price(model: PricingModel, rows: int = 4096) -> int:
    group = GroupLoad(packed_rows=rows, padded_rows=rows, logical_rows=rows, segments=4)
    return price_groups(model, [group], first_slots=frozenset({"default"})).raw_bytes


@pytest.mark.parametrize("backend", ["te-gpu", "torch-cpu"])
def test_assumed_load_is_opt_in_named_in_the_basis_and_never_above_the_default(backend):
    g = load_preset("qwen3-30b-a3b")
    prices = {}
    for ep in (1, 2, 4, 8):
        default = PricingModel.build(g, parallel=ParallelLayout(ep=ep), backend=backend)
        assumed = PricingModel.build(g, parallel=ParallelLayout(ep=ep), backend=backend, moe_load=1.0)
        prices[ep] = _price(default)
        assert default.basis == "evidence" and default.reasons == ()
        assert _price(assumed) <= prices[ep]
        if ep == 1:
            assert assumed.basis == "evidence"   # nothing to assume without an all-to-all
            assert _price(assumed) == prices[1]
        else:
            assert assumed.basis == "assumed"
            assert len(assumed.reasons) == 1 and "MoE load 1 assumed (opt-in" in assumed.reasons[0]
            assert f"worst case {ep:g}" in assumed.reasons[0]
            assert price_groups(assumed, [GroupLoad(packed_rows=8, padded_rows=8, logical_rows=8,
                                                    segments=1)]).basis == "assumed"
    # the worst-case load grows with EP (more ranks can send to the busiest one)
    assert prices[1] < prices[2] < prices[4] < prices[8]
    with pytest.raises(ConfigError, match="moe_load"):
        PricingModel.build(g, parallel=ParallelLayout(ep=2), backend=backend, moe_load=0.9)


def _traced_moe_cells() -> list[dict]:
    out = []
    for name in ("traces_multirank.jsonl", "traces_multirank_ep.jsonl"):
        path = RESULTS / name
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [rec for rec in out if rec["cell"]["geometry"]["moe"]]


def test_no_traced_moe_cell_is_priced_under_its_busiest_rank():
    """Every multi-rank MoE cell (TP1, EP2/4/8, TP2+SP+EP2; balanced and Megatron's router;
    full, selective, none) at its own layout, default load, torch-cpu table: never under; the
    balanced EP cells also with the opt-in load 1 they ran."""
    table = load_table("torch-cpu")
    cells = _traced_moe_cells()
    assert len(cells) >= 84
    for rec in cells:
        cell, trace = rec["cell"], rec["trace"]
        g = ModelGeometry.from_dict(cell["geometry"])
        g = dataclasses.replace(g, layers=g.layers[:cell["num_layers"]])
        step = Step.from_requests([Request(id=f"r{i}", num_tokens=int(n)) for i, n in enumerate(cell["seq_lens"])])
        loads = [None] + ([1.0] if cell["routing"] == "balanced" and cell["layout"]["ep"] > 1 else [])
        for load in loads:
            model = PricingModel(geometry=g, parallel=ParallelLayout(**cell["layout"]),
                                 recompute=Recompute(mode=cell["recompute"]),
                                 lora=LoraConfig(slots=(LoraSlot(rank=cell["lora_rank"]),), grad_bytes=2),
                                 table=table, head="full-native", safety=1.0, moe_load=load)
            raw = WavePricer.build(step, model, profiled=True).price(
                [np.arange(len(step.requests))], first_slots=frozenset({"default"})).raw_bytes
            assert raw >= trace["peak_bytes"], (cell["geometry"]["name"], cell["layout"], cell["routing"],
                                                cell["recompute"], load, raw / trace["peak_bytes"])
