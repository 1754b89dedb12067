"""What one batch of requests cost and saved (:class:`BatchStats`), measured around the engine
as it runs them (:func:`run_batch`): ``minirad batch``'s summary."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minirad.errors import MiniradError

if TYPE_CHECKING:  # the engine imports torch and transformers
    from minirad.engine import GenerateRequest, LLMEngine, RequestOutput

__all__ = ["BatchStats", "run_batch"]


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
        """The summary ``minirad batch`` prints: one row per figure, the names aligned."""
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
