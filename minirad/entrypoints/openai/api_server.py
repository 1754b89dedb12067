"""``minirad serve``: our engine behind an OpenAI-compatible HTTP API, as ``vllm serve`` is.

Routers (sglang-router, vllm-router), benchmark clients and the ``openai`` Python client speak
this API to vLLM and SGLang; a server that answers the same requests in the same shapes slots
into the same setups. The web stack is vLLM's: FastAPI on uvicorn. What each endpoint takes and
answers is in ``docs/serving.md``; the threads behind it in ``docs/architecture.md``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from minirad.engine import GenerateRequest, LLMEngine, RequestOutput
from minirad.engine.async_llm_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    RequestFailedError,
    RequestStream,
)
from minirad.engine.media import MediaFolder
from minirad.entrypoints.chat_utils import chat_template, image_from_url
from minirad.entrypoints.openai.metrics import VLLMMetrics
from minirad.entrypoints.openai.protocol import (
    INTERNAL_ERROR,
    MAX_JSON_VALUES,
    ASCIIJSONResponse,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    ModelNotFoundError,
    SamplingFields,
    TextPart,
    TokenizeRequest,
    error_response,
    failure_body,
)
from minirad.errors import MiniradError, RequestError

__all__ = [
    "MAX_BODY_BYTES",
    "SHUTDOWN_TIMEOUT_S",
    "Shutdown",
    "build_app",
    "run_server",
]

log = logging.getLogger(__name__)

# The largest request body read (413 past it): a data URL of MAX_IMAGE_BYTES, base64'd, fits.
MAX_BODY_BYTES = 64 * 2**20
SHUTDOWN_TIMEOUT_S = 5.0  # on SIGTERM: how long requests in flight may take to finish


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
                response = error_response(
                    503, "the server is shutting down", "ServiceUnavailableError"
                )
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
        response = error_response(status, message, "BadRequestError")
        response.headers["connection"] = "close"  # the rest of the body is not read
        await response(scope, receive, send)


# ---------------------------------------------------------------------------------- the inputs
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
                    images.append(image_from_url(url, media))
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


# ---------------------------------------------------------------------------------- the app
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
    folder); only regular files in it are read (:class:`~minirad.engine.media.MediaFolder`).
    """
    async_engine = AsyncLLMEngine(engine)
    media = MediaFolder(allowed_local_media_path or "/")
    generation = engine.vlm.model.generation_config.to_diff_dict()
    defaults = {k: generation[k] for k in ("temperature", "top_p", "top_k") if k in generation}
    registry = CollectorRegistry()
    registry.register(VLLMMetrics(async_engine, served_model_name))
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
            return error_response(
                400, f"the request body is not valid JSON: {reason}", "BadRequestError"
            )
        if tuple(first.get("loc", ())) == ("body",) and first.get("type") in (
            "model_attributes_type",
            "dict_type",
        ):
            message = "the request body must be a JSON object, sent as application/json"
            return error_response(400, message, "BadRequestError")
        if first.get("type") == "invalid_text":  # _check_json: the message names the place
            where = first["ctx"]["where"]
            return error_response(400, first["msg"], "BadRequestError", where)
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None  # after "body"
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
            for e in errors
        )
        return error_response(400, message or "invalid request", "BadRequestError", param)

    @app.exception_handler(MiniradError)
    async def refused(_: Request, exc: MiniradError) -> JSONResponse:
        return error_response(400, " ".join(str(exc).split()), "BadRequestError")

    @app.exception_handler(ModelNotFoundError)
    async def not_found(_: Request, exc: ModelNotFoundError) -> JSONResponse:
        return error_response(404, str(exc), "NotFoundError", "model")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own refusals (no such path, a wrong method, a body it cannot parse),
        # in the same body as ours rather than {"detail": ...}.
        type_ = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(
            exc.status_code, "BadRequestError"
        )
        response = error_response(exc.status_code, str(exc.detail), type_)
        response.headers.update(exc.headers or {})  # 405's Allow
        return response

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), "ServiceUnavailableError")

    @app.exception_handler(RequestFailedError)
    async def request_failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        body = failure_body(exc.error)
        return ASCIIJSONResponse(body, status_code=body["error"]["code"])

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        # A bug, not a bad request (Starlette logs the traceback after this answer); the body
        # shows no internals.
        return error_response(500, INTERNAL_ERROR, "InternalServerError")

    async def chat_prompt(messages: Sequence[ChatMessage]) -> tuple[str, list]:
        """The chat template's prompt for ``messages`` and their images, read and decoded on
        an input thread (never the event loop's, never the engine's)."""

        def render() -> tuple[str, list]:
            converted, images = _chat_messages(messages, media)
            return chat_template(engine.processor, converted), images

        return await async_engine.run_off_thread(render, what="reading the images")

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise ModelNotFoundError(
                f"The model `{name}` does not exist. This server serves `{served_model_name}`."
            )

    async def submit(
        prompt, images: list, fields: SamplingFields, max_tokens: int | None
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
        fields: SamplingFields,
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
