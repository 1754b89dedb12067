"""Argument types shared by the command lines (``minirad``, ``python -m minirad.bench``)."""

from __future__ import annotations

import argparse
import os

from minirad.engine.sampling_params import SamplingParams
from minirad.errors import RequestError

__all__ = [
    "DTYPES",
    "non_negative_float",
    "positive_float",
    "positive_int",
    "prompt_text",
    "sampling_arg",
    "thread_count",
]

# --dtype of every command that loads a model: the model's (and so the engine's and its KV
# pool's) dtype, by torch's names.
DTYPES = ("float32", "bfloat16")


def port(text: str) -> int:
    """``argparse`` type: a TCP port, 1..65535.

    Raises:
        argparse.ArgumentTypeError: not an int, or out of range (argparse prints it, exits 2).
    """
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 1..65535, got {value}")
    return value


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


def thread_count(text: str) -> int:
    """``argparse`` type: torch intra-op threads, 1 to 4 per CPU of this machine.

    Beyond the CPU count threads only wait on each other (the headroom keeps a command written
    for a bigger machine, ``--threads 2``, working on one core); tens of thousands crashed the
    process (``--threads 99999``: "can't start new thread" in the weight loader, a segfault).

    Raises:
        argparse.ArgumentTypeError: not an int, < 1, or more than 4 x ``os.cpu_count()``.
    """
    value = positive_int(text)
    cpus = os.cpu_count() or 1
    if value > 4 * cpus:
        raise argparse.ArgumentTypeError(
            f"must be at most {4 * cpus} (4 per CPU; this machine has {cpus}), got {value}"
        )
    return value


def non_negative_float(text: str) -> float:
    """``argparse`` type: a finite float >= 0.

    Raises:
        argparse.ArgumentTypeError: not a number, negative or not finite.
    """
    try:
        value = float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from e
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """``argparse`` type: a finite float > 0.

    Raises:
        argparse.ArgumentTypeError: not a number, not positive or not finite.
    """
    try:
        value = float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from e
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
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


def sampling_arg(name: str, parse: type[int] | type[float]):
    """An ``argparse`` type for the :class:`~minirad.engine.sampling_params.SamplingParams` field
    ``name``: ``parse(text)``, checked by ``SamplingParams`` itself (torch-free, so a bad flag
    is refused before the engine import).

    The returned function raises ``argparse.ArgumentTypeError`` (argparse prints it and
    exits 2) for text ``parse`` refuses or a value out of range.
    """

    def convert(text: str) -> int | float:
        try:
            value = parse(text)
        except ValueError as e:
            kind = "an integer" if parse is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}") from e
        try:
            SamplingParams(**{name: value})
        except RequestError as e:  # "temperature must be ...": argparse names the flag
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{name} ")) from e
        return value

    return convert
