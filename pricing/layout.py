"""Layouts: the packed prefix tree of any subset of a step's requests, and its padding.

Under **full sharing** (memory-minimal) the requests of a wave run as packed prefix trees:
every token shared by several requests runs once. Under **no sharing** (the upper bound)
every request runs as its own sequence.

Counts come from the step's precomputed tree order (`Step.rank`) and the adjacent longest
common prefixes (LCPs) of that order (`Step.lcp_table`, a sparse range-minimum table). For a
subset sorted in tree order, the LCP of two neighbours is the minimum of the step's adjacent
LCPs between them, so:

* packed rows = sum(lengths) - sum(adjacent LCPs);
* packed sequences (trees under the root) start wherever the adjacent LCP is 0;
* segments (radix-tree nodes: nodes where a request ends or the tree branches) = the distinct
  nodes named by the positive adjacent LCPs (one stack pass) + the requests that are not a
  prefix of their successor; a duplicate request adds no row and no segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from .errors import ConfigError, StepError, bad
from .parallel import ParallelLayout
from .stable_sort import sorted_ints
from .step import Step


@dataclass(frozen=True, kw_only=True, eq=False)
class LayoutCounts:
    """Counts of one packed layout.

    `sequence_rows` holds the packed rows of each packed sequence (read-only int64; one per
    tree under full sharing, one per request under no sharing), largest first, so that equal
    layouts compare equal whatever the order of their requests.
    """

    num_requests: int
    logical_rows: int
    packed_rows: int
    segments: int
    sequence_rows: np.ndarray

    @property
    def num_sequences(self) -> int:
        return int(self.sequence_rows.size)

    def _key(self) -> tuple:
        return (self.num_requests, self.logical_rows, self.packed_rows, self.segments,
                tuple(self.sequence_rows.tolist()))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LayoutCounts):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def to_dict(self) -> dict:
        return {"requests": self.num_requests, "logical_rows": self.logical_rows,
                "packed_rows": self.packed_rows, "segments": self.segments,
                "sequence_rows": self.sequence_rows.tolist()}


@njit(cache=True)
def _tree_counts(rank, table, length_at, indices, shared):  # pragma: no cover - numba
    """(status, logical, packed, segments, sequence_rows); status 1: indices[logical] is out of
    range, 2: request `logical` is listed twice. O(k log k) for k indices."""
    n = rank.size
    k = indices.size
    empty = np.zeros(0, np.int64)
    pos = np.empty(k, np.int64)
    for i in range(k):
        j = indices[i]
        if j < 0 or j >= n:
            return 1, i, 0, 0, empty
        pos[i] = rank[j]
    pos = sorted_ints(pos)
    for i in range(1, k):
        if pos[i] == pos[i - 1]:
            for j in range(n):  # name the request: error path only
                if rank[j] == pos[i]:
                    return 2, j, 0, 0, empty
    rows = np.empty(k, np.int64)
    logical = 0
    if not shared:
        for i in range(k):
            rows[i] = length_at[pos[i]]
            logical += rows[i]
        rows = sorted_ints(rows)
        return 0, logical, logical, k, rows[::-1].copy()
    stack = np.empty(k + 1, np.int64)  # depths of the open LCP nodes; stack[0] = root
    stack[0] = 0
    top = 0
    segments = 0
    num_seq = 0
    packed = 0
    h_prev = 0
    for i in range(k):
        length = length_at[pos[i]]
        logical += length
        own = length - h_prev
        packed += own
        if i == 0 or h_prev == 0:
            rows[num_seq] = own
            num_seq += 1
        else:
            rows[num_seq - 1] += own
        if i + 1 < k:
            # LCP of this request and the next in the subset: a range minimum of the step's.
            a = pos[i]
            span = pos[i + 1] - a
            lev = 0
            while (2 << lev) <= span:
                lev += 1
            h = min(table[lev, a], table[lev, pos[i + 1] - (1 << lev)])
            if not (h == length and h == length_at[pos[i + 1]]):  # a duplicate names no new node
                while stack[top] > h:
                    top -= 1
                if stack[top] < h:
                    top += 1
                    stack[top] = h
                    segments += 1
            if h < length:  # not a prefix of the next: its end is a leaf
                segments += 1
            h_prev = h
        else:
            segments += 1
    out = rows[:num_seq].copy()
    out = sorted_ints(out)
    return 0, logical, packed, segments, out[::-1].copy()


def layout(step: Step, indices, *, shared: bool = True) -> LayoutCounts:
    """Counts of the packed layout of `step.requests[indices]` (indices, or a boolean mask).

    `shared=True`: full sharing (one packed sequence per tree under the root);
    `shared=False`: no sharing (packed = logical rows, one segment and one sequence per
    request). Token-form and length-form steps give identical counts for the same data.
    O(k log k) for k indices, independent of the number of tokens (a few microseconds for
    k = 64). Raises StepError for an index out of range or listed twice.
    """
    idx = np.asarray(indices)
    if idx.dtype == np.bool_:  # a mask, not indices 0 and 1
        if idx.shape != (step.num_requests,):
            raise bad(StepError, "indices", f"<mask of shape {idx.shape}>",
                      f"a mask needs one entry per request ({step.num_requests})")
        idx = np.flatnonzero(idx)
    idx = np.asarray(idx, dtype=np.int64).reshape(-1)
    status, logical, packed, segments, rows = _tree_counts(
        step.rank, step.lcp_table, step.length_at, idx, shared)
    if status == 1:
        raise bad(StepError, f"indices[{logical}]", int(idx[logical]),
                  f"out of range for a step of {step.num_requests} requests")
    if status == 2:
        raise bad(StepError, "indices", int(logical), "request listed twice")
    rows.flags.writeable = False
    return LayoutCounts(num_requests=int(idx.size), logical_rows=int(logical),
                        packed_rows=int(packed), segments=int(segments), sequence_rows=rows)


def _check_multiple(multiple: int) -> None:
    if isinstance(multiple, bool) or not isinstance(multiple, int | np.integer) or multiple <= 0:
        raise bad(ConfigError, "multiple", multiple, "must be a positive integer")


def padded_rows(sequence_rows, multiple: int) -> int:
    """Rows after padding each packed sequence up to a multiple of `multiple`. O(sequences)."""
    _check_multiple(multiple)
    rows = np.asarray(sequence_rows, dtype=np.int64)
    return int((-(-rows // multiple) * multiple).sum())


def num_padding_rows(sequence_rows, multiple: int) -> int:
    """Padding rows added by `padded_rows`."""
    return padded_rows(sequence_rows, multiple) - int(np.asarray(sequence_rows, dtype=np.int64).sum())


def padding_segments(sequence_rows, multiple: int) -> int:
    """Segments added by padding: each pad token forms its own root segment (measured, see
    docs/memory-model.md#layouts), so this equals
    `num_padding_rows`."""
    return num_padding_rows(sequence_rows, multiple)


def busiest_cp_rank_rows(sequence_rows, *, cp: int, tp: int, sequence_parallel: bool) -> int:
    """Rows held by the busiest context-parallel rank (before any TP shard under SP).

    Megatron's load-balanced CP split of packed (THD) sequences: each sequence is padded to
    a multiple of `ParallelLayout.row_multiple` (2*CP, times TP under sequence parallelism),
    cut into 2*CP equal chunks, and CP rank r takes chunks r and 2*CP-1-r. Every rank thus
    holds 2/(2*CP) of every padded sequence, and the busiest holds padded_rows / CP. The
    unevenness measured at CP2 (docs/memory-model.md#layouts) comes from which layout runs: its 4k pair
    ran as two unshared 4,096-row sequences, 4,096 rows on the busiest CP2 rank though only
    6,964 rows were packed; pass the `sequence_rows` of the layout that actually runs.
    O(sequences).
    """
    multiple = ParallelLayout(tp=tp, cp=cp, sequence_parallel=sequence_parallel).row_multiple
    # Chunks r and 2*CP-1-r are each padded/(2*CP) rows of every sequence: all ranks tie.
    return padded_rows(sequence_rows, multiple) // cp
