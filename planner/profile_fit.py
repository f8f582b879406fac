"""Fit a coefficient table to the peaks a training run observed (`waveplan calibrate --profiles`).

A profile store (`planner/profiles.py`) keeps, per wave that ran, its group loads, its static
raw price and the observed peak. It does not keep the model: a signature names the geometry
only by its name, and the LoRA slots only by their ranks. So the caller supplies the model the
planner priced those waves with, and every observation is checked against it before it is
used (`fit_cells`):

1. the profile's configuration key (geometry name, layout, recompute, LoRA ranks, head,
   coefficient backend) must equal the model's; profiles of other configurations are skipped
   and listed;
2. re-pricing the observation's loads with the model must give back the static raw price it
   was stored with, exactly (two bytes of rounding allowed). Which slots' pending adapter
   gradients the wave carried is not stored; it is the smallest set of the wave's gradient
   slots that gives the stored price back (the smallest prices lowest, so the fit must cover
   the peak with the least help from that term: the conservative reading). An observation
   nothing reproduces was priced by another model (another geometry of the same name,
   other LoRA targets, other gradient bytes): the fit stops with one line naming it.

The fit (`fit_scales`) keeps the base table's structure and gives each group of terms
(`pricing.measure.calibrate.GROUPS`) one factor, like the trace calibration; but a production
wave has several forward calls and pending gradients, so its price is not affine in the
factors and the trace fit's linear programme does not apply. The price is monotone in every
factor (every coefficient is >= 0), so instead:

- `s0`: the least uniform factor with every observation priced at least (1 + margin) x its
  peak (bisection);
- every group starts at max(1, s0) (the base, or the base raised uniformly when it
  under-priced) and is lowered, one group at a time, to the least factor that still covers
  every observation (bisection, valid by monotonicity), never below min(1, s0). A group is
  lowered only when that lowers the mean estimate/peak: a group no observation's price
  depends on keeps its start value (no evidence, no tightening).

Every estimate of the fitted table is >= (1 + margin) x its peak by construction (checked
after rounding). The held-out check (`held_out`) fits on every other observation and prices
the rest, so a user sees how far the fit carries beyond what it saw.

Complexity: O(passes x groups x bisections x observations) wave prices, each
O(groups^2 + groups x layers) (`pricing.price.price_groups`).
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from waveplan.pricing.coefficients import CoefficientTable, covering_after_rounding, covering_scales
from waveplan.pricing.errors import ConfigError, bad
from waveplan.pricing.kernel_set import Framework
from waveplan.pricing.measure import calibrate
from waveplan.pricing.model import PricingModel
from waveplan.pricing.price import GroupLoad, price_groups

from .profiles import ProfileStore, config_key

MARGIN = calibrate.MARGIN      # every fitted estimate >= (1 + MARGIN) x its peak
REPRICE_SLACK_BYTES = 2        # ceil() of the walk's total vs of its parts: at most a byte or two
FACTOR_MAX = calibrate.FACTOR_BOUNDS[1]


@dataclass(frozen=True)
class FitCell:
    """One observed wave, checked against the model: its loads, the slots whose pending
    gradients it carried, its observed peak, and where it came from."""

    where: str
    loads: tuple[GroupLoad, ...]
    first_slots: frozenset[str]
    static_raw_bytes: int
    peak_bytes: int


@dataclass(frozen=True)
class ProfileFit:
    table: CoefficientTable
    scales: dict[str, float]
    uniform: float                # s0: the least uniform factor covering every observation
    cells: tuple[FitCell, ...]
    skipped: tuple[str, ...]      # profiles of other configurations
    ratios: tuple[float, ...]     # fitted estimate / peak, per cell


def _price(model: PricingModel, cell: FitCell) -> int:
    return price_groups(model, cell.loads, first_slots=cell.first_slots, profiled=True).raw_bytes


def fit_cells(store: ProfileStore, model: PricingModel, *,
              where: str = "profiles") -> tuple[list[FitCell], list[str]]:
    """The observations of `store` learned with `model`'s configuration, each checked by
    re-pricing (see the module doc), and the signatures of the profiles skipped.
    ConfigError when an observation of a matching profile is not reproduced, or when no
    profile matches. O(observations x 2^slots) wave prices."""
    key = config_key(model)
    cells, skipped = [], []
    for i, profile in enumerate(store.profiles()):
        if profile.signature.config != key:
            skipped.append(profile.signature.config)
            continue
        for j, obs in enumerate(profile.observations):
            w = f"{where}.profiles[{i}].observations[{j}]"
            slots = sorted({g.slot for g in obs.loads if g.grad})
            subsets = [frozenset(c) for n in range(len(slots) + 1)
                       for c in itertools.combinations(slots, n)]
            for first in subsets:
                cell = FitCell(where=w, loads=tuple(obs.loads), first_slots=first,
                               static_raw_bytes=obs.static_raw_bytes, peak_bytes=obs.peak_bytes)
                if abs(_price(model, cell) - obs.static_raw_bytes) <= REPRICE_SLACK_BYTES:
                    cells.append(cell)
                    break
            else:
                got = _price(model, dataclasses.replace(cell, first_slots=frozenset()))
                raise bad(ConfigError, f"{w}.static_raw_bytes", obs.static_raw_bytes,
                          f"this model prices the wave at {got} bytes: the profile was learned with "
                          "another model (geometry, LoRA targets or gradient bytes); give the "
                          "model the planner used")
    if not cells:
        raise bad(ConfigError, where, f"{len(skipped)} profiles",
                  f"none was learned with this configuration ({key}); give the model, layout, "
                  "recompute, LoRA rank, head and base table the planner used")
    return cells, skipped


def _table_ratios(model: PricingModel, table: CoefficientTable,
                  cells: Sequence[FitCell]) -> list[float]:
    """estimate / peak of every cell with `model` priced from `table` (one model build)."""
    m = dataclasses.replace(model, table=table)
    return [_price(m, c) / c.peak_bytes for c in cells]


def _groups(model: PricingModel):
    """(groups, scaled_table) of the model's framework: Megatron-core's term groups
    (`calibrate.GROUPS`), or the fsdp framework's four factors (`pricing.fsdp.calibrate`)."""
    if model.framework is Framework.FSDP:
        from waveplan.pricing.fsdp import calibrate as fsdp_calibrate

        return list(fsdp_calibrate.GROUPS), fsdp_calibrate.scaled_table
    return list(calibrate.GROUPS), calibrate.scaled_table


