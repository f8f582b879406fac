"""Training steps: the requests of one step and the prefix-tree data the search needs.

A request comes in one of two forms:

* **token form**: its token ids; sharing is whatever common prefixes the tokens have;
* **length form**: a shared-prefix key (`prompt`) with the prefix length and the total
  length. Requests with the same key share exactly `num_prompt_tokens` leading tokens and
  differ at the first token after them; different keys (and requests without a key) share
  nothing (they differ at their first token).

A `Step` holds requests of one form only, and precomputes once, as numpy arrays:

* the order of its requests in the prefix tree and the adjacent longest common prefixes
  (token form: a lexicographic sort of the tokens; length form: derived from the keys),
  which `waveplan.pricing.layout` turns into exact tree counts for any subset;
* a two-level abstraction for the search: prefix groups (`group_of`, `prefix_rows`) and
  each request's rows after its group's prefix (`own_rows`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
from numba import njit

from .errors import StepError, bad

DEFAULT_SLOT = "default"


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


@dataclass(frozen=True, kw_only=True)
class Request:
    """One training sequence.

    `num_tokens` is the total length. `prompt` is the shared-prefix key of the length form and
    `num_prompt_tokens` its length (0 without a key); `tokens` are the ids of the token form
    (int64, read-only, excluded from equality and hashing). A request gives either `tokens`
    or a `prompt` key, never both.
    """

    id: str
    num_tokens: int
    prompt: str | None = None
    num_prompt_tokens: int = 0
    tokens: np.ndarray | None = field(default=None, compare=False, hash=False, repr=False)
    slot: str = DEFAULT_SLOT
    grad: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise bad(StepError, "request id", self.id, "must be a non-empty string")

        def fail(name: str, value: object, why: str) -> StepError:
            return bad(StepError, f"request {self.id!r}: {name}", value, why)

        if not _is_int(self.num_tokens) or self.num_tokens <= 0:
            raise fail("num_tokens", self.num_tokens, "must be a positive integer")
        object.__setattr__(self, "num_tokens", int(self.num_tokens))
        if not isinstance(self.slot, str) or not self.slot:
            raise fail("slot", self.slot, "must be a non-empty string")
        if not isinstance(self.grad, bool | np.bool_):
            raise fail("grad", self.grad, "must be true or false")
        object.__setattr__(self, "grad", bool(self.grad))
        if not _is_int(self.num_prompt_tokens):
            raise fail("num_prompt_tokens", self.num_prompt_tokens, "must be an integer")
        object.__setattr__(self, "num_prompt_tokens", int(self.num_prompt_tokens))
        if self.prompt is None:
            if self.num_prompt_tokens != 0:
                raise fail("num_prompt_tokens", self.num_prompt_tokens, "must be 0 without a prompt key")
        else:
            if not isinstance(self.prompt, str) or not self.prompt:
                raise fail("prompt", self.prompt, "must be a non-empty string or None")
            if self.tokens is not None:
                raise fail("prompt", self.prompt, "a request gives either tokens or a prompt key, not both")
            if not 0 < self.num_prompt_tokens < self.num_tokens:
                raise fail("num_prompt_tokens", self.num_prompt_tokens,
                           f"must be positive and leave a completion of >= 1 token "
                           f"(num_tokens={self.num_tokens})")
        if self.tokens is not None:
            tokens = np.asarray(self.tokens)
            if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
                raise fail("tokens", f"<{tokens.dtype} array of shape {tokens.shape}>",
                           "must be a 1-D sequence of integer token ids")
            if tokens.size != self.num_tokens:
                raise fail("tokens", f"<{tokens.size} ids>", f"length must equal num_tokens={self.num_tokens}")
            if tokens.dtype.kind == "u" and tokens.size and tokens.max() > np.iinfo(np.int64).max:
                raise fail("tokens", int(tokens.max()), "token id exceeds int64")
            tokens = np.array(tokens, dtype=np.int64)  # a private copy: the caller's array stays writable
            if tokens.size and tokens.min() < 0:
                raise fail("tokens", int(tokens.min()), "token ids must be >= 0")
            tokens.flags.writeable = False
            object.__setattr__(self, "tokens", tokens)

    @classmethod
    def from_tokens(cls, id: str, tokens, *, slot: str = DEFAULT_SLOT, grad: bool = True) -> Request:
        """A token-form request; `num_tokens` is the number of ids."""
        return cls(id=id, num_tokens=len(tokens), tokens=tokens, slot=slot, grad=grad)

    @property
    def num_completion_tokens(self) -> int:
        """Tokens after the prompt key's prefix (all of them without a key)."""
        return self.num_tokens - self.num_prompt_tokens


