"""Items and constraints of the packing, built from the step and the pricer's envelope.

The envelope value of a wave at point p is
    const[p] + sum_k present_k presence[p,k]
             + sum_k (coef[p,k,0] packed_k + coef[p,k,1] logical_k + coef[p,k,2] segments_k).
Rewritten per *subgroup* s = (prefix group g, class k): every request i of class k costs
    w_i[p] = coef[p,k,0] own_rows[i] + coef[p,k,1] num_tokens[i] + coef[p,k,2]
and every subgroup present in the wave pays its prompt once, its header
    h_s[p] = coef[p,k,0] prefix_rows[g] + coef[p,k,2],
and every class present pays presence[p,k]. Everything is divided by cap[p] = budget -
const[p], so a wave fits iff its load is <= 1 - FIT_EPS at every point: vector bin packing in
which a group pays its prompt once per wave it appears in. Negative coefficients are clipped
to 0 (the envelope only grows, so the guarantee holds) and points dominated by another point
are dropped.

Step-aware bound. coef[p,k,2] charges every two-level segment the worst padding of a whole
packed sequence plus two true segments, because the envelope knows nothing of the step. When
the envelope gives that charge's parts (a pricing `Envelope` with a padding row `pad` and a
true segment `seg`) and the step says its form (a pricing `Step`), the weights use what the
step's trees allow instead (`items_jit.weights`):
- each subgroup with prefix > 0 forms at most one packed sequence per wave, so it pays at
  most (multiple - 1) padding rows once, in its header, not once per member;
- a request that is a tree of its own (prefix 0, or the only member of its subgroup in a
  length-form step) is charged its exact rows, one segment and its exact padding;
- segments: length form is exactly two-level (the prompt's node + one leaf per member);
  token form has at most one inner node per leaf (two segments per member).
Token-form steps go one step further (`_tree_items`): their prompts nest (a system prompt
inside a task prompt inside a conversation), and a two-level group pays every shared token
above its deepest node again. There, a subgroup is a (radix-tree node, class) pair, every
request pays the nodes on its root path (the TREE_DEPTH nearest the root; deeper ones are
charged to the request), and a wave's packed rows are then at most its requests' rows below
those nodes plus the edges of the nodes it touches (exactly, when no path is cut); segments at most one
per node and per request; padding at most (multiple - 1) rows per top-level node's tree.
Still an upper bound of the exact price of every flat wave without pending gradients (tested
on random waves), and much closer: for unshared steps (SFT) it is the exact price.

Atoms are the indivisible items: a caller's atomic unit, or a single request.
Blocks (built in `blocks_for`) are the connected sets of atoms that share prefix groups;
the greedy keeps a block in one wave when it fits.

Complexity: O(n P) time (jitted) and O(n P) memory; O(P^2 K) once per envelope (cached).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from waveplan.pricing.envelope import Envelope
from waveplan.pricing.errors import InfeasibleError, StepError, bad
from waveplan.pricing.step import Step

from .contract import Pricer, SearchEnvelope, SearchPricer, SearchStep
from .items_jit import (
    GENERIC_BOUND,
    LENGTH_FORM,
    TOKEN_FORM,
    WeightCharges,
    alone_loads,
    blocks_by_group,
    prefix_tree,
    subgroups,
    tree_subgroups,
    tree_weights,
    weights,
)
from .pending import reserve_room

TREE_DEPTH = 16        # tree nodes (nearest the root) a request pays a header for, at least
TREE_ENTRIES = 16384   # ... or up to this many (request, node) pairs in all (small steps)


@dataclass(frozen=True)
class Items:
    n: int
    budget: float
    points: np.ndarray       # int64[P]  envelope points kept
    cap: np.ndarray          # float64[P] budget - const[p] (bytes)
    req_w: np.ndarray        # float64[n, P]
    class_of: np.ndarray     # int64[n]
    req_sptr: np.ndarray     # CSR of the subgroups each request pays a header for
    req_s: np.ndarray
    block_key: np.ndarray    # int64[n] requests with one key form a block (no atomic units)
    sub_class: np.ndarray    # int64[S]
    sub_group: np.ndarray    # int64[S] prefix group, or tree node
    sub_hdr: np.ndarray      # float64[S, P]
    class_hdr: np.ndarray    # float64[K, P]
    atom_ptr: np.ndarray     # int64[A+1]
    atom_req: np.ndarray     # int64[n], ascending inside each atom
    atom_of: np.ndarray      # int64[n]
    atom_unit: np.ndarray    # bool[A]  (caller's unit vs a single request)
    atom_w: np.ndarray       # float64[A, P] sum of member w
    atom_sptr: np.ndarray    # CSR of distinct subgroups per atom
    atom_s: np.ndarray
    atom_cptr: np.ndarray    # CSR of distinct classes per atom
    atom_c: np.ndarray
    atom_alone: np.ndarray   # float64[A, P] load of the atom alone in a wave

    @property
    def num_atoms(self) -> int:
        return len(self.atom_ptr) - 1

    def atom(self, a: int) -> np.ndarray:
        return self.atom_req[self.atom_ptr[a]:self.atom_ptr[a + 1]]

    def load_of(self, reqs: np.ndarray) -> np.ndarray:
        """Normalised envelope load (per kept point) of a flat wave holding `reqs`."""
        reqs = np.asarray(reqs, dtype=np.int64)
        subs = np.unique(np.concatenate([self.req_s[self.req_sptr[i]:self.req_sptr[i + 1]]
                                         for i in reqs])) if len(reqs) else reqs
        classes = np.unique(self.sub_class[subs])
        return (self.req_w[reqs].sum(axis=0) + self.sub_hdr[subs].sum(axis=0)
                + self.class_hdr[classes].sum(axis=0))


def _prune_points(rows: np.ndarray) -> np.ndarray:
    """Indices of points not dominated by another (ties keep the first). O(P^2 D)."""
    P = rows.shape[0]
    ge = np.all(rows[:, None, :] >= rows[None, :, :], axis=2)   # ge[q, p]: q >= p everywhere
    gt = np.any(rows[:, None, :] > rows[None, :, :], axis=2)
    earlier = np.arange(P)[:, None] < np.arange(P)[None, :]
    dom = ge & (gt | earlier)
    np.fill_diagonal(dom, False)
    return np.flatnonzero(~dom.any(axis=0)).astype(np.int64)


def _csr_from_pairs(rows: np.ndarray, vals: np.ndarray, nrows: int,
                    nvals: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct (row, val) pairs as CSR (values ascending inside a row)."""
    key = np.unique(rows * max(nvals, 1) + vals)
    r = key // max(nvals, 1)
    ptr = np.zeros(nrows + 1, dtype=np.int64)
    np.add.at(ptr, r + 1, 1)
    return np.cumsum(ptr), (key % max(nvals, 1)).astype(np.int64)


