"""Scheduling policies: the order in which waiting requests are admitted.

SGLang's ``--schedule-policy`` (``sglang/srt/managers/schedule_policy.py``), for the policies
we implement, under SGLang's names:

- ``fcfs``: first come, first served: arrival order (SGLang's default).
- ``lpm``: longest prefix match first: the waiting requests with the most prompt tokens cached
  in the radix tree go first (ties keep arrival order), so a cached prefix is used before it is
  evicted. Matching every waiting prompt costs a tree walk each, so above
  :data:`LPM_MAX_QUEUE` waiting requests lpm is fcfs (SGLang does the same at 128).

:data:`SCHEDULE_POLICIES` is the one registry: the scheduler's config check, the ``minirad``
command's ``--schedule-policy`` choices and the docs' list come from it. To add a policy, write
a class with a ``name`` and an :meth:`~SchedulePolicy.order` and add it there.

This module imports no torch, so that a command line can offer the choices before the engine
loads. It also holds :data:`PREFIX_STRATEGIES`, the scheduler's other choice (which part of a
prompt may come from the cache), for the same reason.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from minirad.engine.request import Request

__all__ = [
    "LPM_MAX_QUEUE",
    "PREFIX_STRATEGIES",
    "SCHEDULE_POLICIES",
    "FCFSPolicy",
    "LPMPolicy",
    "SchedulePolicy",
]

# How much of a prompt may come from the cache: "radix" (the whole key), "truncate" (the text
# before the first image), "none" (nothing). :mod:`minirad.engine.scheduler` says more.
PREFIX_STRATEGIES = ("radix", "truncate", "none")
# Above this many waiting requests, lpm falls back to fcfs: matching every waiting prompt
# each step would cost more than it saves (SGLang's schedule_policy does the same at 128).
LPM_MAX_QUEUE = 128


class SchedulePolicy(Protocol):
    """The order of the waiting queue, computed once per admission round."""

    name: str

    def order(
        self, waiting: deque[Request], cached_len: Callable[[Request], int]
    ) -> deque[Request]:
        """The waiting requests in the order to admit them (``waiting`` itself if unchanged).

        ``cached_len(request)`` is how many of its prompt tokens the radix tree holds now (a
        tree walk: call it only if the order needs it).
        """
        ...


class FCFSPolicy:
    """First come, first served: arrival order."""

    name = "fcfs"

    def order(
        self, waiting: deque[Request], cached_len: Callable[[Request], int]
    ) -> deque[Request]:
        return waiting


class LPMPolicy:
    """Longest prefix match first: most cached prompt tokens first, ties in arrival order; fcfs
    above :data:`LPM_MAX_QUEUE` waiting requests."""

    name = "lpm"

    def order(
        self, waiting: deque[Request], cached_len: Callable[[Request], int]
    ) -> deque[Request]:
        if len(waiting) > LPM_MAX_QUEUE:
            return waiting
        return deque(sorted(waiting, key=lambda r: -cached_len(r)))  # sorted() is stable


SCHEDULE_POLICIES: dict[str, type[SchedulePolicy]] = {
    cls.name: cls for cls in (FCFSPolicy, LPMPolicy)
}
