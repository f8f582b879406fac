"""The user's batch as validated numpy arrays, for `Step.from_token_ids`, `Step.from_lengths`
and `Step.from_padded`.

A trainer holds its step as Python lists, numpy arrays or torch tensors (on any device). They
are read duck-typed, without importing torch: anything with `.detach()` and `.cpu()` is
copied to the host and read through `.numpy()`; everything else goes through
`numpy.asarray`. Every error is a `StepError` naming the field (with its index) and the value.
"""

from __future__ import annotations

import numpy as np

from .errors import StepError, bad


def _host(value: object) -> object:
    """A torch tensor (duck-typed) as a host numpy array; anything else unchanged."""
    if hasattr(value, "detach") and hasattr(value, "cpu") and hasattr(value, "numpy"):
        if getattr(value, "is_nested", False):
            raise bad(StepError, "tensor", "<nested tensor>",
                      "a nested tensor is not a padded batch (give its rows as a list)")
        return value.detach().cpu().numpy()
    return value


def _describe(array: np.ndarray) -> str:
    return f"<{array.dtype} array of shape {array.shape}>"


def int_array(field: str, value: object, *, ndim: int, allow_bool: bool = False) -> np.ndarray:
    """`value` as an int64 array of `ndim` dimensions (integer dtypes only; booleans when
    `allow_bool`). O(size)."""
    if isinstance(value, str | bytes) or value is None:
        raise bad(StepError, field, value, f"must be a {ndim}-D sequence of integers")
    try:
        array = np.asarray(_host(value))
    except (TypeError, ValueError) as exc:  # ragged nested lists
        raise bad(StepError, field, type(value).__name__, f"cannot be read as a {ndim}-D array ({exc})") from None
    kinds = "iub" if allow_bool else "iu"
    if array.ndim != ndim or (array.size and array.dtype.kind not in kinds):
        raise bad(StepError, field, _describe(array), f"must be a {ndim}-D sequence of integers")
    if array.dtype.kind == "u" and array.size and array.max() > np.iinfo(np.int64).max:
        raise bad(StepError, field, int(array.max()), "exceeds int64")
    return array.astype(np.int64, copy=False)


def token_rows(sequences: object) -> list[np.ndarray]:
    """Each sequence as a non-empty 1-D int64 array of token ids >= 0. O(total tokens)."""
    if isinstance(sequences, str | bytes | dict) or not hasattr(sequences, "__iter__"):
        raise bad(StepError, "sequences", type(sequences).__name__,
                  "must be a sequence of token-id sequences (lists, arrays or 1-D tensors)")
    rows = []
    for i, seq in enumerate(sequences):
        row = int_array(f"sequences[{i}]", seq, ndim=1)
        if row.size == 0:
            raise bad(StepError, f"sequences[{i}]", [], "must hold at least one token id")
        if row.min() < 0:
            raise bad(StepError, f"sequences[{i}]", int(row.min()), "token ids must be >= 0")
        rows.append(row)
    if not rows:
        raise bad(StepError, "sequences", [], "a step needs at least one sequence")
    return rows


def per_request(field: str, value: object, n: int, default: object, kind: type) -> list:
    """A per-request list of `n` values of type `kind`: `default` for None, one value for all,
    or a sequence of `n` values (lists, arrays or tensors). O(n)."""
    if value is None:
        return [default] * n
    if kind is bool and isinstance(value, bool | np.bool_):
        return [bool(value)] * n
    if kind is str and isinstance(value, str):
        if not value:
            raise bad(StepError, field, value, "must be a non-empty string")
        return [value] * n
    host = _host(value)
    items = host.tolist() if isinstance(host, np.ndarray) else host
    if isinstance(items, str | bytes) or not hasattr(items, "__len__"):
        raise bad(StepError, field, value, f"must be a {kind.__name__} or a sequence of {n}")
    items = list(items)
    if len(items) != n:
        raise bad(StepError, field, f"<{len(items)} values>", f"needs one value per request ({n})")
    for i, item in enumerate(items):
        if kind is bool:
            ok = isinstance(item, bool | np.bool_)
        else:
            ok = isinstance(item, kind) and bool(item)
        if not ok:
            raise bad(StepError, f"{field}[{i}]", item,
                      "must be true or false" if kind is bool else f"must be a non-empty {kind.__name__}")
    return [kind(item) for item in items]


