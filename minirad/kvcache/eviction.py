"""Eviction policies for the radix cache: which unlocked leaf goes first.

A policy maps a node to a sort key; ``RadixCache.evict`` pops the smallest key first. Every key
ends with the node's ``id`` so that ties break the same way on every run (SGLang compares
``time.monotonic()`` stamps and leaves ties to the heap; see
``sglang/srt/mem_cache/evict_policy.py``, whose definitions the policies below follow).

- ``lru``: least recently used first (``last_access_time``), the paper's policy (§3.1).
- ``lfu``: least frequently hit first (``hit_count``), then least recently used.
- ``fifo``: oldest insertion first (``creation_time``), blind to reuse.
- ``slru``: segmented LRU: nodes cached by fewer than ``protected_threshold`` requests first,
  LRU within each segment: a reused prefix outlives one-off tails, and unlike lfu a prefix
  popular long ago does not outlive one reused lately.
- ``tlru``: tail-optimized LRU: first the tokens a conversation's next turn can lose without
  prefilling more than ``threshold`` tokens, then LRU: to bound the time to first token.
- ``priority``: lowest request ``priority`` first (a node keeps the highest of the requests
  that cached it), then LRU: for requests or tenants that matter more than others.

``slru``, ``tlru`` and ``priority`` read node state that the tree keeps as SGLang does
(``insert_count``, ``depth`` and ``history_len``, ``priority``; see
:class:`~minirad.kvcache.radix_cache.TreeNode`). Parameters go by keyword to
:func:`get_policy` (``get_policy("tlru", threshold=64, next_prompt_estimate=8)``, the keys of
SGLang's ``--radix-eviction-policy-config``) or to the classes.

:class:`ClosedSessionLRUPolicy` (``lru-closed``) is reuse-aware: LRU, except that the tokens of
conversations known to be over go first. It needs one fact from the caller, when a session
closes (the client's last turn, or SGLang's ``close_session``), so it is not in
:data:`EVICTION_POLICIES`; ``python -m minirad.bench radix`` runs it.

:data:`EVICTION_POLICIES` is the one registry of the policies a name selects (SGLang's
``--radix-eviction-policy``): :func:`get_policy`, the ``minirad`` command's choices and the
docs' list come from it. To add a policy, write a class with a ``name`` and a ``priority`` and
add it there.
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections.abc import Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Protocol

from minirad.errors import InvalidArgumentError
from minirad.kvcache.tokens import as_token_ids

if TYPE_CHECKING:
    from minirad.kvcache.radix_cache import TreeNode

__all__ = [
    "EVICTION_POLICIES",
    "ClosedSessionLRUPolicy",
    "EvictionPolicy",
    "FIFOPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "PriorityPolicy",
    "SLRUPolicy",
    "TLRUPolicy",
    "get_policy",
]


class EvictionPolicy(Protocol):
    name: str

    def priority(self, node: TreeNode) -> tuple[int, ...]:
        """Sort key of an evictable leaf: the smallest is evicted first (ties: lowest id)."""
        ...


# attrgetter builds each key tuple in C: eviction ranks every evictable leaf on each call.
class LRUPolicy:
    name = "lru"
    priority = staticmethod(attrgetter("last_access_time", "id"))


class LFUPolicy:
    name = "lfu"
    priority = staticmethod(attrgetter("hit_count", "last_access_time", "id"))


class FIFOPolicy:
    name = "fifo"
    priority = staticmethod(attrgetter("creation_time", "id"))


class PriorityPolicy:
    """Lowest ``priority`` first, then least recently used (SGLang's ``priority``).

    A node's ``priority`` is the highest ``priority`` of the requests whose inserts walked or
    created it (``Req.priority``, ``RadixCache.insert(..., priority=)``; 0 by default), so a
    prefix shared with an important request is as safe as that request. Matches leave it
    alone. With every request at priority 0 (SGLang without ``--enable-priority-scheduling``)
    this is LRU.
    """

    name = "priority"
    priority = staticmethod(attrgetter("priority", "last_access_time", "id"))


def _check_int(value: Any, name: str, minimum: int) -> None:
    if type(value) is bool or not isinstance(value, numbers.Integral) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_tokens(value: Any, name: str) -> None:
    """A token count as SGLang takes it: an int or a float (an average), finite, >= 0."""
    if (
        type(value) is bool
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
    ):
        raise InvalidArgumentError(f"{name} must be a number of tokens >= 0, got {value!r}")


class SLRUPolicy:
    """Segmented LRU (SGLang's ``slru``): probationary nodes first, then protected ones, each
    segment least recently used first.

    A node is protected once ``insert_count >= protected_threshold``. ``insert_count`` is
    SGLang's ``hit_count``: the requests that cached a sequence through the node, the one that
    created it included. So with the default 2 a prefix that a second request reused is
    protected, and a tail that only its own request cached is not. Unlike LFU, a count decides
    only the segment: an idle prefix with many old hits and one with just enough are ordered by
    recency.

    Args:
        protected_threshold: an int >= 1 (SGLang's default 2). 1 protects every node (each was
            cached once), which is LRU.

    Raises:
        InvalidArgumentError: ``protected_threshold`` is not an int >= 1.
    """

    name = "slru"

    def __init__(self, protected_threshold: int = 2) -> None:
        _check_int(protected_threshold, "slru protected_threshold", 1)
        self.protected_threshold = protected_threshold

    def priority(self, node: TreeNode) -> tuple[int, ...]:
        protected = 1 if node.insert_count >= self.protected_threshold else 0
        return (protected, node.last_access_time, node.id)

    def __repr__(self) -> str:
        return f"SLRUPolicy(protected_threshold={self.protected_threshold})"


class TLRUPolicy:
    """Tail-optimized LRU (SGLang's ``tlru``; Zhang et al., arXiv:2510.15152).

    A conversation whose history has reached ``L`` tokens, and whose next prompt is expected
    to add ``next_prompt_estimate`` more, prefills at most ``threshold`` tokens on its next
    turn as long as ``L + next_prompt_estimate - threshold`` of its tokens stay cached (its
    time to first token stays within budget). Tokens past that budget cannot shorten its
    worst-case prefill: a leaf whose parent alone still holds the budget (``depth - len(key)``
    tokens above it) is *safe*. Safe leaves go first, then every other leaf, each least
    recently used first: the paper's two phases as one sort key.

    ``L`` is the node's ``history_len``, the deepest its branch has ever been; evicting the
    tail does not lower it, so trimming a conversation stops after ``threshold -
    next_prompt_estimate`` tokens instead of walking it down to nothing.

    Args:
        threshold: the prefill budget of a turn, in tokens (the paper states it in blocks:
            multiply by the page size). An int or a float, >= 0.
        next_prompt_estimate: the tokens a next prompt is expected to add (>= 0, below
            ``threshold``).

    The defaults (64 and 8) suit this course's small pools. SGLang has none that it accepts:
    its server refuses ``tlru`` unless ``--radix-eviction-policy-config`` gives a
    ``threshold`` above ``next_prompt_estimate``, because otherwise no token is ever safe and
    the policy is LRU; the same check runs here.

    Raises:
        InvalidArgumentError: a parameter is not a finite number >= 0, or ``threshold <=
            next_prompt_estimate``.
    """

    name = "tlru"

    def __init__(self, threshold: float = 64, next_prompt_estimate: float = 8) -> None:
        _check_tokens(threshold, "tlru threshold")
        _check_tokens(next_prompt_estimate, "tlru next_prompt_estimate")
        if threshold <= next_prompt_estimate:
            raise InvalidArgumentError(
                f"tlru threshold ({threshold}) must be greater than next_prompt_estimate "
                f"({next_prompt_estimate}): otherwise no token is ever safe to evict and "
                "tlru is lru"
            )
        self.threshold = threshold
        self.next_prompt_estimate = next_prompt_estimate

    def budget(self, node: TreeNode) -> float:
        """Tokens of ``node``'s branch that must stay cached for its next turn to prefill at
        most ``threshold`` tokens (0 when the whole branch may go)."""
        return max(node.history_len + self.next_prompt_estimate - self.threshold, 0)

    def priority(self, node: TreeNode) -> tuple[int, ...]:
        safe = node.depth - len(node.key) >= self.budget(node)
        return (0 if safe else 1, node.last_access_time, node.id)

    def __repr__(self) -> str:
        return (
            f"TLRUPolicy(threshold={self.threshold}, "
            f"next_prompt_estimate={self.next_prompt_estimate})"
        )


class ClosedSessionLRUPolicy:
    """LRU among the leaves of open sessions, after every leaf of a closed session.

    A session's tokens are reused only by its next turn; once the client has closed it (its
    last request finished), they are dead weight, and LRU would keep them as long as any
    other idle conversation. This policy uses only what a server knows online: which slots
    belong to closed sessions, as the caller reports with :meth:`close`.

    The mark is read from a leaf's last slot, which holds the leaf's newest token. The caller
    marks a closing session's own slots (not a shared prefix such as its system prompt) before
    :meth:`RadixCache.cache_finished_req` makes them evictable, and clears slots that the
    allocator hands out again with :meth:`reopen`. (A mark that changes while its leaf is
    already evictable takes effect when eviction next reaches the leaf's old place.)

    Raises:
        InvalidKeyError: from :meth:`close` / :meth:`reopen`, slots that are not ints >= 0.
    """

    name = "lru-closed"

    def __init__(self) -> None:
        self.closed: set[int] = set()  # a set, not a mask: slot ids of any size, C-speed updates

    def close(self, slots: Sequence[int]) -> None:
        """Mark ``slots`` as tokens of a closed session."""
        self.closed.update(as_token_ids(slots, "slots"))

    def reopen(self, slots: Sequence[int]) -> None:
        """Clear the mark of freshly allocated ``slots``."""
        self.closed.difference_update(as_token_ids(slots, "slots"))

    def priority(self, node: TreeNode) -> tuple[int, ...]:
        return (0 if node.value[-1] in self.closed else 1, node.last_access_time, node.id)


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls
    for cls in (LRUPolicy, LFUPolicy, FIFOPolicy, SLRUPolicy, TLRUPolicy, PriorityPolicy)
}


def __getattr__(name: str) -> Any:
    """``POLICIES``: :data:`EVICTION_POLICIES`' old name, deprecated (the scheduler's
    registry had the same name)."""
    if name == "POLICIES":
        warnings.warn(
            "minirad.kvcache.eviction.POLICIES is deprecated: use EVICTION_POLICIES",
            DeprecationWarning,
            stacklevel=2,
        )
        return EVICTION_POLICIES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_policy(policy: str | EvictionPolicy, **params: Any) -> EvictionPolicy:
    """A policy instance from its name (a key of :data:`EVICTION_POLICIES`) and parameters, or
    as given.

    ``params`` are the policy's keyword arguments, named as in SGLang's
    ``--radix-eviction-policy-config``: ``get_policy("slru", protected_threshold=3)``,
    ``get_policy("tlru", threshold=64, next_prompt_estimate=8)``.

    Raises:
        InvalidArgumentError: an unknown name, a parameter the policy does not take (or any
            parameter with a policy object), or a bad parameter value.
    """
    if not isinstance(policy, str):
        if not callable(getattr(policy, "priority", None)):
            raise InvalidArgumentError(f"{policy!r} is not an eviction policy (no priority())")
        if params:
            raise InvalidArgumentError(
                f"parameters {sorted(params)} go with a policy name, not with a policy object"
            )
        return policy
    try:
        cls = EVICTION_POLICIES[policy]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown eviction policy {policy!r}; choose one of {sorted(EVICTION_POLICIES)}"
        ) from None
    takes = list(inspect.signature(cls).parameters)
    unknown = sorted(set(params) - set(takes))
    if unknown:
        raise InvalidArgumentError(
            f"eviction policy {policy!r} takes no parameter {', '.join(map(repr, unknown))}; "
            f"it takes {takes or 'none'}"
        )
    return cls(**params)
