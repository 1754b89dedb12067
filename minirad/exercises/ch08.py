"""Exercises of chapter 08 (the real engines: vLLM's hits, block hashes and KV events; what
SGLang's radix tree takes in).

The answers are computed here with the real ``minirad`` code on the chapter's recorded vLLM
session (:func:`minirad.course.recordings.load`, committed in ``data/recordings/``): vLLM's design
replayed by :class:`~minirad.kvcache.kv_cache_manager.KVCacheManager` and
:func:`~minirad.kvcache.kv_cache_manager.serve_one_at_a_time` for q1 to q3, with each image keyed
by its file name as the chapter keys it, and the :class:`~minirad.engine.LLMEngine` on the shipped
model with a :class:`~minirad.kv_events.block_events.RadixBlockEvents` publisher for q4 (the model
is loaded on the first check that needs it). q5 reads the recorded SGLang session
(:func:`minirad.course.sglang_recording.load`) with SGLang's insert rule,
:func:`~minirad.kvcache.cached_tokens.kv_len`. q6 and q7 ask the cause of a few tokens of a
small trace, answered by ``minirad explain``'s replay
(:func:`~minirad.kv_events.explain_trace.explain_trace`). Every ``Qn_SOLUTION`` is runnable
code that sets ``answer``; the tests run it and check it with ``qn``, and compute the answers
another way (vLLM's recorded hashes, plain prefix arithmetic, the paths in SGLang's recorded
events, a hand-written block table and free queue).

Usage in the notebook::

    from minirad.exercises.ch08 import q1
    answer = ...
    q1.check(answer)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from transformers import AutoConfig

from minirad.course import recordings, sglang_recording
from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.exercises import Exercise, is_int, is_int_list, wrong_type
from minirad.kv_events import BlockStored
from minirad.kv_events.block_events import VLLM_BLOCK_SIZE, RadixBlockEvents
from minirad.kv_events.explain_trace import explain_trace
from minirad.kv_events.miss_causes import CAUSES
from minirad.kvcache.cached_tokens import kv_len
from minirad.kvcache.kv_cache_manager import KVCacheManager, serve_one_at_a_time
from minirad.kvcache.multimodal import MultiModalItem
from minirad.models import DEFAULT_MODEL_DIR, load_model

__all__ = [
    "Q1_BLOCK_SIZE",
    "Q1_PROMPT_LEN",
    "Q2_BLOCK_SIZE",
    "Q3_BLOCK_SIZE",
    "Q4_BLOCK_SIZE",
    "Q4_OUTPUT_LEN",
    "Q6_CACHE",
    "Q6_CAPACITY",
    "Q6_FIRST",
    "Q6_LAST",
    "Q6_REQUEST",
    "Q6_TRACE",
    "Q6_UNIT",
    "Q7_CACHE",
    "Q7_CAPACITY",
    "Q7_FIRST",
    "Q7_LAST",
    "Q7_REQUEST",
    "Q7_TRACE",
    "Q7_UNIT",
    "q1",
    "q2",
    "q3",
    "q4",
    "q5",
    "q6",
    "q7",
]

# q1: a prompt of Q1_PROMPT_LEN tokens, all of them (and more) cached by an earlier request.
Q1_PROMPT_LEN = 96
Q1_BLOCK_SIZE = VLLM_BLOCK_SIZE
# q2: the recorded session's six requests again, in a cache of 16-token blocks (vLLM's GPU
# default).
Q2_BLOCK_SIZE = 16
# q3: block 0 of each recorded request, at the recording's block size.
Q3_BLOCK_SIZE = VLLM_BLOCK_SIZE
# q4: r1's prompt served alone by a fresh engine, exactly Q4_OUTPUT_LEN output tokens (98 + 62
# = 160 = 5 blocks: only a count that leaves out the last output token gets it right).
Q4_OUTPUT_LEN = 62
Q4_BLOCK_SIZE = VLLM_BLOCK_SIZE


@functools.cache
def _session() -> recordings.Session:
    return recordings.load()


@functools.cache
def _image_token_id() -> int:
    return AutoConfig.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True).image_token_id


def _block_request(
    out: recordings.RecordedOutput, images: bool = True
) -> tuple[Sequence[int], Sequence[int], list[MultiModalItem]]:
    """``out.block_request`` (as the chapter keys images); with ``images=False`` the images
    are left out of the hashes (a typical mistake)."""
    prompt, output, items = out.block_request(_image_token_id())
    return prompt, output, items if images else []


@functools.cache
def _session_hits(block_size: int, images: bool = True) -> tuple[int, ...]:
    """Each recorded request's cached prompt tokens in vLLM's design at ``block_size``."""
    requests = [_block_request(o, images) for o in _session().outputs]
    return tuple(serve_one_at_a_time(KVCacheManager(1024, block_size), requests))


# ----------------------------------------------------------------------------------------- q1
@functools.cache
def _q1_hit() -> int:
    n, bs = Q1_PROMPT_LEN, Q1_BLOCK_SIZE
    earlier = list(range(100, 100 + n + bs))  # the prompt, and one more block after it
    manager = KVCacheManager(num_blocks=16, block_size=bs)
    # One output token each: its prompt is all that an earlier request caches here.
    return serve_one_at_a_time(manager, [(earlier, [2], []), (earlier[:n], [2], [])])[1]


def _check_q1(answer: object) -> str | None:
    if not is_int(answer):
        return wrong_type("one int (tokens)", answer)
    expected, n, bs = _q1_hit(), Q1_PROMPT_LEN, Q1_BLOCK_SIZE
    if answer == expected:
        return None
    if answer == n // bs * bs:
        return (
            "the last prompt token always goes through the model (its logits give the first "
            "output token): at most (len - 1) // block_size blocks hit, so a prompt of whole "
            "blocks computes its whole last block again"
        )
    if answer == n - 1:
        return "that is what the radix tree reuses; a block cache reuses whole blocks only"
    if answer == expected // bs:
        return "that counts blocks; cached_tokens counts tokens"
    if answer == 0:
        return f"the earlier request cached these {n} tokens: its blocks are still there to hit"
    return f"{answer} tokens is not it; how many whole {bs}-token blocks fit in {n - 1} tokens?"


Q1_SOLUTION = """\
prompt_len, block_size = 96, 32
# The last prompt token is computed whatever is cached: at most (96 - 1) // 32 = 2 blocks hit.
answer = (prompt_len - 1) // block_size * block_size  # 64: the third block is computed again"""

