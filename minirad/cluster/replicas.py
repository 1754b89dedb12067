"""Replicas behind a real router: ``minirad serve`` and vLLM workers, sglang-router, vllm-router.

Chapter 10's setup, as production runs it: N engine replicas, each with its own prefix cache,
and a router in front that picks a replica per request. Every part is the real program:

- :class:`MiniradWorker`: ``minirad serve`` (our engine, OpenAI API, vLLM's metric names,
  optional vLLM KV events) as a subprocess;
- :class:`~minirad.peers.vllm_server.VLLMServer`: the real vLLM (``make vllm``);
- :class:`Router`: ``sglang-router`` 0.3.2 (policies random, round_robin, cache_aware,
  power_of_two, manual) or ``vllm-router`` 0.1.17 (also kv_aware, consistent_hash,
  sticky_least_loaded), from their own venv (``make routers``).

Each server can be pinned to cores (``cpus``), as on a real machine each replica has its own
accelerator: on 2 cores, one worker per core and the router wherever it lands (it does
little). :func:`worker_counters` reads a worker's ``/metrics`` (vLLM's counter names, which
ours share), so hit rates and request counts come from the workers themselves, not from the
client.

How the two routers decide is re-implemented, with the sources it was read from, in
:mod:`minirad.cluster.routing`; docs/replicas.md measures both against it.

Example::

    with MiniradWorker(cpus=[0]) as a, MiniradWorker(cpus=[1]) as b:
        with Router("sglang", [a, b], policy="cache_aware") as router:
            router.post("/v1/completions", {"model": a.model_name, "prompt": "...",
                                            "max_tokens": 4, "temperature": 0})
        worker_counters(a).hit_rate
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from minirad.errors import InvalidArgumentError, PeerError
from minirad.kv_events.block_events import VLLM_BLOCK_SIZE
from minirad.peers.server_process import ServerProcess, free_port
from minirad.peers.vllm_env import REPO_ROOT
from minirad.peers.vllm_server import DEFAULT_MODEL_DIR

__all__ = [
    "POLICIES",
    "ROUTERS",
    "ROUTER_VENV",
    "MiniradWorker",
    "Routed",
    "Router",
    "WorkerCounters",
    "parse_counters",
    "router_executable",
    "send_routed",
    "worker_counters",
]

# ``MINIRAD_ROUTER_VENV`` points elsewhere (a venv shared between clones, say).
ROUTER_VENV = Path(os.environ.get("MINIRAD_ROUTER_VENV", REPO_ROOT / ".venv-router"))
ROUTERS = {"sglang": "sglang-router", "vllm": "vllm-router"}
POLICIES = {
    "sglang": ("random", "round_robin", "cache_aware", "power_of_two", "manual"),
    "vllm": (
        "random",
        "round_robin",
        "cache_aware",
        "kv_aware",
        "power_of_two",
        "consistent_hash",
        "sticky_least_loaded",
    ),
}


def router_executable(router: str, venv: str | os.PathLike | None = None) -> Path:
    """The ``sglang-router`` or ``vllm-router`` program of the router venv.

    Raises:
        InvalidArgumentError: ``router`` is not ``"sglang"`` or ``"vllm"``.
        PeerError: the venv is not built (the message says how to build it).
    """
    if router not in ROUTERS:
        raise InvalidArgumentError(f"router must be one of {sorted(ROUTERS)}, got {router!r}")
    venv = Path(venv) if venv is not None else ROUTER_VENV
    exe = venv / "bin" / ROUTERS[router]
    if not (venv / ".installed").exists() or not exe.exists():
        raise PeerError(
            f"{ROUTERS[router]} is not installed in {venv}: run `make routers` (a venv with "
            "sglang-router 0.3.2 and vllm-router 0.1.17 from PyPI, about 220 MB)"
        )
    return exe


class MiniradWorker(ServerProcess):
    """``minirad serve`` on 127.0.0.1 as a subprocess (this Python, so this venv).

    Args:
        model_dir: the model folder (default: the shipped tiny LLaVA, served under its name).
        port: the HTTP port (default: a free one).
        cpus: pin the worker to these cores; None: no pinning.
        page_size: tokens per KV page. 32 by default, vLLM's CPU block size, so that our
            hit rates count whole blocks as vLLM's do.
        num_kv_slots: the KV pool, in tokens.
        kv_events: publish vLLM KV events: a PUB socket and a replay ROUTER, both bound on
            127.0.0.1 (the events carry every prompt's token ids: they stay on this machine).
        extra_args: more ``minirad serve`` arguments.

    Attributes:
        kv_events_endpoint, replay_endpoint: where a subscriber (or vllm-router's
            ``--kv-event-source``) connects; None without kv_events.
        model_name: the name requests use.
    """

    name = "minirad serve"

    def __init__(
        self,
        model_dir: str | os.PathLike = DEFAULT_MODEL_DIR,
        port: int | None = None,
        cpus: Sequence[int] | None = None,
        page_size: int = VLLM_BLOCK_SIZE,
        num_kv_slots: int = 8192,
        kv_events: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.model_dir = Path(model_dir).resolve()
        if not (self.model_dir / "config.json").is_file():
            raise InvalidArgumentError(f"no model folder (config.json) at {self.model_dir}")
        self.model_name = self.model_dir.name
        super().__init__(port, cpus)
        self.page_size = page_size
        self.num_kv_slots = num_kv_slots
        self.kv_events_endpoint = self.replay_endpoint = None
        if kv_events:
            self.kv_events_endpoint = f"tcp://127.0.0.1:{free_port()}"
            self.replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.extra_args = tuple(extra_args)

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "minirad", "serve", "--model", str(self.model_dir)]
        cmd += ["--served-model-name", self.model_name, "--port", str(self.port)]
        cmd += ["--page-size", str(self.page_size), "--num-kv-slots", str(self.num_kv_slots)]
        if self.kv_events_endpoint is not None:
            cmd += ["--kv-events-endpoint", self.kv_events_endpoint]
            cmd += ["--kv-events-replay-endpoint", self.replay_endpoint]
            cmd += ["--kv-events-block-size", str(VLLM_BLOCK_SIZE)]
        return cmd + list(self.extra_args)

    def env(self) -> dict[str, str]:
        return super().env() | {"PYTHONUNBUFFERED": "1"}  # its log as it happens

    def reset_prefix_cache(self) -> bool:
        """``POST /reset_prefix_cache``; False while requests are in flight."""
        return bool(self.post("/reset_prefix_cache")["success"])


class Router(ServerProcess):
    """The real ``sglang-router`` or ``vllm-router`` in front of ``workers``, on 127.0.0.1.

    Args:
        router: ``"sglang"`` or ``"vllm"``.
        workers: servers with a ``base_url`` (:class:`MiniradWorker`,
            :class:`~minirad.peers.vllm_server.VLLMServer`); for kv_aware, each needs
            ``kv_events_endpoint`` (and uses its ``replay_endpoint`` if set).
        policy: one of :data:`POLICIES` ``[router]``.
        port: the HTTP port (default: a free one); its Prometheus port is another free one.
        cpus: pin the router to these cores; None: no pinning.
        model_dir: the tokenizer folder kv_aware reads (``--kv-event-model``).
        extra_args: more router arguments (``--cache-threshold 0.5``, say).

    Both host flags are given: the routers listen on 0.0.0.0 otherwise. :meth:`start` returns
    once the router reports every worker healthy.

    Raises:
        InvalidArgumentError: an unknown policy, or kv_aware with a worker that publishes no
            KV events.
        PeerError: the router venv is missing.
    """

    start_timeout_s = 60.0  # a router is up in ~2 s; waiting longer is waiting for a worker

    def __init__(
        self,
        router: str,
        workers: Sequence[ServerProcess],
        policy: str = "round_robin",
        port: int | None = None,
        cpus: Sequence[int] | None = None,
        model_dir: str | os.PathLike = DEFAULT_MODEL_DIR,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.executable = router_executable(router)
        if policy not in POLICIES[router]:
            raise InvalidArgumentError(
                f"{ROUTERS[router]} has no policy {policy!r}; it has {', '.join(POLICIES[router])}"
            )
        if not workers:
            raise InvalidArgumentError("a router needs at least one worker")
        urls = [w.base_url for w in workers]
        if len(set(urls)) < len(urls):
            raise InvalidArgumentError(f"a worker is listed twice: {urls}")
        if policy == "kv_aware":
            silent = [w.base_url for w in workers if getattr(w, "kv_events_endpoint", None) is None]
            if silent:
                raise InvalidArgumentError(f"kv_aware needs KV events from every worker: {silent}")
        super().__init__(port, cpus)
        self.router, self.policy, self.workers = router, policy, list(workers)
        self.name = ROUTERS[router]
        self.model_dir = Path(model_dir).resolve()
        self.prometheus_port = free_port()
        self.extra_args = tuple(extra_args)
        self._readiness: dict | None = None

    def command(self) -> list[str]:
        cmd = [str(self.executable)] + (["launch"] if self.router == "sglang" else [])
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--policy", self.policy]
        cmd += ["--worker-urls", *(w.base_url for w in self.workers)]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port)]
        if self.policy == "kv_aware":
            for w in self.workers:
                cmd += ["--kv-event-source", f"{w.base_url}={w.kv_events_endpoint}"]
                if getattr(w, "replay_endpoint", None):
                    cmd += ["--kv-event-replay-source", f"{w.base_url}={w.replay_endpoint}"]
            cmd += ["--kv-event-block-size", str(VLLM_BLOCK_SIZE)]
            cmd += ["--kv-event-model", str(self.model_dir)]
        return cmd + list(self.extra_args)

    def healthy(self) -> bool:
        """Every worker is registered and healthy (``GET /readiness``): a router answers
        ``/health`` before its first health checks of the workers, and 503s until then.
        Only a start-up check: a router keeps reporting a worker healthy for a while after it
        died (until its own health checks fail)."""
        try:
            self._readiness = json.loads(self.get_text("/readiness", timeout_s=2))
        except (PeerError, json.JSONDecodeError):
            self._readiness = None
            return False
        return self._readiness.get("healthy_workers") == len(self.workers)

    def not_ready(self) -> str:
        if self._readiness is None:
            return "did not answer /readiness"
        down = [w.base_url for w in self.workers if not w.healthy()]
        return (
            f"saw {self._readiness.get('healthy_workers')} of {len(self.workers)} workers "
            f"healthy (GET /readiness; not answering /health: {', '.join(down) or 'none'})"
        )

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"Router({self.name}, {self.policy}, {self.base_url}, {state})"


@dataclass(frozen=True)
class WorkerCounters:
    """A worker's cumulative counters, read from its ``/metrics`` (vLLM 0.32's names).

    Attributes:
        queries: prompt tokens looked up in the prefix cache (``vllm:prefix_cache_queries``).
        hits: prompt tokens found there (``vllm:prefix_cache_hits``).
        requests: finished requests, every finish reason (``vllm:request_success``).
        prompt_tokens, generation_tokens: tokens prefilled and generated.
    """

    queries: float
    hits: float
    requests: float
    prompt_tokens: float
    generation_tokens: float

    def __sub__(self, before: WorkerCounters) -> WorkerCounters:
        return WorkerCounters(
            *(getattr(self, f) - getattr(before, f) for f in self.__dataclass_fields__)
        )

    @property
    def hit_rate(self) -> float:
        """hits / queries (0.0 with no queries)."""
        return self.hits / self.queries if self.queries else 0.0


_COUNTERS = {
    "queries": "vllm:prefix_cache_queries_total",
    "hits": "vllm:prefix_cache_hits_total",
    "requests": "vllm:request_success_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
}


def parse_counters(text: str) -> WorkerCounters:
    """:class:`WorkerCounters` from Prometheus text, each summed over its label sets.

    Raises:
        PeerError: a counter is missing (not a vLLM-compatible server).
    """
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    missing = [name for name in _COUNTERS.values() if name not in sums]
    if missing:
        raise PeerError(f"the metrics lack {', '.join(missing)}")
    return WorkerCounters(**{field: sums[name] for field, name in _COUNTERS.items()})


def worker_counters(worker: ServerProcess) -> WorkerCounters:
    """``worker``'s counters now (``GET /metrics``).

    Raises:
        PeerError: no answer, or the metrics lack a counter.
    """
    return parse_counters(worker.get_text("/metrics"))


@dataclass(frozen=True)
class Routed:
    """One request sent through a router, and the worker that served it.

    Attributes:
        worker: the index, in ``router.workers``, of the worker whose request counter moved.
        reply: the response body, as the worker wrote it (the routers pass it on unchanged).
    """

    worker: int
    reply: dict

    @property
    def prompt_tokens(self) -> int:
        return self.reply["usage"]["prompt_tokens"]

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the worker served from its prefix cache
        (``usage.prompt_tokens_details.cached_tokens``)."""
        details = self.reply["usage"].get("prompt_tokens_details") or {}
        return details.get("cached_tokens") or 0


