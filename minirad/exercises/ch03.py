"""Exercises of chapter 03 (eviction: locks, LRU, policies, the Figure 3 replay).

Each exercise describes a few :class:`~minirad.RadixCache` operations on small token ids (or
the Figure 3 scenario); the learner predicts the outcome. Expected answers are computed here by
running those operations on a real ``RadixCache``, so they follow the library. Every
``Qn_SOLUTION`` is runnable code that sets ``answer``; the tests run it and check it with
``qn``.

Usage in the notebook::

    from minirad.exercises.ch03 import q1
    answer = ...
    q1.check(answer)
"""

from __future__ import annotations

import functools

from minirad.events import EventRecorder, EvictEvent
from minirad.exercises import Exercise, WrongAnswer, is_int, is_int_list, wrong_type
from minirad.kvcache.radix_cache import RadixCache

__all__ = [
    "Q1_INSERTS",
    "Q1_LOCKED_QUERY",
    "Q2_EVICT",
    "Q2_INSERTS",
    "Q2_QUERY",
    "Q3_EVICT",
    "Q3_INSERTS",
    "Q3_QUERY",
    "Q4_INSERTS",
    "Q4_QUERIES",
    "q1",
    "q2",
    "q3",
    "q4",
    "q5",
]


def _cache(inserts: list[list[int]], policy: str = "lru") -> RadixCache:
    """A cache holding ``inserts`` (in order), each with its own fresh KV slots."""
    cache = RadixCache(eviction_policy=policy)
    for i, key in enumerate(inserts):
        cache.insert(key, list(range(100 * i, 100 * i + len(key))))
    return cache


def _int_pair(answer: object, names: tuple[str, str]) -> tuple[int, int]:
    if not isinstance(answer, tuple | list) or len(answer) != 2 or not all(map(is_int, answer)):
        raise WrongAnswer(wrong_type(f"a pair of ints ({names[0]}, {names[1]})", answer))
    return answer[0], answer[1]


def _key(key: object) -> list[int]:
    # Token ids are ints: `==` would take 4.0 (or True) for a token id.
    if not is_int_list(key):
        raise WrongAnswer(wrong_type("a key: a list of int token ids, e.g. [1, 2]", key))
    return list(key)


def _keys(answer: object) -> list[list[int]]:
    if not isinstance(answer, list | tuple):
        raise WrongAnswer(wrong_type("a list of keys, e.g. [[1, 2], [3]]", answer))
    return [_key(k) for k in answer]


# q1 -------------------------------------------------------------------------------------------
Q1_INSERTS = [[1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9]]
Q1_LOCKED_QUERY = [1, 2, 5, 6, 10]  # a request matches this prompt and locks its prefix


def q1_expected() -> tuple[int, int]:
    """``(evictable_size(), protected_size())`` once the request holds its lock."""
    cache = _cache(Q1_INSERTS)
    cache.inc_lock_ref(cache.match_prefix(Q1_LOCKED_QUERY).last_node)
    return cache.evictable_size(), cache.protected_size()


def _check_q1(answer: object) -> str | None:
    evictable, protected = _int_pair(answer, ("evictable", "protected"))
    exp_evictable, exp_protected = q1_expected()
    if (evictable, protected) == (exp_evictable, exp_protected):
        return None
    if (evictable, protected) == (exp_protected, exp_evictable):
        return "swapped: the locked path is the protected part"
    if protected == 2:
        return "inc_lock_ref locks the whole path up to the root, not only the last node"
    return f"({evictable}, {protected}) tokens: count the locked path and everything else"


Q1_SOLUTION = """\
from minirad import RadixCache
from minirad.exercises.ch03 import Q1_INSERTS, Q1_LOCKED_QUERY

# The tree: [1, 2] -> [3, 4], [1, 2] -> [5, 6], and [7, 8, 9]. The query matches
# [1, 2] + [5, 6]; locking [5, 6] also locks its parent [1, 2]: 4 tokens protected.
cache = RadixCache()
for i, key in enumerate(Q1_INSERTS):
    cache.insert(key, list(range(100 * i, 100 * i + len(key))))
cache.inc_lock_ref(cache.match_prefix(Q1_LOCKED_QUERY).last_node)
answer = (cache.evictable_size(), cache.protected_size())"""

