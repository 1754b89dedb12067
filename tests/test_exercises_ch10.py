"""Chapter 10 exercises, held to the shared contract of ``exercise_contract.py``: the
oracle's answer passes, near misses fail, typical mistakes get their reason, the stub is
"not attempted", and the printed solution computes the answer.

``minirad.exercises.ch10`` computes its answers with the routing simulator and the router
policies of ``minirad.cluster.routing``. The oracles use no minirad class: q1 and q4 route by hand
(request ``i`` on replica ``i % N``, or everything on one replica) and count each request's
reuse by prefix arithmetic on plain lists (its longest common prefix with what its replica
computed before, at most all but its last prompt token, whole pages only); q2 keeps the list
of prompts the router has sent, in place of its tree; q3 adds up kv_aware's prices by hand.
"""

from __future__ import annotations

import functools

from exercise_contract import ExerciseContract, common_len

from minirad.bench.routing import calibration_trace
from minirad.exercises import ch10

PAGE = 32


def replica_hits(requests: list[tuple[list[int], list[int]]], routes: list[int]) -> int:
    """Prompt tokens reused in all: each (prompt, output) on its replica, one at a time, no
    eviction; a replica has computed each earlier request's prompt and all but its last
    output token."""
    computed: dict[int, list[list[int]]] = {}
    total = 0
    for (prompt, output), replica in zip(requests, routes, strict=True):
        earlier = computed.setdefault(replica, [])
        shared = max((common_len(prompt, c) for c in earlier), default=0)
        total += min(shared, len(prompt) - 1) // PAGE * PAGE
        earlier.append(prompt + output[:-1])
    return total


def q1_requests(system_len: int = ch10.Q1_SYSTEM_LEN) -> list[tuple[list[int], list[int]]]:
    """q1's requests, with token ids of our own: any ids give the same hits, as long as the
    two system prompts differ from the first token and no two questions share one."""
    systems = {
        "A": [("A", k) for k in range(system_len)],
        "B": [("B", k) for k in range(system_len)],
    }
    return [
        (systems[s] + [("q", i, k) for k in range(ch10.Q1_QUESTION_LEN)], ["out"] * 4)
        for i, s in enumerate(ch10.Q1_ORDER)
    ]


def round_robin(n_requests: int, replicas: int) -> list[int]:
    return [i % replicas for i in range(n_requests)]


def oracle_q1(replicas: int = ch10.Q1_REPLICAS) -> int:
    requests = q1_requests()
    return replica_hits(requests, round_robin(len(requests), replicas))


def cache_aware(requests, threshold=0.3, abs_threshold=64, rel_threshold=1.5) -> list[int]:
    """SGLang's cache_aware rules over the prompts it has sent (a list, not a tree)."""
    sent: list[tuple[str, int]] = []  # (prompt, replica), in the order sent
    routes = []
    for text, loads in requests:
        loads = list(loads)
        least = loads.index(min(loads))
        if max(loads) - min(loads) > abs_threshold and max(loads) > rel_threshold * min(loads):
            choice = least
        else:
            matched = max((common_len(text, p) for p, _ in sent), default=0)
            # The replica of the latest prompt through the matched characters.
            holders = [r for p, r in sent if matched and common_len(text, p) >= matched]
            choice = holders[-1] if holders and matched / len(text) > threshold else least
        sent.append((text, choice))
        routes.append(choice)
    return routes


def oracle_q2() -> list[int]:
    return cache_aware(ch10.Q2_REQUESTS)


