"""The sliding-window rules of SGLang 0.5.23's SWA component, as pure functions.

Two rules decide what a hybrid (full attention + sliding window) radix tree may share:

- **the match validator** (``SWAComponent.create_match_validator``): walking root to leaf, a
  node is a valid end of a prefix hit only if the tokens just before that end hold one window
  of live sliding-window KV. The running length starts at infinity (a prefix that starts at the
  root needs no window: nothing before it was dropped), resets to 0 at a *tombstone* (a node
  whose SWA KV was freed) and grows by each live node's tokens;
- **the window lock** (``SWAComponent.acquire_component_lock``): a running request locks its
  node's SWA KV and its ancestors' only until their tokens cover the window, whole nodes, the
  one that fills it included; the rest of its path may lose its SWA KV (become tombstones)
  while the request runs.

The window, off by one. Hugging Face's ``sliding_window=W`` counts W keys, the query's own
included; SGLang stores ``sliding_window_size = W - 1`` (the keys *before* the query: the mask
is ``k >= q - (W - 1)``), and so does everything here. A query at position ``q`` reads keys
``q - sliding_window_size .. q``.

These functions are the one place the window-lock rule lives: the hybrid cache
(:mod:`minirad.kvcache.swa_radix_cache`) and the drawing (``viz.charts.unified_locks``) call it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from minirad.errors import InvalidArgumentError

__all__ = [
    "check_window",
    "hf_to_sglang_window",
    "make_swa_validator",
    "window_lock_count",
    "window_lock_mask",
]


def check_window(sliding_window_size: int) -> int:
    """Return ``sliding_window_size`` if it is an int >= 1, else raise InvalidArgumentError."""
    w = sliding_window_size
    if type(w) is bool or not isinstance(w, int) or w < 1:
        raise InvalidArgumentError(f"sliding_window_size must be an int >= 1, got {w!r}")
    return w


def hf_to_sglang_window(hf_sliding_window: int) -> int:
    """SGLang's ``sliding_window_size`` for Hugging Face's ``sliding_window`` (``W - 1``)."""
    return check_window(hf_sliding_window - 1 if isinstance(hf_sliding_window, int) else 0)


def window_lock_count(lengths_upward: Iterable[int], window: int) -> int:
    """How many nodes the window lock takes, walking up from the request's node.

    Args:
        lengths_upward: each node's token count, the request's node first, then its parent...
            (the root excluded); read lazily, so a cache may pass a walk up its tree.
        window: ``sliding_window_size``.

    The walk stops once the nodes taken hold ``window`` tokens (whole nodes), or at the root.
    """
    covered = taken = 0
    for n in lengths_upward:
        if covered >= window:
            break
        covered += n
        taken += 1
    return taken


def window_lock_mask(lengths: list[int], window: int) -> list[bool]:
    """Which nodes of a root-first path (``lengths``: tokens per node) a request that matched
    the whole path window-locks (:func:`window_lock_count` from the last node up)."""
    taken = window_lock_count(reversed(lengths), window)
    return [i >= len(lengths) - taken for i in range(len(lengths))]


def make_swa_validator(window: int) -> Callable[[int, bool], bool]:
    """A fresh match validator for one root-to-leaf walk.

    Call it on each walked node in order, with the node's token count and whether its SWA KV is
    live; it answers whether a hit may end at that node (see the module docstring).
    """
    running = math.inf

    def validator(n_tokens: int, swa_live: bool) -> bool:
        nonlocal running
        if not swa_live:  # a tombstone: the window must be rebuilt after it
            running = 0
            return False
        running += n_tokens
        return running >= window

    return validator