q1 = Exercise(
    "q1 the hit of a fully cached prompt",
    _check_q1,
    "Only whole blocks hit, and at most (len(prompt) - 1) // block_size of them: r5 of the "
    "recording (98 tokens, 96 cached) is one case of the rule.",
    Q1_SOLUTION,
)


# ----------------------------------------------------------------------------------------- q2
def _check_q2(answer: object) -> str | None:
    expected = list(_session_hits(Q2_BLOCK_SIZE))
    if not is_int_list(answer) or len(answer) != len(expected):
        return wrong_type(f"{len(expected)} ints, one per request, e.g. (0, 0, 0, 0, 0, 0)", answer)
    got, bs = list(answer), Q2_BLOCK_SIZE
    if got == expected:
        return None
    if got == [o.cached_tokens for o in _session().outputs]:
        return (
            f"those are vLLM's hits at {VLLM_BLOCK_SIZE} tokens per block; here a block holds {bs}"
        )
    if got == list(_session_hits(bs, images=False)):
        return (
            "the image is in the block hashes (extra_keys): A and B have the same placeholder "
            "ids, not the same blocks"
        )
    if any(a % bs for a in got):
        return f"a block cache reuses whole blocks only: every hit is a multiple of {bs}"
    i = next(i for i, (a, e) in enumerate(zip(got, expected, strict=True)) if a != e)
    image = _session().outputs[i].prompt_token_ids.index(_image_token_id())
    if got[i] == 0 and image >= bs:
        return (
            f"r{i + 1}: its image starts at token {image}, so its first block holds text only: "
            "did an earlier request compute the same text?"
        )
    return (
        f"r{i + 1} is not {got[i]}: find where its prompt parts from what the earlier requests "
        "computed (their prompts, their answers but the last token, each image by its "
        f"pixels), then keep whole {bs}-token blocks"
    )


