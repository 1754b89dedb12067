"""The engine over a hierarchical cache on a multi-turn image chat: time to first token with
and without tiers (``python -m minirad.bench hicache-engine``).

``C`` conversations, each about its own picture, ``T`` turns each; turn ``t`` of a
conversation is its whole history (the picture, the earlier questions and the engine's own
answers) plus a new question. Requests arrive one at a time, conversations taking turns, so
between two turns of a conversation the others run. Four engines serve the same requests:

- ``device, room for all``: a device pool that never evicts (the bound);
- ``device only``: a device pool of ``--device-frac`` of what the whole workload caches, as
  SGLang runs without HiCache: a conversation's history is usually gone when it returns;
- ``+ host xR``: the same device pool with a host tier ``R`` times its size (write_through);
- ``+ host x2 + disk, new engine``: a fresh engine on a disk folder that another engine filled
  with the same workload (sglang #27619's "after a reboot"): nothing on the device or host
  at its start, the pages on disk.

Each engine's answers must equal the first's (they are printed as mismatches otherwise). The
runs alternate and each keeps its fastest of ``--repeat`` (the machines are noisy); the TTFT of
the first turns (nothing to reuse) is reported apart from the later turns'.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

from minirad.bench.engine import QUESTIONS
from minirad.course.scenes import DEFAULT_IMAGE_SIZE, random_scene, render
from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.entrypoints.argtypes import positive_int, thread_count
from minirad.errors import InvalidArgumentError
from minirad.models import DEFAULT_MODEL_DIR

__all__ = ["TierRun", "add_arguments", "run_cli", "run_conversations"]


@dataclass
class TierRun:
    """One engine's pass over the conversations."""

    label: str
    answers: list[str] = field(default_factory=list)
    ttft_first: list[float] = field(default_factory=list)  # turn 0 of each conversation
    ttft_later: list[float] = field(default_factory=list)  # turns 1..T-1
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    longest: int = 0  # the longest request, prompt and answer, in tokens
    cached_tokens_by_source: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def run_conversations(
    engine: LLMEngine,
    label: str,
    num_conversations: int,
    num_turns: int,
    max_new_tokens: int,
    seed: int = 0,
) -> TierRun:
    """Serve the conversations on ``engine``, one request at a time, round robin."""
    rng = random.Random(seed)
    images = [render(random_scene(rng, DEFAULT_IMAGE_SIZE)) for _ in range(num_conversations)]
    history: list[list[dict]] = [[] for _ in range(num_conversations)]
    params = SamplingParams(max_new_tokens=max_new_tokens)
    run, t0 = TierRun(label), time.perf_counter()
    before = engine.stats
    for turn in range(num_turns):
        for c in range(num_conversations):
            question = QUESTIONS[(c + turn) % len(QUESTIONS)]
            content = [{"type": "text", "text": question}]
            if turn == 0:
                content.insert(0, {"type": "image"})
            history[c].append({"role": "user", "content": content})
            prompt = engine.processor.apply_chat_template(
                history[c], add_generation_prompt=True, tokenize=False
            )
            start, first, out = time.perf_counter(), None, None
            for out in engine.stream(GenerateRequest(prompt, [images[c]], params)):  # noqa: B007
                first = first or time.perf_counter()
            (run.ttft_first if turn == 0 else run.ttft_later).append(first - start)
            run.answers.append(out.text)
            run.prompt_tokens += len(out.prompt_token_ids)
            run.longest = max(run.longest, len(out.prompt_token_ids) + len(out.token_ids))
            history[c].append(
                {"role": "assistant", "content": [{"type": "text", "text": out.text}]}
            )
    run.seconds = time.perf_counter() - t0
    after = engine.stats
    run.prefill_tokens = after.prefill_tokens - before.prefill_tokens
    run.cached_tokens_by_source = {
        k: n - before.cached_tokens_by_source.get(k, 0)
        for k, n in after.cached_tokens_by_source.items()
    }
    return run


