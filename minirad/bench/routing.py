"""Routing benchmark: ``N`` replicas, each a real :class:`RadixCache` with its own pool,
behind a router policy (:mod:`minirad.routing`), on the chat trace of :mod:`.trace`.

Each replica drives its cache as :mod:`.radix` does (``_Lifecycle``: match and lock at
start, evict when the pool is short, insert at finish). Clients: ``concurrency`` requests in
flight; requests go out in the trace's arrival order, the next one as soon as one finishes
(closed loop). Service time, in decode steps: ``1 / prefill_chunk`` step per uncached prompt
token, then ``len(output)``, so a replica that misses is busy longer; the prompt's full
pages are cached once prefilled (``cache_after_prefill``), as vLLM does. A request
is counted in its replica's load (what the router's policies read) from dispatch to finish.
Every request runs at once on its replica (no queue inside a replica). A conversation's next
turn can go out before its previous turn finished when ``concurrency > 1``; it then misses
that turn's output, as a client that does not wait would.

Hit rate: cached prompt tokens / prompt tokens (vLLM's ``prefix_cache_hits_total /
prefix_cache_queries_total``). Load imbalance: max / mean over replicas of requests (and of
prompt tokens); 1.0 is perfectly even.

Calibration (``--calibrate``): the two-replica workload measured in issue 14 with real
vLLM servers behind sglang-router (40 requests over 4 system prompts of 224 tokens, 7
blocks of 32, short user tails, 4 new tokens). At concurrency 1 the simulation agrees with
the measurements. At concurrency 4 it agrees once the clients start a decode step apart
(``ramp``); started together, the same-prefix requests of the first burst all miss, which
costs 2 to 4 points here (one miss is about 2 points of this 40-request workload).
"""

from __future__ import annotations

import argparse
import heapq
import random
from dataclasses import dataclass, replace

from ..argtypes import positive_int
from ..errors import InvalidArgumentError
from ..routing import (
    POLICIES,
    CacheAwarePolicy,
    KVAwarePolicy,
    PowerOfTwoPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    RoutingPolicy,
)
from .radix import _Lifecycle
from .trace import ChatTrace, make_chat_trace

__all__ = [
    "MEASURED",
    "RoutingResult",
    "add_arguments",
    "calibration_trace",
    "run_cli",
    "simulate",
    "skewed",
]

# Issue 14's measured hit rates, two vLLM CPU replicas behind sglang-router 0.3.2:
# (policy, concurrency) -> hit rate. kv_aware was not measured on this workload.
MEASURED: dict[tuple[str, int], float] = {
    ("round_robin", 1): 0.70,
    ("round_robin", 4): 0.70,
    ("cache_aware", 1): 0.79,
    ("cache_aware", 4): 0.78,
}


@dataclass
class RoutingResult:
    """One simulated run.

    Attributes:
        policy: router policy name.
        replicas: number of replicas.
        concurrency: client requests in flight.
        requests: requests per replica.
        prompt_tokens: prompt tokens per replica.
        hit_tokens: cached prompt tokens per replica (prefill saved), in tokens.
        makespan: time of the last finish, in decode steps.
        routes: the replica chosen for each request, in the trace's order.
    """

    policy: str
    replicas: int
    concurrency: int
    requests: list[int]
    prompt_tokens: list[int]
    hit_tokens: list[int]
    makespan: float
    routes: list[int]

    @property
    def hit_rate(self) -> float:
        total = sum(self.prompt_tokens)
        return sum(self.hit_tokens) / total if total else 0.0

    @property
    def replica_hit_rates(self) -> list[float]:
        return [
            h / p if p else 0.0 for h, p in zip(self.hit_tokens, self.prompt_tokens, strict=True)
        ]

    @property
    def worst_hit_rate(self) -> float:
        """The lowest hit rate of a replica that served requests."""
        rates = zip(self.replica_hit_rates, self.requests, strict=True)
        return min(h for h, n in rates if n)

    @property
    def saved_tokens(self) -> int:
        """Prompt tokens not prefilled thanks to the caches."""
        return sum(self.hit_tokens)

    @property
    def imbalance(self) -> float:
        """max / mean of requests per replica (1.0: even)."""
        return max(self.requests) * self.replicas / sum(self.requests)

    @property
    def token_imbalance(self) -> float:
        """max / mean of prompt tokens per replica."""
        return max(self.prompt_tokens) * self.replicas / sum(self.prompt_tokens)


def _make_policy(
    name: str, caches: list[_Lifecycle], seed: int, speculative_ttl: float
) -> RoutingPolicy:
    n = len(caches)
    if name == "round_robin":
        return RoundRobinPolicy(n)
    if name == "random":
        return RandomPolicy(n, seed)
    if name == "power_of_two":
        return PowerOfTwoPolicy(n, seed)
    if name == "cache_aware":
        return CacheAwarePolicy(n)

    def cached_tokens(i: int, key: list[int]) -> int:
        # Read only: a router's event index does not touch the replica's LRU clock.
        return caches[i].cache.cached_prefix_len(key)

    return KVAwarePolicy(n, cached_tokens, caches[0].page_size, speculative_ttl)


