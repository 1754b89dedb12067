"""Chapter 07 exercises, held to the shared contract of ``exercise_contract.py``: the
oracle's answer passes, near misses fail, typical mistakes get their reason, the stub is
"not attempted", and the printed solution computes the answer.

``minirad.exercises.ch07`` computes its answers from the raw events of a Figure 3 replay
(minirad never imports the visualizer) and from a real scheduler step. The oracles here read
the same facts off the visualizer's frames (``viz.frame_builder``: another consumer of the events,
with its own tree, states and lock counts), and q4's off plain arithmetic.
"""

import functools

from exercise_contract import ExerciseContract

from minirad.exercises import ch07
from minirad.models.tokenizer import load_tokenizer
from viz.sources import scenario_frames


@functools.cache
def frames(per: str) -> tuple:
    return tuple(scenario_frames(per=per, tokenizer=load_tokenizer()))


def node(frame, start: str):
    (found,) = [n for n in frame.nodes if n.id and n.label.full.startswith(start)]
    return found


def oracle_q1() -> int:
    step5 = [f for f in frames("event") if f.title.startswith("(5)")]
    first_eviction = next(f for f in step5 if f.caption.startswith("evicted"))
    return len(first_eviction.locked)


def oracle_q2() -> tuple[int, int]:
    before, after = frames("step")[5:7]  # the tree after steps 6 and 7
    examples = node(after, "Question 1:")
    (tail,) = [n for n in after.nodes if n.parent == examples.id and n.state == "split"]
    assert examples.id in {n.id for n in before.live}
    assert tail.id not in {n.id for n in before.nodes}
    return examples.id, tail.id


def oracle_q3() -> tuple[str, ...]:
    return tuple(node(frames("step")[8], start).state for start in ch07.Q3_NODES)


def oracle_q4() -> tuple[int, int]:
    return ch07.Q4_PREFIX_LEN, ch07.Q4_PROMPT_LEN - ch07.Q4_PREFIX_LEN


CASES = [
    (ch07.q1, oracle_q1, ch07.Q1_SOLUTION),
    (ch07.q2, oracle_q2, ch07.Q2_SOLUTION),
    (ch07.q3, oracle_q3, ch07.Q3_SOLUTION),
    (ch07.q4, oracle_q4, ch07.Q4_SOLUTION),
]


def _q3_with(old: str, new: str) -> tuple[str, ...]:
    """Step 9's states with the first node in state ``old`` given ``new`` instead."""
    states = list(oracle_q3())
    states[states.index(old)] = new
    return tuple(states)


@functools.cache
def diagnosed() -> list:
    """Typical mistakes, and a word of the reason the learner must see (computed at test
    time: the oracles replay Figure 3)."""
    prompt, prefix = ch07.Q4_PROMPT_LEN, ch07.Q4_PREFIX_LEN
    return [
        (ch07.q1, 0, "while it is running"),
        (ch07.q1, 1, "up to the root"),
        (ch07.q2, oracle_q2()[::-1], "prefix keeps the old id"),
        (ch07.q2, (oracle_q2()[0], oracle_q2()[1] + 1), "next id"),
        (ch07.q3, _q3_with("split", "idle"), "lower half"),
        (ch07.q3, _q3_with("idle", "accessed"), "never reach"),
        (ch07.q3, ("green",) * len(ch07.Q3_NODES), "unknown states"),
        (ch07.q4, (0, prompt), "not computed again"),
        (ch07.q4, (prefix, prompt), "only the tokens computed"),
        (ch07.q4, (prefix, prompt - 1), "a count, not the last"),
    ]


class TestExerciseContract(ExerciseContract):
    chapter = ch07
    cases = CASES
    diagnosed = diagnosed


def test_lists_are_accepted_for_tuples():
    assert ch07.q2.is_correct(list(oracle_q2()))
    assert ch07.q3.is_correct(list(oracle_q3()))
    assert ch07.q4.is_correct(list(oracle_q4()))
