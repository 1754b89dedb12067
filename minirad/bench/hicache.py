"""HiCache benchmark: the radix benchmark's chat trace through a device pool alone and with a
host tier (:class:`~minirad.kvcache.hiradix_cache.HiRadixCache`) of 1, 2 and 4 times its size.

Same trace, same request order and same lifecycle as :func:`minirad.bench.radix.replay` (its
``_Lifecycle``): a request's ``match_prefix_for_req`` on a
:class:`~minirad.kvcache.hiradix_cache.HiRadixCache` matches both tiers, loads the host-only part
of the match back to the device (unless it is shorter than ``load_back_threshold``, 10 tokens:
recomputing those is cheaper) and locks it, as SGLang's scheduler does before a prefill. A
loaded-back token counts as a hit (it is not prefilled), reported apart from the tokens the
device already held.

The last row adds a disk tier behind the host (SGLang's L3 storage, here
:class:`~minirad.kvcache.hicache_storage.HiCacheMemoryStorage`, unbounded as a disk is next to
these pools): every backed-up page is written there, and before the load-back the pages that
follow the tree's match are prefetched from it to the host.

Belady's MIN is computed twice: at the device capacity (what any eviction policy of a
device-only cache can reach) and at device + host capacity (one flat pool as big as both tiers
together: a bound on the tiers too, since they hold at most that many distinct tokens).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from minirad.bench.radix import _Lifecycle, add_trace_arguments, capacity_for_fraction
from minirad.bench.trace import ChatTrace, make_chat_trace
from minirad.errors import InvalidArgumentError
from minirad.kvcache.belady import OptimalResult, belady
from minirad.kvcache.hicache_storage import HiCacheMemoryStorage
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
        host_hit_tokens: prompt tokens loaded back from the host (hits too: not prefilled),
            those read from the disk first included.
        evicted_tokens: device tokens evicted (deleted, or demoted to host-only).
        storage_hit_tokens: of ``host_hit_tokens``, those prefetched from the disk tier.
        disk: the run had a disk tier (its capacity is unbounded).
    """

    label: str
    device_capacity: int
    host_capacity: int
    prompt_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    evicted_tokens: int
    storage_hit_tokens: int = 0
    disk: bool = False

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
        self,
        trace: ChatTrace,
        capacity: int,
        page_size: int,
        ratio: float | None,
        write: str,
        disk: bool = False,
    ) -> None:
        super().__init__(trace, capacity, page_size, None)  # pool and bookkeeping, no cache
        if ratio is None:
            self.cache = RadixCache(page_size, "lru", self.alloc)
        else:
            storage = HiCacheMemoryStorage() if disk else None
            self.cache = HiRadixCache(
                page_size,
                "lru",
                self.alloc,
                hicache_ratio=ratio,
                write_policy=write,
                storage=storage,
            )
        self.loaded = 0  # tokens loaded back from the host
        self.from_disk = 0  # of those, tokens prefetched from the disk first

    def start(self, i: int) -> None:
        super().start(i)  # match_prefix_for_req: (prefetch ->) load back -> lock; counts hits
        req = self.running[i]
        self.loaded += req.host_hit_length + req.storage_hit_length
        self.from_disk += req.storage_hit_length


def replay_tiers(
    trace: ChatTrace,
    capacity: int,
    page_size: int = 1,
    hicache_ratio: float | None = None,
    write_policy: str = "write_through",
    disk: bool = False,
) -> HiCacheRun:
    """Replay ``trace`` (its own timeline) through a device pool of ``capacity`` tokens and,
    unless ``hicache_ratio`` is None, a host pool that many times its size; LRU on both; with
    ``disk``, an unbounded disk tier behind the host."""
    need = trace.peak_running_tokens(page_size)
    if capacity < need:
        raise InvalidArgumentError(
            f"capacity {capacity} tokens is too small for this trace: its running requests "
            f"hold up to {need} tokens at once"
        )
    ops = _TieredLifecycle(trace, capacity, page_size, hicache_ratio, write_policy, disk)
    for ev in trace.events:
        (ops.start if ev.kind == "start" else ops.finish)(ev.request)
    cache = ops.cache
    host = cache.host_pool.size if isinstance(cache, HiRadixCache) else 0
    # A loaded-back token is matched by the device match that follows: part of ops.hits.
    label = "device only" if hicache_ratio is None else f"host x{hicache_ratio:g}"
    label += " + disk" if disk else ""
    return HiCacheRun(
        label,
        capacity,
        host,
        trace.prompt_tokens,
        ops.hits - ops.loaded,
        ops.loaded,
        ops.evicted,
        ops.from_disk,
        disk,
    )


