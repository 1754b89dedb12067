"""Argument types shared by the command lines (``minirad``, ``python -m minirad.bench``)."""

from __future__ import annotations

import argparse

__all__ = ["SAMPLING_RULES", "positive_int", "prompt_text", "sampling_arg", "sampling_error"]


def positive_int(text: str) -> int:
    """``argparse`` type: an int >= 1.

    Raises:
        argparse.ArgumentTypeError: not an int, or < 1 (argparse prints it and exits 2).
    """
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from e
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def prompt_text(text: str) -> str:
    """``argparse`` type: a prompt holding a non-space character (the rule ``minirad batch``
    applies to a JSONL ``prompt`` too).

    Raises:
        argparse.ArgumentTypeError: empty or only whitespace.
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must hold a non-space character, got {text!r}")
    return text


# The rules of minirad.engine.SamplingParams.__post_init__, spelled here without torch so that
# a bad flag or JSONL field is refused before the engine import (seconds); test_cli checks that
# both refuse the same values. name -> (accepts, what it must be).
SAMPLING_RULES = {
    "max_new_tokens": (lambda v: type(v) is int and v >= 1, "an int >= 1"),
    "temperature": (lambda v: isinstance(v, int | float) and v >= 0, ">= 0"),
    "top_k": (lambda v: type(v) is int and v >= 0, "an int >= 0 (0: off)"),
    "top_p": (lambda v: isinstance(v, int | float) and 0 < v <= 1, "in (0, 1]"),
    "seed": (lambda v: v is None or isinstance(v, int), "an int or None"),
}


def sampling_error(name: str, value: object) -> str | None:
    """Why ``value`` is not a valid :class:`~minirad.engine.SamplingParams` field ``name``
    (``"must be >= 0, got -1.0"``), or None if it is valid.

    Raises:
        KeyError: ``name`` is not one of :data:`SAMPLING_RULES`.
    """
    accepts, what = SAMPLING_RULES[name]
    return None if accepts(value) else f"must be {what}, got {value!r}"


def sampling_arg(name: str, parse: type[int] | type[float]):
    """An ``argparse`` type for the sampling field ``name``: ``parse(text)`` checked with
    :func:`sampling_error`.

    The returned function raises ``argparse.ArgumentTypeError`` (argparse prints it and
    exits 2) for text ``parse`` refuses or a value out of range.
    """

    def convert(text: str) -> int | float:
        try:
            value = parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(sampling_error(name, text)) from e
        if error := sampling_error(name, value):
            raise argparse.ArgumentTypeError(error)
        return value

    convert.__name__ = name
    return convert
