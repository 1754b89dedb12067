"""Routing benchmark: ``N`` replicas, each a real :class:`RadixCache` with its own pool,
behind a router policy (:mod:`minirad.cluster.routing`), on the chat trace of :mod:`.trace`.

Each replica drives its cache as :mod:`.radix` does (``_Lifecycle``: match and lock at
start, evict when the pool is short, insert at finish). Clients: ``concurrency`` requests in
flight; requests go out in the trace's arrival order, the next one as soon as one finishes
(closed loop). A request is counted in its replica's load (what the router's policies read)
from dispatch to finish.

Each replica is an engine loop of forward passes, back to back while it has work, as vLLM's
and ours run: a pass admits every request that arrived before it began (their prefix is
matched then), prefills their uncached tokens, and samples one token for each running request;
it lasts ``1 + prefilled tokens / prefill_chunk`` decode steps, so a replica that misses is
slower for everyone on it. The prompt's full pages are cached when its prefill pass ends
(``cache_after_prefill``), as vLLM caches a block once computed. A request that arrives while
a pass runs waits for it to end: one sent during another's prefill of the same system prompt
hits it, one admitted with it in the same pass misses it too. A conversation's next turn can
go out before its previous turn finished when ``concurrency > 1``; it then misses that turn's
output, as a client that does not wait would.

Hit rate: cached prompt tokens / prompt tokens (vLLM's ``prefix_cache_hits_total /
prefix_cache_queries_total``). Load imbalance: max / mean over replicas of requests (and of
prompt tokens); 1.0 is perfectly even.

Calibration (``--calibrate``): the two-replica workload measured behind the real routers
(``python -m minirad.bench replicas``), simulated beside the measured hit rates; how close
they come, and why the clients' stagger matters: docs/replicas.md, "The simulator".
"""

from __future__ import annotations

import argparse
import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from minirad.bench.common import load_runs
from minirad.bench.radix import _Lifecycle
from minirad.bench.trace import ChatTrace, make_chat_trace
from minirad.cluster.routing import (
    POLICIES,
    CacheAwarePolicy,
    KVAwarePolicy,
    PowerOfTwoPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    RoutingPolicy,
)
from minirad.entrypoints.argtypes import non_negative_float, positive_int
from minirad.errors import InvalidArgumentError
from minirad.peers.vllm_env import REPO_ROOT

__all__ = [
    "KV_CREDIT",
    "MEASURED_RUNS",
    "RoutingResult",
    "add_arguments",
    "calibration_trace",
    "measured_hit_rates",
    "run_cli",
    "simulate",
    "skewed",
]

# The runs measured with real workers behind the real routers, saved by
# ``python -m minirad.bench replicas --repeats 3 --save`` (docs/replicas.md, chapter 10).
MEASURED_RUNS = {
    kind: REPO_ROOT / "data" / "recordings" / f"replicas_{kind}.json"
    for kind in ("minirad", "vllm")
}


def measured_hit_rates() -> dict[tuple[str, str, int], float]:
    """``{(workers, policy, concurrency): hit rate}`` of the committed runs
    (:data:`MEASURED_RUNS`), the mean over their rounds; ``cache_aware`` is sglang-router's.

    Raises:
        InvalidArgumentError: a file is missing or not a saved run list.
    """

    rates: dict[tuple[str, str, int], list[float]] = {}
    for kind, path in MEASURED_RUNS.items():
        for _, run in load_runs(path):
            if run.router == "vllm" and run.policy == "cache_aware":
                continue
            rates.setdefault((kind, run.policy, run.concurrency), []).append(run.hit_rate)
    return {k: sum(v) / len(v) for k, v in rates.items()}


