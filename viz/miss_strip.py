"""Why a request missed, drawn: its prompt as a strip of tokens coloured by cause, and the
tokens per cause as one bar (``minirad explain``'s runs, :mod:`minirad.kv_events.miss_causes`).

A static SVG, deterministic as :mod:`viz.svg`'s frames: hover a run for its tokens, cause and
detail (the evicting request, where the prompt left the earlier ones, whether MIN would have
kept it). Width is proportional to tokens; a run never shrinks below a hairline.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from xml.sax.saxutils import escape, quoteattr

from minirad.events import (
    EventBus,
    EvictEvent,
    InsertEvent,
    MatchEvent,
    SplitEvent,
    plural,
)
from minirad.kv_events.miss_causes import describe_fork, label, span

from .frame import Frame
from .frame_builder import FrameBuilder
from .svg import FONT, MARGIN, MAX_WIDTH, frame_svg

__all__ = ["CAUSE_COLORS", "explain_frames", "explain_view", "miss_strip_svg", "totals_svg"]

# cause -> fill; hits green as the paper's "added", the misses warm to cold by how avoidable.
CAUSE_COLORS = {
    "hit": "#3a8a2e",
    "host": "#8d6e63",
    "storage": "#827717",
    "last_token": "#9ccc65",
    "in_flight": "#4fc3f7",
    "preempted": "#ba68c8",
    "evicted": "#e53935",
    "block_floor": "#ffb300",
    "first_seen": "#9e9e9e",
    "unknown": "#263238",
}
STRIP_H, BAR_H, ROW = 22, 14, 34


def _detail(detail: Mapping) -> str:
    """A run's detail in words, as ``minirad explain`` says it (requests named r1, r2, ...)."""
    parts = []
    if "by_request" in detail:
        parts.append(f"evicted at tick {detail['time']} for {label(detail['by_request'])}")
        parts.append(f"policy {detail['policy']}")
    if "min_kept" in detail:
        n = detail["min_kept"]
        parts.append(f"MIN would have served {n} of them" if n else "MIN would not have kept them")
    if "at" in detail:
        if detail["seen_next"]:
            parts.append(
                f"left the earlier prompts at token {detail['at']}: {describe_fork(detail)}"
            )
        elif detail["at"]:
            parts.append(f"earlier prompts ended before token {detail['at']}")
        else:
            parts.append("no earlier prompt")
    parts += [f"{k}: {v}" for k, v in detail.items() if k not in _KNOWN]
    return "; ".join(parts)


_KNOWN = {
    "by_request",
    "time",
    "policy",
    "min_kept",
    "at",
    "token",
    "seen_next",
    "seen_next_more",
    "image",
    "image_hash",
    "seen_next_images",
}


def _rects(spans: Sequence[tuple[int, int, str, str]], total: int, y: int, h: int) -> list[str]:
    """Rectangles for ``(start, end, cause, title)`` spans of ``total`` tokens, scaled to the
    drawing's width (integer pixels, each at least 1 px)."""
    width = MAX_WIDTH - 2 * MARGIN
    out = []
    for start, end, cause, title in spans:
        x0 = MARGIN + start * width // total
        x1 = max(MARGIN + end * width // total, x0 + 1)
        out.append(
            f'<rect class="cause-{cause}" x="{x0}" y="{y}" width="{x1 - x0}" height="{h}" '
            f'fill="{CAUSE_COLORS.get(cause, "#000000")}"><title>{escape(title)}</title></rect>'
        )
    return out


def miss_strip_svg(runs: Sequence, title: str = "", totals: Mapping[str, int] | None = None) -> str:
    """One request's ``runs`` (:class:`~minirad.kv_events.miss_causes.Run`, or their dicts) as
    a strip, with ``totals`` (tokens per cause, e.g. a whole trace's) as a bar under it, and a
    legend of the causes present. Returns the SVG document."""
    runs = [r if isinstance(r, Mapping) else r.to_dict() for r in runs]
    n = runs[-1]["end"] if runs else 0
    y = MARGIN
    out = []
    if title:
        out.append(f'<text x="{MARGIN}" y="{y + 10}" font-size="12">{escape(title)}</text>')
        y += 18
    spans = [
        (
            r["start"],
            r["end"],
            r["cause"],
            f"{span(r['start'], r['end'])}: {r['cause']}"
            + (f" ({d})" if (d := _detail(r["detail"])) else ""),
        )
        for r in runs
    ]
    if n:
        out += _rects(spans, n, y, STRIP_H)
    y += STRIP_H + 6
    present = [c for c in CAUSE_COLORS if any(r["cause"] == c for r in runs)]
    if totals:
        whole = sum(totals.values())
        out.append(f'<text x="{MARGIN}" y="{y + 10}" font-size="11">all requests</text>')
        y += 14
        bar = _bar(totals, "")
        present += [c for _, _, c, _ in bar if c not in present]
        out += _rects(bar, whole, y, BAR_H)
        y += BAR_H + 6
    out += _legend(present, y)
    return _document(out, y + 10 + MARGIN)


def _bar(counts: Mapping[str, int], label: str) -> list[tuple[int, int, str, str]]:
    """One bar's spans ``(start, end, cause, hover text)``: the causes with tokens, in order."""
    whole, pos, out = sum(counts.values()), 0, []
    for cause, count in counts.items():
        if count:
            out.append(
                (pos, pos + count, cause, f"{label}{cause}: {count:,} tokens ({count / whole:.1%})")
            )
            pos += count
    return out


def _legend(present: Sequence[str], y: int) -> list[str]:
    """One swatch per cause in ``present``, in :data:`CAUSE_COLORS`' order, on one row."""
    out, x = [], MARGIN
    for cause in [c for c in CAUSE_COLORS if c in present]:
        out.append(
            f'<rect x="{x}" y="{y}" width="10" height="10" fill="{CAUSE_COLORS[cause]}"/>'
            f'<text x="{x + 14}" y="{y + 9}" font-size="10">{cause}</text>'
        )
        x += 24 + 7 * len(cause)
    return out


def _document(out: Sequence[str], height: int) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{MAX_WIDTH}" height="{height}" '
        f'viewBox="0 0 {MAX_WIDTH} {height}" font-family={quoteattr(FONT)}>'
        + "".join(out)
        + "</svg>"
    )


