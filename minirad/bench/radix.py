"""Radix-cache benchmark: replay a multi-turn chat trace through :class:`RadixCache`.

Every request goes through the cache as SGLang's scheduler drives it:

1. **start**: :meth:`RadixCache.match_prefix_for_req` finds and locks the cached prefix;
   the uncached rest of the prompt and the decoded tokens get private slots from the
   :class:`TokenToKVPoolAllocator`, and when it is short, :meth:`RadixCache.evict` frees
   unlocked leaves first (SGLang's ``evict_from_tree_cache`` before ``alloc``,
   ``python/sglang/srt/mem_cache/common.py``). Slots for all decode steps are taken at
   admission, as a scheduler that reserves ``max_new_tokens`` would.
2. **finish**: :meth:`RadixCache.cache_finished_req` inserts prompt + output (all but the
   last sampled token, which has no KV), frees the duplicate slots and releases the lock.

The time of those calls alone (``time.perf_counter`` around each) is the *cache-op time*;
throughput is prompt tokens (and requests) per second of it. Generating the trace and
stepping through its timeline are not counted.

In the same process, on the same trace, the benchmark also replays the baselines: no cache
(every prompt token is prefilled; only the allocator runs), each eviction policy at the given
capacity, and a cache large enough never to evict (the upper bound on the hit rate).

Reading the results. On this multi-turn chat trace ``lru`` and ``fifo`` evict (nearly) the
same tokens: an unlocked leaf is usually the tail of an idle conversation, and the insert that
created it (when the conversation's last turn finished) also touched its whole path, so "least
recently used" and "oldest" both mean "the conversation idle the longest". They part once
eviction reaches inner nodes, whose creation and last access differ; other traces (shorter
system prompts, tighter memory) show small differences.
``lfu`` does worse here: every tail has ``hit_count`` 0 (it has never been matched) while
the prefixes above it have been hit, so lfu strips the latest turn off *every* idle
conversation, including those that just answered and are likeliest to come back, before it
drops any older prefix.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from ..argtypes import positive_int
from ..errors import InvalidArgumentError
from ..eviction import POLICIES
from ..kv_pool import TokenToKVPoolAllocator
from ..radix_cache import RadixCache, Req
from .trace import ChatTrace, make_chat_trace

__all__ = [
    "RadixBenchmark",
    "ReplayResult",
    "add_arguments",
    "format_report",
    "replay",
    "run_cli",
    "run_radix_benchmark",
]


@dataclass
class ReplayResult:
    """What one replay of a trace measured.

    Attributes:
        label: row name in the report (``"no cache"``, a policy name, ``"infinite"``).
        policy: eviction policy, or None for the no-cache baseline.
        capacity: pool size in tokens.
        requests: requests replayed.
        prompt_tokens: sum of prompt lengths, in tokens.
        hit_tokens: prompt tokens found in the cache (not prefilled), in tokens.
        evicted_tokens: tokens evicted from the tree.
        cache_seconds: wall time spent inside cache and allocator calls, in seconds.
        allocator: the KV slot allocator after the replay, for inspection.
        cache: the cache after the replay (None for no cache), for inspection.
    """

    label: str
    policy: str | None
    capacity: int
    requests: int
    prompt_tokens: int
    hit_tokens: int
    evicted_tokens: int
    cache_seconds: float
    allocator: TokenToKVPoolAllocator = field(repr=False)
    cache: RadixCache | None = field(default=None, repr=False)

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / prompt_tokens`` (a request's last prompt token never hits)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens that must be computed: ``prompt_tokens - hit_tokens``."""
        return self.prompt_tokens - self.hit_tokens

    @property
    def tokens_per_s(self) -> float:
        """Prompt tokens through the cache per second of cache-op time."""
        return self.prompt_tokens / self.cache_seconds if self.cache_seconds else float("inf")

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.cache_seconds if self.cache_seconds else float("inf")