def request_ids(ids: object, n: int) -> list[str]:
    """`ids` (a sequence of `n` non-empty strings), or the positions "0" .. "n-1". O(n)."""
    if ids is None:
        return [str(i) for i in range(n)]
    if isinstance(ids, str):
        raise bad(StepError, "ids", ids, f"must be a sequence of {n} strings, not one string")
    return per_request("ids", ids, n, None, str)


def lengths(field: str, value: object, n: int | None, *, minimum: int) -> np.ndarray:
    """A 1-D int64 array of lengths >= `minimum` (of `n` entries unless None). O(n)."""
    array = int_array(field, value, ndim=1)
    if n is not None and array.size != n:
        raise bad(StepError, field, f"<{array.size} values>", f"needs one value per request ({n})")
    if array.size == 0:
        raise bad(StepError, field, [], "a step needs at least one request")
    low = np.flatnonzero(array < minimum)
    if low.size:
        i = int(low[0])
        raise bad(StepError, f"{field}[{i}]", int(array[i]), f"must be an integer >= {minimum}")
    return array


def group_keys(groups: object, n: int) -> list[str | None]:
    """Each request's prefix-group key as a string (None: shares nothing). Keys are any
    hashable values (strings, ints, numpy or tensor elements); two different keys that print
    the same are an error. O(n)."""
    if groups is None:
        return [None] * n
    host = _host(groups)
    items = host.tolist() if isinstance(host, np.ndarray) else host
    if isinstance(items, str | bytes) or not hasattr(items, "__len__"):
        raise bad(StepError, "groups", groups, f"must be a sequence of {n} group keys (or None)")
    items = list(items)
    if len(items) != n:
        raise bad(StepError, "groups", f"<{len(items)} values>", f"needs one key per request ({n})")
    names: list[str | None] = []
    owner: dict[str, tuple[object, int]] = {}
    for i, key in enumerate(items):
        if key is None:
            names.append(None)
            continue
        try:
            hash(key)
        except TypeError:
            raise bad(StepError, f"groups[{i}]", key, "must be a hashable key (or None)") from None
        if isinstance(key, bool | np.bool_) or (isinstance(key, str) and not key):
            raise bad(StepError, f"groups[{i}]", key, "must be a non-empty string, an integer or None")
        name = str(key)
        first = owner.setdefault(name, (key, i))
        if first[0] != key or type(first[0]) is not type(key):
            raise bad(StepError, f"groups[{i}]", key,
                      f"prints as {name!r} like the different key groups[{first[1]}]={first[0]!r}")
        names.append(name)
    return names


def padded_rows(input_ids: object, attention_mask: object) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A padded 2-D batch: the token ids, and each row's first and end column of its one
    contiguous run of attended tokens (right-, left- or both-side padded). O(B x S)."""
    ids = int_array("input_ids", input_ids, ndim=2)
    mask = int_array("attention_mask", attention_mask, ndim=2, allow_bool=True)
    if ids.shape != mask.shape:
        raise bad(StepError, "attention_mask", _describe(mask),
                  f"must have the shape of input_ids {tuple(ids.shape)}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise bad(StepError, "input_ids", _describe(ids), "a step needs at least one row and one column")
    off = np.argwhere((mask != 0) & (mask != 1))
    if off.size:
        r, c = (int(x) for x in off[0])
        raise bad(StepError, f"attention_mask[{r}, {c}]", int(mask[r, c]), "must be 0 or 1")
    ones = mask.astype(bool)
    count = ones.sum(axis=1)
    empty = np.flatnonzero(count == 0)
    if empty.size:
        raise bad(StepError, f"attention_mask[{int(empty[0])}]", "<all 0>", "a row needs at least one token")
    start = ones.argmax(axis=1)
    end = start + count
    columns = np.arange(ids.shape[1])
    inside = (columns >= start[:, None]) & (columns < end[:, None])
    holes = np.flatnonzero((inside != ones).any(axis=1))
    if holes.size:
        r = int(holes[0])
        raise bad(StepError, f"attention_mask[{r}]", mask[r].tolist() if mask.shape[1] <= 16 else "<row>",
                  "must be one contiguous run of 1s (a right- or left-padded row)")
    valid = ids[ones]
    if valid.size and valid.min() < 0:
        r, c = (int(x) for x in np.argwhere(ones & (ids < 0))[0])
        raise bad(StepError, f"input_ids[{r}, {c}]", int(ids[r, c]), "token ids must be >= 0")
    return ids, start.astype(np.int64), end.astype(np.int64)