# --- token-form kernels -------------------------------------------------------------------


@njit(cache=True)
def _lcp(flat, a0, alen, b0, blen):  # pragma: no cover - numba
    m = min(alen, blen)
    i = 0
    while i < m and flat[a0 + i] == flat[b0 + i]:
        i += 1
    return i


@njit(cache=True)
def _sort_tokens(flat, starts, lengths):  # pragma: no cover - numba
    """Lexicographic order of the requests (a prefix sorts before its extensions; stable) and
    the adjacent longest common prefixes of that order. Bottom-up merge sort:
    O(n log n) comparisons, each O(LCP of the pair)."""
    n = starts.size
    order = np.arange(n)
    buf = np.empty(n, np.int64)
    width = 1
    while width < n:
        for lo in range(0, n, 2 * width):
            mid = min(lo + width, n)
            hi = min(lo + 2 * width, n)
            i, j, k = lo, mid, lo
            while i < mid and j < hi:
                a = order[i]
                b = order[j]
                common = _lcp(flat, starts[a], lengths[a], starts[b], lengths[b])
                if common == lengths[a] or (common < lengths[b] and flat[starts[a] + common] <= flat[starts[b] + common]):
                    buf[k] = a
                    i += 1
                else:
                    buf[k] = b
                    j += 1
                k += 1
            while i < mid:
                buf[k] = order[i]
                i += 1
                k += 1
            while j < hi:
                buf[k] = order[j]
                j += 1
                k += 1
        order, buf = buf, order
        width *= 2
    lcp = np.zeros(max(n - 1, 0), np.int64)
    for p in range(n - 1):
        a = order[p]
        b = order[p + 1]
        lcp[p] = _lcp(flat, starts[a], lengths[a], starts[b], lengths[b])
    return order, lcp


@njit(cache=True)
def _deepest_nodes(lcp):  # pragma: no cover - numba
    """For each position of the sorted order, the depth of the deepest tree node it shares
    with a neighbour, and an id of that node (-1 for the root: it shares nothing).

    LCP-interval stack pass, O(n): adjacent pairs with equal LCP and no smaller LCP between
    them meet at the same node."""
    n = lcp.size + 1
    pair_node = np.empty(max(n - 1, 0), np.int64)
    stack_depth = np.empty(n + 1, np.int64)
    stack_id = np.empty(n + 1, np.int64)
    stack_depth[0] = 0
    stack_id[0] = -1
    top = 0
    num_nodes = 0
    for p in range(n - 1):
        h = lcp[p]
        while stack_depth[top] > h:
            top -= 1
        if stack_depth[top] < h:
            top += 1
            stack_depth[top] = h
            stack_id[top] = num_nodes
            num_nodes += 1
        pair_node[p] = stack_id[top]
    depth = np.zeros(n, np.int64)
    node = np.full(n, -1, np.int64)
    for p in range(n):
        left = lcp[p - 1] if p > 0 else -1
        right = lcp[p] if p < n - 1 else -1
        if left >= right and left > 0:
            depth[p] = left
            node[p] = pair_node[p - 1]
        elif right > 0:
            depth[p] = right
            node[p] = pair_node[p]
    return depth, node


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _sparse_min_table(lcp: np.ndarray) -> np.ndarray:
    """table[j, i] = min(lcp[i : i + 2**j]) (unused cells 0): O(1) range minima for any subset.
    O(n log n) to build."""
    m = lcp.size
    levels = max(1, int(m).bit_length())
    table = np.zeros((levels, max(m, 1)), np.int64)
    table[0, :m] = lcp
    for j in range(1, levels):
        half = 1 << (j - 1)
        width = m - (1 << j) + 1
        if width <= 0:
            break
        table[j, :width] = np.minimum(table[j - 1, :width], table[j - 1, half:half + width])
    return table


