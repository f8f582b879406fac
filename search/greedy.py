"""Group-aware greedy packing against the affine envelope (numba kernels).

A *piece* is a block (atoms sharing prefix groups) or one atom. Each greedy run walks the
blocks in a given order; a block goes whole into an open wave chosen by the placement rule
when it fits there; otherwise (mode KEEP_BLOCKS) it opens a new wave when it fits alone, or
(mode SPLIT_BLOCKS, or when it does not fit alone) its atoms are placed one by one, opening
waves as needed. Adding a piece to a wave costs its request weights plus the headers of the
subgroups and classes the wave does not hold yet, so a prompt is paid once per wave it
appears in.

Placement rules: FIRST_FIT, BEST_FIT (tightest wave after), CHEAPEST_INCREASE (favours waves
that already hold the prompt), WORST_FIT (least loaded after; used for exact counts).

A wave leaves a class's list of open waves once not even the lightest atom of that class
fits it any more, and a piece only looks at the waves open to its (first) class: most
waves of a large step are full, so this keeps a run near O(M x open waves).

`pack_greedy` runs several modes x orders x rules, empties light waves after each run
(`local.eliminate`) and keeps the fewest waves (first found on ties), stopping as soon as a
run meets the lower bound.

Complexity of one run: O(M W P (1 + s)) for M pieces placed, W open waves, P envelope points
and s distinct subgroups per piece; memory O(W (P + S + K)).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
from numba import njit

from waveplan.pricing.stable_sort import stable_argsort
from waveplan.pricing.tolerances import FIT_EPS, TIE_EPS

from .items import Blocks, Items, atom_size
from .kernels import Headers, Pieces, add_atom, delta, grow
from .local import eliminate

LIMIT = 1.0 - FIT_EPS
ELIMINATE_CANDIDATES = 8   # lightest waves tried per round of `eliminate`

# Placement rules: which open wave a piece goes to (`_choose`; ties: the lowest wave).
FIRST_FIT = 0            # the first (lowest) wave that holds it
BEST_FIT = 1             # the tightest after: the largest load after adding it
CHEAPEST_INCREASE = 2    # the smallest load increase summed over points (then tightest after)
WORST_FIT = 3            # the least loaded after (spreads the load: exact wave counts)
DRAWN_RULES = 3          # the multistart draws one of the rules below this one uniformly
PEAK_INCREASE = 4        # the smallest rise of the wave's peak (then tightest after): a wave
                         # whose binding point belongs to another gradient slot takes a row
                         # for little or nothing, so waves mix slots (large steps only)

# Modes: what happens to a block that fits no open wave.
KEEP_BLOCKS = 0          # it opens a new wave when it fits alone (else as SPLIT_BLOCKS)
SPLIT_BLOCKS = 1         # its atoms are placed one by one, opening waves as needed
NUM_MODES = 2


class GreedyInputs(NamedTuple):
    """What every greedy run of one (items, blocks) pair reads (`greedy_inputs`)."""

    blocks: Pieces           # the blocks as pieces: weights, subgroups, classes
    block_ptr: np.ndarray    # int64[B + 1]: block i holds block_atoms[block_ptr[i]:...[i + 1]]
    block_atoms: np.ndarray  # int64: atoms of each block, decreasing size inside the block
    block_alone: np.ndarray  # float64[B, P]: the load of each block alone in a wave
    atoms: Pieces            # the items' atoms as pieces
    headers: Headers         # subgroup and class headers
    num_atoms: int
    wmin: np.ndarray         # float64[K, P]: per class, its lightest atom at each point
    limit: float             # a wave fits while its load is <= limit at every point


@njit(cache=True)
def _choose(opened, rule, load, scnt, ccnt, w, subs, classes, sub_hdr, class_hdr, tmp, limit):
    """Wave under `rule` among the open waves `opened` (ascending) for a piece of weight `w`
    touching subgroups `subs` and classes `classes`, or -1 when none holds it. Ties go to the
    lowest wave."""
    best = -1
    best_key = 0.0
    best_key2 = 0.0
    P = load.shape[1]
    for j in range(opened.shape[0]):
        b = opened[j]
        m = delta(load, scnt, ccnt, b, w, subs, classes, sub_hdr, class_hdr, tmp, limit)
        if m > limit:
            continue
        if rule == FIRST_FIT:
            return b
        if rule == BEST_FIT:
            key = -m
            key2 = 0.0
        elif rule == CHEAPEST_INCREASE:
            inc = 0.0
            for p in range(P):
                inc += tmp[p] - load[b, p]
            key = inc
            key2 = -m
        elif rule == WORST_FIT:
            key = m
            key2 = 0.0
        else:   # PEAK_INCREASE
            peak = -1e300
            for p in range(P):
                if load[b, p] > peak:
                    peak = load[b, p]
            key = m - peak
            key2 = -m
        if best < 0 or key < best_key - TIE_EPS or (abs(key - best_key) <= TIE_EPS
                                                     and key2 < best_key2):
            best = b
            best_key = key
            best_key2 = key2
    return best


@njit(cache=True)
def _close_full(b, opened, n_open, load, ccnt, wmin, class_hdr, limit):
    """Drop wave b from the open list of each class k whose lightest atom (wmin[k], plus the
    class header when k is not in the wave yet) overflows some point of b: no piece holding
    class k can go there any more, so later pieces skip it. O(K P + W) per call."""
    P = load.shape[1]
    for k in range(wmin.shape[0]):
        full = False
        for p in range(P):
            v = load[b, p] + wmin[k, p]
            if ccnt[b, k] == 0:
                v += class_hdr[k, p]
            if v > limit:
                full = True
                break
        if full:
            m = 0
            for j in range(n_open[k]):
                if opened[k, j] != b:
                    opened[k, m] = opened[k, j]
                    m += 1
            n_open[k] = m


@njit(cache=True)
def _open_wave(opened, n_open, b):
    """A new wave is open to every class (it has the highest index: the lists stay sorted)."""
    if b >= opened.shape[1]:
        bigger = np.empty((opened.shape[0], 2 * b + 2), dtype=np.int64)
        for k in range(opened.shape[0]):   # a loop, not a slice copy: no shape-check overload to compile
            for j in range(opened.shape[1]):
                bigger[k, j] = opened[k, j]
        opened = bigger
    for k in range(opened.shape[0]):
        opened[k, n_open[k]] = b
        n_open[k] += 1
    return opened


@njit(cache=True)
def greedy_run(border, rule, mode, fixed, inputs):
    """One greedy pass over the blocks in `border` under placement `rule` and `mode`, reading
    `inputs` (a `GreedyInputs`). Returns (atom_wave[num_atoms] with -1 for atoms not packed,
    waves); waves = -1 when `fixed` > 0 waves cannot hold everything (some may stay empty).
    A piece only looks at the waves still open to its first class (see `_close_full`)."""
    bw, bsptr, bs, bcptr, bc = inputs.blocks
    aw, asptr, as_, acptr, ac = inputs.atoms
    sub_hdr, class_hdr = inputs.headers
    bptr = inputs.block_ptr
    batoms = inputs.block_atoms
    balone = inputs.block_alone
    num_atoms = inputs.num_atoms
    wmin = inputs.wmin
    limit = inputs.limit
    P = sub_hdr.shape[1]
    S = sub_hdr.shape[0]
    K = class_hdr.shape[0]
    cap0 = fixed if fixed > 0 else 16
    load = np.zeros((cap0, P))
    scnt = np.zeros((cap0, S), dtype=np.int32)
    ccnt = np.zeros((cap0, K), dtype=np.int32)
    atom_wave = -np.ones(num_atoms, dtype=np.int64)
    nw = fixed if fixed > 0 else 0
    opened = np.empty((max(K, 1), cap0), dtype=np.int64)
    n_open = np.zeros(max(K, 1), dtype=np.int64)
    for b in range(nw):
        opened = _open_wave(opened, n_open, b)
    tmp = np.empty(P)
    for bi in range(border.shape[0]):
        blk = border[bi]
        k0 = bc[bcptr[blk]] if bcptr[blk + 1] > bcptr[blk] else 0
        b = _choose(opened[k0][:n_open[k0]], rule, load, scnt, ccnt, bw[blk],
                    bs[bsptr[blk]:bsptr[blk + 1]], bc[bcptr[blk]:bcptr[blk + 1]], sub_hdr,
                    class_hdr, tmp, limit)
        whole_alone = True
        for p in range(P):
            if balone[blk, p] > limit:
                whole_alone = False
        if b < 0 and fixed == 0 and mode == KEEP_BLOCKS and whole_alone:
            load, scnt, ccnt = grow(load, scnt, ccnt, nw + 1)
            b = nw
            nw += 1
            opened = _open_wave(opened, n_open, b)
        if b >= 0:
            for j in range(bptr[blk], bptr[blk + 1]):
                a = batoms[j]
                add_atom(b, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr)
                atom_wave[a] = b
            _close_full(b, opened, n_open, load, ccnt, wmin, class_hdr, limit)
            continue
        for j in range(bptr[blk], bptr[blk + 1]):
            a = batoms[j]
            k0 = ac[acptr[a]] if acptr[a + 1] > acptr[a] else 0
            b = _choose(opened[k0][:n_open[k0]], rule, load, scnt, ccnt, aw[a],
                        as_[asptr[a]:asptr[a + 1]], ac[acptr[a]:acptr[a + 1]], sub_hdr,
                        class_hdr, tmp, limit)
            if b < 0:
                if fixed > 0:
                    return atom_wave, -1
                load, scnt, ccnt = grow(load, scnt, ccnt, nw + 1)
                b = nw
                nw += 1
                opened = _open_wave(opened, n_open, b)
            add_atom(b, a, load, scnt, ccnt, aw, asptr, as_, acptr, ac, sub_hdr, class_hdr)
            atom_wave[a] = b
            _close_full(b, opened, n_open, load, ccnt, wmin, class_hdr, limit)
    return atom_wave, nw


def atom_args(items: Items) -> tuple[Pieces, Headers]:
    """The items' atoms and headers, as the kernels read them (`eliminate`, `balance`)."""
    return (Pieces(items.atom_w, items.atom_sptr, items.atom_s, items.atom_cptr, items.atom_c),
            Headers(items.sub_hdr, items.class_hdr))