def _ceil_to(n: int, page_size: int) -> int:
    return -(-n // page_size) * page_size


def replay(
    trace: ChatTrace,
    capacity: int,
    page_size: int = 1,
    policy: str | None = "lru",
    label: str | None = None,
    progress: bool = False,
) -> ReplayResult:
    """Replay ``trace`` through a fresh allocator of ``capacity`` tokens and a fresh cache.

    Args:
        trace: the workload.
        capacity: KV pool size in tokens (a multiple of ``page_size``).
        page_size: tokens per KV page.
        policy: eviction policy name, or None to run without a cache (allocate every prompt
            token, free everything when the request finishes).
        label: row name; defaults to the policy name (or ``"no cache"``).
        progress: show a tqdm bar on stderr.

    Returns:
        the measurements; ``result.cache`` and ``result.allocator`` hold the final state
        (every lock released, every slot either free or owned by the tree).

    Raises:
        InvalidArgumentError: ``capacity`` is below :meth:`ChatTrace.peak_running_tokens`,
            so some request could not be admitted even after evicting everything unlocked.
    """
    need_peak = trace.peak_running_tokens(page_size)
    if capacity < need_peak:
        raise InvalidArgumentError(
            f"capacity {capacity} tokens is too small for this trace: its running requests "
            f"hold up to {need_peak} tokens at once"
        )
    alloc = TokenToKVPoolAllocator(capacity, page_size)
    cache = RadixCache(page_size, policy, alloc) if policy is not None else None
    label = label or (policy if policy is not None else "no cache")
    requests = trace.requests
    running: dict[int, Req] = {}
    clock = time.perf_counter
    spent = 0.0
    hits = evicted = 0
    bar = tqdm(
        trace.events,
        desc=f"{label:>10}",
        unit="ev",
        disable=not progress,
        leave=False,
        mininterval=0.5,
    )
    for ev in bar:
        r = requests[ev.request]
        if ev.kind == "start":
            req = Req(r.rid, r.prompt)
            # KV for the prompt and every decoded token except the last sampled one.
            num_kv = len(r.prompt) + len(r.output) - 1
            t0 = clock()
            if cache is not None:
                cache.match_prefix_for_req(req)
            need = num_kv - len(req.kv_indices)
            short = _ceil_to(need, page_size) - alloc.available_size()
            if short > 0 and cache is not None:
                evicted += len(cache.evict(short))
            req.kv_indices += alloc.alloc(need, owner=req.rid)
            spent += clock() - t0
            hits += len(req.prefix_indices)
            running[ev.request] = req
        else:
            req = running.pop(ev.request)
            req.output_ids = r.output
            t0 = clock()
            if cache is not None:
                cache.cache_finished_req(req)
            else:
                alloc.free(req.kv_indices)
            spent += clock() - t0
    bar.close()
    return ReplayResult(
        label=label,
        policy=policy,
        capacity=capacity,
        requests=len(requests),
        prompt_tokens=trace.prompt_tokens,
        hit_tokens=hits,
        evicted_tokens=evicted,
        cache_seconds=spent,
        allocator=alloc,
        cache=cache,
    )


@dataclass
class RadixBenchmark:
    """One benchmark: the headline run and its baselines, all on one trace.

    Attributes:
        policy: the headline policy (one of ``policies``).
        no_cache: the baseline without a prefix cache.
        policies: one run per eviction policy at the given capacity, by name.
        infinite: a run with a pool big enough never to evict.
    """

    trace: ChatTrace
    page_size: int
    policy: str
    no_cache: ReplayResult
    policies: dict[str, ReplayResult]
    infinite: ReplayResult

    @property
    def headline(self) -> ReplayResult:
        return self.policies[self.policy]

    @property
    def runs(self) -> list[ReplayResult]:
        return [self.no_cache, *self.policies.values(), self.infinite]


def run_radix_benchmark(
    trace: ChatTrace,
    capacity: int,
    page_size: int = 1,
    policy: str = "lru",
    policies: Iterable[str] = tuple(POLICIES),
    progress: bool = False,
) -> RadixBenchmark:
    """Replay ``trace`` without a cache, with every policy in ``policies`` at ``capacity``
    tokens, and with an infinite pool. ``policy`` (the headline) is always among the runs.

    Raises:
        InvalidArgumentError: unknown policy, or ``capacity`` too small (see :func:`replay`).
    """
    names = list(dict.fromkeys([policy, *policies]))
    unknown = [p for p in names if p not in POLICIES]
    if unknown:
        raise InvalidArgumentError(
            f"unknown eviction policy {unknown}; choose from {list(POLICIES)}"
        )
    no_cache = replay(trace, capacity, page_size, None, progress=progress)
    runs = {p: replay(trace, capacity, page_size, p, progress=progress) for p in names}
    # Never evicts: room for everything the trace can cache plus what running requests hold.
    big = trace.max_cached_tokens(page_size) + trace.peak_running_tokens(page_size)
    infinite = replay(trace, _ceil_to(big, page_size), page_size, policy, "infinite", progress)
    return RadixBenchmark(trace, page_size, policy, no_cache, runs, infinite)


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def format_report(bench: RadixBenchmark) -> str:
    """The benchmark as a small text table plus the ratios that matter, one per line."""
    t = bench.trace
    head = bench.headline
    lines = [
        f"trace: {t.num_conversations} conversations, {len(t.requests)} requests, "
        f"{t.prompt_tokens:,} prompt tokens, {len(t.system_prompts)} system prompts; "
        f"page_size {bench.page_size}",
        "",
        f"{'run':<10} {'capacity':>11} {'hit rate':>9} {'prefill tok':>12} {'saved':>6} "
        f"{'evicted tok':>12} {'tokens/s':>9} {'req/s':>8}",
    ]
    for r in bench.runs:
        name = r.label + (" *" if r is head else "")
        saved = t.prompt_tokens / r.prefill_tokens if r.prefill_tokens else float("inf")
        lines.append(
            f"{name:<10} {r.capacity:>11,} {r.hit_rate:>9.1%} {r.prefill_tokens:>12,} "
            f"{saved:>5.2f}x {r.evicted_tokens:>12,} {_si(r.tokens_per_s):>9} "
            f"{_si(r.requests_per_s):>8}"
        )
    inf = bench.infinite
    lines += [
        "",
        f"prefill tokens saved vs no cache: {t.prompt_tokens / head.prefill_tokens:.2f}x "
        f"({head.label} at {head.capacity:,} tokens); "
        f"{t.prompt_tokens / inf.prefill_tokens:.2f}x with infinite capacity",
    ]
    for r in bench.policies.values():
        share = r.hit_rate / inf.hit_rate if inf.hit_rate else 0.0
        lines.append(
            f"{r.label} hit rate vs infinite-cache bound: {r.hit_rate:.1%} / {inf.hit_rate:.1%}"
            f" = {share:.3f}"
        )
    lines += [
        f"cache-op throughput ({head.label}): {head.tokens_per_s:,.0f} prompt tokens/s, "
        f"{head.requests_per_s:,.0f} requests/s",
        f"  ({head.cache_seconds:.2f} s of match + lock + evict + alloc + insert + unlock + free)",
        "(* = --policy; tokens/s = prompt tokens per second of cache-op time; "
        "'no cache' times the allocator alone)",
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``radix`` subcommand's options."""
    parser.add_argument(
        "--conversations", type=positive_int, default=2000, help="number of conversations"
    )
    parser.add_argument("--turns", type=positive_int, default=4, help="mean turns per conversation")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace")
    parser.add_argument(
        "--capacity", type=positive_int, default=262144, help="KV pool size in tokens"
    )
    parser.add_argument("--page-size", type=positive_int, default=1, help="tokens per KV page")
    parser.add_argument(
        "--policy",
        default="lru",
        choices=sorted(POLICIES),
        help="headline eviction policy; every policy is run for comparison",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def run_cli(args: argparse.Namespace) -> int:
    """Run ``python -m minirad.bench radix``: print the report, return the exit code."""
    trace = make_chat_trace(args.conversations, args.turns, args.seed)
    bench = run_radix_benchmark(
        trace, args.capacity, args.page_size, args.policy, progress=not args.no_progress
    )
    print(format_report(bench))
    return 0