def run_hicache_benchmark(
    trace: ChatTrace,
    capacity: int,
    page_size: int = 1,
    ratios: tuple[float, ...] = DEFAULT_RATIOS,
    write_policy: str = "write_through",
    optimal: bool = True,
    disk_ratio: float | None = 2.0,
) -> tuple[list[HiCacheRun], dict[int, OptimalResult]]:
    """Device-only, one run per host ratio, and (unless ``disk_ratio`` is None) the host at
    ``disk_ratio`` with a disk tier; MIN at the device capacity and at each run's device +
    host capacity (keyed by capacity; for the disk run, the whole trace's unique tokens)."""
    if write_policy not in WRITE_POLICIES:
        raise InvalidArgumentError(f"write policy must be one of {WRITE_POLICIES}")
    runs = [replay_tiers(trace, capacity, page_size)]
    runs += [replay_tiers(trace, capacity, page_size, r, write_policy) for r in ratios]
    if disk_ratio is not None:
        runs.append(replay_tiers(trace, capacity, page_size, disk_ratio, write_policy, True))
    mins: dict[int, OptimalResult] = {}
    if optimal:
        for r in runs:
            cap = _min_capacity(trace, r, page_size)
            if cap not in mins:
                mins[cap] = belady(trace, cap, page_size)
    return runs, mins


def _min_capacity(trace: ChatTrace, run: HiCacheRun, page_size: int) -> int:
    """The flat pool MIN gets for ``run``: its device + host, or, with a disk, room for every
    unique token (whole pages), as if nothing were ever evicted."""
    if not run.disk:
        return run.total_capacity
    unique = -(-trace.unique_tokens() // page_size) * page_size
    return max(unique + trace.peak_running_tokens(page_size), run.total_capacity)


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
        f"{'run':<15} {'device':>9} {'host':>9} {'hit rate':>9} {'prefill tok':>12} "
        f"{'device hit':>11} {'host hit':>10} {'from disk':>10} {'MIN@total':>10} "
        f"{'% of MIN':>9}",
    ]
    for r in runs:
        o = mins.get(_min_capacity(trace, r, page_size))
        bound = f"{o.bound_hit_rate:.1%}" if o else "-"
        share = f"{r.hit_tokens / o.bound_hit_tokens:.1%}" if o and o.bound_hit_tokens else "-"
        lines.append(
            f"{r.label:<15} {r.device_capacity:>9,} {r.host_capacity:>9,} {r.hit_rate:>9.1%} "
            f"{r.prefill_tokens:>12,} {r.device_hit_tokens:>11,} {r.host_hit_tokens:>10,} "
            f"{r.storage_hit_tokens:>10,} {bound:>10} {share:>9}"
        )
    lines.append("")
    for cap, o in sorted(mins.items()):
        disk = any(r.disk and _min_capacity(trace, r, page_size) == cap for r in runs)
        what = (
            "device only"
            if cap == dev
            else "as big as the disk run needs"
            if disk
            else f"device {dev:,} + host {cap - dev:,}"
        )
        lines.append(
            f"MIN (Belady, one flat pool of {cap:,} tokens = {what}): schedule {o.hit_rate:.1%}"
            f" ({o.prompt_tokens - o.hit_tokens:,} prefill tokens), upper bound "
            f"{o.bound_hit_rate:.1%}"
        )
    lines += [
        "(hit = device hit + host hit; host hit = tokens loaded back from the host before the "
        "prefill, from disk = of those, read from the disk tier first; prefill tok = prompt "
        "tokens computed; MIN@total = MIN's upper bound at the run's device + host capacity "
        "(with a disk: room for everything), % of MIN = the run's hits over it)",
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
    parser.add_argument(
        "--disk-ratio",
        type=float,
        default=2.0,
        help="the host ratio of the last row, which adds a disk tier (SGLang's default 2)",
    )
    parser.add_argument("--no-disk", action="store_true", help="skip the disk row")


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
        disk_ratio=None if args.no_disk else args.disk_ratio,
    )
    print(format_report(trace, runs, mins, args.page_size, args.write_policy))
    return 0
