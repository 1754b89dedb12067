"""Belady's MIN for the radix cache (:mod:`minirad.kvcache.belady`).

The oracle is checked against an exhaustive search over every eviction choice on tiny
hand-made traces, against every real policy run through :class:`RadixCache` on random chat
traces (MIN's bound must never be beaten), and against the never-evicting cache.
"""

from __future__ import annotations

import functools
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minirad import InvalidArgumentError
from minirad.bench.radix import replay
from minirad.bench.trace import ChatTrace, TraceEvent, TraceRequest, make_chat_trace
from minirad.kvcache.belady import belady
from minirad.kvcache.eviction import EVICTION_POLICIES


def _trace(requests: list[tuple[list[int], list[int]]], order: list[tuple[str, int]]) -> ChatTrace:
    """A trace from (prompt, output) pairs and an event order like [("start", 0), ...]."""
    reqs = [TraceRequest(f"r{i}", i, 0, p, o) for i, (p, o) in enumerate(requests)]
    events = [TraceEvent(float(t), kind, i) for t, (kind, i) in enumerate(order)]
    return ChatTrace(reqs, events, system_prompts=[])


def _sequential(requests: list[tuple[list[int], list[int]]]) -> ChatTrace:
    return _trace(requests, [(k, i) for i in range(len(requests)) for k in ("start", "finish")])


def _brute_force_hits(trace: ChatTrace, capacity: int) -> int:
    """The most hits of any eviction schedule of a token-granular radix cache, by exhaustive
    search: the tree is a set of token prefixes (tuples); at each start the longest cached
    prefix of ``prompt[:-1]`` hits and is locked, the rest of ``prompt + output[:-1]`` takes
    private slots, and when memory is short every choice of unlocked tokens to evict that
    leaves a tree (prefix-closed) and fits is tried; at each finish the request's tokens join
    the tree."""
    reqs = trace.requests
    events = [(e.kind, e.request) for e in trace.events]

    def prefixes(tokens: list[int]) -> list[tuple[int, ...]]:
        return [tuple(tokens[:i]) for i in range(1, len(tokens) + 1)]

    @functools.cache
    def best(i: int, tree: frozenset, running: frozenset) -> int:
        if i == len(events):
            return 0
        kind, k = events[i]
        r = reqs[k]
        if kind == "finish":
            held = dict(running)
            held.pop(k)
            grown = tree | set(prefixes(r.prompt + r.output[:-1]))
            return best(i + 1, frozenset(grown), frozenset(held.items()))
        query = prefixes(r.prompt[:-1])
        hits = next((j for j, p in enumerate(query) if p not in tree), len(query))
        held = dict(running)
        held[k] = (hits, len(r.prompt) + len(r.output) - 1 - hits)  # (locked, private)
        locked = {p for j, (h, _) in held.items() for p in prefixes(reqs[j].prompt[:h])}
        need = len(tree) + sum(priv for _, priv in held.values()) - capacity
        state = frozenset(held.items())
        if need <= 0:
            return hits + best(i + 1, tree, state)
        free = sorted(tree - locked)
        options = []
        for n in range(need, len(free) + 1):
            for gone in itertools.combinations(free, n):
                left = tree - set(gone)
                if all(p[:-1] in left or len(p) == 1 for p in left):  # still a tree
                    options.append(hits + best(i + 1, frozenset(left), state))
        assert options, "capacity too small for the trace"
        return max(options)

    return best(0, frozenset(), frozenset())


# Hand-made traces where the order of evictions matters.
_A, _B, _C = [1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11]
HAND_MADE = {
    # A is asked again after B: keeping A (evicting B) is the only way to hit it.
    "keep the one that returns": _sequential(
        [(_A + [90], [91, 92]), (_B + [93], [94, 95]), (_A + [96], [97, 98])]
    ),
    # Two conversations alternate; the cache holds only about one at a time.
    "alternating conversations": _sequential(
        [
            (_A + [20], [21, 22]),
            (_C + [30], [31, 32]),
            (_A + [20, 21, 40], [41, 42]),
            (_A + [20, 21, 40, 41, 50], [51, 52]),
            (_C + [30, 31, 60], [61, 62]),
        ]
    ),
    # A shared prefix under two branches, one of which is never used again.
    "a dead branch": _sequential(
        [
            ([1, 2, 3, 4, 5, 6], [7, 8]),
            ([1, 2, 3, 9, 10, 11], [12, 13]),
            ([1, 2, 3, 4, 5, 6, 7, 14], [15, 16]),
        ]
    ),
}