def greedy_inputs(items: Items, blocks: Blocks) -> GreedyInputs:
    """What every greedy run over these blocks reads (`greedy_run`, `multistart_chunk`)."""
    atoms, headers = atom_args(items)
    return GreedyInputs(
        blocks=Pieces(blocks.w, blocks.sptr, blocks.s, blocks.cptr, blocks.c),
        block_ptr=blocks.ptr, block_atoms=blocks.atoms, block_alone=blocks.alone, atoms=atoms,
        headers=headers, num_atoms=items.num_atoms,
        wmin=class_min_weights(items, blocks.atoms), limit=LIMIT)


def class_min_weights(items: Items, atoms: np.ndarray) -> np.ndarray:
    """float64[K, P]: per class, the smallest weight at each point of an atom holding that
    class (inf where no atom does). An atom of several classes counts for each of them."""
    return _class_min(np.asarray(atoms, dtype=np.int64), items.atom_w, items.atom_cptr,
                      items.atom_c, max(items.class_hdr.shape[0], 1))


@njit(cache=True)
def _class_min(atoms, aw, acptr, ac, K):
    out = np.full((K, aw.shape[1]), np.inf)
    for a in atoms:
        for j in range(acptr[a], acptr[a + 1]):
            k = ac[j]
            for p in range(aw.shape[1]):
                if aw[a, p] < out[k, p]:
                    out[k, p] = aw[a, p]
    return out


