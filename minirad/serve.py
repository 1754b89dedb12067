"""``minirad serve``: our engine behind an OpenAI-compatible HTTP API, as ``vllm serve`` is.

Routers (sglang-router, vllm-router), benchmark clients and the ``openai`` Python client speak
this API to vLLM and SGLang; a server that answers the same requests in the same shapes slots
into the same setups. The web stack is vLLM's: FastAPI on uvicorn.

Three kinds of threads share the work::

    HTTP handlers (asyncio)        input threads (2)              engine thread (the LLMEngine)
      parse and check the body
      --------------------------->  read + decode pictures,
                                    chat template; then
                                    process_inputs: tokenize,
                                    preprocess, compile grammar
      <---------------------------  (or a 400; 10 s at most)
      --add (EngineCoreRequest)---------------------------------->  add_request
      <--ack: the rid, or the typed error it raised---------------
      await outputs: one asyncio.Queue per request  <--out-------  step() while there is work;
        (call_soon_threadsafe)                                      blocks on its inbox when
      client gone / stream closed  --abort----------------------->  idle (no spinning)

Only the engine thread touches the engine, and nothing a client sends is read, decoded or
compiled there: one request's big picture or grammar holds up nobody's step. After each step
it stores a snapshot of the counters, which ``/metrics`` reads (before it hands out that
step's outputs, so a client that got its answer scrapes counters that include it). No request
ends that thread: a failure in a step ends the requests it belongs to (finish reason
``"error"``: a 500 without internals, or an error event in a stream) and the engine goes on.

Endpoints (vLLM's request and response fields, ``vllm/entrypoints/openai/``):

- ``POST /v1/chat/completions``: ``messages`` (roles as the chat template renders them;
  ``content`` a string or a list of ``{"type": "text", "text": ...}`` and ``{"type":
  "image_url", "image_url": {"url": ...}}`` parts, kept in order). An image URL is a
  ``data:image/...;base64,...`` URL, or a local file path (plain or ``file://``, relative to
  the server's working folder, under ``allowed_local_media_path`` if set: a regular file,
  opened once and checked); http(s) URLs are refused (nothing is fetched over the network).
  PNG, JPEG, WebP, GIF and BMP pictures are read, of a sane size (:mod:`minirad.media`).
- ``POST /v1/completions``: ``prompt`` as text (sent as written, no chat template) or one list
  of token ids.
- Both: ``max_tokens`` (chat: also ``max_completion_tokens``; default: until the context is
  full, completions: 16), ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop`` (strings:
  the text ends before the first, or after it with ``include_stop_str_in_output``; a stream
  holds back what could be the start of one), ``stop_token_ids`` (stop on these as well as
  EOS), ``ignore_eos``, ``stream`` with ``stream_options.
  include_usage``, structured output as ``response_format`` (``json_schema``, ``json_object``),
  ``structured_outputs`` (``json``, ``regex``, ``choice``, ``json_object``) or the older
  ``guided_json`` / ``guided_regex`` / ``guided_choice`` (one constraint per request). Unset
  sampling fields take the model's ``generation_config`` values, else OpenAI's defaults
  (temperature 1, as vLLM does): send ``"temperature": 0`` for greedy answers.
  ``n`` (1 to :data:`MAX_N`): that many choices, sampled as separate engine requests of the
  same prompt (vLLM's parallel sampling; with a ``seed``, choice ``i`` draws with
  ``seed + i``), streamed as chunks tagged with their ``index``. Refused with a 400 unless
  set to their off values: the fields of OpenAI's API or vLLM's that would change the answer
  and that the engine does not implement (``UNSUPPORTED``: penalties, ``logit_bias``,
  ``min_tokens``, ``best_of``, ``logprobs``, ``echo``, ``tools``, ``tool_choice``...). Fields
  neither API defines for the endpoint are ignored, as vLLM ignores fields it does not know.
- ``usage`` (in every answer, and in a stream's last chunk with ``include_usage``) has
  ``prompt_tokens_details.cached_tokens``: the prompt tokens the radix tree held for this
  request at its admission (:class:`~minirad.engine.RequestStats`).
- ``POST /tokenize`` (``prompt`` or chat ``messages``: ``{"count", "max_model_len",
  "tokens"}``, the ids a completion would be computed from, each image expanded to its
  placeholders) and ``POST /detokenize`` (``tokens``: ``{"prompt"}``), vLLM's.
- ``GET /v1/models``, ``GET /health`` (200, or 503 once the engine thread has failed),
  ``GET /metrics``: Prometheus text with vLLM 0.32's names (``vllm/v1/metrics/loggers.py``)
  and labels ``model_name``, ``engine``: ``vllm:prefix_cache_queries_total`` /
  ``vllm:prefix_cache_hits_total`` (prompt tokens looked up / found at first admissions),
  ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
  ``vllm:request_success_total{finished_reason}``, ``vllm:num_preemptions_total``, and the
  gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (the pool's share held by unfinished requests; cached slots
  that nothing locks count as free, as vLLM counts them).
- ``GET /server_info``, ``GET /model_info``: SGLang's names for what sglang-router reads when
  it registers a worker (model path, served name, context length, page size).
- ``POST /reset_prefix_cache``: empty the radix tree and the encoder cache (KV events:
  ``AllBlocksCleared``); ``{"success": false}`` while requests are in flight. vLLM serves it
  only with ``VLLM_SERVER_DEV_MODE=1``; benchmarks between runs and routers' tests use it.

Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400
``BadRequestError`` for a request the engine refuses (every typed error of
:mod:`minirad.errors`: malformed JSON, a bad field, text that is not valid Unicode, an
unreadable image, a grammar that does not compile or is too big...), 404 ``NotFoundError``
for a model name this server does not serve (or a path it does not have), 405 for a wrong
method, 413 for a body over :data:`MAX_BODY_BYTES`, 503 while shutting down or once the
engine has stopped, and 500 ``InternalServerError`` for a bug (the log has the traceback; the
body shows none of it). Messages name files relative to the media folder and never show the
server's own folders.

Example::

    minirad serve --port 8000
    curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d \\
      '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url":
        {"url": "data/images/orange_square.png"}}, {"type": "text", "text":
        "What colour is the square?"}]}], "temperature": 0}'
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .cli import chat_template
from .engine import EngineCoreRequest, EngineStats, GenerateRequest, LLMEngine, RequestOutput
from .errors import GrammarError, ImageError, MiniradError, RequestError
from .media import MediaFolder, decode_data_url, open_image
from .sampling_params import SamplingParams

__all__ = [
    "AsyncLLMEngine",
    "ChatCompletionRequest",
    "CompletionRequest",
    "EngineDeadError",
    "EngineSnapshot",
    "RequestStream",
    "Shutdown",
    "build_app",
    "run_server",
]

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ the protocol
MAX_N = 64  # choices per request (n): each is an engine request, so bound what one client asks
# Longest a request's inputs may take to process (pictures read and preprocessed, grammar
# compiled), on the input threads: past it the request gets a 400 and the server goes on.
INPUT_TIMEOUT_S = 10.0
# The largest request body read (413 past it): a data URL of MAX_IMAGE_BYTES, base64'd, fits.
MAX_BODY_BYTES = 64 * 2**20
SHUTDOWN_TIMEOUT_S = 5.0  # on SIGTERM: how long requests in flight may take to finish


MAX_JSON_DEPTH = 64  # nesting of a request body: deeper is refused before anything reads it
# Commas in a request body (about its JSON values): past it the body is refused before it is
# parsed, since parsing and checking ten million numbers would hold the event loop, and so
# every client and /health, for seconds. Far above any context's worth of token ids.
MAX_JSON_VALUES = 200_000


class _Model(BaseModel):
    # Fields minirad does not read are ignored, as vLLM ignores them (it logs them); the
    # ones that would change the answer are refused (_SamplingFields.check_supported).
    model_config = ConfigDict(extra="ignore")


class _Body(_Model):
    """A request body: its text must be valid Unicode, and its nesting sane, everywhere."""

    @model_validator(mode="before")
    @classmethod
    def _check_body(cls, data: Any) -> Any:
        _check_json(data)
        return data


def _check_json(data: Any) -> None:
    """Refuse, with where it is, a string (or key) holding a lone surrogate (``"\\ud800"``
    is valid JSON but no Unicode text: a tokenizer, a regex compiler or a UTF-8 encoder fails
    on it) and nesting deeper than :data:`MAX_JSON_DEPTH` (every reader after this one walks
    the value recursively). Iterative: the check itself does not recurse.

    Raises:
        PydanticCustomError: ``invalid_text``, with the path in ``ctx["where"]``.
    """
    stack: list[tuple[Any, tuple]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            raise PydanticCustomError(
                "invalid_text",
                "{where} is nested deeper than " + str(MAX_JSON_DEPTH) + " levels",
                {"where": ".".join(map(str, path[:3])) + "..."},
            )
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str):
                    _check_text(key, path)
                stack.append((item, (*path, key)))
        elif isinstance(value, list):
            stack.extend((item, (*path, i)) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, path)


def _check_text(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = ".".join(map(str, path)) or "body"
        raise PydanticCustomError(
            "invalid_text",
            "{where} holds a lone surrogate ("
            + ascii(text[e.start])
            + ") at character {at}: send valid Unicode text",
            {"where": where, "at": e.start},
        ) from None


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImageURL(_Model):
    url: str


class ImagePart(_Model):
    type: Literal["image_url"]
    image_url: ImageURL | str  # vLLM also takes the URL as a bare string


class ChatMessage(_Model):
    role: str
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None


class StreamOptions(_Model):
    include_usage: bool = False


class JSONSchemaFormat(_Model):
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # `schema` is a BaseModel method


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Model):
    """vLLM's ``StructuredOutputsParams``, the kinds our grammar backend compiles; the others
    (``grammar``, ``structural_tag``) are refused rather than ignored."""

    model_config = ConfigDict(extra="forbid")
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


class _SamplingFields(_Body):
    """What both endpoints read besides the prompt (OpenAI's names, vLLM's extensions)."""

    model_config = ConfigDict(extra="allow")  # kept, for check_supported to look at

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch's generators take
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    # Fields of OpenAI's API or vLLM's that would change the answer, and that the engine does
    # not implement, with their "off" values: refused unless off, never silently ignored.
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "presence_penalty": (None, 0),
        "frequency_penalty": (None, 0),
        "repetition_penalty": (None, 1),
        "min_p": (None, 0),
        "logit_bias": (None, {}),
        "min_tokens": (None, 0),
        "best_of": (None, 1),
        "bad_words": (None, []),
        "allowed_token_ids": (None,),
        "prompt_logprobs": (None,),
    }

    def check_supported(self) -> None:
        """Raises RequestError for a field whose meaning the engine cannot honour."""
        extra = self.model_extra or {}
        for name, off in self.UNSUPPORTED.items():
            if name in extra and extra[name] not in off:
                raise RequestError(
                    f"{name} is not supported (it would change the answer); leave it unset"
                )

    def sampling_params(
        self, max_tokens: int, defaults: Mapping[str, Any], eos: Sequence[int]
    ) -> SamplingParams:
        """The engine's :class:`SamplingParams` for this request.

        Raises:
            RequestError: an unsupported field or a value out of range.
            GrammarError: more than one structured-output constraint, or a malformed one.
        """
        self.check_supported()
        if max_tokens < 1:  # said with the request's name for it (SamplingParams: max_new_tokens)
            raise RequestError(f"max_tokens must be >= 1, got {max_tokens}")
        if self.stop_token_ids is None and not self.ignore_eos:
            stop = None  # the engine's default: the model's EOS
        else:  # vLLM's stop_token_ids stop as well as EOS, not instead of it
            stop = (() if self.ignore_eos else tuple(eos)) + tuple(self.stop_token_ids or ())

        def given(name: str, default: float) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, default)

        top_k = given("top_k", 0)
        return SamplingParams(
            temperature=given("temperature", 1.0),
            top_p=given("top_p", 1.0),
            top_k=0 if top_k == -1 else top_k,  # vLLM and SGLang spell "off" -1
            seed=self.seed,
            max_new_tokens=max_tokens,
            stop_token_ids=stop,
            stop=self.stop,
            include_stop_str_in_output=self.include_stop_str_in_output,
            **self._constraint(),
        )

    def _constraint(self) -> dict[str, Any]:
        found: dict[str, tuple[str, Any]] = {}  # request field -> (SamplingParams field, value)
        if (fmt := self.response_format) is not None and fmt.type == "json_object":
            found["response_format"] = ("json_schema", {"type": "object"})
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise GrammarError("response_format of type json_schema needs json_schema.schema")
            found["response_format"] = ("json_schema", fmt.json_schema.schema_)
        if (so := self.structured_outputs) is not None:
            for name, kind, value in (
                ("json", "json_schema", so.json_),
                ("regex", "regex", so.regex),
                ("choice", "choice", so.choice),
                ("json_object", "json_schema", {"type": "object"} if so.json_object else None),
            ):
                if value is not None:
                    found[f"structured_outputs.{name}"] = (kind, value)
        for name, kind in (
            ("guided_json", "json_schema"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
        ):
            if (value := getattr(self, name)) is not None:
                found[name] = (kind, value)
        if len(found) > 1:
            raise GrammarError(f"give one structured-output constraint, got {', '.join(found)}")
        return dict(found.values())


class ChatCompletionRequest(_SamplingFields):
    """The body of ``POST /v1/chat/completions`` (module docstring)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple]] = _SamplingFields.UNSUPPORTED | {
        "logprobs": (None, False),
        "top_logprobs": (None, 0),
        "tools": (None, []),
        "tool_choice": (None, "none", "auto"),  # with no tools, "auto" calls none
        "echo": (None, False),  # vLLM's: the answer would start with the last message
    }


