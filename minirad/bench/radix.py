"""Radix-cache benchmark: replay a multi-turn chat trace through :class:`RadixCache`.

Each request goes through the cache as SGLang's scheduler drives it (match and lock, evict and
allocate, insert and unlock when it finishes); only those calls are timed. In the same run, on
the same trace, it replays the baselines that make a hit rate mean something: no cache, each
eviction policy, an infinite cache, and Belady's MIN on the same request order; an optional
waiting queue (``--max-running``, ``--schedule``) shows what a scheduler adds. How it is
measured and how to read the results: ``docs/benchmarks.md``, "The radix cache on a chat trace".
"""

from __future__ import annotations

import argparse
import heapq
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from minirad.bench.trace import ChatTrace, TraceEvent, make_chat_trace
from minirad.entrypoints.argtypes import positive_int
from minirad.errors import InvalidArgumentError
from minirad.kvcache.belady import OptimalResult, belady
from minirad.kvcache.eviction import EVICTION_POLICIES, ClosedSessionLRUPolicy
from minirad.kvcache.kv_pool import TokenToKVPoolAllocator
from minirad.kvcache.radix_cache import RadixCache, Req

__all__ = [
    "BENCH_POLICIES",
    "SCHEDULES",
    "RadixBenchmark",
    "ReplayResult",
    "add_arguments",
    "capacity_for_fraction",
    "format_report",
    "replay",
    "run_cli",
    "run_radix_benchmark",
]


# Every policy the benchmark runs: the cache's own, plus the reuse-aware one that needs to be
# told when a conversation closes (replay() does, when a conversation's last turn finishes).
# Not "priority": the trace's requests carry no priority, so it would rank every leaf as lru.
BENCH_POLICIES: tuple[str, ...] = (
    *(name for name in EVICTION_POLICIES if name != "priority"),
    ClosedSessionLRUPolicy.name,
)

# The waiting queue's orders, named as SGLang's --schedule-policy and our engine's scheduler
# (minirad/engine/scheduler.py) name them: arrival order, longest cached prefix first.
SCHEDULES: tuple[str, ...] = ("fcfs", "lpm")


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
        peak_used_tokens: most KV slots held at once (tree + running requests), in tokens.
        max_running: the queue's cap on running requests, or None (no queue: the trace's
            own timeline).
        schedule: the queue's order, ``"fcfs"`` or ``"lpm"``.
        ran: the order that ran, as a :class:`ChatTrace` over the same requests (its
            ``start`` events are admissions); :func:`~minirad.kvcache.belady.belady` on it is
            the optimum for this run. The trace itself when ``max_running`` is None.
        queue_delay: summed time from arrival to admission over all requests, in the trace's
            time units (decode steps); 0 without a queue.
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
    peak_used_tokens: int
    max_running: int | None
    schedule: str
    ran: ChatTrace = field(repr=False)
    queue_delay: float
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
    def peak_usage(self) -> float:
        """``peak_used_tokens / capacity``: the peak KV cache usage, between 0 and 1."""
        return self.peak_used_tokens / self.capacity

    @property
    def tokens_per_s(self) -> float:
        """Prompt tokens through the cache per second of cache-op time."""
        return self.prompt_tokens / self.cache_seconds if self.cache_seconds else float("inf")

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.cache_seconds if self.cache_seconds else float("inf")

    @property
    def mean_queue_delay(self) -> float:
        """``queue_delay / requests``: the mean wait for admission, in decode steps."""
        return self.queue_delay / self.requests if self.requests else 0.0

    @property
    def makespan(self) -> float:
        """Time of the last finish, in decode steps (the trace's own without a queue)."""
        return self.ran.events[-1].time if self.ran.events else 0.0


