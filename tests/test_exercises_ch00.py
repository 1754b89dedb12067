"""Chapter 00 exercises, held to the shared contract of ``exercise_contract.py``.

The oracles replay the tour on plain token lists: chat-2 reuses the longest common prefix of
the two chats, and the third chat's match walks the system-prompt node (id 1, the prefix of
chat-1's split edge keeps its id) and, when it shares more than that with chat-1, chat-1's
remaining edge (id 2, made by that split).
"""

from exercise_contract import ExerciseContract, common_len

from minirad import RadixCache, Req, TokenToKVPoolAllocator
from minirad.exercises import ch00
from minirad.models.tokenizer import load_tokenizer

TOK = load_tokenizer()
SYSTEM = "You are a helpful assistant. "
IDS_1 = TOK.encode(SYSTEM + "User: Hello! Assistant: Hi! How can I help you today?")
IDS_2 = TOK.encode(SYSTEM + "User: What can you do? Assistant: I can answer questions.")
THIRD = TOK.encode(SYSTEM + "User: Hello! Assistant: Bye")


def oracle_q1() -> int:
    return common_len(IDS_1, IDS_2)


def oracle_q2() -> list[int]:
    return [1, 2] if common_len(THIRD, IDS_1) > common_len(IDS_1, IDS_2) else [1]


def notebook_globals() -> dict:
    """What the tour has defined when the exercises come: the two chats served into a cache."""
    allocator = TokenToKVPoolAllocator(size=256)
    cache = RadixCache(token_to_kv_pool_allocator=allocator)
    for rid, ids in (("chat-1", IDS_1), ("chat-2", IDS_2)):
        req = Req(rid, ids)
        cached = len(cache.match_prefix_for_req(req))
        req.kv_indices += allocator.alloc(len(ids) - cached)
        cache.cache_finished_req(req)
    return {"tok": TOK, "system": SYSTEM, "ids_1": IDS_1, "ids_2": IDS_2, "cache": cache}


CASES = [
    (ch00.q1, oracle_q1, ch00.Q1_SOLUTION),
    (ch00.q2, oracle_q2, ch00.Q2_SOLUTION),
]

DIAGNOSED = [
    (ch00.q1, len(IDS_2), "chat-2's match"),  # every prompt token, not the reused ones
    (ch00.q1, float(oracle_q1()), "got float"),
    (ch00.q2, [1], "walks 2 node"),  # stopping at the system prompt
    (ch00.q2, [1, 3], "not that path"),  # chat-2's branch
    (ch00.q2, 12, "list of node ids"),
]


class TestExerciseContract(ExerciseContract):
    chapter = ch00
    cases = CASES
    diagnosed = DIAGNOSED
    solution_globals = notebook_globals  # fresh for every run: a solution may split the tree