def _ratios(model: PricingModel, base: CoefficientTable, scales: dict[str, float],
            cells: Sequence[FitCell]) -> list[float]:
    return _table_ratios(model, _groups(model)[1](base, scales), cells)


def fit_scales(model: PricingModel, cells: Sequence[FitCell], *,
               margin: float = MARGIN) -> tuple[dict[str, float], float]:
    """(group factors, s0) covering every cell at (1 + margin) x its peak; see the module doc.
    The model's own table is the base. Deterministic."""
    base = model.table

    def refuse(ratios: list[float]) -> None:
        worst = min(zip(ratios, cells, strict=True), key=lambda rc: rc[0])
        raise bad(ConfigError, f"{worst[1].where}.peak_bytes", worst[1].peak_bytes,
                  f"even {FACTOR_MAX:g}x the base table prices this wave at {worst[0]:.3f}x its peak; "
                  "the peak was not measured on the wave (or with other memory counted)")

    return covering_scales(_groups(model)[0], lambda scales: _ratios(model, base, scales, cells),
                           margin=margin, factor_max=FACTOR_MAX, refuse=refuse)


def fit_profiles(store: ProfileStore, model: PricingModel, *, backend: str,
                 source_label: str = "profiles", margin: float = MARGIN) -> ProfileFit:
    """A table named `backend`, fitted to the observations `store` holds for `model` (whose
    table is the base). See the module doc."""
    cells, skipped = fit_cells(store, model, where=source_label)
    scales, s0 = fit_scales(model, cells, margin=margin)
    note = (f"fitted by waveplan.planner.profile_fit to {len(cells)} observed waves of "
            f"{source_label}")
    scaled = _groups(model)[1]
    table, scales, ratios = covering_after_rounding(
        scales, lambda s: scaled(model.table, s, note=note, backend=backend),
        lambda t: _table_ratios(model, t, cells), margin=margin, field=source_label,
        value=len(cells), why="could not raise the fit above every peak")
    return ProfileFit(table=table, scales=scales, uniform=s0, cells=tuple(cells),
                      skipped=tuple(skipped), ratios=tuple(ratios))


def held_out(model: PricingModel, cells: Sequence[FitCell], *,
             margin: float = MARGIN) -> tuple[int, list[float]] | None:
    """Fit on the even-index cells, price the odd-index ones: (cells fitted on, estimate/peak
    of each held-out cell). None with fewer than 4 cells. Deterministic."""
    if len(cells) < 4:
        return None
    fit, test = list(cells[0::2]), list(cells[1::2])
    scales, _ = fit_scales(model, fit, margin=margin)
    return len(fit), _ratios(model, model.table, scales, test)


def summary(ratios: Sequence[float]) -> str:
    """`n cells, under k, median +x%, worst +y%, least +z%` of estimate/peak ratios."""
    over = sorted(r - 1.0 for r in ratios)
    under = sum(1 for r in ratios if r < 1.0)
    return (f"{len(over)} waves, under {under}, median {statistics.median(over):+.2%}, "
            f"worst {over[-1]:+.2%}, least {over[0]:+.2%}")


__all__ = ["FitCell", "ProfileFit", "fit_cells", "fit_profiles", "fit_scales", "held_out", "summary",
           "MARGIN"]
