"""Exercises of chapter 02 (the KV block pool).

Every expected answer is computed here with the real ``minirad`` classes (:class:`KVCache`,
:func:`slot_mapping`, :class:`KVCacheManager`, :class:`TokenToKVPoolAllocator`), from the
scenario constants below, which the notebook's questions quote. Each ``Qn_SOLUTION`` is runnable
code that sets ``answer``; the tests run it and check it with ``qn``.
"""

from __future__ import annotations

import torch

from minirad.exercises import Exercise, is_int, is_int_list, wrong_type
from minirad.kvcache.kv_cache_manager import KVCacheManager
from minirad.kvcache.kv_pool import KVCache, TokenToKVPoolAllocator, slot_mapping

__all__ = [
    "Q1_CONFIG",
    "Q2_BLOCK_SIZE",
    "Q2_BLOCK_TABLE",
    "Q2_POSITION",
    "Q3_BLOCK_SIZE",
    "Q3_CACHED",
    "Q3_PROMPTS",
    "Q4_BLOCK_SIZE",
    "Q4_NEW_BLOCKS",
    "Q4_NUM_BLOCKS",
    "Q4_PROMPTS",
    "Q5_BLOCK_SIZE",
    "Q5_LENGTHS",
    "q1",
    "q2",
    "q3",
    "q4",
    "q5",
]

# q1: the attention dimensions of Llama-3-8B, as its config.json names them.
Q1_CONFIG = {
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "torch_dtype": "bfloat16",
}

# q2: one sequence's block table, and a token position in it.
Q2_BLOCK_TABLE = [7, 2, 9]
Q2_BLOCK_SIZE = 4
Q2_POSITION = 10

# q3: block_size 4; one request ran and finished, then three new prompts are looked up.
Q3_BLOCK_SIZE = 4
Q3_CACHED = list(range(1, 13))
Q3_PROMPTS = (
    list(range(1, 11)) + [50, 51, 52, 53],
    list(range(1, 13)),
    list(range(1, 14)),
)

# q4: block_size 4, 6 blocks; R1 and R2 are allocated in this order, then freed in this order.
Q4_NUM_BLOCKS = 6
Q4_BLOCK_SIZE = 4
Q4_PROMPTS = {"R1": list(range(100, 112)), "R2": list(range(200, 205))}
Q4_NEW_BLOCKS = 3

# q5: request lengths (tokens) and a block size.
Q5_LENGTHS = [5, 17, 33, 64]
Q5_BLOCK_SIZE = 16


def _config_bytes_per_token(cfg: dict, heads_key: str = "num_key_value_heads") -> int:
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = KVCache(
        num_layers=cfg["num_hidden_layers"],
        num_blocks=1,
        block_size=1,
        num_kv_heads=cfg[heads_key],
        head_dim=head_dim,
        dtype=getattr(torch, cfg["torch_dtype"]),
        device="meta",  # shape and dtype only: no memory is allocated
    )
    return kv.bytes_per_token


def _check_q1(answer: object) -> str | None:
    expected = _config_bytes_per_token(Q1_CONFIG)
    if not is_int(answer):
        return wrong_type("one int (bytes)", answer)
    if answer == expected:
        return None
    if answer == expected // 2:
        return "that counts only K (or only V); the cache holds K and V"
    if answer == _config_bytes_per_token(Q1_CONFIG, "num_attention_heads"):
        return "GQA: only num_key_value_heads heads are cached, not num_attention_heads"
    if answer == expected * 2:
        return "bfloat16 takes 2 bytes per element, not 4"
    return f"{answer!r} bytes is not it; multiply K and V, layers, KV heads, head_dim, bytes"


