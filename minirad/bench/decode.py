"""``python -m minirad.bench decode``: the time of one decode step, and what each kernel choice
does to it.

A decode step of ``--batch`` requests, each with ``--shared`` context tokens in the same slots
(a prefix the radix tree shares: a system prompt, a picture) and ``--own`` more of its own,
through :class:`~minirad.models.PagedVLM` on the model's own weights, three ways:

- ``plain``: HF's weights through ``F.linear``, each request's whole context gathered;
- ``prepacked``: oneDNN-packed weight copies (:mod:`minirad.models.linear`);
- ``prepacked + cascade``: and the shared prefix attended to once
  (:mod:`minirad.models.cascade_attention`).

The three take turns, ``--rounds`` times; each keeps its fastest round (the mean over
``--steps`` steps). The KV pool holds random values: the time of a step does not depend on
them, and the three outputs are checked to agree.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import transformers

from minirad.bench.common import thread_settings
from minirad.entrypoints.argtypes import DTYPES, positive_int, thread_count
from minirad.errors import InvalidArgumentError
from minirad.kvcache.kv_pool import KVCache
from minirad.models import DEFAULT_MODEL_DIR, ForwardBatch, PagedVLM, kv_cache_dims, load_model

__all__ = ["VARIANTS", "add_arguments", "decode_slots", "run_cli", "time_decode_step"]

# name -> (prepack, cascade)
VARIANTS = {
    "plain": (False, False),
    "prepacked": (True, False),
    "prepacked + cascade": (True, True),
}


def decode_slots(batch: int, shared: int, own: int) -> list[list[int]]:
    """Slot rows of ``batch`` requests: the first ``shared`` slots the same in every row, then
    ``own`` slots of each row's own (its newest token last)."""
    return [
        list(range(shared)) + list(range(shared + b * own, shared + (b + 1) * own))
        for b in range(batch)
    ]


def time_decode_step(vlm: PagedVLM, batch: ForwardBatch, steps: int) -> float:
    """Mean seconds of one ``vlm(batch)`` over ``steps`` calls (after one untimed call)."""
    vlm(batch)
    start = time.perf_counter()
    for _ in range(steps):
        vlm(batch)
    return (time.perf_counter() - start) / steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``decode`` subcommand's options."""
    positive = positive_int
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="local model folder")
    parser.add_argument("--batch", type=positive, default=8, help="requests decoding together")
    parser.add_argument("--shared", type=_count, default=200, help="context tokens they share")
    parser.add_argument("--own", type=positive, default=50, help="context tokens of each one")
    parser.add_argument("--threads", type=thread_count, default=1, help="torch intra-op threads")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--steps", type=positive, default=10, help="steps timed per round")
    parser.add_argument("--rounds", type=positive, default=3, help="rounds; the fastest is kept")


def _count(text: str) -> int:
    return 0 if text.strip() == "0" else positive_int(text)


def run_cli(args: argparse.Namespace) -> int:
    """Run ``python -m minirad.bench decode``: print ms per step of each variant.

    Raises:
        InvalidArgumentError: no model folder, or a context longer than the model's.
    """
    if not Path(args.model).is_dir():
        raise InvalidArgumentError(f"model folder {args.model!r} not found")
    torch.set_num_threads(args.threads)
    transformers.logging.disable_progress_bar()
    model, _ = load_model(args.model, dtype=getattr(torch, args.dtype), load_processor=False)
    context, limit = args.shared + args.own, model.config.text_config.max_position_embeddings
    if context > limit:
        raise InvalidArgumentError(
            f"a context of {context} tokens is longer than the model's {limit} (--shared + --own)"
        )
    kv = KVCache(
        num_blocks=args.shared + args.batch * args.own,
        block_size=1,
        dtype=model.dtype,
        **kv_cache_dims(model.config),
    )
    torch.manual_seed(0)
    kv.k_cache.normal_()
    kv.v_cache.normal_()
    batch = ForwardBatch.build([[1]] * args.batch, decode_slots(args.batch, args.shared, args.own))
    # One model per prepack setting (a packed copy is the text model's size again); the
    # cascade is a switch of the decoder's.
    vlms = {prepack: PagedVLM(model, kv, prepack) for prepack in (False, True)}

    def step(name: str) -> PagedVLM:
        prepack, cascade = VARIANTS[name]
        vlms[prepack].decoder.cascade = cascade
        return vlms[prepack]

    # Each variant rewrites the newest tokens' K/V: the same values each time, so all agree.
    ref = step("plain")(batch)
    for name in VARIANTS:
        atol = 0.1 if args.dtype == "bfloat16" else 1e-3
        torch.testing.assert_close(step(name)(batch), ref, atol=atol, rtol=0)
    best = dict.fromkeys(VARIANTS, float("inf"))
    for _ in range(args.rounds):
        for name in VARIANTS:
            best[name] = min(best[name], time_decode_step(step(name), batch, args.steps))
    linears = [lin for w in vlms[True].decoder.linears for lin in vars(w).values()]
    packed = sum(lin.packed is not None for lin in linears)
    print(
        f"one decode step: {args.batch} requests, {args.shared} shared + {args.own} own context "
        f"tokens, {args.dtype}, {model.num_parameters() / 1e6:.1f} M parameters; "
        f"{packed} of the decoder's {len(linears)} weight matrices large enough to prepack"
    )
    width = max(map(len, best))
    for name, seconds in best.items():
        ratio = best["plain"] / seconds
        print(f"  {name:<{width}}  {seconds * 1e3:8.2f} ms  {ratio:5.2f}x")
    print(f"threads: {thread_settings()}")
    print(f"Fastest of {args.rounds} rounds of {args.steps} steps, taking turns.")
    return 0
