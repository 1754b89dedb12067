"""The ``minirad`` command: ask the course's tiny VLM about images: a prompt, a batch, over HTTP.

Usage::

    minirad generate --image data/images/orange_square.png --prompt "What colour is the square?"
    minirad generate --image a.png --prompt "Describe the image." --stream --temperature 0.8
    minirad generate --image a.png --prompt "List the shapes as JSON." --json-schema shapes.json
    minirad generate --image a.png --prompt "What colour is the circle?" --choice red blue
    minirad batch requests.jsonl --prefix-strategy radix --page-size 4
    minirad serve --port 8000   # an OpenAI-compatible HTTP server (entrypoints/openai/)

``batch`` reads one JSON object per line::

    {"prompt": "What colour is the circle?", "images": ["a.png"], "max_new_tokens": 8}

``images`` are paths relative to the JSONL file; the optional sampling fields are those of
:class:`~minirad.engine.SamplingParams` (``max_new_tokens``, ``temperature``, ``top_k``,
``top_p``, ``seed``) and at most one structured-output constraint (``json_schema``: the
schema object itself, ``regex``: a string, ``choice``: a list of strings). It prints every
answer with its finish reason, then what the radix cache and the encoder cache saved over the
whole batch (the engine's :class:`~minirad.engine.EngineStats`).

The rules for prompts, images and structured output, and what the commands print, are in
``docs/serving.md`` ("What the commands check").
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from minirad.engine.sampling_params import SamplingParams
from minirad.entrypoints.argtypes import (
    DTYPES,
    non_negative_float,
    port,
    positive_float,
    positive_int,
    prompt_text,
    sampling_arg,
    thread_count,
)
from minirad.entrypoints.chat_utils import chat_prompt
from minirad.errors import (
    GrammarError,
    ImageError,
    InvalidArgumentError,
    MiniradError,
    RequestError,
)
from minirad.kvcache.eviction import POLICIES as EVICTION_POLICIES
from minirad.kvcache.tiers import DEFAULT_HICACHE_RATIO, WRITE_POLICIES
from minirad.peers.vllm_server import DEFAULT_MODEL_DIR

CACHE_DESIGNS = ("radix", "block")  # explain_trace.CACHE_DESIGNS, named without torch here

if TYPE_CHECKING:  # the engine imports torch and transformers: only the commands load it
    from minirad.engine import GenerateRequest, LLMEngine, RequestOutput

__all__ = [
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

# The per-request fields a JSONL line may set (besides "prompt" and "images").
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")
# The structured-output constraints (SamplingParams' names, at most one per request).
STRUCTURED_FIELDS = ("json_schema", "regex", "choice")
# What each JSONL field holds, for `minirad batch --help` and the unknown-field message.
JSONL_FIELDS = {
    "prompt": "the question (required; a non-space character; no '<image>' without --raw)",
    "images": "list of image paths, relative to the JSONL file, placed before the question",
    "max_new_tokens": "int >= 1 (default: --max-new-tokens)",
    "temperature": "float >= 0 (0: greedy, the default)",
    "top_k": "int >= 0 (0: off)",
    "top_p": "float in (0, 1] (1: off)",
    "seed": "int: this request's own sampling seed",
    "json_schema": "JSON schema object: the answer is compact JSON valid against it",
    "regex": "string: the answer fully matches this regex (Rust regex syntax)",
    "choice": "list of strings: the answer is one of them",
}
# The engine's choices (minirad.engine.PREFIX_STRATEGIES and POLICIES), spelled here so that
# --help and a bad choice answer without importing torch; test_cli checks they agree.
PREFIX_STRATEGIES = ("radix", "truncate", "none")
SCHEDULING_POLICIES = ("fcfs", "lpm")
# The shipped model's training prompts hold one image each (minirad.course.train: the user turn is
# one image item, then the question), so several images are outside what it learned.
ONE_IMAGE_MODEL = DEFAULT_MODEL_DIR.resolve()
NO_IMAGE_WARNING = (
    "no image given: the model answers from the text alone (minirad's models are VLMs; "
    "the course's tiny model was trained on image questions only)"
)


def check_image(path: Path, where: str = "", written: str | None = None) -> None:
    """Refuse an image that the engine could not read, before the model loads (seconds).

    Only the header is read (:func:`minirad.engine.media.probe_image`). The message starts with
    ``where`` (``"requests.jsonl:3: "``) and shows the path as ``written`` (default
    ``str(path)``) and, if that differs, as resolved.

    Raises:
        ImageError: ``path`` is missing, a directory or another non-regular file (a FIFO
            would block the reader), not a PNG, JPEG, WebP, GIF or BMP image, or refused by
            :func:`minirad.engine.media.check_image_size` (too many pixels, too thin).
    """
    from minirad.engine.media import (
        probe_image,  # Pillow: only the commands that read images need it
    )

    written = str(path) if written is None else written
    shown = repr(written)
    if str(path.resolve()) != written:
        shown += f" (resolved: {str(path.resolve())!r})"
    if path.is_dir():
        raise ImageError(f"{where}image {shown} is a directory, not an image file")
    if not path.exists():
        raise ImageError(f"{where}image {shown} not found")
    if not path.is_file():
        raise ImageError(f"{where}image {shown} is not a regular file")
    try:
        probe_image(path, shown).close()
    except ImageError as e:
        raise ImageError(f"{where}{e}") from e


def check_model_dir(model: str | Path) -> Path:
    """The model folder ``model``, checked before the engine import (seconds).

    Raises:
        InvalidArgumentError: ``model`` is not a folder, or has no ``config.json`` (not a
            Hugging Face model folder).
    """
    path = Path(model)
    if not path.is_dir():
        raise InvalidArgumentError(f"model folder {str(model)!r} not found")
    if not (path / "config.json").is_file():
        raise InvalidArgumentError(
            f"model folder {str(model)!r} has no config.json: not a Hugging Face model folder "
            "(pass --model a folder saved with save_pretrained)"
        )
    return path


def _image_token(model_dir: Path) -> str | None:
    """The processor's image placeholder (``"<image>"``) as saved in ``model_dir``, read from
    its JSON files rather than by loading the processor (which imports transformers)."""
    for name in ("processor_config.json", "tokenizer_config.json"):
        try:
            token = json.loads((model_dir / name).read_text(encoding="utf-8")).get("image_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(token, str) and token:
            return token
    return None


def check_prompt(
    prompt: str, num_images: int, raw: bool, placeholder: str | None, where: str = ""
) -> None:
    """Refuse a prompt whose placeholders do not fit its images, before the model loads.

    A plain prompt must not hold ``placeholder`` (the chat template adds one per image); a
    ``raw`` one must hold exactly ``num_images`` of them. No check when ``placeholder`` is
    None (a model folder without it saved). ``where`` prefixes the message.

    Raises:
        RequestError: the prompt breaks the rule for its mode.
    """
    if placeholder is None:
        return
    count = prompt.count(placeholder)
    if not raw and count:
        raise RequestError(
            f"{where}the prompt contains {placeholder!r}: without --raw the images go "
            f"before the question, one per image; remove it, or pass --raw with a "
            f"fully templated prompt"
        )
    if raw and count != num_images:
        raise RequestError(
            f"{where}the prompt has {count} {placeholder!r} placeholder(s) but {num_images} "
            f"image(s) were given: with --raw the prompt needs one {placeholder!r} per image"
        )


def _images_note(command: str, model_dir: Path, num_images: int, where: str = "") -> None:
    """Say on stderr how several images of a plain prompt are placed (and, for the shipped
    model, that it learned one image per prompt)."""
    note = (
        f"{where}{num_images} images go before the question, in the order given (first image first)"
    )
    if model_dir.resolve() == ONE_IMAGE_MODEL:
        note += f"; {ONE_IMAGE_MODEL.name} was trained on one image per prompt"
    print(f"minirad {command}: note: {note}", file=sys.stderr)


def _warn(command: str, message: str) -> None:
    print(f"minirad {command}: warning: {message}", file=sys.stderr)


class RequestLine(NamedTuple):
    """One request of a JSONL file: where it is (``"requests.jsonl:3"``) and what it asks."""

    where: str
    prompt: str
    images: list[Path]
    params: SamplingParams


def load_requests(path: str | Path, max_new_tokens: int = 32) -> list[RequestLine]:
    """Parse a requests JSONL file: one :class:`RequestLine` per non-blank line, image paths
    resolved against the file's folder, ``max_new_tokens`` unless the line sets it.

    Raises:
        RequestError: unreadable file, or a line that is not a JSON object with a ``prompt``
            string holding a non-space character, a list of string ``images`` and only valid
            sampling fields (the message names the line).
        GrammarError: a line with two constraints, a ``json_schema`` that is not an object,
            an empty ``regex`` or ``choice`` (the message names the line; the grammar itself
            is compiled by the engine).
        ImageError: an image :func:`check_image` refuses (the message names the line).

    The whole file is checked before the engine is imported (which takes seconds).
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise RequestError(f"cannot read {str(path)!r}: {e.strerror}") from e
    checked = []
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
        if unknown := set(obj) - set(JSONL_FIELDS):
            raise RequestError(
                f"{where}: unknown fields {sorted(unknown)}; a line may hold "
                f"{', '.join(JSONL_FIELDS)}"
            )
        prompt, images = obj.get("prompt"), obj.get("images", [])
        if not isinstance(prompt, str) or not prompt.strip():
            raise RequestError(f"{where}: 'prompt' must be a string with a non-space character")
        if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
            raise RequestError(f"{where}: 'images' must be a list of paths")
        fields = {"max_new_tokens": max_new_tokens} | {
            k: obj[k] for k in (*SAMPLING_FIELDS, *STRUCTURED_FIELDS) if k in obj
        }
        try:
            params = SamplingParams(**fields)
        except RequestError as e:  # GrammarError included: the same type, the line named
            raise type(e)(f"{where}: {e}") from None
        paths = [path.parent / p for p in images]
        for written, p in zip(images, paths, strict=True):
            check_image(p, f"{where}: ", written)
        checked.append(RequestLine(where, prompt, paths, params))
    if not checked:
        raise RequestError(f"{path}: no requests")
    return checked