def totals_svg(rows: Mapping[str, Mapping[str, int]], title: str = "") -> str:
    """Tokens per cause as one bar per row (``{row name: totals}``, e.g. one per cache design
    or per source), all on one scale (the largest row fills the width), with a legend of the
    causes present. Hover a span for its tokens and share of its row. Returns the SVG
    document."""
    y, out = MARGIN, []
    if title:
        out.append(f'<text x="{MARGIN}" y="{y + 10}" font-size="12">{escape(title)}</text>')
        y += 18
    scale = max((sum(t.values()) for t in rows.values()), default=0)
    present: list[str] = []
    for name, counts in rows.items():
        whole = sum(counts.values())
        out.append(
            f'<text x="{MARGIN}" y="{y + 10}" font-size="11">{escape(name)}: {whole:,} tokens'
            + (f", {counts.get('hit', 0) / whole:.1%} hit" if whole else "")
            + "</text>"
        )
        y += 14
        bar = _bar(counts, f"{name}, ")
        present += [c for _, _, c, _ in bar if c not in present]
        if scale:
            out += _rects(bar, scale, y, BAR_H)
        y += BAR_H + 8
    out += _legend(present, y)
    return _document(out, y + 10 + MARGIN)


def explain_view(frame: Frame, runs: Sequence, title: str = "", totals=None) -> str:
    """A request's tree at its match (``frame``, one of :func:`explain_frames`' frames, drawn
    by :func:`viz.svg.frame_svg`) over its strip (:func:`miss_strip_svg` of ``runs``, with
    ``title`` and ``totals``): where in the cache each run of the prompt was, or was not.
    Returns one SVG document, :data:`~viz.svg.MAX_WIDTH` px wide."""
    parts, y, out = (frame_svg(frame), miss_strip_svg(runs, title, totals)), 0, []
    for part in parts:
        size = re.match(r'<svg [^>]*?width="(\d+)" height="(\d+)"', part)
        if size is None:  # both are drawn here: never
            raise ValueError("a drawing must start <svg ... width=... height=...>")
        out.append(part.replace("<svg ", f'<svg x="0" y="{y}" ', 1))
        y += int(size[2]) + 4
    return _document(out, y)


