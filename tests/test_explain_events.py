"""Why a real server's request missed, from its KV events and cached_tokens (issue 33, source
3): chapter 08's recorded vLLM session, and a scripted event stream where every cause is known
by construction, ``unknown`` included."""

from __future__ import annotations

import json

import pytest

from minirad.course import recordings
from minirad.entrypoints.cli import main
from minirad.errors import InvalidArgumentError
from minirad.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from minirad.kv_events.explain_events import (
    EVENT_CAUSES,
    BlockHistory,
    ServedRequest,
    explain_events,
    explain_recording,
    load_served,
    recording_totals,
    totals,
)
from minirad.kv_events.explain_trace import explain_trace

VLLM = recordings.RECORDINGS_DIR / "vllm_ch08"
SGLANG = recordings.RECORDINGS_DIR / "sglang_ch08"
# The session's two pictures, by their vLLM mm_hash (chapter 08 prints their first 16 digits).
IMAGE_A = "e96150181102290d9a525fac33d26f709cb150d2598a7f23f1ff45abc376818b"
IMAGE_B = "398e8ba9e76bda6e8f6b016ddd14a00cf800cf099e8f06b36647aa77d1b7f4f9"


def spans(e) -> list[tuple[int, int, str]]:
    return [(r.start, r.end, r.cause) for r in e.runs]


def check_every_token(explained, requests) -> None:
    """One label per prompt token; the hits are the server's; the causes cover the rest."""
    assert len(explained) == len(requests)
    for e, r in zip(explained, requests, strict=True):
        n = len(r.prompt_token_ids)
        assert e.num_tokens == n and e.runs[0].start == 0 and e.runs[-1].end == n
        assert all(a.end == b.start for a, b in zip(e.runs, e.runs[1:], strict=False))
        assert all(r.cause in EVENT_CAUSES and r.end > r.start for r in e.runs)
        assert e.tokens("hit") == r.cached_tokens
        assert sum(e.tokens(c) for c in EVENT_CAUSES if c != "hit") == n - r.cached_tokens


@pytest.mark.parametrize("path", [VLLM, f"{VLLM}_outputs.json", f"{VLLM}_events.jsonl"])
def test_the_recorded_vllm_session_is_explained_without_unknowns(path):
    """Chapter 08 on the real vLLM (blocks of 32, 64 placeholders per image, no eviction):
    0 is new; 1 hits the system prompt and image A (two blocks), then leaves request 0 at its
    question (block 2 was stored with request 0's question: block_floor up to there); 2 has
    image B: request 0's tokens but other hashes (the image's extra key), so it is new from
    the image on; 3 is 1 for B; 4 repeats 0 (or 2: the same token ids, two chains; both give
    the same labels): 3 blocks hit, the 2-token tail was never a full block; 5 has no system
    prompt and shares only the first token."""
    requests, batches = load_served(path)
    explained = explain_recording(path)
    check_every_token(explained, requests)
    assert [spans(e) for e in explained] == [
        [(0, 98, "first_seen")],
        [(0, 64, "hit"), (64, 89, "block_floor"), (89, 100, "first_seen")],
        [(0, 24, "block_floor"), (24, 98, "first_seen")],
        [(0, 64, "hit"), (64, 89, "block_floor"), (89, 100, "first_seen")],
        [(0, 96, "hit"), (96, 98, "block_floor")],
        [(0, 1, "block_floor"), (1, 79, "first_seen")],
    ]
    # r3 forks from r1 at picture B: the same placeholder id, another image (its mm_hash).
    assert explained[2].runs[1].detail == {
        "at": 24,
        "token": 3,
        "seen_next": [3],
        "image": True,
        "image_hash": IMAGE_B,
        "seen_next_images": [IMAGE_A],
    }
    assert recording_totals(path) == {
        "hit": 224,
        "last_token": 0,
        "evicted": 0,
        "block_floor": 77,
        "first_seen": 272,
        "unknown": 0,
    }


def test_the_events_agree_with_an_offline_replay_of_the_same_prompts():
    """The same prompts through our block cache, each image's placeholders as one pad id per
    picture (the file name): the same hits as vLLM's, the same labels as from its events."""
    session = recordings.load()
    placeholders = BlockHistory(session.batches).placeholders
    assert placeholders == {3}
    pads = {}
    keyed = [
        [
            pads.setdefault(o.request.image, 100_000 + len(pads)) if t in placeholders else t
            for t in o.prompt_token_ids
        ]
        for o in session.outputs
    ]
    replay = explain_trace(keyed, cache="block", capacity=4096, block_size=32)
    assert [e.tokens("hit") for e in replay] == [o.cached_tokens for o in session.outputs]
    assert [spans(e) for e in replay] == [spans(e) for e in explain_recording(VLLM)]


