"""``python -m minirad.bench sglang-cache``: the real SGLang's cached tokens beside our radix
tree's, request by request, and its eviction policies beside ours and Belady's MIN.

The text chat workload (:mod:`minirad.bench.text_chat`: shared system prompts, branching
turns) runs on the real SGLang 0.5.23 (``make sglang``, :mod:`minirad.peers.sglang_server`, the
shipped LLaVA's text half) with a small KV pool, one request at a time. The same requests, with
SGLang's answers, are replayed through our radix tree with SGLang's request lifecycle and
insert rule (:mod:`minirad.kvcache.cached_tokens`), and each request's ``cached_tokens`` are
compared. SGLang's greedy answers are compared with our engine's (``LLMEngine`` on the shipped
LLaVA, the same prompt ids, text only).

``--policies`` runs the workload once more per SGLang eviction policy (``lfu``, ``slru``,
``priority``, ``tlru`` with ``threshold`` 64 and ``next_prompt_estimate`` 8) and prints the
cached tokens of every request under each, beside our replay with the same policy and
Belady's MIN (:mod:`minirad.kvcache.belady`) on the same request order.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

from minirad.bench.text_chat import Answer, Turn, chat_turns, run_turns
from minirad.entrypoints.argtypes import positive_int
from minirad.errors import InvalidArgumentError, PeerError
from minirad.kvcache.cached_tokens import ServedRequest, kv_len, replay_cached_tokens
from minirad.kvcache.eviction import get_policy

__all__ = [
    "POLICY_CONFIGS",
    "Run",
    "add_arguments",
    "belady_per_request",
    "engine_answers",
    "format_comparison",
    "format_policies",
    "run_cli",
    "run_sglang",
]

# SGLang's policies in the table, with their --radix-eviction-policy-config (our get_policy
# takes the same keys).
POLICY_CONFIGS: dict[str, dict | None] = {
    "lru": None,
    "lfu": None,
    "slru": None,
    "priority": None,
    "tlru": {"threshold": 64, "next_prompt_estimate": 8},
}


@dataclass(frozen=True)
class Run:
    """The workload on one SGLang configuration: its answers (``cached_tokens`` included)."""

    max_total_tokens: int
    page_size: int
    overlap: bool
    policy: str
    answers: list[Answer]

    def served(self) -> list[ServedRequest]:
        return [
            ServedRequest(a.prompt, a.output, a.max_new_tokens, a.stopped) for a in self.answers
        ]

    def ours(self, policy: str | None = None, max_total_tokens: int | None = None) -> list[int]:
        """Our replay's cached tokens on these requests (this run's policy and pool unless
        given)."""
        policy = policy or self.policy
        return replay_cached_tokens(
            self.served(),
            max_total_tokens or self.max_total_tokens,
            self.page_size,
            get_policy(policy, **(POLICY_CONFIGS.get(policy) or {})),
            self.overlap,
        )


def run_sglang(
    turns: Sequence[Turn],
    *,
    max_total_tokens: int,
    page_size: int = 1,
    overlap: bool = True,
    policy: str = "lru",
    python: str | os.PathLike | None = None,
) -> Run:
    """Start SGLang with this configuration, send it ``turns`` one at a time, stop it."""
    from minirad.peers.sglang_server import SGLangServer
    from minirad.peers.text_model import text_model_dir

    server = SGLangServer(
        text_model_dir(),
        kv_events=False,
        max_total_tokens=max_total_tokens,
        page_size=page_size,
        eviction_policy=policy,
        eviction_policy_config=POLICY_CONFIGS.get(policy),
        overlap_schedule=overlap,
        python=python,
    )
    with server:
        answers = run_turns(turns, lambda prompt, n: _answer(server, prompt, n))
    return Run(max_total_tokens, page_size, overlap, policy, answers)


def _answer(server, prompt: list[int], max_new_tokens: int) -> tuple[list[int], bool, int]:
    reply = server.generate(prompt, max_new_tokens)
    finish = (reply["finish_reason"] or {}).get("type")
    if finish not in ("stop", "length"):
        raise PeerError(f"SGLang finished a request with {reply['finish_reason']!r}")
    return reply["output_ids"], finish == "stop", reply["cached_tokens"]


def engine_answers(answers: Sequence[Answer]) -> list[list[int]]:
    """Our engine's greedy output ids for the same prompt ids and ``max_new_tokens``, one
    request at a time (the shipped LLaVA, float32, text only)."""
    from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
    from minirad.peers.text_model import DEFAULT_LLAVA_DIR

    engine = LLMEngine.from_pretrained(DEFAULT_LLAVA_DIR)
    outputs = []
    for a in answers:
        params = SamplingParams(max_new_tokens=a.max_new_tokens)
        (out,) = engine.generate([GenerateRequest(a.prompt, sampling_params=params)])
        outputs.append(list(out.token_ids))
    return outputs


def belady_per_request(run: Run) -> list[int]:
    """Belady's MIN (the feasible schedule) on the run's requests in its order, per request."""
    from minirad.bench.trace import ChatTrace, TraceEvent, TraceRequest
    from minirad.kvcache.belady import belady

    requests, events = [], []
    for i, a in enumerate(run.answers):
        # MIN caches prompt + output[:-1]: a request that also cached its stop token (kv_len)
        # gets one more token, the one the overlap scheduler's extra step sampled.
        extra = kv_len(len(a.prompt), len(a.output), a.max_new_tokens, a.stopped, run.overlap)
        extra -= len(a.prompt) + len(a.output) - 1
        requests.append(TraceRequest(a.rid, i, 0, list(a.prompt), list(a.output) + [0] * extra))
        events += [TraceEvent(2 * i, "start", i), TraceEvent(2 * i + 1, "finish", i)]
    trace = ChatTrace(requests, events, [])
    return list(belady(trace, run.max_total_tokens, run.page_size).request_hit_tokens)


def _finish(a: Answer) -> str:
    return f"{len(a.output)} {'stop' if a.stopped else 'length'}"


def format_comparison(run: Run, engine: Sequence[Sequence[int]] | None = None) -> str:
    """The per-request table: SGLang's cached tokens, ours, ours with an unbounded pool (what
    evictions cost), and whether the answers equal our engine's."""
    page = run.page_size
    never = -(-sum(len(a.prompt) + len(a.output) for a in run.answers) // page) * page + page
    ours, unbounded = run.ours(), run.ours(max_total_tokens=never)  # a pool that never evicts
    head = (
        f"{'#':>3}  {'request':<8} {'after':>5} {'prompt':>6} {'output':>11}  "
        f"{'SGLang':>6} {'ours':>6} {'same':>4}  {'no evict':>8}"
    )
    if engine is not None:
        head += "  engine"
    lines = [
        f"cached tokens per request: SGLang 0.5.23 vs our RadixCache replay "
        f"(pool {run.max_total_tokens} tokens, page size {run.page_size}, {run.policy}, "
        f"overlap scheduler {'on' if run.overlap else 'off'})",
        head,
    ]
    for i, a in enumerate(run.answers):
        row = (
            f"{i:>3}  {a.rid:<8} {'-' if a.after is None else a.after:>5} {len(a.prompt):>6} "
            f"{_finish(a):>11}  {a.cached_tokens:>6} {ours[i]:>6} "
            f"{'yes' if a.cached_tokens == ours[i] else 'NO':>4}  {unbounded[i]:>8}"
        )
        if engine is not None:
            row += "  " + ("same" if list(engine[i]) == a.output else f"DIFF {engine[i]}")
        lines.append(row)
    same = _same(ours, [a.cached_tokens for a in run.answers])
    total = sum(a.cached_tokens for a in run.answers)
    lines.append(
        f"{'total':<19} {sum(len(a.prompt) for a in run.answers):>6} {'':>11}  {total:>6} "
        f"{sum(ours):>6} {'':>4}  {sum(unbounded):>8}"
    )
    lines.append(f"same cached tokens: {same}/{len(ours)} requests")
    if engine is not None:
        equal = _same([list(e) for e in engine], [a.output for a in run.answers])
        lines.append(f"same greedy tokens as our engine: {equal}/{len(ours)} requests")
    return "\n".join(lines)


def _same(xs: Sequence, ys: Sequence) -> int:
    """How many positions hold equal items (the sequences have the same length)."""
    return sum(x == y for x, y in zip(xs, ys, strict=True))


def format_policies(runs: dict[str, Run], optimal: Sequence[int]) -> str:
    """The policy table: per request, SGLang's cached tokens (S) and our replay's under each
    policy (``-`` where we have no such policy), and Belady's MIN."""
    first = next(iter(runs.values()))
    n = len(first.answers)
    groups = {}  # policy -> (SGLang's, ours or None)
    for name, run in runs.items():
        try:
            ours = run.ours()
        except InvalidArgumentError:  # not one of our policies
            ours = None
        groups[name] = ([a.cached_tokens for a in run.answers], ours)
    lines = [
        f"cached tokens per request under each eviction policy: S = SGLang 0.5.23, ours = our "
        f"RadixCache replay; MIN = Belady's (pool {first.max_total_tokens} tokens, page size "
        f"{first.page_size})",
        f"{'':<13}" + "".join(f"{name:>12}" for name in groups) + f"{'MIN':>7}",
        f"{'#':>3}  {'request':<8}" + f"{'S':>6}{'ours':>6}" * len(groups),
    ]

    def row(head: str, pick) -> str:
        cells = "".join(
            f"{pick(sg):>6}{'-' if ours is None else pick(ours):>6}" for sg, ours in groups.values()
        )
        return head + cells + f"{pick(optimal):>7}"

    for i, a in enumerate(first.answers):
        lines.append(row(f"{i:>3}  {a.rid:<8}", lambda v, i=i: v[i]))
    lines.append(row(f"{'total':<13}", sum))
    agree = [f"{k} {_same(sg, ours)}/{n}" for k, (sg, ours) in groups.items() if ours is not None]
    lines.append("requests where SGLang and ours agree: " + ", ".join(agree))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``sglang-cache`` subcommand's options."""
    parser.add_argument(
        "--max-total-tokens",
        type=positive_int,
        default=192,
        help="the KV pool in tokens (SGLang's --max-total-tokens): small, so that it evicts",
    )
    parser.add_argument("--page-size", type=positive_int, default=1, help="tokens per KV page")
    parser.add_argument(
        "--no-overlap",
        action="store_true",
        help="SGLang's --disable-overlap-schedule (a stop token is then never cached)",
    )
    parser.add_argument(
        "--conversations", type=positive_int, default=10, help="conversations in the workload"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload")
    parser.add_argument(
        "--policies",
        action="store_true",
        help="also run SGLang once per eviction policy (lru, lfu, slru, priority, tlru: one "
        "server start each) and print them beside ours and Belady's MIN",
    )
    parser.add_argument(
        "--no-engine",
        action="store_true",
        help="skip the comparison of SGLang's greedy tokens with our engine's",
    )


# The workload's turns reach 155 prompt tokens plus up to 24 new ones: a smaller pool fails
# mid-run (SGLang answers 400), and below a few tokens SGLang dies starting.
MIN_POOL = 192


def run_cli(args: argparse.Namespace) -> int:
    if args.max_total_tokens < MIN_POOL:  # checked before a server starts (minutes)
        raise InvalidArgumentError(
            f"--max-total-tokens {args.max_total_tokens} is too small for this workload: its "
            f"prompts and answers need up to {MIN_POOL} tokens of KV"
        )
    if args.max_total_tokens % args.page_size:
        raise InvalidArgumentError(
            f"--max-total-tokens {args.max_total_tokens} is not a multiple of --page-size "
            f"{args.page_size}"
        )
    turns = chat_turns(args.conversations, args.seed)
    settings = dict(
        max_total_tokens=args.max_total_tokens,
        page_size=args.page_size,
        overlap=not args.no_overlap,
    )
    runs = {"lru": run_sglang(turns, **settings)}
    engine = None if args.no_engine else engine_answers(runs["lru"].answers)
    lru = runs["lru"]
    print(format_comparison(lru, engine))
    n = len(lru.answers)
    ok = _same(lru.ours(), [a.cached_tokens for a in lru.answers]) == n
    if engine is not None:
        ok &= _same([list(e) for e in engine], [a.output for a in lru.answers]) == n
    if args.policies:
        for policy in POLICY_CONFIGS:
            if policy not in runs:
                runs[policy] = run_sglang(turns, policy=policy, **settings)
        print()
        print(format_policies(runs, belady_per_request(runs["lru"])))
    return 0 if ok else 1