def _check_q2(answer: object) -> str | None:
    expected = slot_mapping(Q2_BLOCK_TABLE, [Q2_POSITION], Q2_BLOCK_SIZE)[0]
    if not is_int(answer):
        return wrong_type("one int (a slot id)", answer)
    if answer == expected:
        return None
    if answer == Q2_POSITION:
        return "that is the position; the slot depends on the block table"
    block = Q2_BLOCK_TABLE[Q2_POSITION // Q2_BLOCK_SIZE]
    if answer == block:
        return "that is the block id; a slot counts token slots, not blocks"
    if answer == block * Q2_BLOCK_SIZE:
        return "that is the first slot of the block; add the offset inside the block"
    return f"slot {answer!r} is not where position {Q2_POSITION} lives"


def _block_hits() -> tuple[int, ...]:
    mgr = KVCacheManager(num_blocks=16, block_size=Q3_BLOCK_SIZE)
    mgr.allocate_slots("cached", Q3_CACHED, len(Q3_CACHED))
    mgr.free("cached")
    return tuple(mgr.get_computed_blocks(p)[1] for p in Q3_PROMPTS)


def _check_q3(answer: object) -> str | None:
    expected = _block_hits()
    if not is_int_list(answer) or len(answer) != len(expected):
        return wrong_type(f"{len(expected)} ints, one per prompt, e.g. (0, 0, 0)", answer)
    wrong = [i for i, (a, e) in enumerate(zip(answer, expected, strict=True)) if a != e]
    if not wrong:
        return None
    return f"prompt(s) {', '.join(str(i + 1) for i in wrong)} wrong: whole blocks, last token"


def _blocks_handed_out() -> list[int]:
    mgr = KVCacheManager(num_blocks=Q4_NUM_BLOCKS, block_size=Q4_BLOCK_SIZE)
    for rid, prompt in Q4_PROMPTS.items():
        mgr.allocate_slots(rid, prompt, len(prompt))
    for rid in Q4_PROMPTS:
        mgr.free(rid)
    return [b.block_id for b in mgr.block_pool.get_new_blocks(Q4_NEW_BLOCKS)]


def _check_q4(answer: object) -> str | None:
    expected = _blocks_handed_out()
    if not is_int_list(answer):
        return wrong_type("a list of block ids", answer)
    if list(answer) == expected:
        return None
    if sorted(answer) == sorted(expected):
        return "right blocks, wrong order"
    return f"{list(answer)} is not what the front of the free queue holds"


def _wasted_slots() -> int:
    bs = Q5_BLOCK_SIZE
    alloc = TokenToKVPoolAllocator(size=bs * sum(-(-n // bs) for n in Q5_LENGTHS), page_size=bs)
    for n in Q5_LENGTHS:
        alloc.alloc(n)
    return (alloc.size - alloc.available_size()) - sum(Q5_LENGTHS)


def _check_q5(answer: object) -> str | None:
    expected = _wasted_slots()
    if not is_int(answer):
        return wrong_type("one int (slots)", answer)
    if answer == expected:
        return None
    return f"{answer!r} slots is not it; count the empty slots of each request's last block"


Q1_SOLUTION = """\
import torch
from minirad import KVCache

head_dim = 4096 // 32
kv = KVCache(num_layers=32, num_blocks=1, block_size=1, num_kv_heads=8, head_dim=head_dim,
             dtype=torch.bfloat16, device="meta")
answer = kv.bytes_per_token  # 2 (K, V) * 32 layers * 8 heads * 128 * 2 bytes = 128 KiB"""

Q2_SOLUTION = """\
block_table, block_size, pos = [7, 2, 9], 4, 10
answer = block_table[pos // block_size] * block_size + pos % block_size  # 9 * 4 + 2"""

Q3_SOLUTION = """\
from minirad import KVCacheManager

mgr = KVCacheManager(num_blocks=16, block_size=4)
mgr.allocate_slots("cached", list(range(1, 13)), 12)  # blocks [1-4] [5-8] [9-12], all hashed
mgr.free("cached")
prompts = [list(range(1, 11)) + [50, 51, 52, 53], list(range(1, 13)), list(range(1, 14))]
answer = tuple(mgr.get_computed_blocks(p)[1] for p in prompts)
# (8, 8, 12): block [9-12] differs in prompt 1; prompt 2 must recompute its last token, and
# blocks are all or nothing; prompt 3's last token is 13, so all three blocks hit."""

Q4_SOLUTION = """\
# R1 (12 tokens) gets blocks 0, 1, 2 (all full, hashed); R2 (5 tokens) gets 3 (hashed), 4 (not).
# free(R1): hashed blocks go to the back, tail first  -> [5, 2, 1, 0]
# free(R2): unhashed 4 to the front, hashed 3 to the back -> [4, 5, 2, 1, 0, 3]
answer = [4, 5, 2]  # block 2 (R1's tail) is the first cached block to lose its hash"""

Q5_SOLUTION = """\
lengths, block_size = [5, 17, 33, 64], 16
answer = sum(-(-n // block_size) * block_size - n for n in lengths)  # 11 + 15 + 15 + 0"""

q1 = Exercise(
    "q1 bytes per token",
    _check_q1,
    "head_dim = hidden_size // num_attention_heads; then count K and V, every layer, every "
    "KV head, and 2 bytes per bfloat16 element.",
    Q1_SOLUTION,
)
q2 = Exercise(
    "q2 slot of a position",
    _check_q2,
    "Which block of the table holds the position (pos // block_size), and at which offset?",
    Q2_SOLUTION,
)
q3 = Exercise(
    "q3 tokens reused by block hashing",
    _check_q3,
    "Only whole blocks hit, at most (len(prompt) - 1) // block_size of them.",
    Q3_SOLUTION,
)
q4 = Exercise(
    "q4 next blocks from the free queue",
    _check_q4,
    "Blocks without a hash go to the front of the queue; hashed blocks go to the back, a "
    "request's last block first.",
    Q4_SOLUTION,
)
q5 = Exercise(
    "q5 internal fragmentation",
    _check_q5,
    "Each request gets ceil(n / block_size) blocks; the unused part of its last block is wasted.",
    Q5_SOLUTION,
)