class CompletionRequest(_SamplingFields):
    """The body of ``POST /v1/completions`` (module docstring)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions

    UNSUPPORTED: ClassVar[dict[str, tuple]] = _SamplingFields.UNSUPPORTED | {
        "echo": (None, False),
        "logprobs": (None,),  # 0 still asks for the sampled tokens' logprobs
        "suffix": (None, ""),
    }


class TokenizeRequest(_Body):
    """The body of ``POST /tokenize``: a ``prompt`` (text or token ids, as for completions) or
    chat ``messages`` (rendered by the chat template with the assistant header, as for chat
    completions), not both."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)


class DetokenizeRequest(_Body):
    """The body of ``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict:
    """OpenAI's (and vLLM's) error body."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _ASCIIJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message that quotes what a
    client sent always encodes (Starlette's UTF-8 encoding fails on a lone surrogate)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return _ASCIIJSONResponse(error_body(message, type_, status, param), status_code=status)


INTERNAL_ERROR = "internal server error: the server's log has the details"


def failure_body(error: BaseException) -> dict:
    """The error body of a request that failed: the request's own fault (a typed
    :class:`~minirad.errors.MiniradError`) is a 400 that says what is wrong; a shutdown or a
    stopped engine a 503; anything else a 500 that shows no internals (they are logged)."""
    if isinstance(error, MiniradError):
        return error_body(" ".join(str(error).split()), "BadRequestError", 400)
    if isinstance(error, EngineDeadError):
        return error_body(str(error), "ServiceUnavailableError", 503)
    return error_body(INTERNAL_ERROR, "InternalServerError", 500)


class _NotFound(Exception):
    """A model name this server does not serve (404, param ``model``)."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (or the server is shutting down); the server answers
    503."""


class RequestFailedError(RuntimeError):
    """A request the engine ended with finish reason ``"error"`` (its ``error`` is the
    cause): the engine goes on, the request's client gets the error."""

    def __init__(self, error: BaseException | None) -> None:
        super().__init__(repr(error))
        self.error = error


# --------------------------------------------------------------------------- the engine thread
@dataclass(frozen=True)
class EngineSnapshot:
    """What ``/metrics`` reports, taken by the engine thread after each step.

    ``prompt_tokens``: prompt tokens of the requests that got their first output token
    (vLLM's ``vllm:prompt_tokens``, cached ones included); ``generation_tokens``: tokens
    handed out; ``finished``: finished requests by finish reason.
    """

    stats: EngineStats
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prompt_tokens: int
    generation_tokens: int
    finished: Mapping[str, int]


class _Channel:
    """One request's outputs, from the engine thread to the handler's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass


class RequestStream:
    """The outputs of one API request's engine requests (one per choice: ``n``), as an async
    iterator of ``(index, output)`` in the order the engine produced them; it ends when each
    request has had its last output (``finished`` set).

    :meth:`abort` stops the unfinished ones in the engine (their KV stays cached, unlocked);
    it does nothing once every last output arrived, so a handler calls it however it ends.
    """

    def __init__(self, engine: AsyncLLMEngine, rids: Sequence[str], channel: _Channel) -> None:
        self.engine, self._channel = engine, channel
        self._index = {rid: i for i, rid in enumerate(rids)}
        self._unfinished = set(rids)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._channel.queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.rid)
        return self._index[item.rid], item

    def abort(self) -> None:
        for rid in self._unfinished:
            self.engine.abort(rid)
        self._unfinished.clear()


class AsyncLLMEngine:
    """An :class:`~minirad.engine.LLMEngine` run by its own thread, for asyncio callers
    (vLLM v0's ``AsyncLLMEngine``: a background loop over the engine's ``step``).

    :meth:`start` starts the thread; :meth:`add_request` (from an event loop) processes the
    requests' inputs on a worker thread (:meth:`LLMEngine.process_inputs`: tokens, pictures,
    grammar; never on the engine thread, whose steps every client waits on) and returns a
    :class:`RequestStream`; :meth:`shutdown` stops the thread after its current step and
    closes the engine's KV-event sockets. :attr:`snapshot` is an :class:`EngineSnapshot`.

    No request can stop the thread: what fails inside a step ends the requests it belongs to
    (:meth:`LLMEngine.step`), and should the step itself raise, every request in flight ends
    with the error and the thread goes on once the engine's invariants hold
    (:meth:`_recover`).

    Args:
        engine: the engine; only the engine thread touches it from :meth:`start` on.
        input_timeout_s: longest an input may take to process (a 400 after that).
    """

    input_workers = 2  # threads processing inputs: the machine's cores, for our 2

    def __init__(self, engine: LLMEngine, input_timeout_s: float = INPUT_TIMEOUT_S) -> None:
        self.engine = engine
        self.input_timeout_s = input_timeout_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # commands; None: stop
        self._thread = threading.Thread(target=self._run, name="minirad-engine", daemon=True)
        self.inputs: Executor = ThreadPoolExecutor(self.input_workers, "minirad-inputs")
        self._channels: dict[str, _Channel] = {}  # the engine thread's only
        self._prompt_tokens = self._generation_tokens = 0
        self._finished: Counter[str] = Counter()
        self.error: BaseException | None = None
        self.snapshot = self._snapshot()

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._inbox.put(None)
            self._thread.join()
        self.inputs.shutdown(wait=False, cancel_futures=True)

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self.error is None

    async def run_off_thread(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        """``fn(*args)`` on an input thread, within :attr:`input_timeout_s`.

        Raises:
            RequestError: it took longer (``what`` names it in the message; the thread
                finishes it and the result is dropped).
            Exception: what ``fn`` raised.
        """
        future = asyncio.get_running_loop().run_in_executor(self.inputs, fn, *args)
        try:
            return await asyncio.wait_for(future, self.input_timeout_s)
        except TimeoutError:
            raise RequestError(
                f"{what} took longer than {self.input_timeout_s:g} s; send less"
            ) from None

    async def add_request(self, requests: Sequence[GenerateRequest]) -> RequestStream:
        """Process ``requests`` (their ``rid`` set: one API request's choices) off the engine
        thread, then queue them in the engine, in one go between two steps; returns their
        outputs.

        Raises:
            MiniradError: what :meth:`LLMEngine.process_inputs` or
                :meth:`LLMEngine.add_request` raised for one of them (then none is queued);
                a RequestError if processing took longer than :attr:`input_timeout_s`.
            EngineDeadError: the engine thread has stopped.
        """
        if self.error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")

        def process() -> list[EngineCoreRequest]:
            return [self.engine.process_inputs(r) for r in requests]

        processed = await self.run_off_thread(process, what="processing the prompt and images")
        channel = _Channel(asyncio.get_running_loop())
        self._inbox.put(("add", processed, channel))
        try:
            ack = await channel.queue.get()
        except asyncio.CancelledError:  # the client left before the engine took them
            for request in requests:
                self.abort(request.rid)
            raise
        if isinstance(ack, BaseException):
            raise ack
        return RequestStream(self, [r.rid for r in requests], channel)

    def abort(self, rid: str) -> None:
        """Abort request ``rid`` (thread-safe; nothing happens if it has finished)."""
        self._inbox.put(("abort", rid))

    def fail_in_flight(self, message: str) -> None:
        """End every request in flight now with an :class:`EngineDeadError` of ``message``
        (thread-safe): their clients get a 503 (a stream, an error event) instead of waiting.
        A server shutting down calls it when its grace period is over."""
        self._inbox.put(("fail", message))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """``fn(engine)`` run on the engine thread between two steps (only that thread
        touches the engine); returns what it returned.

        Raises:
            Exception: what ``fn`` raised.
            EngineDeadError: the engine thread has stopped.
        """
        if self.error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        channel = _Channel(asyncio.get_running_loop())
        self._inbox.put(("call", fn, channel))
        reply = await channel.queue.get()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache between two steps (vLLM's ``POST /reset_prefix_cache``).
        Returns False, and changes nothing, while requests are in flight.

        Raises:
            EngineDeadError: the engine thread has stopped.
        """

        def reset(engine: LLMEngine) -> bool:
            idle = not engine.has_unfinished_requests()
            if idle:
                engine.reset_prefix_cache()
            return idle

        return await self.call(reset)

    # -------------------------------------------------------------- on the engine thread
    def _run(self) -> None:
        engine = self.engine
        replies: list[tuple[_Channel, object]] = []  # this round's answers, sent after it
        try:
            while True:
                # Block while idle; with requests in flight take only what has arrived.
                commands = [] if engine.has_unfinished_requests() else [self._inbox.get()]
                while True:
                    try:
                        commands.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                replies = []
                for command in commands:
                    if command is None:
                        return
                    self._handle(command, replies)
                if engine.has_unfinished_requests():
                    try:
                        outs = engine.step()
                    except Exception as e:
                        outs = self._recover(e)
                    for out in outs:
                        self._count(out)
                        channel = self._channels.get(out.rid)
                        if out.finished:
                            self._channels.pop(out.rid, None)
                        if channel is not None:
                            replies.append((channel, out))
                self.snapshot = self._snapshot()
                for channel, item in replies:
                    channel.put(item)
        except Exception as e:  # the engine cannot go on: fail every request, stay answering
            log.exception("the engine thread failed")
            self.error = EngineDeadError(f"the engine has stopped: {e!r}")
            for channel, _ in replies:  # acks and refusals of this round never went out
                channel.put(self.error)
            self._fail_all()
        finally:
            for channel in self._channels.values():  # shut down with requests in flight
                channel.put(EngineDeadError("the server is shutting down"))
            engine.close()

    def _recover(self, error: Exception) -> list[RequestOutput]:
        """After a step raised: every request in flight ends with ``error`` (their new KV is
        dropped, not cached), then the engine's invariants are checked.

        Raises:
            Exception: ``error`` again, if the engine is not whole after that (the thread
                then stops, and the server answers 503).
        """
        log.exception("a step failed; every request in flight ends with its error")
        outs = self.engine.fail_unfinished(error)
        try:
            self.engine.check_invariants()
        except Exception:
            log.exception("the engine is not whole after the failed step")
            raise error from None
        return outs

    def _handle(self, command: tuple, replies: list) -> None:
        kind, *args = command
        if kind == "add":
            requests, channel = args
            added = []
            try:
                for request in requests:
                    added.append(self.engine.add_request(request))
            except Exception as e:  # the handler answers with it, and nothing stays queued
                for rid in added:
                    self.engine.abort_request(rid)
                replies.append((channel, e))
                return
            for rid in added:
                self._channels[rid] = channel
            replies.append((channel, added))
        elif kind == "call":
            fn, channel = args
            try:
                replies.append((channel, fn(self.engine)))
            except Exception as e:  # the handler raises it
                replies.append((channel, e))
        elif kind == "fail":
            error = EngineDeadError(args[0])
            for rid, channel in list(self._channels.items()):
                out = self.engine.abort_request(rid)
                if out is not None:
                    self._finished[out.finish_reason] += 1
                replies.append((channel, error))
            self._channels.clear()
        elif self._channels.pop(args[0], None) is not None:  # "abort" of an unfinished request
            out = self.engine.abort_request(args[0])
            if out is not None:
                self._finished[out.finish_reason] += 1

    def _count(self, out: RequestOutput) -> None:
        if len(out.new_token_ids) == len(out.token_ids) and out.token_ids:  # its first output
            self._prompt_tokens += out.stats.prompt_tokens
        self._generation_tokens += len(out.new_token_ids)
        if out.finished:
            self._finished[out.finish_reason] += 1

    def _snapshot(self) -> EngineSnapshot:
        e = self.engine
        held = e.allocator.used_size() - e.tree_cache.evictable_size()
        return EngineSnapshot(
            stats=e.stats,
            num_running=len(e.scheduler.running),
            num_waiting=len(e.scheduler.waiting),
            kv_cache_usage=held / e.allocator.size,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            finished=dict(self._finished),
        )

    def _fail_all(self) -> None:
        """After a failure: every waiting handler gets the error, and so does every later
        command, until :meth:`shutdown` (no handler waits forever)."""
        for channel in self._channels.values():
            channel.put(self.error)
        self._channels.clear()
        while (command := self._inbox.get()) is not None:
            if command[0] in ("add", "call"):  # the ones whose handler awaits a reply
                command[-1].put(self.error)


# ------------------------------------------------------------------------------ the metrics
class _VLLMMetrics:
    """A prometheus_client collector over :attr:`AsyncLLMEngine.snapshot`, in vLLM's names
    and help texts (a counter ``x`` is exposed as ``x_total``)."""

    METRICS: tuple[tuple[type, str, str, Callable[[EngineSnapshot], float]], ...] = (
        (
            CounterMetricFamily,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            lambda s: s.stats.queried_tokens,
        ),
        (
            CounterMetricFamily,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            lambda s: s.stats.cached_tokens,
        ),
        (
            CounterMetricFamily,
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            lambda s: s.prompt_tokens,
        ),
        (
            CounterMetricFamily,
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            lambda s: s.generation_tokens,
        ),
        (
            CounterMetricFamily,
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            lambda s: s.stats.num_preemptions,
        ),
        (
            GaugeMetricFamily,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            lambda s: s.num_running,
        ),
        (
            GaugeMetricFamily,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            lambda s: s.num_waiting,
        ),
        (
            GaugeMetricFamily,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            lambda s: s.kv_cache_usage,
        ),
    )

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine, self.labels = engine, [model_name, "0"]

    def collect(self):
        snapshot, names = self.engine.snapshot, ["model_name", "engine"]
        for family, name, doc, value in self.METRICS:
            metric = family(name, doc, labels=names)
            metric.add_metric(self.labels, value(snapshot))
            yield metric
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*names, "finished_reason"],
        )
        for reason in ("stop", "length", "abort", "error"):
            success.add_metric([*self.labels, reason], snapshot.finished.get(reason, 0))
        yield success