def explain_frames(
    prompts: Sequence[Sequence[int]],
    decode=None,
    capacity: int = 4096,
    page_size: int = 1,
    policy: str = "lru",
    min_hits: Sequence[int] | None = None,
    vocab_size: int | None = None,
) -> tuple[list, list[Frame]]:
    """``minirad explain``'s radix replay of ``prompts``, with the tree drawn at each request's
    match (its path accessed, what was evicted for the request before it gone): the explained
    requests and one :class:`~viz.frame.Frame` per request, to show beside its strip.

    Requests are named r1, r2, ... as ``minirad explain`` names them (``frames[i]`` is request
    ``i``'s frame, titled ``r{i + 1}``). A frame's caption lists what happened since the
    request before matched, in order, with node ids: that request's splits, evictions and
    insert, then this request's split (a match that ends inside a node cuts it) and match,
    e.g. ``"r5 evicted #2 #3 (8 tokens), inserted #6 (28 tokens); r6 matched nothing: 0 of its
    16 tokens"``."""
    from minirad.kv_events.explain_trace import explain_trace

    bus = EventBus()
    builder = FrameBuilder(
        decode, vocab_size=vocab_size, pool_size=capacity, page_size=page_size, every_event=False
    )
    builder.attach(bus)
    since: list = []  # the events since the last match

    def at_match(e) -> None:
        if not isinstance(e, MatchEvent):
            since.append(e)
            return
        k = len(builder.frames)
        builder.title = f"r{k + 1}"
        frame = builder.snapshot()
        caption = _match_caption(since, e, k, len(prompts[k]))
        builder.frames[-1] = dataclasses.replace(frame, caption=caption)
        since.clear()

    bus.subscribe(at_match)
    explained = explain_trace(
        prompts,
        capacity=capacity,
        page_size=page_size,
        policy=policy,
        vocab_size=vocab_size,
        min_hits=min_hits,
        bus=bus,
    )
    return explained, builder.frames


def _match_caption(events: Sequence, match: MatchEvent, k: int, num_tokens: int) -> str:
    """The caption of request ``k``'s frame (0-based; named ``r{k + 1}``): ``events`` since the
    request before matched (its splits, evictions and insert, up to its insert; after it, this
    request's splits), then ``match``."""
    last_insert = max((i for i, e in enumerate(events) if isinstance(e, InsertEvent)), default=-1)
    before, now = _describe(events[: last_insert + 1]), _describe(events[last_insert + 1 :])
    path = " ".join(f"#{i}" for i in match.path)
    now.append(f"matched {path}: " if path else "matched nothing: ")
    now[-1] += f"{match.num_tokens} of its {plural(num_tokens, 'token')}"
    parts = [f"r{k} {', '.join(before)}"] if before else []
    return "; ".join([*parts, f"r{k + 1} {', '.join(now)}"])


def _describe(events: Sequence) -> list[str]:
    """Splits, evictions (a run of them as one item) and inserts, in order, with node ids."""
    out: list[str] = []
    evicted: list[EvictEvent] = []
    for e in [*events, None]:
        if evicted and not isinstance(e, EvictEvent):
            ids = " ".join(f"#{x.node_id}" for x in evicted)
            out.append(f"evicted {ids} ({plural(sum(x.num_tokens for x in evicted), 'token')})")
            evicted = []
        if isinstance(e, EvictEvent):
            evicted.append(e)
        elif isinstance(e, SplitEvent):
            out.append(f"split #{e.node_id} at token {e.split_len} (the rest is #{e.new_node_id})")
        elif isinstance(e, InsertEvent) and e.node_id is None:
            were = "were" if e.prefix_len > 1 else "was"
            out.append(f"inserted nothing new (all {plural(e.prefix_len, 'token')} {were} cached)")
        elif isinstance(e, InsertEvent):
            out.append(f"inserted #{e.node_id} ({plural(len(e.key), 'token')})")
    return out


def explain_browser(explained: Sequence, frames: Sequence[Frame] | None = None, totals=None):
    """Select a request, see why it missed: a dropdown of the requests (most tokens missed
    first) over :func:`explain_view` of the chosen one (its tree at its match, when
    ``frames`` are given, :func:`explain_frames`') or its strip alone. An ipywidgets
    ``VBox``; its ``children[1].value`` is the drawing's HTML."""
    import ipywidgets as widgets

    order = sorted(explained, key=lambda e: (e.tokens("hit") - e.num_tokens, e.request))
    options = [
        (
            f"r{e.request + 1}: {e.num_tokens - e.tokens('hit'):,} of {e.num_tokens:,} missed",
            e.request,
        )
        for e in order
    ]
    by_index = {e.request: e for e in explained}
    pick = widgets.Dropdown(options=options, description="request")
    view = widgets.HTML()

    def show(change=None) -> None:
        e = by_index[pick.value]
        title = f"r{e.request + 1}"
        if frames is not None:
            view.value = explain_view(frames[e.request], e.runs, title, totals)
        else:
            view.value = miss_strip_svg(e.runs, title, totals)

    pick.observe(show, names="value")
    show()
    return widgets.VBox([pick, view])
