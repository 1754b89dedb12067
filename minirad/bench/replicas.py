"""Replicas behind the real routers, measured (``python -m minirad.bench replicas``).

N workers (``minirad serve``, the real vLLM, or a mix), each pinned to a core, behind the real
``sglang-router`` or ``vllm-router`` (:mod:`minirad.replicas`); closed-loop clients send one
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
import json
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..argtypes import positive_int
from ..errors import InvalidArgumentError, PeerError
from ..replicas import (
    POLICIES,
    MiniradWorker,
    Router,
    WorkerCounters,
    router_executable,
    worker_counters,
)
from ..routing import POLICIES as SIMULATED
from ..server_process import ServerProcess, usable_cpus
from .routing import KV_CREDIT, simulate
from .trace import ChatTrace, TraceRequest

__all__ = [
    "RouteRun",
    "add_arguments",
    "fastest_runs",
    "format_table",
    "load_runs",
    "make_prompts",
    "prompts_trace",
    "run_cli",
    "run_route",
    "save_runs",
]

WORKER_KINDS = ("minirad", "vllm")
DEFAULT_ROUTES = ("sglang:round_robin", "sglang:cache_aware", "vllm:cache_aware", "vllm:kv_aware")
ROUTES = tuple(f"{router}:{policy}" for router, policies in POLICIES.items() for policy in policies)


def make_prompts(
    tokenizer,
    num_requests: int = 40,
    num_system_prompts: int = 4,
    system_tokens: int = 224,
    user_tokens: int = 24,
    seed: int = 0,
) -> list[str]:
    """``num_requests`` text prompts: a shared system prompt of about ``system_tokens``
    tokens (words of the course's scenes, so the tokenizer knows them), then a user tail of
    about ``user_tokens``. Deterministic for a seed.

    Raises:
        InvalidArgumentError: a count is not positive.
    """
    from ..scenes import caption, random_scene  # Pillow; only this workload needs it

    for name, v in dict(
        num_requests=num_requests,
        num_system_prompts=num_system_prompts,
        system_tokens=system_tokens,
        user_tokens=user_tokens,
    ).items():
        if not isinstance(v, int) or v <= 0:
            raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
    rng = random.Random(seed)

    def text(n_tokens: int) -> str:
        words: list[str] = []
        while len(tokenizer(" ".join(words))["input_ids"]) < n_tokens:
            words += f"{caption(random_scene(rng))}.".split()
        while len(tokenizer(" ".join(words[:-1]))["input_ids"]) >= n_tokens:
            words.pop()
        return " ".join(words)

    systems = [f"Notes {k}: {text(system_tokens)}" for k in range(num_system_prompts)]
    return [f"{rng.choice(systems)}\nQ: {text(user_tokens)}\nA:" for _ in range(num_requests)]


def prompts_trace(tokenizer, texts: Sequence[str], max_tokens: int = 4) -> ChatTrace:
    """The simulator's trace of ``texts`` (:func:`minirad.bench.routing.simulate`): their
    token ids, ``max_tokens`` new tokens each, as :func:`run_route` sends them."""
    requests = [
        TraceRequest(f"r{i}", i, 0, tokenizer(t)["input_ids"], [0] * max_tokens)
        for i, t in enumerate(texts)
    ]
    return ChatTrace(requests, [], [])


@dataclass(frozen=True)
class RouteRun:
    """One workload through one router policy at one client concurrency.

    Attributes:
        router, policy, concurrency: what ran.
        counters: each worker's counters over the run, in worker order.
        seconds: wall time from the first request sent to the last answer.
        simulated: the hit rate :func:`minirad.bench.routing.simulate` predicts for the same
            token ids, policy, worker count and concurrency (None: not simulated).
    """

    router: str
    policy: str
    concurrency: int
    counters: list[WorkerCounters]
    seconds: float
    simulated: float | None = None

    @property
    def hit_rate(self) -> float:
        queries = sum(c.queries for c in self.counters)
        return sum(c.hits for c in self.counters) / queries if queries else 0.0

    @property
    def requests(self) -> list[int]:
        return [round(c.requests) for c in self.counters]

    @property
    def imbalance(self) -> float:
        """max / mean of the requests per worker."""
        counts = self.requests
        return max(counts) * len(counts) / sum(counts) if sum(counts) else 0.0

    @property
    def throughput(self) -> float:
        """Requests per second."""
        return sum(self.requests) / self.seconds


def fastest_runs(runs: Sequence[RouteRun]) -> list[RouteRun]:
    """The fastest run (req/s) of each router, policy and concurrency, in first-run order:
    the best of N rounds on a noisy machine."""
    best: dict[tuple[str, str, int], RouteRun] = {}
    for r in runs:
        key = (r.router, r.policy, r.concurrency)
        if key not in best or r.throughput > best[key].throughput:
            best[key] = r
    return list(best.values())


def save_runs(path: str | Path, kinds: Sequence[str], runs: Sequence[RouteRun]) -> Path:
    """Write ``runs`` of workers ``kinds`` as JSON (what :func:`load_runs` reads): what was
    measured, not the simulator's prediction, which a reader recomputes. Returns the path."""
    rows = [asdict(replace(r, simulated=None)) | {"workers": list(kinds)} for r in runs]
    path = Path(path)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    return path


def load_runs(path: str | Path) -> list[tuple[list[str], RouteRun]]:
    """The runs a ``--save`` wrote: ``(worker kinds, run)`` pairs, in the order they ran.

    Raises:
        InvalidArgumentError: the file is not a saved run list (the message says which run
            and why).
    """
    try:
        rows = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InvalidArgumentError(f"{path} is not a run list of --save: {e}") from e
    if not isinstance(rows, list):
        raise InvalidArgumentError(f"{path} is not a run list of --save: not a JSON list")
    return [_run_from_json(row, f"{path}, run {i}") for i, row in enumerate(rows)]


def _run_from_json(row: object, where: str) -> tuple[list[str], RouteRun]:
    def number(v: object) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and v >= 0

    try:
        kinds, counters = row["workers"], [WorkerCounters(**c) for c in row["counters"]]
        run = RouteRun(
            row["router"],
            row["policy"],
            row["concurrency"],
            counters,
            row["seconds"],
            row.get("simulated"),
        )
        problem = None
        if row["router"] not in POLICIES or row["policy"] not in POLICIES[row["router"]]:
            problem = f"no route {row['router']!r}:{row['policy']!r}"
        elif not (isinstance(kinds, list) and all(k in WORKER_KINDS for k in kinds)):
            problem = f"workers must be a list of {WORKER_KINDS}, got {kinds!r}"
        elif len(kinds) != len(counters):
            problem = f"{len(kinds)} workers but {len(counters)} counter sets"
        elif not (isinstance(run.concurrency, int) and run.concurrency > 0):
            problem = f"concurrency must be a positive int, got {run.concurrency!r}"
        elif not (number(run.seconds) and run.seconds > 0):
            problem = f"seconds must be > 0, got {run.seconds!r}"
        elif not all(number(getattr(c, f)) for c in counters for f in c.__dataclass_fields__):
            problem = "every counter must be a number >= 0"
        elif any(c.hits > c.queries for c in counters):
            problem = "a worker has more prefix-cache hits than queries"
    except (KeyError, TypeError, AttributeError) as e:
        problem = f"missing or malformed field: {e!r}"
    if problem is not None:
        raise InvalidArgumentError(f"{where} is not a saved run: {problem}")
    return kinds, run


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
    from ..vllm_server import VLLMServer

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
    from ..tokenizer import load_tokenizer

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
