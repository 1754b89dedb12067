"""Exercises of chapter 04 (paged attention).

Every expected answer is computed here with the real ``minirad`` code (:class:`ForwardBatch`,
:class:`KVCacheManager`, :class:`AttentionMetadata`, :func:`paged_attention`), from the scenario
constants below, which the notebook's questions quote. Each ``Qn_SOLUTION`` is runnable code that
sets ``answer``; the tests run it and check it with ``qn``.
"""

from __future__ import annotations

import torch

from minirad.exercises import Exercise, WrongAnswer, is_int, is_int_list, wrong_type
from minirad.kvcache.kv_cache_manager import KVCacheManager
from minirad.kvcache.kv_pool import slot_mapping
from minirad.models import ForwardBatch
from minirad.models.paged_attention import AttentionMetadata, paged_attention

__all__ = [
    "Q1_BLOCK_SIZE",
    "Q1_BLOCK_TABLES",
    "Q1_QUERY_LENS",
    "Q1_SEQ_LENS",
    "Q2_BLOCK_SIZE",
    "Q2_DECODE_STEPS",
    "Q2_PROMPT_LEN",
    "Q3_CACHED",
    "Q3_CHUNK",
    "Q4_NUM_HEADS",
    "Q4_NUM_KV_HEADS",
    "Q5_SEQ_LENS",
    "q1",
    "q2",
    "q3",
    "q4",
    "q5",
]

# q1: one step of three sequences: A prefills a chunk of 4 tokens, B and C decode one each.
Q1_BLOCK_SIZE = 4
Q1_BLOCK_TABLES = {"A": [6, 2, 9], "B": [4, 0], "C": [7, 1, 3, 5]}
Q1_SEQ_LENS = {"A": 10, "B": 6, "C": 13}  # context tokens after the step
Q1_QUERY_LENS = {"A": 4, "B": 1, "C": 1}  # new tokens in the step

# q2: a prompt is prefilled, then decoded one token per step.
Q2_BLOCK_SIZE = 4
Q2_PROMPT_LEN = 13
Q2_DECODE_STEPS = 8

# q3: a chunk of new tokens after a cached prefix.
Q3_CACHED = 3
Q3_CHUNK = 3

# q4: Qwen2-0.5B's attention heads.
Q4_NUM_HEADS = 14
Q4_NUM_KV_HEADS = 2

# q5: the context lengths of a batch of decodes.
Q5_SEQ_LENS = [5, 40, 7, 12]


def _q1_batch() -> ForwardBatch:
    names = list(Q1_BLOCK_TABLES)
    kv_slots = [
        slot_mapping(Q1_BLOCK_TABLES[n], range(Q1_SEQ_LENS[n]), Q1_BLOCK_SIZE) for n in names
    ]
    token_ids = [[0] * Q1_QUERY_LENS[n] for n in names]  # the ids do not matter here
    return ForwardBatch.build(token_ids, kv_slots)


def _check_q1(answer: object) -> str | None:
    batch = _q1_batch()
    expected = batch.slot_mapping.tolist()
    if not is_int_list(answer):
        return wrong_type("a list of ints (slots)", answer)
    if list(answer) == expected:
        return None
    if list(answer) == batch.positions.tolist():
        return "those are the positions; map each through its sequence's block table"
    if len(answer) != len(expected):
        return f"the step writes {len(expected)} tokens: A's whole chunk, then B's and C's token"
    one_late = [  # each new token taken one position too far
        slot
        for n, table in Q1_BLOCK_TABLES.items()
        for slot in slot_mapping(
            table, range(Q1_SEQ_LENS[n] - Q1_QUERY_LENS[n] + 1, Q1_SEQ_LENS[n] + 1), Q1_BLOCK_SIZE
        )
    ]
    if list(answer) == one_late:
        return "positions start at 0: the last new token sits at position seq_len - 1"
    return f"{list(answer)} is not where the new tokens' K/V go"


