"""veRL's memory-safe token budget, priced by waveplan's own model: the `max_token_len` a user
could set once for a run (shared by tests/integration/test_integration_verl.py and
bench/verl_fsdp_table.py)."""

from __future__ import annotations

import numpy as np

from waveplan.pricing.step import Step

FIRST = frozenset({"default"})


def first_fits(planner, lengths, free) -> bool:
    """Whether `lengths` as one step's first micro-batch (it also allocates the adapter
    gradients) fits `free` bytes."""
    step = Step.from_lengths(np.zeros(len(lengths), np.int64), lengths)
    return planner.pricer(step).price([np.arange(len(lengths))], first_slots=FIRST).admitted_bytes <= free


def earlier_entries_bound(planner, hi) -> int:
    """What the RoPE cache entries earlier micro-batches leave (Megatron's lru_cache keeps one
    per call, 32 at most) can add beside any micro-batch of sequences up to hi tokens: the
    planner's reserve for a step of 32 sequences of hi tokens (0 without rotary entries)."""
    step = Step.from_lengths(np.zeros(32, np.int64), [hi] * 32)
    return planner.pricer(step).earlier_reserve_bytes()


def memory_safe_token_budget(planner, lo, hi, free) -> int:
    """The largest max_token_len for which ANY micro-batch of sequences of lo..hi tokens fits
    `free` as the step's first micro-batch (the one that also allocates the adapter
    gradients) beside the earlier micro-batches' RoPE cache entries (`earlier_entries_bound`):
    checked for micro-batches of long (hi) and of short (lo) sequences, topped up with one
    partial sequence, by bisection on the same pricing model."""
    free -= earlier_entries_bound(planner, hi)
    best = []
    for size in (lo, hi):
        a, b = 1, 1 << 14
        while a < b:
            m = (a + b + 1) // 2
            a, b = (m, b) if first_fits(planner, [size] * m, free) else (a, m - 1)
        r0, r1 = 0, size - 1
        while r0 < r1:
            m = (r0 + r1 + 1) // 2
            r0, r1 = (m, r1) if first_fits(planner, [size] * a + [m], free) else (r0, m - 1)
        best.append(a * size + r0)
    return min(best)