q1 = Exercise(
    "q1 evictable and protected tokens",
    _check_q1,
    hint="Draw the tree. inc_lock_ref walks from the matched node up to the root; every node "
    "it passes is protected, everything else is evictable.",
    solution=Q1_SOLUTION,
)


# q2 -------------------------------------------------------------------------------------------
Q2_INSERTS = [[1, 2, 3], [4, 5], [6, 7, 8]]
Q2_QUERY = [1, 2, 3]  # matched after the inserts
Q2_EVICT = 4  # then evict(4)


def _evicted_keys(cache: RadixCache, num_tokens: int) -> list[list[int]]:
    """Keys of the leaves ``evict(num_tokens)`` removes, in order (read from its events)."""
    key_of = {}
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        key_of[node.id] = list(node.key)
        stack.extend(node.children.values())
    recorder = EventRecorder(cache.bus)
    cache.evict(num_tokens)
    recorder.close()
    return [key_of[e.node_id] for e in recorder.events if isinstance(e, EvictEvent)]


def q2_expected() -> list[list[int]]:
    cache = _cache(Q2_INSERTS)
    cache.match_prefix(Q2_QUERY)
    return _evicted_keys(cache, Q2_EVICT)


def _check_q2(answer: object) -> str | None:
    keys, expected = _keys(answer), q2_expected()
    if keys == expected:
        return None
    if sorted(keys) == sorted(expected):
        return "right leaves, wrong order: least recently used goes first"
    if len(keys) < len(expected):
        return f"evict({Q2_EVICT}) frees whole leaves until at least {Q2_EVICT} tokens are free"
    return f"{keys} is not it: order the leaves by last access (the match touched one of them)"


Q2_SOLUTION = """\
# Access times: [1, 2, 3] was matched last; [4, 5] is the oldest, then [6, 7, 8].
# [4, 5] frees 2 tokens (< 4), so [6, 7, 8] goes too.
answer = [[4, 5], [6, 7, 8]]"""

q2 = Exercise(
    "q2 LRU eviction order",
    _check_q2,
    hint="Every insert and match stamps the nodes it walks with the current logical time. "
    "evict() pops leaves oldest-first until enough tokens are free.",
    solution=Q2_SOLUTION,
)


# q3 -------------------------------------------------------------------------------------------
Q3_INSERTS = [[1, 2, 3, 4], [1, 2, 5, 6], [9]]
Q3_QUERY = [1, 2, 5, 6]  # matched after the inserts
Q3_EVICT = 6  # then evict(6)


def q3_expected() -> tuple[int, int]:
    """``(tokens freed by evict(Q3_EVICT), nodes left besides the root)``."""
    cache = _cache(Q3_INSERTS)
    cache.match_prefix(Q3_QUERY)
    freed = len(cache.evict(Q3_EVICT))
    stack, left = list(cache.root_node.children.values()), 0
    while stack:
        left += 1
        stack.extend(stack.pop().children.values())
    return freed, left


def _check_q3(answer: object) -> str | None:
    freed, left = _int_pair(answer, ("tokens freed", "nodes left"))
    exp_freed, exp_left = q3_expected()
    if (freed, left) == (exp_freed, exp_left):
        return None
    if freed == Q3_EVICT:
        return "evict() removes whole leaves, so it can free more than it was asked for"
    if freed < exp_freed:
        return "once its children are gone, [1, 2] is a leaf too (cascading eviction)"
    return f"({freed}, {left}) is not it: list the leaves by last access and pop them"