# ------------------------------------------------------------------------------ the intake
class Shutdown:
    """Set when a server's grace period is over (:func:`run_server` calls :meth:`close`):
    :class:`_BodyIntake` then answers every body still arriving with a 503."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None  # made on the server's event loop

    @property
    def event(self) -> asyncio.Event:
        if self._event is None:
            self._event = asyncio.Event()
        return self._event

    def close(self) -> None:
        self.event.set()


class _BodyIntake:
    """ASGI middleware: reads a request's whole body before the app sees it, within limits
    checked on the event loop in microseconds: at most :data:`MAX_BODY_BYTES` (413, whether
    declared by Content-Length or not), at most :data:`MAX_JSON_VALUES` commas (400). A body
    still arriving when the grace period ends (``shutdown``) gets a 503, so a client that
    never finishes sending holds up nobody's shutdown."""

    def __init__(self, app: Callable, shutdown: Shutdown) -> None:
        self.app = app
        self.shutdown = shutdown

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return await self._refuse(413, scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await self._receive(receive)
            if message is None:  # the grace period is over
                response = _error(503, "the server is shutting down", "ServiceUnavailableError")
                response.headers["connection"] = "close"
                return await response(scope, receive, send)
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > MAX_BODY_BYTES:
                return await self._refuse(413, scope, receive, send)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if body.count(b",") >= MAX_JSON_VALUES:
            return await self._refuse(400, scope, receive, send)
        delivered = False

        async def replay() -> dict:
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _receive(self, receive: Callable) -> dict | None:
        """The next message of the body, or None once the server is shutting down."""
        message = asyncio.ensure_future(receive())
        closing = asyncio.ensure_future(self.shutdown.event.wait())
        await asyncio.wait({message, closing}, return_when=asyncio.FIRST_COMPLETED)
        closing.cancel()
        if message.done():
            return message.result()
        message.cancel()
        return None

    @staticmethod
    async def _refuse(status: int, scope: dict, receive: Callable, send: Callable) -> None:
        message = (
            f"the request body is over {MAX_BODY_BYTES // 2**20} MiB"
            if status == 413
            else f"the request body holds {MAX_JSON_VALUES} or more JSON values (commas)"
        )
        response = _error(status, message, "BadRequestError")
        response.headers["connection"] = "close"  # the rest of the body is not read
        await response(scope, receive, send)


# ---------------------------------------------------------------------------------- the inputs
def _image(url: str, media: MediaFolder) -> Any:
    """An image part's URL as a decoded, checked PIL image: a ``data:`` URL, or a file in the
    media folder (a path, plain or ``file://``, relative to the server's working folder).
    Runs on an input thread (:meth:`AsyncLLMEngine.run_off_thread`).

    Raises:
        ImageError: a malformed data URL, a network URL, a path outside the folder, or no
            readable picture (:mod:`minirad.media`).
    """
    if url.startswith("data:"):
        return open_image(decode_data_url(url), "in the data URL")
    if not url:
        raise ImageError("an image_url must not be empty: send a data: URL or a local path")
    if url.startswith(("http://", "https://")):
        raise ImageError(
            "this server fetches no images over the network: send a data: URL or a local path"
        )
    name = url.removeprefix("file://")
    return open_image(media.read(name), media.shown(name))


def _chat_messages(messages: Sequence[ChatMessage], media: MediaFolder) -> tuple[list[dict], list]:
    """The messages in HF's chat format (an ``{"type": "image"}`` item per image part, in
    order) and their images, read and decoded."""
    converted, images = [], []
    for message in messages:
        content: Any = message.content or ""
        if not isinstance(content, str):
            items = []
            for part in content:
                if isinstance(part, TextPart):
                    items.append({"type": "text", "text": part.text})
                else:
                    url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
                    images.append(_image(url, media))
                    items.append({"type": "image"})
            content = items
        converted.append({"role": message.role, "content": content})
    return converted, images


def _completion_prompt(prompt: str | list) -> str | list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise RequestError(f"one prompt per request, got {len(prompt)}")
        return prompt[0]
    return prompt


# ---------------------------------------------------------------------------------- responses
def _usage(outs: Sequence[RequestOutput]) -> dict:
    """OpenAI's ``usage`` of one API request's choices: the prompt once, every choice's
    completion tokens; ``cached_tokens``: the first choice's (the others usually find its
    prompt cached, which is the point of sampling them together)."""
    prompt, completion = len(outs[0].prompt_token_ids), sum(len(o.token_ids) for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": outs[0].stats.cached_tokens},
    }


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events whose engine request is aborted however the response ends: done,
    the client gone (Starlette cancels the body), or a failed send."""

    def __init__(self, chunks: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(chunks, media_type="text/event-stream")
        self.request_stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.request_stream.abort()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (its body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _final_outputs(stream: RequestStream, request: Request) -> list[RequestOutput] | None:
    """Each choice's last output, by index, or None if the client left first (then they are
    aborted)."""

    async def last() -> list[RequestOutput]:
        outs = {}
        async for i, out in stream:
            if out.finish_reason == "error":  # the whole answer fails: the others stop too
                stream.abort()
                raise RequestFailedError(out.error)
            if out.finished:
                outs[i] = out
        return [outs[i] for i in sorted(outs)]

    result = asyncio.ensure_future(last())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        left = not result.done()  # the client went away (or this handler was cancelled)
        if left:
            result.cancel()
            stream.abort()
    return None if left else result.result()


# ------------------------------------------------------------------------------------ the app
def build_app(
    engine: LLMEngine,
    served_model_name: str,
    *,
    model_path: str | None = None,
    allowed_local_media_path: str | Path | None = None,
) -> FastAPI:
    """The FastAPI application serving ``engine`` as ``served_model_name``.

    Its lifespan starts the :class:`AsyncLLMEngine` thread and stops it (run it with uvicorn,
    which runs the lifespan). ``model_path`` is ``/v1/models``' ``root`` (default: the name);
    ``allowed_local_media_path`` restricts image file paths to one folder (vLLM's flag;
    default here: any path the server can read; ``minirad serve``'s default: its working
    folder); only regular files in it are read (:class:`~minirad.media.MediaFolder`).
    """
    async_engine = AsyncLLMEngine(engine)
    media = MediaFolder(allowed_local_media_path or "/")
    generation = engine.vlm.model.generation_config.to_diff_dict()
    defaults = {k: generation[k] for k in ("temperature", "top_p", "top_k") if k in generation}
    registry = CollectorRegistry()
    registry.register(_VLLMMetrics(async_engine, served_model_name))
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="minirad", lifespan=lifespan)
    app.state.shutdown = Shutdown()
    app.add_middleware(_BodyIntake, shutdown=app.state.shutdown)
    app.state.engine = async_engine

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error", first.get("msg"))
            return _error(400, f"the request body is not valid JSON: {reason}", "BadRequestError")
        if tuple(first.get("loc", ())) == ("body",) and first.get("type") in (
            "model_attributes_type",
            "dict_type",
        ):
            message = "the request body must be a JSON object, sent as application/json"
            return _error(400, message, "BadRequestError")
        if first.get("type") == "invalid_text":  # _check_json: the message names the place
            where = first["ctx"]["where"]
            return _error(400, first["msg"], "BadRequestError", where)
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None  # after "body"
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
            for e in errors
        )
        return _error(400, message or "invalid request", "BadRequestError", param)

    @app.exception_handler(MiniradError)
    async def refused(_: Request, exc: MiniradError) -> JSONResponse:
        return _error(400, " ".join(str(exc).split()), "BadRequestError")

    @app.exception_handler(_NotFound)
    async def not_found(_: Request, exc: _NotFound) -> JSONResponse:
        return _error(404, str(exc), "NotFoundError", "model")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own refusals (no such path, a wrong method, a body it cannot parse),
        # in the same body as ours rather than {"detail": ...}.
        type_ = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(
            exc.status_code, "BadRequestError"
        )
        response = _error(exc.status_code, str(exc.detail), type_)
        response.headers.update(exc.headers or {})  # 405's Allow
        return response

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return _error(503, str(exc), "ServiceUnavailableError")

    @app.exception_handler(RequestFailedError)
    async def request_failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        body = failure_body(exc.error)
        return _ASCIIJSONResponse(body, status_code=body["error"]["code"])

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        # A bug, not a bad request (Starlette logs the traceback after this answer); the body
        # shows no internals.
        return _error(500, INTERNAL_ERROR, "InternalServerError")

    async def chat_prompt(messages: Sequence[ChatMessage]) -> tuple[str, list]:
        """The chat template's prompt for ``messages`` and their images, read and decoded on
        an input thread (never the event loop's, never the engine's)."""

        def render() -> tuple[str, list]:
            converted, images = _chat_messages(messages, media)
            return chat_template(engine.processor, converted), images

        return await async_engine.run_off_thread(render, what="reading the images")

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise _NotFound(
                f"The model `{name}` does not exist. This server serves `{served_model_name}`."
            )

    async def submit(
        prompt, images: list, fields: _SamplingFields, max_tokens: int | None
    ) -> tuple[str, RequestStream]:
        """Queue the request's ``n`` choices as engine requests (vLLM's parallel sampling:
        ``{index}_{id}``, seeds ``seed + index``; the prompt's KV is shared through the radix
        tree); returns the API request's id and their outputs."""
        # No max_tokens: until the context is full (the engine stops there), as vLLM does.
        max_tokens = engine.max_model_len if max_tokens is None else max_tokens
        params = fields.sampling_params(max_tokens, defaults, engine.eos_token_ids)
        rid = uuid.uuid4().hex
        children = []
        for i in range(fields.n):
            child = params
            if i and params.seed is not None:  # its own draws, reproducible; wrap past 2**64
                seed = params.seed + i
                child = replace(params, seed=seed if seed < 2**64 else seed - 2**64)
            child_rid = rid if fields.n == 1 else f"{i}_{rid}"
            children.append(GenerateRequest(prompt, images, child, child_rid))
        return rid, await async_engine.add_request(children)

    async def respond(
        raw: Request,
        stream: RequestStream,
        fields: _SamplingFields,
        head: dict,
        chunk_object: str,
        final_choice: Callable[[int, RequestOutput], dict],
        delta_choice: Callable[[int, RequestOutput | None], dict | None],
    ) -> Response:
        """The JSON answer (``head``, a ``final_choice`` per choice, the usage), or its
        server-sent events: a chunk per output with new text (``delta_choice(i, out)``; first
        ``delta_choice(i, None)``, the opening chunk, if any), then the usage chunk if asked,
        then ``[DONE]``; each chunk is ``head`` with ``chunk_object`` as its ``object``."""
        if not fields.stream:
            outs = await _final_outputs(stream, raw)
            if outs is None:
                return Response(status_code=499)
            choices = [final_choice(i, out) for i, out in enumerate(outs)]
            return JSONResponse(head | {"choices": choices, "usage": _usage(outs)})
        include_usage = fields.stream_options is not None and fields.stream_options.include_usage
        chunk = head | {"object": chunk_object}

        async def chunks() -> AsyncIterator[str]:
            try:
                for i in range(fields.n):
                    if (opening := delta_choice(i, None)) is not None:
                        yield _sse(chunk | {"choices": [opening]})
                last: dict[int, RequestOutput] = {}
                async for i, out in stream:
                    if out.finish_reason == "error":  # the request failed: say so, and stop
                        raise RequestFailedError(out.error)
                    last[i] = out
                    if out.new_text or out.finished:
                        yield _sse(chunk | {"choices": [delta_choice(i, out)]})
                if include_usage:
                    usage = _usage([last[i] for i in sorted(last)])
                    yield _sse(chunk | {"choices": [], "usage": usage})
            except RequestFailedError as e:
                yield _sse(failure_body(e.error))
            except Exception as e:  # the engine stopped, or the server is shutting down
                yield _sse(failure_body(e))
            yield _sse("[DONE]")

        return _EventStream(chunks(), stream)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if async_engine.is_healthy else 503)

    # SGLang's discovery endpoints: sglang-router asks a worker for them when it registers
    # it, and names the worker's model from them (else "unknown", as it names vLLM's).
    paths = dict.fromkeys(("model_path", "tokenizer_path"), model_path or served_model_name)

    @app.get("/server_info")
    async def server_info() -> dict:
        limits = {"context_length": engine.max_model_len, "page_size": engine.config.page_size}
        return paths | {"served_model_name": served_model_name} | limits

    @app.get("/model_info")
    async def model_info() -> dict:
        return paths | {"is_generation": True, "has_image_understanding": True}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        return {"success": await async_engine.reset_prefix_cache()}

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "minirad",
            "root": model_path or served_model_name,
            "parent": None,
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        prompt, images = await chat_prompt(body.messages)
        max_tokens = body.max_completion_tokens
        max_tokens = body.max_tokens if max_tokens is None else max_tokens
        rid, stream = await submit(prompt, images, body, max_tokens)
        head = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time())}
        head["model"] = served_model_name

        def final_choice(i: int, out: RequestOutput) -> dict:
            message = {"role": "assistant", "content": out.text}
            return {
                "index": i,
                "message": message,
                "logprobs": None,
                "finish_reason": out.finish_reason,
            }

        def delta_choice(i: int, out: RequestOutput | None) -> dict:
            if out is None:  # OpenAI's first chunk: the role, no text
                d, reason = {"role": "assistant", "content": ""}, None
            else:
                d, reason = ({"content": out.new_text} if out.new_text else {}), out.finish_reason
            return {"index": i, "delta": d, "logprobs": None, "finish_reason": reason}

        chunk_object = "chat.completion.chunk"
        return await respond(raw, stream, body, head, chunk_object, final_choice, delta_choice)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("give a prompt or messages, one of the two")
        prompt, images = body.prompt, []
        if body.messages is not None:
            prompt, images = await chat_prompt(body.messages)
        # The ids a completion of the same prompt is computed from (images expanded).
        processed = await async_engine.run_off_thread(
            engine.input_processor.process, prompt, images, what="processing the prompt"
        )
        ids = processed.prompt_token_ids
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        if bad := [t for t in body.tokens if not 0 <= t < engine.vocab_size][:5]:
            raise RequestError(f"token ids must be in 0..{engine.vocab_size - 1}, got {bad}")
        if engine.tokenizer is None:
            raise RequestError("this server has no tokenizer to detokenize with")
        # Any ids, placeholders of images included (/tokenize gives those), as vLLM does.
        text = await async_engine.run_off_thread(
            engine.tokenizer.decode, body.tokens, what="detokenizing"
        )
        return {"prompt": text}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        prompt = _completion_prompt(body.prompt)
        rid, stream = await submit(prompt, [], body, body.max_tokens)
        head = {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time())}
        head["model"] = served_model_name

        def choice(i: int, text: str, reason: str | None) -> dict:
            return {"index": i, "text": text, "logprobs": None, "finish_reason": reason}

        def final_choice(i: int, out: RequestOutput) -> dict:
            return choice(i, out.text, out.finish_reason)

        def delta_choice(i: int, out: RequestOutput | None) -> dict | None:
            if out is None:  # completions open with the first text
                return None
            return choice(i, out.new_text, out.finish_reason)

        chunk_object = "text_completion"  # vLLM's and OpenAI's name for its chunks too
        return await respond(raw, stream, body, head, chunk_object, final_choice, delta_choice)

    return app