# vllm-router's credit per cached token, by the memory a worker's KV events name: vLLM's block
# pool says "GPU" (full credit), our workers say "CPU" (kv_penalty_host).
KV_CREDIT = {"vllm": 1.0, "minirad": 0.8}


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
    name: str, caches: list[_Lifecycle], seed: int, kv_credit: float | Sequence[float]
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

    return KVAwarePolicy(n, cached_tokens, caches[0].page_size, kv_credit)


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
    kv_credit: float | Sequence[float] = 1.0,
    ramp: float = 0.0,
    seed: int = 0,
) -> RoutingResult:
    """Route every request of ``trace`` to one of ``replicas`` caches and replay it there.

    Args:
        trace: the requests, dispatched in arrival order (its timeline is not used).
        policy: one of :data:`minirad.cluster.routing.POLICIES`.
        replicas: number of replicas, each with a pool of ``capacity`` tokens.
        capacity: KV pool per replica, in tokens (a multiple of ``page_size``).
        page_size: tokens per page (vLLM's block size).
        concurrency: client requests in flight.
        prefill_chunk: uncached prompt tokens that cost one decode step of a pass's time.
        cache_after_prefill: insert the prompt's full pages into the tree as soon as it is
            prefilled, as vLLM caches a block once computed (SGLang's
            ``cache_unfinished_req``); False: only when the request finishes.
        kv_credit: ``kv_aware``'s credit per cached token, for all replicas or per replica
            (:data:`KV_CREDIT`: 1.0 for vLLM workers, 0.8 for ours).
        ramp: client ``j`` sends its first request at ``j * ramp`` decode steps; 0: all
            clients start together, a burst that shares one pass, whose same-prefix
            requests all miss.
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
    if ramp < 0:
        raise InvalidArgumentError(f"ramp must be >= 0, got {ramp!r}")
    needs = sorted(
        -(-(len(r.prompt) + len(r.output)) // page_size) * page_size for r in trace.requests
    )
    need = sum(needs[-concurrency:])
    if capacity < need:
        raise InvalidArgumentError(
            f"capacity {capacity} tokens per replica is too small: {concurrency} running "
            f"requests of this trace may hold {need} tokens on one replica"
        )
    reps = [_Replica(_Lifecycle(trace, capacity, page_size, "lru")) for _ in range(replicas)]
    router = _make_policy(policy, [rep.ops for rep in reps], seed, kv_credit)
    loads, routes = [0] * replicas, []
    requests, prompt, hits = [0] * replicas, [0] * replicas, [0] * replicas
    # (time, rank, replica or client, kind): at equal times a pass ends before a client sends,
    # and a pass starts last, so it takes every request that arrived at that instant.
    events = [(j * ramp, _RANK["ready"], j, "ready") for j in range(concurrency)]
    now, nxt = 0.0, 0

    def send() -> None:  # a client sends the next request of the trace
        nonlocal nxt
        if nxt == len(trace.requests):
            return
        r = trace.requests[nxt]
        k = router.select(r.prompt, loads, now)
        routes.append(k)
        loads[k] += 1
        requests[k] += 1
        prompt[k] += len(r.prompt)
        reps[k].waiting.append(nxt)
        nxt += 1
        if not reps[k].busy:
            reps[k].busy = True
            heapq.heappush(events, (now, _RANK["start"], k, "start"))

    def start_pass(k: int) -> None:  # admit what waits, prefill it, decode the rest
        rep, new_tokens = reps[k], 0
        rep.prefilling, rep.waiting = rep.waiting, []
        for i in rep.prefilling:
            before = rep.ops.hits
            rep.ops.start(i)
            hit = rep.ops.hits - before
            hits[k] += hit
            new_tokens += len(trace.requests[i].prompt) - hit
            rep.left[i] = max(1, len(trace.requests[i].output))
        heapq.heappush(events, (now + 1 + new_tokens / prefill_chunk, _RANK["end"], k, "end"))

    while events:
        now, _, k, kind = heapq.heappop(events)
        if kind == "ready":
            send()
        elif kind == "start":
            start_pass(k)
        else:
            rep = reps[k]
            if cache_after_prefill:
                for i in rep.prefilling:
                    _cache_prompt(rep.ops, i)
            done = []
            for i in list(rep.left):  # every running request sampled one token
                rep.left[i] -= 1
                if rep.left[i] == 0:
                    del rep.left[i]
                    done.append(i)
            for i in done:
                rep.ops.finish(i)
                router.finish(k, trace.requests[i].prompt)
                loads[k] -= 1
            # The engine loop goes on at once: a request its clients send now waits a pass.
            if rep.left or rep.waiting:
                start_pass(k)
            else:
                rep.busy = False
            for _ in done:
                send()
    return RoutingResult(policy, replicas, concurrency, requests, prompt, hits, now, routes)


_RANK = {"end": 0, "ready": 1, "start": 2}  # the order of simultaneous events


@dataclass
class _Replica:
    """One simulated engine: its cache, the requests sent to it and not yet admitted, the
    running ones with their output tokens left to sample, and those the current pass
    prefills."""

    ops: _Lifecycle
    waiting: list[int] = field(default_factory=list)
    left: dict[int, int] = field(default_factory=dict)
    prefilling: list[int] = field(default_factory=list)
    busy: bool = False  # a forward pass runs or is about to start


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
    parser.add_argument(
        "--replicas", type=positive_int, nargs="+", default=[2, 8, 64], help="replica counts"
    )
    parser.add_argument(
        "--skew",
        type=non_negative_float,
        nargs="+",
        default=[0.0, 1.5],
        help="Zipf skew of the system prompts' traffic (0: uniform)",
    )
    parser.add_argument(
        "--policies", nargs="+", choices=POLICIES, default=list(POLICIES), help="router policies"
    )
    parser.add_argument(
        "--concurrency", type=positive_int, default=16, help="client requests in flight"
    )
    parser.add_argument(
        "--conversations", type=positive_int, default=200, help="chat conversations of the trace"
    )
    parser.add_argument("--turns", type=positive_int, default=3, help="turns per conversation")
    parser.add_argument(
        "--system-prompts", type=positive_int, default=16, help="distinct system prompts"
    )
    parser.add_argument(
        "--capacity", type=positive_int, default=65536, help="KV pool per replica, tokens"
    )
    parser.add_argument("--page-size", type=positive_int, default=32, help="tokens per page")
    parser.add_argument(
        "--ramp",
        type=non_negative_float,
        default=1.0,
        help="decode steps between the clients' starts",
    )
    parser.add_argument("--seed", type=int, default=0, help="the trace's seed")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="only the calibration against the measured two-replica runs (the other options "
        "do not apply to it)",
    )


def _calibration_table() -> str:
    """The simulator on the prompts measured behind the real routers (the same token ids, two
    replicas, clients a step apart), beside the measured hit rates."""
    from minirad.bench.common import make_prompts, prompts_trace
    from minirad.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    trace = prompts_trace(tokenizer, make_prompts(tokenizer))
    measured = measured_hit_rates()
    lines = [
        "Calibration: the two-replica workload measured behind the real routers (40 requests "
        "over 4 system prompts of 7 blocks of 32) on 2 replicas, clients a step apart, against "
        "the runs measured with our workers and with vLLM's (mean of 3 rounds)",
        f"{'policy':<13}{'conc':>5}{'workers':>9}{'sim hit':>9}{'measured':>10}{'points':>8}"
        "  requests/replica",
    ]
    for policy in ("round_robin", "cache_aware", "kv_aware"):
        for conc in (1, 4, 8):
            for workers, credit in KV_CREDIT.items():
                r = simulate(trace, policy, 2, 1 << 16, 32, conc, kv_credit=credit, ramp=1.0)
                real = measured[workers, policy, conc]
                lines.append(
                    f"{policy:<13}{conc:>5}{workers:>9}{r.hit_rate:>9.3f}{real:>10.3f}"
                    f"{(r.hit_rate - real) * 100:>+8.1f}  {r.requests}"
                )
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """Run ``python -m minirad.bench routing``: print the tables, return the exit code."""
    print(_calibration_table())
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