def _ceil_to(n: int, page_size: int) -> int:
    return -(-n // page_size) * page_size


class _Lifecycle:
    """A fresh pool and cache, and a request's calls into them (module docstring, steps 1
    and 2), timed; the trace-order replay and the queued one both drive it."""

    def __init__(self, trace: ChatTrace, capacity: int, page_size: int, policy: str | None) -> None:
        self.requests = trace.requests
        self.page_size = page_size
        self.alloc = TokenToKVPoolAllocator(capacity, page_size)
        closing = None
        if policy == ClosedSessionLRUPolicy.name:
            closing = ClosedSessionLRUPolicy()
        self.closing = closing
        self.cache = (
            None if policy is None else RadixCache(page_size, closing or policy, self.alloc)
        )
        self.last_turn: dict[int, int] = {}
        for r in trace.requests:
            self.last_turn[r.conversation] = max(r.turn, self.last_turn.get(r.conversation, 0))
        self.own_start: dict[int, int] = {}  # open conversation -> tokens turn 0 found cached
        self.running: dict[int, Req] = {}
        self.spent = 0.0
        self.hits = self.evicted = 0

    def cached_prefix_len(self, i: int) -> int:
        """Tokens of request ``i``'s prompt that would hit now (lpm's priority; SGLang's
        ``calc_priority`` calls ``match_prefix`` too, which also refreshes their recency)."""
        if self.cache is None:
            return 0
        t0 = time.perf_counter()
        n = len(self.cache.match_prefix(self.requests[i].prompt[:-1]).indices)
        self.spent += time.perf_counter() - t0
        return n

    def start(self, i: int) -> None:
        r = self.requests[i]
        cache, alloc = self.cache, self.alloc
        req = Req(r.rid, r.prompt)
        # KV for the prompt and every decoded token except the last sampled one.
        num_kv = len(r.prompt) + len(r.output) - 1
        t0 = time.perf_counter()
        if cache is not None:
            cache.match_prefix_for_req(req)
        need = num_kv - len(req.kv_indices)
        short = _ceil_to(need, self.page_size) - alloc.available_size()
        if short > 0 and cache is not None:
            self.evicted += len(cache.evict(short))
        new = alloc.alloc(need, owner=req.rid)
        req.kv_indices += new
        if self.closing is not None:
            self.closing.reopen(new)
            self.own_start.setdefault(r.conversation, len(req.prefix_indices))
        self.spent += time.perf_counter() - t0
        self.hits += len(req.prefix_indices)
        self.running[i] = req

    def finish(self, i: int) -> None:
        r = self.requests[i]
        req = self.running.pop(i)
        req.output_ids = r.output
        t0 = time.perf_counter()
        if self.closing is not None and r.turn == self.last_turn[r.conversation]:
            self.closing.close(req.kv_indices[self.own_start.pop(r.conversation) :])
        if self.cache is not None:
            self.cache.cache_finished_req(req)
        else:
            self.alloc.free(req.kv_indices)
        self.spent += time.perf_counter() - t0


def replay(
    trace: ChatTrace,
    capacity: int,
    page_size: int = 1,
    policy: str | None = "lru",
    label: str | None = None,
    progress: bool = False,
    *,
    max_running: int | None = None,
    schedule: str = "fcfs",
) -> ReplayResult:
    """Replay ``trace`` through a fresh allocator of ``capacity`` tokens and a fresh cache.

    Args:
        trace: the workload.
        capacity: KV pool size in tokens (a multiple of ``page_size``).
        page_size: tokens per KV page.
        policy: eviction policy name (one of :data:`BENCH_POLICIES`), or None to run without
            a cache (allocate every prompt token, free everything when the request finishes).
            With ``"lru-closed"`` the replay tells the policy, as a client closing its session
            would, when a conversation's last turn finishes: the conversation's own slots
            (past the prefix its first turn found cached) are marked closed just before its
            tokens are cached.
        label: row name; defaults to the policy name (or ``"no cache"``).
        progress: show a tqdm bar on stderr.
        max_running: None replays the trace's own timeline (every request starts when it
            arrives). An int puts a server in front of the cache that runs at most this many
            requests at once; the others wait in a queue ("The queue" in the module
            docstring).
        schedule: the waiting queue's order, ``"fcfs"`` or ``"lpm"`` (:data:`SCHEDULES`);
            without a queue (``max_running=None``) nothing waits and both are the same.

    Returns:
        the measurements; ``result.ran`` is the order that ran (the trace itself when
        ``max_running`` is None), ``result.cache`` and ``result.allocator`` the final state
        (every lock released, every slot either free or owned by the tree).

    Raises:
        InvalidArgumentError: ``capacity`` is below :meth:`ChatTrace.peak_running_tokens`
            (without a queue: some request could not be admitted even after evicting
            everything unlocked) or, with a queue, below one request's
            ``prompt + output``; ``max_running`` is not a positive int; unknown ``schedule``.
    """
    if schedule not in SCHEDULES:
        raise InvalidArgumentError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if max_running is not None:
        if not isinstance(max_running, int) or isinstance(max_running, bool) or max_running < 1:
            raise InvalidArgumentError(f"max_running must be a positive int, got {max_running!r}")
    else:
        need_peak = trace.peak_running_tokens(page_size)
        if capacity < need_peak:
            raise InvalidArgumentError(
                f"capacity {capacity} tokens is too small for this trace: its running requests "
                f"hold up to {need_peak} tokens at once"
            )
    label = label or (policy if policy is not None else "no cache")
    ops = _Lifecycle(trace, capacity, page_size, policy)
    bar = tqdm(
        total=len(trace.events),
        desc=f"{label:>10}",
        unit="ev",
        disable=not progress,
        leave=False,
        mininterval=0.5,
    )
    if max_running is None:
        for ev in trace.events:
            if ev.kind == "start":
                ops.start(ev.request)
            else:
                ops.finish(ev.request)
            bar.update()
        ran, waited = trace, 0.0
    else:
        ran, waited = _serve(trace, ops, capacity, page_size, max_running, schedule, bar.update)
    bar.close()
    return ReplayResult(
        label=label,
        policy=policy,
        capacity=capacity,
        requests=len(trace.requests),
        prompt_tokens=trace.prompt_tokens,
        hit_tokens=ops.hits,
        evicted_tokens=ops.evicted,
        cache_seconds=ops.spent,
        peak_used_tokens=ops.alloc.peak_used_size,
        max_running=max_running,
        schedule=schedule,
        ran=ran,
        queue_delay=waited,
        allocator=ops.alloc,
        cache=ops.cache,
    )


def _serve(
    trace: ChatTrace,
    ops: _Lifecycle,
    capacity: int,
    page_size: int,
    max_running: int,
    schedule: str,
    tick: Callable[[], object],
) -> tuple[ChatTrace, float]:
    """The queued server ("The queue" in the module docstring): a discrete-event simulation
    of arrivals and finishes. Returns the order that ran and the summed queueing delay."""
    reqs = trace.requests
    size = [_ceil_to(len(r.prompt) + len(r.output), page_size) for r in reqs]
    too_big = max(size, default=0)
    if too_big > capacity:
        raise InvalidArgumentError(
            f"capacity {capacity} tokens is too small for this trace: one request holds "
            f"{too_big} tokens"
        )
    arrive_at: dict[int, float] = {}
    finish_at: dict[int, float] = {}
    for e in trace.events:
        (arrive_at if e.kind == "start" else finish_at)[e.request] = e.time
    turns: dict[int, list[int]] = {}
    for i in sorted(range(len(reqs)), key=lambda i: reqs[i].turn):
        turns.setdefault(reqs[i].conversation, []).append(i)
    next_turn = {a: b for ts in turns.values() for a, b in zip(ts, ts[1:], strict=False)}

    # (time, seq, request); seq keeps push order at equal times. A request in `started` is a
    # finish, else an arrival. First turns arrive at their trace times.
    heap = [(arrive_at[ts[0]], n, ts[0]) for n, ts in enumerate(turns.values())]
    heapq.heapify(heap)
    seq = len(heap)
    waiting: list[int] = []  # arrival order (fcfs); lpm re-sorts it before admitting
    arrived: dict[int, float] = {}
    started: set[int] = set()
    events: list[TraceEvent] = []
    reserved = 0  # tokens that the running requests may hold: prompt + output each
    waited = 0.0
    while heap:
        now, _, i = heapq.heappop(heap)
        if i in started:
            ops.finish(i)
            reserved -= size[i]
            events.append(TraceEvent(now, "finish", i))
            tick()
            nxt = next_turn.get(i)
            if nxt is not None:  # closed loop: its think time starts when this turn finished
                heapq.heappush(heap, (arrive_at[nxt] + (now - finish_at[i]), seq, nxt))
                seq += 1
        else:
            waiting.append(i)
            arrived[i] = now
        if not waiting or len(ops.running) >= max_running:
            continue
        if schedule == "lpm" and len(waiting) > 1:  # longest cached prefix first; ties by arrival
            cached = {j: ops.cached_prefix_len(j) for j in waiting}
            waiting.sort(key=lambda j: (-cached[j], arrived[j], j))
        while waiting and len(ops.running) < max_running:
            j = waiting[0]
            if reserved + size[j] > capacity:
                break  # head of line waits for memory, as the engine's scheduler does
            waiting.pop(0)
            ops.start(j)
            started.add(j)
            reserved += size[j]
            waited += now - arrived[j]
            events.append(TraceEvent(now, "start", j))
            tick()
            heapq.heappush(heap, (now + len(reqs[j].output), seq, j))
            seq += 1
    return ChatTrace(reqs, events, trace.system_prompts), waited


@dataclass
class RadixBenchmark:
    """One benchmark: the headline run and its baselines, all on one trace.

    Attributes:
        policy: the headline policy (one of ``policies``).
        no_cache: the baseline without a prefix cache.
        policies: one run per eviction policy at the given capacity, by name.
        infinite: a run with a pool big enough never to evict.
        optimal: Belady's MIN at the same capacity on the headline's request order (with no
            queue, the trace's: the same for every run), or None when not computed.
        unique_tokens: :meth:`ChatTrace.unique_tokens` of the trace.
        max_running, schedule: the queue every run went through (:func:`replay`); None and
            ``"fcfs"``: no queue.
        optima: MIN on each policy run's own order (:attr:`ReplayResult.ran`), by policy
            name; empty when not computed.
    """

    trace: ChatTrace
    page_size: int
    policy: str
    no_cache: ReplayResult
    policies: dict[str, ReplayResult]
    infinite: ReplayResult
    optimal: OptimalResult | None
    unique_tokens: int
    max_running: int | None = None
    schedule: str = "fcfs"
    optima: dict[str, OptimalResult] = field(default_factory=dict)

    @property
    def headline(self) -> ReplayResult:
        return self.policies[self.policy]

    @property
    def capacity(self) -> int:
        """Pool size of the policy runs, in tokens."""
        return self.headline.capacity

    def share_of_optimal(self, hit_tokens: int, policy: str | None = None) -> float:
        """``hit_tokens`` over MIN's upper bound (so the true share is at least this), on the
        order that ``policy``'s run ran (None: the headline's, :attr:`optimal`).

        Raises:
            InvalidArgumentError: MIN was not computed.
        """
        opt = self.optima.get(policy, self.optimal) if policy is not None else self.optimal
        if opt is None:
            raise InvalidArgumentError("this benchmark ran without the MIN oracle")
        bound = opt.bound_hit_tokens
        return hit_tokens / bound if bound else 1.0

    @property
    def runs(self) -> list[ReplayResult]:
        return [self.no_cache, *self.policies.values(), self.infinite]


def run_radix_benchmark(
    trace: ChatTrace,
    capacity: int,
    page_size: int = 1,
    policy: str = "lru",
    policies: Iterable[str] = BENCH_POLICIES,
    progress: bool = False,
    optimal: bool = True,
    max_running: int | None = None,
    schedule: str = "fcfs",
) -> RadixBenchmark:
    """Replay ``trace`` without a cache, with every policy in ``policies`` at ``capacity``
    tokens, and with an infinite pool; ``optimal``: also compute Belady's MIN
    (:func:`minirad.kvcache.belady.belady`). ``policy`` (the headline) is always among the runs.
    ``max_running`` and ``schedule``: every run goes through that queue (:func:`replay`), and
    each policy's MIN is computed on the order its run ran (one MIN per policy).

    Raises:
        InvalidArgumentError: unknown policy, or ``capacity`` too small, ``max_running`` or
            ``schedule`` invalid (see :func:`replay`).
    """
    names = list(dict.fromkeys([policy, *policies]))
    unknown = [p for p in names if p not in BENCH_POLICIES]
    if unknown:
        raise InvalidArgumentError(
            f"unknown eviction policy {unknown}; choose from {list(BENCH_POLICIES)}"
        )
    queue = dict(max_running=max_running, schedule=schedule)
    no_cache = replay(trace, capacity, page_size, None, progress=progress, **queue)
    runs = {p: replay(trace, capacity, page_size, p, progress=progress, **queue) for p in names}
    # Never evicts: room for everything the trace can cache plus what running requests hold.
    big = trace.max_cached_tokens(page_size) + trace.peak_running_tokens(page_size)
    big = _ceil_to(big, page_size)
    infinite = replay(trace, big, page_size, policy, "infinite", progress, **queue)
    optima: dict[str, OptimalResult] = {}
    if optimal and max_running is None:  # one order for every run
        opt = belady(trace, capacity, page_size)
        optima = dict.fromkeys(names, opt)
    elif optimal:  # each run's own order
        optima = {p: belady(r.ran, capacity, page_size) for p, r in runs.items()}
    return RadixBenchmark(
        trace,
        page_size,
        policy,
        no_cache,
        runs,
        infinite,
        optima.get(policy),
        trace.unique_tokens(),
        max_running,
        schedule,
        optima,
    )


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def format_report(bench: RadixBenchmark) -> str:
    """The benchmark as a small text table plus the ratios that matter, one per line.

    ``% of MIN`` is a run's hits over MIN's upper bound at the policy capacity (so at least
    the true share of the optimum), on the order that run ran; ``peak KV`` is the peak pool
    occupancy. With a queue, ``wait`` (mean time from arrival to admission) and ``makespan``
    (last finish) are its cost, in decode steps, next to the trace's own makespan.
    """
    t = bench.trace
    head = bench.headline
    opt = bench.optimal
    queued = bench.max_running is not None
    lines = [
        f"trace: {t.num_conversations} conversations, {len(t.requests)} requests, "
        f"{t.prompt_tokens:,} prompt tokens, {bench.unique_tokens:,} unique tokens, "
        f"{len(t.system_prompts)} system prompts; page_size {bench.page_size}",
        f"capacity: {bench.capacity:,} tokens = {bench.capacity / bench.unique_tokens:.1%} of "
        "the unique tokens (the tokens a never-evicting cache would hold)",
    ]
    if queued:
        lines.append(
            f"queue: at most {bench.max_running} running, schedule {bench.schedule}, closed "
            f"loop; the trace's own makespan is {t.events[-1].time:,.0f} steps"
        )
    lines += [
        "",
        f"{'run':<12} {'capacity':>11} {'hit rate':>9} {'% of MIN':>8} {'prefill tok':>12} "
        f"{'saved':>6} {'evicted tok':>12} {'peak KV tok':>12} {'(%)':>6} {'tokens/s':>9} "
        f"{'req/s':>8}" + (f" {'wait':>7} {'makespan':>9}" if queued else ""),
    ]

    def row(name, capacity, hits, evicted, peak, share, tokens_s, req_s, run=None) -> str:
        prefill = t.prompt_tokens - hits
        saved = t.prompt_tokens / prefill if prefill else float("inf")
        cost = ""
        if queued:
            cost = (
                f" {run.mean_queue_delay:>7.1f} {run.makespan:>9,.0f}"
                if run
                else f" {'-':>7} {'-':>9}"
            )
        return (
            f"{name:<12} {capacity:>11,} {hits / t.prompt_tokens:>9.1%} {share:>8} "
            f"{prefill:>12,} {saved:>5.2f}x {evicted:>12,} {peak:>12,} "
            f"{peak / capacity:>6.1%} {tokens_s:>9} {req_s:>8}" + cost
        )

    for r in bench.runs:
        share = "-"
        if opt is not None and r is not bench.infinite:  # MIN is at the policy capacity
            share = f"{bench.share_of_optimal(r.hit_tokens, r.policy):.1%}"
        lines.append(
            row(
                r.label + (" *" if r is head else ""),
                r.capacity,
                r.hit_tokens,
                r.evicted_tokens,
                r.peak_used_tokens,
                share,
                _si(r.tokens_per_s),
                _si(r.requests_per_s),
                r,
            )
        )
        # With a queue each run has its own order and MIN: they are listed below instead.
        if opt is not None and not queued and r is list(bench.policies.values())[-1]:
            lines.append(
                row(
                    "min",
                    opt.capacity,
                    opt.hit_tokens,
                    opt.evicted_tokens,
                    opt.peak_used_tokens,
                    f"{bench.share_of_optimal(opt.hit_tokens):.1%}",
                    "offline",
                    "-",
                )
            )
    inf = bench.infinite
    lines += [
        "",
        f"prefill tokens saved vs no cache: {t.prompt_tokens / head.prefill_tokens:.2f}x "
        f"({head.label} at {head.capacity:,} tokens); "
        f"{t.prompt_tokens / inf.prefill_tokens:.2f}x with infinite capacity",
    ]
    orders = [(f"the order {p} ran", o) for p, o in bench.optima.items()]
    if not queued:
        orders = [("same request order", opt)] if opt is not None else []
    for order, o in orders:
        proof = (
            "a proven bound"
            if o.resupplied_tokens == 0
            else f"not proven: {o.resupplied_tokens:,} tokens re-supplied for free"
        )
        lines.append(
            f"MIN (Belady, {order}, {o.capacity:,} tokens): schedule "
            f"{o.hit_rate:.2%}, upper bound {o.bound_hit_rate:.2%} ({proof})"
        )
    for r in bench.policies.values():
        share = r.hit_rate / inf.hit_rate if inf.hit_rate else 0.0
        of_min = ""
        if opt is not None:
            of_min = f"; {bench.share_of_optimal(r.hit_tokens, r.policy):.1%} of MIN"
        lines.append(
            f"{r.label} hit rate vs infinite-cache bound: {r.hit_rate:.1%} / {inf.hit_rate:.1%}"
            f" = {share:.3f}{of_min}"
        )
    lines += [
        f"cache-op throughput ({head.label}): {head.tokens_per_s:,.0f} prompt tokens/s, "
        f"{head.requests_per_s:,.0f} requests/s",
        f"  ({head.cache_seconds:.2f} s of match + lock + evict + alloc + insert + unlock + free)",
        "(* = --policy; tokens/s = prompt tokens per second of cache-op time; "
        "'no cache' times the allocator alone; min = Belady's offline schedule; "
        "peak KV = most slots in use at once)",
    ]
    if queued:
        lines.append(
            "(wait = mean steps from arrival to admission; makespan = last finish, in steps; "
            "% of MIN is against MIN on the order each run ran)"
        )
    return "\n".join(lines)


def add_trace_arguments(
    parser: argparse.ArgumentParser,
    capacity: int | None,
    capacity_frac: float | None,
    pool: str = "KV pool",
) -> None:
    """The chat trace's options and the pool's size, shared by the benchmarks that replay it
    (``radix``, ``hicache``): ``--capacity`` tokens or ``--capacity-frac`` of the unique ones."""
    parser.add_argument(
        "--conversations", type=positive_int, default=2000, help="number of conversations"
    )
    parser.add_argument("--turns", type=positive_int, default=4, help="mean turns per conversation")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace")
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--capacity", type=positive_int, default=capacity, help=f"{pool} size in tokens"
    )
    size.add_argument(
        "--capacity-frac",
        type=_fraction,
        default=capacity_frac,
        help=f"{pool} size as a fraction of the trace's unique tokens (instead of --capacity), "
        "rounded down to whole pages and raised to what the running requests need",
    )
    parser.add_argument("--page-size", type=positive_int, default=1, help="tokens per KV page")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``radix`` subcommand's options."""
    add_trace_arguments(parser, capacity=262144, capacity_frac=None)
    parser.add_argument(
        "--policy",
        default="lru",
        choices=sorted(BENCH_POLICIES),
        help="headline eviction policy; every policy is run for comparison",
    )
    parser.add_argument(
        "--max-running",
        type=positive_int,
        default=None,
        help="run at most N requests at once; the others wait in a queue (None: no queue, "
        "every request starts when it arrives)",
    )
    parser.add_argument(
        "--schedule",
        default="fcfs",
        choices=SCHEDULES,
        help="waiting queue order with --max-running: fcfs (arrival) or lpm (longest cached "
        "prefix first)",
    )
    parser.add_argument(
        "--no-optimal", action="store_true", help="skip Belady's MIN (the %% of optimal)"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def _fraction(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = -1.0
    if not 0.0 < x <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return x


def capacity_for_fraction(trace: ChatTrace, fraction: float, page_size: int = 1) -> int:
    """``fraction`` of the trace's unique tokens, in tokens: rounded down to whole pages, and
    at least :meth:`ChatTrace.peak_running_tokens` (below that no cache can run the trace).

    Raises:
        InvalidArgumentError: ``fraction`` is not in (0, 1].
    """
    if not 0.0 < fraction <= 1.0:
        raise InvalidArgumentError(f"fraction must be in (0, 1], got {fraction!r}")
    cap = int(fraction * trace.unique_tokens())
    return max(cap - cap % page_size, trace.peak_running_tokens(page_size))


def run_cli(args: argparse.Namespace) -> int:
    """Run ``python -m minirad.bench radix``: print the report, return the exit code."""
    if args.schedule != "fcfs" and args.max_running is None:
        raise InvalidArgumentError(f"--schedule {args.schedule} orders a queue: give --max-running")
    trace = make_chat_trace(args.conversations, args.turns, args.seed)
    capacity = args.capacity
    if args.capacity_frac is not None:
        capacity = capacity_for_fraction(trace, args.capacity_frac, args.page_size)
    bench = run_radix_benchmark(
        trace,
        capacity,
        args.page_size,
        args.policy,
        progress=not args.no_progress,
        optimal=not args.no_optimal,
        max_running=args.max_running,
        schedule=args.schedule,
    )
    print(format_report(bench))
    # The benchmark has counted the unique tokens already (a sort of every sequence).
    if args.capacity_frac is not None and capacity > args.capacity_frac * bench.unique_tokens:
        print(
            f"note: --capacity-frac {args.capacity_frac} was raised to {capacity:,} tokens, "
            "what the running requests of this trace hold at once"
        )
    return 0