def test_the_recorded_sglang_session_has_a_last_token():
    """SGLang's radix tree as blocks of 1: request 2 repeats request 0 whole, and the last
    token is recomputed."""
    requests, _ = load_served(SGLANG)
    explained = explain_recording(SGLANG)
    check_every_token(explained, requests)
    assert spans(explained[2]) == [(0, 32, "hit"), (32, 33, "last_token")]
    assert totals(explained) == {
        "hit": 79,
        "last_token": 1,
        "evicted": 0,
        "block_floor": 0,
        "first_seen": 91,
        "unknown": 0,
    }


# A scripted server with blocks of 4. Hashes are made up: only their equality matters.
A = tuple(range(100, 110))  # 10 tokens: two blocks and a tail of 2
A2 = (*A, 110, 111)  # three blocks
B = tuple(range(200, 209))  # 9 tokens: two blocks and a tail of 1
D = (300, 301, 302, 303, 304)
IMG = (1, 9, 9, 9, 9, 9, 9, 2, 5)  # an image of 6 placeholders (id 9) at 1: blocks 0 and 1
T = (7, 7, 7, 7, 8, 9, 9)  # an image of 2 at 5, in the tail: never in a full block


def stored(hashes, parent, tokens, extra_keys=None):
    return BlockStored(list(hashes), parent, list(tokens), 4, extra_keys=extra_keys)


def image_blocks(first, mm_hash, tokens):
    keys = [[[mm_hash, 1]], [[mm_hash, -3]]]
    return stored([first, first + 1], None, tokens[:8], keys)


def scripted():
    """``(requests, batches, expected spans)``: one request at a time, its events after it."""
    script = [  # (prompt, cached_tokens, events after it (None: no batch), expected spans)
        (A, 0, [stored([0xA0, 0xA1], None, A[:8])], [(0, 10, "first_seen")]),
        (A[:8], 4, None, [(0, 4, "hit"), (4, 8, "last_token")]),
        (
            A2,
            8,
            [stored([0xA2], 0xA1, A2[8:])],
            [(0, 8, "hit"), (8, 10, "block_floor"), (10, 12, "first_seen")],
        ),
        (A, 4, None, [(0, 4, "hit"), (4, 8, "evicted"), (8, 10, "block_floor")]),
        (B, 0, [stored([0xB0, 0xB1], None, B[:8])], [(0, 9, "first_seen")]),
        # the server counts nothing, the events say B's two blocks are there
        (B, 0, None, [(0, 8, "unknown"), (8, 9, "block_floor")]),
        # the server counts a block the events never stored
        (D, 4, [stored([0xD0], None, D[:4])], [(0, 4, "hit"), (4, 5, "first_seen")]),
        (B, 0, None, [(0, 8, "evicted"), (8, 9, "block_floor")]),
        (IMG, 0, [image_blocks(0x10, "X", IMG)], [(0, 9, "first_seen")]),
        (IMG, 0, [image_blocks(0x20, "Y", IMG)], [(0, 1, "block_floor"), (1, 9, "first_seen")]),
        # stored nothing: picture X or Y, both fully cached; the labels agree
        (IMG, 8, None, [(0, 8, "hit"), (8, 9, "block_floor")]),
        # stored nothing and hit nothing: neither X nor Y, so new from the image on
        (IMG, 0, None, [(0, 1, "block_floor"), (1, 9, "first_seen")]),
        (T, 0, [stored([0x70], None, T[:4])], [(0, 7, "first_seen")]),
        # the tail's image: no event names either picture, so the same one or not is unknown
        (T, 4, None, [(0, 4, "hit"), (4, 5, "block_floor"), (5, 7, "unknown")]),
    ]
    batches, requests, expected = [], [], []
    for prompt, cached, events, want in script:
        requests.append(ServedRequest(prompt, cached))
        expected.append(want)
        if events is not None:
            batches.append((len(batches), KVEventBatch(float(len(batches)), events)))
        if prompt == A2:  # after request 2: A's second block is evicted
            batches.append((len(batches), KVEventBatch(100.5, [BlockRemoved([0xA1])])))
        if prompt == D:  # after request 6: the whole cache is cleared
            batches.append((len(batches), KVEventBatch(200.5, [AllBlocksCleared()])))
    return requests, batches, expected


