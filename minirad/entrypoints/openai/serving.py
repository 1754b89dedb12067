"""What ``minirad serve``'s endpoints do: OpenAI's requests in, engine requests out, answers and
streams back (vLLM's ``OpenAIServingChat`` / ``OpenAIServingCompletion`` in one class).

The routes (``api_server.py``) only hand each request to :class:`OpenAIServing`. It renders
chat messages with the model's chat template and reads their images on an input thread (never
the event loop's, never the engine's), queues a request's ``n`` choices in the engine, and
answers with one JSON body or a stream of server-sent events. A client that leaves aborts its
requests; their KV stays cached, unlocked.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minirad.engine import GenerateRequest, LLMEngine, RequestOutput
from minirad.engine.async_llm_engine import AsyncLLMEngine, RequestFailedError, RequestStream
from minirad.engine.media import MediaFolder
from minirad.entrypoints.chat_utils import chat_template, image_from_url
from minirad.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    ModelNotFoundError,
    SamplingFields,
    TextPart,
    TokenizeRequest,
    failure_body,
)
from minirad.errors import RequestError

__all__ = ["OpenAIServing"]

# A choice of the final answer, from its last output; a chunk's choice from a new output (None:
# the stream's opening chunk, which a function may decline by returning None).
FinalChoice = Callable[[int, RequestOutput], dict]
DeltaChoice = Callable[[int, RequestOutput | None], dict | None]


class OpenAIServing:
    """The endpoints' logic for ``engine`` (run by ``async_engine``'s thread), served as
    ``served_model_name``; image paths are read from ``media`` only."""

    def __init__(
        self,
        engine: LLMEngine,
        async_engine: AsyncLLMEngine,
        served_model_name: str,
        model_path: str | None,
        media: MediaFolder,
    ) -> None:
        self.engine, self.async_engine, self.media = engine, async_engine, media
        self.served_model_name = served_model_name
        self.model_path = model_path or served_model_name
        generation = engine.vlm.model.generation_config.to_diff_dict()
        keys = ("temperature", "top_p", "top_k")
        self.defaults = {k: generation[k] for k in keys if k in generation}
        self.created = int(time.time())

    # ------------------------------------------------------------------------------ endpoints
    async def chat_completions(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        prompt, images = await self.chat_prompt(body.messages)
        max_tokens, field = body.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, field = body.max_tokens, "max_tokens"
        rid, stream = await self.submit(prompt, images, body, max_tokens, field)
        head = self._head(f"chatcmpl-{rid}", "chat.completion")

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
        return await self.respond(raw, stream, body, head, chunk_object, final_choice, delta_choice)

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        prompt = _completion_prompt(body.prompt)
        rid, stream = await self.submit(prompt, [], body, body.max_tokens)
        head = self._head(f"cmpl-{rid}", "text_completion")

        def choice(i: int, text: str, reason: str | None) -> dict:
            return {"index": i, "text": text, "logprobs": None, "finish_reason": reason}

        def final_choice(i: int, out: RequestOutput) -> dict:
            return choice(i, out.text, out.finish_reason)

        def delta_choice(i: int, out: RequestOutput | None) -> dict | None:
            if out is None:  # completions open with the first text
                return None
            return choice(i, out.new_text, out.finish_reason)

        chunk_object = "text_completion"  # vLLM's and OpenAI's name for its chunks too
        return await self.respond(raw, stream, body, head, chunk_object, final_choice, delta_choice)

    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("give a prompt or messages, one of the two")
        prompt, images = body.prompt, []
        if body.messages is not None:
            prompt, images = await self.chat_prompt(body.messages)
        # The ids a completion of the same prompt is computed from (images expanded).
        processed = await self.async_engine.run_off_thread(
            self.engine.input_processor.process, prompt, images, what="processing the prompt"
        )
        ids = processed.prompt_token_ids
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        vocab_size = self.engine.vocab_size
        if bad := [t for t in body.tokens if not 0 <= t < vocab_size][:5]:
            raise RequestError(f"token ids must be in 0..{vocab_size - 1}, got {bad}")
        if self.engine.tokenizer is None:
            raise RequestError("this server has no tokenizer to detokenize with")
        # Any ids, placeholders of images included (/tokenize gives those), as vLLM does.
        text = await self.async_engine.run_off_thread(
            self.engine.tokenizer.decode, body.tokens, what="detokenizing"
        )
        return {"prompt": text}

    def models(self) -> dict:
        card = {
            "id": self.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "minirad",
            "root": self.model_path,
            "parent": None,
            "max_model_len": self.engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    # SGLang's discovery endpoints: sglang-router asks a worker for them when it registers it,
    # and names the worker's model from them (else "unknown", as it names vLLM's).
    def server_info(self) -> dict:
        limits = {
            "context_length": self.engine.max_model_len,
            "page_size": self.engine.config.page_size,
            # Where and in what the engine computes, as SGLang's server args name them.
            "device": str(self.engine.device),
            "dtype": str(self.engine.dtype).removeprefix("torch."),
        }
        return self._paths() | {"served_model_name": self.served_model_name} | limits

    def model_info(self) -> dict:
        return self._paths() | {"is_generation": True, "has_image_understanding": True}

    # -------------------------------------------------------------------------------- helpers
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            shown = name if len(name) <= 100 else name[:100] + "..."
            raise ModelNotFoundError(
                f"The model `{shown}` does not exist. This server serves "
                f"`{self.served_model_name}`."
            )

    async def chat_prompt(self, messages: Sequence[ChatMessage]) -> tuple[str, list]:
        """The chat template's prompt for ``messages`` and their images, read and decoded on
        an input thread (never the event loop's, never the engine's)."""

        def render() -> tuple[str, list]:
            converted, images = _chat_messages(messages, self.media)
            return chat_template(self.engine.processor, converted), images

        return await self.async_engine.run_off_thread(render, what="reading the images")

    async def submit(
        self,
        prompt,
        images: list,
        fields: SamplingFields,
        max_tokens: int | None,
        max_tokens_field: str = "max_tokens",
    ) -> tuple[str, RequestStream]:
        """Queue the request's ``n`` choices as engine requests (vLLM's parallel sampling:
        ``{index}_{id}``, seeds ``seed + index``; the prompt's KV is shared through the radix
        tree); returns the API request's id and their outputs."""
        # No max_tokens: until the context is full (the engine stops there), as vLLM does.
        max_tokens = self.engine.max_model_len if max_tokens is None else max_tokens
        eos = self.engine.eos_token_ids
        params = fields.sampling_params(max_tokens, self.defaults, eos, max_tokens_field)
        if fields.minirad_explain:
            await self.start_explaining()
        rid = uuid.uuid4().hex
        children = []
        for i in range(fields.n):
            child = params
            if i and params.seed is not None:  # its own draws, reproducible; wrap past 2**64
                seed = params.seed + i
                child = replace(params, seed=seed if seed < 2**64 else seed - 2**64)
            child_rid = rid if fields.n == 1 else f"{i}_{rid}"
            children.append(GenerateRequest(prompt, images, child, child_rid))
        return rid, await self.async_engine.add_request(children)

    async def start_explaining(self) -> None:
        """Have the engine explain its misses from now on (on its thread, between two steps),
        unless it does already: the first request that asks turns it on for every later one
        (what was evicted before is unknown to it, docs/serving.md)."""
        explainer = self.engine.explainer
        if explainer is None or explainer.error is not None:
            await self.async_engine.call(lambda engine: engine.explain())

    async def respond(
        self,
        raw: Request,
        stream: RequestStream,
        fields: SamplingFields,
        head: dict,
        chunk_object: str,
        final_choice: FinalChoice,
        delta_choice: DeltaChoice,
    ) -> Response:
        """The JSON answer (``head``, a ``final_choice`` per choice, the usage), or its
        server-sent events (:func:`_chunks`), each chunk ``head`` with ``chunk_object`` as its
        ``object``."""
        if not fields.stream:
            outs = await _final_outputs(stream, raw)
            if outs is None:
                return Response(status_code=499)
            choices = [final_choice(i, out) for i, out in enumerate(outs)]
            usage = _usage(outs, fields.minirad_explain)
            return JSONResponse(head | {"choices": choices, "usage": usage})
        include_usage = fields.stream_options is not None and fields.stream_options.include_usage
        chunk = head | {"object": chunk_object}
        chunks = _chunks(stream, fields, chunk, delta_choice, include_usage)
        return _EventStream(chunks, stream)

    def _head(self, id_: str, object_: str) -> dict:
        return {
            "id": id_,
            "object": object_,
            "created": int(time.time()),
            "model": self.served_model_name,
        }

    def _paths(self) -> dict:
        return dict.fromkeys(("model_path", "tokenizer_path"), self.model_path)


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


