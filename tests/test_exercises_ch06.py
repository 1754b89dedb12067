"""Chapter 06 exercises, held to the shared contract of ``exercise_contract.py``: the
oracle's answer passes, near misses fail, typical mistakes get their reason, the stub is
"not attempted", and the printed solution computes the answer.

The expected answers are recomputed here by oracles over plain ints and lists (no minirad
classes): the scheduling rules the chapter states (decodes before new prompts, one prefix in
the q2 pool at a time, the newest running request preempted, a shared prefix computed once).
A checker that drifts from those rules, or a scheduler change that breaks them, fails here.
"""

import math

from exercise_contract import ExerciseContract, near_misses

from minirad.exercises import ch06


def oracle_q1() -> int:
    return math.ceil(ch06.Q1_PROMPT_LEN / (ch06.Q1_BUDGET - ch06.Q1_NUM_DECODING))


def _prefix(prompt: list[int]) -> tuple[int, ...]:
    return tuple(prompt[:-1])  # q2's prompts: a 30-token prefix and one token of their own


def q2_cached() -> tuple[int, int]:
    """Prompt tokens taken from the cache under (fcfs, lpm). The pool holds one prefix: a
    request hits iff the request before it used its prefix."""

    def cached(order: list[list[int]]) -> int:
        last, total = _prefix(ch06.Q2_WARM), 0
        for prompt in order:
            total += len(_prefix(prompt)) if _prefix(prompt) == last else 0
            last = _prefix(prompt)
        return total

    queue = list(ch06.Q2_QUEUE.values())
    warm = _prefix(ch06.Q2_WARM)
    # lpm: the requests on the cached prefix first; then, once one of another prefix has run,
    # the rest of that prefix (a stable sort at every admission).
    lpm = [p for p in queue if _prefix(p) == warm]
    rest = [p for p in queue if _prefix(p) != warm]
    while rest:
        group = [p for p in rest if _prefix(p) == _prefix(rest[0])]
        lpm += group
        rest = [p for p in rest if p not in group]
    return cached(queue), cached(lpm)


def oracle_q2() -> int:
    fcfs, lpm = q2_cached()
    return lpm - fcfs


def oracle_q3() -> tuple[str, int]:
    n = len(ch06.Q3_PROMPTS)
    free = ch06.Q3_NUM_KV_SLOTS - sum(len(p) for p in ch06.Q3_PROMPTS.values())
    return list(ch06.Q3_PROMPTS)[-1], free // n + 1


def oracle_q4() -> tuple[int, int]:
    n, prefix, suffix = ch06.Q4_NUM_REQUESTS, ch06.Q4_PREFIX_LEN, ch06.Q4_SUFFIX_LEN
    return prefix + suffix + (n - 1) * suffix, n * (prefix + suffix)


CASES = [
    (ch06.q1, oracle_q1, ch06.Q1_SOLUTION),
    (ch06.q2, oracle_q2, ch06.Q2_SOLUTION),
    (ch06.q3, oracle_q3, ch06.Q3_SOLUTION),
    (ch06.q4, oracle_q4, ch06.Q4_SOLUTION),
]


def wrong_answers(right):
    """The contract's near misses, and for q3 (request id, step) the other requests."""
    wrong = near_misses(right)
    if isinstance(right, tuple) and isinstance(right[0], str):
        wrong += [(other, right[1]) for other in ch06.Q3_PROMPTS if other != right[0]]
    return wrong


# Typical mistakes, and a word of the reason the learner must see.
DIAGNOSED = [
    (ch06.q1, math.ceil(ch06.Q1_PROMPT_LEN / ch06.Q1_BUDGET), "decodes run first"),
    (ch06.q1, oracle_q1() + 1, "also samples"),
    (ch06.q2, q2_cached()[1], "subtract"),
    (ch06.q2, -oracle_q2(), "positive"),
    (ch06.q2, 0, "holds one"),
    (ch06.q3, ("A", oracle_q3()[1]), "newest"),
    (ch06.q3, ("C", oracle_q3()[1] - 1), "count them"),
    (ch06.q3, ("C", oracle_q3()[1] + 1), "first step"),
    (ch06.q4, oracle_q4()[::-1], "swapped"),
    (ch06.q4, (ch06.Q4_PREFIX_LEN + ch06.Q4_SUFFIX_LEN, oracle_q4()[1]), "own suffixes"),
    (ch06.q4, (oracle_q4()[0], oracle_q4()[1] - 1), "whole prompt"),
]


class TestExerciseContract(ExerciseContract):
    chapter = ch06
    cases = CASES
    diagnosed = DIAGNOSED
    wrong_answers = staticmethod(wrong_answers)


def test_lists_are_accepted_for_pairs():
    assert ch06.q3.is_correct(list(oracle_q3()))
    assert ch06.q4.is_correct(list(oracle_q4()))