def load_schema(path: str | Path) -> dict:
    """The JSON schema in the file ``path`` (for ``--json-schema``), read before the model
    loads.

    Raises:
        RequestError: the file cannot be read (missing, a directory, not UTF-8).
        GrammarError: the file is not JSON, or its JSON is not an object (a schema is one).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise RequestError(f"cannot read JSON schema file {str(path)!r}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise RequestError(f"cannot read JSON schema file {str(path)!r}: not UTF-8") from e
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(
            f"JSON schema file {str(path)!r} is not JSON: {e.msg} at line {e.lineno} "
            f"column {e.colno}"
        ) from e
    if not isinstance(schema, dict):
        raise GrammarError(
            f"JSON schema file {str(path)!r} holds a {type(schema).__name__}, not a schema object"
        )
    return schema


def _load_engine(args: argparse.Namespace, **settings) -> LLMEngine:
    """The engine over ``args.model`` (a folder :func:`check_model_dir` accepted).

    Raises:
        InvalidArgumentError: no loadable model in the folder; a ``--device`` this machine
            cannot use.
    """
    import torch
    from transformers.utils import logging as hf_logging

    from minirad.engine import LLMEngine, resolve_device

    try:  # before the weights load: a device this machine lacks is refused at once
        resolve_device(args.device)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"--device: {e}") from None
    # The course's models are tiny: a second intra-op thread only adds synchronisation.
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # "Loading weights" bars would bury the answer
    try:
        return LLMEngine.from_pretrained(
            args.model, dtype=getattr(torch, args.dtype), device=args.device, **settings
        )
    except MiniradError:
        raise
    except (OSError, ValueError) as e:  # transformers: no config, weights or processor files
        raise InvalidArgumentError(f"cannot load a model from {str(args.model)!r}: {e}") from e


def _request(
    engine: LLMEngine,
    prompt: str,
    images: Sequence[Path],
    raw: bool,
    params: SamplingParams,
) -> GenerateRequest:
    """The engine request for a CLI prompt (templated unless ``raw``; :func:`check_prompt`
    has checked its placeholders)."""
    from minirad.engine import GenerateRequest

    if not raw:
        prompt = chat_prompt(engine.processor, prompt, len(images))
    return GenerateRequest(prompt, [str(p) for p in images], params)


def finish_note(
    out: RequestOutput,
    max_new_tokens: int,
    max_model_len: int,
    params: SamplingParams | None = None,
) -> str:
    """Why a request's generation stopped, in words: ``"finish_reason: stop (...)"`` or
    ``"finish_reason: length (...)"`` (vLLM's and OpenAI's names), with the token counts.

    ``length`` names its cause: ``max_new_tokens`` reached, or the context full
    (prompt + output tokens == ``max_model_len``) before it. With a constraint in ``params``
    (the request's sampling parameters), a ``length`` note also says what the cut answer is
    (:func:`cut_note`).
    """
    n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
    if out.finish_reason == "length" and n_out < max_new_tokens:
        why = (
            f"the context is full: {n_prompt} prompt + {n_out} output tokens = max_model_len "
            f"{max_model_len}, before max_new_tokens {max_new_tokens}"
        )
    elif out.finish_reason == "length":
        why = f"max_new_tokens {max_new_tokens} reached"
    elif out.finish_reason == "stop":
        why = f"stop token after {n_out} tokens"
    else:
        why = f"{n_out} tokens"
    note = f"finish_reason: {out.finish_reason} ({why})"
    if out.finish_reason == "length" and params is not None:
        if cut := cut_note(out.text, params):
            note += f"; {cut}"
    return note


def cut_note(text: str, params: SamplingParams) -> str | None:
    """What an answer cut at the length limit is with respect to its constraint, or None
    (no constraint).

    The grammar only ever allowed prefixes of valid answers, so a cut answer is usually
    incomplete: JSON that does not parse, or a word that is not (yet) one of the choices.
    A cut answer may also be complete, with only its stop token cut off (the limit fell
    right after the last character); the note then says so. A regex answer is not checked
    here (Python's ``re`` is not the grammar's Rust syntax): the note says it may be partial.
    """
    kind = params.structured_output_kind
    if kind == "json_schema":
        try:
            json.loads(text)
        except ValueError:
            return "the output is cut: it is not valid JSON (raise --max-new-tokens)"
        return "the JSON is complete, only its stop token was cut"
    if kind == "choice":
        if text in params.choice:
            return "the choice is complete, only its stop token was cut"
        return "the output is cut: it is not one of the choices (raise --max-new-tokens)"
    if kind == "regex":
        return "the output is cut: it may be only a prefix of a regex match"
    return None


def _generate(args: argparse.Namespace) -> int:
    images = [Path(p) for p in args.image]
    for p in images:
        check_image(p)
    model_dir = check_model_dir(args.model)
    check_prompt(args.prompt, len(images), args.raw, _image_token(model_dir))
    if len(images) > 1 and not args.raw:
        _images_note(args.command, model_dir, len(images))
    params = SamplingParams(
        **{k: getattr(args, k) for k in SAMPLING_FIELDS},
        json_schema=None if args.json_schema is None else load_schema(args.json_schema),
        regex=args.regex,
        choice=args.choice,
    )
    engine = _load_engine(args)
    request = _request(engine, args.prompt, images, args.raw, params)
    if not images:
        _warn(args.command, NO_IMAGE_WARNING)
    if args.stream:
        for out in engine.stream(request):
            print(out.new_text, end="", flush=True)
        print()
    else:
        out = engine.generate([request])[0]
        print(out.text)
    print(finish_note(out, params.max_new_tokens, engine.max_model_len, params), file=sys.stderr)
    return 0


@dataclass
class BatchStats:
    """What one batch cost and saved (tokens unless named otherwise).

    ``peak_kv_slots`` counts slots held by running requests and by the radix tree together,
    at the moment after an allocation when the pool was fullest. ``cached_tokens`` counts a
    request's prefix hits at its first admission only (vLLM #25787), so the hit rate never
    exceeds 100%; what a preempted request finds again is ``preempted_cached_tokens``.
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
    preempted_cached_tokens: int
    cached_tokens_by_source: dict[str, int] = field(default_factory=dict)

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
        ]
        if set(self.cached_tokens_by_source) - {"device"}:  # a hierarchical cache
            sources = ", ".join(f"{n} {k}" for k, n in self.cached_tokens_by_source.items())
            rows.append(("cached tokens by source", sources))
        rows += [
            ("output tokens", f"{self.output_tokens}"),
            ("encoder calls", f"{self.encoder_calls} made, {self.encoder_hits} saved"),
            (
                "KV slots at peak",
                f"{self.peak_kv_slots} / {self.num_kv_slots} "
                f"({pages} / {total_pages} pages of {self.page_size})",
            ),
            (
                "preemptions",
                f"{self.num_preemptions} ({self.preempted_cached_tokens} tokens found again in "
                "the tree on readmission, not counted as hits)",
            ),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run_batch(
    engine: LLMEngine, requests: Sequence[GenerateRequest], names: Sequence[str] = ()
) -> tuple[list[RequestOutput], BatchStats]:
    """Run ``requests`` together (continuous batching) and measure the batch.

    The engine's counters are read before and after, so an engine that already served
    requests reports only this batch; the peak is taken from the pool's allocation events.

    Raises:
        MiniradError: a request the engine refuses (:meth:`~minirad.engine.LLMEngine.
            add_request`), its message prefixed with its entry of ``names``
            (``"requests.jsonl:3: "``) if given; nothing runs then.
    """
    from minirad.events import AllocEvent, Event

    pool = engine.allocator
    peak = pool.size - pool.available_size()

    def on_event(event: Event) -> None:
        nonlocal peak
        if isinstance(event, AllocEvent):
            peak = max(peak, pool.size - pool.available_size())

    before = engine.stats
    unsubscribe = engine.bus.subscribe(on_event)
    try:
        outs = engine.generate(_named(engine, requests, names))
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
        preempted_cached_tokens=after.preempted_cached_tokens - before.preempted_cached_tokens,
        cached_tokens_by_source={
            k: n - before.cached_tokens_by_source.get(k, 0)
            for k, n in after.cached_tokens_by_source.items()
        },
    )
    return outs, stats


