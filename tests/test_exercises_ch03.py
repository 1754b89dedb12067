"""Chapter 03 exercises, held to the shared contract of ``exercise_contract.py``: the
oracle's answer passes, near misses fail, typical mistakes get their reason, the stub is
"not attempted", and the printed solution computes the answer.

The oracles recompute every answer without ``RadixCache.evict`` or the eviction policies:
locks and sizes from plain prefix arithmetic, eviction orders by brute force over the edges
that the inserts create (node boundaries at key ends and divergence points; ``last access`` is
the last operation that entered an edge). They are written for these small exercises.
"""

from __future__ import annotations

from exercise_contract import ExerciseContract, common_len

from minirad.course.scenario import ScenarioReplay
from minirad.exercises import ch03


def edges(keys: list[list[int]]) -> dict[tuple, tuple]:
    """The radix tree of ``keys`` as {node prefix: parent prefix} (root = ``()``)."""
    prefixes = {tuple(k[:n]) for k in keys for n in range(1, len(k) + 1)}
    ends = {tuple(k) for k in keys}
    nexts = {p: {k[len(p)] for k in keys if len(k) > len(p) and tuple(k[: len(p)]) == p}
             for p in prefixes}  # fmt: skip
    bounds = ends | {p for p in prefixes if len(nexts[p]) > 1}
    return {b: max((p for p in bounds | {()} if b[: len(p)] == p and p != b), key=len)
            for b in bounds}  # fmt: skip


def brute_force_evict(keys, ops, num_tokens, priority):
    """Evict by brute force: ``ops`` is the list of keys walked (inserts then matches), in time
    order; ``priority(node, last, created, hits)`` sorts leaves. Returns evicted node prefixes."""
    tree = edges(keys)
    created, last, hits = {}, {}, {}
    for t, (kind, key) in enumerate(ops):
        for node, parent in tree.items():
            if common_len(node, key) > len(parent):  # the op entered this edge
                created.setdefault(node, t)
                last[node] = t
                hits[node] = hits.get(node, 0) + (kind == "match")
    evicted, freed = [], 0
    while freed < num_tokens:
        leaves = [n for n in tree if n not in evicted and not any(
            tree[c] == n for c in tree if c not in evicted)]  # fmt: skip
        if not leaves:
            break
        victim = min(leaves, key=lambda n: priority(n, last[n], created[n], hits[n]))
        evicted.append(victim)
        freed += len(victim) - len(tree[victim])
    return [list(n[len(tree[n]) :]) for n in evicted], freed, len(tree) - len(evicted)


def lru(node, last, created, hits):
    return last


def oracle_q1():
    total = len({tuple(k[:n]) for k in ch03.Q1_INSERTS for n in range(1, len(k) + 1)})
    protected = max(common_len(k, ch03.Q1_LOCKED_QUERY) for k in ch03.Q1_INSERTS)
    return (total - protected, protected)


def oracle_q2():
    ops = [("insert", k) for k in ch03.Q2_INSERTS] + [("match", ch03.Q2_QUERY)]
    return brute_force_evict(ch03.Q2_INSERTS, ops, ch03.Q2_EVICT, lru)[0]


def oracle_q3():
    ops = [("insert", k) for k in ch03.Q3_INSERTS] + [("match", ch03.Q3_QUERY)]
    _, freed, left = brute_force_evict(ch03.Q3_INSERTS, ops, ch03.Q3_EVICT, lru)
    return (freed, left)


def oracle_q4():
    ops = [("insert", k) for k in ch03.Q4_INSERTS] + [("match", q) for q in ch03.Q4_QUERIES]
    policies = {
        "lru": lru,
        "lfu": lambda n, last, created, hits: (hits, last),
        "fifo": lambda n, last, created, hits: created,
    }
    return {p: brute_force_evict(ch03.Q4_INSERTS, ops, 1, f)[0][0] for p, f in policies.items()}


def oracle_q5():
    """Replay Figure 3 with FIFO up to step 9's first request (match + lock), then pick FIFO
    victims by hand from the live tree; drop those that the scenario file says LRU evicts."""
    replay = ScenarioReplay(eviction_policy="fifo")
    for _ in range(8):
        replay.step()
    step9 = replay.scenario.steps[8]
    request = step9.requests[0]
    node = replay.cache.match_prefix(replay.tokens(request.prompt)).last_node
    replay.cache.inc_lock_ref(node)
    alive, stack = [], [replay.cache.root_node]
    while stack:
        n = stack.pop()
        alive += n.children.values()
        stack.extend(n.children.values())
    gone, freed = [], 0
    while freed < len(replay.tokens(request.evict)):
        leaves = [n for n in alive if n.lock_ref == 0 and n not in gone
                  and all(c in gone for c in n.children.values())]  # fmt: skip
        victim = min(leaves, key=lambda n: (n.creation_time, n.id))
        gone.append(victim)
        freed += len(victim.key)
    lru_evicted = set(step9.expected["evicted"])
    return [replay.label(n.key) for n in gone if replay.label(n.key) not in lru_evicted][0]


CASES = [
    (ch03.q1, oracle_q1, ch03.Q1_SOLUTION),
    (ch03.q2, oracle_q2, ch03.Q2_SOLUTION),
    (ch03.q3, oracle_q3, ch03.Q3_SOLUTION),
    (ch03.q4, oracle_q4, ch03.Q4_SOLUTION),
    (ch03.q5, oracle_q5, ch03.Q5_SOLUTION),
]

# Plausible mistakes, and a word the reason must contain.
DIAGNOSED = [
    (ch03.q1, (4, 5), "swapped"),
    (ch03.q1, (7, 2), "whole path"),
    (ch03.q1, (5, 5), "count"),
    (ch03.q1, 5, "pair"),
    (ch03.q2, [[6, 7, 8], [4, 5]], "order"),
    (ch03.q2, [[4, 5]], "whole leaves"),
    (ch03.q2, [[1, 2, 3], [4, 5]], "not it"),
    (ch03.q2, "x", "list of keys"),
    (ch03.q3, (6, 0), "whole leaves"),
    (ch03.q3, (5, 1), "cascading"),
    (ch03.q3, (9, 0), "not it"),
    (ch03.q3, (7.0, 0), "ints"),
    (ch03.q4, {"lru": [1, 2], "lfu": [3, 4], "fifo": [1, 2]}, "lru"),
    (ch03.q4, {"lru": [5, 6], "lfu": [5, 6], "fifo": [5, 6]}, "lfu, fifo"),
    (ch03.q4, [5, 6], "dict"),
    (ch03.q5, "q_when + a_when", "not it"),
    (ch03.q5, "q_what", "not it"),
    (ch03.q5, ["a_this"], "string"),
]


class TestExerciseContract(ExerciseContract):
    chapter = ch03
    cases = CASES
    diagnosed = DIAGNOSED
