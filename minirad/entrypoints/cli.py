"""The ``minirad`` command: ask the course's tiny VLM about images: a prompt, a batch, over HTTP;
and why a trace's requests missed the cache.

Usage::

    minirad generate --image data/images/orange_square.png --prompt "What colour is the square?"
    minirad generate --image a.png --prompt "Describe the image." --stream --temperature 0.8
    minirad generate --image a.png --prompt "List the shapes as JSON." --json-schema shapes.json
    minirad generate --image a.png --prompt "What colour is the circle?" --choice red blue
    minirad batch requests.jsonl --prefix-strategy radix --page-size 4 --schedule-policy lpm
    minirad serve --port 8000 --radix-eviction-policy slru  # OpenAI-compatible (openai/)
    minirad explain trace.jsonl --capacity 4096 --page-size 16

Each subcommand is a module of :mod:`minirad.entrypoints.commands` that builds its subparser
and runs it; the flags several share (the model, the device, the engine's settings and its two
policies, ``--schedule-policy`` and ``--radix-eviction-policy`` as SGLang names them) are
defined once, in :mod:`~minirad.entrypoints.commands.options`. The rules for prompts, images
and structured output, and what the commands print, are in ``docs/serving.md`` ("What the
commands check").

The names below :func:`main` are imported from the command modules, where they now live, so
that code written against this module keeps working.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from minirad.entrypoints.commands import batch, explain, generate, serve
from minirad.entrypoints.commands.batch_stats import BatchStats, run_batch
from minirad.entrypoints.commands.inputs import (
    RequestLine,
    check_image,
    check_model_dir,
    check_prompt,
    load_requests,
    load_schema,
)
from minirad.entrypoints.commands.notes import cut_note, finish_note
from minirad.errors import MiniradError

__all__ = [
    "COMMANDS",
    "BatchStats",
    "build_parser",
    "check_image",
    "check_model_dir",
    "check_prompt",
    "cut_note",
    "finish_note",
    "load_requests",
    "load_schema",
    "main",
    "RequestLine",
    "run_batch",
]

# The subcommands, in the order ``minirad --help`` lists them: each module's ``add_parser``
# adds its subparser and sets its ``run``.
COMMANDS = (generate, batch, serve, explain)


def build_parser() -> argparse.ArgumentParser:
    """The ``minirad`` parser: one subparser per module of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(prog="minirad", description="serve the minirad tiny VLM")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``minirad`` command on ``argv`` (default: the command line); returns the exit
    status. Bad arguments exit through argparse (status 2); library errors print one line on
    stderr and return 2; Ctrl-C (while a model loads, say: a serving server has its own
    graceful stop) prints one line and returns 130, as a shell reports SIGINT."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except MiniradError as e:
        message = " ".join(str(e).split())  # one line, even for a multi-line HF message
        print(f"minirad {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"minirad {args.command}: interrupted", file=sys.stderr)
        return 130