@pytest.mark.parametrize("name", sorted(HAND_MADE))
@pytest.mark.parametrize("slack", [0, 2, 5])
def test_min_equals_brute_force_on_sequential_traces(name, slack):
    # One request at a time: the bound's relaxation changes nothing, so MIN is exact.
    trace = HAND_MADE[name]
    capacity = trace.peak_running_tokens() + slack
    result = belady(trace, capacity)
    best = _brute_force_hits(trace, capacity)
    assert result.resupplied_tokens == 0
    assert result.hit_tokens == result.bound_hit_tokens == best
    assert result.peak_used_tokens <= capacity


def test_min_beats_lru_where_lru_is_wrong():
    trace = HAND_MADE["keep the one that returns"]
    capacity = trace.peak_running_tokens() + 2
    lru = replay(trace, capacity, policy="lru")
    result = belady(trace, capacity)
    assert result.hit_tokens == 4 > lru.hit_tokens  # A's four tokens, kept across B


def test_concurrent_requests_are_bracketed():
    # Two requests share a prefix that neither finds cached: the real cache computes it twice
    # (two copies in memory), the relaxation once. Brute force lies between the two numbers.
    shared = [1, 2, 3, 4, 5]
    trace = _trace(
        [(shared + [6], [7, 8]), (shared + [9], [10, 11]), (shared + [12], [13, 14])],
        [("start", 0), ("start", 1), ("finish", 0), ("finish", 1), ("start", 2), ("finish", 2)],
    )
    for slack in (0, 3, 8):
        capacity = trace.peak_running_tokens() + slack
        result = belady(trace, capacity)
        best = _brute_force_hits(trace, capacity)
        assert result.hit_tokens <= best <= result.bound_hit_tokens


@st.composite
def small_traces(draw):
    trace = make_chat_trace(
        draw(st.integers(2, 12)),
        turns=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 10**6)),
        vocab_size=1000,
        num_system_prompts=draw(st.integers(1, 3)),
        system_prompt_len=(4, 40),
        user_median=6,
        answer_median=10,
        arrival_interval=draw(st.sampled_from([2.0, 20.0, 200.0])),
        think_time=draw(st.sampled_from([20.0, 200.0])),
    )
    page_size = draw(st.sampled_from([1, 1, 2, 4]))
    peak = trace.peak_running_tokens(page_size)
    extra = draw(st.integers(0, 2 * peak)) // page_size * page_size
    return trace, page_size, peak + extra


@settings(max_examples=60, deadline=None)
@given(small_traces())
def test_no_policy_beats_the_bound(case):
    trace, page_size, capacity = case
    result = belady(trace, capacity, page_size)
    assert result.hit_tokens <= result.bound_hit_tokens
    assert result.peak_used_tokens <= capacity
    if result.resupplied_tokens == 0:  # the condition under which the bound is proven
        for policy in EVICTION_POLICIES:
            run = replay(trace, capacity, page_size, policy)
            assert run.hit_tokens <= result.bound_hit_tokens, policy


@settings(max_examples=30, deadline=None)
@given(small_traces())
def test_huge_capacity_gives_the_infinite_cache(case):
    trace, page_size, _ = case
    big = trace.max_cached_tokens(page_size) + trace.peak_running_tokens(page_size)
    big += -big % page_size
    infinite = replay(trace, big, page_size, "lru")
    assert infinite.evicted_tokens == 0
    result = belady(trace, big, page_size)
    assert result.hit_tokens == result.bound_hit_tokens == infinite.hit_tokens
    assert result.evicted_tokens == 0


def test_min_on_a_chat_trace_is_deterministic_and_above_lru():
    trace = make_chat_trace(30, turns=3, seed=3)
    capacity = trace.peak_running_tokens() + 500
    a, b = belady(trace, capacity), belady(trace, capacity)
    assert a == b
    lru = replay(trace, capacity, policy="lru")
    assert lru.hit_tokens < a.hit_tokens <= a.bound_hit_tokens
    assert a.resupplied_tokens == 0


def test_bad_arguments_are_rejected():
    trace = HAND_MADE["a dead branch"]
    peak = trace.peak_running_tokens()
    with pytest.raises(InvalidArgumentError, match="too small"):
        belady(trace, peak - 1)
    with pytest.raises(InvalidArgumentError, match="multiple of page_size"):
        belady(trace, 4 * peak + 1, page_size=4)
    for bad in (0, -3, 2.5):
        with pytest.raises(InvalidArgumentError, match="positive int"):
            belady(trace, bad)


def test_hits_per_request_sum_to_the_total() -> None:
    trace = make_chat_trace(40, seed=3, system_prompt_len=(20, 60))
    capacity = trace.peak_running_tokens() + 200
    result = belady(trace, capacity)
    assert len(result.request_hit_tokens) == len(trace.requests)
    assert sum(result.request_hit_tokens) == result.hit_tokens > 0
    assert all(
        0 <= h < len(r.prompt)
        for h, r in zip(result.request_hit_tokens, trace.requests, strict=True)
    )