def _named(
    engine: LLMEngine, requests: Sequence[GenerateRequest], names: Sequence[str]
) -> list[GenerateRequest]:
    """``requests``, each first queued alone and aborted again, so that an error names the
    request (``engine.generate`` refuses the batch without saying which one)."""
    for name, request in zip(names, requests, strict=False):
        try:
            rid = engine.add_request(request)
        except MiniradError as e:
            raise type(e)(f"{name}{e}") from e
        engine.abort_request(rid)
    return list(requests)


def _check_pool(args: argparse.Namespace) -> None:
    if args.num_kv_slots % args.page_size:
        raise InvalidArgumentError(
            f"--num-kv-slots {args.num_kv_slots} is not a multiple of --page-size "
            f"{args.page_size}: the pool is whole pages"
        )


def _engine_settings(args: argparse.Namespace) -> dict:
    settings = {
        "prefix_strategy": args.prefix_strategy,
        "page_size": args.page_size,
        "num_kv_slots": args.num_kv_slots,
        "policy": args.policy,
    }
    tier_flags = (args.hicache_ratio, args.hicache_write_policy, args.hicache_storage_dir)
    if not args.enable_hierarchical_cache:
        if any(v is not None for v in tier_flags):
            raise InvalidArgumentError("the --hicache-* options need --enable-hierarchical-cache")
        return settings
    ratio, policy, folder = tier_flags
    settings["hicache_ratio"] = DEFAULT_HICACHE_RATIO if ratio is None else ratio
    settings["hicache_write_policy"] = policy or "write_through"
    if folder is not None:
        settings["hicache_storage_dir"] = folder
    return settings


