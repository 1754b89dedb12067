"""Chapter 02 exercises: each printed solution passes its check, wrong answers fail with a
useful reason, and an untouched stub (``...``) reports "not attempted"."""

import pytest

from minirad.exercises import ch02

EXERCISES = {
    "q1": (ch02.q1, ch02.Q1_SOLUTION),
    "q2": (ch02.q2, ch02.Q2_SOLUTION),
    "q3": (ch02.q3, ch02.Q3_SOLUTION),
    "q4": (ch02.q4, ch02.Q4_SOLUTION),
    "q5": (ch02.q5, ch02.Q5_SOLUTION),
}

# Plausible mistakes, and a word the reason must contain.
WRONG = {
    "q1": [(65536, "K and V"), (524288, "GQA"), (262144, "2 bytes"), (1000, "not it")],
    "q2": [(10, "position"), (9, "block id"), (36, "offset"), (37, "not where")],
    "q3": [((8, 12, 12), "prompt(s) 2"), ((10, 11, 12), "prompt(s) 1, 2"), (8, "3 numbers")],
    "q4": [([2, 5, 4], "order"), ([0, 1, 2], "free queue"), (None, "TypeError")],
    "q5": [(0, "not it"), (41 + 16, "not it")],
}


def solution_answer(code: str) -> object:
    namespace: dict = {}
    exec(code, namespace)
    return namespace["answer"]


@pytest.mark.parametrize("name", EXERCISES)
def test_solution_passes(name, capsys):
    q, code = EXERCISES[name]
    assert q.check(solution_answer(code)) is True
    assert "correct!" in capsys.readouterr().out


@pytest.mark.parametrize("name", EXERCISES)
def test_wrong_answers_fail_with_a_reason(name, capsys):
    q, _ = EXERCISES[name]
    for answer, reason in WRONG[name]:
        assert q.check(answer) is False
        out = capsys.readouterr().out
        assert "incorrect" in out and reason in out, out


@pytest.mark.parametrize("name", EXERCISES)
def test_stub_is_not_attempted(name, capsys):
    q, _ = EXERCISES[name]
    assert q.check(...) is False
    assert "not attempted" in capsys.readouterr().out


@pytest.mark.parametrize("name", EXERCISES)
def test_hint_and_solution_print(name, capsys):
    q, code = EXERCISES[name]
    q.hint()
    q.solution()
    out = capsys.readouterr().out
    assert "hint:" in out and code in out


def test_answers_follow_the_chapter_rules():
    """The computed answers agree with the rules the chapter states, so a change in the
    library that breaks a rule shows up here and not only as a confusing exercise."""
    bs = ch02.Q3_BLOCK_SIZE
    cached_blocks = len(ch02.Q3_CACHED) // bs
    expected = []
    for p in ch02.Q3_PROMPTS:
        common = next(
            (i for i, (a, b) in enumerate(zip(p, ch02.Q3_CACHED, strict=False)) if a != b),
            min(len(p), len(ch02.Q3_CACHED)),
        )
        expected.append(min(common // bs, cached_blocks, (len(p) - 1) // bs) * bs)
    assert ch02._block_hits() == tuple(expected)
    lengths = ch02.Q5_LENGTHS
    assert ch02._wasted_slots() == sum((-n) % ch02.Q5_BLOCK_SIZE for n in lengths)