Q2_SOLUTION = """\
from minirad.course import recordings, sglang_recording
from minirad.kvcache.kv_cache_manager import KVCacheManager, serve_one_at_a_time

session = recordings.load()
requests = [out.block_request(3) for out in session.outputs]  # 3: the model's image_token_id
answer = serve_one_at_a_time(KVCacheManager(num_blocks=1024, block_size=16), requests)
# [0, 80, 16, 80, 96, 0]: r2 and r4 share 89 tokens with the request before them, 5 whole
# blocks; r5 hits 6 blocks of its 98 tokens; and r3 now reuses block 0: tokens 0-15 hold only
# the system turn (its image starts at token 24), which r1 computed."""

q2 = Exercise(
    "q2 hits with 16-token blocks",
    _check_q2,
    "Run the chapter's comparison again with KVCacheManager(num_blocks=1024, block_size=16). "
    "By hand: a block hits when its tokens, its images and every block before it match.",
    Q2_SOLUTION,
)


# ----------------------------------------------------------------------------------------- q3
@functools.cache
def _q3_expected() -> frozenset[int]:
    """Requests (1-based) whose block 0 has r1's token ids but another hash."""
    bs = Q3_BLOCK_SIZE
    manager = KVCacheManager(num_blocks=1, block_size=bs)
    blocks = []
    for out in _session().outputs:
        prompt, _, items = _block_request(out)
        blocks.append((tuple(prompt[:bs]), manager.block_hashes(prompt[:bs], items)[0]))
    first = blocks[0]
    return frozenset(i for i, (ids, h) in enumerate(blocks, 1) if ids == first[0] and h != first[1])


def _check_q3(answer: object) -> str | None:
    n = len(_session().outputs)
    if not isinstance(answer, set | frozenset | list | tuple) or not all(map(is_int, answer)):
        return wrong_type("a set of request numbers, e.g. {2, 5}", answer)
    got = set(answer)
    if unknown := sorted(got - set(range(1, n + 1))):
        return f"the requests are r1 to r{n}; there is no {unknown[0]}"
    expected = _q3_expected()
    if got == expected:
        return None
    outputs = _session().outputs
    r1 = outputs[0]
    bs = Q3_BLOCK_SIZE
    for i in sorted(got - expected):
        out = outputs[i - 1]
        if i == 1:
            return "r1's block 0 is the one the others are compared with"
        if out.prompt_token_ids[:bs] != r1.prompt_token_ids[:bs]:
            return f"r{i}: compare its first {bs} token ids with r1's"
        return (
            f"r{i} asks about r1's picture behind the same text: same tokens, same image, "
            "same parent (none), so the same hash; a hash does not depend on the request"
        )
    missing = sorted(expected - got)[0]
    if outputs[missing - 1].cached_tokens:
        return (
            f"r{missing} published no block 0 of its own: it hit {bs}-token blocks stored "
            "before; which request stored them, and with which image?"
        )
    return f"r{missing}: its first {bs} token ids are r1's; which image does its block 0 hold?"


Q3_SOLUTION = """\
from minirad.course import recordings, sglang_recording
from minirad.kvcache.kv_cache_manager import KVCacheManager

session = recordings.load()
manager = KVCacheManager(num_blocks=1, block_size=32)
blocks = []
for out in session.outputs:
    prompt, _, items = out.block_request(3)  # 3: the model's image_token_id
    block = prompt[:32]
    blocks.append((block, manager.block_hashes(block, items)[0]))
answer = {
    i for i, (ids, h) in enumerate(blocks, 1) if ids == blocks[0][0] and h != blocks[0][1]
}
# {3, 4}: block 0 holds the system turn and the first 8 placeholders, the same 32 ids for
# r1 to r5 (r6 has no system turn). Its hash covers the image: A for r1, r2 and r5 (one
# block, stored by r1, hit by the others), B for r3 and r4 (stored by r3, hit by r4)."""

q3 = Exercise(
    "q3 same tokens, another hash",
    _check_q3,
    "A block's hash covers its parent's hash, its token ids and its images (extra_keys), "
    "nothing else. Requests that hit block 0 published none: theirs is the one they hit.",
    Q3_SOLUTION,
)


