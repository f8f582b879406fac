"""veRL's data-parallel balance, torch-free: the baseline the group plan is measured against.

veRL's driver (`RayPPOTrainer._balance_batch`) hands each data-parallel rank an equal count of
sequences, balanced by `calculate_workload` (24576 x s + s^2, attention FLOPs of a 7B model)
with Karmarkar-Karp (`get_seqlen_balanced_partitions`; with the prefix grouper, whole uid
groups: `get_group_balanced_partitions`). `karmarkar_karp` is the same algorithm, tie-breaks
included, so the partitions are veRL's own (`tests/planner/test_group_plan.py` checks it against
verl 0.9.1).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def verl_workload(length: int) -> int:
    """veRL's `calculate_workload` of one sequence: 24576 x s + s^2."""
    return 24576 * int(length) + int(length) ** 2


class _Set:
    __slots__ = ("sum", "items")

    def __init__(self) -> None:
        self.sum = 0
        self.items: list[tuple[int, int]] = []

    def add(self, idx: int, val: int) -> None:
        self.items.append((idx, val))
        self.sum += val

    def merge(self, other: _Set) -> None:
        for idx, val in other.items:
            self.add(idx, val)

    def __lt__(self, other: _Set) -> bool:
        if self.sum != other.sum:
            return self.sum < other.sum
        if len(self.items) != len(other.items):
            return len(self.items) < len(other.items)
        return self.items < other.items


class _State:
    __slots__ = ("k", "sets")

    def __init__(self, items: list[tuple[int, int]], k: int) -> None:
        self.k = k
        self.sets = [_Set() for _ in range(k)]
        for i, (idx, val) in enumerate(items):
            self.sets[i].add(idx, val)
        self.sets.sort(reverse=True)

    def merge(self, other: _State) -> None:
        for i in range(self.k):
            self.sets[i].merge(other.sets[self.k - 1 - i])
        self.sets.sort(reverse=True)

    @property
    def spread(self) -> int:
        return self.sets[0].sum - self.sets[-1].sum

    def __lt__(self, other: _State) -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.sets[0] > other.sets[0]


def karmarkar_karp(values: Sequence[int], k: int, *, equal_size: bool) -> list[list[int]]:
    """k partitions of the indices of `values` by the largest differencing method, as veRL's
    `get_seqlen_balanced_partitions` returns them (each partition's indices ascending;
    `equal_size`: len(values) / k indices each, len(values) a multiple of k).
    O(n log n x k)."""
    order = sorted((int(v), i) for i, v in enumerate(values))
    heap: list[_State] = []
    if equal_size:
        for off in range(0, len(order), k):
            heapq.heappush(heap, _State([(i, v) for v, i in order[off:off + k]], k))
    else:
        for v, i in order:
            heapq.heappush(heap, _State([(i, v)], k))
    while len(heap) > 1:
        a = heapq.heappop(heap)
        b = heapq.heappop(heap)
        a.merge(b)
        heapq.heappush(heap, a)
    return [sorted(idx for idx, _ in s.items) for s in heap[0].sets]
