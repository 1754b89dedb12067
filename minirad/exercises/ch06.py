"""Exercises of chapter 06 (the engine: continuous batching, chunked prefill, policies,
preemption, in-batch prefix sharing).

Each exercise is a small workload of token-id prompts; the learner predicts what the scheduler
does with it. Expected answers are computed here by running the real
:class:`~minirad.engine.Scheduler` over a real :class:`~minirad.RadixCache` and
:class:`~minirad.kvcache.kv_pool.TokenToKVPoolAllocator`, without a model: the model's part of a
step only decides *which* token is sampled, and these workloads never stop on a token and never
match a generated token, so the schedule does not depend on it (every sampled token is
:data:`FILLER`). The notebook's engine gives the same schedule for the same prompts with
``SamplingParams(max_new_tokens=..., stop_token_ids=())``. Every ``Qn_SOLUTION`` is runnable
code that sets ``answer``; the tests run it and check it with ``qn``.

Usage in the notebook::

    from minirad.exercises.ch06 import q1
    answer = ...
    q1.check(answer)
"""

from __future__ import annotations

import functools
import math

from minirad.engine import Request, SamplingParams, Scheduler, SchedulerConfig, SchedulerOutput
from minirad.exercises import Exercise, is_int, wrong_type
from minirad.kvcache.kv_pool import TokenToKVPoolAllocator
from minirad.kvcache.radix_cache import RadixCache

__all__ = [
    "FILLER",
    "Q1_BUDGET",
    "Q1_NUM_DECODING",
    "Q1_PROMPT_LEN",
    "Q2_MAX_NEW",
    "Q2_NUM_KV_SLOTS",
    "Q2_QUEUE",
    "Q2_WARM",
    "Q3_MAX_NEW",
    "Q3_NUM_KV_SLOTS",
    "Q3_PROMPTS",
    "Q4_NUM_REQUESTS",
    "Q4_PREFIX_LEN",
    "Q4_SUFFIX_LEN",
    "Q4_THRESHOLD",
    "q1",
    "q2",
    "q3",
    "q4",
]

FILLER = 4  # the token every "forward pass" here samples (any id would do)

# q1: Q1_NUM_DECODING requests are decoding when a prompt of Q1_PROMPT_LEN tokens arrives;
# each step may compute at most Q1_BUDGET tokens (max_num_batched_tokens).
Q1_BUDGET = 32
Q1_NUM_DECODING = 4
Q1_PROMPT_LEN = 90

# q2: a pool that holds one long prefix at a time, one running request at a time. Two
# 30-token prefixes, P and Q; the warm-up request (P) has run; then the queue arrives at once.
Q2_NUM_KV_SLOTS = 48
Q2_MAX_NEW = 2
_P, _Q = list(range(100, 130)), list(range(200, 230))
Q2_WARM = _P + [5]
Q2_QUEUE = {"q1": _Q + [6], "p1": _P + [7], "p2": _P + [8], "q2": _Q + [9]}

# q3: three requests arrive together in a small pool and all prefill in step 0.
Q3_NUM_KV_SLOTS = 40
Q3_MAX_NEW = 12
Q3_PROMPTS = {"A": list(range(10, 20)), "B": list(range(20, 30)), "C": list(range(30, 40))}

# q4: requests sharing a prefix arrive together (in-batch prefix sharing).
Q4_NUM_REQUESTS = 4
Q4_PREFIX_LEN = 20
Q4_SUFFIX_LEN = 5
Q4_THRESHOLD = 16  # in_batch_prefix_threshold


def _scheduler(num_slots: int = 4096, **config) -> Scheduler:
    """A scheduler over a fresh tree and pool of ``num_slots`` token slots (pages of 1)."""
    allocator = TokenToKVPoolAllocator(num_slots)
    tree = RadixCache(token_to_kv_pool_allocator=allocator)
    return Scheduler(tree, SchedulerConfig(**config))


def _request(rid: str, prompt: list[int], max_new_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_new_tokens=max_new_tokens))  # no stop ids


def _step(scheduler: Scheduler) -> SchedulerOutput:
    """One engine step without a model: schedule, 'sample' FILLER, update."""
    out = scheduler.schedule()
    scheduler.update_from_output(out, [FILLER for s in out.scheduled if s.sample])
    return out


