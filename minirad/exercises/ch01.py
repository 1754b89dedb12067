"""Exercises of chapter 01 (the radix tree).

Each exercise describes a few :class:`~minirad.RadixCache` operations on small token ids; the
learner predicts the outcome by hand. The expected answers are computed here by running those
operations on a real ``RadixCache``, so they follow the library if its semantics ever change.
Every ``Qn_SOLUTION`` is runnable code that sets ``answer``, importing the data it uses (the
notebook imports only ``qn``); the tests run it and check it with ``qn``.

Usage in the notebook::

    from minirad.exercises.ch01 import q1
    answer = ...
    q1.check(answer)
"""

from __future__ import annotations

from minirad.exercises import Exercise, is_int, is_int_list, wrong_type
from minirad.kvcache.radix_cache import RadixCache, TreeNode

__all__ = [
    "Q1_INSERTS",
    "Q1_QUERY",
    "Q1_SOLUTION",
    "Q2_INSERTS",
    "Q2_SOLUTION",
    "Q3_INSERTS",
    "Q3_QUERY",
    "Q3_SOLUTION",
    "Q4_INSERT",
    "Q4_PAGE_SIZE",
    "Q4_QUERY",
    "Q4_SOLUTION",
    "Q5_INSERTS",
    "Q5_QUERY",
    "Q5_SOLUTION",
    "q1",
    "q2",
    "q3",
    "q4",
    "q5",
]


def _fresh_slots(start: int, n: int) -> list[int]:
    """``n`` consecutive KV slot ids from ``start``: what a pool would hand out."""
    return list(range(start, start + n))


def _check_int(answer: object, expected: int, unit: str, look: str) -> str | None:
    """None if ``answer`` is ``expected``; else the reason: the type, or what to ``look`` at
    (not "too high": a learner would bisect to the number instead of reading the tree)."""
    if not is_int(answer):
        return wrong_type(f"one int ({unit})", answer)
    if answer == expected:
        return None
    return f"{answer} is not it: {look}"


# q1 -------------------------------------------------------------------------------------------
Q1_INSERTS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [9, 10]]
Q1_QUERY = [1, 2, 3, 4, 9]


def q1_expected() -> int:
    """Tokens of ``Q1_QUERY`` that ``match_prefix`` finds after the ``Q1_INSERTS``."""
    cache = RadixCache()
    for i, key in enumerate(Q1_INSERTS):
        cache.insert(key, _fresh_slots(100 * i, len(key)))
    return len(cache.match_prefix(Q1_QUERY).indices)


Q1_SOLUTION = """\
from minirad import RadixCache
from minirad.exercises.ch01 import Q1_INSERTS, Q1_QUERY

# 4: the query follows the edge [1, 2, 3], enters the edge [4, 5, 6] and leaves it at 9
# (the edge continues with 5).
cache = RadixCache()
for i, key in enumerate(Q1_INSERTS):
    cache.insert(key, list(range(100 * i, 100 * i + len(key))))
answer = len(cache.match_prefix(Q1_QUERY).indices)"""

q1 = Exercise(
    "q1 matched length",
    lambda a: _check_int(
        a, q1_expected(), "tokens", "count the query's tokens that edges continue, edge by edge"
    ),
    hint="Walk the query down from the root; stop at the first token that no edge continues with.",
    solution=Q1_SOLUTION,
)


# q2 -------------------------------------------------------------------------------------------
Q2_INSERTS = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 3, 7], [8, 9], [1, 2]]


def _count_nodes(node: TreeNode) -> int:
    """Nodes below ``node``, found through the ``children`` links."""
    return sum(1 + _count_nodes(child) for child in node.children.values())


def q2_expected() -> int:
    """Nodes (root excluded) after inserting ``Q2_INSERTS`` in order."""
    cache = RadixCache()
    for i, key in enumerate(Q2_INSERTS):
        cache.insert(key, _fresh_slots(100 * i, len(key)))
    return _count_nodes(cache.root_node)


Q2_SOLUTION = """\
from minirad import RadixCache
from minirad.exercises.ch01 import Q2_INSERTS

# 6: [1,2,3,4] -> 1 node; [1,2,5,6] splits it into [1,2] -> [3,4] and adds [5,6] (3);
# [1,2,3,7] splits [3,4] into [3] -> [4] and adds [7] (5); [8,9] is a new root child (6);
# [1,2] ends exactly at a node: nothing changes.
cache = RadixCache()
for i, key in enumerate(Q2_INSERTS):
    cache.insert(key, list(range(100 * i, 100 * i + len(key))))


def count(node):
    return sum(1 + count(child) for child in node.children.values())


answer = count(cache.root_node)"""

q2 = Exercise(
    "q2 node count",
    lambda a: _check_int(
        a, q2_expected(), "nodes", "draw the tree after every insert; a split adds a node"
    ),
    hint=(
        "Draw the tree after every insert. An insert that leaves an edge midway splits it "
        "(one more node), then adds a leaf for the rest if any tokens are left."
    ),
    solution=Q2_SOLUTION,
)


# q3 -------------------------------------------------------------------------------------------
# (key, KV slots) pairs: the second request computed all of its tokens itself.
Q3_INSERTS = [([5, 6, 7, 8, 9], [40, 41, 42, 43, 44]), ([5, 6, 7, 1, 2], [50, 51, 52, 53, 54])]
Q3_QUERY = [5, 6, 7, 1]


def q3_expected() -> list[int]:
    """KV slots that ``match_prefix(Q3_QUERY)`` returns after the ``Q3_INSERTS``."""
    cache = RadixCache()
    for key, value in Q3_INSERTS:
        cache.insert(key, value)
    return cache.match_prefix(Q3_QUERY).indices