# ----------------------------------------------------------------------------------------- q4
@functools.cache
def _q4_published() -> tuple[int, int]:
    """``(blocks, BlockStored events)`` our engine publishes for r1's prompt served alone."""
    r1 = _session().outputs[0]
    with torch.random.fork_rng(devices=[]):  # loading must not move the learner's RNG
        model, processor = load_model(DEFAULT_MODEL_DIR)
    engine = LLMEngine(model, processor)
    publisher = RadixBlockEvents(engine.bus, block_size=Q4_BLOCK_SIZE)
    params = SamplingParams(max_new_tokens=Q4_OUTPUT_LEN, stop_token_ids=())
    engine.generate([GenerateRequest(list(r1.prompt_token_ids), [r1.request.image_path], params)])
    publisher.close()
    stored = [e for e in publisher.take_events() if isinstance(e, BlockStored)]
    return sum(len(e.block_hashes) for e in stored), len(stored)


def _check_q4(answer: object) -> str | None:
    if not is_int(answer):
        return wrong_type("one int (blocks)", answer)
    blocks, events = _q4_published()
    if answer == blocks:
        return None
    prompt_len, bs = len(_session().outputs[0].prompt_token_ids), Q4_BLOCK_SIZE
    if answer == (prompt_len + Q4_OUTPUT_LEN) // bs:
        return (
            "the last output token is sampled, never fed back to the model: it has no K/V, "
            "so the tree never caches it"
        )
    if answer == prompt_len // bs:
        return (
            "the answer's tokens enter the tree too, when the request finishes "
            "(cache_finished_req): count the prompt and the output tokens that have K/V"
        )
    if answer == events:
        return "that counts BlockStored events; count the blocks in them (len(block_hashes))"
    if answer >= bs:
        return "count blocks, not tokens"
    return (
        f"{answer} blocks is not it; how many tokens does the tree hold when the request "
        f"ends, and how many whole {bs}-token blocks is that?"
    )


Q4_SOLUTION = """\
from minirad.course import recordings, sglang_recording
from minirad.kv_events.block_events import RadixBlockEvents
from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.kv_events import BlockStored
from minirad.models import DEFAULT_MODEL_DIR

r1 = recordings.load().outputs[0]
engine = LLMEngine.from_pretrained(DEFAULT_MODEL_DIR)
publisher = RadixBlockEvents(engine.bus, block_size=32)  # no sink: it keeps the events
params = SamplingParams(max_new_tokens=62, stop_token_ids=())
engine.generate([GenerateRequest(list(r1.prompt_token_ids), [r1.request.image_path], params)])
publisher.close()
events = publisher.take_events()
answer = sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
# 4: the tree holds 98 + 62 - 1 = 159 tokens (the last output token has no K/V), 4 whole
# blocks: 3 published after the prefill, the fourth when the request finishes and the tree
# takes in its answer (vLLM publishes a block in the step that fills it)."""

q4 = Exercise(
    "q4 blocks our engine publishes",
    _check_q4,
    "RadixBlockEvents publishes every whole 32-token block of the paths the radix tree "
    "caches; the tree caches the prompt and the output tokens that have K/V.",
    Q4_SOLUTION,
)


# ----------------------------------------------------------------------------------------- q5
@functools.cache
def _sglang_session() -> sglang_recording.SGLangSession:
    return sglang_recording.load()


def _q5_lengths(overlap: bool = True, last: bool = False) -> list[int]:
    """Per recorded SGLang request, the tokens of prompt + output its tree path holds when it
    finishes (``last``: every output token, the last included)."""
    out = []
    for o in _sglang_session().outputs:
        r = o.served()
        n = len(r.prompt) + len(r.output)
        out.append(
            n
            if last
            else kv_len(len(r.prompt), len(r.output), r.max_new_tokens, r.stopped, overlap)
        )
    return out


