"""waveplan.search: packs a step's requests into waves that fit the budget, with bounds.

Public API: `pack`, `make_packer`, `PackerKind`, `SearchResult`, `PackedWave`, `check_plan`.
Depends on `waveplan.pricing` only (never on the planner).
"""

from .invariants import check_plan
from .packers import Packer, PackerKind, make_packer, pack
from .result import PackedWave, Pricer, SearchResult

__all__ = ["Packer", "PackerKind", "PackedWave", "Pricer", "SearchResult", "check_plan",
           "make_packer", "pack"]