def _run(scheduler: Scheduler, requests: list[Request]) -> list[SchedulerOutput]:
    for r in requests:
        scheduler.add_request(r)
    outs = []
    while scheduler.has_unfinished_requests():
        outs.append(_step(scheduler))
    return outs


@functools.cache
def _q1_prefill_steps() -> int:
    s = _scheduler(max_num_batched_tokens=Q1_BUDGET, max_model_len=512)
    for i in range(Q1_NUM_DECODING):  # short prompts: all prefilled in the first step
        s.add_request(_request(f"d{i}", [300 + 10 * i + j for j in range(4)], 100))
    _step(s)
    s.add_request(_request("long", list(range(500, 500 + Q1_PROMPT_LEN)), 4))
    for step in range(1, 100):
        out = _step(s)
        if any(x.request.rid == "long" and x.sample for x in out.scheduled):
            return step
    raise AssertionError("the long prompt never finished its prefill")


def _check_q1(answer: object) -> str | None:
    expected = _q1_prefill_steps()
    if not is_int(answer):
        return wrong_type("one int (steps)", answer)
    if answer == expected:
        return None
    if answer == math.ceil(Q1_PROMPT_LEN / Q1_BUDGET):
        return "the decodes run first: each step they take their tokens out of the budget"
    if answer == expected + 1:
        return "the step that computes the last chunk also samples the first output token"
    return f"{answer} is not it; how many prompt tokens fit in each step next to the decodes?"


def _cached_tokens(policy: str) -> dict[str, int]:
    """Tokens each queued request of q2 found in the tree, under ``policy``."""
    s = _scheduler(Q2_NUM_KV_SLOTS, max_num_seqs=1, policy=policy, max_model_len=64)
    _run(s, [_request("warm", Q2_WARM, Q2_MAX_NEW)])
    queue = [_request(rid, p, Q2_MAX_NEW) for rid, p in Q2_QUEUE.items()]
    _run(s, queue)
    return {r.rid: r.stats.cached_tokens for r in queue}


@functools.cache
def _q2_saved() -> tuple[int, int]:
    return sum(_cached_tokens("fcfs").values()), sum(_cached_tokens("lpm").values())


def _check_q2(answer: object) -> str | None:
    fcfs, lpm = _q2_saved()
    if not is_int(answer):
        return wrong_type("one int (prefill tokens)", answer)
    if answer == lpm - fcfs:
        return None
    if answer == lpm:
        return "that is what lpm took from the cache; subtract what fcfs took"
    if answer == fcfs - lpm:
        return "lpm computes fewer prefill tokens, not more: give a positive number"
    if answer == 0:
        return "with room for both prefixes the order would not matter; this pool holds one"
    return f"{answer} is not it; follow the tree under each policy, one request at a time"


@functools.cache
def _q3_first_preemption() -> tuple[str, int]:
    s = _scheduler(Q3_NUM_KV_SLOTS, max_model_len=64)
    for rid, prompt in Q3_PROMPTS.items():
        s.add_request(_request(rid, prompt, Q3_MAX_NEW))
    for step in range(100):
        out = _step(s)
        if out.preempted:
            return out.preempted[0].rid, step
    raise AssertionError("no request was preempted")


def _check_q3(answer: object) -> str | None:
    rid, step = _q3_first_preemption()
    if not isinstance(answer, tuple | list) or len(answer) != 2:
        return wrong_type("a pair (request id, step), e.g. ('A', 2)", answer)
    who, when = answer
    if not isinstance(who, str) or not is_int(when):
        return "the request id is a str and the step an int"
    if who != rid:
        if who == next(iter(Q3_PROMPTS)):
            return "the oldest request keeps its KV; the scheduler preempts the newest"
        return f"{who!r} is not the victim; the scheduler preempts the newest running request"
    if when == step:
        return None
    if when < step:
        return "the slots left after the prefills last a few decode steps; count them"
    if when > step:
        return "the victim goes in the first step whose decodes do not all fit"
    return f"the victim is right, but not step {when}; count the free slots after the prefill"


