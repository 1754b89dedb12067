"""Chapter 03 exercises: each printed solution passes its check, an independent oracle agrees,
wrong answers fail with a useful reason, and an untouched stub (``...``) is "not attempted".

The oracles recompute every answer without ``RadixCache.evict`` or the eviction policies:
locks and sizes from plain prefix arithmetic, eviction orders by brute force over the edges
that the inserts create (node boundaries at key ends and divergence points; ``last access`` is
the last operation that entered an edge). They are written for these small exercises.
"""

from __future__ import annotations

import pytest

from minirad import RadixCache
from minirad.exercises import ch03
from minirad.scenario import ScenarioReplay


def common_len(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


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


def solution_answer(code: str) -> object:
    namespace = {"RadixCache": RadixCache, **vars(ch03)}
    exec(code, namespace)
    return namespace["answer"]


EXERCISES = {
    "q1": (ch03.q1, ch03.Q1_SOLUTION, oracle_q1),
    "q2": (ch03.q2, ch03.Q2_SOLUTION, oracle_q2),
    "q3": (ch03.q3, ch03.Q3_SOLUTION, oracle_q3),
    "q4": (ch03.q4, ch03.Q4_SOLUTION, oracle_q4),
    "q5": (ch03.q5, ch03.Q5_SOLUTION, oracle_q5),
}

# Plausible mistakes, and a word the reason must contain.
WRONG = {
    "q1": [((4, 5), "swapped"), ((7, 2), "whole path"), ((5, 5), "count"), (5, "pair")],
    "q2": [([[6, 7, 8], [4, 5]], "order"), ([[4, 5]], "whole leaves"),
           ([[1, 2, 3], [4, 5]], "not it"), ("x", "list of keys")],
    "q3": [((6, 0), "whole leaves"), ((5, 1), "cascading"), ((9, 0), "not it"),
           ((7.0, 0), "ints")],
    "q4": [({"lru": [1, 2], "lfu": [3, 4], "fifo": [1, 2]}, "lru"),
           ({"lru": [5, 6], "lfu": [5, 6], "fifo": [5, 6]}, "lfu, fifo"), ([5, 6], "dict")],
    "q5": [("q_when + a_when", "not it"), ("q_what", "not it"), (["a_this"], "string")],
}  # fmt: skip


@pytest.mark.parametrize("name", EXERCISES)
def test_solution_passes(name, capsys):
    q, code, _ = EXERCISES[name]
    answer = solution_answer(code)
    assert q.is_correct(answer)
    q.check(answer)
    assert capsys.readouterr().out.strip().endswith("correct!")


@pytest.mark.parametrize("name", EXERCISES)
def test_oracle_agrees(name):
    q, code, oracle = EXERCISES[name]
    expected = oracle()
    assert solution_answer(code) == expected
    assert q.is_correct(expected)


@pytest.mark.parametrize("name", EXERCISES)
def test_wrong_answers_fail_with_a_reason(name, capsys):
    q, _, _ = EXERCISES[name]
    for answer, reason in WRONG[name]:
        assert not q.is_correct(answer)
        q.check(answer)
        out = capsys.readouterr().out
        assert "incorrect" in out and reason in out, out


@pytest.mark.parametrize("name", EXERCISES)
def test_stub_is_not_attempted(name, capsys):
    q, _, _ = EXERCISES[name]
    assert not q.is_correct(...)
    q.check(...)
    assert "not attempted" in capsys.readouterr().out


@pytest.mark.parametrize("name", EXERCISES)
def test_hint_prints(name, capsys):
    q, _, _ = EXERCISES[name]
    q.hint()
    assert capsys.readouterr().out.startswith(f"[{q.name}] hint: ")
