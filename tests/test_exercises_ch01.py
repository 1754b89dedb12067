"""Chapter 01 exercises: each solution passes, wrong answers fail, untouched stubs say so.

The expected answers are recomputed here from the exercise data with brute-force oracles over
plain lists (no tree), so a checker that drifts from the radix-tree semantics fails.
"""

import pytest

from minirad import RadixCache
from minirad.exercises import ch01


def common_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


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
    (ch01.q1, oracle_q1),
    (ch01.q2, oracle_q2),
    (ch01.q3, oracle_q3),
    (ch01.q4, oracle_q4),
    (ch01.q5, oracle_q5),
]
IDS = [q.name.split()[0] for q, _ in CASES]


def wrong_answers(right):
    """Near misses of the right answer's type, and answers of the wrong type."""
    if isinstance(right, int):
        return [right + 1, right - 1, float(right), str(right), None]
    if isinstance(right, tuple):
        return [(right[0], right[1] + 1), (right[0] + 1, right[1]), right[:1], right + (0,)]
    return [right[:-1], right + [0], [s + 1 for s in right], list(reversed(right)), "x"]


@pytest.mark.parametrize("exercise, oracle", CASES, ids=IDS)
def test_right_answer_passes(exercise, oracle, capsys):
    assert exercise.is_correct(oracle())
    exercise.check(oracle())
    assert capsys.readouterr().out == f"[{exercise.name}] correct!\n"


@pytest.mark.parametrize("exercise, oracle", CASES, ids=IDS)
def test_wrong_answers_fail(exercise, oracle, capsys):
    for wrong in wrong_answers(oracle()):
        assert not exercise.is_correct(wrong), wrong
        exercise.check(wrong)
        assert capsys.readouterr().out.startswith(f"[{exercise.name}] incorrect: "), wrong


@pytest.mark.parametrize("exercise, oracle", CASES, ids=IDS)
def test_untouched_stub_is_not_attempted(exercise, oracle, capsys):
    assert not exercise.is_correct(...)
    exercise.check(...)
    assert capsys.readouterr().out.startswith(f"[{exercise.name}] not attempted")


@pytest.mark.parametrize("exercise, oracle", CASES, ids=IDS)
def test_solution_states_and_computes_the_answer(exercise, oracle, capsys):
    exercise.solution()
    text = capsys.readouterr().out.split("solution:\n", 1)[1]
    prose, code = text.split("\n", 1)
    assert prose.startswith(f"{oracle()}:"), prose
    namespace = {"RadixCache": RadixCache, **vars(ch01)}
    exec(code, namespace)
    assert exercise.is_correct(namespace["answer"])


@pytest.mark.parametrize("exercise, oracle", CASES, ids=IDS)
def test_hint_prints(exercise, oracle, capsys):
    exercise.hint()
    assert capsys.readouterr().out.startswith(f"[{exercise.name}] hint: ")
