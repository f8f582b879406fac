"""The search's options, validated once: which packer, how much time, and the caller's
constraints. Their defaults are defined here and nowhere else (the planner, the CLI and the
reports refer to these constants).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from waveplan.pricing.compat import StrEnum
from waveplan.pricing.errors import ConfigError, StepError, bad


class PackerKind(StrEnum):
    AUTO = "auto"
    GREEDY = "greedy"
    EXACT = "exact"
    UNIFORM_WIDTH = "uniform-width"
    FFD = "ffd"
    KK = "kk"


# the baseline packers replace the search's packing (see `baselines`)
BASELINE_KINDS = frozenset({PackerKind.UNIFORM_WIDTH, PackerKind.FFD, PackerKind.KK})

DEFAULT_PACKER = PackerKind.AUTO
DEFAULT_TIME_BUDGET_MS = 20.0    # the default time budget's floor (the whole search, exact
                                 # re-pricing included) ...
DEFAULT_MS_PER_REQUEST = 0.2     # ... and its share per request: 409.6 ms at 2048 requests
DEFAULT_SEED = 0


def default_time_budget_ms(num_requests: int) -> float:
    """The time budget when none is given: max(DEFAULT_TIME_BUDGET_MS, DEFAULT_MS_PER_REQUEST
    x requests) ms, so a wave's worth of search grows with the step. docs/faq.md#time-budget."""
    return max(DEFAULT_TIME_BUDGET_MS, DEFAULT_MS_PER_REQUEST * int(num_requests))


def packer_kind(kind: PackerKind | str) -> PackerKind:
    """The packer kind named `kind`; ConfigError naming the known kinds otherwise."""
    try:
        return PackerKind(kind)
    except ValueError:
        raise bad(ConfigError, "packer", kind,
                  f"must be one of {[k.value for k in PackerKind]}") from None


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """How to search. `time_budget_ms`: the whole search's, None for the default rule
    (`default_time_budget_ms` of the step's requests); `atomic_units`: lists of request indices that must share a wave
    (checked against the step when it is packed); `num_waves`: exactly that many waves (not
    with a baseline packer); `deterministic`: never read the clock, the iteration caps implied
    by `time_budget_ms` decide (see `budget`); `stage_budgets`: a pipeline's (PP > 1) budget
    per stage, against which each stage's in-flight windows are checked (None: the search's
    budget for every stage); `earlier_entries`: charge each wave what the waves run before it
    leave, where the pricer prices it (`contract.EarlierEntriesPricer`, the search's
    `earlier`; the planner's plans do). O(total atomic unit size) to validate."""

    packer: PackerKind = DEFAULT_PACKER
    time_budget_ms: float | None = None
    atomic_units: tuple[tuple[int, ...], ...] = ()
    num_waves: int | None = None
    seed: int = DEFAULT_SEED
    deterministic: bool = False
    stage_budgets: tuple[int, ...] | None = None
    earlier_entries: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "packer", packer_kind(self.packer))
        t = self.time_budget_ms
        if t is None:
            pass
        elif isinstance(t, bool) or not isinstance(t, int | float | np.integer | np.floating) \
                or not math.isfinite(t) or t <= 0:
            raise bad(ConfigError, "time_budget_ms", t, "must be a finite number > 0")
        else:
            set_(self, "time_budget_ms", float(t))
        try:
            units = tuple(tuple(unit) for unit in self.atomic_units)
        except TypeError:
            raise bad(StepError, "atomic_units", self.atomic_units,
                      "must be lists of request indices") from None
        set_(self, "atomic_units", units)
        n = self.num_waves
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
                raise bad(ConfigError, "num_waves", n, "must be a positive integer or None")
            if self.packer in BASELINE_KINDS:
                raise bad(ConfigError, "num_waves", n,
                          f"not supported by the {self.packer.value} baseline packer")
            set_(self, "num_waves", int(n))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int | np.integer):
            raise bad(ConfigError, "seed", self.seed, "must be an integer")
        set_(self, "seed", int(self.seed))
        if not isinstance(self.deterministic, bool | np.bool_):
            raise bad(ConfigError, "deterministic", self.deterministic, "must be True or False")
        set_(self, "deterministic", bool(self.deterministic))
        if not isinstance(self.earlier_entries, bool | np.bool_):
            raise bad(ConfigError, "earlier_entries", self.earlier_entries,
                      "must be True or False")
        set_(self, "earlier_entries", bool(self.earlier_entries))
        if self.stage_budgets is not None:
            try:
                budgets = tuple(self.stage_budgets)
            except TypeError:
                budgets = ()
            if not budgets or any(isinstance(b, bool) or not isinstance(b, int | np.integer)
                                  or b <= 0 for b in budgets):
                raise bad(ConfigError, "stage_budgets", self.stage_budgets,
                          "must be a non-empty list of positive byte counts, one per stage")
            set_(self, "stage_budgets", tuple(int(b) for b in budgets))