def simulate(
    trace: ChatTrace,
    policy: str,
    replicas: int,
    capacity: int,
    page_size: int = 32,
    concurrency: int = 1,
    *,
    prefill_chunk: int = 512,
    cache_after_prefill: bool = True,
    speculative_ttl: float = 50.0,
    ramp: float = 0.0,
    seed: int = 0,
) -> RoutingResult:
    """Route every request of ``trace`` to one of ``replicas`` caches and replay it there.

    Args:
        trace: the requests, dispatched in arrival order (its timeline is not used).
        policy: one of :data:`minirad.routing.POLICIES`.
        replicas: number of replicas, each with a pool of ``capacity`` tokens.
        capacity: KV pool per replica, in tokens (a multiple of ``page_size``).
        page_size: tokens per page (vLLM's block size).
        concurrency: client requests in flight.
        prefill_chunk: uncached prompt tokens prefilled per decode step (service time).
        cache_after_prefill: insert the prompt's full pages into the tree as soon as it is
            prefilled, as vLLM caches a block once computed (SGLang's
            ``cache_unfinished_req``); False: only when the request finishes.
        speculative_ttl: ``kv_aware``'s speculative entries live this many decode steps
            (vllm-router's 2 s, at an assumed ~40 ms a step); 0 turns them off.
        ramp: client ``j`` sends its first request at ``j * ramp`` decode steps; 0: all
            clients start together, a burst whose same-prefix requests all miss.
        seed: seed of ``random`` and ``power_of_two``.

    Raises:
        InvalidArgumentError: unknown policy, a count not positive, or ``capacity`` below
            what ``concurrency`` running requests may hold on one replica.
    """
    if policy not in POLICIES:
        raise InvalidArgumentError(f"policy must be one of {POLICIES}, got {policy!r}")
    for name, v in dict(replicas=replicas, concurrency=concurrency, page_size=page_size).items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
    if prefill_chunk <= 0:
        raise InvalidArgumentError(f"prefill_chunk must be > 0, got {prefill_chunk!r}")
    if ramp < 0 or speculative_ttl < 0:
        raise InvalidArgumentError(
            f"ramp and speculative_ttl must be >= 0, got {ramp, speculative_ttl}"
        )
    needs = sorted(
        -(-(len(r.prompt) + len(r.output)) // page_size) * page_size for r in trace.requests
    )
    need = sum(needs[-concurrency:])
    if capacity < need:
        raise InvalidArgumentError(
            f"capacity {capacity} tokens per replica is too small: {concurrency} running "
            f"requests of this trace may hold {need} tokens on one replica"
        )
    caches = [_Lifecycle(trace, capacity, page_size, "lru") for _ in range(replicas)]
    router = _make_policy(policy, caches, seed, speculative_ttl)
    loads, routes = [0] * replicas, []
    requests, prompt, hits = [0] * replicas, [0] * replicas, [0] * replicas
    # (time, request, replica, kind); client j is ready to send its first request at j * ramp.
    events = [(j * ramp, -1, -1, "ready") for j in range(concurrency)]
    now, nxt = 0.0, 0
    while events:
        now, i, k, kind = heapq.heappop(events)
        if kind == "prefilled":
            _cache_prompt(caches[k], i)
            continue
        if kind == "finish":
            caches[k].finish(i)
            loads[k] -= 1
        if nxt == len(trace.requests):  # this client has nothing left to send
            continue
        r = trace.requests[nxt]
        k = router.select(r.prompt, loads, now)
        routes.append(k)
        before = caches[k].hits
        caches[k].start(nxt)
        hit = caches[k].hits - before
        loads[k] += 1
        requests[k] += 1
        prompt[k] += len(r.prompt)
        hits[k] += hit
        prefill = (len(r.prompt) - hit) / prefill_chunk
        if cache_after_prefill:
            heapq.heappush(events, (now + prefill, nxt, k, "prefilled"))
        heapq.heappush(events, (now + prefill + len(r.output), nxt, k, "finish"))
        nxt += 1
    return RoutingResult(policy, replicas, concurrency, requests, prompt, hits, now, routes)


def _cache_prompt(ops: _Lifecycle, i: int) -> None:
    """Insert request ``i``'s prompt into its replica's tree once it is prefilled (its
    decode slots stay private until it finishes)."""
    req = ops.running[i]
    n = len(ops.requests[i].prompt)
    rest = req.kv_indices[n:]
    req.kv_indices = req.kv_indices[:n]
    ops.cache.cache_unfinished_req(req)
    req.kv_indices += rest


def calibration_trace(seed: int = 0) -> ChatTrace:
    """Issue 14's measured workload: 40 one-turn requests over 4 system prompts of 224
    tokens (7 blocks of 32), user tails of median 24 tokens, 4 new tokens each."""
    trace = make_chat_trace(
        40,
        turns=1,
        seed=seed,
        num_system_prompts=4,
        system_prompt_len=(224, 224),
        user_median=24,
        answer_median=8,
    )
    return replace(trace, requests=[replace(r, output=r.output[:4]) for r in trace.requests])


def skewed(trace: ChatTrace, skew: float, seed: int = 0) -> ChatTrace:
    """``trace`` with each conversation's system prompt redrawn with Zipf weights
    ``1 / (rank + 1) ** skew`` (0: uniform; larger: a few prompts take most traffic).

    Raises:
        InvalidArgumentError: ``skew < 0``.
    """
    if skew < 0:
        raise InvalidArgumentError(f"skew must be >= 0, got {skew!r}")
    rng = random.Random(seed)
    systems = trace.system_prompts
    weights = [1.0 / (k + 1) ** skew for k in range(len(systems))]
    pick: dict[int, list[int]] = {}
    requests = []
    for r in trace.requests:
        old = next(s for s in systems if r.prompt[: len(s)] == s)
        new = pick.setdefault(r.conversation, rng.choices(systems, weights)[0])
        requests.append(replace(r, prompt=new + r.prompt[len(old) :]))
    return replace(trace, requests=requests)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m minirad.bench routing``."""
    parser.add_argument("--replicas", type=positive_int, nargs="+", default=[2, 8, 64])
    parser.add_argument("--skew", type=float, nargs="+", default=[0.0, 1.5])
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--concurrency", type=positive_int, default=16)
    parser.add_argument("--conversations", type=positive_int, default=200)
    parser.add_argument("--turns", type=positive_int, default=3)
    parser.add_argument("--system-prompts", type=positive_int, default=16)
    parser.add_argument(
        "--capacity", type=positive_int, default=65536, help="KV pool per replica, tokens"
    )
    parser.add_argument("--page-size", type=positive_int, default=32)
    parser.add_argument(
        "--ramp", type=float, default=1.0, help="decode steps between the clients' starts"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--calibrate", action="store_true", help="only the issue-14 two-replica calibration"
    )


def _calibration_table(seeds: range) -> str:
    lines = [
        "Calibration: issue 14's workload on 2 replicas, block 32 "
        f"(mean over {len(seeds)} trace seeds; ramp: steps between the clients' starts)",
        f"{'policy':<13}{'conc':>5}{'ramp':>5}{'sim hit':>9}{'min-max':>11}{'measured':>10}"
        "  requests/replica",
    ]
    for policy in ("round_robin", "cache_aware", "kv_aware"):
        for conc, ramp in ((1, 0.0), (4, 0.0), (4, 1.0)):
            runs = [
                simulate(calibration_trace(s), policy, 2, 1 << 16, 32, conc, ramp=ramp, seed=s)
                for s in seeds
            ]
            rates = [r.hit_rate for r in runs]
            measured = MEASURED.get((policy, conc))
            lines.append(
                f"{policy:<13}{conc:>5}{ramp:>5.0f}{sum(rates) / len(rates):>9.3f}"
                f"{f'{min(rates):.2f}-{max(rates):.2f}':>11}"
                f"{'-' if measured is None else f'{measured:.2f}':>10}  {runs[0].requests}"
            )
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """Run ``python -m minirad.bench routing``: print the tables, return the exit code."""
    print(_calibration_table(range(20)))
    if args.calibrate:
        return 0
    base = make_chat_trace(
        args.conversations, args.turns, args.seed, num_system_prompts=args.system_prompts
    )
    print(
        f"\n{len(base.requests)} requests, {args.system_prompts} system prompts, "
        f"concurrency {args.concurrency} (ramp {args.ramp:g}), {args.capacity:,} tokens per replica"
    )
    print(
        f"{'skew':>5}{'N':>4} {'policy':<13}{'hit':>7}{'saved tok':>11}"
        f"{'req max/mean':>14}{'tok max/mean':>14}{'worst replica hit':>19}"
    )
    for skew in args.skew:
        trace = skewed(base, skew, args.seed)
        for n in args.replicas:
            for policy in args.policies:
                r = simulate(
                    trace,
                    policy,
                    n,
                    args.capacity,
                    args.page_size,
                    args.concurrency,
                    ramp=args.ramp,
                    seed=args.seed,
                )
                print(
                    f"{skew:>5.1f}{n:>4} {policy:<13}{r.hit_rate:>7.3f}{r.saved_tokens:>11,}"
                    f"{r.imbalance:>14.2f}{r.token_imbalance:>14.2f}"
                    f"{r.worst_hit_rate:>19.3f}"
                )
    return 0