Q3_SOLUTION = """\
# Leaves by last access: [3, 4] (split off at the second insert), [9], [5, 6] (matched).
# They free 2 + 1 + 2 = 5 < 6 tokens; [1, 2] has become a leaf and goes too: 7 tokens.
answer = (7, 0)"""

q3 = Exercise(
    "q3 cascading eviction",
    _check_q3,
    hint="A parent whose last child is evicted becomes a leaf, and can be evicted in the same "
    "call. Leaves go whole.",
    solution=Q3_SOLUTION,
)


# q4 -------------------------------------------------------------------------------------------
Q4_INSERTS = [[1, 2], [3, 4], [5, 6]]
Q4_QUERIES = [[5, 6], [5, 6], [1, 2], [1, 2], [3, 4]]  # matched in this order after the inserts
POLICY_NAMES = ("lru", "lfu", "fifo")


def q4_expected() -> dict[str, list[int]]:
    """For each policy, the key of the first leaf ``evict(1)`` removes."""
    out = {}
    for policy in POLICY_NAMES:
        cache = _cache(Q4_INSERTS, policy)
        for query in Q4_QUERIES:
            cache.match_prefix(query)
        (out[policy],) = _evicted_keys(cache, 1)
    return out


def _check_q4(answer: object) -> str | None:
    if not isinstance(answer, dict) or set(answer) != set(POLICY_NAMES):
        return wrong_type('a dict {"lru": key, "lfu": key, "fifo": key}', answer)
    expected = q4_expected()
    wrong = [p for p in POLICY_NAMES if _key(answer[p]) != expected[p]]
    if not wrong:
        return None
    return (
        f"wrong for {', '.join(wrong)}: recall each policy's sort key (minirad/kvcache/eviction.py)"
    )


Q4_SOLUTION = """\
# lru : oldest last access  -> [5, 6] (last matched before [1, 2] and [3, 4])
# lfu : fewest hits         -> [3, 4] (1 hit; the others have 2)
# fifo: oldest insertion    -> [1, 2]
answer = {"lru": [5, 6], "lfu": [3, 4], "fifo": [1, 2]}"""

q4 = Exercise(
    "q4 three policies, three victims",
    _check_q4,
    hint="lru sorts leaves by last_access_time, lfu by (hit_count, last_access_time), fifo by "
    "creation_time; count the matches of each key.",
    solution=Q4_SOLUTION,
)


# q5 -------------------------------------------------------------------------------------------
@functools.cache
def q5_expected() -> list[str]:
    """Labels that step 9 of Figure 3 evicts under FIFO but not under LRU."""
    from minirad.course.scenario import ScenarioReplay

    lru, fifo = (ScenarioReplay(eviction_policy=p).run()[8] for p in ("lru", "fifo"))
    lru_evicted = set(lru.names(lru.evicted))
    return [label for label in fifo.names(fifo.evicted) if label not in lru_evicted]


def _check_q5(answer: object) -> str | None:
    expected = q5_expected()
    if not isinstance(answer, str):
        return wrong_type('one node label (a string such as "q_when + a_when")', answer)
    if [answer] == expected:
        return None
    return f"{answer!r} is not it: which leaf is old by insertion but was just used?"


Q5_SOLUTION = """\
from minirad.course.scenario import ScenarioReplay

# Step 9's match splits g; its old answer " This is 17." becomes leaf k, which keeps g's
# creation time (step 6: a split keeps it, and g was cut from f) but gets the current access
# time. FIFO sees the oldest leaf, k, and evicts it; LRU keeps it.
lru, fifo = (ScenarioReplay(eviction_policy=p).run()[8] for p in ("lru", "fifo"))
(answer,) = set(fifo.names(fifo.evicted)) - set(lru.names(lru.evicted))"""

q5 = Exercise(
    "q5 Figure 3 under FIFO",
    _check_q5,
    hint="Replay the scenario with ScenarioReplay(eviction_policy='fifo') and compare step 9's "
    "evicted labels with LRU's. Then explain why with creation_time vs last_access_time.",
    solution=Q5_SOLUTION,
)
