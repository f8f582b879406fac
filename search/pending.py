"""Room for the pending adapter gradients, reserved while packing.

Each gradient slot's pending adapter gradients ride in one wave: the first that holds its
gradient requests (`order`). Packing as if they did not leaves every wave full, and the
order step's repair then needs extra waves. Instead, the lightest gradient request of each
slot that still fits alone with them weighs its slot's pending gradients at every point, so
the wave that packs it keeps the room.

How much: "measured" is what carrying them adds to that request's exact price alone (one
exact price with and one without; it tracks the walk point where the gradients bind, but a
full wave may bind elsewhere); "bound" is the pricer's upper bound (its `PendingPricer`
capability, `WavePricer.pending_bytes`: all of the slot's adapter gradients at every point),
safe but loose when the gradients bind at a layer where only part of them is allocated. The
search packs with "measured" and, when the order step still had to add waves, once more with
"bound", keeping the better plan.

Complexity: O(n P) plus two exact prices per slot.
"""

from __future__ import annotations

import numpy as np

from waveplan.pricing.tolerances import FIT_EPS

from .contract import SearchPricer
from .prices import exact_price

LIMIT = 1.0 - FIT_EPS


def pending_bytes(pricer: SearchPricer, slot: str, carrier: int, mode: str) -> float:
    """What carrying `slot`'s pending gradients adds to a wave (see the module docstring); a
    pricer without the `PendingPricer` capability has them measured in either mode."""
    if mode == "bound" and pricer.pending is not None:
        return float(pricer.pending.pending_bytes(slot))
    one = [np.asarray([carrier], dtype=np.int64)]
    return float(max(0, exact_price(pricer, one, frozenset({slot})).admitted_bytes
                     - exact_price(pricer, one).admitted_bytes))


def reserve_room(pricer: SearchPricer, req_w: np.ndarray, alone: np.ndarray, cap: np.ndarray,
                 class_of: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """New (req_w, alone) with each gradient slot's pending gradients on one request."""
    grad = pricer.class_grad
    names = sorted({pricer.class_slot[k] for k in range(len(grad)) if grad[k]})
    if not names:
        return req_w, alone
    # the gradient slot of each request (-1: no gradient), in sorted slot order
    code = np.asarray([names.index(pricer.class_slot[k]) if grad[k] else -1
                       for k in range(len(grad))], dtype=np.int64)[class_of]
    req_w, alone = req_w.copy(), alone.copy()
    size = alone.max(axis=1) if alone.shape[1] else np.zeros(len(alone))
    order = np.lexsort((np.arange(len(size)), size, code))   # by slot, then lightest first
    starts = np.searchsorted(code[order], np.arange(len(names) + 1))
    for j, slot in enumerate(names):
        cand = order[starts[j]:starts[j + 1]]
        extra = pending_bytes(pricer, slot, int(cand[0]), mode) / cap
        for i in cand:
            if (alone[i] + extra).max() <= LIMIT:
                req_w[i] += extra
                alone[i] += extra
                break
    return req_w, alone