@dataclass(frozen=True)
class Step:
    """The requests of one training step, with their prefix-tree data precomputed.

    Build it with `Step.from_requests` (or `load_step`). Arrays are read-only, indexed by
    request index (the order of `requests`) unless stated:

    * `lengths: int64[n]` total rows of each request (logical rows);
    * `group_of: int64[n]`, `prefix_rows: int64[G]`, `own_rows: int64[n]`: the search's
      two-level abstraction. Length form: a group is a prompt key, its prefix the key's
      `num_prompt_tokens`; a request without a key is a group of its own with prefix 0.
      Token form: a group is the requests whose leaf hangs under the same deepest shared node
      (the node where a request branches from its nearest sibling in the tree), its prefix
      that node's depth; a request sharing nothing is a group of its own with prefix 0. This
      ignores sharing above a group's node (conservative for the search); exact counts come
      from `waveplan.pricing.layout`. Groups are numbered by first appearance.
    * `slot_names: tuple[str, ...]` (first appearance) and `slots: int64[n]` indices into it;
      `grads: bool[n]`.

    Building costs O(n) Python work plus, in token form, one copy of the tokens and a merge
    sort of O(n log n) comparisons, each O(LCP of the pair).
    """

    requests: tuple[Request, ...]
    lengths: np.ndarray = field(init=False, compare=False, repr=False)
    group_of: np.ndarray = field(init=False, compare=False, repr=False)
    prefix_rows: np.ndarray = field(init=False, compare=False, repr=False)
    own_rows: np.ndarray = field(init=False, compare=False, repr=False)
    slot_names: tuple[str, ...] = field(init=False, compare=False, repr=False)
    slots: np.ndarray = field(init=False, compare=False, repr=False)
    grads: np.ndarray = field(init=False, compare=False, repr=False)
    # Prefix-tree order (see layout.py): rank[i] = position of request i in the tree order,
    # lcp_table = sparse range-minimum table over the adjacent LCPs of that order,
    # length_at[p] = length of the request at position p.
    rank: np.ndarray = field(init=False, compare=False, repr=False)
    lcp_table: np.ndarray = field(init=False, compare=False, repr=False)
    length_at: np.ndarray = field(init=False, compare=False, repr=False)
    is_token_form: bool = field(init=False, compare=False, repr=False)

    @classmethod
    def from_requests(cls, requests) -> Step:
        """Validate the requests (duplicate ids, one form, one prefix length per prompt key)
        and precompute the tree data."""
        return cls(requests=tuple(requests))

    # --- the user's own batch (lists, numpy arrays or tensors; see `batch_input`) ---------

    @classmethod
    def from_token_ids(cls, sequences, ids=None, slots=None, *, grads=None) -> Step:
        """A token-form step from token-id sequences (lists, numpy arrays or 1-D tensors):
        shared prefixes are whatever the tokens share, found by the step's prefix tree.

        `ids`: one string per sequence (default: the positions "0", "1", ...). `slots`,
        `grads`: one value for all or one per sequence (default: slot "default", grad on).
        O(total tokens) plus the tree sort (see the class docstring)."""
        from . import batch_input as bi

        rows = bi.token_rows(sequences)
        n = len(rows)
        names = bi.request_ids(ids, n)
        slot_of = bi.per_request("slots", slots, n, DEFAULT_SLOT, str)
        grad_of = bi.per_request("grads", grads, n, True, bool)
        return cls.from_requests(Request(id=names[i], num_tokens=int(rows[i].size), tokens=rows[i],
                                         slot=slot_of[i], grad=grad_of[i]) for i in range(n))

    @classmethod
    def from_lengths(cls, prompt_lengths, completion_lengths, groups=None, ids=None, *,
                     slots=None, grads=None) -> Step:
        """A length-form step: request i has `prompt_lengths[i]` prompt tokens followed by
        `completion_lengths[i]` (>= 1) completion tokens (the step file's `prompt_tokens` /
        `completion_tokens`). Requests with the same `groups` key share their prompt (its
        length must agree within the group); a key of None, no `groups`, or a prompt of 0
        tokens shares nothing. Keys are strings or integers and become the `prompt` keys.

        `ids`, `slots`, `grads` as in `from_token_ids`. O(n)."""
        from . import batch_input as bi
        from .errors import bad

        completion = bi.lengths("completion_lengths", completion_lengths, None, minimum=1)
        n = int(completion.size)
        prompt = bi.lengths("prompt_lengths", prompt_lengths, n, minimum=0)
        keys = bi.group_keys(groups, n)
        names = bi.request_ids(ids, n)
        slot_of = bi.per_request("slots", slots, n, DEFAULT_SLOT, str)
        grad_of = bi.per_request("grads", grads, n, True, bool)
        first: dict[str, int] = {}
        requests = []
        for i in range(n):
            key, p = keys[i], int(prompt[i])
            if key is not None:
                j = first.setdefault(key, i)
                if int(prompt[j]) != p:
                    raise bad(StepError, f"prompt_lengths[{i}]", p,
                              f"group {key!r} has {int(prompt[j])} prompt tokens at prompt_lengths[{j}]")
            shared = key is not None and p > 0
            requests.append(Request(id=names[i], num_tokens=p + int(completion[i]),
                                    prompt=key if shared else None,
                                    num_prompt_tokens=p if shared else 0,
                                    slot=slot_of[i], grad=grad_of[i]))
        return cls.from_requests(requests)

    @classmethod
    def from_padded(cls, input_ids, attention_mask, *, response_length=None, ids=None,
                    slots=None, grads=None) -> Step:
        """A step from a padded 2-D batch as veRL holds it (`input_ids`, `attention_mask`:
        tensors or arrays of shape [B, S]; each row's attended tokens one contiguous run, so
        right-, left- or both-side padded rows).

        Without `response_length`: a token-form step of each row's attended tokens (shared
        prefixes found by the prefix tree). With it (veRL: `batch["responses"].shape[-1]`):
        the last `response_length` columns are the response, the others the prompt, and the
        step is in length form: rows with the same prompt tokens share exactly their prompt
        (a GRPO group), nothing deeper; a row with no prompt or no response token shares
        nothing. `ids`, `slots`, `grads` as in `from_token_ids`. O(B x S)."""
        from . import batch_input as bi
        from .errors import bad

        tokens, start, end = bi.padded_rows(input_ids, attention_mask)
        rows = [tokens[r, start[r]:end[r]] for r in range(tokens.shape[0])]
        if response_length is None:
            return cls.from_token_ids(rows, ids, slots, grads=grads)
        width = tokens.shape[1]
        if not _is_int(response_length) or not 0 < response_length < width:
            raise bad(StepError, "response_length", response_length,
                      f"must be an integer in [1, {width - 1}] (input_ids has {width} columns)")
        split = width - int(response_length)
        prompt = np.clip(split - start, 0, end - start)
        completion = (end - start) - prompt
        keys: list[int | None] = []
        seen: dict[bytes, int] = {}
        for r in range(tokens.shape[0]):
            if prompt[r] == 0 or completion[r] == 0:
                keys.append(None)
                continue
            keys.append(seen.setdefault(rows[r][:prompt[r]].tobytes(), r))
        none = np.array([k is None for k in keys])
        return cls.from_lengths(np.where(none, 0, prompt), np.where(none, end - start, completion),
                                keys, ids, slots=slots, grads=grads)

    def __post_init__(self) -> None:
        requests = tuple(self.requests)
        object.__setattr__(self, "requests", requests)
        if not requests:
            raise StepError("requests=(): a step needs at least one request")
        seen: dict[str, int] = {}
        prompt_len: dict[str, tuple[int, int]] = {}
        for i, req in enumerate(requests):
            if not isinstance(req, Request):
                raise bad(StepError, f"requests[{i}]", req, "must be a Request")
            if req.id in seen:
                raise bad(StepError, f"requests[{i}].id", req.id, f"duplicate id (first at requests[{seen[req.id]}])")
            seen[req.id] = i
            if (req.tokens is None) != (requests[0].tokens is None):
                raise StepError(f"requests[{i}].tokens: a step mixes token-form and length-form requests")
            if req.prompt is not None:
                first = prompt_len.setdefault(req.prompt, (req.num_prompt_tokens, i))
                if first[0] != req.num_prompt_tokens:
                    raise StepError(
                        f"requests[{i}].num_prompt_tokens={req.num_prompt_tokens}: prompt "
                        f"{req.prompt!r} has {first[0]} tokens at requests[{first[1]}]")
        n = len(requests)
        lengths = np.fromiter((r.num_tokens for r in requests), np.int64, n)
        slot_index: dict[str, int] = {}
        slots = np.fromiter((slot_index.setdefault(r.slot, len(slot_index)) for r in requests), np.int64, n)
        grads = np.fromiter((r.grad for r in requests), np.bool_, n)
        token_form = requests[0].tokens is not None
        if token_form:
            order, lcp, group_of, prefix_rows = _token_tree(requests, lengths)
        else:
            order, lcp, group_of, prefix_rows = _length_tree(requests)
        rank = np.empty(n, np.int64)
        rank[order] = np.arange(n)
        values = {
            "lengths": lengths, "group_of": group_of, "prefix_rows": prefix_rows,
            "own_rows": lengths - prefix_rows[group_of], "slots": slots, "grads": grads,
            "rank": rank, "lcp_table": _sparse_min_table(lcp), "length_at": lengths[order],
        }
        for name, array in values.items():
            object.__setattr__(self, name, _readonly(np.ascontiguousarray(array)))
        object.__setattr__(self, "slot_names", tuple(slot_index))
        object.__setattr__(self, "is_token_form", token_form)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def num_groups(self) -> int:
        return int(self.prefix_rows.size)

    @property
    def num_logical_rows(self) -> int:
        return int(self.lengths.sum())

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(r.id for r in self.requests)

    def to_length_form(self) -> list[dict]:
        """JSON-able length-form lines (as `load_step` reads them), for reports.

        Token-form steps use the group abstraction: a group with a prefix becomes the key
        `group-<g>`; a request with no rows after its group's prefix (a duplicate, or one that
        ends at the node) is written without a key. Both lose sharing above a group's node, so
        the lines never share more than the tokens do.
        """
        lines = []
        for i, req in enumerate(self.requests):
            line: dict = {"id": req.id}
            if self.is_token_form:
                g = int(self.group_of[i])
                prefix, own = int(self.prefix_rows[g]), int(self.own_rows[i])
                if prefix > 0 and own > 0:
                    line.update(prompt=f"group-{g}", prompt_tokens=prefix, completion_tokens=own)
                else:
                    line["completion_tokens"] = req.num_tokens
            elif req.prompt is not None:
                line.update(prompt=req.prompt, prompt_tokens=req.num_prompt_tokens,
                            completion_tokens=req.num_completion_tokens)
            else:
                line["completion_tokens"] = req.num_tokens
            lines.append(_with_slot_and_grad(line, req))
        return lines

    def to_tree_form(self) -> list[dict]:
        """JSON-able lines that keep a token-form step's prefix tree exactly, for reports.

        One line per request, in request order: `id`, `num_tokens`, `tree_position` (its place
        in the tree order, the lexicographic order of the tokens) and `shared_tokens` (how many
        leading tokens it shares with the request just before it in that order; 0 for the
        first), plus `slot` and `grad` when not the defaults. The token ids are not kept:
        `step_from_tree_form` rebuilds ids with exactly this tree order and these shared
        prefixes, so every array the search and the layouts read is the same. Meant for
        token-form steps (a length-form step keeps its keys with `to_length_form`). O(n).
        """
        order = np.empty(self.num_requests, np.int64)
        order[self.rank] = np.arange(self.num_requests)
        lcp = self.lcp_table[0, : self.num_requests - 1]
        shared = np.zeros(self.num_requests, np.int64)
        shared[order[1:]] = lcp
        lines = []
        for i, req in enumerate(self.requests):
            line: dict = {"id": req.id, "num_tokens": req.num_tokens,
                          "tree_position": int(self.rank[i]), "shared_tokens": int(shared[i])}
            lines.append(_with_slot_and_grad(line, req))
        return lines