def _batch(args: argparse.Namespace) -> int:
    _check_pool(args)
    lines = load_requests(args.requests, args.max_new_tokens)
    model_dir = check_model_dir(args.model)
    placeholder = _image_token(model_dir)
    for line in lines:
        check_prompt(line.prompt, len(line.images), args.raw, placeholder, f"{line.where}: ")
        if len(line.images) > 1 and not args.raw:
            _images_note(args.command, model_dir, len(line.images), f"{line.where}: ")
    engine = _load_engine(args, **_engine_settings(args))
    requests = [_request(engine, line.prompt, line.images, args.raw, line.params) for line in lines]
    for line in lines:
        if not line.images:
            _warn(args.command, f"{line.where}: {NO_IMAGE_WARNING}")
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


def _serve(args: argparse.Namespace) -> int:
    _check_pool(args)
    # vLLM serves a model under its --model string; the shipped one under its folder name
    # (its default path is absolute, different on every machine).
    name = args.served_model_name or args.model or DEFAULT_MODEL_DIR.name
    # /server_info and /v1/models show the model path as the user gave it, and the shipped
    # model's by its name: never the server's own folders.
    shown_path = args.model or DEFAULT_MODEL_DIR.name
    args.model = args.model or str(DEFAULT_MODEL_DIR)
    check_model_dir(args.model)
    if not Path(args.allowed_local_media_path).is_dir():
        raise InvalidArgumentError(
            f"--allowed-local-media-path {args.allowed_local_media_path!r} is not a folder"
        )
    events = {
        "kv_events_endpoint": _kv_events_endpoint(args.kv_events_endpoint),
        "kv_events_replay_endpoint": _kv_events_endpoint(args.kv_events_replay_endpoint),
    }
    if args.kv_events_block_size is not None:
        events["kv_events_block_size"] = args.kv_events_block_size
    if args.kv_events_endpoint is None and (
        args.kv_events_replay_endpoint is not None or args.kv_events_block_size is not None
    ):
        raise InvalidArgumentError("the --kv-events-* options need --kv-events-endpoint")
    _check_port_free(args.host, args.port)  # before the model loads, not after
    engine = _load_engine(args, **_engine_settings(args), **events)
    if (publisher := engine.kv_event_publisher) is not None:  # a '*' port is known only now
        replay = f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else ""
        print(f"minirad serve: KV events on {publisher.endpoint}{replay}", file=sys.stderr)
    from minirad.entrypoints.openai.api_server import (
        run_server,  # FastAPI and uvicorn: only this command needs them
    )

    run_server(
        engine,
        host=args.host,
        port=args.port,
        served_model_name=name,
        model_path=shown_path,
        allowed_local_media_path=args.allowed_local_media_path,
        shutdown_timeout_s=args.shutdown_timeout,
    )
    return 0