def _q4_prompts() -> list[list[int]]:
    prefix = list(range(600, 600 + Q4_PREFIX_LEN))
    return [
        prefix + list(range(700 + 10 * i, 700 + 10 * i + Q4_SUFFIX_LEN))
        for i in range(Q4_NUM_REQUESTS)
    ]


def _prefill_tokens(threshold: int | None) -> int:
    s = _scheduler(in_batch_prefix_threshold=threshold, max_model_len=64)
    reqs = [_request(f"r{i}", p, 3) for i, p in enumerate(_q4_prompts())]
    _run(s, reqs)
    return sum(r.stats.prefill_tokens for r in reqs)


@functools.cache
def _q4_prefill() -> tuple[int, int]:
    return _prefill_tokens(Q4_THRESHOLD), _prefill_tokens(None)


def _check_q4(answer: object) -> str | None:
    expected = _q4_prefill()
    if not isinstance(answer, tuple | list) or len(answer) != 2:
        return wrong_type("a pair of ints: (with sharing on, with it off)", answer)
    if not all(is_int(x) for x in answer):
        return "both numbers must be ints (prompt tokens computed)"
    if tuple(answer) == expected:
        return None
    if tuple(answer) == expected[::-1]:
        return "swapped: sharing computes fewer tokens"
    prompt = Q4_PREFIX_LEN + Q4_SUFFIX_LEN
    if answer[0] == prompt + (Q4_NUM_REQUESTS - 1) * (Q4_SUFFIX_LEN - 1):
        return "the len - 1 rule does not bite here: the match stops where the prompts differ"
    if answer[0] == prompt:
        return "the deferred requests still compute their own suffixes"
    if answer[1] != expected[1]:
        return "without sharing, every request computes its whole prompt"
    return "not the number with sharing on; the prefix is computed once, then matched"


Q1_SOLUTION = """\
import math

budget, num_decoding, prompt_len = 32, 4, 90
# Running requests are scheduled first, one token each; the new prompt gets what is left.
answer = math.ceil(prompt_len / (budget - num_decoding))  # 4 steps of 28, 28, 28, 6 tokens"""

Q2_SOLUTION = """\
# The pool holds one 30-token prefix at a time; the warm-up left P in the tree.
# fcfs: q1 (evicts P, 0), p1 (evicts Q, 0), p2 (hits P, 30), q2 (evicts P, 0)   -> 30
# lpm:  p1 (30), p2 (30), then q1 (evicts P, 0), q2 (30)                         -> 90
answer = 90 - 30"""

Q3_SOLUTION = """\
num_slots, prompt_len, n = 40, 10, 3
free = num_slots - n * prompt_len  # after step 0 (the prefills): 10 slots
# Each later step needs one slot per request: steps 1-3 fit (9 slots), step 4 does not,
# and the newest running request, C, is preempted.
answer = ("C", free // n + 1)"""

Q4_SOLUTION = """\
n, prefix, suffix = 4, 20, 5
# On: the first request computes the whole prompt; the others wait a step and then
# match the 20 shared tokens, computing only their 5-token suffixes. Off: all compute all.
answer = (prefix + suffix + (n - 1) * suffix, n * (prefix + suffix))"""

q1 = Exercise(
    "q1 steps of a chunked prefill",
    _check_q1,
    "Each step the running requests go first: every decode takes one token of the budget, "
    "and the new prompt gets the rest.",
    Q1_SOLUTION,
)
q2 = Exercise(
    "q2 what lpm saves over fcfs",
    _check_q2,
    "Only one prefix fits in the pool. Under fcfs a request hits only if the request before "
    "it used the same prefix; lpm runs the requests whose prefix is cached first.",
    Q2_SOLUTION,
)
q3 = Exercise(
    "q3 which request is preempted",
    _check_q3,
    "After the prefills, each step every running request needs one more slot. When the "
    "pool is short, the scheduler preempts the request that was admitted last.",
    Q3_SOLUTION,
)
q4 = Exercise(
    "q4 in-batch prefix sharing",
    _check_q4,
    "With sharing on, one request computes the shared prefix while the others wait one step; "
    "then they match it in the tree.",
    Q4_SOLUTION,
)
