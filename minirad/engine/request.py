"""A generation request: what the user asks for, the engine's state of it, and what comes back.

Four objects, as in vLLM v1 (``vllm/v1/request.py``, ``vllm/outputs.py``) and SGLang
(``GenerateReqInput``, ``Req`` in ``managers/schedule_batch.py``):

- :class:`GenerateRequest` + :class:`~minirad.engine.sampling_params.SamplingParams`: the user's
  input (prompt, images, how to sample, when to stop).
- :class:`EngineCoreRequest`: the input processed (tokens, preprocessed images, compiled
  grammar), ready to queue.
- :class:`Request`: the engine's state of one request while it lives, one object as
  nano-vllm's ``Sequence``: a radix-cache :class:`~minirad.kvcache.radix_cache.Req` (token ids, KV
  slots, locked prefix) extended with what the model and the scheduler need (the model's
  ids, images, sampling, how many tokens have KV, its :class:`RequestStatus`).
- :class:`RequestOutput`: what the engine returns after each step that produced a token.

Lifecycle::

    WAITING --schedule--> RUNNING --stop token / max_new_tokens / context--> FINISHED_*
       ^                     |
       +------ PREEMPTED <---+  (out of KV slots: KV released, recomputed later)

A request that fails inside a step (its forward pass, its sampling, its grammar) ends as
``FINISHED_ERROR`` with the exception in ``error`` (vLLM v1's ``FINISHED_ERROR``, finish reason
``"error"``); the engine and the other requests go on.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from PIL import Image

from minirad.engine.processing import ImageItem, ImageSegment, ProcessedPrompt
from minirad.engine.sampling_params import SamplingParams
from minirad.errors import GrammarError, RequestError
from minirad.kvcache.radix_cache import Req

if TYPE_CHECKING:
    from minirad.engine.grammar import Grammar
    from minirad.kv_events.miss_causes import Run

__all__ = [
    "EngineCoreRequest",
    "GenerateRequest",
    "Request",
    "RequestOutput",
    "RequestStats",
    "RequestStatus",
]


@dataclass(frozen=True)
class GenerateRequest:
    """One generation request as the user writes it (SGLang's ``GenerateReqInput``).

    Attributes:
        prompt: text (run through the model's processor, which expands each image
            placeholder such as ``"<image>"``), or token ids that already contain the
            expanded placeholders (as the processor returns them).
        images: PIL images or paths to image files, one per image in the prompt, in order.
        sampling_params: see :class:`SamplingParams` (greedy, 16 tokens by default).
        rid: request id; the engine makes one if None.
        return_logits: keep the raw next-token logits of every generated token
            (``RequestOutput.logits``), e.g. to compare with HF's ``output_logits``.
    """

    prompt: str | Sequence[int]
    images: Sequence[Image.Image | str | os.PathLike] = ()
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    rid: str | None = None
    return_logits: bool = False


@dataclass(eq=False)
class EngineCoreRequest:
    """A request ready for the engine core (vLLM v1's ``EngineCoreRequest``): its prompt
    tokenized and its images preprocessed (:class:`~minirad.engine.processing.ProcessedPrompt`),
    its stop tokens resolved and its grammar compiled.

    Made by :meth:`LLMEngine.process_inputs`, which touches no engine state, so a server runs it
    off the engine thread (a big picture or grammar then holds up no one else's step); queued by
    :meth:`LLMEngine.add_request`, once (its grammar is the request's own state).
    """

    rid: str | None
    prompt: ProcessedPrompt
    sampling_params: SamplingParams
    stop_token_ids: tuple[int, ...]
    grammar: Grammar | None = None
    return_logits: bool = False
    added: bool = False  # set by add_request: a second add is refused


class RequestStatus(enum.Enum):
    """Where a request is in its lifecycle (vLLM v1 ``RequestStatus``)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or None (not finished)."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class RequestStats:
    """Per-request counters, in tokens.

    Attributes:
        prompt_tokens: prompt length, image placeholders included.
        cached_tokens: prompt tokens whose KV came from the radix tree at the first admission
            (vLLM's ``num_cached_tokens``): the hit rate's numerator, < ``prompt_tokens``
            (or equal, when a grammar's first forced run follows the prompt).
        preempted_cached_tokens: tokens found in the tree again at readmissions after a
            preemption (its own KV, outputs included): recompute saved, not hits (vLLM #25787).
        prefill_tokens: tokens computed in prefill steps (prompt chunks, and the recompute of
            a preempted request). Without preemption, ``cached + prefill == prompt``.
        decode_tokens: tokens computed one at a time after the prompt (decode steps).
        num_preemptions: how often the request lost its KV to make room.
        cached_forced_tokens: forced output tokens (the grammar's first run, appended before
            admission) whose KV the tree already held at the first admission: another request
            with the same prompt and grammar computed them. Without preemption,
            ``cached + cached_forced + prefill + decode == prompt + outputs - 1``.
        forced_tokens: output tokens its grammar forced and jump-forward appended without a
            decode step each (they are computed in the next prefill chunk; counted in
            ``prefill_tokens`` then).
        cached_tokens_by_source: ``cached_tokens`` by the tier they came from: ``device``
            (the radix tree's device pool), ``host`` (loaded back from the host pool),
            ``storage`` (read from the disk tier, then loaded back); the three add up to
            ``cached_tokens``. Only ``device`` without tiers.
        miss_causes: why each prompt token hit or missed, as runs of one cause each
            (:mod:`minirad.engine.explain`: ``hit``, ``host``, ``storage``, ``last_token``,
            ``in_flight``, ``preempted``, ``evicted``, ``block_floor``, ``first_seen``), set at
            the first admission when the engine explains its misses (``EngineConfig.
            explain_misses``); None otherwise. Left out of the repr (it is long).
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    preempted_cached_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    num_preemptions: int = 0
    cached_forced_tokens: int = 0
    forced_tokens: int = 0
    cached_tokens_by_source: dict[str, int] = field(default_factory=dict)
    miss_causes: list[Run] | None = field(default=None, repr=False)


class Request(Req):
    """The engine's state of one request (vLLM v1 ``Request``, SGLang ``Req``, nano-vllm's
    ``Sequence``): a :class:`~minirad.kvcache.radix_cache.Req`, so the radix cache's ``*_for_req``
    lifecycle takes it directly.

    Token ids exist in two forms. ``prompt_token_ids`` are what the model embeds: each image
    placeholder is ``image_token_id``. ``origin_input_ids`` is the radix-cache key: each
    placeholder of an image is replaced by that image's pad id (>= vocab size,
    :func:`minirad.kvcache.multimodal.pad_value`), so different images fork the tree at their first
    placeholder. Generated ids are shared by both (``output_ids``).

    ``kv_indices`` holds one KV slot per token that has (or, once this step's forward runs,
    will have) its K/V in the pool, so ``num_computed_tokens == len(kv_indices)``; the
    scheduler grows it when it schedules tokens, as vLLM advances ``num_computed_tokens`` at
    schedule time.

    Args:
        rid: request id.
        prompt_token_ids: the prompt, placeholders as ``image_token_id``.
        sampling_params: see :class:`SamplingParams`.
        stop_token_ids: resolved stop ids (the engine fills in the model's EOS).
        key_ids: the radix key of the prompt (pad ids for images); ``prompt_token_ids`` if
            None (a text-only prompt).
        images, segments: the prompt's images and where their placeholders sit
            (:mod:`minirad.engine.processing`).
        generator: the request's sampling RNG (None for greedy).
        return_logits: keep each generated token's logits in ``logits``.
        grammar: its structured-output state (:class:`~minirad.engine.grammar.Grammar`), or None.
    """

    def __init__(
        self,
        rid: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        stop_token_ids: Sequence[int] = (),
        key_ids: Sequence[int] | None = None,
        images: Sequence[ImageItem] = (),
        segments: Sequence[ImageSegment] = (),
        generator: torch.Generator | None = None,
        return_logits: bool = False,
        grammar: Grammar | None = None,
    ) -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.stop_token_ids = frozenset(stop_token_ids)
        key = self.prompt_token_ids if key_ids is None else list(key_ids)
        if len(key) != len(self.prompt_token_ids):
            raise RequestError(f"key has {len(key)} ids for {len(self.prompt_token_ids)} tokens")
        super().__init__(rid, key)
        self.images = list(images)
        self.segments = list(segments)
        self.generator = generator
        self.grammar = grammar
        self.logits: list[torch.Tensor] | None = [] if return_logits else None
        self.status = RequestStatus.WAITING
        self.error: Exception | None = None  # why it ended as FINISHED_ERROR
        self.stats = RequestStats(prompt_tokens=len(self.prompt_token_ids))
        self.output_text = ""  # output_ids decoded, cut at a stop string (the engine's)
        self.sent_text = ""  # text already returned (for streaming deltas)
        self.num_sent_tokens = 0

    # ------------------------------------------------------------------ token views
    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + generated ids, as the model embeds them."""
        return self.prompt_token_ids + self.output_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens so far."""
        return len(self.prompt_token_ids) + len(self.output_ids)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens with a KV slot (cached prefix + computed or scheduled this step)."""
        return len(self.kv_indices)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    # ------------------------------------------------------------------ generation
    def fail(self, error: Exception) -> None:
        """End the request with ``error`` (``FINISHED_ERROR``); the scheduler releases it."""
        self.status = RequestStatus.FINISHED_ERROR
        self.error = error

    def append_output_token_id(self, token_id: int, max_model_len: int) -> None:
        """Record a sampled token and finish the request if it should stop (vLLM's
        ``check_stop``): a stop token, a complete grammar without stop tokens (nothing may
        follow it), ``max_new_tokens`` reached, or the context full.

        A request already finished (aborted or failed during the step) drops the token. A token
        its grammar refuses (a matcher past its resource limits refuses every token) fails the
        request (:meth:`fail`) rather than the step.
        """
        if self.is_finished:
            return
        if self.grammar is not None:
            try:
                self.grammar.accept_token(token_id)
            except GrammarError as e:
                self.fail(e)
                return
        self.output_ids.append(token_id)
        if token_id in self.stop_token_ids or (
            self.grammar is not None and not self.stop_token_ids and self.grammar.is_terminated
        ):
            self.status = RequestStatus.FINISHED_STOPPED
        elif (
            len(self.output_ids) >= self.sampling_params.max_new_tokens
            or self.num_tokens >= max_model_len
        ):
            self.status = RequestStatus.FINISHED_LENGTH

    def jump_forward(self, max_model_len: int) -> int:
        """Append the run of tokens the grammar forces next (jump-forward decoding, SGLang
        paper §4) and return how many. They are outputs without KV: the next step computes them
        with the request's last sampled token as one prefill chunk, instead of one decode step
        each. The run stops one token short of ``max_new_tokens``, of the context, and (without
        stop tokens) of the grammar's end, so that the request still ends on a sampled token."""
        if self.grammar is None or self.is_finished:
            return 0
        room = min(
            self.sampling_params.max_new_tokens - len(self.output_ids),
            max_model_len - self.num_tokens,
        )
        forced = self.grammar.jump_forward_tokens()[: max(room - 1, 0)]
        self.grammar.accept_tokens(forced)
        if forced and not self.stop_token_ids and self.grammar.is_terminated:
            # The run completes the text and no stop token will end it: hand its last token
            # back to the sampler, which finishes the request on it (append_output_token_id),
            # instead of sampling the grammar's end token after it.
            self.grammar.rollback(1)
            forced = forced[:-1]
        self.output_ids.extend(forced)
        self.stats.forced_tokens += len(forced)
        return len(forced)

    def rollback_forced(self, num_tokens: int) -> None:
        """Take back the last ``num_tokens`` tokens of the last forced run (they have no KV
        yet): the engine does so when the run would complete a stop string, so that the token
        completing it is sampled in its own step, as without jump-forward."""
        if not 0 <= num_tokens <= self.stats.forced_tokens:
            raise RequestError(f"cannot take back {num_tokens} forced tokens")
        if num_tokens:
            self.grammar.rollback(num_tokens)
            del self.output_ids[-num_tokens:]
            self.stats.forced_tokens -= num_tokens

    def __repr__(self) -> str:
        return (
            f"Request(rid={self.rid!r}, status={self.status.value}, prompt={self.num_prompt_tokens}"
            f", output={len(self.output_ids)}, computed={self.num_computed_tokens})"
        )


@dataclass
class RequestOutput:
    """A request's output after a step (vLLM ``RequestOutput``, flattened).

    Attributes:
        rid: request id.
        prompt_token_ids: the prompt as the model saw it (placeholders expanded).
        token_ids: every generated token so far (a stop token included).
        text: ``token_ids`` decoded, special tokens skipped ("" without a tokenizer), cut at
            a stop string (``SamplingParams.stop``). Before the request finishes, the text
            so far less what may still change (a partial UTF-8 character, the start of a
            stop string): every ``new_text`` so far, joined.
        new_token_ids, new_text: what this step added (for streaming).
        finished: no more tokens will come.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or None.
        stats: the request's :class:`RequestStats` (a snapshot).
        logits: ``[len(token_ids), vocab]`` raw next-token logits (fp32, on the CPU whatever
            the engine's device), if asked for.
        error: with finish reason ``"error"``, what failed (a
            :class:`~minirad.errors.MiniradError` when the request itself was at fault, such
            as a grammar past its resource limits; any other exception is the engine's).
    """

    rid: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    stats: RequestStats
    logits: torch.Tensor | None = None
    error: Exception | None = None

    @property
    def miss_causes(self) -> list[Run] | None:
        """Why each prompt token hit or missed (``stats.miss_causes``; None unless the engine
        explains its misses)."""
        return self.stats.miss_causes
