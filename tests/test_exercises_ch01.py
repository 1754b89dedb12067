"""Chapter 01 exercises, held to the shared contract of ``exercise_contract.py``: the
oracle's answer passes, near misses fail, typical mistakes get their reason, the stub is
"not attempted", and the printed solution computes the answer.

The expected answers are recomputed here from the exercise data with brute-force oracles over
plain lists (no tree), so a checker that drifts from the radix-tree semantics fails.
"""

from exercise_contract import ExerciseContract, common_len

from minirad.exercises import ch01


def oracle_q1() -> int:
    # Every prefix of every inserted key is cached (page_size 1).
    return max(common_len(key, ch01.Q1_QUERY) for key in ch01.Q1_INSERTS)


def oracle_q2() -> int:
    # After inserts only, a node ends exactly where a key ends or where keys branch.
    keys = ch01.Q2_INSERTS
    prefixes = {tuple(k[:n]) for k in keys for n in range(1, len(k) + 1)}
    ends = {tuple(k) for k in keys}
    branching = {
        p
        for p in prefixes
        if len({k[len(p)] for k in keys if len(k) > len(p) and tuple(k[: len(p)]) == p}) > 1
    }
    return len(ends | branching)


def oracle_q3() -> list[int]:
    # Token j of the match keeps the slot of the first insert that cached that prefix.
    query = ch01.Q3_QUERY
    n = max(common_len(key, query) for key, _ in ch01.Q3_INSERTS)
    slots = []
    for j in range(n):
        value = next(v for k, v in ch01.Q3_INSERTS if k[: j + 1] == query[: j + 1])
        slots.append(value[j])
    return slots


def oracle_q4() -> tuple[int, int]:
    ps = ch01.Q4_PAGE_SIZE
    key = ch01.Q4_INSERT[: len(ch01.Q4_INSERT) // ps * ps]
    query = ch01.Q4_QUERY[: len(ch01.Q4_QUERY) // ps * ps]
    return len(key), common_len(key, query) // ps * ps


def oracle_q5() -> int:
    # Disjoint keys: one node each (ids 1..n after the root's 0); the split creates id n + 1.
    keys = ch01.Q5_INSERTS
    assert all(common_len(a, b) == 0 for a in keys for b in keys if a is not b)
    return len(keys) + 1


CASES = [
    (ch01.q1, oracle_q1, ch01.Q1_SOLUTION),
    (ch01.q2, oracle_q2, ch01.Q2_SOLUTION),
    (ch01.q3, oracle_q3, ch01.Q3_SOLUTION),
    (ch01.q4, oracle_q4, ch01.Q4_SOLUTION),
    (ch01.q5, oracle_q5, ch01.Q5_SOLUTION),
]

# Typical mistakes, and a word of the reason the learner must see.
DIAGNOSED = [
    # stopping at the node boundary instead of inside the edge
    (ch01.q1, common_len(*ch01.Q1_INSERTS[:2]), "edge by edge"),
    (ch01.q1, float(oracle_q1()), "expected one int (tokens), got float"),
    (ch01.q2, len(ch01.Q2_INSERTS), "a split adds a node"),  # one node per key, no splits
    (ch01.q2, oracle_q2() + 1, "draw the tree"),
    (ch01.q3, ch01.Q3_INSERTS[1][1][: len(oracle_q3())], "which copy"),  # the second's slots
    (ch01.q3, oracle_q3()[::-1], "wrong order"),  # the right slots, in reverse
    (ch01.q3, oracle_q3()[:-1], "the query matches"),
    (ch01.q3, [float(s) for s in oracle_q3()], "expected a list of slot ids"),
    (ch01.q4, (len(ch01.Q4_INSERT), oracle_q4()[1]), "cached tokens"),  # no whole pages
    (ch01.q4, (oracle_q4()[0], common_len(ch01.Q4_INSERT, ch01.Q4_QUERY)), "matched tokens"),
    (ch01.q4, oracle_q4()[0], "expected a pair"),
    (ch01.q5, 1, "prefix part"),  # the suffix keeping the id of the node it was split from
    (ch01.q5, 2, "the order they are created"),
]


class TestExerciseContract(ExerciseContract):
    chapter = ch01
    cases = CASES
    diagnosed = DIAGNOSED
