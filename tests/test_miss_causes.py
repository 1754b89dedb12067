"""Why each request missed (issue 33): every prompt token's cause, on scripted traces whose
causes are known by construction, on both cache designs, and on random traces against an oracle
that knows only the prompts (longest common prefixes) and the page or block size."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minirad.entrypoints.cli import main
from minirad.errors import InvalidArgumentError
from minirad.kv_events.explain_trace import explain_trace, totals
from minirad.kv_events.miss_causes import CAUSES

A = list(range(100, 120))  # 20 tokens: five pages or blocks of 4
X = list(range(200, 206))
B = list(range(300, 330))  # 30 tokens: the whole cache of 32 (eight pages or blocks)
TRACE = [A, A, A[:12] + X, B, A, B]


def spans(e) -> list[tuple[int, int, str]]:
    return [(r.start, r.end, r.cause) for r in e.runs]


@pytest.mark.parametrize("cache", ["radix", "block"])
def test_every_cause_on_a_scripted_trace(cache):
    """Request by request, with a cache of 32 tokens in pages (blocks) of 4:
    0: A is new. 1: A again: 16 served, its last page recomputed (a hit stops at len - 1).
    2: A's first 12 tokens, then X: new from token 12, where A had 112.
    3: B fills the whole cache: everything else is evicted, B is new.
    4: A again: evicted by request 3.
    5: B again: the radix tree lost all of B to request 4 (B's one leaf); the block cache lost
       only the blocks request 4 took (B's tail first), and never had B's 2-token tail."""
    ex = explain_trace(TRACE, cache=cache, capacity=32, page_size=4, block_size=4)
    assert spans(ex[0]) == [(0, 20, "first_seen")]
    assert spans(ex[1]) == [(0, 16, "hit"), (16, 20, "last_token")]
    assert spans(ex[2]) == [(0, 12, "hit"), (12, 18, "first_seen")]
    assert ex[2].runs[1].detail == {"at": 12, "token": 200, "seen_next": [112]}
    assert spans(ex[3]) == [(0, 30, "first_seen")]
    assert spans(ex[4]) == [(0, 20, "evicted")]
    assert ex[4].runs[0].detail["by_request"] == 3 and ex[4].runs[0].detail["policy"] == "lru"
    if cache == "radix":
        assert spans(ex[5]) == [(0, 28, "evicted"), (28, 30, "block_floor")]
        evicted = ex[5].runs[0]
    else:
        assert spans(ex[5]) == [(0, 12, "hit"), (12, 28, "evicted"), (28, 30, "block_floor")]
        evicted = ex[5].runs[1]
    assert evicted.detail["by_request"] == 4
    assert all(totals(ex)[c] > 0 for c in CAUSES)


def test_an_image_fork_is_named_in_the_detail():
    """Pad ids (one per image, :func:`pad_value`: the vocabulary size plus the whole digest)
    are shown by their hash's first hex digits, never as 77-digit numbers."""
    from minirad.kvcache.multimodal import pad_value

    vocab = 1000
    h1, h2 = "ab" * 32, "cd" * 32
    img1, img2 = [pad_value(h1, vocab)] * 8, [pad_value(h2, vocab)] * 8
    ex = explain_trace([[1, 2, *img1, 3], [1, 2, *img2, 3]], vocab_size=vocab)
    (hit, new) = ex[1].runs
    assert (hit.cause, hit.end, new.cause) == ("hit", 2, "first_seen")
    assert new.detail == {
        "at": 2,
        "token": "image cdcdcdcdcdcd",
        "seen_next": ["image abababababab"],
    }


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


prompts = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=24), min_size=1, max_size=14)