def _check_q5(answer: object) -> str | None:
    expected = _q5_lengths()
    outputs = _sglang_session().outputs
    if not is_int_list(answer) or len(answer) != len(expected):
        return wrong_type(f"{len(expected)} ints, one per request, e.g. (0, 0, 0, 0, 0, 0)", answer)
    got = list(answer)
    if got == expected:
        return None
    if got == _q5_lengths(overlap=False):
        return (
            "that is output[:-1] for every request; under the overlap scheduler a request that "
            "stopped early was already in the next step, which fed its stop token"
        )
    if got == _q5_lengths(last=True):
        return (
            "the last token of a request that ran to max_new_tokens is sampled, never fed "
            "back: it has no KV, and the scheduler knew not to schedule another step"
        )
    if got == [len(o.prompt_token_ids) for o in outputs]:
        return "the answer enters the tree too, when the request finishes"
    if got == [e - o.cached_tokens for o, e in zip(outputs, expected, strict=True)]:
        return "count the whole path from the root, the prompt tokens it found cached included"
    i = next(i for i, (a, e) in enumerate(zip(got, expected, strict=True)) if a != e)
    o = outputs[i]
    how = "stopped on its stop token" if o.stopped else "ran to max_new_tokens"
    return (
        f"r{i + 1} is not {got[i]}: {len(o.prompt_token_ids)} prompt tokens, "
        f"{len(o.output_ids)} output tokens, and it {how}"
    )


Q5_SOLUTION = """\
from minirad.course import sglang_recording
from minirad.kvcache.cached_tokens import kv_len

answer = []
for out in sglang_recording.load().outputs:
    r = out.served()  # prompt, output, max_new_tokens, stopped
    answer.append(kv_len(len(r.prompt), len(r.output), r.max_new_tokens, r.stopped))
# [40, 38, 40, 34, 17, 32]: r1, r3 and r4 ran to 8 tokens, and their last one has no KV
# (prompt + 7); r2, r5 and r6 stopped on <|im_end|> after 3, and the overlap scheduler had
# already fed it (prompt + 3)."""

q5 = Exercise(
    "q5 what SGLang's tree takes in",
    _check_q5,
    "A token enters the tree only if the model computed its KV, that is, if it was fed to "
    "the model: each request's finish_reason says how it ended, and section 7 says which "
    "endings feed their last token.",
    Q5_SOLUTION,
)


# ------------------------------------------------------------------------------------- q6, q7
# "What is the cause of tokens a..b of request i?": small traces replayed one request at a time
# by minirad explain's replay (:func:`~minirad.kv_events.explain_trace.explain_trace`).
# q6: a radix tree in pages of 4 that never evicts; p1 shares p0's first 6 tokens.
Q6_P0 = list(range(1, 11))
Q6_TRACE = [Q6_P0, Q6_P0[:6] + [50, 51, 52, 53]]
Q6_CACHE, Q6_CAPACITY, Q6_UNIT = "radix", 64, 4
Q6_REQUEST, Q6_FIRST, Q6_LAST = 1, 4, 5
# q7: vLLM's block cache of 4 blocks of 4 tokens: a, then b (which needs room), then a again.
Q7_A, Q7_B = list(range(10, 22)), list(range(40, 52))
Q7_TRACE = [Q7_A, Q7_B, Q7_A]
Q7_CACHE, Q7_CAPACITY, Q7_UNIT = "block", 16, 4
Q7_REQUEST, Q7_FIRST, Q7_LAST = 2, 0, 3


@functools.cache
def _runs(trace: tuple, cache: str, capacity: int, unit: int) -> tuple:
    """Each request's runs, ``minirad explain``'s replay of ``trace`` (a tuple of tuples)."""
    explained = explain_trace(
        [list(p) for p in trace], cache=cache, capacity=capacity, page_size=unit, block_size=unit
    )
    return tuple(tuple(e.runs) for e in explained)


def _cause_of(trace, cache: str, capacity: int, unit: int, request: int, first: int, last: int):
    """The run that holds tokens ``first .. last`` of ``request`` (they share one cause)."""
    runs = _runs(tuple(map(tuple, trace)), cache, capacity, unit)[request]
    (run,) = [r for r in runs if r.start <= first and last < r.end]
    return run