def _explain(args: argparse.Namespace) -> int:
    from minirad.entrypoints.explain import run_explain

    return run_explain(args)


def _kv_events_endpoint(value: str | None) -> str | None:
    """A bare port means that port on loopback (``"5557"``: ``"tcp://127.0.0.1:5557"``)."""
    if value is not None and value.isdigit():
        return f"tcp://127.0.0.1:{value}"
    return value


def _check_port_free(host: str, port: int) -> None:
    """Raises InvalidArgumentError if ``host:port`` cannot be listened on (in use, or not an
    address of this machine). uvicorn binds again afterwards, with the same SO_REUSEADDR."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as e:
        raise InvalidArgumentError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="local model folder")
    p.add_argument(
        "--raw",
        action="store_true",
        help="send prompts as written (already templated, with image placeholders)",
    )
    p.add_argument("--threads", type=thread_count, default=1, help="torch intra-op threads")
    _add_device_options(p)


def _add_device_options(p: argparse.ArgumentParser) -> None:
    """Where the engine runs and in which dtype (every command that loads the model)."""
    p.add_argument(
        "--device",
        default="cpu",
        help="where the model and the KV pool live: cpu, cuda, cuda:1, mps (checked before "
        "the model loads)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="the model's dtype, and so the KV pool's: bfloat16 halves their memory (answers "
        "may then differ from float32's where two tokens are nearly tied)",
    )


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the flags' help, except None: those flags' help says what unset means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


class _BatchHelpFormatter(_DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the flags' help, and the JSONL field table kept one line per field."""


