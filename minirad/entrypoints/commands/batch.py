"""``minirad batch``: answer a JSONL file of requests together (continuous batching), then say
what the radix cache and the encoder cache saved over the whole batch.

``batch`` reads one JSON object per line::

    {"prompt": "What colour is the circle?", "images": ["a.png"], "max_new_tokens": 8}

``images`` are paths relative to the JSONL file; the other fields are those of
:data:`~minirad.entrypoints.commands.inputs.JSONL_FIELDS` (sampling, and at most one
structured-output constraint). The whole file is checked before the model loads.
"""

from __future__ import annotations

import argparse

from minirad.entrypoints.argtypes import positive_int
from minirad.entrypoints.commands.batch_stats import run_batch
from minirad.entrypoints.commands.inputs import (
    JSONL_FIELDS,
    NO_IMAGE_WARNING,
    check_model_dir,
    check_prompt,
    image_token,
    images_note,
    load_requests,
    warn,
)
from minirad.entrypoints.commands.loading import engine_request, load_engine
from minirad.entrypoints.commands.notes import finish_note
from minirad.entrypoints.commands.options import (
    DefaultsHelpFormatter,
    add_engine_options,
    add_model_options,
    check_pool,
    engine_settings,
)
from minirad.errors import RequestError

__all__ = ["add_parser", "run"]


class _BatchHelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the flags' help, and the JSONL field table kept one line per field."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``batch`` subparser (its help ends with the JSONL fields), its ``run`` set."""
    width = max(map(len, JSONL_FIELDS))
    b = subparsers.add_parser(
        "batch",
        help="answer a JSONL file of requests",
        formatter_class=_BatchHelpFormatter,
        epilog="JSONL fields, one JSON object per line:\n"
        + "\n".join(f"  {k:<{width}}  {v}" for k, v in JSONL_FIELDS.items()),
    )
    add_model_options(b)
    b.add_argument("requests", help="JSONL file: one request object per line")
    b.add_argument("--max-new-tokens", type=positive_int, default=32, help="unless a line sets it")
    add_engine_options(b)
    b.set_defaults(run=run)
    return b


def run(args: argparse.Namespace) -> int:
    """Check the file and its images, load the engine, run every request; print each answer
    with its finish note, then the batch's
    :class:`~minirad.entrypoints.commands.batch_stats.BatchStats`; returns 0.

    Raises:
        MiniradError: what a check or the engine refuses, naming the file's line.
    """
    check_pool(args)
    lines = load_requests(args.requests, args.max_new_tokens)
    model_dir = check_model_dir(args.model)
    placeholder = image_token(model_dir)
    for line in lines:
        check_prompt(line.prompt, len(line.images), args.raw, placeholder, f"{line.where}: ")
        if len(line.images) > 1 and not args.raw:
            images_note(args.command, model_dir, len(line.images), f"{line.where}: ")
    engine = load_engine(args, **engine_settings(args))
    requests = [
        engine_request(engine, line.prompt, line.images, args.raw, line.params) for line in lines
    ]
    for line in lines:
        if not line.images:
            warn(args.command, f"{line.where}: {NO_IMAGE_WARNING}")
    try:
        outs, stats = run_batch(engine, requests, [f"{line.where}: " for line in lines])
    except RequestError as e:
        if "KV slots" not in str(e):  # the pool is too small for the request
            raise
        raise RequestError(f"{e}; raise --num-kv-slots (now {args.num_kv_slots})") from e
    for i, (line, out) in enumerate(zip(lines, outs, strict=True)):
        about = f" ({', '.join(p.name for p in line.images)})" if line.images else ""
        note = finish_note(out, line.params.max_new_tokens, engine.max_model_len, line.params)
        print(f"[{i}] {line.prompt}{about}\n    -> {out.text}\n    {note}")
    print()
    print(stats.format())
    return 0
