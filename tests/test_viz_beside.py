"""Players side by side (``viz.beside``, chapter 08 section 8): the request table's header, and
"fit" in a player as narrow as a side-by-side column (issue 43, point 5).

The browser checks open the player's standalone HTML export in Debian's chromium (headless,
as ``tests/test_browser.py`` does), in a window as narrow as the column ``BesideView`` gives
each player; they are skipped where chromium or playwright is missing."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from browser_tools import Console, missing

from viz import RadixView
from viz.beside import OURS, THEIRS, BesideView
from viz.sources import scenario_frames

NO_BROWSER = missing()
needs_browser = pytest.mark.skipif(NO_BROWSER is not None, reason=NO_BROWSER or "")
# The player's width in chapter 08's pair: each column is at least 460 px (viz/beside.py), two
# to a row in JupyterLab's output area; a 500-px window less the page's margins gives ~468.
NARROW = {"width": 500, "height": 900}


@pytest.fixture(scope="module")
def figure3():
    """SGLang's Figure 3, one frame per step: 8 columns (1208 px at full size), wider than
    chapter 08's trees (6 columns)."""
    return scenario_frames(per="step")


def pair_of(frames) -> BesideView:
    pair = BesideView([RadixView(frames), RadixView(frames)], [THEIRS, OURS])
    pair.add_request("system + what shape is it?", (12, 12))
    pair.add_request("flush_cache", (None, None))
    return pair


def header(pair: BesideView) -> list[list[str]]:
    table = ET.fromstring(pair.table.value)
    rows = [tr for tr in table.iter("tr") if tr.find("th") is not None]
    return [["".join(th.itertext()) for th in tr.findall("th")] for tr in rows]


def test_the_request_tables_header_names_each_column_apart(figure3):
    """The header read "cached: SGLang 0.5.23 cached: minirad": cells with no padding and no
    rule between them. Now: the engines under one "cached tokens" heading, every cell padded
    and ruled, the counts under their engine's name."""
    pair = pair_of(figure3)
    assert header(pair) == [["request", "cached tokens", "prompt"], ["SGLang 0.5.23", "minirad"]]
    table = ET.fromstring(pair.table.value)
    assert "border-collapse:collapse" in table.get("style", "")
    for cell in [*table.iter("th"), *table.iter("td")]:
        style = cell.get("style", "")
        assert "padding:" in style and "border:1px solid" in style, ET.tostring(cell)
    body = [[td.text for td in tr.findall("td")] for tr in table.iter("tr")]
    body = [row for row in body if row]
    assert body == [["1", "12", "12", "system + what shape is it?"], ["2", "?", "?", "flush_cache"]]


@needs_browser
def test_the_header_cells_text_is_apart_on_screen(browser, figure3):
    """In the browser, each header cell's text is at least 12 px from its neighbour's, and a
    rule (a border) is drawn between them."""
    page = browser.new_page(viewport=NARROW)
    page.set_content(pair_of(figure3).table.value)
    cells = page.evaluate(
        """() => [...document.querySelectorAll('tr')].filter((tr) => tr.querySelector('th'))
             .map((tr) => [...tr.querySelectorAll('th')].map((th) => {
               const range = document.createRange();
               range.selectNodeContents(th);
               const r = range.getBoundingClientRect();
               return { text: th.textContent, left: r.left, right: r.right,
                        border: parseFloat(getComputedStyle(th).borderRightWidth) };
             }))"""
    )
    page.close()
    assert [[c["text"] for c in row] for row in cells] == header(pair_of(figure3))
    for row in cells:
        for a, b in zip(row, row[1:], strict=False):
            assert b["left"] - a["right"] >= 12, (a, b)
        assert all(c["border"] >= 1 for c in row), row


def shown(page) -> dict:
    return page.evaluate(
        """() => {
          const wrap = document.querySelector('.rv-tree-wrap');
          const svg = document.querySelector('.rv-tree');
          const w = wrap.getBoundingClientRect(), s = svg.getBoundingClientRect();
          const boxes = [...svg.querySelectorAll('rect.rv-box')]
            .map((b) => b.getBoundingClientRect());
          const scale = s.width / svg.viewBox.baseVal.width;
          const px = [...svg.querySelectorAll('.rv-node text.rv-head')]
            .map((t) => parseFloat(getComputedStyle(t).fontSize) * scale);
          const left = w.left + wrap.clientLeft;
          return { wrapLeft: left, wrapRight: left + wrap.clientWidth,
                   svgRight: s.right, right: Math.max(...boxes.map((b) => b.right)),
                   scrollWidth: wrap.scrollWidth, clientWidth: wrap.clientWidth,
                   hint: !document.querySelector('.rv-scroll-hint').hidden,
                   hintText: document.querySelector('.rv-scroll-hint').textContent,
                   px: Math.min(...px) };
        }"""
    )


def at_rest(page, counter: str) -> None:
    page.wait_for_function(
        "(c) => document.querySelector('.rv-counter').textContent === c", arg=counter
    )
    page.wait_for_function("() => document.getAnimations().every((a) => a.playState !== 'running')")


@needs_browser
def test_fit_draws_the_whole_tree_in_a_side_by_side_player(browser, figure3, tmp_path):
    """Issue 43: with "fit" ticked, chapter 08's pair still clipped its trees ("scroll
    sideways →"): fit never drew node text under 11 px, and a side-by-side player is ~460 px
    wide. A ``BesideView``'s players fit the whole tree to their width (the text as small as
    that takes; a node's full text is in the details on hover); unticked, full size and a
    scroll. A player on its own keeps its readable floor (and says why it scrolls)."""
    pair = pair_of(figure3)
    pair.request.value = 0  # both players at their first frame
    page = browser.new_page(viewport=NARROW)
    console = Console().watch(page)
    page.goto(pair.views[0].to_html(tmp_path / "beside.html").as_uri())
    assert page.locator(".rv-fit input").is_checked()
    total = len(figure3)
    widest = 0.0
    for f in figure3:
        at_rest(page, f"{f.index + 1} / {total}")
        s = shown(page)
        assert 400 < s["clientWidth"] < 500, s
        assert s["svgRight"] <= s["wrapRight"] + 0.5, (f.index, s)
        assert s["right"] <= s["wrapRight"] + 0.5, (f.index, s)
        assert s["scrollWidth"] <= s["clientWidth"], (f.index, s)
        assert not s["hint"], (f.index, s)
        widest = max(widest, s["svgRight"] - s["wrapLeft"])
        page.locator(".rv-fwd").click()
    assert widest > 0.9 * s["clientWidth"]  # the widest frame fills the width: no needless shrink
    page.locator(".rv-fit input").uncheck()  # full size: the tree scrolls, and says so
    s = shown(page)
    assert s["hint"] and s["scrollWidth"] > s["clientWidth"] and s["px"] >= 11.99, s
    assert "tick fit" in s["hintText"], s
    # A player on its own (chapter 07's) keeps fit's floor: node text at 11 px or more.
    wide = max(figure3, key=lambda f: max(n.col for n in f.nodes))
    alone = RadixView(figure3, step=wide.index).to_html(tmp_path / "alone.html")
    page.goto(alone.as_uri())
    at_rest(page, f"{wide.index + 1} / {total}")
    s = shown(page)
    assert s["px"] >= 10.99 and s["hint"], s
    assert "fit keeps node text at 11 px" in s["hintText"], s
    page.close()
    assert not console.errors, console.errors
