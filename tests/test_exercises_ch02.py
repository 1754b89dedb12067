"""Chapter 02 exercises, held to the shared contract of ``exercise_contract.py``: the
oracle's answer passes, near misses fail, typical mistakes get their reason, the stub is
"not attempted", and the printed solution computes the answer.

The expected answers are recomputed here by oracles over plain ints and lists (no minirad
classes): the formulas and the free-queue rules the chapter states. A checker that drifts from
those rules, or a library change that breaks them, fails here.
"""

import torch
from exercise_contract import ExerciseContract

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


def allocated_slots_q5() -> int:
    bs = ch02.Q5_BLOCK_SIZE
    return sum(-(-n // bs) * bs for n in ch02.Q5_LENGTHS)


def oracle_q5() -> int:
    return allocated_slots_q5() - sum(ch02.Q5_LENGTHS)


CASES = [
    (ch02.q1, oracle_q1, ch02.Q1_SOLUTION),
    (ch02.q2, oracle_q2, ch02.Q2_SOLUTION),
    (ch02.q3, oracle_q3, ch02.Q3_SOLUTION),
    (ch02.q4, oracle_q4, ch02.Q4_SOLUTION),
    (ch02.q5, oracle_q5, ch02.Q5_SOLUTION),
]

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
    (ch02.q5, allocated_slots_q5(), "empty slots"),  # every slot of the blocks, used or not
]


class TestExerciseContract(ExerciseContract):
    chapter = ch02
    cases = CASES
    diagnosed = DIAGNOSED