@njit(cache=True)
def balanced_order(alone, size):
    """Blocks grouped by their dominant point (where their alone load is largest), each group
    by decreasing size (ties: index); the next block always comes from the group with the
    most size left. Consecutive blocks then stress different points, so the waves a greedy
    fills mix complementary blocks (e.g. two slots whose gradient classes peak at different
    walk points) instead of stacking blocks that all peak at the same point.
    O(B (log B + P))."""
    nb, P = alone.shape
    dom = np.zeros(nb, dtype=np.int64)
    for b in range(nb):
        for p in range(1, P):
            if alone[b, p] > alone[b, dom[b]]:
                dom[b] = p
    by_size = stable_argsort(-size)       # stable: ties by index
    heads = np.zeros(P + 1, dtype=np.int64)
    for b in range(nb):
        heads[dom[b] + 1] += 1
    for p in range(P):
        heads[p + 1] += heads[p]
    fill = heads[:P].copy()
    lists = np.empty(nb, dtype=np.int64)
    rem = np.zeros(P)
    for j in range(nb):
        b = by_size[j]
        lists[fill[dom[b]]] = b
        fill[dom[b]] += 1
        rem[dom[b]] += size[b]
    pos = heads[:P].copy()
    out = np.empty(nb, dtype=np.int64)
    for j in range(nb):
        best = -1
        for p in range(P):
            if pos[p] < heads[p + 1] and (best < 0 or rem[p] > rem[best]):
                best = p
        b = lists[pos[best]]
        pos[best] += 1
        rem[best] -= size[b]
        out[j] = b
    return out


