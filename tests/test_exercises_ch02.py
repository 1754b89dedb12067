"""Chapter 02 exercises: each solution passes, wrong answers fail with a useful reason, and
untouched stubs say "not attempted".

The expected answers are recomputed here by oracles over plain ints and lists (no minirad
classes): the formulas and the free-queue rules the chapter states. A checker that drifts from
those rules, or a library change that breaks them, fails here.
"""

import pytest
import torch

from minirad.exercises import ch02


def oracle_q1() -> int:
    cfg = ch02.Q1_CONFIG
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    elem = getattr(torch, cfg["torch_dtype"]).itemsize
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * elem


def oracle_q2() -> int:
    bs, pos = ch02.Q2_BLOCK_SIZE, ch02.Q2_POSITION
    return ch02.Q2_BLOCK_TABLE[pos // bs] * bs + pos % bs


def oracle_q3() -> tuple[int, ...]:
    # Whole blocks of the common prefix, at most the cached full blocks and (len - 1) // bs.
    bs, cached = ch02.Q3_BLOCK_SIZE, ch02.Q3_CACHED
    out = []
    for p in ch02.Q3_PROMPTS:
        common = 0
        while common < min(len(p), len(cached)) and p[common] == cached[common]:
            common += 1
        out.append(min(common // bs, len(cached) // bs, (len(p) - 1) // bs) * bs)
    return tuple(out)


def oracle_q4() -> list[int]:
    # Free queue as a plain list: pop from the front; a finished request's blocks in reverse,
    # unhashed (partial) ones prepended, hashed (full) ones appended.
    bs = ch02.Q4_BLOCK_SIZE
    queue = list(range(ch02.Q4_NUM_BLOCKS))
    tables = {}
    for rid, prompt in ch02.Q4_PROMPTS.items():
        n = -(-len(prompt) // bs)
        tables[rid] = [(queue.pop(0), (i + 1) * bs <= len(prompt)) for i in range(n)]
    for rid in ch02.Q4_PROMPTS:
        freed = list(reversed(tables[rid]))
        queue = [b for b, full in freed if not full] + queue + [b for b, full in freed if full]
    return queue[: ch02.Q4_NEW_BLOCKS]


def oracle_q5() -> int:
    bs = ch02.Q5_BLOCK_SIZE
    return sum(-(-n // bs) * bs - n for n in ch02.Q5_LENGTHS)


CASES = [
    (ch02.q1, oracle_q1, ch02.Q1_SOLUTION),
    (ch02.q2, oracle_q2, ch02.Q2_SOLUTION),
    (ch02.q3, oracle_q3, ch02.Q3_SOLUTION),
    (ch02.q4, oracle_q4, ch02.Q4_SOLUTION),
    (ch02.q5, oracle_q5, ch02.Q5_SOLUTION),
]
IDS = [q.name.split()[0] for q, _, _ in CASES]


def wrong_answers(right):
    """Near misses of the right answer's type, and answers of the wrong type."""
    if isinstance(right, int):
        return [right + 1, right - 1, float(right), str(right), None, [right]]
    if isinstance(right, tuple):
        bumped = [right[:i] + (right[i] + 1,) + right[i + 1 :] for i in range(len(right))]
        return bumped + [right[:-1], right + (0,), tuple(float(x) for x in right), None]
    return [right[:-1], right + [0], list(reversed(right)), [b + 1 for b in right], "x", None]


@pytest.mark.parametrize("exercise, oracle, solution", CASES, ids=IDS)
def test_right_answer_passes(exercise, oracle, solution, capsys):
    assert exercise.is_correct(oracle())
    exercise.check(oracle())
    assert capsys.readouterr().out == f"[{exercise.name}] correct!\n"


@pytest.mark.parametrize("exercise, oracle, solution", CASES, ids=IDS)
def test_wrong_answers_fail(exercise, oracle, solution, capsys):
    for wrong in wrong_answers(oracle()):
        assert not exercise.is_correct(wrong), wrong
        exercise.check(wrong)
        assert capsys.readouterr().out.startswith(f"[{exercise.name}] incorrect: "), wrong


# Typical mistakes, and a word of the reason the learner must see.
DIAGNOSED = [
    (ch02.q1, 65536, "K and V"),  # only K
    (ch02.q1, 524288, "GQA"),  # 32 query heads instead of 8 KV heads
    (ch02.q1, 262144, "2 bytes"),  # 4-byte elements
    (ch02.q2, 10, "position"),
    (ch02.q2, 9, "block id"),
    (ch02.q2, 36, "offset"),
    (ch02.q3, (10, 12, 12), "prompt(s) 1, 2"),
    (ch02.q4, [2, 5, 4], "order"),
]


@pytest.mark.parametrize("exercise, answer, reason", DIAGNOSED)
def test_typical_mistakes_get_a_reason(exercise, answer, reason):
    assert reason in exercise.problem(answer)


@pytest.mark.parametrize("exercise, oracle, solution", CASES, ids=IDS)
def test_untouched_stub_is_not_attempted(exercise, oracle, solution, capsys):
    assert not exercise.is_correct(...)
    exercise.check(...)
    assert capsys.readouterr().out.startswith(f"[{exercise.name}] not attempted")


@pytest.mark.parametrize("exercise, oracle, solution", CASES, ids=IDS)
def test_printed_solution_computes_the_answer(exercise, oracle, solution, capsys):
    exercise.solution()
    assert capsys.readouterr().out == f"[{exercise.name}] solution:\n{solution}\n"
    namespace: dict = {}
    exec(solution, namespace)  # self-contained code that sets `answer`
    assert namespace["answer"] == oracle()
    assert exercise.is_correct(namespace["answer"])


@pytest.mark.parametrize("exercise, oracle, solution", CASES, ids=IDS)
def test_hint_prints(exercise, oracle, solution, capsys):
    exercise.hint()
    assert capsys.readouterr().out.startswith(f"[{exercise.name}] hint: ")
