"""A request trace as the cache benchmarks replay it: requests (prompt and output token ids)
and the order in which they start and finish. :mod:`minirad.bench.trace` draws synthetic chat
traces of this shape; :mod:`minirad.kvcache.belady` computes the best any eviction policy can do
on one; ``minirad explain`` builds one from a JSONL file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ChatTrace", "TraceEvent", "TraceRequest", "common_prefix_len"]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace (one turn of one conversation).

    Attributes:
        rid: request id, ``"c{conversation}t{turn}"``.
        conversation: index of the conversation.
        turn: 0-based turn within the conversation.
        prompt: prompt token ids (the conversation so far plus the new user turn).
        output: the answer's token ids, as the model would generate them.
    """

    rid: str
    conversation: int
    turn: int
    prompt: list[int]
    output: list[int]


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """A request starts (arrives and is admitted) or finishes, at ``time`` (decode steps)."""

    time: float
    kind: Literal["start", "finish"]
    request: int  # index into ChatTrace.requests


@dataclass(frozen=True, slots=True)
class ChatTrace:
    """Requests and the order in which they start and finish.

    Attributes:
        requests: every request, in order of arrival.
        events: ``2 * len(requests)`` events in time order; a request's ``finish`` always comes
            after its ``start``, and a conversation's next turn starts after its previous turn
            finished.
        system_prompts: the shared system prompts (token ids).
    """

    requests: list[TraceRequest]
    events: list[TraceEvent]
    system_prompts: list[list[int]]

    @property
    def num_conversations(self) -> int:
        return len({r.conversation for r in self.requests})

    @property
    def prompt_tokens(self) -> int:
        """Sum of prompt lengths, in tokens: the prefill work without any cache."""
        return sum(len(r.prompt) for r in self.requests)

    def peak_running_tokens(self, page_size: int = 1) -> int:
        """The most KV slots that running requests can hold at once, in tokens: the sum over
        the requests running together of ``len(prompt) + len(output)``, each rounded up to
        whole pages. A pool at least this large never runs out of memory once the cache has
        evicted everything unlocked."""
        running = peak = 0
        for e in self.events:
            r = self.requests[e.request]
            need = _ceil_to(len(r.prompt) + len(r.output), page_size)
            running += need if e.kind == "start" else -need
            peak = max(peak, running)
        return peak

    def max_cached_tokens(self, page_size: int = 1) -> int:
        """An upper bound, in tokens, on what a cache that never evicts ends up holding.

        A conversation's requests are nested (each prompt extends the previous request's
        prompt and output), so its cached tokens are at most its last request's prompt plus
        output. Shared system prompts are counted once per conversation: a bound, not a count.
        """
        last: dict[int, TraceRequest] = {}
        for r in self.requests:
            last[r.conversation] = r
        return sum(_ceil_to(len(r.prompt) + len(r.output), page_size) for r in last.values())

    def unique_tokens(self) -> int:
        """Distinct token positions of all ``prompt + output`` sequences, in tokens: the nodes
        of an uncompressed trie of them, i.e. what a cache that never evicts would hold.

        Pool sizes are quoted as a fraction of this (``--capacity-frac``), as the anchor
        harness (``../shared/anchor-bench``) does. Sort the sequences; each adds its length
        minus its longest common prefix with the one before it.
        """
        seqs = sorted(r.prompt + r.output for r in self.requests)
        total, prev = 0, []
        for seq in seqs:
            total += len(seq) - common_prefix_len(prev, seq)
            prev = seq
        return total


def _ceil_to(n: int, page_size: int) -> int:
    return -(-n // page_size) * page_size


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``. Bisect on slice equality,
    so that the token compares run in C, not in a Python loop."""
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
