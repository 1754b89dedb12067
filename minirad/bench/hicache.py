"""HiCache benchmark: the radix benchmark's chat trace through a device pool alone and with a
host tier (:class:`~minirad.kvcache.hiradix_cache.HiRadixCache`) of 1, 2 and 4 times its size.

Same trace, same request order and same lifecycle as :func:`minirad.bench.radix.replay` (its
``_Lifecycle``), with one step added before a request's prefill, as SGLang's scheduler does it:
match both tiers, load the host-only part of the match back to the device (unless it is shorter
than ``load_back_threshold``, 10 tokens: recomputing those is cheaper), then match and lock on
the device as usual. A loaded-back token counts as a hit (it is not prefilled), reported apart
from the tokens the device already held.

Belady's MIN is computed twice: at the device capacity (what any eviction policy of a
device-only cache can reach) and at device + host capacity (one flat pool as big as both tiers
together: a bound on the tiers too, since they hold at most that many distinct tokens).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from minirad.bench.optimal import OptimalResult, belady
from minirad.bench.radix import _Lifecycle, add_trace_arguments, capacity_for_fraction
from minirad.bench.trace import ChatTrace, make_chat_trace
from minirad.errors import InvalidArgumentError
from minirad.kvcache.hiradix_cache import WRITE_POLICIES, HiRadixCache
from minirad.kvcache.radix_cache import RadixCache

__all__ = [
    "DEFAULT_RATIOS",
    "HiCacheRun",
    "add_arguments",
    "format_report",
    "replay_tiers",
    "run_cli",
    "run_hicache_benchmark",
]

DEFAULT_RATIOS: tuple[float, ...] = (1.0, 2.0, 4.0)


@dataclass
class HiCacheRun:
    """One replay of the trace.

    Attributes:
        label: row name (``"device only"``, ``"host x2"``...).
        device_capacity: device pool size, in tokens.
        host_capacity: host pool size, in tokens (0 without a host tier).
        prompt_tokens: sum of prompt lengths, in tokens.
        device_hit_tokens: prompt tokens the device held at the request's start.
        host_hit_tokens: prompt tokens loaded back from the host (hits too: not prefilled).
        evicted_tokens: device tokens evicted (deleted, or demoted to host-only).
    """

    label: str
    device_capacity: int
    host_capacity: int
    prompt_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    evicted_tokens: int

    @property
    def hit_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens that must be computed."""
        return self.prompt_tokens - self.hit_tokens

    @property
    def total_capacity(self) -> int:
        return self.device_capacity + self.host_capacity


class _TieredLifecycle(_Lifecycle):
    """radix.py's lifecycle over a RadixCache (``ratio`` None) or a HiRadixCache, with the
    load-back step before each request's device match."""

    def __init__(
        self, trace: ChatTrace, capacity: int, page_size: int, ratio: float | None, write: str
    ) -> None:
        super().__init__(trace, capacity, page_size, None)  # pool and bookkeeping, no cache
        if ratio is None:
            self.cache = RadixCache(page_size, "lru", self.alloc)
        else:
            self.cache = HiRadixCache(
                page_size, "lru", self.alloc, hicache_ratio=ratio, write_policy=write
            )
        self.loaded = 0  # tokens loaded back from the host

    def start(self, i: int) -> None:
        cache = self.cache
        if isinstance(cache, HiRadixCache):  # match -> load_back, then the usual start
            m = cache.match_prefix(self.requests[i].prompt[:-1])
            if m.host_hit_length:
                self.loaded += len(cache.load_back(m.last_host_node) or [])
        super().start(i)  # match + lock on the device, evict, alloc; counts every hit


def replay_tiers(
    trace: ChatTrace,
    capacity: int,
    page_size: int = 1,
    hicache_ratio: float | None = None,
    write_policy: str = "write_through",
) -> HiCacheRun:
    """Replay ``trace`` (its own timeline) through a device pool of ``capacity`` tokens and,
    unless ``hicache_ratio`` is None, a host pool that many times its size; LRU on both."""
    need = trace.peak_running_tokens(page_size)
    if capacity < need:
        raise InvalidArgumentError(
            f"capacity {capacity} tokens is too small for this trace: its running requests "
            f"hold up to {need} tokens at once"
        )
    ops = _TieredLifecycle(trace, capacity, page_size, hicache_ratio, write_policy)
    for ev in trace.events:
        (ops.start if ev.kind == "start" else ops.finish)(ev.request)
    cache = ops.cache
    host = cache.host_pool.size if isinstance(cache, HiRadixCache) else 0
    # A loaded-back token is matched by the device match that follows: part of ops.hits.
    label = "device only" if hicache_ratio is None else f"host x{hicache_ratio:g}"
    return HiCacheRun(
        label, capacity, host, trace.prompt_tokens, ops.hits - ops.loaded, ops.loaded, ops.evicted
    )


