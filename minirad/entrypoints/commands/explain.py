"""``minirad explain``: why each request of a trace hit or missed the cache, replayed without
a model (or read from a real server's recording); the parser here, the work in
:mod:`minirad.entrypoints.explain`."""

from __future__ import annotations

import argparse

from minirad.entrypoints.argtypes import positive_int
from minirad.entrypoints.commands.options import (
    DefaultsHelpFormatter,
    add_eviction_policy_option,
)
from minirad.peers.vllm_server import DEFAULT_MODEL_DIR

__all__ = ["CACHE_DESIGNS", "add_parser", "run"]

CACHE_DESIGNS = ("radix", "block")  # explain_trace.CACHE_DESIGNS, named without torch here


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``explain`` subparser, its ``run`` set."""
    x = subparsers.add_parser(
        "explain",
        help="why each request of a trace hit or missed the cache (no model run)",
        formatter_class=DefaultsHelpFormatter,
        description="Replay a JSONL trace, one request at a time, through a radix cache "
        "(SGLang's) or a block cache (vLLM's) and label every prompt token with its cause: "
        "hit, last_token, evicted, block_floor, first_seen (minirad.kv_events.miss_causes). "
        'Lines: {"prompt_token_ids": [...]} or {"messages": [...]} (OpenAI chat; needs '
        "--model's processor, not its weights). Or, with --from-recording, a real vLLM or "
        "SGLang session: its KV events and each response's cached_tokens, no replay; what they "
        "cannot explain is labelled unknown (minirad.kv_events.explain_events). The report "
        "names the requests r1, r2, ... in the order they were sent (chapter 08's names); with "
        "--json, a line's \"request\" counts from 0 (as do its runs' by_request) and its "
        '"label" is r1, r2, ...',
    )
    x.add_argument(
        "trace",
        nargs="?",
        help="JSONL file: one request per line (default: none; give a trace or --from-recording)",
    )
    x.add_argument(
        "--from-recording",
        metavar="PATH",
        help="a recorded real-server session instead of a trace: PATH_outputs.json and "
        "PATH_events.jsonl (e.g. data/recordings/vllm_ch08); the cache options do not apply "
        "(default: none, a trace)",
    )
    x.add_argument("--cache", choices=CACHE_DESIGNS, default="radix", help="cache design")
    x.add_argument("--capacity", type=positive_int, default=4096, help="cache size in tokens")
    x.add_argument("--page-size", type=positive_int, default=1, help="radix cache page size")
    x.add_argument("--block-size", type=positive_int, default=16, help="block cache block size")
    add_eviction_policy_option(x, old_policy_flag=True, applies="radix cache")
    x.add_argument(
        "--model",
        default=None,
        help="model folder whose chat template and processor render the trace's chat lines "
        f"(default: the shipped {DEFAULT_MODEL_DIR.name}; not needed for token-id lines)",
    )
    x.add_argument("--json", action="store_true", help="one JSON line per request")
    x.set_defaults(run=run)
    return x


def run(args: argparse.Namespace) -> int:
    """:func:`minirad.entrypoints.explain.run_explain` (which imports the caches, and torch,
    only when the command runs)."""
    from minirad.entrypoints.explain import run_explain

    return run_explain(args)