def _blocks_used() -> tuple[int, int]:
    mgr = KVCacheManager(num_blocks=64, block_size=Q2_BLOCK_SIZE, enable_caching=False)
    tokens = list(range(Q2_PROMPT_LEN))
    mgr.allocate_slots("r", tokens, len(tokens))
    after_prefill = len(mgr.get_block_ids("r"))
    for _ in range(Q2_DECODE_STEPS):  # each step feeds one token and writes its K/V
        tokens.append(0)
        mgr.allocate_slots("r", tokens, 1)
    return after_prefill, len(mgr.get_block_ids("r"))


def _check_q2(answer: object) -> str | None:
    expected = _blocks_used()
    if not is_int_list(answer) or len(answer) != 2:
        return wrong_type(f"two ints (after prefill, after {Q2_DECODE_STEPS} decode steps)", answer)
    if tuple(answer) == expected:
        return None
    if answer[0] == Q2_PROMPT_LEN // Q2_BLOCK_SIZE:
        return "round up: a partly filled last block is still a whole block"
    if answer[0] == expected[0]:
        total = Q2_PROMPT_LEN + Q2_DECODE_STEPS
        return f"after the decodes {total} tokens have K/V: how many blocks of {Q2_BLOCK_SIZE}?"
    return f"{tuple(answer)} is not it; blocks = ceil(tokens with K/V / block_size)"


def _chunk_mask() -> torch.Tensor:
    seq_len = Q3_CACHED + Q3_CHUNK
    meta = AttentionMetadata.build(
        slot_mapping=torch.arange(Q3_CACHED, seq_len),
        kv_slots=torch.arange(seq_len)[None, :],
        seq_lens=torch.tensor([seq_len]),
        query_lens=torch.tensor([Q3_CHUNK]),
        max_query_len=Q3_CHUNK,
    )
    return meta.mask[0, 0]  # [Q3_CHUNK, seq_len]


def _as_bool_matrix(answer: object) -> torch.Tensor:
    """``answer`` as a bool tensor; :class:`WrongAnswer` unless it holds only bools or 0/1
    ints."""
    t = torch.as_tensor(answer)
    if t.dtype != torch.bool:
        if t.dtype.is_floating_point or t.dtype.is_complex or not ((t == 0) | (t == 1)).all():
            raise WrongAnswer(wrong_type("True/False (or 1/0) entries", answer))
        t = t.bool()
    return t


def _check_q3(answer: object) -> str | None:
    expected = _chunk_mask()
    shape = tuple(expected.shape)
    if answer is None or isinstance(answer, str | bytes):
        return wrong_type(
            f"a {list(shape)} matrix of True/False (a list of lists, or a tensor)", answer
        )
    mask = _as_bool_matrix(answer)
    if tuple(mask.shape) != shape:
        return (
            f"shape {tuple(mask.shape)}: one row per new token ({shape[0]}), one column per "
            f"context token ({shape[1]})"
        )
    if torch.equal(mask, expected):
        return None
    if torch.equal(mask, torch.ones(shape, dtype=torch.bool).tril()):
        return f"query i sits at position {Q3_CACHED} + i: it sees the whole cached prefix"
    if torch.equal(mask, torch.ones(shape, dtype=torch.bool).tril(Q3_CACHED - 1)):
        return "a token also attends to itself (key position <= query position)"
    if mask.all():
        return "the chunk's tokens must not see the tokens after them"
    return "not the mask; query i may look at keys 0 .. (cached + i)"


def _kv_head_of_each_query_head() -> list[int]:
    # One context token whose V in KV head j is the constant j: query head h then outputs the
    # index of the KV head it reads (its softmax weights sum to 1).
    H, KV, D = Q4_NUM_HEADS, Q4_NUM_KV_HEADS, 4
    q, k = torch.ones(1, H, D), torch.ones(1, KV, D)
    v = torch.arange(KV, dtype=torch.float32)[None, :, None].expand(1, KV, D)
    meta = AttentionMetadata.build(
        torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]), torch.tensor([1]), 1
    )
    k_cache, v_cache = torch.zeros(1, KV, D), torch.zeros(1, KV, D)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=D**-0.5)  # [1, H, D]
    return out[0, :, 0].round().long().tolist()


