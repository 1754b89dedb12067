"""Exercises of chapter 07 (the visualizer: frames from events, Figure 3 replayed, engine steps).

The answers are computed here from the real :class:`~minirad.kvcache.radix_cache.RadixCache` and its
events: the Figure 3 scenario replayed by :class:`~minirad.course.scenario.ScenarioReplay`, and one
step of a real :class:`~minirad.engine.Scheduler` (no model needed: only the schedule is
asked). ``minirad`` never imports the visualizer, so nothing here uses ``viz``; the tests check
the same answers against the visualizer's frames. Every ``Qn_SOLUTION`` is runnable code that
sets ``answer``; the tests run it and check it with ``qn``.

Usage in the notebook::

    from minirad.exercises.ch07 import q1
    answer = ...
    q1.check(answer)
"""

from __future__ import annotations

import functools

from minirad.course.scenario import ScenarioReplay, StepResult
from minirad.engine import Request, SamplingParams, Scheduler, SchedulerConfig
from minirad.events import EvictEvent, LockEvent, SplitEvent, UnlockEvent
from minirad.exercises import Exercise, is_int, wrong_type
from minirad.kvcache.kv_pool import TokenToKVPoolAllocator
from minirad.kvcache.radix_cache import RadixCache

__all__ = [
    "Q3_NODES",
    "Q4_PREFIX_LEN",
    "Q4_PROMPT_LEN",
    "q1",
    "q2",
    "q3",
    "q4",
]

# q3: nodes of step 9's frame, each named by the start of its text.
Q3_NODES = (" This is 17.", " Let us count", " When does the sun set?", "You are a helpful")
STATES = ("added", "accessed", "split", "evicted", "idle")

# q4: a warm-up request left its prompt in the tree; a new prompt shares its first
# Q4_PREFIX_LEN tokens and has Q4_PROMPT_LEN tokens in all.
Q4_PREFIX_LEN = 24
Q4_PROMPT_LEN = 100


@functools.cache
def _figure3() -> tuple[StepResult, ...]:
    """Every step of the Figure 3 replay (the course tokenizer, LRU)."""
    return tuple(ScenarioReplay().run())


def _locked_at_eviction(step: int) -> int:
    """Nodes with ``lock_ref > 0`` when step ``step`` evicts its first leaf, from the lock
    events of the whole replay up to that moment."""
    refs: dict[int, int] = {}
    for result in _figure3():
        for e in result.events:
            if isinstance(e, EvictEvent) and result.step.number == step:
                return sum(1 for r in refs.values() if r > 0)
            if isinstance(e, LockEvent | UnlockEvent):
                refs.update(zip(e.node_ids, e.lock_refs, strict=True))
    raise AssertionError(f"step {step} evicts nothing")


def _check_q1(answer: object) -> str | None:
    expected = _locked_at_eviction(5)
    if not is_int(answer):
        return wrong_type("one int (a number of nodes)", answer)
    if answer == expected:
        return None
    if answer == 0:
        return "locks are released when the request ends, but it evicts while it is running"
    if answer == 1:
        return "inc_lock_ref locks every node from the matched node up to the root"
    return f"{answer} is not it; which nodes lie on the path chat 2 matched?"


def _split_in(step: int) -> tuple[int, int]:
    (split,) = [e for e in _figure3()[step - 1].events if isinstance(e, SplitEvent)]
    return split.node_id, split.new_node_id


def _check_q2(answer: object) -> str | None:
    kept, new = _split_in(7)
    if not isinstance(answer, tuple | list) or len(answer) != 2:
        return wrong_type("a pair (id of the prefix part, id of the suffix part)", answer)
    if not all(is_int(x) for x in answer):
        return "node ids are ints"
    if tuple(answer) == (kept, new):
        return None
    if tuple(answer) == (new, kept):
        return "swapped: the prefix keeps the old id, the suffix gets the new one"
    if answer[0] == kept:
        return "the prefix is right; the suffix gets the next id the cache hands out"
    return "the node that is cut keeps its id on its prefix part; which node is cut in step 7?"


def _node_state(result: StepResult, node_id: int) -> str:
    """A node's colour in a step's frame: the strongest of what the step did to it
    (evicted > added > accessed > split > idle), as the visualizer draws it."""
    suffixes = {new for _, new in result.splits}
    for state, ids in (
        ("evicted", result.evicted),
        ("added", result.added),
        ("accessed", result.accessed),
        ("split", suffixes),
    ):
        if node_id in ids:
            return state
    return "idle"


@functools.cache
def _q3_states() -> tuple[str, ...]:
    result = _figure3()[8]
    texts = result.texts
    states = []
    for start in Q3_NODES:
        (node_id,) = [i for i, t in texts.items() if t.startswith(start)]
        states.append(_node_state(result, node_id))
    return tuple(states)