def block_orders(blocks: Blocks, items: Items):
    """Deterministic block orders, best first, each computed only when the previous runs did
    not meet the bound: balanced across dominant points (`balanced_order`, the best single
    order on generated GRPO steps), decreasing largest load, decreasing total load,
    decreasing total load weighted towards the tightest point. Duplicates are skipped."""
    nb = blocks.count
    if nb == 0:
        yield np.zeros(0, dtype=np.int64)
        return
    idx = np.arange(nb)

    def by_tight():
        tight = blocks.alone.sum(axis=0)
        return np.lexsort((idx, -(blocks.alone @ (tight / max(float(tight.sum()), 1e-300)))))

    makers = (lambda: balanced_order(blocks.alone, blocks.size),
              lambda: np.lexsort((idx, -blocks.size)),
              lambda: np.lexsort((idx, -blocks.alone.sum(axis=1))), by_tight)
    seen: list[np.ndarray] = []
    for make in makers:
        o = make().astype(np.int64)
        if not any(np.array_equal(o, x) for x in seen):
            seen.append(o)
            yield o


def pack_greedy(items: Items, blocks: Blocks, target: int, fixed: int = 0,
                deadline: float | None = None, max_runs: int | None = None,
                peak_first: bool = False, keep_first: bool = False,
                ) -> tuple[np.ndarray | None, int, int]:
    """Best of the deterministic greedy runs, each followed (without a fixed count) by
    `eliminate`, which empties light waves into the others. Returns (atom_wave, waves, runs);
    waves = -1 (and atom_wave None) when `fixed` > 0 waves could not be filled by any run.
    With a `deadline` (perf_counter seconds), no new run starts after it once a plan exists;
    with `max_runs` (the deterministic budget), no more than that many runs once a plan exists.

    Run order, best first on generated steps (a short budget only runs the first few): the
    block orders of `block_orders`, atom-by-atom runs (SPLIT_BLOCKS) before block-whole runs
    (KEEP_BLOCKS), then the rules. Ties keep the first plan. `peak_first` (large steps)
    puts PEAK_INCREASE before the other rules: on generated steps of 512 atoms it mixes the
    gradient slots and never needed more waves than CHEAPEST_INCREASE in the first run.
    `keep_first` (with `peak_first`; AUTO when the fill follows, see `packers._fill`) runs
    PEAK_INCREASE with whole blocks (KEEP_BLOCKS) first: the fill already builds waves atom by
    atom, so the greedy's first run offers the other construction, and the better plan is
    kept (on the generated 512-request GRPO study it saved the wave an atom-by-atom first run
    lost on one step of 50; alone, without the fill, it costs waves from 768 atoms on)."""
    rules = ((WORST_FIT, BEST_FIT, CHEAPEST_INCREASE, FIRST_FIT) if fixed
             else (CHEAPEST_INCREASE, FIRST_FIT, BEST_FIT))
    if peak_first and not fixed:
        rules = (PEAK_INCREASE, *rules)
    modes = (KEEP_BLOCKS,) if fixed else (SPLIT_BLOCKS, KEEP_BLOCKS)
    inputs = greedy_inputs(items, blocks)
    active = np.sort(blocks.atoms)
    asize = atom_size(items)
    runs_order = [(mode, rule) for mode in modes for rule in rules]
    if keep_first and peak_first and not fixed:
        runs_order.remove((KEEP_BLOCKS, PEAK_INCREASE))
        runs_order.insert(0, (KEEP_BLOCKS, PEAK_INCREASE))
    best, best_nw, runs = None, -1, 0
    for order in block_orders(blocks, items):
        for mode, rule in runs_order:
            aw, nw = greedy_run(order, rule, mode, fixed, inputs)
            runs += 1
            if nw > target and fixed == 0 and nw > 1:
                nw = eliminate(aw, nw, active, asize, ELIMINATE_CANDIDATES, inputs.atoms,
                               inputs.headers, LIMIT)
            if nw > 0 and (best_nw < 0 or nw < best_nw):
                best, best_nw = aw, nw
            if best_nw > 0 and best_nw <= target:
                return best, best_nw, runs
            if best_nw > 0 and ((max_runs is not None and runs >= max_runs) or (
                    deadline is not None and time.perf_counter() >= deadline)):
                return best, best_nw, runs
    return best, best_nw, runs
