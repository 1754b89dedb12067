"""``minirad serve``: our engine behind an OpenAI-compatible HTTP API, as ``vllm serve`` is.

Routers (sglang-router, vllm-router), benchmark clients and the ``openai`` Python client speak
this API to vLLM and SGLang; a server that answers the same requests in the same shapes slots
into the same setups. The web stack is vLLM's: FastAPI on uvicorn. This module holds the routes
(each hands its request to :class:`~minirad.entrypoints.openai.serving.OpenAIServing`), the
errors' answers, and the server's life. What each endpoint takes and answers is in
``docs/serving.md``; the threads behind it in ``docs/architecture.md``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import threading
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from minirad.engine import LLMEngine
from minirad.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from minirad.engine.media import MediaFolder
from minirad.entrypoints.openai.intake import BodyIntake, Shutdown
from minirad.entrypoints.openai.metrics import VLLMMetrics
from minirad.entrypoints.openai.protocol import (
    INTERNAL_ERROR,
    ASCIIJSONResponse,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelNotFoundError,
    TokenizeRequest,
    error_response,
    failure_body,
)
from minirad.entrypoints.openai.serving import OpenAIServing
from minirad.errors import MiniradError

__all__ = ["SHUTDOWN_TIMEOUT_S", "build_app", "router", "run_server"]

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 5.0  # on SIGTERM: how long requests in flight may take to finish

router = APIRouter()


def serving(raw: Request) -> OpenAIServing:
    return raw.app.state.serving


# ---------------------------------------------------------------------------------- the routes
@router.get("/health")
async def health(raw: Request) -> Response:
    return Response(status_code=200 if raw.app.state.engine.is_healthy else 503)


@router.get("/server_info")
async def server_info(raw: Request) -> dict:
    return serving(raw).server_info()


@router.get("/model_info")
async def model_info(raw: Request) -> dict:
    return serving(raw).model_info()


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(raw: Request) -> dict:
    return {"success": await raw.app.state.engine.reset_prefix_cache()}


@router.get("/v1/models")
async def models(raw: Request) -> dict:
    return serving(raw).models()


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    return Response(generate_latest(raw.app.state.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
    return await serving(raw).chat_completions(body, raw)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request) -> Response:
    return await serving(raw).completions(body, raw)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw: Request) -> dict:
    return await serving(raw).tokenize(body)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, raw: Request) -> dict:
    return await serving(raw).detokenize(body)


# ---------------------------------------------------------------------------------- the errors
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
    param = _field(first) or None
    message = "; ".join(f"{_field(e) or 'body'}: {e.get('msg')}" for e in errors)
    return error_response(400, message or "invalid request", "BadRequestError", param)


def _field(error: dict) -> str:
    """The request field a validation error is about, as the client wrote it: its place after
    ``body``, without the names pydantic gives the members of a union (``str``,
    ``list[...]``, ``function-after[...]``)."""
    loc = error.get("loc", ())[1:]
    return ".".join(str(p) for p in loc if not isinstance(p, str) or not _TYPE_NAME.match(p))


_TYPE_NAME = re.compile(r"^(str|int|float|bool|list|dict|none|[a-z-]+\[.*\])$")
# The body fields a refusal may name first ("temperature must be ...", "logprobs is not ...").
_FIELDS = frozenset(
    set(ChatCompletionRequest.model_fields)
    | set(CompletionRequest.model_fields)
    | set(ChatCompletionRequest.UNSUPPORTED)
    | set(CompletionRequest.UNSUPPORTED)
)


async def refused(_: Request, exc: MiniradError) -> JSONResponse:
    message = " ".join(str(exc).split())
    named = message.split(" ", 1)[0]  # "temperature must be ...": the field it is about
    return error_response(400, message, "BadRequestError", named if named in _FIELDS else None)


async def not_found(_: Request, exc: ModelNotFoundError) -> JSONResponse:
    return error_response(404, str(exc), "NotFoundError", "model")


async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Starlette's own refusals (no such path, a wrong method, a body it cannot parse), in the
    # same body as ours rather than {"detail": ...}.
    type_ = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(
        exc.status_code, "BadRequestError"
    )
    detail = str(exc.detail)
    if detail == "There was an error parsing the body":  # e.g. bytes that are not UTF-8
        detail = "the request body is not valid JSON (or not UTF-8)"
    response = error_response(exc.status_code, detail, type_)
    response.headers.update(exc.headers or {})  # 405's Allow
    return response


async def engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
    return error_response(503, str(exc), "ServiceUnavailableError")


async def request_failed(_: Request, exc: RequestFailedError) -> JSONResponse:
    body = failure_body(exc.error)
    return ASCIIJSONResponse(body, status_code=body["error"]["code"])


async def internal(_: Request, exc: Exception) -> JSONResponse:
    # A bug, not a bad request (Starlette logs the traceback after this answer); the body
    # shows no internals.
    return error_response(500, INTERNAL_ERROR, "InternalServerError")


# Every error's answer has OpenAI's body; the handler of the most specific class answers.
ERROR_HANDLERS = {
    RequestValidationError: invalid_request,
    MiniradError: refused,
    ModelNotFoundError: not_found,
    StarletteHTTPException: http_error,
    EngineDeadError: engine_dead,
    RequestFailedError: request_failed,
    Exception: internal,
}


# ------------------------------------------------------------------------------------- the app
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

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="minirad", lifespan=lifespan)
    app.state.engine = async_engine
    app.state.serving = OpenAIServing(engine, async_engine, served_model_name, model_path, media)
    app.state.registry = CollectorRegistry()
    app.state.registry.register(VLLMMetrics(async_engine, served_model_name))
    app.state.shutdown = Shutdown()
    app.add_middleware(BodyIntake, shutdown=app.state.shutdown)
    for error, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)
    app.include_router(router)
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

    SIGTERM or SIGINT (Ctrl-C) stops taking connections and gives the requests in flight
    ``shutdown_timeout_s`` to finish (uvicorn's ``timeout_graceful_shutdown``); just before
    that runs out, those still running end with a 503 (a stream: an error event), those
    whose inputs are still being processed too, and what is left (a client that never
    finished sending its request) gets one as well. The process then ends, killed by the
    signal it got (exit status 143 or 130 in a shell, as ``uvicorn`` exits on SIGTERM):
    within the timeout, whatever its clients do, and without a traceback.
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
    # While it serves, uvicorn catches both signals; once it has shut down, it raises the one
    # it caught again, under the handler from before. SIGTERM's is the default action: the
    # process ends at once. SIGINT's was asyncio.run's, which made it a KeyboardInterrupt: a
    # traceback, then an interpreter shutdown that waited for the input threads to finish
    # the pictures they were reading (under load, an exit 6 to 17 s after Ctrl-C where
    # SIGTERM took 5). With the default action for SIGINT too, Ctrl-C ends the process as
    # SIGTERM does.
    ctrl_c = threading.current_thread() is threading.main_thread()  # else: no signals here
    previous = signal.signal(signal.SIGINT, signal.SIG_DFL) if ctrl_c else None
    try:
        asyncio.run(_serve(uvicorn.Server(config), app.state, shutdown_timeout_s))
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


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