def build_parser() -> argparse.ArgumentParser:
    """The ``minirad`` parser: ``generate``, ``batch`` and ``serve`` subcommands."""
    parser = argparse.ArgumentParser(prog="minirad", description="serve the minirad tiny VLM")
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = _DefaultsHelpFormatter

    g = sub.add_parser("generate", help="answer one prompt", formatter_class=fmt)
    _add_common(g)
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
    g.set_defaults(run=_generate)

    width = max(map(len, JSONL_FIELDS))
    b = sub.add_parser(
        "batch",
        help="answer a JSONL file of requests",
        formatter_class=_BatchHelpFormatter,
        epilog="JSONL fields, one JSON object per line:\n"
        + "\n".join(f"  {k:<{width}}  {v}" for k, v in JSONL_FIELDS.items()),
    )
    _add_common(b)
    b.add_argument("requests", help="JSONL file: one request object per line")
    b.add_argument("--max-new-tokens", type=positive_int, default=32, help="unless a line sets it")
    _add_engine_options(b)
    b.set_defaults(run=_batch)

    s = sub.add_parser(
        "serve",
        help="serve the model over HTTP (OpenAI-compatible API, as vllm serve)",
        formatter_class=fmt,
        description="An OpenAI-compatible server (minirad.entrypoints.openai.api_server): "
        "/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics (vLLM's metric "
        "names), /tokenize, /detokenize, /reset_prefix_cache (vLLM's), /server_info, "
        "/model_info (SGLang's).",
    )
    s.add_argument(
        "--model",
        default=None,
        help=f"local model folder (default: the shipped {DEFAULT_MODEL_DIR.name}, served under "
        "that name)",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=port, default=8000, help="port to listen on")
    s.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send and /v1/models lists (default: --model as given)",
    )
    s.add_argument(
        "--allowed-local-media-path",
        default=".",
        metavar="DIR",
        help="image file paths must lie in this folder ('.' is the folder the server is "
        "started in; '/' allows any readable path)",
    )
    s.add_argument("--threads", type=thread_count, default=1, help="torch intra-op threads")
    _add_device_options(s)
    s.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=5.0,
        metavar="SECONDS",
        help="on SIGTERM / Ctrl-C, how long requests in flight may take to finish; then they "
        "end with a 503 and the server exits",
    )
    _add_engine_options(s)
    events = s.add_argument_group(
        "KV events",
        "publish the radix tree's blocks as vLLM KV events over ZMQ (off by default). The "
        "events carry every cached prompt's token ids: a loopback address keeps them on this "
        "machine, while '*' as the host (tcp://*:5557, vLLM's example) listens on every "
        "network interface, for anyone who can reach the port.",
    )
    events.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="URL",
        help="PUB socket (vLLM's KVEventsConfig.endpoint): a port alone (5557) or "
        "tcp://127.0.0.1:5557 listens on loopback, tcp://127.0.0.1:* on a free loopback port "
        "(printed at start); another host is connected to, as vLLM does",
    )
    events.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="URL",
        help="replay ROUTER socket (vLLM's replay_endpoint), always listened on: a port alone "
        "(5558) or tcp://127.0.0.1:5558 on loopback",
    )
    events.add_argument(
        "--kv-events-block-size",
        type=positive_int,
        default=None,
        help="tokens per published block (default: vLLM's CPU block size, 32)",
    )
    s.set_defaults(run=_serve)

    x = sub.add_parser(
        "explain",
        help="why each request of a trace hit or missed the cache (no model run)",
        formatter_class=fmt,
        description="Replay a JSONL trace, one request at a time, through a radix cache "
        "(SGLang's) or a block cache (vLLM's) and label every prompt token with its cause: "
        "hit, last_token, evicted, block_floor, first_seen (minirad.kv_events.miss_causes). "
        'Lines: {"prompt_token_ids": [...]} or {"messages": [...]} (OpenAI chat; needs '
        "--model's processor, not its weights). Or, with --from-recording, a real vLLM or "
        "SGLang session: its KV events and each response's cached_tokens, no replay; what they "
        "cannot explain is labelled unknown (minirad.kv_events.explain_events). The report "
        "names the requests r1, r2, ... in the order they were sent (chapter 08's names); with "
        "--json, a line's \"request\" counts from 0 (as do its runs' by_request) and its "
        '"label" is r1, r2, ...',
    )
    x.add_argument(
        "trace",
        nargs="?",
        help="JSONL file: one request per line (default: none; give a trace or --from-recording)",
    )
    x.add_argument(
        "--from-recording",
        metavar="PATH",
        help="a recorded real-server session instead of a trace: PATH_outputs.json and "
        "PATH_events.jsonl (e.g. data/recordings/vllm_ch08); the cache options do not apply "
        "(default: none, a trace)",
    )
    x.add_argument("--cache", choices=CACHE_DESIGNS, default="radix", help="cache design")
    x.add_argument("--capacity", type=positive_int, default=4096, help="cache size in tokens")
    x.add_argument("--page-size", type=positive_int, default=1, help="radix cache page size")
    x.add_argument("--block-size", type=positive_int, default=16, help="block cache block size")
    x.add_argument(
        "--policy", choices=tuple(EVICTION_POLICIES), default="lru", help="radix cache eviction"
    )
    x.add_argument(
        "--model",
        default=None,
        help="model folder whose chat template and processor render the trace's chat lines "
        f"(default: the shipped {DEFAULT_MODEL_DIR.name}; not needed for token-id lines)",
    )
    x.add_argument("--json", action="store_true", help="one JSON line per request")
    x.set_defaults(run=_explain)
    return parser


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    """The engine settings that ``batch`` and ``serve`` share."""
    p.add_argument(
        "--prefix-strategy",
        choices=PREFIX_STRATEGIES,
        default="radix",
        help="reuse of cached prompt KV: radix (the longest cached prefix, images included, "
        "SGLang's RadixAttention), truncate (only the text before the first image), none",
    )
    p.add_argument("--page-size", type=positive_int, default=1, help="tokens per KV page")
    p.add_argument("--num-kv-slots", type=positive_int, default=4096, help="KV pool in tokens")
    p.add_argument("--policy", choices=SCHEDULING_POLICIES, default="fcfs", help="scheduling order")
    tiers = p.add_argument_group("hierarchical cache (SGLang's HiCache: device -> host -> disk)")
    tiers.add_argument(
        "--enable-hierarchical-cache",
        action="store_true",
        help="back the radix tree's KV up to a host pool and load it back on a match",
    )
    tiers.add_argument(
        "--hicache-ratio",
        type=positive_float,
        default=None,
        help=f"host pool size over the device pool (default {DEFAULT_HICACHE_RATIO:g})",
    )
    tiers.add_argument(
        "--hicache-write-policy",
        choices=WRITE_POLICIES,
        default=None,
        help="when the host gets a copy (default write_through)",
    )
    tiers.add_argument(
        "--hicache-storage-dir",
        default=None,
        help="a folder for the disk tier: one safetensors file per page, found again by the "
        "next engine of the same model",
    )


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
