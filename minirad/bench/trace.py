"""A synthetic multi-turn chat trace: the workload that a radix prefix cache is built for.

Each conversation starts with one of a few shared system prompts, then alternates user turns
and assistant answers. Turn ``k`` is one request whose prompt is the whole history so far
(system prompt, every earlier user turn and answer, and the new user turn) and whose output is
the ``k``-th answer, so the next turn's prompt begins with everything this request computed.
That is the reuse pattern of the SGLang paper's multi-turn chat benchmark (Zheng et al. 2024,
§6, "multi-turn chat"), and the reason a radix tree beats a per-request cache.

Arrivals interleave: conversations start at random times (a Poisson process), every request
runs for a time proportional to its output length (one time unit per decoded token), and the
next turn of a conversation arrives after a random "think time". Many conversations are
therefore open at once, and their requests overlap, which is what makes eviction choose among
them. The timeline does not depend on the cache: it is fixed by the seed, so every cache and
policy replays exactly the same sequence of request starts and finishes.

Token ids are uniform random draws from the vocabulary; only equality of ids matters to the
cache. Everything is drawn from one ``random.Random(seed)``: the same arguments give the same
trace on every run and machine.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass
from typing import Literal

from minirad.errors import InvalidArgumentError

__all__ = ["ChatTrace", "TraceEvent", "TraceRequest", "make_chat_trace"]


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
            total += len(seq) - _common_prefix_len(prev, seq)
            prev = seq
        return total


def _ceil_to(n: int, page_size: int) -> int:
    return -(-n // page_size) * page_size


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    """Bisect on slice equality, so that the token compares run in C, not in a Python loop."""
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _length(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """A log-normal length: most turns are short, a few are long (as in real chat logs)."""
    return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))


def make_chat_trace(
    num_conversations: int = 2000,
    turns: int = 4,
    seed: int = 0,
    *,
    vocab_size: int = 32000,
    num_system_prompts: int = 4,
    system_prompt_len: tuple[int, int] = (200, 800),
    user_median: int = 48,
    answer_median: int = 128,
    arrival_interval: float = 16.0,
    think_time: float = 2000.0,
) -> ChatTrace:
    """Generate a deterministic multi-turn chat trace.

    Args:
        num_conversations: number of conversations.
        turns: mean turns per conversation; each has a uniform ``1 .. 2 * turns - 1`` turns.
        seed: seed of the one random generator behind every choice.
        vocab_size: token ids are drawn from ``0 .. vocab_size - 1``.
        num_system_prompts: shared system prompts; each conversation picks one at random.
        system_prompt_len: (min, max) system prompt length in tokens.
        user_median, answer_median: median user-turn and answer lengths in tokens
            (log-normal; user turns 4..1024 tokens, answers 8..1024).
        arrival_interval: mean time between two conversations' first requests, in decode
            steps. Smaller means more conversations open at once.
        think_time: mean time between an answer and the next user turn, in decode steps.

    Raises:
        InvalidArgumentError: a count or length is not positive.
    """
    for name, v in dict(
        num_conversations=num_conversations,
        turns=turns,
        vocab_size=vocab_size,
        num_system_prompts=num_system_prompts,
        user_median=user_median,
        answer_median=answer_median,
    ).items():
        if not isinstance(v, int) or v <= 0:
            raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
    lo, hi = system_prompt_len
    if not 0 < lo <= hi:
        raise InvalidArgumentError(f"system_prompt_len must be 0 < min <= max, got {lo, hi}")
    if arrival_interval <= 0 or think_time <= 0:
        raise InvalidArgumentError("arrival_interval and think_time must be > 0")

    rng = random.Random(seed)
    vocab = range(vocab_size)

    def tokens(n: int) -> list[int]:
        return rng.choices(vocab, k=n)

    system_prompts = [tokens(rng.randint(lo, hi)) for _ in range(num_system_prompts)]

    # Content first (so a conversation's tokens do not depend on how arrivals interleave).
    convs: list[list[tuple[list[int], list[int]]]] = []
    for _ in range(num_conversations):
        history = list(rng.choice(system_prompts))
        reqs = []
        for _ in range(rng.randint(1, 2 * turns - 1)):
            prompt = history + tokens(_length(rng, user_median, 0.8, 4, 1024))
            output = tokens(_length(rng, answer_median, 0.7, 8, 1024))
            reqs.append((prompt, output))
            history = prompt + output
        convs.append(reqs)

    # Timeline: a discrete-event simulation with a heap of (time, seq, kind, conversation, turn).
    heap: list[tuple[float, int, str, int, int]] = []
    t = 0.0
    for c in range(num_conversations):
        t += rng.expovariate(1.0 / arrival_interval)
        heap.append((t, c, "start", c, 0))
    heapq.heapify(heap)
    seq = num_conversations  # tie-breaker: equal times keep push order
    requests: list[TraceRequest] = []
    events: list[TraceEvent] = []
    index: dict[tuple[int, int], int] = {}
    while heap:
        t, _, kind, c, k = heapq.heappop(heap)
        prompt, output = convs[c][k]
        if kind == "start":
            index[c, k] = len(requests)
            requests.append(TraceRequest(f"c{c}t{k}", c, k, prompt, output))
            heapq.heappush(heap, (t + len(output), seq, "finish", c, k))
        elif k + 1 < len(convs[c]):
            heapq.heappush(heap, (t + rng.expovariate(1.0 / think_time), seq, "start", c, k + 1))
        seq += 1
        events.append(TraceEvent(t, kind, index[c, k]))
    return ChatTrace(requests, events, system_prompts)
