"""The numeric tolerances of the memory model and of the search, each named for what it guards.

The search imports them from here (pricing <- search). numba freezes a module-level number into
every kernel that reads it when that kernel compiles, and its on-disk cache does not notice a
change made here: after changing a value, empty the numba cache (NUMBA_CACHE_DIR).
"""

from __future__ import annotations

# --- prices (bytes) -----------------------------------------------------------------------

# Added to every constant of the (upper) envelope: the exact price rounds the walk's peak up to
# whole bytes and then the admitted bytes up again (`price.price_groups`), which the affine
# envelope does not; this keeps it at or above the exact admitted price.
ENVELOPE_ROUNDING_BYTES = 4.0

# Added to `WavePricer.pending_bytes`, for the same two roundings up (raw, then admitted).
PENDING_ROUNDING_BYTES = 2.0

# The lower envelope is scaled by safety x (1 - LOWER_ENVELOPE_MARGIN) (relative), so that
# floating-point rounding of its sums never lifts it above the exact price it bounds.
LOWER_ENVELOPE_MARGIN = 1e-12

# --- the search's normalised loads (1.0 = the budget at an envelope point) ------------------

# A wave fits when its load is <= 1 - FIT_EPS at every point: loads are sums of normalised
# weights, and a wave whose envelope value equals the budget up to their rounding must not fit.
FIT_EPS = 1e-9

# The wave-count lower bounds (`search.bounds`, `WavePricer.lower_bound_waves`) round a
# quotient up only when it exceeds an integer by more than this: a mass that is a whole number
# of budgets up to rounding must not count one wave more, or the bound could pass the optimum.
CEIL_SLACK = 1e-9

# The greedy's placement keys (`search.greedy._choose`) closer than this are a tie, settled by
# the secondary key and then the lowest wave, not by summation rounding.
TIE_EPS = 1e-15

# `search.local.balance` moves an atom only when the largest load drops by more than this, so
# rounding noise never counts as progress (equal loads are not traded back and forth).
BALANCE_GAIN_EPS = 1e-12

# `search.fill`'s placement keys closer than this are a tie, settled by the larger atom.
FILL_TIE_EPS = 1e-12

# --- improvement tests of the planner's and the calibration's local searches ----------------

# A trial counts as an improvement only when it lowers the value by more than this fraction
# (`planner.profile_fit.fit_scales`, `planner.group`'s time moves), so rounding is no progress.
REL_GAIN_EPS = 1e-9

# A stored aggregate (a profile's ratio, its largest sharing) may sit this fraction below the
# largest observation it covers: JSON rounding of the stored numbers, not an inconsistency.
ROUNDTRIP_REL_EPS = 1e-12

# `calibrate`: two fitted points are equal up to this (bytes per unit, coefficient-wise) when one
# is tested for dominating the other.
DOMINANCE_EPS = 1e-9

# `calibrate`: a clipped LP solution still covers every cell when its lowest ratio is at least
# 1 + margin - FIT_RATIO_EPS; a cell at most 1 + margin + BINDING_RATIO_EPS is held at its bound.
FIT_RATIO_EPS = 1e-9
BINDING_RATIO_EPS = 1e-6

# `calibrate`: a settled solution replaces the best one when its value is lower by more than
# SETTLE_GAIN_EPS (starts) or MOVE_GAIN_EPS (binding-point moves); the values are mean ratios.
SETTLE_GAIN_EPS = 1e-12
MOVE_GAIN_EPS = 1e-9

# A fit whose rounded coefficients price a cell below its margin is raised by (1 + margin) / the
# lowest ratio, times this (`coefficients.covering_after_rounding`), so one raise clears the rounding.
ROUNDING_RAISE = 1.00001