def _check_q3(answer: object) -> str | None:
    expected = _q3_states()
    if not isinstance(answer, tuple | list) or len(answer) != len(Q3_NODES):
        return wrong_type(
            f"{len(Q3_NODES)} states, one per node, in the order of the question", answer
        )
    if unknown := [a for a in answer if a not in STATES]:
        return f"unknown states {unknown}; the states are {', '.join(STATES)}"
    wrong = [i for i, (a, e) in enumerate(zip(answer, expected, strict=True)) if a != e]
    if not wrong:
        return None
    i = wrong[0]
    if expected[i] == "split":
        return f"{Q3_NODES[i]!r}: the lower half of a cut edge, untouched otherwise"
    if expected[i] == "idle":
        return f"{Q3_NODES[i]!r}: step 9's requests never reach this node"
    return f"{Q3_NODES[i]!r} is not {answer[i]!r}; replay step 9 in the widget"


@functools.cache
def _q4_scheduled() -> tuple[int, int]:
    """``(start, num_tokens)`` of the new prompt in the step that admits it."""
    allocator = TokenToKVPoolAllocator(1024)
    scheduler = Scheduler(RadixCache(token_to_kv_pool_allocator=allocator), SchedulerConfig())
    shared = list(range(100, 100 + Q4_PREFIX_LEN))
    # max_new_tokens=1: the prefill samples the last token, and the request ends at once.
    scheduler.add_request(Request("warm", [*shared, 7, 8, 9], SamplingParams(max_new_tokens=1)))
    out = scheduler.schedule()
    scheduler.update_from_output(out, [5])
    prompt = shared + list(range(500, 500 + Q4_PROMPT_LEN - Q4_PREFIX_LEN))
    scheduler.add_request(Request("new", prompt, SamplingParams(max_new_tokens=1)))
    (s,) = scheduler.schedule().scheduled
    return s.start, s.num_tokens


def _check_q4(answer: object) -> str | None:
    start, n = _q4_scheduled()
    if not isinstance(answer, tuple | list) or len(answer) != 2:
        return wrong_type("a pair (start, num_tokens)", answer)
    if not all(is_int(x) for x in answer):
        return "both numbers are ints (token positions, token counts)"
    if tuple(answer) == (start, n):
        return None
    if answer[0] == 0:
        return "the cached prefix is not computed again: the chunk starts after it"
    if answer[1] == Q4_PROMPT_LEN:
        return "num_tokens counts only the tokens computed in this step"
    if tuple(answer) == (start, start + n - 1):
        return "the second number is a count, not the last position"
    return f"{tuple(answer)} is not it; the caption would say 'tokens {start}-{start + n - 1}'"


Q1_SOLUTION = """\
# Chat 2 matched the system node and its own first turn (node d), and locked that path:
# inc_lock_ref walks from the matched node up to the root. Both stay locked until the
# request ends, after the eviction; chat 1's nodes are not locked by anyone.
answer = 2"""

Q2_SOLUTION = """\
from minirad.events import SplitEvent
from minirad.course.scenario import ScenarioReplay

result = ScenarioReplay().run()[6]  # step 7
(split,) = [e for e in result.events if isinstance(e, SplitEvent)]
answer = (split.node_id, split.new_node_id)  # the prefix keeps its id; the suffix is new"""

Q3_SOLUTION = """\
# ' This is 17.': the old answer, cut off its question: the lower half of a split.
# ' Let us count': one of the three new samples: added.
# ' When does the sun set?': evicted to make room.
# the system prompt: step 9's few-shot requests never touch the chat branch: idle.
answer = ("split", "added", "evicted", "idle")"""

Q4_SOLUTION = """\
prefix_len, prompt_len = 24, 100
# The match covers the shared prefix; the chunk computes the rest, from position 24 on.
answer = (prefix_len, prompt_len - prefix_len)  # caption: 'prefill new (tokens 24-99)'"""

q1 = Exercise(
    "q1 locked nodes at an eviction",
    _check_q1,
    "Replay step 5 one event at a time (replay_scenario(per='event')): between chat 2's lock "
    "and its unlock, count the nodes with a lock badge.",
    Q1_SOLUTION,
)
q2 = Exercise(
    "q2 ids of a split",
    _check_q2,
    "Read step 7's events: a split keeps the id on the prefix part, and the cache numbers "
    "new nodes 1, 2, 3, ... in creation order.",
    Q2_SOLUTION,
)
q3 = Exercise(
    "q3 colours of step 9",
    _check_q3,
    "A node's state covers the whole step, strongest first: evicted > added > accessed > "
    "split > idle.",
    Q3_SOLUTION,
)
q4 = Exercise(
    "q4 a step's token range",
    _check_q4,
    "A StepEvent gives each request's start position and the number of tokens it computed "
    "in the step; cached tokens are not computed.",
    Q4_SOLUTION,
)
