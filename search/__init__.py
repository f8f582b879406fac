"""waveplan.search: packs a step's requests into waves that fit the budget, with bounds.

Public API: `pack`, `make_packer`, `PackerKind`, `SearchOptions` (and its defaults),
`SearchResult`, `PackedWave`, `check_plan`, and the pricer contract (`Pricer` and its optional
capabilities, see `contract`). Depends on `waveplan.pricing` only (never on the planner).
"""

from .contract import (
    AdmittedPricer,
    BoundedPricer,
    LoadsPricer,
    PendingPricer,
    Pricer,
    SearchEnvelope,
    SearchPricer,
    SearchStep,
    StagedPricer,
    StageView,
    WavePrice,
)
from .invariants import check_plan
from .options import (
    DEFAULT_PACKER,
    DEFAULT_SEED,
    DEFAULT_TIME_BUDGET_MS,
    PackerKind,
    SearchOptions,
    default_time_budget_ms,
)
from .packers import Packer, make_packer, pack
from .result import PackedWave, SearchResult

__all__ = ["DEFAULT_PACKER", "DEFAULT_SEED", "DEFAULT_TIME_BUDGET_MS", "AdmittedPricer",
           "BoundedPricer", "LoadsPricer", "Packer", "PackerKind", "PackedWave",
           "PendingPricer", "Pricer", "SearchEnvelope", "SearchOptions", "SearchPricer",
           "SearchResult", "SearchStep", "StageView", "StagedPricer", "WavePrice", "check_plan",
           "default_time_budget_ms", "make_packer", "pack"]
