"""Exercises of chapter 00 (the tour). Answers are computed by replaying the tour's requests."""

from __future__ import annotations

from minirad.exercises import Exercise, is_int, is_int_list, wrong_type
from minirad.kvcache.radix_cache import RadixCache, Req
from minirad.models.tokenizer import load_tokenizer

__all__ = ["Q1_SOLUTION", "Q2_SOLUTION", "q1", "q2"]

_SYSTEM = "You are a helpful assistant. "
_CHATS = (
    _SYSTEM + "User: Hello! Assistant: Hi! How can I help you today?",
    _SYSTEM + "User: What can you do? Assistant: I can answer questions.",
)
_THIRD = _SYSTEM + "User: Hello! Assistant: Bye"


def _tour_cache() -> tuple[RadixCache, list[int]]:
    """The tour's cache after both chats, and how many tokens each chat reused."""
    tok = load_tokenizer()
    cache = RadixCache()
    reused = []
    for i, text in enumerate(_CHATS):
        ids = tok.encode(text)
        req = Req(f"chat-{i + 1}", ids)
        reused.append(len(cache.match_prefix_for_req(req)))
        req.kv_indices += [10_000 * (i + 1) + j for j in range(len(ids) - reused[-1])]
        cache.cache_finished_req(req)
    return cache, reused


def _check_q1(answer: object) -> str | None:
    if not is_int(answer):
        return wrong_type("one int (tokens)", answer)
    expected = _tour_cache()[1][1]
    if answer != expected:
        return (
            f"{answer!r} is not what chat-2's match returned; look at the line printed for chat-2"
        )
    return None


def _check_q2(answer: object) -> str | None:
    if not is_int_list(answer):
        return wrong_type("a list of node ids (ints)", answer)
    cache, _ = _tour_cache()
    _, node = cache.match_prefix(load_tokenizer().encode(_THIRD))
    path = []
    while node is not cache.root_node:
        path.append(node.id)
        node = node.parent
    expected = path[::-1]
    if list(answer) != expected:
        return f"the match walks {len(expected)} node(s); {list(answer)!r} is not that path"
    return None


Q1_SOLUTION = (
    "# chat-2 reused the tokens it shares with chat-1 (the number serve() printed):\n"
    "answer = next(i for i, (a, b) in enumerate(zip(ids_1, ids_2)) if a != b)"
)
Q2_SOLUTION = (
    "# The system-prompt node, then chat-1's node: the match splits it, and the prefix part\n"
    "# keeps the id.\n"
    'third = tok.encode(system + "User: Hello! Assistant: Bye")\n'
    "_, node = cache.match_prefix(third)\n"
    "answer = []\n"
    "while node is not cache.root_node:\n"
    "    answer.insert(0, node.id)\n"
    "    node = node.parent"
)


q1 = Exercise(
    "q1 tokens reused",
    _check_q1,
    hint="serve() prints, for each request, how many prompt tokens came from the cache.",
    solution=Q1_SOLUTION,
)
q2 = Exercise(
    "q2 the matched path",
    _check_q2,
    hint="The third chat shares the system prompt with both chats and 'User: Hello! Assistant:' "
    "with chat-1 only; where does it leave chat-1's edge?",
    solution=Q2_SOLUTION,
)