def send_routed(
    router: Router, body: dict, path: str = "/v1/completions", timeout_s: float = 5.0
) -> Routed:
    """POST ``body`` through ``router`` and find which worker served it.

    Neither router says where it sent a request, in the response or its headers; the workers'
    own counters do. Each worker's ``vllm:request_success`` is read before and after (polling
    for up to ``timeout_s`` seconds: a server may count a request just after replying), and
    exactly one must have moved, by one. So the workers must serve nobody else meanwhile: send
    one request at a time.

    Raises:
        PeerError: the request failed, no worker counted it in time, or more than one request
            was counted (another client is using the workers).
    """
    before = [worker_counters(w).requests for w in router.workers]
    reply = router.post(path, body)
    deadline = time.monotonic() + timeout_s
    while True:
        moved = [
            worker_counters(w).requests - b for w, b in zip(router.workers, before, strict=True)
        ]
        served = [i for i, m in enumerate(moved) if m]
        if sum(moved) > 1:
            raise PeerError(
                f"the workers counted {sum(moved):.0f} requests for one ({moved}): another "
                "client is using them, so the router's choice cannot be told"
            )
        if served:
            return Routed(served[0], reply)
        if time.monotonic() > deadline:
            raise PeerError(f"no worker counted the request within {timeout_s} s")
        time.sleep(0.02)