def _check_q4(answer: object) -> str | None:
    expected = _kv_head_of_each_query_head()
    if not is_int_list(answer) or len(answer) != len(expected):
        return wrong_type(
            f"{len(expected)} ints, the KV head of query heads 0 .. {len(expected) - 1}", answer
        )
    if list(answer) == expected:
        return None
    if list(answer) == [h % Q4_NUM_KV_HEADS for h in range(Q4_NUM_HEADS)]:
        return "groups are consecutive query heads (repeat_interleave), not every other head"
    return f"{list(answer)} is not it; each KV head serves a group of consecutive query heads"


def _padding_rows() -> int:
    batch = ForwardBatch.build([[0]] * len(Q5_SEQ_LENS), [list(range(n)) for n in Q5_SEQ_LENS])
    return batch.kv_slots.numel() - int(batch.seq_lens.sum())


def _check_q5(answer: object) -> str | None:
    expected = _padding_rows()
    if not is_int(answer):
        return wrong_type("one int (gathered rows)", answer)
    if answer == expected:
        return None
    if answer == len(Q5_SEQ_LENS) * max(Q5_SEQ_LENS):
        return "that counts every gathered row; subtract the real context tokens"
    if answer == sum(Q5_SEQ_LENS):
        return "that counts the real context tokens; padding is what the gather adds to them"
    return f"{answer!r} is not it; each row is padded to the longest context"


Q1_SOLUTION = """\
block_size = 4
block_tables = {"A": [6, 2, 9], "B": [4, 0], "C": [7, 1, 3, 5]}
seq_lens = {"A": 10, "B": 6, "C": 13}
query_lens = {"A": 4, "B": 1, "C": 1}
answer = []
for name, table in block_tables.items():
    for pos in range(seq_lens[name] - query_lens[name], seq_lens[name]):  # the new tokens
        answer.append(table[pos // block_size] * block_size + pos % block_size)
# A: positions 6..9 -> 10, 11, 36, 37; B: position 5 -> 1; C: position 12 -> 20"""

Q2_SOLUTION = """\
block_size, prompt_len, decode_steps = 4, 13, 8
answer = (-(-prompt_len // block_size), -(-(prompt_len + decode_steps) // block_size))  # (4, 6)"""

Q3_SOLUTION = """\
import torch

cached, chunk = 3, 3
q_pos = torch.arange(cached, cached + chunk)  # positions of the new tokens
answer = torch.arange(cached + chunk)[None, :] <= q_pos[:, None]  # [3, 6]"""

Q4_SOLUTION = """\
num_heads, num_kv_heads = 14, 2
group = num_heads // num_kv_heads  # 7 query heads per KV head
answer = [h // group for h in range(num_heads)]  # [0]*7 + [1]*7"""

Q5_SOLUTION = """\
seq_lens = [5, 40, 7, 12]
answer = len(seq_lens) * max(seq_lens) - sum(seq_lens)  # 160 gathered rows, 64 real"""

q1 = Exercise(
    "q1 slot_mapping of a step",
    _check_q1,
    "Only the new tokens are written: positions seq_len - query_len .. seq_len - 1 of each "
    "sequence, A's first, each mapped through its own block table.",
    Q1_SOLUTION,
)
q2 = Exercise(
    "q2 blocks a sequence needs",
    _check_q2,
    "Every token that went through the model has K/V: the prompt, then one more per decode "
    "step. Blocks = ceil(tokens / block_size).",
    Q2_SOLUTION,
)
q3 = Exercise(
    "q3 the mask of a chunk",
    _check_q3,
    "New token i sits at position cached + i and may look at every key at or before it.",
    Q3_SOLUTION,
)
q4 = Exercise(
    "q4 which KV head a query head reads",
    _check_q4,
    "num_heads // num_kv_heads consecutive query heads share one KV head.",
    Q4_SOLUTION,
)
q5 = Exercise(
    "q5 padding in the gathered batch",
    _check_q5,
    "The gather reads a [batch, longest context] block of rows; the real ones are sum(seq_lens).",
    Q5_SOLUTION,
)