def _with_slot_and_grad(line: dict, req: Request) -> dict:
    """A step line with the request's `slot` and `grad` added where they are not the defaults."""
    if req.slot != DEFAULT_SLOT:
        line["slot"] = req.slot
    if not req.grad:
        line["grad"] = False
    return line


TREE_FIELDS = frozenset({"id", "num_tokens", "tree_position", "shared_tokens", "slot", "grad"})


def step_from_tree_form(lines: object) -> Step:
    """The token-form step that `Step.to_tree_form` lines describe (see there).

    Token ids are synthesised in tree order: a request copies the first `shared_tokens` ids of
    the request before it, then branches with an id one above that request's id at that place
    (or 0 where that request has ended), then pads with 0. This keeps the tree order and the
    shared prefixes, hence the groups, the exact layouts and the plan. Raises StepError naming
    the line and field; lines that describe no prefix tree (e.g. a request sorted after a
    longer one it is a prefix of) are refused. O(total tokens) plus one `Step` build.
    """
    if not isinstance(lines, list) or not lines:
        raise bad(StepError, "requests", lines, "must be a non-empty list")
    n = len(lines)
    lengths = np.zeros(n, np.int64)
    order = np.full(n, -1, np.int64)
    shared = np.zeros(n, np.int64)
    for i, line in enumerate(lines):
        where = f"requests[{i}]"
        if not isinstance(line, dict):
            raise bad(StepError, where, line, "must be an object")
        unknown = sorted(set(line) - TREE_FIELDS)
        missing = sorted({"id", "num_tokens", "tree_position", "shared_tokens"} - set(line))
        if unknown or missing:
            name = (unknown or missing)[0]
            raise bad(StepError, f"{where}.{name}", line.get(name),
                      "unknown field" if unknown else "missing field")
        for name, low in (("num_tokens", 1), ("tree_position", 0), ("shared_tokens", 0)):
            value = line[name]
            if type(value) is not int or value < low:
                raise bad(StepError, f"{where}.{name}", value, f"must be an integer >= {low}")
        position = line["tree_position"]
        if position >= n or order[position] >= 0:
            raise bad(StepError, f"{where}.tree_position", position,
                      f"must be a distinct position in [0, {n})")
        order[position] = i
        lengths[i] = line["num_tokens"]
        shared[i] = line["shared_tokens"]
    tokens: list[np.ndarray] = [np.empty(0, np.int64)] * n
    previous = None
    for i in order.tolist():
        h = int(shared[i])
        limit = 0 if previous is None else min(lengths[i], previous.size)
        if h > limit:
            raise bad(StepError, f"requests[{i}].shared_tokens", h,
                      "must be 0 for tree_position 0" if previous is None else
                      f"exceeds the shorter of this request and the one before it in tree order ({limit})")
        own = np.zeros(lengths[i], np.int64)
        if h:
            own[:h] = previous[:h]
        if h < own.size and previous is not None and h < previous.size:
            own[h] = previous[h] + 1
        tokens[i] = own
        previous = own
    step = Step.from_requests(
        Request(id=line["id"], num_tokens=int(lengths[i]), tokens=tokens[i],
                slot=line.get("slot", DEFAULT_SLOT), grad=line.get("grad", True))
        for i, line in enumerate(lines))
    rebuilt = [(x["tree_position"], x["shared_tokens"]) for x in step.to_tree_form()]
    if rebuilt != [(x["tree_position"], x["shared_tokens"]) for x in lines]:
        raise bad(StepError, "requests", f"<{n} tree-form lines>",
                  "tree_position and shared_tokens describe no prefix tree (a request sorts after "
                  "a longer one it is a prefix of, or equal requests are out of request order)")
    return step


