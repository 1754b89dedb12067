"""Replicas behind the real routers, measured (``python -m minirad.bench replicas``).

N workers (``minirad serve``, the real vLLM, or a mix), each pinned to a core, behind the real
``sglang-router`` or ``vllm-router`` (:mod:`minirad.cluster.replicas`); closed-loop clients send one
workload through the router at each concurrency, and each worker's own ``/metrics`` say what
its cache did. Per route (router and policy) and concurrency it prints:

- **hit**: prompt tokens served from the workers' prefix caches / prompt tokens looked up
  (vLLM's ``prefix_cache_hits`` / ``prefix_cache_queries``, summed over the workers), and each
  worker's own hit rate;
- **requests**: how many requests each worker served, and max / mean of those counts (1.0 is an
  even split; N means one worker got everything);
- **req/s**: requests completed per second of wall time, seen by the clients;
- **sim**: the hit rate the routing simulator (:mod:`minirad.bench.routing`) predicts for the
  same token ids, policy (sglang's and vllm-router's cache_aware are one policy there) and
  concurrency, the check before trusting it for 64 replicas.

Before each run every worker's cache is emptied (``POST /reset_prefix_cache``) and a fresh
router is started (its own tree starts empty too). With ``--repeats N`` every route and
concurrency runs N times, the rounds alternated (the machine is shared and noisy), and the
final table keeps each one's fastest run; ``--save FILE`` writes every run as JSON (what
chapter 10's table reads).

The workload is the one first measured with vLLM workers, in text: 40 one-turn requests,
each a random one of 4 system prompts of about 224 tokens (7 blocks of 32) and a user tail of
about 24 tokens, 4 new tokens each (``ignore_eos``, greedy). The best any router can do is one
miss per system prompt. sglang-router gets text prompts (it refuses token ids); vllm-router
gets the same prompts as token ids (its kv_aware policy takes nothing else).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from minirad.bench.common import (
    WORKER_KINDS,
    RouteRun,
    fastest_runs,
    make_prompts,
    prompts_trace,
    save_runs,
)
from minirad.bench.routing import KV_CREDIT, simulate
from minirad.cluster.replicas import (
    POLICIES,
    MiniradWorker,
    Router,
    router_executable,
    worker_counters,
)
from minirad.cluster.routing import POLICIES as SIMULATED
from minirad.entrypoints.argtypes import positive_int
from minirad.errors import PeerError
from minirad.peers.server_process import ServerProcess, usable_cpus

__all__ = [
    "add_arguments",
    "format_table",
    "run_cli",
    "run_route",
]

DEFAULT_ROUTES = ("sglang:round_robin", "sglang:cache_aware", "vllm:cache_aware", "vllm:kv_aware")
ROUTES = tuple(f"{router}:{policy}" for router, policies in POLICIES.items() for policy in policies)


def _reset(worker: ServerProcess, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not worker.reset_prefix_cache():  # refused while requests are in flight
        if time.monotonic() > deadline:
            raise PeerError(f"{worker.name} at {worker.base_url} would not empty its cache")
        time.sleep(0.2)


def run_route(
    workers: Sequence[ServerProcess],
    route: str,
    prompts: Sequence[str | list[int]],
    concurrency: int,
    max_tokens: int = 4,
) -> RouteRun:
    """Empty the workers' caches, start ``route`` (``"sglang:cache_aware"``) in front of them,
    send ``prompts`` in order from ``concurrency`` closed-loop clients, stop the router.

    Raises:
        InvalidArgumentError: a malformed route.
        PeerError: a worker or the router failed, or a request got an error answer.
    """
    router, _, policy = route.partition(":")
    for w in workers:
        _reset(w)
    before = [worker_counters(w) for w in workers]
    model = workers[0].model_name
    with Router(router, workers, policy) as front:
        pending = iter(range(len(prompts)))
        lock = threading.Lock()

        def client() -> None:
            while True:
                with lock:
                    i = next(pending, None)
                if i is None:
                    return
                body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens}
                front.post("/v1/completions", body | {"temperature": 0, "ignore_eos": True})

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            for f in [pool.submit(client) for _ in range(concurrency)]:
                f.result()
        seconds = time.perf_counter() - t0
    counters = [worker_counters(w) - b for w, b in zip(workers, before, strict=True)]
    return RouteRun(router, policy, concurrency, counters, seconds)


def _route(value: str) -> str:
    if value not in ROUTES:
        raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(ROUTES)}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m minirad.bench replicas``."""
    parser.add_argument(
        "--workers",
        nargs="+",
        choices=WORKER_KINDS,
        default=["minirad", "minirad"],
        help="one worker per word: minirad serve, or the real vLLM (make vllm)",
    )
    parser.add_argument(
        "--routes",
        nargs="+",
        type=_route,
        default=list(DEFAULT_ROUTES),
        metavar="ROUTER:POLICY",
        help=f"one of {', '.join(ROUTES)}",
    )
    parser.add_argument(
        "--concurrency", type=positive_int, nargs="+", default=[1, 4, 8], help="clients"
    )
    parser.add_argument("--requests", type=positive_int, default=40, help="per run")
    parser.add_argument(
        "--system-prompts", type=positive_int, default=4, help="shared prompts of ~224 tokens"
    )
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    parser.add_argument(
        "--no-pin", action="store_true", help="do not pin worker i to the i-th usable core"
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="runs of each route and concurrency, alternated; the table keeps the fastest",
    )
    parser.add_argument("--save", type=Path, metavar="FILE", help="write every run as JSON")


