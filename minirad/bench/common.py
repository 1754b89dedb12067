"""What the benchmarks share: the engine benchmark's workloads and results (ours and the real
vLLM's runs are measured into the same :class:`RunResult`), and the replica benchmark's prompts
and saved runs (the routing simulator is calibrated against them)."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from PIL import Image

from minirad.bench.rss import RSSPeak
from minirad.bench.trace import ChatTrace, TraceRequest
from minirad.cluster.replicas import POLICIES, WorkerCounters
from minirad.errors import InvalidArgumentError

__all__ = [
    "WORKER_KINDS",
    "KVMemory",
    "RouteRun",
    "RunResult",
    "Workload",
    "fastest_runs",
    "load_runs",
    "make_prompts",
    "prompts_trace",
    "save_runs",
    "thread_settings",
]


@dataclass
class Workload:
    """Requests as ``(templated prompt, images)`` pairs, with a one-line description."""

    name: str
    description: str
    requests: list[tuple[str, list[Image.Image]]]


@dataclass(frozen=True)
class KVMemory:
    """A run's KV pool and how full it got (see the module docstring).

    Attributes:
        bytes_per_token: K plus V of one token over all layers, in bytes.
        pool_tokens: usable capacity of the configured pool (vLLM: its blocks but the null
            block, times the block size).
        pool_bytes: bytes of the physical KV tensors (vLLM: the null block included).
        block_size: tokens per block (minirad: per page).
        peak_usage: most tokens running requests held after a step (vLLM's KV cache usage);
            None: not measured.
        peak_held: most tokens allocated at once, cached prefixes included; None: not
            measured.
    """

    bytes_per_token: int
    pool_tokens: int
    pool_bytes: int
    block_size: int
    peak_usage: int | None
    peak_held: int | None

    @staticmethod
    def percent(tokens: int | None, pool_tokens: int) -> str:
        """``tokens`` as ``"N (P%)"`` of ``pool_tokens``, or ``"n/a"`` for None."""
        return "n/a" if tokens is None else f"{tokens} ({100 * tokens / pool_tokens:.3g}%)"


@dataclass
class RunResult:
    """One system's run of one workload.

    Attributes:
        outputs: each request's generated ids (through the first stop token).
        seconds: wall time of the whole run.
        ttft: per request, seconds to its first token (see the module docstring).
        ttft_from_start: per request, seconds from the run's start to its first token.
        prefill_tokens: prompt tokens the model computed (HF: padding included).
        encoder_calls: vision-tower runs, one per image encoded (None: not measured).
        cached_tokens: prompt tokens reused from the prefix cache (0 for HF).
        prompt_token_ids: each request's prompt as the model saw it (no padding).
        num_cached_tokens: per request, its prompt tokens reused from the prefix cache.
        kv: the run's KV pool and peaks (None: not measured, e.g. HF).
        rss: resident memory at the run's start and its peak during the run, of the
            processes that run it (:func:`~minirad.bench.rss.peak_rss`; None: not measured).
    """

    name: str
    outputs: list[list[int]]
    seconds: float
    ttft: list[float]
    ttft_from_start: list[float]
    prefill_tokens: int
    encoder_calls: int | None
    cached_tokens: int = 0
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    num_cached_tokens: list[int] = field(default_factory=list)
    kv: KVMemory | None = None
    rss: RSSPeak | None = None

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of all requests (no padding)."""
        return sum(len(p) for p in self.prompt_token_ids)

    @property
    def throughput(self) -> float:
        """Output tokens per second."""
        return self.output_tokens / self.seconds

    @property
    def total_throughput(self) -> float:
        """Prompt and output tokens per second (vLLM's "total token throughput")."""
        return (self.prompt_tokens + self.output_tokens) / self.seconds


def thread_settings() -> str:
    """This process's torch threads, CPU affinity and OpenMP variables (HF and minirad)."""
    omp = os.environ.get("OMP_NUM_THREADS", "unset")
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    return (
        f"torch {torch.get_num_threads()} intra-op / {torch.get_num_interop_threads()} "
        f"inter-op threads, cpus {cpus}, OMP_NUM_THREADS={omp}"
    )


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
    from minirad.course.scenes import caption, random_scene  # Pillow; only this workload needs it

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


WORKER_KINDS = ("minirad", "vllm")