def kv_prices(credit: float = 1.0) -> list[int]:
    """kv_aware's choices for q3, by adding up its prices: a copy's new prefill on a replica
    is the prompt minus the credited cached prefix (whole blocks), its cost that plus what is
    already queued there; the cheapest wins, the first on a tie."""
    queued = [0] * len(ch10.Q3_CACHED)
    routes = []
    for _ in range(ch10.Q3_REQUESTS):
        new = [
            ch10.Q3_PROMPT_LEN - int(c // ch10.Q3_BLOCK_SIZE * ch10.Q3_BLOCK_SIZE * credit)
            for c in ch10.Q3_CACHED
        ]
        costs = [n + q for n, q in zip(new, queued, strict=True)]
        choice = costs.index(min(costs))
        queued[choice] += new[choice]
        routes.append(choice)
    return routes


def oracle_q3() -> list[int]:
    return kv_prices()


@functools.cache
def q4_requests() -> list[tuple[list[int], list[int]]]:
    trace = calibration_trace(ch10.Q4_TRACE_SEED)
    return [(list(r.prompt), list(r.output)) for r in trace.requests]


def oracle_q4() -> tuple[int, int, int]:
    requests = q4_requests()
    rr = replica_hits(requests, round_robin(len(requests), ch10.Q4_REPLICAS))
    # One client: every load is 0 at every request; a system prompt seen for the first time
    # matches nothing and goes to the first replica, and its repeats follow it there.
    ca = replica_hits(requests, [0] * len(requests))
    return rr, ca, 1


CASES = [
    (ch10.q1, oracle_q1, ch10.Q1_SOLUTION),
    (ch10.q2, oracle_q2, ch10.Q2_SOLUTION),
    (ch10.q3, oracle_q3, ch10.Q3_SOLUTION),
    (ch10.q4, oracle_q4, ch10.Q4_SOLUTION),
]


def _with(answer: list[int], i: int, value: int) -> list[int]:
    answer = list(answer)
    answer[i] = value
    return answer


@functools.cache
def diagnosed() -> list:
    """Typical mistakes, and a word of the reason the learner must see (computed at test
    time: q4's read a trace)."""
    system, n = ch10.Q1_SYSTEM_LEN, len(ch10.Q2_REQUESTS)
    hits = oracle_q1() // (system // PAGE * PAGE)
    rr, ca, _ = oracle_q4()
    rr_two = replica_hits(q4_requests(), round_robin(len(q4_requests()), 2))
    return [
        (ch10.q1, oracle_q1(replicas=2), "over 2 replicas"),
        (ch10.q1, replica_hits(q1_requests(), [0] * len(ch10.Q1_ORDER)), "does not look"),
        (ch10.q1, hits * system, "whole 32-token pages"),
        (ch10.q1, hits, "counts the requests"),
        (ch10.q1, hits * (system // PAGE), "counts pages"),
        (ch10.q1, 7, "i % 3"),
        (ch10.q1, "192", "expected one int (prompt tokens), got str '192'"),
        (ch10.q2, [0] * n, "first only when the loads are equal"),
        (ch10.q2, cache_aware(ch10.Q2_REQUESTS, abs_threshold=10**9), "imbalanced"),
        (ch10.q2, _with(oracle_q2(), 4, 1), "over 30%"),
        (ch10.q2, _with(oracle_q2(), 1, 0), "request 2"),
        (ch10.q2, [0, 1, 2, 0, 1, 2], "no 2"),
        (ch10.q2, [0, 1], "expected 6 ints"),
        (ch10.q3, [0] * ch10.Q3_REQUESTS, "worth its tokens and no more"),
        (ch10.q3, [k % 2 for k in range(ch10.Q3_REQUESTS)], "compares tokens"),
        (ch10.q3, kv_prices(credit=0.8), "credited in full"),
        (ch10.q3, _with(oracle_q3(), 6, 1), "request 7"),
        (ch10.q3, [0, 2] + [0] * (ch10.Q3_REQUESTS - 2), "no 2"),
        (ch10.q3, [0, 1], "expected 10 ints"),
        (ch10.q4, (rr_two, ca, 1), "those of 2 replicas"),
        (ch10.q4, (ca, ca, 1), "misses it once"),
        (ch10.q4, (rr - 224, ca, 1), "i % 8"),
        (ch10.q4, (rr, ca - 224, 1), "224 tokens each"),
        (ch10.q4, (rr, ca, 4), "first of equals"),
        (ch10.q4, (rr, ca, 8), "first of equals"),
        (ch10.q4, rr, "expected 3 ints"),
    ]


class TestExerciseContract(ExerciseContract):
    chapter = ch10
    cases = CASES
    diagnosed = diagnosed


def test_q4_oracle_is_the_two_replica_pile_up_too():
    """At 2 replicas and one client the oracle's arithmetic gives docs/replicas.md's calibration:
    round robin misses each of the 4 system prompts once per replica (32 hits of 224 tokens),
    cache_aware once in all (36 hits)."""
    requests = q4_requests()
    assert replica_hits(requests, [0] * len(requests)) == 36 * 224
    assert replica_hits(requests, round_robin(len(requests), 2)) == 32 * 224


def test_lists_are_accepted_for_tuples():
    assert ch10.q2.is_correct(tuple(oracle_q2()))
    assert ch10.q4.is_correct(list(oracle_q4()))
