"""Chapter 08 exercises, held to the shared contract of ``exercise_contract.py``: the
oracle's answer passes, near misses fail, typical mistakes get their reason, the stub is
"not attempted", and the printed solution computes the answer.

``minirad.exercises.ch08`` computes its answers with our ``KVCacheManager`` (vLLM's design)
and our engine. The oracles use no minirad class: q1 and q4 are the block arithmetic of the
chapter; q2 replays the recorded requests with prefix arithmetic (each placeholder marked
with its image's pixels, a request reuses its longest common prefix with what an earlier
request computed, at most all but its last prompt token, whole blocks only), which
reproduces the real vLLM's recorded hits at 32 tokens per block; q3 reads vLLM's own block
hashes off the recorded ``BlockStored`` events; q5 reads the paths of the real SGLang's radix
tree off its recorded events: how much of each request's prompt + output the tree held once the
request was done. q6 and q7 (the cause of a few tokens of a small trace, which ``ch08`` asks
``minirad explain``'s replay) are prefix arithmetic on pages, and a hand-written block table
and free queue for vLLM's design.
"""

from __future__ import annotations

import functools

from exercise_contract import ExerciseContract, common_len
from PIL import Image
from transformers import AutoConfig

from minirad.course import recordings, sglang_recording
from minirad.exercises import ch08
from minirad.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from minirad.kv_events.block_events import VLLM_BLOCK_SIZE
from minirad.models import DEFAULT_MODEL_DIR


@functools.cache
def image_token_id() -> int:
    return AutoConfig.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True).image_token_id


@functools.cache
def session() -> recordings.Session:
    return recordings.load()


@functools.cache
def pixels(path) -> bytes:
    with Image.open(path) as image:
        return image.convert("RGB").tobytes()


def key(out: recordings.RecordedOutput, images: bool = True) -> list:
    """The prompt's token ids, each placeholder replaced by (its image's pixels, its index)."""
    if not images:
        return list(out.prompt_token_ids)
    image, placeholder = pixels(out.request.image_path), image_token_id()
    return [(image, i) if t == placeholder else t for i, t in enumerate(out.prompt_token_ids)]