async def _chunks(
    stream: RequestStream,
    fields: SamplingFields,
    chunk: dict,
    delta_choice: DeltaChoice,
    include_usage: bool,
) -> AsyncIterator[str]:
    """A stream's events: ``delta_choice(i, None)`` per choice (the opening chunk, if any),
    a chunk per output with new text, the usage chunk if asked, then ``[DONE]``; a failure
    ends it with an error event."""
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
            usage = _usage([last[i] for i in sorted(last)], fields.minirad_explain)
            yield _sse(chunk | {"choices": [], "usage": usage})
    except RequestFailedError as e:
        yield _sse(failure_body(e.error))
    except Exception as e:  # the engine stopped, or the server is shutting down
        yield _sse(failure_body(e))
    yield _sse("[DONE]")


def _usage(outs: Sequence[RequestOutput], explain: bool = False) -> dict:
    """OpenAI's ``usage`` of one API request's choices: the prompt once, every choice's
    completion tokens; ``cached_tokens``: the first choice's (the others usually find its
    prompt cached, which is the point of sampling them together), and with a hierarchical
    cache ``cached_tokens_by_source`` (``device``, ``host``, ``storage``, adding up to it).
    With ``explain`` (the request's ``minirad_explain``), the first choice's ``miss_causes``:
    its prompt's runs as dicts (null if it has none: it was never admitted)."""
    prompt, completion = len(outs[0].prompt_token_ids), sum(len(o.token_ids) for o in outs)
    details: dict = {"cached_tokens": outs[0].stats.cached_tokens}
    by_source = outs[0].stats.cached_tokens_by_source
    if set(by_source) - {"device"}:  # a hierarchical cache: where the cached tokens came from
        details["cached_tokens_by_source"] = dict(by_source)
    if explain:
        runs = outs[0].stats.miss_causes
        details["miss_causes"] = None if runs is None else [r.to_dict() for r in runs]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": details,
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
