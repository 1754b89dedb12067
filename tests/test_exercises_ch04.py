"""Chapter 04 exercises, held to the shared contract of ``exercise_contract.py``: the
oracle's answer passes, near misses fail, typical mistakes get their reason, the stub is
"not attempted", and the printed solution computes the answer.

The expected answers are recomputed here by oracles over plain ints and lists (no minirad
classes): the formulas the chapter states. A checker that drifts from those formulas, or a
library change that breaks them, fails here.
"""

import torch
from exercise_contract import ExerciseContract

from minirad.exercises import ch04


def oracle_q1() -> list[int]:
    bs, out = ch04.Q1_BLOCK_SIZE, []
    for name, table in ch04.Q1_BLOCK_TABLES.items():
        seq_len, new = ch04.Q1_SEQ_LENS[name], ch04.Q1_QUERY_LENS[name]
        out += [table[p // bs] * bs + p % bs for p in range(seq_len - new, seq_len)]
    return out


def oracle_q2() -> tuple[int, int]:
    bs, n = ch04.Q2_BLOCK_SIZE, ch04.Q2_PROMPT_LEN
    return (n + bs - 1) // bs, (n + ch04.Q2_DECODE_STEPS + bs - 1) // bs


def oracle_q3() -> list[list[bool]]:
    cached, chunk = ch04.Q3_CACHED, ch04.Q3_CHUNK
    return [[key <= cached + i for key in range(cached + chunk)] for i in range(chunk)]


def oracle_q4() -> list[int]:
    group = ch04.Q4_NUM_HEADS // ch04.Q4_NUM_KV_HEADS
    return [h // group for h in range(ch04.Q4_NUM_HEADS)]


def oracle_q5() -> int:
    lens = ch04.Q5_SEQ_LENS
    return len(lens) * max(lens) - sum(lens)


CASES = [
    (ch04.q1, oracle_q1, ch04.Q1_SOLUTION),
    (ch04.q2, oracle_q2, ch04.Q2_SOLUTION),
    (ch04.q3, oracle_q3, ch04.Q3_SOLUTION),
    (ch04.q4, oracle_q4, ch04.Q4_SOLUTION),
    (ch04.q5, oracle_q5, ch04.Q5_SOLUTION),
]


def _positions_one_late() -> list[int]:
    bs, out = ch04.Q1_BLOCK_SIZE, []
    for name, table in ch04.Q1_BLOCK_TABLES.items():
        seq_len, new = ch04.Q1_SEQ_LENS[name], ch04.Q1_QUERY_LENS[name]
        out += [table[p // bs] * bs + p % bs for p in range(seq_len - new + 1, seq_len + 1)]
    return out


# Typical mistakes, and a word of the reason the learner must see.
DIAGNOSED = [
    (ch04.q1, [6, 7, 8, 9, 5, 12], "positions"),
    (ch04.q1, _positions_one_late(), "seq_len - 1"),
    (ch04.q1, [37, 1, 20], "writes 6 tokens"),
    (ch04.q2, (3, 5), "round up"),
    (ch04.q2, (4, 5), "21 tokens"),
    (ch04.q3, [[key <= i for key in range(6)] for i in range(3)], "whole cached prefix"),
    (ch04.q3, [[key < 3 + i for key in range(6)] for i in range(3)], "itself"),
    (ch04.q3, [[True] * 6] * 3, "must not see"),
    (ch04.q3, [[True] * 3] * 6, "one row per new token (3)"),
    (ch04.q4, [h % 2 for h in range(14)], "consecutive"),
    (ch04.q5, 160, "subtract"),
    (ch04.q5, 64, "real context tokens"),
]


class TestExerciseContract(ExerciseContract):
    chapter = ch04
    cases = CASES
    diagnosed = DIAGNOSED


def test_mask_accepts_tensors_and_ints():
    mask = oracle_q3()
    assert ch04.q3.is_correct(torch.tensor(mask))
    assert ch04.q3.is_correct([[int(x) for x in row] for row in mask])
    assert not ch04.q3.is_correct(torch.tensor(mask, dtype=torch.float32))