def _token_tree(requests: tuple[Request, ...], lengths: np.ndarray):
    """Sort order, adjacent LCPs and group abstraction of token-form requests."""
    n = len(requests)
    starts = np.zeros(n, np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    flat = np.concatenate([r.tokens for r in requests])
    order, lcp = _sort_tokens(flat, starts, lengths)
    depth_at, node_at = _deepest_nodes(lcp)
    # Position p -> request order[p]; number groups by first appearance in request order.
    depth = np.empty(n, np.int64)
    node = np.empty(n, np.int64)
    depth[order] = depth_at
    node[order] = node_at
    group_of = np.empty(n, np.int64)
    prefix: list[int] = []
    group_of_node: dict[int, int] = {}
    for i in range(n):
        key = int(node[i])
        if key < 0:  # shares nothing: a group of its own
            group_of[i] = len(prefix)
            prefix.append(0)
            continue
        g = group_of_node.get(key)
        if g is None:
            g = group_of_node[key] = len(prefix)
            prefix.append(int(depth[i]))
        group_of[i] = g
    return order, lcp, group_of, np.array(prefix, np.int64)


def _length_tree(requests: tuple[Request, ...]):
    """Tree order and adjacent LCPs implied by prompt keys: members of a key sit together and
    share its prefix; everything else shares nothing. Plus the group abstraction."""
    n = len(requests)
    group_of = np.empty(n, np.int64)
    prefix: list[int] = []
    key_group: dict[str, int] = {}
    for i, req in enumerate(requests):
        if req.prompt is None:
            group_of[i] = len(prefix)
            prefix.append(0)
            continue
        g = key_group.get(req.prompt)
        if g is None:
            g = key_group[req.prompt] = len(prefix)
            prefix.append(req.num_prompt_tokens)
        group_of[i] = g
    prefix_rows = np.array(prefix, np.int64)
    order = np.argsort(group_of, kind="stable")
    g_sorted = group_of[order]
    lcp = np.where(g_sorted[1:] == g_sorted[:-1], prefix_rows[g_sorted[:-1]], 0).astype(np.int64)
    return order, lcp, group_of, prefix_rows


# --- step files ---------------------------------------------------------------------------

_TOKEN_FIELDS = {"id", "tokens", "slot", "grad"}
_LENGTH_FIELDS = {"id", "prompt", "prompt_tokens", "completion_tokens", "slot", "grad"}


def _parse_line(where: str, data: object) -> tuple[Request, str]:
    """One JSON line -> (request, form). Raises StepError naming `where` and the field."""

    def fail(name: str, value: object, why: str) -> StepError:
        return bad(StepError, f"{where}: {name}", value, why)

    if not isinstance(data, dict):
        raise StepError(f"{where}: must be a JSON object, got {type(data).__name__}")
    for name in data:
        if name not in _TOKEN_FIELDS | _LENGTH_FIELDS:
            raise fail(name, data[name], "unknown field (known: "
                       + ", ".join(sorted(_TOKEN_FIELDS | _LENGTH_FIELDS)) + ")")
    if "id" not in data:
        raise StepError(f"{where}: id: missing field")
    rid = data["id"]
    if not isinstance(rid, str) or not rid:
        raise fail("id", rid, "must be a non-empty string")
    slot = data.get("slot", DEFAULT_SLOT)
    if not isinstance(slot, str) or not slot:
        raise fail("slot", slot, "must be a non-empty string")
    grad = data.get("grad", True)
    if not isinstance(grad, bool):
        raise fail("grad", grad, "must be true or false")
    length_fields = sorted(set(data) & (_LENGTH_FIELDS - _TOKEN_FIELDS))
    if "tokens" in data:
        if length_fields:
            raise fail(length_fields[0], data[length_fields[0]],
                       "a line gives either tokens or prompt/prompt_tokens/completion_tokens, not both")
        tokens = data["tokens"]
        if not isinstance(tokens, list) or not tokens:
            raise fail("tokens", tokens if not isinstance(tokens, list) else [],
                       "must be a non-empty list of token ids")
        for k, t in enumerate(tokens):  # strict: JSON true/false or floats are not token ids
            if type(t) is not int or not 0 <= t < 2**63:
                raise fail(f"tokens[{k}]", t, "must be an integer token id in [0, 2**63)")
        array = np.array(tokens, dtype=np.int64)
        return Request(id=rid, num_tokens=array.size, tokens=array, slot=slot, grad=grad), "token"
    if "completion_tokens" not in data:
        raise StepError(f"{where}: completion_tokens: missing field (or give tokens)")
    completion = data["completion_tokens"]
    if type(completion) is not int or completion < 0:
        raise fail("completion_tokens", completion, "must be a non-negative integer")
    if ("prompt" in data) != ("prompt_tokens" in data):
        missing = "prompt_tokens" if "prompt" in data else "prompt"
        raise StepError(f"{where}: {missing}: missing field (prompt and prompt_tokens go together)")
    if "prompt" not in data:
        if completion == 0:
            raise fail("completion_tokens", completion,
                       "must be positive without a prompt (0 is allowed with one: the request is its prompt)")
        return Request(id=rid, num_tokens=completion, slot=slot, grad=grad), "length"
    prompt, num_prompt = data["prompt"], data["prompt_tokens"]
    if not isinstance(prompt, str) or not prompt:
        raise fail("prompt", prompt, "must be a non-empty string")
    if type(num_prompt) is not int or num_prompt <= 0:
        raise fail("prompt_tokens", num_prompt, "must be a positive integer")
    if completion == 0:
        # An empty completion (an aborted rollout): the request is its prompt alone. It is
        # priced as an unshared request of prompt_tokens rows (it shares none of its group's
        # prefix rows: conservative).
        return Request(id=rid, num_tokens=num_prompt, slot=slot, grad=grad), "length"
    return Request(id=rid, num_tokens=num_prompt + completion, prompt=prompt,
                   num_prompt_tokens=num_prompt, slot=slot, grad=grad), "length"


def load_step(path: str | Path) -> Step:
    """Read a step file: JSON Lines, one request per line, blank lines ignored.

    Token form: `{"id": "g3-c5", "tokens": [int, ...]}`. Length form:
    `{"id": "g3-c5", "prompt": "g3", "prompt_tokens": 2048, "completion_tokens": 517}`, or
    `{"id": "r7", "completion_tokens": 900}` for a request that shares nothing. Optional
    `"slot"` (default "default") and `"grad"` (default true). One file holds one form.

    `path` may also name a bundled step (`"grpo-8x8"`, see `list_bundled_steps`); an existing
    file of that name wins. Every error is a `StepError` naming the file, the line number and
    the field. O(file size).
    """
    path = Path(path)
    if not path.is_file():
        if path.name.removesuffix(".jsonl") in list_bundled_steps() and len(path.parts) == 1:
            path = bundled_step(path.name)
        elif not path.exists():
            raise StepError(f"{path}: cannot read step file: no such file or bundled step "
                            f"(bundled: {', '.join(list_bundled_steps())})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise StepError(f"{path}: cannot read step file: {exc}") from None
    return parse_step(text, source=str(path))


def parse_step(text: str, *, source: str = "<step>") -> Step:
    """`load_step` of a step file's text; errors name `source` (e.g. "<stdin>"), the line
    number and the field. O(len(text))."""
    path = source
    requests: list[Request] = []
    id_line: dict[str, int] = {}
    prompt_line: dict[str, tuple[int, int]] = {}
    form_line: tuple[str, int] | None = None
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise StepError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from None
        req, form = _parse_line(where, data)
        if form_line is None:
            form_line = (form, lineno)
        elif form != form_line[0]:
            name = "tokens" if form == "token" else "completion_tokens"
            raise StepError(f"{where}: {name}: {form} form, but line {form_line[1]} is "
                            f"{form_line[0]} form (one file holds one form)")
        if req.id in id_line:
            raise bad(StepError, f"{where}: id", req.id, f"duplicate id (first on line {id_line[req.id]})")
        id_line[req.id] = lineno
        if req.prompt is not None:
            first = prompt_line.setdefault(req.prompt, (req.num_prompt_tokens, lineno))
            if first[0] != req.num_prompt_tokens:
                raise StepError(f"{where}: prompt_tokens={req.num_prompt_tokens}: prompt "
                                f"{req.prompt!r} has {first[0]} tokens on line {first[1]}")
        requests.append(req)
    if not requests:
        raise StepError(f"{path}: no requests (a step file needs at least one line)")
    return Step.from_requests(requests)


# --- bundled examples ---------------------------------------------------------------------


def _steps_dir():
    return resources.files("waveplan.pricing") / "data" / "steps"


def list_bundled_steps() -> list[str]:
    """Names of the bundled example steps (without `.jsonl`), sorted."""
    return sorted(p.name[: -len(".jsonl")] for p in _steps_dir().iterdir() if p.name.endswith(".jsonl"))


def bundled_step(name: str) -> Path:
    """Path of a bundled example step, e.g. `bundled_step("grpo-8x8")`."""
    stem = name[: -len(".jsonl")] if name.endswith(".jsonl") else name
    entry = _steps_dir() / f"{stem}.jsonl"
    if not entry.is_file():
        raise bad(StepError, "step", name, "no bundled step of that name "
                  f"(bundled: {', '.join(list_bundled_steps())})")
    return Path(str(entry))


def materialize_tokens(step: Step, *, vocab_size: int = 151_936, seed: int = 0) -> Step:
    """A token-form step with exactly the sharing that a length-form `step` states.

    Each prefix group (prompt key, or a request without one) starts with its own first token;
    the completions of one key share its prefix and differ at their first token; every other
    token is drawn uniformly (seeded, deterministic). Slots, grads and ids are kept. A
    token-form step is returned unchanged. O(total tokens).
    """
    if step.is_token_form:
        return step
    max_members = int(np.bincount(step.group_of).max())
    if isinstance(vocab_size, bool) or not _is_int(vocab_size) or vocab_size < max(step.num_groups, max_members):
        raise bad(StepError, "vocab_size", vocab_size, "must be an integer >= the number of groups "
                  f"({step.num_groups}) and of requests in a group ({max_members})")
    rng = np.random.default_rng(seed)
    first = rng.choice(vocab_size, size=step.num_groups, replace=False)
    prefixes = [np.concatenate(([first[g]], rng.integers(0, vocab_size, max(int(p) - 1, 0))))
                for g, p in enumerate(step.prefix_rows)]
    requests = []
    members_seen = np.zeros(step.num_groups, np.int64)
    branch = [rng.choice(vocab_size, size=int(c), replace=False) for c in np.bincount(step.group_of)]
    for i, req in enumerate(step.requests):
        g = int(step.group_of[i])
        own = int(step.own_rows[i])
        if step.prefix_rows[g] == 0:
            tokens = np.concatenate(([first[g]], rng.integers(0, vocab_size, own - 1)))
        else:
            head = branch[g][members_seen[g]]
            tokens = np.concatenate((prefixes[g], [head], rng.integers(0, vocab_size, own - 1)))
        members_seen[g] += 1
        requests.append(Request(id=req.id, num_tokens=req.num_tokens, tokens=tokens.astype(np.int64),
                                slot=req.slot, grad=req.grad))
    return Step.from_requests(requests)
