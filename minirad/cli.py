"""The ``minirad`` command: ask the course's tiny VLM about images, one prompt or a batch.

Usage::

    minirad generate --image data/images/orange_square.png --prompt "What colour is the square?"
    minirad generate --image a.png --prompt "Describe the image." --stream --temperature 0.8
    minirad batch requests.jsonl --prefix-strategy radix --page-size 4

``batch`` reads one JSON object per line::

    {"prompt": "What colour is the circle?", "images": ["a.png"], "max_new_tokens": 8}

``images`` are paths relative to the JSONL file; the optional sampling fields are those of
:class:`~minirad.engine.SamplingParams` (``max_new_tokens``, ``temperature``, ``top_k``,
``top_p``, ``seed``). It prints every answer, then what the radix cache and the encoder cache
saved over the whole batch (the engine's :class:`~minirad.engine.EngineStats`).

A plain prompt is wrapped in the model's chat template with one image item per image, as
vLLM's and SGLang's chat endpoints do (``--raw`` sends it as written: it must then hold the
image placeholders itself). Any error (missing model or image, bad JSONL line, bad setting)
prints one line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from .argtypes import positive_int
from .engine import (
    POLICIES,
    PREFIX_STRATEGIES,
    GenerateRequest,
    LLMEngine,
    RequestOutput,
    SamplingParams,
)
from .errors import ImageError, InvalidArgumentError, MiniradError, RequestError
from .events import AllocEvent, Event
from .models import DEFAULT_MODEL_DIR

__all__ = ["BatchStats", "build_parser", "chat_prompt", "load_requests", "main"]

# The per-request fields a JSONL line may set (besides "prompt" and "images").
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")


def chat_prompt(processor, prompt: str, num_images: int) -> str:
    """``prompt`` as the user turn of the processor's chat template: ``num_images`` image
    items, then the text, then the assistant header (``add_generation_prompt``).

    Raises:
        RequestError: the processor has no chat template (use ``--raw``).
    """
    if getattr(processor, "chat_template", None) is None:
        raise RequestError("the model's processor has no chat template; pass --raw")
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": prompt}]
    return processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


def _check_images(paths: Sequence[Path]) -> None:
    """Fail before the model loads (seconds) if an image file is missing."""
    for p in paths:
        if not p.is_file():
            raise ImageError(f"image {str(p)!r} not found")


def load_requests(
    path: str | Path, max_new_tokens: int = 32
) -> list[tuple[str, list[Path], SamplingParams]]:
    """Parse a requests JSONL file: ``(prompt, image paths, sampling params)`` per non-blank
    line, image paths resolved against the file's folder, ``max_new_tokens`` unless the line
    sets it.

    Raises:
        RequestError: unreadable file, or a line that is not a JSON object with a non-empty
            string ``prompt``, a list of string ``images`` and only valid sampling fields
            (the message names the line).
        ImageError: an image file does not exist.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise RequestError(f"cannot read {str(path)!r}: {e.strerror}") from e
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise RequestError(f"{where}: not valid JSON ({e.msg})") from e
        if not isinstance(obj, dict):
            raise RequestError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if unknown := set(obj) - {"prompt", "images", *SAMPLING_FIELDS}:
            raise RequestError(f"{where}: unknown fields {sorted(unknown)}")
        prompt, images = obj.get("prompt"), obj.get("images", [])
        if not isinstance(prompt, str) or not prompt:
            raise RequestError(f"{where}: 'prompt' must be a non-empty string")
        if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
            raise RequestError(f"{where}: 'images' must be a list of paths")
        try:
            params = SamplingParams(
                **{"max_new_tokens": max_new_tokens}
                | {k: obj[k] for k in SAMPLING_FIELDS if k in obj}
            )
        except RequestError as e:
            raise RequestError(f"{where}: {e}") from e
        paths = [path.parent / p for p in images]
        _check_images(paths)
        out.append((prompt, paths, params))
    if not out:
        raise RequestError(f"{path}: no requests")
    return out


def _load_engine(args: argparse.Namespace, **settings) -> LLMEngine:
    """The engine over ``args.model``.

    Raises:
        InvalidArgumentError: no such folder, or no loadable model in it.
    """
    if not Path(args.model).is_dir():
        raise InvalidArgumentError(f"model folder {str(args.model)!r} not found")
    # The course's models are tiny: a second intra-op thread only adds synchronisation.
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # "Loading weights" bars would bury the answer
    try:
        return LLMEngine.from_pretrained(args.model, **settings)
    except MiniradError:
        raise
    except (OSError, ValueError) as e:  # transformers: no config, weights or processor files
        raise InvalidArgumentError(f"cannot load a model from {str(args.model)!r}: {e}") from e


def _request(
    engine: LLMEngine, prompt: str, images: Sequence[Path], raw: bool, params: SamplingParams
) -> GenerateRequest:
    text = prompt if raw else chat_prompt(engine.processor, prompt, len(images))
    return GenerateRequest(text, [str(p) for p in images], params)


def _generate(args: argparse.Namespace) -> int:
    images = [Path(p) for p in args.image]
    _check_images(images)
    params = SamplingParams(**{k: getattr(args, k) for k in SAMPLING_FIELDS})
    engine = _load_engine(args)
    request = _request(engine, args.prompt, images, args.raw, params)
    if args.stream:
        for out in engine.stream(request):
            print(out.new_text, end="", flush=True)
        print()
    else:
        print(engine.generate([request])[0].text)
    return 0


