"""The contract every chapter's exercises keep, written once for all chapters.

A chapter's test file recomputes each answer with its own oracle (plain Python, no minirad
class) and declares::

    class TestExerciseContract(ExerciseContract):
        chapter = ch02                      # the exercises module
        cases = CASES                       # [(exercise, oracle, solution code), ...]
        diagnosed = DIAGNOSED               # [(exercise, typical mistake, word of the reason)]

Every test method below that takes ``exercise`` (and ``oracle``, ``solution``) then runs once
per case, with the exercise's short name (``q1``) as its id; the class-level
``pytest_generate_tests`` hook does that (pytest looks for this hook in test classes too:
https://docs.pytest.org/en/stable/how-to/parametrize.html#pytest-generate-tests).

The contract, per exercise: the oracle's answer is correct and ``check`` says so; near misses of
it (:func:`near_misses`) are incorrect; at least one typical mistake is diagnosed with the reason
the learner must read; the untouched stub ``...`` is "not attempted"; the hint prints; the
printed solution is runnable code whose ``answer`` equals the oracle's and passes; the name is
``"qN title"`` with ``qN`` the module's name for it; a reason reads as words for the learner (no
``TypeError:`` prefix, no "too high / too low"). Per chapter: every exercise of the module has a
case, checking leaves the global RNGs alone, and the printed solutions use only names that the
chapter's notebook (``notebooks/NN_*.ipynb``) has bound before its exercises: a solution pasted
into the notebook runs.

A chapter adapts the contract with class attributes (``solution_globals``, ``wrong_answers``),
or by overriding a test and calling ``super()``.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import nbformat
import numpy as np
import pytest
import torch
from IPython.core.inputtransformer2 import TransformerManager

from minirad.exercises import Exercise

Oracle = Callable[[], Any]  # returns the right answer
Case = tuple[Exercise, Oracle, str]  # (exercise, oracle, solution code)
CASE_FIELDS = ("exercise", "oracle", "solution")
Diagnosis = tuple[Exercise, Any, str]  # (exercise, wrong answer, a word of the reason)
Capsys = pytest.CaptureFixture[str]
# What a reason must not look like: a Python exception's name, or a bisection game.
NOT_FOR_LEARNERS = re.compile(r"^\w*(Error|Exception)\b|too (high|low)", re.IGNORECASE)
NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def near_misses(right: object) -> list[object]:
    """Answers close to ``right`` that a checker must reject.

    Numbers off by one, negated or of the wrong type (float, str, wrapped in a list); each
    element of a list, tuple or dict value replaced by its own near misses; an element (or a
    key) dropped, added or reordered; a container's first element without the container; a
    matrix transposed; every number plus one, or as a float; and ``None``, ``"x"``. Answers a
    checker may accept for ``right`` (a tuple for a list, 0/1 for bools) are not listed, nor
    variants that print like ``right`` (``-0``, a palindrome reversed).

    Raises:
        TypeError: for an answer type it does not know (extend it, or the chapter's
            ``wrong_answers``).
    """
    wrong: list[object]
    if isinstance(right, bool):
        wrong = [not right]
    elif isinstance(right, int):
        wrong = [right + 1, right - 1, -right, float(right), str(right), [right]]
    elif isinstance(right, str):
        wrong = [right + "x", "", [right]]
    elif isinstance(right, dict):
        wrong = [{**right, k: miss} for k, v in right.items() for miss in near_misses(v)]
        wrong += [{k: v for k, v in right.items() if k != key} for key in right]
        wrong += [list(right.values()), {}]
    elif isinstance(right, set | frozenset):
        ordered = sorted(right, key=repr)  # the same near misses on every run
        wrong = [right - {x} for x in ordered] + ordered[:1] + [type(right)()]
    elif isinstance(right, list | tuple):
        kind = type(right)
        wrong = [
            kind([*right[:i], miss, *right[i + 1 :]])
            for i, x in enumerate(right)
            for miss in near_misses(x)
        ]
        wrong += [right[:-1], right + kind([0]), right[::-1], kind()] + list(right[:1])
        if right and all(isinstance(row, list | tuple) for row in right):
            if len({len(row) for row in right}) == 1:  # a matrix
                wrong.append([list(column) for column in zip(*right, strict=True)])
    else:
        raise TypeError(f"no near misses for a {type(right).__name__}")
    wrong += [_map_ints(right, float), _map_ints(right, _plus_one), None, "x"]
    unique = {repr(w): w for w in wrong}  # also drops duplicates
    unique.pop(repr(right), None)
    return list(unique.values())


def common_len(a: Sequence[object], b: Sequence[object]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``: what a radix tree with page
    size 1 reuses, computed on plain lists for the chapters' oracles."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class _ModuleNames(ast.NodeVisitor):
    """The names a module binds at its top level (not inside functions, classes' bodies or
    comprehensions, which have scopes of their own)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self.names.add(node.id)

    def visit_alias(self, node: ast.alias) -> None:
        self.names.add(node.asname or node.name.split(".")[0])

    def _bind_only(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.names.add(node.name)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _bind_only

    def _skip(self, node: ast.AST) -> None:
        pass

    visit_Lambda = visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _skip


def notebook_names(chapter: ModuleType) -> set[str]:
    """Names that ``chapter``'s notebook has bound (imported, assigned, defined) in its code
    cells before the first cell that imports from ``minirad.exercises``: what a learner's
    pasted solution may use. IPython syntax (``%magic``, ``!cmd``) is translated first."""
    number = chapter.__name__.rsplit(".ch", 1)[1]
    (path,) = NOTEBOOKS.glob(f"{number}_*.ipynb")
    visitor, to_python = _ModuleNames(), TransformerManager()
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        if "minirad.exercises" in cell.source:
            return visitor.names
        visitor.visit(ast.parse(to_python.transform_cell(cell.source)))
    raise AssertionError(f"{path.name} never imports its exercises")


def _plus_one(n: int) -> int:
    return n if isinstance(n, bool) else n + 1


def _map_ints(x: object, fn: Callable[[int], object]) -> object:
    """``x`` with ``fn`` applied to every int (bools included) inside it."""
    if isinstance(x, int):
        return fn(x)
    if isinstance(x, dict):
        return {k: _map_ints(v, fn) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_map_ints(v, fn) for v in x)
    return x


def _rng_draws() -> tuple[float, float, float]:
    """One draw from each global RNG a learner's notebook may seed."""
    return random.random(), float(np.random.random()), torch.rand(()).item()


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class ExerciseContract:
    """Base class of a chapter's ``TestExerciseContract``; see the module docstring.

    Attributes:
        chapter: the exercises module (``minirad.exercises.chNN``).
        cases: one ``(exercise, oracle, solution code)`` per exercise of ``chapter``; the oracle
            takes no argument and returns the right answer. A chapter whose printed solutions
            are not plain code may give ``(exercise, oracle)`` pairs and override
            ``test_printed_solution_computes_the_answer`` (without the ``solution`` argument).
        diagnosed: ``(exercise, wrong answer, a word of the reason)`` triples, at least one per
            exercise; or a function that returns them, when they are costly to compute (it
            then runs at test time, not while pytest collects; cache it).
        solution_globals: the names a printed solution may use without importing them, only
            names the notebook has bound before its exercises (checked), never an exercises
            module's constants (the notebook does not import them); or a function that returns
            them, called afresh for every run (a solution may change a notebook's cache). By
            default none: the solution is self-contained.
    """

    chapter: ModuleType
    cases: Sequence[Case] = ()
    diagnosed: Sequence[Diagnosis] | Callable[[], Sequence[Diagnosis]] = ()
    solution_globals: dict[str, Any] | Callable[[], dict[str, Any]] = {}

    wrong_answers = staticmethod(near_misses)  # a chapter may add its own near misses

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Run each test that takes ``exercise`` once per case, with the fields it asks for."""
        wanted = [name for name in CASE_FIELDS if name in metafunc.fixturenames]
        if wanted:
            cases = [dict(zip(CASE_FIELDS, case, strict=False)) for case in self.cases]
            metafunc.parametrize(
                wanted,
                [tuple(case[name] for name in wanted) for case in cases],
                ids=[case["exercise"].name.split()[0] for case in cases],
            )

    def typical_mistakes(self) -> Sequence[Diagnosis]:
        diagnosed = type(self).diagnosed  # read on the class: a function stays unbound
        return diagnosed() if callable(diagnosed) else diagnosed

    def notebook_globals(self) -> dict[str, Any]:
        given = type(self).solution_globals  # read on the class: a function stays unbound
        return dict(given() if callable(given) else given)

    def run_solution(self, code: str) -> object:
        """Run a printed solution, as a learner would paste it; return the ``answer`` it sets."""
        namespace = self.notebook_globals()
        exec(code, namespace)
        return namespace["answer"]

    # ------------------------------------------------------------------------- per exercise
    def test_right_answer_passes(self, exercise: Exercise, oracle: Oracle, capsys: Capsys) -> None:
        right = oracle()
        assert exercise.is_correct(right), exercise.problem(right)
        exercise.check(right)
        assert capsys.readouterr().out == f"[{exercise.name}] correct!\n"

    def test_wrong_answers_fail(self, exercise: Exercise, oracle: Oracle, capsys: Capsys) -> None:
        for wrong in self.wrong_answers(oracle()):
            problem = exercise.problem(wrong)
            assert problem is not None, wrong
            assert not NOT_FOR_LEARNERS.search(problem), (wrong, problem)
            exercise.check(wrong)
            assert capsys.readouterr().out.startswith(f"[{exercise.name}] incorrect: "), wrong

    def test_numpy_integers_count_as_ints(self, exercise: Exercise, oracle: Oracle) -> None:
        """A right answer computed with numpy (``np.int64`` where an int is asked) passes."""

        def as_numpy(n: int) -> object:  # a pad id (a whole image hash) does not fit int64
            return n if isinstance(n, bool) or not -(2**63) <= n < 2**63 else np.int64(n)

        right = _map_ints(oracle(), as_numpy)
        assert exercise.is_correct(right), exercise.problem(right)

    def test_name_is_the_variable_and_a_title(self, exercise: Exercise) -> None:
        """``[q1 matched length]``: the name the learner calls, then what it asks."""
        short, _, title = exercise.name.partition(" ")
        assert re.fullmatch(r"q\d+", short) and title, exercise.name
        assert getattr(self.chapter, short) is exercise

    def test_typical_mistakes_get_a_reason(self, exercise: Exercise, capsys: Capsys) -> None:
        mistakes = [(a, reason) for ex, a, reason in self.typical_mistakes() if ex is exercise]
        assert mistakes, f"list at least one typical mistake of {exercise.name} in `diagnosed`"
        for answer, reason in mistakes:
            problem = exercise.problem(answer)
            assert problem is not None and reason in problem, (answer, reason, problem)
            exercise.check(answer)
            assert capsys.readouterr().out == f"[{exercise.name}] incorrect: {problem}\n"

    def test_untouched_stub_is_not_attempted(self, exercise: Exercise, capsys: Capsys) -> None:
        assert not exercise.is_correct(...)
        exercise.check(...)
        assert capsys.readouterr().out.startswith(f"[{exercise.name}] not attempted")

    def test_printed_solution_computes_the_answer(
        self, exercise: Exercise, oracle: Oracle, solution: str, capsys: Capsys
    ) -> None:
        exercise.solution()
        assert capsys.readouterr().out == f"[{exercise.name}] solution:\n{solution}\n"
        answer = self.run_solution(solution)
        # A tensor (or array) answer is compared by its values.
        assert (answer.tolist() if hasattr(answer, "tolist") else answer) == oracle()
        assert exercise.is_correct(answer)

    def test_hint_prints(self, exercise: Exercise, capsys: Capsys) -> None:
        exercise.hint()
        prefix = f"[{exercise.name}] hint: "
        out = capsys.readouterr().out
        assert out.startswith(prefix) and out.strip() != prefix.strip(), out

    # -------------------------------------------------------------------------- per chapter
    def test_every_exercise_has_a_case(self) -> None:
        """Each ``Exercise`` of the chapter module is tested (a new one cannot slip through)."""
        exercises = {v for v in vars(self.chapter).values() if isinstance(v, Exercise)}
        assert {case[0] for case in self.cases} == exercises
        assert {ex for ex, _, _ in self.typical_mistakes()} <= exercises

    def test_solution_globals_are_the_notebooks(self) -> None:
        """A solution runs with nothing but what the learner's notebook has defined."""
        missing = set(self.notebook_globals()) - notebook_names(self.chapter)
        assert not missing, f"the notebook does not define {sorted(missing)} before its exercises"

    def test_checking_leaves_the_global_rng_alone(self) -> None:
        """A learner's seeded notebook must not change because they checked an answer: not
        even the first check, which fills the chapter's caches (a loaded model, a replay)."""
        answers = [(case[0], case[1]()) for case in self.cases]
        for value in vars(self.chapter).values():
            if hasattr(value, "cache_clear"):  # a functools.cache of the chapter module
                value.cache_clear()
        _seed_all(0)
        expected = _rng_draws()
        _seed_all(0)
        for exercise, answer in answers:
            exercise.check(answer)
        assert _rng_draws() == expected