def _check_cause(answer: object, run, why_not: dict[str, str]) -> str | None:
    """``answer`` against ``run``'s cause; ``why_not``: the reason for each other cause."""
    if not isinstance(answer, str):
        return wrong_type(f"one cause, a str among {', '.join(CAUSES)}", answer)
    if answer not in CAUSES:
        return f"{answer!r} is not one of minirad explain's causes: {', '.join(CAUSES)}"
    if answer == run.cause:
        return None
    return why_not[answer]


def _check_q6(answer: object) -> str | None:
    run = _cause_of(Q6_TRACE, Q6_CACHE, Q6_CAPACITY, Q6_UNIT, Q6_REQUEST, Q6_FIRST, Q6_LAST)
    u = Q6_UNIT
    why_not = {
        "hit": (
            f"p0 had these tokens after the same prefix, but a cache in pages of {u} serves "
            f"whole pages only: p0's page of tokens 4-7 is [5, 6, 7, 8], p1's [5, 6, 50, 51]"
        ),
        "first_seen": (
            "p0 had tokens 4 and 5 right after the same 4 tokens: p1 leaves p0 at token 6, "
            "not before"
        ),
        "evicted": f"a cache of {Q6_CAPACITY} tokens holds both prompts: nothing is evicted",
        "last_token": (
            "last_token is a page the cache held for this prompt and computed again; the cache "
            "held no page of p1's tokens 4-7"
        ),
    }
    return _check_cause(answer, run, why_not)


Q6_SOLUTION = """\
from minirad.kv_events.explain_trace import explain_trace

p0 = list(range(1, 11))
trace = [p0, p0[:6] + [50, 51, 52, 53]]
explained = explain_trace(trace, cache="radix", capacity=64, page_size=4)
answer = next(r.cause for r in explained[1].runs if r.start <= 4 and 5 < r.end)
# 'block_floor': p1 = hit 0-3 (p0's first page), block_floor 4-5, first_seen 6-9. p0 had
# tokens 4 and 5 after the same prefix, but the page that holds them (tokens 4-7) holds
# p0's 7 and 8 at 6 and 7: no page of p1's tokens 4-7 was ever cached."""

q6 = Exercise(
    "q6 the cause of a shared prefix inside a page",
    _check_q6,
    "Write the pages: p0 cached [1 2 3 4] [5 6 7 8] (its last 2 tokens fill no page). Which "
    "of them can p1's tokens 4-7 use, and did an earlier prompt have tokens 4 and 5 after "
    "tokens 0-3?",
    Q6_SOLUTION,
)


def _check_q7(answer: object) -> str | None:
    run = _cause_of(Q7_TRACE, Q7_CACHE, Q7_CAPACITY, Q7_UNIT, Q7_REQUEST, Q7_FIRST, Q7_LAST)
    why_not = {
        "evicted": (
            "that is a radix tree's answer, whose leaf goes whole; a block cache frees a "
            "request's blocks last one first into its LRU queue, so b took a's last two "
            "blocks and left its first"
        ),
        "first_seen": "request 0 was a: the same tokens, cached as 3 whole blocks",
        "last_token": (
            "a holds 12 tokens: at most (12 - 1) // 4 = 2 blocks could hit, and tokens 0-3 are "
            "in the first of them; last_token is a cached block past those, computed again"
        ),
        "block_floor": "a's 12 tokens fill 3 whole blocks: every one of them was cached",
    }
    return _check_cause(answer, run, why_not)


Q7_SOLUTION = """\
from minirad.kv_events.explain_trace import explain_trace

a, b = list(range(10, 22)), list(range(40, 52))
explained = explain_trace([a, b, a], cache="block", capacity=16, block_size=4)
answer = next(r.cause for r in explained[2].runs if r.start <= 0 and 3 < r.end)
# 'hit': b needs 3 of the 4 blocks and 1 is free, so 2 of a's are evicted. a's blocks went
# into the free queue last block first: the LRU takes blocks 2 and 1 and keeps block 0.
# The third request: hit 0-3, evicted 4-11. (A radix tree would evict a's leaf whole.)"""

q7 = Exercise(
    "q7 the cause after an eviction in blocks",
    _check_q7,
    "Follow vLLM's free queue: a finished request's blocks go to its tail in reverse order "
    "(last block first), and a new block is taken from its head, evicting what it held.",
    Q7_SOLUTION,
)
