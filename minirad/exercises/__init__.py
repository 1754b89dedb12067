"""Check-your-answer helpers for the chapters' exercises (in the style of Kaggle learntools).

Each chapter's module (``minirad.exercises.ch01`` ...) defines :class:`Exercise` objects. In a
notebook the learner fills in a stub and calls ``q1.check(answer)``, which prints one line:
correct, incorrect (with a reason), or not attempted while the stub is still ``...``.
Expected answers are computed with the real ``minirad`` code, never typed in by hand.
``q1.hint()`` and ``q1.solution()`` print help.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Exercise"]


class Exercise:
    """One exercise.

    Args:
        name: short title, printed with every message.
        checker: called with the learner's answer; returns None when it is right, or a
            string saying what is wrong. It may raise; the exception counts as incorrect.
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
        except Exception as e:  # a wrong answer may well crash the checker
            return f"{type(e).__name__}: {e}"

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
