"""Argument types shared by the command lines (``minirad``, ``python -m minirad.bench``)."""

from __future__ import annotations

import argparse

__all__ = ["positive_int", "prompt_text"]


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