def prefix_hits(block_size: int, images: bool = True, whole_blocks: bool = True) -> list[int]:
    """Each recorded request's reused prompt tokens, by prefix arithmetic (no eviction)."""
    computed: list[list] = []  # per earlier request: its prompt and all but its last output
    hits = []
    for out in session().outputs:
        prompt = key(out, images)
        shared = max((common_len(prompt, c) for c in computed), default=0)
        shared = min(shared, len(prompt) - 1)
        hits.append(shared // block_size * block_size if whole_blocks else shared)
        computed.append(prompt + list(out.token_ids[:-1]))
    return hits


def oracle_q1() -> int:
    return (ch08.Q1_PROMPT_LEN - 1) // ch08.Q1_BLOCK_SIZE * ch08.Q1_BLOCK_SIZE


def oracle_q2() -> list[int]:
    return prefix_hits(ch08.Q2_BLOCK_SIZE)


def vllm_block0_hashes() -> list[int]:
    """vLLM's hash of each recorded request's block 0: the first block of a stored chain
    (no parent) with the request's first token ids and its image's hash in ``extra_keys``."""
    outputs = session().outputs
    bs = ch08.Q3_BLOCK_SIZE
    mm_hash = {o.request.image: o.mm_hash for o in outputs if o.mm_hash}
    first = [
        e
        for _, batch in session().batches
        for e in batch.events
        if isinstance(e, BlockStored) and e.parent_block_hash is None
    ]
    hashes = []
    for out in outputs:
        (block,) = [
            e
            for e in first
            if tuple(e.token_ids[:bs]) == out.prompt_token_ids[:bs]
            and mm_hash[out.request.image] in {k[0] for k in e.extra_keys[0] or ()}
        ]
        hashes.append(block.block_hashes[0])
    return hashes


def oracle_q3() -> set[int]:
    outputs, hashes, bs = session().outputs, vllm_block0_hashes(), ch08.Q3_BLOCK_SIZE
    r1 = outputs[0].prompt_token_ids[:bs]
    return {
        i
        for i, (out, h) in enumerate(zip(outputs, hashes, strict=True), 1)
        if out.prompt_token_ids[:bs] == r1 and h != hashes[0]
    }


def oracle_q4() -> int:
    prompt_len = len(session().outputs[0].prompt_token_ids)
    # The last output token is sampled, never fed back: the tree holds all tokens but it.
    return (prompt_len + ch08.Q4_OUTPUT_LEN - 1) // ch08.Q4_BLOCK_SIZE


@functools.cache
def sglang_session() -> sglang_recording.SGLangSession:
    return sglang_recording.load()


def sglang_paths(up_to_seq: int) -> set[tuple[int, ...]]:
    """The token paths from the root that SGLang's tree held after batch ``up_to_seq``, read
    off its events (page size 1: one hash per token, chained by ``parent_block_hash``)."""
    path: dict[int, tuple[int, ...]] = {}
    for seq, batch in sglang_session().batches:
        if seq > up_to_seq:
            break
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                path.clear()
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    path.pop(h, None)
            elif isinstance(e, BlockStored):
                before = path[e.parent_block_hash] if e.parent_block_hash is not None else ()
                for h, token in zip(e.block_hashes, e.token_ids, strict=True):
                    before = path[h] = (*before, token)
    return set(path.values())


def oracle_q5() -> list[int]:
    held = []
    for out in sglang_session().outputs:
        tokens, paths = (*out.prompt_token_ids, *out.output_ids), sglang_paths(out.last_seq)
        held.append(max(n for n in range(len(tokens) + 1) if n == 0 or tokens[:n] in paths))
    return held


def cause_at(t: int, hit: int, cached: int, ever: int, seen: int) -> str:
    """Token ``t``'s cause from four prefix lengths: served, held by the cache at admission
    (the recomputed last page or block included), ever cached in whole units, ever seen."""
    for cause, end in (
        ("hit", hit),
        ("last_token", cached),
        ("evicted", ever),
        ("block_floor", seen),
    ):
        if t < end:
            return cause
    return "first_seen"


def oracle_q6() -> str:
    """A radix tree that never evicts, by prefix arithmetic: it holds, of each earlier
    prompt, its whole pages; a request is served what it holds, at most its length less one,
    in whole pages."""
    trace, u, i = ch08.Q6_TRACE, ch08.Q6_UNIT, ch08.Q6_REQUEST
    prompt, earlier = trace[i], trace[:i]
    seen = max((common_len(prompt, q) for q in earlier), default=0)
    ever = max((common_len(prompt, q) // u * u for q in earlier), default=0)
    hit = min(ever, (len(prompt) - 1) // u * u)
    causes = {cause_at(t, hit, ever, ever, seen) for t in range(ch08.Q6_FIRST, ch08.Q6_LAST + 1)}
    (cause,) = causes
    return cause


def oracle_q7() -> str:
    """vLLM's block cache by hand: blocks named by their prefix, a free queue of block ids (a
    finished request's blocks go to its tail last block first; a new block comes from its
    head, and what the block held is no longer cached)."""
    trace, bs, i = ch08.Q7_TRACE, ch08.Q7_UNIT, ch08.Q7_REQUEST
    free = list(range(ch08.Q7_CAPACITY // bs))
    holds: dict[int, tuple] = {}  # block id -> the prefix its last token ends
    ever: set[tuple] = set()  # every prefix ever cached as a block
    for j, prompt in enumerate(trace):
        keys = [tuple(prompt[: (k + 1) * bs]) for k in range(len(prompt) // bs)]
        where = {key: b for b, key in holds.items()}
        cached = 0
        while cached < len(keys) and keys[cached] in where:
            cached += 1
        hit = min(cached, (len(prompt) - 1) // bs)
        if j == i:
            was = 0
            while was < len(keys) and keys[was] in ever:
                was += 1
            seen = max((common_len(prompt, q) for q in trace[:i]), default=0)
            span = range(ch08.Q7_FIRST, ch08.Q7_LAST + 1)
            (cause,) = {cause_at(t, hit * bs, cached * bs, was * bs, seen) for t in span}
            return cause
        table = [where[k] for k in keys[:hit]]
        for b in table:
            free.remove(b)
        for key in keys[hit:] + [None] * (-(-len(prompt) // bs) - len(keys)):
            b = free.pop(0)
            holds.pop(b, None)
            if key is not None:
                holds[b] = key
                ever.add(key)
            table.append(b)
        free += table[::-1]
    raise AssertionError("the request is not in the trace")


CASES = [
    (ch08.q1, oracle_q1, ch08.Q1_SOLUTION),
    (ch08.q2, oracle_q2, ch08.Q2_SOLUTION),
    (ch08.q3, oracle_q3, ch08.Q3_SOLUTION),
    (ch08.q4, oracle_q4, ch08.Q4_SOLUTION),
    (ch08.q5, oracle_q5, ch08.Q5_SOLUTION),
    (ch08.q6, oracle_q6, ch08.Q6_SOLUTION),
    (ch08.q7, oracle_q7, ch08.Q7_SOLUTION),
]


def _q2_with(i: int, value: int) -> list[int]:
    hits = oracle_q2()
    hits[i] = value
    return hits


def _q5_with(i: int, value: int) -> list[int]:
    held = oracle_q5()
    held[i] = value
    return held


@functools.cache
def diagnosed() -> list:
    """Typical mistakes, and a word of the reason the learner must see (computed at test
    time: they read the recording)."""
    n, bs = ch08.Q1_PROMPT_LEN, ch08.Q1_BLOCK_SIZE
    prompt_len = len(session().outputs[0].prompt_token_ids)
    sglang = sglang_session().outputs
    lengths = [(o, len(o.prompt_token_ids) + len(o.output_ids)) for o in sglang]
    return [
        (ch08.q1, n // bs * bs, "last prompt token"),
        (ch08.q1, n - 1, "radix tree"),
        (ch08.q1, oracle_q1() // bs, "counts blocks"),
        (ch08.q1, 0, "still there"),
        (ch08.q2, [o.cached_tokens for o in session().outputs], "32 tokens per block"),
        (ch08.q2, prefix_hits(ch08.Q2_BLOCK_SIZE, images=False), "extra_keys"),
        (ch08.q2, prefix_hits(ch08.Q2_BLOCK_SIZE, whole_blocks=False), "whole blocks only"),
        (ch08.q2, _q2_with(2, 0), "text only"),
        (ch08.q2, _q2_with(1, 96), "where its prompt parts"),
        (
            ch08.q2,
            (0, 0, 0),
            "expected 6 ints, one per request, e.g. (0, 0, 0, 0, 0, 0), got tuple",
        ),
        (ch08.q3, {3}, "published no block 0"),
        (ch08.q3, {4}, "which image"),
        (ch08.q3, {3, 4, 6}, "first 32 token ids"),
        (ch08.q3, {2, 3, 4, 5}, "does not depend on the request"),
        (ch08.q3, {1, 3, 4}, "compared with"),
        (ch08.q3, {3, 7}, "no 7"),
        (ch08.q3, 3, "expected a set of request numbers, e.g. {2, 5}, got int 3"),
        (ch08.q4, (prompt_len + ch08.Q4_OUTPUT_LEN) // ch08.Q4_BLOCK_SIZE, "never fed back"),
        (ch08.q4, prompt_len // ch08.Q4_BLOCK_SIZE, "cache_finished_req"),
        (ch08.q4, 2, "BlockStored events"),  # one after the prefill, one as the request ends
        (ch08.q4, prompt_len + ch08.Q4_OUTPUT_LEN - 1, "not tokens"),
        (ch08.q5, [len(o.prompt_token_ids) for o in sglang], "answer enters the tree"),
        (ch08.q5, [n - 1 for _, n in lengths], "overlap scheduler"),
        (ch08.q5, [n for _, n in lengths], "never fed back"),
        (ch08.q5, _q5_with(5, 31), "r6 is not 31"),
        (
            ch08.q5,
            [h - o.cached_tokens for o, h in zip(sglang, oracle_q5(), strict=True)],
            "whole path",
        ),
        (ch08.q6, "hit", "whole pages only"),
        (ch08.q6, "first_seen", "leaves p0 at token 6"),
        (ch08.q6, "evicted", "nothing is evicted"),
        (ch08.q6, "last_token", "no page of p1's tokens 4-7"),
        (ch08.q6, "hits", "not one of minirad explain's causes"),
        (ch08.q6, 8, "expected one cause, a str among hit"),
        (ch08.q7, "evicted", "last one first"),
        (ch08.q7, "first_seen", "request 0 was a"),
        (ch08.q7, "last_token", "tokens 0-3 are in the first"),
        (ch08.q7, "block_floor", "3 whole blocks"),
    ]


class TestExerciseContract(ExerciseContract):
    chapter = ch08
    cases = CASES
    diagnosed = diagnosed


def test_q2_oracle_reproduces_the_recorded_vllm_hits():
    """The prefix arithmetic of q2's oracle, at vLLM's block size, gives what the real vLLM
    reported for each request of the recording."""
    assert prefix_hits(VLLM_BLOCK_SIZE) == [o.cached_tokens for o in session().outputs]


def test_q3_oracle_sees_two_block0_hashes_for_the_same_tokens():
    """r1 to r5 start with the same 32 token ids; vLLM gave their block 0 two hashes (one
    per picture), r6's block 0 a third."""
    hashes = vllm_block0_hashes()
    assert len(set(hashes[:5])) == 2 and hashes[5] not in hashes[:5]


def test_lists_are_accepted_for_tuples_and_sets():
    assert ch08.q2.is_correct(tuple(oracle_q2()))
    assert ch08.q3.is_correct(sorted(oracle_q3()))


def test_q5_oracle_sees_the_stop_tokens_sglang_cached():
    """SGLang's tree held every output token of the requests that stopped early (r2, r5, r6:
    the overlap scheduler fed the stop token) and all but the last of those that ran to
    max_new_tokens (r1, r3, r4)."""
    sglang = sglang_session().outputs
    assert [o.stopped for o in sglang] == [False, True, False, False, True, True]
    for o, held in zip(sglang, oracle_q5(), strict=True):
        assert held == len(o.prompt_token_ids) + len(o.output_ids) - (not o.stopped)


def test_the_cause_exercises_ask_about_their_traces_last_request():
    """Replayed one request at a time, what comes after the asked request cannot change its
    cause: a trace that goes on only gives the learner more to read (q6 once had a p2)."""
    for trace, request in ((ch08.Q6_TRACE, ch08.Q6_REQUEST), (ch08.Q7_TRACE, ch08.Q7_REQUEST)):
        assert request == len(trace) - 1