def _check_q3(answer: object) -> str | None:
    if not is_int_list(answer):
        return wrong_type("a list of slot ids (ints)", answer)
    expected = q3_expected()
    if len(answer) != len(expected):
        return f"{len(answer)} slots, but the query matches {len(expected)} tokens"
    if sorted(answer) == sorted(expected) != list(answer):
        return "the right slots in the wrong order: slot j holds the K/V of the query's token j"
    if list(answer) != expected:
        return "right length, wrong slots: which copy of [5, 6, 7] does the tree keep?"
    return None


Q3_SOLUTION = """\
from minirad import RadixCache
from minirad.exercises.ch01 import Q3_INSERTS, Q3_QUERY

# [40, 41, 42, 53]: the tree kept slots 40-42 for [5, 6, 7] (insert returned 3, and the
# second request must free its duplicates 50-52); the leaf [1, 2] holds 53, 54, and the
# query stops after 1, so match_prefix splits that leaf and returns 53.
cache = RadixCache()
for key, value in Q3_INSERTS:
    cache.insert(key, value)
answer = cache.match_prefix(Q3_QUERY).indices"""

q3 = Exercise(
    "q3 slots of a mid-edge match",
    _check_q3,
    hint=(
        "insert() keeps the slots the tree already has for the cached prefix; only the new "
        "tail brings its own slots. The query then ends inside the second request's leaf."
    ),
    solution=Q3_SOLUTION,
)


# q4 -------------------------------------------------------------------------------------------
Q4_PAGE_SIZE = 2
Q4_INSERT = [1, 2, 3, 4, 5, 6, 7]
Q4_QUERY = [1, 2, 3, 4, 5, 9, 9]


def q4_expected() -> tuple[int, int]:
    """``(total_size() after inserting Q4_INSERT, tokens matched for Q4_QUERY)`` with
    ``page_size = Q4_PAGE_SIZE``."""
    cache = RadixCache(page_size=Q4_PAGE_SIZE)
    cache.insert(Q4_INSERT, _fresh_slots(0, len(Q4_INSERT)))
    return cache.total_size(), len(cache.match_prefix(Q4_QUERY).indices)


def _check_q4(answer: object) -> str | None:
    if not isinstance(answer, tuple | list) or len(answer) != 2:
        return wrong_type("a pair (cached tokens, matched tokens)", answer)
    cached, matched = q4_expected()
    problem = _check_int(answer[0], cached, "tokens", "insert keeps whole pages only")
    if problem is not None:
        return f"cached tokens: {problem}"
    problem = _check_int(answer[1], matched, "tokens", "a match is rounded down to whole pages")
    if problem is not None:
        return f"matched tokens: {problem}"
    return None


Q4_SOLUTION = """\
from minirad import RadixCache
from minirad.exercises.ch01 import Q4_INSERT, Q4_PAGE_SIZE, Q4_QUERY

# (6, 4): the 7-token key is cut to 3 pages (6 tokens); the query shares 5 tokens with it,
# rounded down to 2 pages = 4 tokens.
cache = RadixCache(page_size=Q4_PAGE_SIZE)
cache.insert(Q4_INSERT, list(range(len(Q4_INSERT))))
answer = (cache.total_size(), len(cache.match_prefix(Q4_QUERY).indices))"""

q4 = Exercise(
    "q4 page_size 2",
    _check_q4,
    hint="Both insert and match_prefix cut keys to whole pages, and a match is rounded down "
    "to a whole page.",
    solution=Q4_SOLUTION,
)


# q5 -------------------------------------------------------------------------------------------
Q5_INSERTS = [[1, 2, 3, 4], [5, 6]]
Q5_QUERY = [1, 2, 9]


def q5_expected() -> int:
    """Id of the node that holds the suffix ``[3, 4]`` after ``match_prefix(Q5_QUERY)``."""
    cache = RadixCache()
    for i, key in enumerate(Q5_INSERTS):
        cache.insert(key, _fresh_slots(100 * i, len(key)))
    node = cache.match_prefix(Q5_QUERY).last_node
    (suffix,) = node.children.values()
    return suffix.id


def _check_q5(answer: object) -> str | None:
    expected = q5_expected()
    cache = RadixCache()
    for i, key in enumerate(Q5_INSERTS):
        cache.insert(key, _fresh_slots(100 * i, len(key)))
    split = cache.match_prefix(Q5_QUERY).last_node
    if is_int(answer) and answer == split.id != expected:
        return f"{answer} is the id of the prefix part [1, 2]: which part keeps the old id?"
    return _check_int(
        answer,
        expected,
        "a node id",
        "list the nodes in the order they are created (the root is 0, then each insert's new "
        "node, then the split's new node) and find the one that holds [3, 4]",
    )


Q5_SOLUTION = """\
from minirad import RadixCache
from minirad.exercises.ch01 import Q5_INSERTS, Q5_QUERY

# 3: the root is #0, [1,2,3,4] is #1 and [5,6] is #2. The match stops inside #1, which is
# split: the prefix [1, 2] keeps id 1 (it is the returned last_node) and the suffix [3, 4]
# gets the next id, 3.
cache = RadixCache()
for i, key in enumerate(Q5_INSERTS):
    cache.insert(key, list(range(100 * i, 100 * i + len(key))))
node = cache.match_prefix(Q5_QUERY).last_node
answer = next(iter(node.children.values())).id"""

q5 = Exercise(
    "q5 node id after a split",
    _check_q5,
    hint=(
        "Ids are handed out in creation order, starting with the root at 0. In minirad a "
        "split keeps the old id on the prefix part; the suffix part gets the next free id."
    ),
    solution=Q5_SOLUTION,
)
