"""The miss strip (issue 33): a request's prompt coloured by cause, the trace's totals."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from minirad.kv_events.explain_trace import explain_trace, optimal, totals
from viz.miss_strip import CAUSE_COLORS, miss_strip_svg

A = list(range(100, 120))
B = list(range(300, 330))
TRACE = [A, A, A[:12] + [7, 8, 9], B, A, B]
SVG = "{http://www.w3.org/2000/svg}"


def test_each_run_is_one_rect_in_its_colour_with_its_detail_on_hover():
    mins = optimal(TRACE, 32, 4)
    ex = explain_trace(TRACE, capacity=32, page_size=4, min_hits=mins.request_hit_tokens)
    svg = miss_strip_svg(ex[5].runs, "request 5", totals(ex))
    root = ET.fromstring(svg)
    rects = [r for r in root.iter(f"{SVG}rect") if r.get("class", "").startswith("cause-")]
    strip = rects[: len(ex[5].runs)]
    assert [r.get("class") for r in strip] == [f"cause-{r.cause}" for r in ex[5].runs]
    assert all(r.get("fill") == CAUSE_COLORS[r.get("class")[6:]] for r in rects)
    titles = [r.find(f"{SVG}title").text for r in strip]
    assert "for r5;" in titles[0] and "MIN would" in titles[0]  # request 4 from 0
    widths = [int(r.get("width")) for r in strip]
    assert widths[0] > widths[-1]  # 28 evicted tokens against 2 below a page
    bar = rects[len(ex[5].runs) :]
    assert {r.get("class")[6:] for r in bar} == {c for c, n in totals(ex).items() if n}


def test_the_drawing_depends_on_the_runs_alone():
    ex = explain_trace(TRACE, capacity=32, page_size=4)
    assert miss_strip_svg(ex[2].runs) == miss_strip_svg([r.to_dict() for r in ex[2].runs])
    assert "first_seen" in miss_strip_svg(ex[2].runs)


def test_one_frame_per_request_at_its_match():
    from viz.miss_strip import explain_frames

    ex, frames = explain_frames(TRACE, capacity=32, page_size=4)
    assert [f.title for f in frames] == [f"r{i + 1}" for i in range(len(TRACE))]
    # A frame holds what happened since the request before matched: request 2's shows its
    # match of A's first 12 tokens (accessed); request 4's what request 3 evicted (A's nodes).
    assert any(n.state == "accessed" for n in frames[2].nodes)
    assert "evicted" in frames[4].caption
    assert not any(n.state == "accessed" for n in frames[4].nodes if n.id)
    assert ex[4].runs[0].cause == "evicted"


def test_the_view_stacks_the_tree_over_the_strip_and_the_totals_share_one_scale():
    from viz.miss_strip import explain_frames, explain_view, totals_svg

    ex, frames = explain_frames(TRACE, capacity=32, page_size=4)
    view = ET.fromstring(explain_view(frames[4], ex[4].runs, "request 4", totals(ex)))
    inner = [c for c in view if c.tag == f"{SVG}svg"]
    assert len(inner) == 2 and int(inner[1].get("y")) > int(inner[0].get("height"))
    assert inner[1].find(f"{SVG}rect").get("class") == "cause-evicted"
    block = explain_trace(TRACE, cache="block", capacity=32, block_size=4)
    bars = ET.fromstring(totals_svg({"radix": totals(ex), "block": totals(block)}))
    rects = [r for r in bars.iter(f"{SVG}rect") if r.get("class", "").startswith("cause-")]
    hits = [int(r.get("width")) for r in rects if r.get("class") == "cause-hit"]
    # One scale: the block cache hits more here (its first block survives), so its bar is longer.
    assert len(hits) == 2 and hits[1] > hits[0]


def test_the_browser_shows_the_selected_request():
    from viz.miss_strip import explain_browser, explain_frames

    ex, frames = explain_frames(TRACE, capacity=32, page_size=4)
    box = explain_browser(ex, frames, totals(ex))
    pick, view = box.children
    first = pick.value  # the request that missed most comes first
    assert max(ex, key=lambda e: e.num_tokens - e.tokens("hit")).request == first
    pick.value = 1
    assert "r2" in view.value and "cause-last_token" in view.value
    assert pick.options[0][0].startswith(f"r{first + 1}: ")


def chapter_08_frames():
    """Chapter 08 section 10's trace, built as its cells build it (one token per word)."""
    from minirad.kv_events.explain_trace import optimal
    from viz.miss_strip import explain_frames

    words: dict[str, int] = {}

    def toy_tokens(text):
        return [words.setdefault(w, 100 + len(words)) for w in text.split()]

    def toy_text(ids):
        names = {i: w for w, i in words.items()}
        return " ".join(names[i] for i in ids)

    system = toy_tokens("you are a terse helper . answer briefly")
    q_radix = toy_tokens("user : what is a radix tree ?")
    q_block = toy_tokens("now : define a block .")
    follow_up = toy_tokens("then : why whole blocks ?")
    document = toy_tokens(" ".join(f"w{i}" for i in range(28)))
    trace = [
        system + q_radix,
        system + q_radix,
        system + q_block,
        system + q_block + follow_up,
        document,
        system + q_radix,
    ]
    min_hits = optimal(trace, 32, 4).request_hit_tokens
    return explain_frames(trace, toy_text, capacity=32, page_size=4, min_hits=min_hits)


def test_a_frames_caption_lists_the_insert_the_evictions_and_the_match_with_node_ids():
    """Issue 43: chapter 08 says a frame's caption lists, in order, the request before's
    insert (and what it evicted) and this request's match, with node ids; it listed the
    insert alone (r4), the evictions and the insert (r6), never the match. Requests are
    r1..r6, as the CLI's report and the rest of chapter 08 number them."""
    explained, frames = chapter_08_frames()
    assert [f.title for f in frames] == [f"r{i}" for i in range(1, 7)]
    captions = [f.caption for f in frames]
    assert captions[3] == "r3 inserted #4 (4 tokens); r4 matched #1 #4: 12 of its 20 tokens"
    assert captions[5] == (
        "r5 evicted #2 #3 #5 #4 #1 (28 tokens), inserted #6 (28 tokens); "
        "r6 matched nothing: 0 of its 16 tokens"
    )
    assert captions[0] == "r1 matched nothing: 0 of its 16 tokens"
    # A split by the match belongs to the match; an insert of nothing new says so.
    assert captions[1] == (
        "r1 inserted #1 (16 tokens); r2 split #1 at token 12 (the rest is #2), "
        "matched #1: 12 of its 16 tokens"
    )
    assert captions[2] == (
        "r2 inserted nothing new (all 16 tokens were cached); r3 split #1 at token 8 "
        "(the rest is #3), matched #1: 8 of its 14 tokens"
    )
    # The caption agrees with the drawing: the ids it names have the colours it names.
    f = frames[5]
    assert {n.id for n in f.nodes if n.state == "evicted"} == {1, 2, 3, 4, 5}
    assert f.node(6).state == "added"
    assert [n.id for n in frames[3].nodes if n.state in ("accessed", "added")] == [1, 4]
    for e, frame in zip(explained, frames, strict=True):  # the match is the strip's hits
        assert frame.caption.endswith(f"{e.tokens('hit')} of its {e.num_tokens} tokens")