@settings(max_examples=150, deadline=None)
@given(trace=prompts, cache=st.sampled_from(["radix", "block"]), unit=st.sampled_from([1, 2, 4]))
def test_runs_agree_with_an_oracle_of_prefixes(trace, cache, unit):
    """Whatever the cache holds now (hit, and cached with the last page): evicted is what an
    earlier prompt got cached after this prefix (whole units of its length) and is gone;
    block_floor what an earlier prompt had but no unit of it was cached; first_seen the
    rest, after the longest prefix any earlier prompt shares."""
    ex = explain_trace(trace, cache=cache, capacity=64, page_size=unit, block_size=unit)
    for i, (p, e) in enumerate(zip(trace, ex, strict=True)):
        assert (
            [(r.start, r.end) for r in e.runs] == [(a.start, a.end) for a in e.runs]
            and e.runs[0].start == 0
            and e.runs[-1].end == len(p)
        )
        assert all(a.end == b.start for a, b in zip(e.runs, e.runs[1:], strict=False))
        seen = max((lcp(p, q) for q in trace[:i]), default=0)
        ever = max((min(lcp(p, q) // unit, len(q) // unit) * unit for q in trace[:i]), default=0)
        hit, cached = e.tokens("hit"), e.tokens("hit") + e.tokens("last_token")
        assert e.tokens("first_seen") == len(p) - max(seen, cached)
        assert e.tokens("block_floor") == max(seen, cached) - max(ever, cached)
        assert e.tokens("evicted") == max(ever, cached) - cached
        assert hit <= cached <= max(ever, cached)


def test_minirad_explain_prints_totals_and_json_lines(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in TRACE))
    args = ["explain", str(trace), "--capacity", "32", "--page-size", "4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for cause in CAUSES:
        assert cause in out
    # Requests are r1..r6 (issue 43), the evicting request too; a fork names both tokens.
    assert "  r5: 20 missed: tokens 0-19 evicted (by r4 at tick " in out
    assert (
        "  r3: 6 missed: tokens 12-17 first_seen "
        "(token id 200 where earlier prompts had token id 112)"
    ) in out
    assert "request 4" not in out and "r0" not in out
    assert "Belady's MIN (the best any eviction could do), same order and capacity" in out
    served = re.search(r"of the 48 evicted tokens, MIN would have served (\d+)", out)
    assert served and int(served[1]) <= 48  # 20 of request 4 and 28 of request 5
    assert main([*args, "--cache", "block", "--block-size", "4", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["request"] for x in lines] == list(range(len(TRACE)))  # from 0, as before
    assert [x["label"] for x in lines] == [f"r{i + 1}" for i in range(len(TRACE))]
    assert lines[5]["runs"][-1] == {"start": 28, "end": 30, "cause": "block_floor", "detail": {}}


def test_a_fork_at_an_image_names_both_images():
    """Issue 43: "(token 3, an image where earlier prompts had [3])" read as one token; an
    image is named by its hash's first digits on both sides (a replay with a vocabulary names
    images so in the detail; a real server's events give its mm_hash)."""
    from minirad.entrypoints.explain import format_report
    from minirad.kv_events.explain_trace import ExplainedRequest
    from minirad.kv_events.miss_causes import Run

    replay = {"at": 5, "token": "image 0123456789ab", "seen_next": ["image ba9876543210", 7]}
    events = {
        "at": 5,
        "token": 3,
        "image": True,
        "seen_next": [3],
        "image_hash": "0123456789abcdef" * 4,
        "seen_next_images": ["ba9876543210fedc" * 4, "ffffffffffff0000" * 4],
    }
    unnamed = {"at": 5, "token": 3, "image": True, "seen_next": [3]}
    explained = [
        ExplainedRequest(i, 9, [Run(0, 5, "hit"), Run(5, 9, "first_seen", d)])
        for i, d in enumerate([replay, events, unnamed])
    ]
    report = format_report(explained, totals(explained))
    assert (
        "  r1: 4 missed: tokens 5-8 first_seen "
        "(image 0123456789ab where earlier prompts had image ba9876543210 or token id 7)"
    ) in report
    assert (
        "  r2: 4 missed: tokens 5-8 first_seen (image 0123456789ab where earlier prompts had "
        "image ba9876543210 or image ffffffffffff)"
    ) in report
    assert (
        "  r3: 4 missed: tokens 5-8 first_seen (token id 3, an image the events do not name, "
        "where earlier prompts had token id 3)"
    ) in report


def test_chat_lines_use_the_models_template_and_images(tmp_path, capsys):
    """Two chats about the same picture, by path and as a data URL: the second hits the
    first's template, picture and question up to the new words."""
    import base64
    import shutil

    from minirad.models import DEFAULT_MODEL_DIR

    picture = DEFAULT_MODEL_DIR.parents[1] / "images" / "orange_square.png"
    shutil.copy(picture, tmp_path / "p.png")
    url = "data:image/png;base64," + base64.b64encode(picture.read_bytes()).decode()

    def chat(image: str, text: str) -> dict:
        parts = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": text}]
        return {"messages": [{"role": "user", "content": parts}]}

    lines = [chat("p.png", "What colour is the square?"), chat(url, "What colour is it?")]
    trace = tmp_path / "chat.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["explain", str(trace), "--json"]) == 0
    first, second = (json.loads(x) for x in capsys.readouterr().out.splitlines())
    assert [r["cause"] for r in first["runs"]] == ["first_seen"]
    assert [r["cause"] for r in second["runs"]] == ["hit", "first_seen"]
    assert second["runs"][0]["end"] > 64  # the template and the picture's 64 placeholders


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ('{"prompt_token_ids": []}', "non-empty list"),
        ('{"prompt_token_ids": [1, -2]}', "non-empty list"),
        ('{"prompt": "text"}', "needs 'prompt_token_ids'"),
    ],
)
def test_bad_trace_lines_are_one_line_errors(tmp_path, capsys, line, message):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(line + "\n")
    assert main(["explain", str(trace)]) == 2
    err = capsys.readouterr().err
    assert message in err and f"{trace}:1" in err


def test_a_prompt_longer_than_the_cache_is_refused():
    with pytest.raises(InvalidArgumentError, match="do not fit"):
        explain_trace([list(range(40))], capacity=32)


def test_min_says_whether_an_eviction_could_have_been_avoided():
    """Request 3 (B) fills the cache; request 4 (A) then misses what request 3 evicted. MIN
    has the same capacity: B needs the whole cache too, so A is lost under MIN as well."""
    from minirad.kv_events.explain_trace import optimal

    mins = optimal(TRACE, 32, 4)
    assert mins.request_hit_tokens[4] == 0  # B evicts A under any policy
    ex = explain_trace(TRACE, capacity=32, page_size=4, min_hits=mins.request_hit_tokens)
    assert ex[4].runs[0].detail["min_kept"] == 0
    # A, then B, fill the cache; C needs two pages: LRU evicts A (the older), MIN evicts B
    # (never used again) and keeps A for request 3.
    trace = [A, B[:20], list(range(400, 408)), A]
    mins = optimal(trace, 40, 4)
    ex = explain_trace(trace, capacity=40, page_size=4, min_hits=mins.request_hit_tokens)
    assert spans(ex[3]) == [(0, 20, "evicted")]
    assert ex[3].runs[0].detail["by_request"] == 2
    assert ex[3].runs[0].detail["min_kept"] == 16  # all it could serve: 19 tokens, pages of 4
    assert mins.request_hit_tokens[3] == 16


def test_a_huge_capacity_costs_nothing_and_a_page_larger_than_it_is_named():
    """Found by the hostile pass: --capacity 10**9 allocated a billion simulated slots."""
    ex = explain_trace([[1, 2, 3], [1, 2, 3]], capacity=10**9)
    assert [r.cause for r in ex[1].runs] == ["hit", "last_token"]
    with pytest.raises(InvalidArgumentError, match="page_size 8 is larger than the capacity 4"):
        explain_trace([[1, 2, 3]], capacity=4, page_size=8)


def test_a_fifo_or_a_network_image_is_a_one_line_error(tmp_path, capsys):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert main(["explain", str(fifo)]) == 2
    assert "not a regular file" in capsys.readouterr().err
    parts = [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"messages": [{"role": "user", "content": parts}]}) + "\n")
    assert main(["explain", str(trace)]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:1" in err and "fetches no images over the network" in err
