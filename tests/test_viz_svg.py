"""The static SVG fallback (``viz.svg``) and the widget's MIME bundle.

nbval compares ``text/plain`` and ``image/svg+xml`` byte for byte, and GitHub shows the SVG
when there is no kernel: both must be deterministic, well-formed, and say what the frame is.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from minirad import RadixCache
from minirad.events import EventBus
from viz import FrameBuilder, RadixView, frame_svg
from viz.sources import scenario_frames
from viz.svg import CELL, CELL_PITCH, CELLS_PER_ROW, COLORS, IMAGE, LOCK

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def events(tokenizer):
    return scenario_frames(per="event", tokenizer=tokenizer)


def test_svg_is_deterministic_and_well_formed(events, tokenizer):
    again = scenario_frames(per="event", tokenizer=tokenizer)
    for frame, twin in zip(events, again, strict=True):
        svg = frame_svg(frame, heading="h")
        assert svg == frame_svg(twin, heading="h")
        root = ET.fromstring(svg)
        assert root.tag == f"{SVG}svg"
        groups = root.findall(f"{SVG}g")
        assert sorted(int(g.get("data-id")) for g in groups) == sorted(n.id for n in frame.nodes)
        assert not re.search(r"0x[0-9a-f]{6,}", svg)
        bars = [r for r in root.findall(f"{SVG}rect") if r.get("class") == "pool"]
        # One bar per row of each run of same-owner cells: together they cover the pool once.
        covered = sum((int(b.get("width")) - CELL) // CELL_PITCH + 1 for b in bars)
        assert covered == frame.pool.num_cells
        assert len(bars) <= len(frame.pool.runs) + frame.pool.num_cells // CELLS_PER_ROW


def test_svg_draws_states_locks_and_evictions(events):
    locked = next(f for f in events if f.locked and any(n.state == "evicted" for n in f.nodes))
    root = ET.fromstring(frame_svg(locked))
    by_id = {int(g.get("data-id")): g for g in root.findall(f"{SVG}g")}
    for n in locked.nodes:
        if n.id == 0:
            continue
        box = by_id[n.id].find(f"{SVG}rect")
        assert box.get("fill") == COLORS[n.state][0]
        assert (box.get("stroke-dasharray") is not None) == (n.state == "evicted")
        assert by_id[n.id].find(f"{SVG}title").text.startswith(f"node {n.id}: {n.num_tokens}")
    thick = [p for p in root.findall(f"{SVG}path") if p.get("stroke") == LOCK]
    assert len(thick) == len(locked.locked)  # the locked path, edge by edge
    gone = next(n.id for n in locked.nodes if n.state == "evicted")
    assert "evicted" in ET.tostring(by_id[gone], encoding="unicode")


def test_an_edge_that_starts_with_an_image_is_purple():
    bus = EventBus()
    cache = RadixCache(bus=bus)
    builder = FrameBuilder(vocab_size=10, images={12: "img cafe01"})
    builder.attach(bus)
    cache.insert([1, 2, 12, 12, 3])
    cache.insert([1, 2, 13, 13, 4])
    root = ET.fromstring(frame_svg(builder.frames[-1]))
    purple = [p for p in root.findall(f"{SVG}path") if p.get("stroke") == IMAGE]
    assert len(purple) == 2  # both sides of the fork at the image boundary
    chips = [t for t in root.iter(f"{SVG}tspan") if t.get("fill") == IMAGE]
    assert [c.text for c in chips] == ["img cafe01 x2", "img #3 x2"]


def test_repr_and_mime_bundle(tokenizer):
    view = RadixView(scenario_frames(per="step", tokenizer=tokenizer))
    view.step = 3
    data, _ = view._repr_mimebundle_()
    assert set(data) == {
        "text/plain",
        "image/svg+xml",
        "application/vnd.jupyter.widget-view+json",
    }
    frame = view.frames[3]
    assert (
        data["text/plain"]
        == repr(view)
        == (
            f"RadixView: step 4/9 {frame.title}, 4 nodes, {frame.num_tokens} tokens, 0 locked: "
            f"{frame.caption!r}"
        )
    )
    assert "object at" not in repr(view) and "0x" not in repr(view)
    assert data["image/svg+xml"] == view.svg() == frame_svg(frame, heading="step 4/9")
    view.step = 99  # clamped to the last frame
    assert view.step == 8
    assert repr(RadixView()) == "RadixView: no frames"
    assert "image/svg+xml" not in RadixView()._repr_mimebundle_()[0]
