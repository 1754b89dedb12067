"""``minirad generate``: answer one prompt about images, printed whole or streamed.

One request on a fresh engine: there is no queue to order and nothing to evict, so it takes
neither policy flag (``batch`` and ``serve`` do). Why the answer stopped goes to stderr
(:func:`~minirad.entrypoints.commands.notes.finish_note`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minirad.engine.sampling_params import SamplingParams
from minirad.entrypoints.argtypes import positive_int, prompt_text, sampling_arg
from minirad.entrypoints.commands.inputs import (
    NO_IMAGE_WARNING,
    SAMPLING_FIELDS,
    check_image,
    check_model_dir,
    check_prompt,
    image_token,
    images_note,
    load_schema,
    warn,
)
from minirad.entrypoints.commands.loading import engine_request, load_engine
from minirad.entrypoints.commands.notes import finish_note
from minirad.entrypoints.commands.options import DefaultsHelpFormatter, add_model_options

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``generate`` subparser, its ``run`` set."""
    g = subparsers.add_parser(
        "generate", help="answer one prompt", formatter_class=DefaultsHelpFormatter
    )
    add_model_options(g)
    g.add_argument(
        "--prompt",
        type=prompt_text,
        required=True,
        help="the question (without --raw: no '<image>' in it; the images go before it)",
    )
    g.add_argument(
        "--image",
        action="append",
        default=[],
        help="image file; repeat for several: they go before the question, in this order",
    )
    g.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=32,
        help="at most this many tokens; fewer if the context (max_model_len) fills first",
    )
    temperature = sampling_arg("temperature", float)
    g.add_argument("--temperature", type=temperature, default=0.0, help=">= 0; 0: greedy")
    g.add_argument("--top-k", type=sampling_arg("top_k", int), default=0, help=">= 0; 0: off")
    g.add_argument(
        "--top-p", type=sampling_arg("top_p", float), default=1.0, help="in (0, 1]; 1: off"
    )
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--stream", action="store_true", help="print tokens as they come")
    structured = g.add_argument_group(
        "structured output", "constrain the answer (at most one of these flags)"
    ).add_mutually_exclusive_group()
    structured.add_argument(
        "--json-schema",
        metavar="FILE",
        default=None,
        help="a JSON schema file: the answer is compact JSON valid against it",
    )
    structured.add_argument(
        "--regex", default=None, help="the answer fully matches this regex (Rust regex syntax)"
    )
    structured.add_argument(
        "--choice", nargs="+", default=None, metavar="WORD", help="the answer is one of these"
    )
    g.set_defaults(run=run)
    return g


def run(args: argparse.Namespace) -> int:
    """Check the images, the model folder and the prompt, load the engine, answer; returns 0.

    Raises:
        MiniradError: what a check or the engine refuses (the command prints it as one line).
    """
    images = [Path(p) for p in args.image]
    for p in images:
        check_image(p)
    model_dir = check_model_dir(args.model)
    check_prompt(args.prompt, len(images), args.raw, image_token(model_dir))
    if len(images) > 1 and not args.raw:
        images_note(args.command, model_dir, len(images))
    params = SamplingParams(
        **{k: getattr(args, k) for k in SAMPLING_FIELDS},
        json_schema=None if args.json_schema is None else load_schema(args.json_schema),
        regex=args.regex,
        choice=args.choice,
    )
    engine = load_engine(args)
    request = engine_request(engine, args.prompt, images, args.raw, params)
    if not images:
        warn(args.command, NO_IMAGE_WARNING)
    if args.stream:
        for out in engine.stream(request):
            print(out.new_text, end="", flush=True)
        print()
    else:
        out = engine.generate([request])[0]
        print(out.text)
    print(finish_note(out, params.max_new_tokens, engine.max_model_len, params), file=sys.stderr)
    return 0
