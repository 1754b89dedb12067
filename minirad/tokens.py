"""Validation of token-id sequences, shared by the radix tree and the block cache.

Cache keys must be plain Python ints >= 0: numpy or torch scalars would hash, print and
serialise differently from ints (a block hash would change from call to call, a JSON event log
would fail to write), and a negative id can never be a real token.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from .errors import InvalidKeyError

__all__ = ["as_token_ids"]


def as_token_ids(ids: Sequence[int], name: str = "key") -> list[int]:
    """``ids`` as a new list of Python ints >= 0 (lists, tuples, numpy arrays and torch
    tensors are accepted).

    Raises:
        InvalidKeyError: ``ids`` is not a sequence of integers >= 0 (and < 2**64).
    """
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    try:
        # An unsigned C array type-checks every element at C speed: floats, strings and None
        # raise TypeError, negative ids OverflowError; tolist() gives back plain ints.
        return array("Q", ids).tolist()
    except (TypeError, OverflowError):
        pass
    try:
        bad = next((t for t in ids if not isinstance(t, int) or t < 0), ids)
    except TypeError:  # not iterable at all
        bad = ids
    raise InvalidKeyError(f"{name} must be a sequence of ints >= 0, got {bad!r}") from None
