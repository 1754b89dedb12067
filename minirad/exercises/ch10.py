"""Exercises of chapter 10 (replicas behind a router: which prefix cache a request meets).

The answers are computed here with the real ``minirad`` code: the routing simulator
(:func:`minirad.bench.routing.simulate`, N replicas each with a real
:class:`~minirad.kvcache.radix_cache.RadixCache`) for q1 and q4, SGLang's ``cache_aware`` policy
(:class:`~minirad.cluster.routing.CacheAwarePolicy`, its approximate text tree and balance
thresholds) for q2, and vllm-router's ``kv_aware`` (:class:`~minirad.cluster.routing.KVAwarePolicy`)
for q3 (as vllm-router 0.1.17 decides: a replica's cost is the request's new prefill there
plus the prefill already in flight there). Every ``Qn_SOLUTION`` is runnable code that sets
``answer``; the tests run it and check it with ``qn``, and compute the answers another way
(prefix arithmetic on plain lists, a list of the prompts the router has sent in place of its
tree, kv_aware's prices added up by hand).

Usage in the notebook::

    from minirad.exercises.ch10 import q1
    answer = ...
    q1.check(answer)
"""

from __future__ import annotations

import functools

from minirad.bench.routing import calibration_trace, simulate
from minirad.bench.trace import ChatTrace, TraceRequest
from minirad.cluster.routing import CacheAwarePolicy, KVAwarePolicy
from minirad.exercises import Exercise, WrongAnswer, is_int, is_int_list, wrong_type

__all__ = [
    "Q1_ORDER",
    "Q1_PAGE_SIZE",
    "Q1_QUESTION_LEN",
    "Q1_REPLICAS",
    "Q1_SYSTEM_LEN",
    "Q2_REQUESTS",
    "Q3_BLOCK_SIZE",
    "Q3_CACHED",
    "Q3_PROMPT_LEN",
    "Q3_REQUESTS",
    "Q4_REPLICAS",
    "Q4_TRACE_SEED",
    "q1",
    "q2",
    "q3",
    "q4",
]

# q1: two system prompts of Q1_SYSTEM_LEN tokens, each request one of them and a question of
# its own, in this order, one at a time, round robin over Q1_REPLICAS replicas.
Q1_ORDER = "AABBABAB"
Q1_REPLICAS = 3
Q1_SYSTEM_LEN = 80  # two and a half pages: only whole pages hit
Q1_QUESTION_LEN = 40
Q1_PAGE_SIZE = 32
Q1_OUTPUT_LEN = 4

# q2: (prompt text, in-flight requests per replica when it arrives), one after another,
# through a fresh cache_aware router (SGLang's defaults) over two replicas.
Q2_REQUESTS: tuple[tuple[str, tuple[int, int]], ...] = (
    ("You are a shape expert. Q: how many circles?", (0, 0)),
    ("You are a colour expert. Q: which colour?", (1, 0)),
    ("You are a shape expert. Q: where is the square?", (1, 1)),
    ("You are a colour expert. Q: which shape?", (0, 0)),
    ("You are a size expert. Q: how big?", (1, 0)),
    ("You are a shape expert. Q: how many squares?", (70, 0)),
)

# q3: copies of one prompt at a fresh kv_aware router (vllm-router 0.1.17's prefix cost) over
# two replicas whose caches hold Q3_CACHED of its tokens; none finishes or is prefilled before
# the last arrives. Credit 1.0 per cached token: vLLM's GPU blocks.
Q3_BLOCK_SIZE = 32
Q3_PROMPT_LEN = 260
Q3_CACHED = (7 * Q3_BLOCK_SIZE, 0)
Q3_REQUESTS = 10
Q3_CREDIT = 1.0

# q4: the two-replica workload measured behind the real routers (40 requests over 4 system
# prompts of 7 blocks) on Q4_REPLICAS replicas, one client, pages of 32.
Q4_REPLICAS = 8
Q4_TRACE_SEED = 0


# ----------------------------------------------------------------------------------------- q1
def _q1_trace(system_len: int = Q1_SYSTEM_LEN) -> ChatTrace:
    """The requests of q1 as a trace: system prompt A is ids 1.., B ids 1001..; request ``i``'s
    question ids from ``10_000 + 100 * i`` (no two questions share a token)."""
    systems = {"A": list(range(1, 1 + system_len)), "B": list(range(1001, 1001 + system_len))}
    requests = [
        TraceRequest(
            f"r{i}",
            i,
            0,
            systems[s] + list(range(10_000 + 100 * i, 10_000 + 100 * i + Q1_QUESTION_LEN)),
            [2] * Q1_OUTPUT_LEN,
        )
        for i, s in enumerate(Q1_ORDER)
    ]
    return ChatTrace(requests, [], list(systems.values()))