def run_hicache_benchmark(
    trace: ChatTrace,
    capacity: int,
    page_size: int = 1,
    ratios: tuple[float, ...] = DEFAULT_RATIOS,
    write_policy: str = "write_through",
    optimal: bool = True,
) -> tuple[list[HiCacheRun], dict[int, OptimalResult]]:
    """Device-only and one run per host ratio; MIN at the device capacity and at each run's
    device + host capacity (keyed by capacity)."""
    if write_policy not in WRITE_POLICIES:
        raise InvalidArgumentError(f"write policy must be one of {WRITE_POLICIES}")
    runs = [replay_tiers(trace, capacity, page_size)]
    runs += [replay_tiers(trace, capacity, page_size, r, write_policy) for r in ratios]
    mins: dict[int, OptimalResult] = {}
    if optimal:
        for r in runs:
            if r.total_capacity not in mins:
                mins[r.total_capacity] = belady(trace, r.total_capacity, page_size)
    return runs, mins


def format_report(
    trace: ChatTrace,
    runs: list[HiCacheRun],
    mins: dict[int, OptimalResult],
    page_size: int,
    write_policy: str,
) -> str:
    unique = trace.unique_tokens()
    dev = runs[0].device_capacity
    lines = [
        f"trace: {trace.num_conversations} conversations, {len(trace.requests)} requests, "
        f"{trace.prompt_tokens:,} prompt tokens, {unique:,} unique tokens; page_size {page_size}",
        f"device pool: {dev:,} tokens = {dev / unique:.1%} of the unique tokens; host write "
        f"policy {write_policy}, LRU on both tiers, load-back threshold 10 tokens",
        "",
        f"{'run':<12} {'device':>9} {'host':>9} {'hit rate':>9} {'prefill tok':>12} "
        f"{'device hit':>11} {'host hit':>10} {'MIN@total':>10} {'% of MIN':>9}",
    ]
    for r in runs:
        o = mins.get(r.total_capacity)
        bound = f"{o.bound_hit_rate:.1%}" if o else "-"
        share = f"{r.hit_tokens / o.bound_hit_tokens:.1%}" if o and o.bound_hit_tokens else "-"
        lines.append(
            f"{r.label:<12} {r.device_capacity:>9,} {r.host_capacity:>9,} {r.hit_rate:>9.1%} "
            f"{r.prefill_tokens:>12,} {r.device_hit_tokens:>11,} {r.host_hit_tokens:>10,} "
            f"{bound:>10} {share:>9}"
        )
    lines.append("")
    for cap, o in sorted(mins.items()):
        what = "device only" if cap == dev else f"device {dev:,} + host {cap - dev:,}"
        lines.append(
            f"MIN (Belady, one flat pool of {cap:,} tokens = {what}): schedule {o.hit_rate:.1%}"
            f" ({o.prompt_tokens - o.hit_tokens:,} prefill tokens), upper bound "
            f"{o.bound_hit_rate:.1%}"
        )
    lines += [
        "(hit = device hit + host hit; host hit = tokens loaded back from the host before the "
        "prefill; prefill tok = prompt tokens computed; MIN@total = MIN's upper bound at the "
        "run's device + host capacity, % of MIN = the run's hits over it)",
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``hicache`` subcommand's options (the trace and pool ones as ``radix``'s)."""
    add_trace_arguments(parser, capacity=None, capacity_frac=0.1, pool="device pool")
    parser.add_argument(
        "--ratios",
        type=float,
        nargs="+",
        default=list(DEFAULT_RATIOS),
        help="host pool sizes, as multiples of the device pool (SGLang's --hicache-ratio)",
    )
    parser.add_argument(
        "--write-policy", default="write_through", choices=WRITE_POLICIES, help="host backups"
    )
    parser.add_argument("--no-optimal", action="store_true", help="skip Belady's MIN")


def run_cli(args: argparse.Namespace) -> int:
    """Run ``python -m minirad.bench hicache``: print the report, return the exit code."""
    trace = make_chat_trace(args.conversations, args.turns, args.seed)
    capacity = args.capacity
    if capacity is None:
        capacity = capacity_for_fraction(trace, args.capacity_frac, args.page_size)
    runs, mins = run_hicache_benchmark(
        trace,
        capacity,
        args.page_size,
        tuple(args.ratios),
        args.write_policy,
        optimal=not args.no_optimal,
    )
    print(format_report(trace, runs, mins, args.page_size, args.write_policy))
    return 0
