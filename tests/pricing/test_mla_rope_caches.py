"""Multi-latent attention fills one RoPE cache entry per layer (docs/memory-model.md#mla-rope-caches)."""

import dataclasses

import pytest

from waveplan.pricing import layer_arrays, rope_cache
from waveplan.pricing.model import PricingModel
from waveplan.pricing.pipeline import rope_cache_instances, rope_cache_per_row
from waveplan.pricing.presets import load_preset
from waveplan.pricing.price import GroupLoad, price_groups


def one_group(rows):
    return GroupLoad(slot="default", grad=True, packed_rows=rows, padded_rows=rows,
                     logical_rows=rows, segments=1, longest_rows=rows)


@pytest.mark.parametrize("name,expected", [("qwen3-8b", 1), ("deepseek-v2-lite", 27), ("deepseek-v3", 32)])
def test_instances_one_per_mla_layer_at_most_the_caches_32(name, expected):
    g = load_preset(name)
    assert rope_cache_instances(g, g.layers) == expected


@pytest.mark.parametrize("backend", ["torch-cpu", "te-gpu"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_call_holds_every_mla_layers_entry(monkeypatch, backend, mode):
    from waveplan.pricing.parallel import Recompute

    g = load_preset("deepseek-v2-lite")
    g = dataclasses.replace(g, layers=g.layers[:6])
    model = PricingModel.build(g, backend=backend, recompute=Recompute(mode=mode))
    rows = 4096
    many = price_groups(model, [one_group(rows)]).raw_bytes
    monkeypatch.setattr(layer_arrays, "rope_cache_instances", lambda *_: 1)
    one = price_groups(PricingModel.build(g, backend=backend, recompute=Recompute(mode=mode)),
                       [one_group(rows)]).raw_bytes
    entry = rope_cache_per_row(g, g.layers)
    assert many - one >= 5 * entry * rows - 1


def test_earlier_waves_hold_at_most_the_slots_the_calls_leave():
    waves = [[one_group(1000)], [one_group(2000)], [one_group(3000)]]
    # plain RoPE: one entry per earlier length, as before
    assert rope_cache.earlier_wave_entries(1.0, waves) == [0.0, 1000.0, 3000.0]
    # 27 MLA layers: 32 - 27 + 1 = 6 entries of earlier lengths, the longest first
    assert rope_cache.earlier_slots(27) == 6
    assert rope_cache.earlier_wave_entries(1.0, waves, 27) == [0.0, 6000.0, 6 * 2000.0]
    assert rope_cache.earlier_wave_entries(1.0, waves, 2) == [0.0, 2000.0, 2 * 2000.0 + 2 * 1000.0]
    assert rope_cache.reserve_bound(1.0, 100, 27) == 600.0
    assert rope_cache.reserve_bound(1.0, 100) == 3200.0