@dataclass
class BatchStats:
    """What one batch cost and saved (tokens unless named otherwise).

    ``peak_kv_slots`` counts slots held by running requests and by the radix tree together,
    at the moment after an allocation when the pool was fullest.
    """

    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    output_tokens: int
    encoder_calls: int
    encoder_hits: int
    peak_kv_slots: int
    num_kv_slots: int
    page_size: int
    num_preemptions: int

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def format(self) -> str:
        pages = -(-self.peak_kv_slots // self.page_size)
        total_pages = self.num_kv_slots // self.page_size
        rows = [
            ("requests", f"{self.num_requests}"),
            ("prompt tokens", f"{self.prompt_tokens}"),
            (
                "prefix hit rate",
                f"{self.hit_rate:.1%} ({self.cached_tokens} cached / {self.prompt_tokens})",
            ),
            ("prefill tokens", f"{self.prefill_tokens} computed, {self.cached_tokens} saved"),
            ("output tokens", f"{self.output_tokens}"),
            ("encoder calls", f"{self.encoder_calls} made, {self.encoder_hits} saved"),
            (
                "KV slots at peak",
                f"{self.peak_kv_slots} / {self.num_kv_slots} "
                f"({pages} / {total_pages} pages of {self.page_size})",
            ),
            ("preemptions", f"{self.num_preemptions}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run_batch(
    engine: LLMEngine, requests: Sequence[GenerateRequest]
) -> tuple[list[RequestOutput], BatchStats]:
    """Run ``requests`` together (continuous batching) and measure the batch.

    The engine's counters are read before and after, so an engine that already served
    requests reports only this batch; the peak is taken from the pool's allocation events.
    """
    pool = engine.allocator
    peak = pool.size - pool.available_size()

    def on_event(event: Event) -> None:
        nonlocal peak
        if isinstance(event, AllocEvent):
            peak = max(peak, pool.size - pool.available_size())

    before = engine.stats
    unsubscribe = engine.bus.subscribe(on_event)
    try:
        outs = engine.generate(list(requests))
    finally:
        unsubscribe()
    after = engine.stats
    stats = BatchStats(
        num_requests=len(outs),
        prompt_tokens=sum(o.stats.prompt_tokens for o in outs),
        cached_tokens=after.cached_tokens - before.cached_tokens,
        prefill_tokens=after.prefill_tokens - before.prefill_tokens,
        output_tokens=sum(len(o.token_ids) for o in outs),
        encoder_calls=after.encoder_calls - before.encoder_calls,
        encoder_hits=after.encoder_hits - before.encoder_hits,
        peak_kv_slots=peak,
        num_kv_slots=pool.size,
        page_size=pool.page_size,
        num_preemptions=after.num_preemptions - before.num_preemptions,
    )
    return outs, stats


def _batch(args: argparse.Namespace) -> int:
    lines = load_requests(args.requests, args.max_new_tokens)
    engine = _load_engine(
        args,
        prefix_strategy=args.prefix_strategy,
        page_size=args.page_size,
        num_kv_slots=args.num_kv_slots,
        policy=args.policy,
    )
    requests = [
        _request(engine, prompt, images, args.raw, params) for prompt, images, params in lines
    ]
    outs, stats = run_batch(engine, requests)
    for i, ((prompt, images, _), out) in enumerate(zip(lines, outs, strict=True)):
        about = f" ({', '.join(p.name for p in images)})" if images else ""
        print(f"[{i}] {prompt}{about}\n    -> {out.text}")
    print()
    print(stats.format())
    return 0


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="local model folder")
    p.add_argument(
        "--raw",
        action="store_true",
        help="send prompts as written (already templated, with image placeholders)",
    )
    p.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads")


def build_parser() -> argparse.ArgumentParser:
    """The ``minirad`` parser: ``generate`` and ``batch`` subcommands."""
    parser = argparse.ArgumentParser(prog="minirad", description="serve the minirad tiny VLM")
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter

    g = sub.add_parser("generate", help="answer one prompt", formatter_class=fmt)
    _add_common(g)
    g.add_argument("--prompt", required=True, help="the question")
    g.add_argument("--image", action="append", default=[], help="image file (repeat for several)")
    g.add_argument("--max-new-tokens", type=positive_int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=0, help="0: off")
    g.add_argument("--top-p", type=float, default=1.0, help="1: off")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--stream", action="store_true", help="print tokens as they come")
    g.set_defaults(run=_generate)

    b = sub.add_parser("batch", help="answer a JSONL file of requests", formatter_class=fmt)
    _add_common(b)
    b.add_argument("requests", help="JSONL file: one request object per line")
    b.add_argument("--max-new-tokens", type=positive_int, default=32, help="unless a line sets it")
    b.add_argument("--prefix-strategy", choices=PREFIX_STRATEGIES, default="radix")
    b.add_argument("--page-size", type=positive_int, default=1, help="tokens per KV page")
    b.add_argument("--num-kv-slots", type=positive_int, default=4096, help="KV pool in tokens")
    b.add_argument("--policy", choices=POLICIES, default="fcfs", help="scheduling order")
    b.set_defaults(run=_batch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``minirad`` command on ``argv`` (default: the command line); returns the exit
    status. Bad arguments exit through argparse (status 2); library errors print one line on
    stderr and return 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except MiniradError as e:
        message = " ".join(str(e).split())  # one line, even for a multi-line HF message
        print(f"minirad {args.command}: error: {message}", file=sys.stderr)
        return 2
