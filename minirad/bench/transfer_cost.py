"""``python -m minirad.bench transfer-cost``: when loading KV back from a slower tier beats
recomputing it, on this machine and over named links.

Measured here, each the best of ``--repeats`` tries:

- the **host copy**: ``dst.copy_(src)`` between two CPU buffers the KV size of
  ``--copy-tokens`` tokens (default: 64 MB, more than a CPU cache holds) gives the
  bandwidth; one token's KV copied ``--small-copies`` times gives the per-transfer latency
  (the call's fixed cost);
- the **prefill rate**: the model (``--model``, the shipped one by default) prefilling a fresh
  prompt of ``--prompt-tokens`` random token ids, one generated token, nothing cached; or
  ``--prefill-tokens-per-s`` gives one (a GPU's, say: on a CPU a prefill is so slow that
  loading back pays at any length).

Bytes per token come from the model's config (``layers * 2 * kv_heads * head_dim * dtype
bytes``). The table then gives, for the measured host copy, the presets of
:data:`minirad.kvcache.transfer_cost.PRESETS` (or one link of ``--bandwidth-gb-s`` /
``--latency-us``), the load time at each of ``--lengths`` beside the recompute time, and the
break-even length (:func:`~minirad.kvcache.transfer_cost.break_even_tokens`). Recompute is
linear in the model: lengths past the measured prompt are extrapolated, and a real prefill's
attention makes long ones dearer than that.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch
import transformers

from minirad.bench.common import thread_settings
from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.entrypoints.argtypes import DTYPES, non_negative_float, positive_int, thread_count
from minirad.errors import InvalidArgumentError
from minirad.kvcache.transfer_cost import (
    PRESETS,
    TierLink,
    break_even_tokens,
    kv_bytes_per_token,
    load_time_s,
    recompute_time_s,
)
from minirad.models import DEFAULT_MODEL_DIR, kv_cache_dims, load_model

__all__ = ["add_arguments", "measure_host_copy", "measure_prefill", "run_cli"]


def measure_host_copy(bytes_per_token: int, copy_tokens: int, repeats: int, small_copies: int):
    """This machine's host-to-host KV copy as a :class:`TierLink` ("host-copy (measured)").

    Bandwidth: payload bytes over the fastest of ``repeats`` copies of ``copy_tokens`` tokens'
    KV between two CPU buffers. Latency: the fastest of ``repeats`` means over
    ``small_copies`` copies of one token's KV (its bytes' own time is negligible there).
    """
    n = bytes_per_token * copy_tokens
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages before timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    small_src, small_dst = src[:bytes_per_token], dst[:bytes_per_token]
    best_small = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(small_copies):
            small_dst.copy_(small_src)
        best_small = min(best_small, (time.perf_counter() - start) / small_copies)
    return TierLink("host-copy", n / best / 1e9, best_small * 1e6, "measured here")


def measure_prefill(
    engine: LLMEngine, prompt_tokens: int, repeats: int, avoid: set[int], seed: int = 0
) -> float:
    """Prefill tokens per second: the fastest of ``repeats`` requests of ``prompt_tokens``
    fresh random token ids (none in ``avoid``: image placeholders, stop tokens; no prefix in
    common, so nothing is cached), one new token each.

    Raises:
        InvalidArgumentError: the engine found part of a prompt cached.
    """
    rng = random.Random(seed)
    usable = [t for t in range(min(engine.vocab_size, 32000)) if t not in avoid]
    params = SamplingParams(max_new_tokens=1)
    best = float("inf")
    for _ in range(repeats):
        prompt = [rng.choice(usable) for _ in range(prompt_tokens)]
        cached = engine.stats.cached_tokens
        start = time.perf_counter()
        engine.generate([GenerateRequest(prompt, sampling_params=params)])
        best = min(best, time.perf_counter() - start)
        if engine.stats.cached_tokens != cached:
            raise InvalidArgumentError("a prefill prompt hit the cache: the rate would be wrong")
    return prompt_tokens / best


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``transfer-cost`` subcommand's options."""
    positive = positive_int
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="local model folder")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="KV and model dtype")
    parser.add_argument("--threads", type=thread_count, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--prompt-tokens", type=positive, default=None,
        help="prefill prompt length (default: the model's context less one)",
    )  # fmt: skip
    parser.add_argument(
        "--copy-tokens", type=positive, default=None,
        help="tokens per bandwidth copy (default: 64 MB of KV, past the CPU caches)",
    )  # fmt: skip
    parser.add_argument("--small-copies", type=positive, default=200, help="copies per latency try")
    parser.add_argument("--repeats", type=positive, default=5, help="tries; the fastest is kept")
    parser.add_argument(
        "--lengths", type=positive, nargs="+", default=[16, 64, 256, 1024, 4096, 16384],
        help="prefix lengths (tokens) of the table",
    )  # fmt: skip
    parser.add_argument(
        "--bandwidth-gb-s", type=float, default=None,
        help="one link of this bandwidth instead of the presets (with --latency-us)",
    )  # fmt: skip
    parser.add_argument(
        "--latency-us", type=non_negative_float, default=None,
        help="its per-transfer latency (default 0)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-tokens-per-s", type=float, default=None,
        help="use this prefill rate instead of measuring one (e.g. a GPU's)",
    )  # fmt: skip
    parser.add_argument(
        "--transfers", type=positive, default=1,
        help="copies per load-back (1: one batched copy; pages: page by page)",
    )  # fmt: skip


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def run_cli(args: argparse.Namespace) -> int:
    """Run ``python -m minirad.bench transfer-cost``: measure, then print the table.

    Raises:
        InvalidArgumentError: no model folder, a prompt longer than the model's context, a
            bad link.
    """
    if not Path(args.model).is_dir():
        raise InvalidArgumentError(f"model folder {args.model!r} not found")
    if args.prefill_tokens_per_s is not None and not 0 < args.prefill_tokens_per_s < math.inf:
        raise InvalidArgumentError(
            f"--prefill-tokens-per-s must be a positive number, got {args.prefill_tokens_per_s}"
        )
    if args.latency_us is not None and args.bandwidth_gb_s is None:
        raise InvalidArgumentError("--latency-us needs --bandwidth-gb-s")
    links = list(PRESETS.values())
    if args.bandwidth_gb_s is not None:
        links = [TierLink("given", args.bandwidth_gb_s, args.latency_us or 0.0, "command line")]
    torch.set_num_threads(args.threads)
    transformers.logging.disable_progress_bar()
    dtype = getattr(torch, args.dtype)
    model, processor = load_model(args.model, dtype=dtype)
    config = model.config
    limit = config.get_text_config().max_position_embeddings
    prompt_tokens = args.prompt_tokens or limit - 1
    if prompt_tokens >= limit:
        raise InvalidArgumentError(
            f"--prompt-tokens {prompt_tokens} leaves no room for a token in the model's "
            f"context of {limit}"
        )
    engine = LLMEngine(model, processor, num_kv_slots=-(-(prompt_tokens + 1) // 64) * 64)
    dims = kv_cache_dims(config)
    bpt = kv_bytes_per_token(**dims, dtype_bytes=dtype.itemsize)
    avoid = {*engine.eos_token_ids, getattr(config, "image_token_id", -1)}
    if args.prefill_tokens_per_s is None:
        rate = measure_prefill(engine, prompt_tokens, args.repeats, avoid)
        measured = f"{prompt_tokens}-token prompt, {args.threads} thread(s)"
    else:
        rate = args.prefill_tokens_per_s
        measured = "given, not measured"
    copy_tokens = args.copy_tokens or -(-(64 << 20) // bpt)
    host = measure_host_copy(bpt, copy_tokens, args.repeats, args.small_copies)
    links = [host, *links]
    print(
        f"{Path(args.model).name}: {model.num_parameters() / 1e6:.1f} M parameters, "
        f"{args.dtype}; KV {dims['num_layers']} layers x 2 x {dims['num_kv_heads']} kv heads x "
        f"{dims['head_dim']} x {dtype.itemsize} B = {bpt} B per token"
    )
    print(
        f"prefill: {rate:.0f} tokens/s ({measured}); "
        f"host copy: {host.bandwidth_gb_s:.2f} GB/s, {host.latency_us:.2f} us per copy "
        f"({copy_tokens} tokens = {bpt * copy_tokens / 1e6:.1f} MB)"
    )
    print(f"load back ({args.transfers} transfer(s)) vs recompute, ms:")
    name_w = max(len("recompute"), *(len(link.name) for link in links))
    head = f"  {'link':<{name_w}}  {'GB/s':>6}  {'lat us':>7}"
    head += "".join(f"  {n:>8}" for n in args.lengths) + f"  {'break-even':>11}  source"
    print(head)
    line = f"  {'recompute':<{name_w}}  {'':>6}  {'':>7}"
    print(line + "".join(f"  {_fmt_ms(recompute_time_s(n, rate)):>8}" for n in args.lengths))
    for link in links:
        row = f"  {link.name:<{name_w}}  {link.bandwidth_gb_s:>6.3g}  {link.latency_us:>7.3g}"
        row += "".join(
            f"  {_fmt_ms(load_time_s(n, bpt, link, args.transfers)):>8}" for n in args.lengths
        )
        even = break_even_tokens(bpt, link, rate, args.transfers)
        shown = "never" if even is None else f"{even:.3g} tok"
        print(f"{row}  {shown:>11}  {link.source}")
    past = "" if args.prefill_tokens_per_s else f"lengths past {prompt_tokens} extrapolated; "
    print(
        "Break-even: the prefix length above which loading back beats recomputing. Recompute "
        f"is linear at the prefill rate ({past}real attention makes long prefills dearer, so "
        "loading pays earlier than shown)."
    )
    print(f"threads: {thread_settings()}; fastest of {args.repeats} tries each.")
    return 0