def _start_workers(kinds: Sequence[str], pin: bool, kv_events: bool) -> list[ServerProcess]:
    from minirad.peers.vllm_server import VLLMServer

    cores = usable_cpus()
    workers: list[ServerProcess] = []
    try:
        for i, kind in enumerate(kinds):
            cpus = [cores[i % len(cores)]] if pin else None
            if kind == "vllm":
                w: ServerProcess = VLLMServer(kv_events=kv_events, cpus=cpus)
            else:
                w = MiniradWorker(cpus=cpus, kv_events=kv_events)
            workers.append(w.start())
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers


def format_table(runs: Sequence[RouteRun], kinds: Sequence[str]) -> str:
    """The runs as a text table, one row per run."""
    lines = [
        f"workers: {', '.join(kinds)}",
        f"{'router':<8}{'policy':<13}{'conc':>5}{'hit':>7}{'sim':>7}  {'worker hits':<16}"
        f"{'requests':<12}{'max/mean':>9}{'req/s':>8}",
    ]
    for r in runs:
        hits = " ".join(f"{c.hit_rate:.2f}" if c.queries else "-" for c in r.counters)
        sim = "-" if r.simulated is None else f"{r.simulated:.3f}"
        lines.append(
            f"{r.router:<8}{r.policy:<13}{r.concurrency:>5}{r.hit_rate:>7.3f}{sim:>7}  "
            f"{hits:<16}{'/'.join(map(str, r.requests)):<12}{r.imbalance:>9.2f}"
            f"{r.throughput:>8.1f}"
        )
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """Run ``python -m minirad.bench replicas``: print the table, return the exit code."""
    from minirad.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    texts = make_prompts(tokenizer, args.requests, args.system_prompts, seed=args.seed)
    trace = prompts_trace(tokenizer, texts)
    ids = [r.prompt for r in trace.requests]
    lengths = sorted(len(i) for i in ids)
    print(
        f"{len(texts)} requests over {args.system_prompts} system prompts, prompts of "
        f"{lengths[0]}-{lengths[-1]} tokens, 4 new tokens each"
    )
    for router in {r.partition(":")[0] for r in args.routes}:
        router_executable(router)  # missing: say so before the workers load
    kv_events = any(r.endswith(":kv_aware") for r in args.routes)
    credit = [KV_CREDIT[kind] for kind in args.workers]  # kv_aware's, by the workers' events
    workers = _start_workers(args.workers, not args.no_pin, kv_events)
    print(format_table([], args.workers), flush=True)
    runs: dict[tuple[str, int], list[RouteRun]] = {}
    try:
        for round_ in range(args.repeats):
            for route in args.routes:
                prompts = texts if route.startswith("sglang:") else ids
                policy = route.partition(":")[2]
                for c in args.concurrency:
                    run = run_route(workers, route, prompts, c)
                    # The clients start one after another here, as ramp 1 does (the
                    # calibration's check).
                    if policy in SIMULATED:
                        sim = simulate(
                            trace, policy, len(workers), 1 << 16, 32, c, kv_credit=credit, ramp=1.0
                        )
                        run = replace(run, simulated=sim.hit_rate)
                    runs.setdefault((route, c), []).append(run)
                    row = format_table([run], args.workers).splitlines()[-1]
                    tag = f"  (round {round_ + 1}/{args.repeats})" if args.repeats > 1 else ""
                    print(row + tag, flush=True)
    finally:
        for w in workers:
            w.stop()
    if args.repeats > 1:
        print(f"\nthe fastest of {args.repeats} runs each:")
        print(format_table(fastest_runs([r for rs in runs.values() for r in rs]), args.workers))
    print("\nworker hits: each worker's own hit rate (-: it got no request); requests: per worker")
    if args.save is not None:
        saved = [r for rs in runs.values() for r in rs]
        save_runs(args.save, args.workers, saved)
        print(f"{len(saved)} runs saved in {args.save}")
    return 0
