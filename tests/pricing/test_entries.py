"""The table-entry registry (pricing.entries) and the kernel set chosen from a table
(pricing.kernel_set): every shipped table's entries are registered, every required one is
present, and no module outside the registry asks a table whether it carries an entry."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from waveplan.pricing import entries
from waveplan.pricing.coefficients import list_backends, load_table
from waveplan.pricing.errors import ConfigError
from waveplan.pricing.kernel_set import FRAMEWORKS, Framework, KernelSet

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("backend", list_backends())
def test_every_shipped_entry_is_registered_and_every_required_one_present(backend):
    table = load_table(backend)
    assert set(table.terms) <= set(entries.REGISTRY), set(table.terms) - set(entries.REGISTRY)
    assert entries.missing_required(table.terms) == []


def test_every_entry_names_a_unit_and_a_docs_anchor():
    text = (ROOT / "docs" / "memory-model.md").read_text()
    for entry in entries.ENTRIES:
        assert entry.unit and entry.anchor
        assert entry.docs == f"docs/memory-model.md#{entry.anchor}"
        assert entry.required == (entry.default is None)
        assert f'id="{entry.anchor}"' in text or f"#{entry.anchor}" in text, entry.name


def test_a_table_without_a_required_entry_is_refused_naming_it():
    table = load_table("te-gpu")
    with pytest.raises(ConfigError, match="boundary"):
        dataclasses.replace(table, terms={k: v for k, v in table.terms.items() if k != "boundary"})


def test_an_unregistered_name_is_a_programming_error():
    with pytest.raises(KeyError):
        entries.has(load_table("te-gpu"), "no_such_entry")


def test_kernel_sets_of_the_shipped_tables():
    gpu, cpu = load_table("te-gpu").kernels, load_table("torch-cpu").kernels
    # te-gpu: the TP1 point and head forward written from the fused kernels' allocation models,
    # nothing else structural (docs/memory-model.md#gpu-kernel-allocation-models)
    # (and the GDN hybrids' retained layers from FLA's, `fused_gdn`, and their recomputed ones,
    # `fused_gdn_point`)
    on = {"tp1_point", "sp_head", "fused_retained", "fused_mla", "fused_gdn", "fused_gdn_point",
          "kernel_models"}
    assert gpu.name == "fused-gpu-models" and gpu.fused and gpu.rope_copies == 0.0
    assert {f.name for f in dataclasses.fields(KernelSet) if f.name != "framework"
            and getattr(gpu, f.name)} == on
    assert cpu.name == "plain-cpu" and not cpu.fused and cpu.rope_copies == 2.0 and all(
        getattr(cpu, f.name) for f in dataclasses.fields(KernelSet)
        if f.name not in ("framework", "kernel_models", "fused_retained", "fused_mla", "fused_gdn",
                          "fused_gdn_point"))
    assert gpu.framework == cpu.framework == Framework.MEGATRON and Framework.MEGATRON in FRAMEWORKS
    # a table with part of the optional entries gets exactly those
    table = load_table("torch-cpu")
    part = dataclasses.replace(table, terms={k: v for k, v in table.terms.items() if k != "sp_fc2_point"})
    assert not part.kernels.sp_point and part.kernels.structural


_PROBE = re.compile(r"""(?:\bin|not in)\s+[\w.]*\bterms\b(?!\s*\()|\.terms\.get\(""")
_LOOP = re.compile(r"\bfor\b[^:]*\bin\s+[\w.]*\bterms\b")


def test_no_module_outside_the_registry_probes_a_table():
    """At most two checks of a table's entries, both in pricing/entries.py."""
    hits = []
    for folder in ("pricing", "search", "planner"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if (_PROBE.search(code) and not _LOOP.search(code)
                        and "breakdown" not in code and "price.terms" not in code):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    inside = [h for h in hits if h.startswith("pricing/entries.py")]
    outside = [h for h in hits if not h.startswith("pricing/entries.py")]
    assert outside == [], outside
    assert 1 <= len(inside) <= 2, inside
