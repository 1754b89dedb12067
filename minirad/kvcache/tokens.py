"""Validation of token-id sequences, shared by the radix tree and the block cache.

Cache keys must be integers >= 0: a negative id can never be a real token, and a float or a
string is a caller's bug. Tensors and arrays become lists; block hashing asks for plain Python
ints, since a numpy scalar pickles (and so hashes) differently from the int it equals.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from minirad.errors import InvalidKeyError

__all__ = ["as_token_ids", "checked_token_ids", "u64_array"]

_ALL_GOOD = object()  # no bad id found (None cannot say it: None is a bad id)


def u64_array(ids: list[int]) -> array:
    """``array("Q", ids)`` for a list: ``fromlist`` fills it with fewer calls per item than
    the constructor does. The same errors (TypeError, OverflowError) for the same bad ids."""
    buf = array("Q")
    buf.fromlist(ids)
    return buf


def checked_token_ids(
    ids: Sequence[int], name: str = "key", plain: bool = False
) -> tuple[list[int], array | None]:
    """``ids`` as a list of ints >= 0, and the same ids as an ``array("Q")`` (None when one
    needs 64 bits or more, as the multimodal pad ids do). Lists, tuples, numpy arrays and
    torch tensors are accepted.

    A list is checked and returned as is (no copy: the caches only ever store slices of it),
    unless ``plain`` asks for a new list of Python ints, as hashing needs (a numpy scalar
    pickles differently from the int it equals). The array is what the check builds anyway;
    the radix tree compares edges with it (one C ``memcmp`` instead of a Python list compare).

    Raises:
        InvalidKeyError: ``ids`` is not a sequence of integers >= 0.
    """
    if type(ids) is not list:  # a list, the common case, goes straight to the check
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        elif isinstance(ids, bytes | bytearray):  # one token per byte, not 8-byte words
            ids = list(ids)
    try:
        # An unsigned C array type-checks every element at C speed: floats, strings and None
        # raise TypeError, negative ids OverflowError; tolist() gives back plain ints.
        checked = u64_array(ids) if type(ids) is list else array("Q", ids)
    except (TypeError, OverflowError):
        try:
            bad = next((t for t in ids if not isinstance(t, int) or t < 0), _ALL_GOOD)
        except TypeError:  # not iterable at all
            bad = ids
        if bad is _ALL_GOOD:  # ints >= 0, some of 64 bits or more: pad ids (multimodal.pad_value)
            return (ids if type(ids) is list and not plain else [int(t) for t in ids]), None
        raise InvalidKeyError(f"{name} must be a sequence of ints >= 0, got {bad!r}") from None
    return (ids if type(ids) is list and not plain else checked.tolist()), checked


def as_token_ids(ids: Sequence[int], name: str = "key", plain: bool = False) -> list[int]:
    """The list of :func:`checked_token_ids`.

    Raises:
        InvalidKeyError: ``ids`` is not a sequence of integers >= 0.
    """
    return checked_token_ids(ids, name, plain)[0]