def _csr_sum(ptr: np.ndarray, idx: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Per CSR row, the sum of table[idx] (rows of table summed)."""
    out = np.zeros((len(ptr) - 1, table.shape[1]))
    if len(idx):
        rows = np.repeat(np.arange(len(ptr) - 1), np.diff(ptr))
        np.add.at(out, rows, table[idx])
    return out


def normalise_units(n: int, atomic_units, ids) -> list[np.ndarray]:
    """Validate the caller's atomic units: in range, non-empty, pairwise disjoint."""
    seen = np.full(n, -1, dtype=np.int64)
    units = []
    for u, unit in enumerate(atomic_units):
        arr = np.unique(np.asarray(list(unit), dtype=np.int64))
        if len(arr) == 0:
            raise StepError(f"atomic_units[{u}]=[]: an atomic unit must hold a request")
        if arr[0] < 0 or arr[-1] >= n:
            raise bad(StepError, f"atomic_units[{u}]", arr.tolist(), f"request index out of range "
                      f"0..{n - 1}")
        clash = arr[seen[arr] >= 0]
        if len(clash):
            raise StepError(f"atomic_units[{u}]: request {ids[int(clash[0])]!r} is already in "
                            f"atomic_units[{int(seen[clash[0]])}]")
        seen[arr] = u
        units.append(arr)
    return units


@dataclass(frozen=True)
class PointCoefs:
    """The envelope's kept points and their coefficients, per point and class (bytes)."""

    points: np.ndarray     # int64[P] envelope points kept
    const: np.ndarray      # float64[P]
    presence: np.ndarray   # float64[P, K]
    c0: np.ndarray         # float64[P, K] per packed row
    c1: np.ndarray         # float64[P, K] per logical row
    cseg: np.ndarray       # float64[P, K] per segment (GENERIC_BOUND: the envelope's whole charge)
    cpad: np.ndarray       # float64[P, K] per padding row (GENERIC_BOUND: unused)
    multiple: int
    step_aware: bool       # the envelope splits its segment charge (pad, seg): step-aware modes


_COEF_CACHE: dict[int, tuple[object, PointCoefs]] = {}
_COEF_CACHE_SIZE = 64


def point_coefs(env: SearchEnvelope) -> PointCoefs:
    """Clip negative coefficients to 0 (the envelope only grows) and drop points dominated by
    another. Cached per envelope object (pricers share theirs across steps): O(P^2 K) once.
    Step-aware (modes 1-2) when a pricing `Envelope` knows both parts of its segment charge;
    any other envelope gets the generic bound."""
    hit = _COEF_CACHE.get(id(env))
    if hit is not None and hit[0] is env:
        return hit[1]
    const = np.asarray(env.const, dtype=np.float64)
    presence = np.maximum(np.asarray(env.presence, dtype=np.float64), 0.0)
    coef = np.maximum(np.asarray(env.coef, dtype=np.float64), 0.0)
    split = isinstance(env, Envelope)
    pad = env.pad if split else None
    seg = env.seg if split else None
    aware = pad is not None and seg is not None
    if aware:
        pad = np.maximum(np.asarray(pad, dtype=np.float64), 0.0)
        seg = np.maximum(np.asarray(seg, dtype=np.float64), 0.0)
        cols = [coef[:, :, 0], coef[:, :, 1], seg, pad]
    else:
        cols = [coef[:, :, 0], coef[:, :, 1], coef[:, :, 2]]
    points = _prune_points(np.concatenate([const[:, None], presence, *cols], axis=1))
    c0, c1 = coef[points, :, 0], coef[points, :, 1]
    cseg = seg[points] if aware else coef[points, :, 2]
    cpad = pad[points] if aware else np.zeros_like(c0)
    out = PointCoefs(points=points, const=const[points], presence=presence[points],
                     c0=np.ascontiguousarray(c0), c1=np.ascontiguousarray(c1),
                     cseg=np.ascontiguousarray(cseg), cpad=np.ascontiguousarray(cpad),
                     multiple=int(env.multiple) if split else 1, step_aware=aware)
    if len(_COEF_CACHE) >= _COEF_CACHE_SIZE:
        _COEF_CACHE.pop(next(iter(_COEF_CACHE)))
    _COEF_CACHE[id(env)] = (env, out)
    return out


def weight_mode(step: SearchStep, coefs: PointCoefs) -> int:
    """GENERIC_BOUND, LENGTH_FORM or TOKEN_FORM (see items_jit.weights). A step that does not
    say its form (not a pricing `Step`) gets the generic bound."""
    if not coefs.step_aware or not isinstance(step, Step):
        return GENERIC_BOUND
    return TOKEN_FORM if step.is_token_form else LENGTH_FORM


def _tree_items(step: Step, pc: PointCoefs, cap: np.ndarray, class_of: np.ndarray, K: int):
    """Items of a token-form step from its radix tree (`items_jit.prefix_tree`): a subgroup
    per (tree node, class), every request paying the nodes on its root path, so nested
    shared prompts are paid once per wave each, not once per deepest group. Only the
    max(TREE_DEPTH, TREE_ENTRIES / n) nodes nearest the root of each path are kept (they are
    the most shared); a deeper node's rows are charged to each of its requests (still an
    upper bound). Returns
    the items' arrays and whether a path was cut. O(n (log n + TREE_DEPTH P))."""
    n = len(class_of)
    order = np.argsort(np.asarray(step.rank, dtype=np.int64), kind="stable")
    lcp = np.ascontiguousarray(step.lcp_table[0, :max(n - 1, 0)], dtype=np.int64)
    lengths = np.ascontiguousarray(step.lengths, dtype=np.int64)
    node_parent, node_depth, leaf_parent = prefix_tree(order, lcp, lengths)
    V = len(node_depth)
    req_sptr, req_s, sub_node, sub_class, kept, skipped = tree_subgroups(
        leaf_parent, node_parent, V, class_of, K, max(TREE_DEPTH, TREE_ENTRIES // max(n, 1)))
    charges = WeightCharges(pc.c0, pc.c1, pc.cseg, pc.cpad, cap, pc.multiple)
    req_w, sub_hdr = tree_weights(charges, class_of, kept, node_parent, node_depth, V, sub_node,
                                  sub_class, lengths, lengths.astype(np.float64))
    return req_w, sub_hdr, req_sptr, req_s, sub_node, sub_class, kept, bool(skipped.any())


def _mass(req_w: np.ndarray, sub_hdr: np.ndarray) -> float:
    """Largest total load over the points, each header paid once: how heavy a model is."""
    total = req_w.sum(axis=0) + sub_hdr.sum(axis=0)
    return float(total.max()) if total.size else 0.0


def build_items(step: SearchStep, pricer: Pricer | SearchPricer, budget_bytes: float,
                atomic_units=(), *, reserve_pending: str | None = "measured") -> Items:
    """Build the normalised packing items. Raises InfeasibleError if the wave constant alone
    exceeds the budget at some point. With `reserve_pending` ("measured" or "bound", see
    `pending`), one request per gradient slot weighs its slot's pending gradients too."""
    pricer = SearchPricer.of(pricer)
    reqs = step.requests
    n = len(reqs)
    pc = point_coefs(pricer.envelope())
    points = pc.points
    cap = float(budget_bytes) - pc.const
    if np.any(cap <= 0):
        p = int(points[int(np.argmin(cap))])
        raise InfeasibleError(f"budget_bytes={int(budget_bytes)}: below the fixed cost of any "
                              f"wave ({int(pc.const.max())} admitted bytes at envelope point {p})")
    K = int(pricer.num_classes)
    class_of = np.ascontiguousarray(pricer.class_of, dtype=np.int64)
    group_of = np.ascontiguousarray(step.group_of, dtype=np.int64)
    prefix = np.ascontiguousarray(step.prefix_rows, dtype=np.int64)
    own = np.ascontiguousarray(step.own_rows, dtype=np.int64)
    tokens = (np.asarray(step.lengths, dtype=np.float64) if isinstance(step, Step)
              else np.asarray([r.num_tokens for r in reqs], dtype=np.float64))
    P = len(points)
    mode = weight_mode(step, pc)
    tree = (_tree_items(step, pc, cap, class_of, K)
            if (mode == TOKEN_FORM and n and isinstance(step, Step)) else None)
    if n:
        sub_of, sub_group, sub_class, sub_count = subgroups(group_of, class_of, K)
        req_w, sub_hdr = weights(WeightCharges(pc.c0, pc.c1, pc.cseg, pc.cpad, cap, pc.multiple),
                                 class_of, sub_of, sub_group, sub_class, sub_count, prefix, own,
                                 tokens, mode)
        req_sptr, req_s = np.arange(n + 1, dtype=np.int64), sub_of
        block_key = sub_group[sub_of]
        # the tree items are tighter unless paths were cut: then keep the lighter model
        if tree is not None and (not tree[-1] or _mass(tree[0], tree[1]) < _mass(req_w, sub_hdr)):
            req_w, sub_hdr, req_sptr, req_s, sub_group, sub_class, block_key = tree[:-1]
    else:
        req_sptr = np.zeros(1, dtype=np.int64)
        req_s = sub_group = sub_class = block_key = np.zeros(0, dtype=np.int64)
        req_w, sub_hdr = np.zeros((0, P)), np.zeros((0, P))
    class_hdr = np.ascontiguousarray(pc.presence.T / cap) if K else np.zeros((0, P))
    alone = alone_loads(req_w, sub_hdr, class_hdr, req_sptr, req_s, class_of) if n else req_w
    if reserve_pending and n:
        req_w, alone = reserve_room(pricer, req_w, alone, cap, class_of, reserve_pending)
    # atoms: the caller's units and single requests, numbered by their first request
    units = (normalise_units(n, atomic_units, [r.id for r in reqs]) if len(atomic_units)
             else [])
    if not units:   # fast path: every atom is one request, atom a == request a
        ar = np.arange(n, dtype=np.int64)
        atom_of = atom_req = ar
        atom_ptr = atom_cptr = np.arange(n + 1, dtype=np.int64)
        atom_unit = np.zeros(n, dtype=bool)
        atom_sptr, atom_s, atom_c = req_sptr, req_s, class_of
        atom_w = req_w
        atom_alone = alone
    else:
        atom_of = np.arange(n, dtype=np.int64)
        for u in units:
            atom_of[u] = u[0]
        firsts, atom_of = np.unique(atom_of, return_inverse=True)
        atom_of = atom_of.astype(np.int64)
        A = len(firsts)
        atom_req = np.argsort(atom_of, kind="stable").astype(np.int64)
        atom_ptr = np.zeros(A + 1, dtype=np.int64)
        np.add.at(atom_ptr, atom_of + 1, 1)
        atom_ptr = np.cumsum(atom_ptr)
        atom_unit = np.zeros(A, dtype=bool)
        for u in units:
            atom_unit[atom_of[u[0]]] = True
        S = len(sub_group)
        atom_sptr, atom_s = _csr_from_pairs(np.repeat(atom_of, np.diff(req_sptr)), req_s, A, S)
        atom_cptr, atom_c = _csr_from_pairs(atom_of, class_of, A, K)
        atom_w = np.zeros((A, P))
        np.add.at(atom_w, atom_of, req_w)
        atom_alone = atom_w + _csr_sum(atom_sptr, atom_s, sub_hdr) + _csr_sum(
            atom_cptr, atom_c, class_hdr)
    return Items(n=n, budget=float(budget_bytes), points=points, cap=cap, req_w=req_w,
                 class_of=class_of, req_sptr=req_sptr, req_s=req_s, block_key=block_key,
                 sub_class=sub_class, sub_group=sub_group, sub_hdr=sub_hdr,
                 class_hdr=class_hdr, atom_ptr=atom_ptr, atom_req=atom_req, atom_of=atom_of,
                 atom_unit=atom_unit, atom_w=atom_w, atom_sptr=atom_sptr, atom_s=atom_s,
                 atom_cptr=atom_cptr, atom_c=atom_c, atom_alone=atom_alone)


@dataclass(frozen=True)
class Blocks:
    """Connected sets of active atoms sharing prefix groups, for the greedy (CSR arrays)."""

    ptr: np.ndarray      # int64[B+1]
    atoms: np.ndarray    # atoms of each block, decreasing size inside the block
    w: np.ndarray        # float64[B, P]
    sptr: np.ndarray
    s: np.ndarray
    cptr: np.ndarray
    c: np.ndarray
    alone: np.ndarray    # float64[B, P]
    size: np.ndarray     # float64[B] max_p alone load (sort key)

    @property
    def count(self) -> int:
        return len(self.ptr) - 1


def atom_size(items: Items) -> np.ndarray:
    """Sort key of an atom: its largest normalised alone load."""
    if items.num_atoms == 0:
        return np.zeros(0)
    return items.atom_alone.max(axis=1) if items.atom_alone.shape[1] else np.zeros(items.num_atoms)


def blocks_for(items: Items, active: np.ndarray) -> Blocks:
    """Blocks of the active atoms: atoms joined when they share a prefix group (units can
    join several groups). O(n log n + P n) vectorised, plus a Python loop over the units."""
    active = np.asarray(active, dtype=np.int64)
    if not items.atom_unit.any():
        return _blocks_by_group(items, active)
    P = len(items.points)
    group_of_sub = items.sub_group
    G = int(group_of_sub.max()) + 1 if len(group_of_sub) else 0
    parent = np.arange(G, dtype=np.int64)

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    first_group = np.zeros(items.num_atoms, dtype=np.int64)
    if items.num_atoms:
        first_group = group_of_sub[items.atom_s[items.atom_sptr[:-1]]]
    for a in np.flatnonzero(items.atom_unit):
        gs = np.unique(group_of_sub[items.atom_s[items.atom_sptr[a]:items.atom_sptr[a + 1]]])
        r0 = find(int(gs[0]))
        for g in gs[1:]:
            r = find(int(g))
            if r != r0:
                lo, hi = min(r, r0), max(r, r0)
                parent[hi] = lo
                r0 = lo
    roots = np.asarray([find(int(g)) for g in range(G)], dtype=np.int64) if items.atom_unit.any() \
        else np.arange(G, dtype=np.int64)
    broot = roots[first_group[active]] if len(active) else np.zeros(0, dtype=np.int64)
    uroots, block_of = np.unique(broot, return_inverse=True)
    nb = len(uroots)
    size = atom_size(items)
    order = np.lexsort((active, -size[active], block_of)) if len(active) else np.zeros(0, int)
    flat = active[order].astype(np.int64)
    ptr = np.zeros(nb + 1, dtype=np.int64)
    np.add.at(ptr, block_of + 1, 1)
    ptr = np.cumsum(ptr)
    w = np.zeros((nb, P))
    if len(active):
        np.add.at(w, block_of, items.atom_w[active])
    # distinct subgroups / classes per block
    block_of_atom = np.full(items.num_atoms, -1, dtype=np.int64)
    block_of_atom[active] = block_of
    entry_atom = np.repeat(np.arange(items.num_atoms), np.diff(items.atom_sptr))
    mask = block_of_atom[entry_atom] >= 0
    srows = block_of_atom[entry_atom[mask]]
    svals = items.atom_s[mask]
    return _finish_blocks(items, ptr, flat, w, srows, svals)


def _finish_blocks(items: Items, ptr, flat, w, srows, svals) -> Blocks:
    """Blocks from their atoms and weights: the subgroups (prompts) and classes each block
    touches, as CSR, and what the block costs alone. O(entries + blocks x P)."""
    nb = len(ptr) - 1
    P = len(items.points)
    sptr, s_flat = _csr_from_pairs(srows, svals, nb, len(items.sub_class))
    crows = np.repeat(np.arange(nb), np.diff(sptr))
    cptr, c_flat = _csr_from_pairs(crows, items.sub_class[s_flat], nb, items.class_hdr.shape[0])
    alone = w + _csr_sum(sptr, s_flat, items.sub_hdr) + _csr_sum(cptr, c_flat, items.class_hdr)
    bsize = alone.max(axis=1) if nb and P else np.zeros(nb)
    return Blocks(ptr=ptr, atoms=flat, w=w, sptr=sptr, s=s_flat, cptr=cptr, c=c_flat,
                  alone=alone, size=bsize)


def _blocks_by_group(items: Items, active: np.ndarray) -> Blocks:
    """Fast path without atomic units: a block is the active requests of one prefix group."""
    return Blocks(*blocks_by_group(np.ascontiguousarray(active, dtype=np.int64),
                                   atom_size(items), items.req_w, items.block_key,
                                   items.req_sptr, items.req_s, items.sub_class, items.sub_hdr,
                                   items.class_hdr))