def run_server(
    engine: LLMEngine,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str,
    model_path: str | None = None,
    allowed_local_media_path: str | Path | None = None,
    shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S,
    log_level: str = "info",
) -> None:
    """Serve ``engine`` over HTTP until interrupted (uvicorn; see :func:`build_app`).

    SIGTERM or SIGINT stops taking connections and gives the requests in flight
    ``shutdown_timeout_s`` to finish (uvicorn's ``timeout_graceful_shutdown``); just before
    that runs out, those still running end with a 503 (a stream: an error event), and what
    is left (a client that never finished sending its request) is cut. The process exits
    within the timeout, whatever its clients do.
    """
    app = build_app(
        engine,
        served_model_name,
        model_path=model_path,
        allowed_local_media_path=allowed_local_media_path,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=shutdown_timeout_s,
    )
    asyncio.run(_serve(uvicorn.Server(config), app.state, shutdown_timeout_s))


async def _serve(server: uvicorn.Server, state: Any, grace_s: float) -> None:
    async def end_in_flight() -> None:
        while not server.should_exit:
            await asyncio.sleep(0.1)
        await asyncio.sleep(max(grace_s - 0.5, 0.0))
        state.shutdown.close()  # bodies still arriving: 503
        state.engine.fail_in_flight("the server is shutting down")

    watcher = asyncio.create_task(end_in_flight())
    try:
        await server.serve()
    finally:
        watcher.cancel()