@functools.cache
def _q1_hits(replicas: int = Q1_REPLICAS, policy: str = "round_robin") -> int:
    result = simulate(_q1_trace(), policy, replicas, 4096, Q1_PAGE_SIZE)
    return result.saved_tokens


def _check_q1(answer: object) -> str | None:
    if not is_int(answer):
        return wrong_type("one int (prompt tokens)", answer)
    expected, page, system = _q1_hits(), Q1_PAGE_SIZE, Q1_SYSTEM_LEN
    hits = expected // (system // page * page)  # requests that found their system prompt
    if answer == expected:
        return None
    if answer == _q1_hits(replicas=2):
        return (
            f"that is round robin over 2 replicas (the recording's); here there are "
            f"{Q1_REPLICAS}: request i goes to replica i % {Q1_REPLICAS}"
        )
    if answer == _q1_hits(policy="cache_aware"):
        return (
            "that is one miss per system prompt, what a cache-aware router could do; round "
            "robin does not look at the prompt, so each replica misses each prompt once"
        )
    if answer == hits * system:
        return (
            f"a replica caches whole {page}-token pages only: of an {system}-token system "
            f"prompt, {system // page} pages can hit"
        )
    if answer == hits:
        return f"that counts the requests that hit; the question asks for tokens ({page} a page)"
    if answer == hits * (system // page):
        return "that counts pages; the question asks for tokens"
    return (
        "not that; write down the replica of each request (i % "
        f"{Q1_REPLICAS}) and which system prompts each replica has seen before it"
    )


Q1_SOLUTION = """\
from minirad.bench.routing import simulate
from minirad.bench.trace import ChatTrace, TraceRequest

systems = {"A": list(range(1, 81)), "B": list(range(1001, 1081))}  # 80 tokens each
requests = []
for i, s in enumerate("AABBABAB"):
    question = list(range(10_000 + 100 * i, 10_040 + 100 * i))  # 40 tokens, its own
    requests.append(TraceRequest(f"r{i}", i, 0, systems[s] + question, [2] * 4))
trace = ChatTrace(requests, [], list(systems.values()))
result = simulate(trace, "round_robin", replicas=3, capacity=4096, page_size=32)
answer = result.saved_tokens
# 192: replicas 0 1 2 0 1 2 0 1 get A A B B A B A B. Replica 0 sees A, B, A: one hit;
# replica 1 sees A, A, B: one hit; replica 2 sees B, B: one hit. Each hit is the system
# prompt's 2 whole pages, 64 tokens (its last 16 tokens fill no page)."""

q1 = Exercise(
    "q1 round robin's hits",
    _check_q1,
    "Request i goes to replica i % 3, whatever its prompt. A request hits when its replica has "
    "served its system prompt before; then it reuses the system prompt's whole 32-token pages.",
    Q1_SOLUTION,
)


# ----------------------------------------------------------------------------------------- q2
@functools.cache
def _q2_routes(balance: bool = True, threshold: float = 0.3) -> tuple[int, ...]:
    """The replicas a fresh cache_aware router picks for Q2_REQUESTS; ``balance=False``
    never lets the loads override the tree (a typical mistake)."""
    abs_threshold = 64 if balance else 10**9
    policy = CacheAwarePolicy(2, cache_threshold=threshold, balance_abs_threshold=abs_threshold)
    return tuple(policy.select(text, list(loads)) for text, loads in Q2_REQUESTS)


def _request_list(answer: object, n: int, what: str) -> list[int]:
    if not is_int_list(answer) or len(answer) != n:
        raise WrongAnswer(wrong_type(f"{n} ints, {what}", answer))
    return list(answer)


def _check_q2(answer: object) -> str | None:
    n = len(Q2_REQUESTS)
    got = _request_list(answer, n, f"one replica (0 or 1) per request, e.g. {(0,) * n}")
    if unknown := sorted(set(got) - {0, 1}):
        return f"there are two replicas, 0 and 1; there is no {unknown[0]}"
    expected = list(_q2_routes())
    if got == expected:
        return None
    if got == [0] * n:
        return (
            "the least-loaded replica is the first only when the loads are equal; request 2 "
            f"arrives with loads {list(Q2_REQUESTS[1][1])}"
        )
    if got == list(_q2_routes(balance=False)):
        return (
            f"request {n}: the loads {list(Q2_REQUESTS[-1][1])} are imbalanced (a difference "
            "over 64 and a ratio over 1.5), and then the least-loaded replica wins whatever "
            "the tree says"
        )
    i = next(i for i, (a, e) in enumerate(zip(got, expected, strict=True)) if a != e)
    if i == 4:
        return (
            "request 5: count the characters it shares with an earlier prompt, from the "
            "start; over 30% of its length (more than cache_threshold) routes by the tree"
        )
    return (
        f"request {i + 1}: how many leading characters does it share with a prompt sent "
        "before, and to which replica did that prompt go? Below 30% of its length, the "
        "least-loaded replica (the first of equals) wins"
    )


Q2_SOLUTION = """\
from minirad.cluster.routing import CacheAwarePolicy

requests = [
    ("You are a shape expert. Q: how many circles?", [0, 0]),
    ("You are a colour expert. Q: which colour?", [1, 0]),
    ("You are a shape expert. Q: where is the square?", [1, 1]),
    ("You are a colour expert. Q: which shape?", [0, 0]),
    ("You are a size expert. Q: how big?", [1, 0]),
    ("You are a shape expert. Q: how many squares?", [70, 0]),
]
router = CacheAwarePolicy(2)  # SGLang's defaults: cache_threshold 0.3, balance 64 and 1.5
answer = [router.select(text, loads) for text, loads in requests]
# [0, 1, 0, 1, 0, 1]: 1 nothing in the tree, equal loads: replica 0. 2 shares "You are a "
# (10 of 41 characters, 24%): the least loaded, 1. 3 shares 27 of 47 with request 1: 0.
# 4 shares 34 of 40 with request 2: 1. 5 shares "You are a s" with the shape prompts
# (11 of 34, 32%: just over the threshold): the replica of the latest of them, 0, although
# replica 1 is idle. 6 matches replica 0, but 70 against 0 requests is imbalanced: 1."""

q2 = Exercise(
    "q2 cache_aware's text tree",
    _check_q2,
    "For each request: if the loads are imbalanced (difference > 64 and ratio > 1.5), the "
    "least-loaded replica; else the longest shared prefix of characters with an earlier "
    "prompt, and that prompt's replica if the match covers more than 30% of the request; else "
    "the least-loaded replica, the first on a tie.",
    Q2_SOLUTION,
)


# ----------------------------------------------------------------------------------------- q3
@functools.cache
def _q3_routes(credit: float = Q3_CREDIT) -> tuple[int, ...]:
    """The replicas a fresh kv_aware router picks for Q3_REQUESTS copies of one prompt, the
    caches as in Q3_CACHED and nothing finishing meanwhile."""

    def cached_tokens(replica: int, _key) -> int:
        return Q3_CACHED[replica]

    router = KVAwarePolicy(len(Q3_CACHED), cached_tokens, block_size=Q3_BLOCK_SIZE, credit=credit)
    prompt = list(range(Q3_PROMPT_LEN))
    return tuple(router.select(prompt, [0] * len(Q3_CACHED)) for _ in range(Q3_REQUESTS))


def _check_q3(answer: object) -> str | None:
    n, replicas = Q3_REQUESTS, len(Q3_CACHED)
    got = _request_list(answer, n, f"one replica per request, e.g. {(0,) * n}")
    if unknown := sorted(set(got) - set(range(replicas))):
        return f"the replicas are 0 to {replicas - 1}; there is no {unknown[0]}"
    expected = list(_q3_routes())
    if got == expected:
        return None
    if got == [0] * n:
        return (
            "a cached prefix is worth its tokens and no more: the router adds to each replica's "
            "cost the new prefill of the requests it has already sent there"
        )
    if got == [k % replicas for k in range(n)]:
        return (
            "that alternates as a count of requests would; the router compares tokens: the "
            "request's new prefill on each replica plus the prefill queued there"
        )
    if got == list(_q3_routes(credit=0.8)):
        return (
            "that credits a cached token at 0.8 (host memory, what our workers' events say); "
            "here the blocks are vLLM's GPU blocks, credited in full"
        )
    i = next(i for i, (a, e) in enumerate(zip(got, expected, strict=True)) if a != e)
    return (
        f"request {i + 1}: add up the new prefill already queued on each replica by the "
        "requests before it, add this request's own new prefill there (its prompt minus the "
        "cached prefix), and take the cheaper replica, replica 0 on a tie"
    )


Q3_SOLUTION = """\
from minirad.cluster.routing import KVAwarePolicy

cached = [224, 0]  # prompt tokens each replica's cache holds (7 blocks of 32 on replica 0)
router = KVAwarePolicy(2, lambda replica, key: cached[replica], block_size=32)
prompt = list(range(260))
answer = [router.select(prompt, [0, 0]) for _ in range(10)]
# [0, 0, 0, 0, 0, 0, 0, 1, 0, 0]: on replica 0 a copy costs 36 new tokens, on replica 1 all
# 260. The n-th copy to replica 0 finds 36 * (n - 1) tokens queued there: the 8th would cost
# 36 * 8 = 288 > 260, so it goes to replica 1. Then replica 1 has 260 queued, and replica 0
# is cheaper again until 36 * (n + 1) > 520."""

q3 = Exercise(
    "q3 kv_aware's price",
    _check_q3,
    "A replica's cost is the request's new prefill there (260 minus the cached 224 on replica "
    "0, all 260 on replica 1) plus the new prefill of the requests already in flight there; "
    "the cheapest wins, the first on a tie.",
    Q3_SOLUTION,
)


# ----------------------------------------------------------------------------------------- q4
@functools.cache
def _q4_run(policy: str, replicas: int = Q4_REPLICAS) -> tuple[int, int]:
    """(hit tokens, replicas that served a request) of ``policy`` on q4's workload."""
    result = simulate(calibration_trace(Q4_TRACE_SEED), policy, replicas, 1 << 16, 32, 1)
    return result.saved_tokens, sum(1 for n in result.requests if n)


def _check_q4(answer: object) -> str | None:
    if not is_int_list(answer) or len(answer) != 3:
        return wrong_type(
            "3 ints: (round_robin's hit tokens, cache_aware's hit tokens, replicas cache_aware "
            "uses)",
            answer,
        )
    rr, ca, used = answer
    (rr_hits, _), (ca_hits, ca_used) = _q4_run("round_robin"), _q4_run("cache_aware")
    if (rr, ca, used) == (rr_hits, ca_hits, ca_used):
        return None
    if rr != rr_hits:
        if rr == _q4_run("round_robin", 2)[0]:
            return f"round_robin's hits are those of 2 replicas; here there are {Q4_REPLICAS}"
        if rr == ca_hits:
            return (
                "round_robin's hits: round robin spreads each system prompt over the replicas, "
                "and each replica misses it once"
            )
        return (
            "round_robin's hits: request i goes to replica i % 8; a request hits when its "
            "replica served its system prompt before (224 tokens, 7 whole blocks)"
        )
    if ca != ca_hits:
        return (
            "cache_aware's hits: every request but the first of each system prompt finds it "
            "cached, 224 tokens each"
        )
    if used != ca_used:
        return (
            "one client: every request finds every load at 0; a new system prompt matches "
            "nothing, so it goes to the least-loaded replica, the first of equals, every time"
        )
    raise AssertionError("unreachable: some part differs")


Q4_SOLUTION = """\
from minirad.bench.routing import calibration_trace, simulate

trace = calibration_trace(0)  # 40 requests over 4 system prompts of 224 tokens
rr = simulate(trace, "round_robin", replicas=8, capacity=1 << 16, page_size=32, concurrency=1)
ca = simulate(trace, "cache_aware", replicas=8, capacity=1 << 16, page_size=32, concurrency=1)
answer = (rr.saved_tokens, ca.saved_tokens, sum(1 for n in ca.requests if n))
# (3584, 8064, 1): round robin gives each replica 5 requests, and 24 of the 32 (replica,
# system prompt) pairs occur: 16 hits of 224 tokens. cache_aware sends all 40 to replica 0
# (one client: every load is 0, and the first of equals wins), where 36 hit."""

q4 = Exercise(
    "q4 eight replicas, one client",
    _check_q4,
    "At one client every request finds the loads at 0. Round robin: request i on replica "
    "i % 8. cache_aware: where does a system prompt go the first time, when it matches "
    "nothing in the tree?",
    Q4_SOLUTION,
)