def _mean_ms(xs: list[float]) -> str:
    return f"{1000 * statistics.fmean(xs):.1f}" if xs else "-"


def format_report(runs: list[TierRun], device_slots: int, roomy_slots: int, header: str) -> str:
    ref = runs[0]
    lines = [
        header,
        f"device pool: {device_slots:,} token slots (room for all: {roomy_slots:,})",
        "",
        f"{'engine':<32} {'TTFT turn 0':>12} {'TTFT later':>11} {'vs device':>10} "
        f"{'prefill tok':>12} {'cached: device / host / disk':>30} {'mismatch':>9}",
    ]
    base = next(r for r in runs if r.label == "device only")
    for r in runs:
        src = r.cached_tokens_by_source
        cached = f"{src.get('device', 0):,} / {src.get('host', 0):,} / {src.get('storage', 0):,}"
        ratio = statistics.fmean(base.ttft_later) / statistics.fmean(r.ttft_later)
        bad = sum(a != b for a, b in zip(r.answers, ref.answers, strict=True))
        lines.append(
            f"{r.label:<32} {_mean_ms(r.ttft_first):>12} {_mean_ms(r.ttft_later):>11} "
            f"{ratio:>9.2f}x {r.prefill_tokens:>12,} {cached:>30} {bad:>9}"
        )
    lines.append(
        "(TTFT: mean ms from submitting a request to its first token, one request at a time; "
        "vs device: device-only's later-turn TTFT over the row's; each row the fastest of its "
        "repeats)"
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="local model folder")
    parser.add_argument("--conversations", type=positive_int, default=6)
    parser.add_argument("--turns", type=positive_int, default=4)
    parser.add_argument("--max-new-tokens", type=positive_int, default=16)
    parser.add_argument(
        "--device-frac",
        type=float,
        default=0.25,
        help="the small device pool, as a fraction of what the roomy run caches",
    )
    parser.add_argument("--hicache-ratio", type=float, default=4.0, help="host tier row")
    parser.add_argument("--repeat", type=positive_int, default=3, help="best of N, alternated")
    parser.add_argument("--threads", type=thread_count, default=1, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)


def run_cli(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    if not 0 < args.device_frac <= 1:
        raise InvalidArgumentError(f"--device-frac must be in (0, 1], got {args.device_frac}")
    work = (args.conversations, args.turns, args.max_new_tokens, args.seed)
    roomy = LLMEngine.from_pretrained(args.model, num_kv_slots=1 << 16)
    model, processor = roomy.vlm.model, roomy.processor
    first = run_conversations(roomy, "device, room for all", *work)
    cached = roomy.tree_cache.total_size()
    slots = max(int(cached * args.device_frac), first.longest)  # a request must fit
    folder = tempfile.mkdtemp(prefix="minirad-hicache-")
    filler = LLMEngine(
        model, processor, num_kv_slots=slots, hicache_ratio=2.0, hicache_storage_dir=folder
    )
    run_conversations(filler, "filler", *work)
    filler.close()
    configs = {
        "device, room for all": dict(num_kv_slots=1 << 16),
        "device only": dict(num_kv_slots=slots),
        f"+ host x{args.hicache_ratio:g}": dict(
            num_kv_slots=slots, hicache_ratio=args.hicache_ratio
        ),
        "+ host x2 + disk, new engine": dict(
            num_kv_slots=slots, hicache_ratio=2.0, hicache_storage_dir=folder
        ),
    }
    best: dict[str, TierRun] = {}
    for _ in range(args.repeat):
        for label, kwargs in configs.items():
            engine = LLMEngine(model, processor, **kwargs)
            run = run_conversations(engine, label, *work)
            engine.close()
            if label not in best or run.seconds < best[label].seconds:
                best[label] = run
    header = (
        f"{args.conversations} conversations x {args.turns} turns, one picture each, "
        f"{args.max_new_tokens} new tokens per answer, model {args.model}, "
        f"{args.threads} thread(s)"
    )
    print(format_report(list(best.values()), slots, 1 << 16, header))
    return 0
