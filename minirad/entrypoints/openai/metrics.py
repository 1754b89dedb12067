"""``/metrics``: Prometheus text with vLLM 0.32's metric names (and SGLang's
``sglang:cached_tokens_total`` by ``cache_source``), from the engine thread's snapshot."""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from minirad.engine.async_llm_engine import AsyncLLMEngine, EngineSnapshot

__all__ = [
    "VLLMMetrics",
]

log = logging.getLogger(__name__)


class VLLMMetrics:
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
        # SGLang's name, with its cache_source label: the prefix hits by the tier they came
        # from (device only without a hierarchical cache).
        cached = CounterMetricFamily(
            "sglang:cached_tokens",
            "Number of cached prompt tokens, by the tier they came from.",
            labels=[*names, "cache_source"],
        )
        by_source = snapshot.stats.cached_tokens_by_source or {"device": 0}
        for source, n in by_source.items():
            cached.add_metric([*self.labels, source], n)
        yield cached
