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

from minirad.errors import InvalidArgumentError
from minirad.kvcache.request_trace import ChatTrace, TraceEvent, TraceRequest

__all__ = ["ChatTrace", "TraceEvent", "TraceRequest", "make_chat_trace"]


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
