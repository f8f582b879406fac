"""The layer-kind registry (pricing.layers): every layer of every preset has a kind with a
pricer, each pricer gives the three figures, and every kind is exercised by a bundled preset."""

from __future__ import annotations

import re
from pathlib import Path

from waveplan.pricing.layers import PRICERS, LayerKind, kind_of, pricer_for
from waveplan.pricing.model import PricingModel
from waveplan.pricing.parallel import ParallelLayout, Recompute
from waveplan.pricing.presets import list_presets, load_preset

ROOT = Path(__file__).resolve().parents[2]


def test_every_kind_has_a_pricer_with_its_three_figures():
    assert set(PRICERS) == set(LayerKind)
    for kind, pricer in PRICERS.items():
        for name in ("stage", "retained", "residual_covered"):
            assert callable(getattr(pricer, name, None)), (kind, name)


def test_every_preset_layer_has_a_kind_and_every_kind_a_preset():
    seen = set()
    for name in list_presets():
        g = load_preset(name)
        for layer in g.layers:
            kind = kind_of(g, layer)
            assert pricer_for(g, layer) is PRICERS[kind]
            seen.add(kind)
    assert seen == set(LayerKind), set(LayerKind) - seen


def test_each_kinds_stage_is_what_the_model_charges():
    """Under full recompute (one layer at a time) a layer's workspace is its kind's stage plus
    what lies beside every layer (the features' and dispatcher's extras, the layout residual
    where no structural point, the RoPE cache): equal across layers of one kind."""
    for name in ("qwen3.8-27b", "qwen3.6-35b-a3b", "deepseek-v2-lite"):
        g = load_preset(name)
        m = PricingModel.build(g, parallel=ParallelLayout(), recompute=Recompute(mode="full"),
                               backend="torch-cpu")
        ctx = m.layer_context()
        by_kind = {}
        for i, layer in enumerate(g.layers):
            stage, _ = pricer_for(g, layer).stage(ctx, layer)
            by_kind.setdefault(kind_of(g, layer), set()).add(
                round(float(m.charges.walk.workspace[i]) - stage, 6))
        assert all(len(v) == 1 for v in by_kind.values()), (name, by_kind)


def test_no_string_keyed_reads_of_a_models_charges():
    pattern = re.compile(r"\.arrays\b|\barrays\[\"")
    hits = [f"{p.relative_to(ROOT)}:{n}" for folder in ("pricing", "search", "planner")
            for p in sorted((ROOT / folder).rglob("*.py"))
            for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []
