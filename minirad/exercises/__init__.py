"""Check-your-answer helpers for the chapters' exercises (in the style of Kaggle learntools).

Each chapter's module (``minirad.exercises.ch01`` ...) defines :class:`Exercise` objects. In a
notebook the learner fills in a stub and calls ``q1.check(answer)``, which prints one line:
correct, incorrect (with a reason), or not attempted while the stub is still ``...``.
Expected answers are computed with the real ``minirad`` code, never typed in by hand.
``q1.hint()`` and ``q1.solution()`` print help.

Every exercise is named ``"qN <short title>"``: ``qN`` is the name the learner imports and
calls (``q1.check(...)``), so the printed ``[q1 ...]`` points at the cell. A reason is
written for the learner: an answer of the wrong type or shape says what was expected and
what was given (:func:`wrong_type`), never a Python exception name; a wrong value says what
to look at, never "too high" or "too low" (which invites guessing).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

__all__ = ["Exercise", "WrongAnswer", "is_int", "is_int_list", "wrong_type"]


class WrongAnswer(Exception):
    """Raised by a checker's helper with the reason the learner reads (a wrong shape deep in
    the answer); :meth:`Exercise.problem` returns its message as is."""


def is_int(x: object) -> bool:
    """An integer that is not a bool (``True == 1``: a bool would pass an ``==`` check).
    numpy integers count (``numbers.Integral``): a count computed with numpy is still a count."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_int_list(x: object) -> bool:
    """A list or tuple of :func:`is_int` values."""
    return isinstance(x, tuple | list) and all(is_int(v) for v in x)


def _describe(answer: object) -> str:
    """``answer``'s type and value, for a learner: ``str '12'`` (long values cut)."""
    shown = repr(answer)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{type(answer).__name__} {shown}"


def wrong_type(what: str, answer: object) -> str:
    """The reason for an answer of the wrong type or shape: ``"expected <what>, got <the
    answer's type> <its value>"``, e.g. ``expected one int (bytes), got str '12'``."""
    return f"expected {what}, got {_describe(answer)}"


class Exercise:
    """One exercise.

    Args:
        name: short title, printed with every message.
        checker: called with the learner's answer; returns None when it is right, or a
            string saying what is wrong. It may raise :class:`WrongAnswer` with that string;
            any other exception (an answer that crashes the check) counts as incorrect too.
        hint: one or two sentences that point the way.
        solution: the answer, as code or prose.
    """

    def __init__(
        self, name: str, checker: Callable[[object], str | None], hint: str, solution: str
    ) -> None:
        self.name, self._checker, self._hint, self._solution = name, checker, hint, solution

    def problem(self, answer: object) -> str | None:
        """What is wrong with ``answer`` (None when it is right), without printing."""
        if answer is ...:
            return "not attempted"
        try:
            return self._checker(answer)
        except WrongAnswer as e:
            return str(e)
        except Exception as e:  # a wrong answer may well crash the checker
            return f"could not check {_describe(answer)}: {e}"

    def is_correct(self, answer: object) -> bool:
        """True when ``answer`` is right (silent; for tests)."""
        return self.problem(answer) is None

    def check(self, answer: object = ...) -> None:
        """Print whether ``answer`` is right, not attempted, or wrong and why."""
        if answer is ...:
            print(f"[{self.name}] not attempted: replace the ... with your answer, then run again.")
            return
        problem = self.problem(answer)
        if problem is None:
            print(f"[{self.name}] correct!")
        else:
            print(f"[{self.name}] incorrect: {problem}")

    def hint(self) -> None:
        print(f"[{self.name}] hint: {self._hint}")

    def solution(self) -> None:
        print(f"[{self.name}] solution:\n{self._solution}")

    def __repr__(self) -> str:
        return f"Exercise({self.name!r})"
