"""The OpenAI API's requests and errors as ``minirad serve`` reads and writes them.

Pydantic models of the request bodies (vLLM's fields, ``vllm/entrypoints/openai/protocol.py``),
checked before the engine sees them: JSON depth and size, text that is valid Unicode, sampling
fields in range, fields the engine does not implement refused unless off. Errors have OpenAI's
body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from minirad.engine.async_llm_engine import EngineDeadError
from minirad.engine.sampling_params import SamplingParams
from minirad.errors import GrammarError, MiniradError, RequestError

__all__ = [
    "INTERNAL_ERROR",
    "MAX_N",
    "ASCIIJSONResponse",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "ModelNotFoundError",
    "TokenizeRequest",
    "error_body",
    "error_response",
    "failure_body",
]

log = logging.getLogger(__name__)


MAX_N = 64  # choices per request (n): each is an engine request, so bound what one client asks


MAX_JSON_DEPTH = 64  # nesting of a request body: deeper is refused before anything reads it
# Commas in a request body (about its JSON values): past it the body is refused before it is
# parsed, since parsing and checking ten million numbers would hold the event loop, and so
# every client and /health, for seconds. Far above any context's worth of token ids.
MAX_JSON_VALUES = 200_000


class _Model(BaseModel):
    # Fields minirad does not read are ignored, as vLLM ignores them (it logs them); the
    # ones that would change the answer are refused (SamplingFields.check_supported).
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


class SamplingFields(_Body):
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
    # minirad's own: the usage says why each prompt token hit or missed (docs/serving.md).
    # vLLM and SGLang ignore a field they do not know, so a client may send it to either.
    minirad_explain: bool | None = False  # null: unset, as OpenAI clients send it

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
        self,
        max_tokens: int,
        defaults: Mapping[str, Any],
        eos: Sequence[int],
        max_tokens_field: str = "max_tokens",
    ) -> SamplingParams:
        """The engine's :class:`SamplingParams` for this request (``max_tokens_field``: the
        name the request gave ``max_tokens``, for the error).

        Raises:
            RequestError: an unsupported field or a value out of range.
            GrammarError: more than one structured-output constraint, or a malformed one.
        """
        self.check_supported()
        if max_tokens < 1:  # said with the request's name for it (SamplingParams: max_new_tokens)
            raise RequestError(f"{max_tokens_field} must be >= 1, got {max_tokens}")
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


class ChatCompletionRequest(SamplingFields):
    """The body of ``POST /v1/chat/completions`` (module docstring)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple]] = SamplingFields.UNSUPPORTED | {
        "logprobs": (None, False),
        "top_logprobs": (None, 0),
        "tools": (None, []),
        "tool_choice": (None, "none", "auto"),  # with no tools, "auto" calls none
        "echo": (None, False),  # vLLM's: the answer would start with the last message
    }


class CompletionRequest(SamplingFields):
    """The body of ``POST /v1/completions`` (module docstring)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions

    UNSUPPORTED: ClassVar[dict[str, tuple]] = SamplingFields.UNSUPPORTED | {
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


class ASCIIJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message that quotes what a
    client sent always encodes (Starlette's UTF-8 encoding fails on a lone surrogate)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return ASCIIJSONResponse(error_body(message, type_, status, param), status_code=status)


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


class ModelNotFoundError(Exception):
    """A model name this server does not serve (404, param ``model``)."""
