"""Benchmarks, run as ``python -m minirad.bench <name>``.

- ``radix``: replay a synthetic multi-turn chat trace through the radix cache and compare
  hit rates and throughput with no cache, every eviction policy and an infinite cache
  (:mod:`minirad.bench.radix`, trace in :mod:`minirad.bench.trace`).
- ``engine``: the same VLM requests through Hugging Face ``generate()``, our engine and, with
  ``--peer vllm`` / ``--peer sglang``, the real vLLM and SGLang (throughput, time to first
  token, prefill and cached tokens, encoder calls; answers must match) (:mod:`minirad.bench.engine`,
  :mod:`minirad.bench.peer`, :mod:`minirad.bench.sglang_peer`).
- ``structured``: the JSON task on fresh scenes, free, under a grammar without and with
  jump-forward, HF ``generate()`` with the same grammar and, with ``--peer vllm``, vLLM's
  structured outputs (tok/s, steps, forced tokens, mask cost per row, valid and exact
  answers) (:mod:`minirad.bench.structured`).
- ``routing``: router policies (:mod:`minirad.cluster.routing`) over N replicas, each a radix cache
  with its own pool: hit rate, load imbalance, prefill saved, against N and traffic skew
  (:mod:`minirad.bench.routing`).
- ``replicas``: real workers (``minirad serve``, vLLM) behind the real routers
  (sglang-router, vllm-router): hit rate, requests per worker, throughput, per policy and
  client concurrency (:mod:`minirad.bench.replicas`, :mod:`minirad.cluster.replicas`).
- ``load``: ``minirad serve`` (or any OpenAI-compatible server) under closed-loop load, half
  the requests with a fresh picture: req/s, p50 / p99 latency, and the text-only requests'
  p99 (:mod:`minirad.bench.load`).

- ``decode``: one decode step of the model, ms per step with HF's weights, with prepacked
  weights and with cascade attention over a shared prefix (:mod:`minirad.bench.decode`).
- ``transfer-cost``: when loading KV back from a slower tier beats recomputing it: the measured
  host copy and prefill rate, typical links (PCIe, NVMe, RDMA) and the break-even length
  (:mod:`minirad.bench.transfer_cost`, model in :mod:`minirad.kvcache.transfer_cost`).
- ``sglang-cache``: the real SGLang's cached tokens beside our radix tree's, request by
  request, on a text chat workload with evictions; ``--policies``: its eviction policies
  beside ours and Belady's MIN (:mod:`minirad.bench.sglang_cache`).
- ``hicache``: the chat trace through a device pool alone and with a host tier 1, 2 and 4 times
  its size: hit rate, prefill tokens, device and host (loaded-back) hits, against Belady's MIN
  at the device and at the total capacity; a last row adds a disk tier
  (:mod:`minirad.bench.hicache`).
- ``hicache-engine``: the engine on a multi-turn image chat whose conversations take turns on a
  small device pool: TTFT device-only, with a host tier, and a new engine on a filled disk
  folder; outputs must match (:mod:`minirad.bench.hicache_engine`).
- ``hybrid``: KV bytes per sequence, concurrent sequences in a fixed pool and the bytes-vs-tokens
  curve of a 5 sliding : 1 full model, full attention against vLLM's hybrid block manager,
  measured on :class:`~minirad.kvcache.kv_cache_manager.KVCacheManager`
  (:mod:`minirad.bench.hybrid`).

Each benchmark module provides ``add_arguments(parser)`` and ``run_cli(args) -> exit code``;
:func:`main` registers them as subcommands (``-`` in a name is ``_`` in its module's), importing
only the one it runs (``engine`` pulls in transformers: seconds of start-up that ``radix`` does
not need).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from minirad.errors import MiniradError

__all__ = ["build_parser", "main"]

_COMMANDS = {  # subcommand (= module name, "-" for "_") -> help
    "radix": "radix-cache hit rate, throughput and % of optimal on a multi-turn chat trace",
    "engine": "our engine against HF generate() (and the real vLLM, SGLang: --peer vllm,sglang) "
    "on VLM and text requests",
    "structured": "JSON answers: free vs grammar vs jump-forward, HF + grammar (and vLLM: "
    "--peer vllm)",
    "routing": "router policies over N simulated replicas (radix caches): hit rate, balance",
    "replicas": "real workers behind the real sglang-router / vllm-router: hit rate, balance, "
    "req/s",
    "load": "a running server under closed-loop load, half the requests with fresh pictures: "
    "req/s, p50 / p99 latency",
    "decode": "one decode step of B requests sharing a prefix: plain, prepacked weights, "
    "cascade attention",
    "sglang-cache": "the real SGLang's cached tokens beside our radix tree's, request by request "
    "(and its eviction policies: --policies)",
    "transfer-cost": "loading KV back from a slower tier (host copy measured here, PCIe, NVMe...) "
    "vs recomputing it: times and the break-even length",
    "hicache": "the chat trace device-only vs with a host tier (ratio 1, 2, 4) and a disk: hit "
    "rate, prefill tokens, device and host hits, against Belady's MIN at the total capacity",
    "hicache-engine": "the engine on a multi-turn image chat, device-only vs with a host tier "
    "vs a new engine on a filled disk: TTFT, prefill tokens, cached tokens by source",
    "hybrid": "sliding-window + full attention KV: bytes per sequence, concurrent sequences in "
    "a fixed pool and the bytes-vs-tokens sawtooth, full attention vs vLLM's hybrid manager",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``python -m minirad.bench`` parser with one subcommand per benchmark.

    Args:
        only: import and register the options of this subcommand alone (the others keep their
            name and help); None: all of them.
    """
    parser = argparse.ArgumentParser(
        prog="python -m minirad.bench", description="minirad benchmarks"
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{" + ",".join(_COMMANDS) + "}"
    )
    for name, help_ in _COMMANDS.items():
        p = sub.add_parser(
            name,
            help=help_.replace("%", "%%"),  # help is %-formatted, a description is not
            description=help_,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        if only in (None, name):
            module = importlib.import_module(f".{name.replace('-', '_')}", __name__)
            module.add_arguments(p)
            p.set_defaults(run=module.run_cli)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the command line) and run the chosen benchmark.

    Bad arguments (including library errors such as a pool too small for the trace) end
    with argparse's usage message and exit code 2.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    # The top-level parser has no option taking a value: the first bare word is the command.
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in _COMMANDS else None)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except MiniradError as e:
        parser.error(f"{args.command}: {e}")
