"""Randomised multistart, run only when the greedy leaves a gap to the lower bound.

Each iteration perturbs the block order (size x exp(0.35 N(0,1))), draws a placement rule and
mode, runs the greedy and then tries to empty the lightest waves (`local.eliminate`). The
random stream is numba's, seeded from (`seed`, chunk index), so a given number of iterations
always gives the same plan.

Iterations run in chunks. With `deterministic=True` the number of iterations is fixed from
what is left of the time budget (`iteration_cap`, see `budget`) and the clock is never read;
with `deterministic=False` chunks run until the deadline, the iteration cap or the target is
reached, so a run that hits its deadline can depend on the machine's speed (a run that
stops on the cap or the target does not).

Complexity: O(iterations x (greedy run + eliminate)), see `greedy` and `local`.
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit

from waveplan.pricing.stable_sort import stable_argsort

from .budget import runs_within
from .greedy import (
    DRAWN_RULES,
    ELIMINATE_CANDIDATES,
    KEEP_BLOCKS,
    NUM_MODES,
    WORST_FIT,
    greedy_inputs,
    greedy_run,
)
from .items import Blocks, Items, atom_size
from .local import eliminate

CHUNK = 4
MAX_ITERS = 4096


@njit(cache=True)
def multistart_chunk(n_iter, seed, target, fixed, bsize, active, asize, inputs, best_assign,
                     best_nw):
    """Run `n_iter` randomised greedy + eliminate iterations over `inputs` (a
    `greedy.GreedyInputs`); `bsize`: the blocks' sizes (the order's sort key), `asize`: the
    atoms' (`eliminate`'s). Returns (best_assign, best_nw, iterations done)."""
    np.random.seed(seed)
    nb = bsize.shape[0]
    key = np.empty(nb)
    done = 0
    for _it in range(n_iter):
        for i in range(nb):
            key[i] = -bsize[i] * np.exp(0.35 * np.random.standard_normal())
        order = stable_argsort(key)
        if fixed > 0:
            rule = WORST_FIT if np.random.random() < 0.5 else np.random.randint(0, DRAWN_RULES)
            mode = KEEP_BLOCKS
        else:
            rule = np.random.randint(0, DRAWN_RULES)
            mode = np.random.randint(0, NUM_MODES)
        assign, nw = greedy_run(order, rule, mode, fixed, inputs)
        done += 1
        if nw > 0 and fixed == 0:
            # typed, not the constant's Literal[int]: the same compile of eliminate as the greedy's
            nw = eliminate(assign, nw, active, asize, np.int64(ELIMINATE_CANDIDATES), inputs.atoms,
                           inputs.headers, inputs.limit)
        if nw > 0 and (best_nw < 0 or nw < best_nw):
            best_nw = nw
            best_assign = assign.copy()
        if best_nw > 0 and best_nw <= target:
            break
    return best_assign, best_nw, done


def iteration_cap(budget_us: float, num_atoms: int, waves: int, points: int) -> int:
    """Iterations that fit in `budget_us` microseconds (`budget.run_cost_us`): what the
    deterministic mode runs, and a cap otherwise. O(1)."""
    return int(min(MAX_ITERS, runs_within(budget_us, num_atoms, waves, points)))


def run_multistart(items: Items, blocks: Blocks, active: np.ndarray, *, target: int,
                   best_assign: np.ndarray | None, best_nw: int, seed: int,
                   deadline: float | None, max_iters: int, fixed: int = 0,
                   first_chunk: int = 0) -> tuple[np.ndarray | None, int, int]:
    """Improve (best_assign, best_nw) towards `target`. `deadline` (perf_counter seconds) is
    ignored when None (deterministic mode). `first_chunk`: the random stream starts at that
    chunk (a later call continues an earlier one's without repeating its draws). Returns
    (assign, waves, iterations)."""
    if best_assign is None:
        best_assign = -np.ones(items.num_atoms, dtype=np.int64)
        best_nw = -1
    inputs = greedy_inputs(items, blocks)
    asize = atom_size(items)
    iters, chunk = 0, first_chunk
    while iters < max_iters and not (best_nw > 0 and best_nw <= target):
        if deadline is not None and time.perf_counter() >= deadline:
            break
        n = min(CHUNK, max_iters - iters)
        s = (int(seed) * 1_000_003 + chunk * 7919 + 12345) % (2**31 - 1)
        best_assign, best_nw, done = multistart_chunk(
            n, s, target, fixed, blocks.size, active, asize, inputs, best_assign, best_nw)
        iters += done
        chunk += 1
    return (best_assign if best_nw > 0 else None), best_nw, iters