def test_every_cause_on_a_scripted_event_stream():
    """Each request's labels, known by construction. Requests 3 and 7 stored nothing: the
    removal (the clear) before them may have come before or after them; the side that explains
    their cached_tokens is the one taken."""
    requests, batches, expected = scripted()
    explained = explain_events(requests, batches)
    check_every_token(explained, requests)
    assert [spans(e) for e in explained] == expected
    assert explained[3].runs[1].detail == {"seq": 2, "ts": 100.5}
    assert explained[5].runs[0].detail == {"why": "cached by the events, not counted by the server"}
    assert explained[6].runs[0].detail == {"events_support": 0}
    assert explained[7].runs[0].detail == {"seq": 5, "ts": 200.5, "cleared": True}
    # picture Y where request 8 had X: the same placeholder id (9), the images by mm_hash;
    # request 11 stored nothing, so the events do not name its picture (neither X nor Y)
    assert explained[9].runs[1].detail == {
        "at": 1,
        "token": 9,
        "seen_next": [9],
        "image": True,
        "image_hash": "Y",
        "seen_next_images": ["X"],
    }
    assert "image_hash" not in explained[11].runs[1].detail
    assert explained[11].runs[1].detail["seen_next_images"] == ["X", "Y"]
    assert explained[13].runs[2].detail == {"one_of": ["block_floor", "first_seen"]}
    assert totals(explained) == {
        "hit": 32,
        "last_token": 4,
        "evicted": 12,
        "block_floor": 10,
        "first_seen": 54,
        "unknown": 10,
    }


def test_a_removal_on_either_side_of_a_request_is_not_guessed():
    """Request 1 (A's two blocks, 4 cached) stored nothing, and the removal of A's second block
    may have come before it (evicted) or after it (the last-token rule): both explain its 4
    hits, so those 4 tokens are unknown. Told that the removal came after it, they are
    last_token; told before, evicted."""
    batches = [
        (0, KVEventBatch(0.0, [stored([0xA0, 0xA1], None, A[:8])])),
        (1, KVEventBatch(1.0, [BlockRemoved([0xA1])])),
    ]
    requests = [ServedRequest(A, 0), ServedRequest(A[:8], 4)]
    e = explain_events(requests, batches)[1]
    assert spans(e) == [(0, 4, "hit"), (4, 8, "unknown")]
    assert e.runs[1].detail == {"one_of": ["evicted", "last_token"]}
    requests[1] = ServedRequest(A[:8], 4, events_before=2)
    assert spans(explain_events(requests, batches)[1])[1] == (4, 8, "evicted")
    e = explain_events(requests[:1] + [ServedRequest(A[:8], 4)], batches[:1])[1]
    assert spans(e)[1] == (4, 8, "last_token")


def test_bad_requests_are_refused():
    with pytest.raises(InvalidArgumentError, match="empty prompt"):
        explain_events([ServedRequest((), 0)], [])
    with pytest.raises(InvalidArgumentError, match="cached_tokens 5"):
        explain_events([ServedRequest((1, 2), 5)], [])
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        load_served("/nonexistent/session")


def test_minirad_explain_from_a_recording(capsys):
    """Issue 43: requests are r1..r6 as chapter 08 names them (JSON keeps "request" from 0
    and adds the "label"), and r3's fork at its picture names the two pictures by hash, not
    by their placeholder id (3 on both sides, which read as the same token)."""
    assert main(["explain", "--from-recording", str(VLLM)]) == 0
    out = capsys.readouterr().out
    assert "6 requests, 573 prompt tokens" in out
    assert "unknown" in out
    assert (
        "  r3: 98 missed: tokens 0-23 block_floor, tokens 24-97 first_seen "
        f"(image {IMAGE_B[:12]} where earlier prompts had image {IMAGE_A[:12]})\n"
    ) in out
    assert (
        "  r6: 79 missed: token 0 block_floor, tokens 1-78 first_seen "
        "(token id 432 where earlier prompts had token id 614)\n"
    ) in out
    assert "request 0" not in out and "r0" not in out
    assert main(["explain", "--from-recording", str(VLLM), "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["request"] for x in lines] == list(range(6))
    assert [x["label"] for x in lines] == [f"r{i}" for i in range(1, 7)]
    assert list(lines[0]) == ["request", "label", "num_tokens", "runs"]
    assert main(["explain"]) == 2
    assert "one of them" in capsys.readouterr().err


def test_blocks_with_a_requests_tokens_may_be_a_later_requests():
    """Request 2 (picture X again: 8 hits) stored nothing; the next batch has its token ids
    but belongs to request 3 (picture Z): read as request 2's, it would not explain the hits."""
    batches = [
        (k, KVEventBatch(float(k), [image_blocks(0x10 * (k + 1), mm, IMG)]))
        for k, mm in enumerate(["X", "Y", "Z"])
    ]
    requests = [ServedRequest(IMG, c) for c in (0, 0, 8, 0)]
    explained = explain_events(requests, batches)
    check_every_token(explained, requests)
    assert [spans(e) for e in explained] == [
        [(0, 9, "first_seen")],
        [(0, 1, "block_floor"), (1, 9, "first_seen")],
        [(0, 8, "hit"), (8, 9, "block_floor")],
        [(0, 1, "block_floor"), (1, 9, "first_seen")],
    ]
