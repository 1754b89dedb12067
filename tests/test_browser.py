"""The visualizer in a real browser: Debian's chromium, headless, driven by Playwright.

- Chapter 07 in JupyterLab (started here): Run > Run All Cells, every widget displays (no
  "Error displaying widget", no JavaScript error), and the SGLang Figure 3 player, played,
  shows each step's tree as Python computed it (node ids, states, lock marks, pool cells),
  with the animations that step should start (grow, flash, fade, slide) and the paper's
  colours once they end. A screenshot is saved in the test's tmp folder.
- The standalone HTML export, opened from disk: it plays with no kernel; an engine run's
  image fork shows the two pictures; a tree bigger than ``max_nodes`` is drawn collapsed.

Skipped only when chromium or the playwright package is missing (CI installs both:
``.ci/run`` and the ``dev`` extra). The tooling is in ``tests/browser_tools.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from browser_tools import (
    Console,
    box_styles,
    fork_frame,
    jupyter_lab,
    missing,
    play,
    player_state,
    record,
    recorded,
    rgb,
    run_all_cells,
    step_through,
)

from viz import RadixView
from viz.sources import scenario_frames
from viz.svg import COLORS, LOCK

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = "notebooks/07_visualizer.ipynb"
REASON = missing()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.fixture(scope="module")
def figure3() -> dict[str, list]:
    """The Figure 3 replay as the chapter makes it (``viz.replay_scenario()``), per step and
    per event."""
    return {per: scenario_frames(per=per) for per in ("step", "event")}


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    page.console = Console().watch(page)
    yield page
    context.close()


# ---------------------------------------------------------------------- checks
def check_played(log: list[dict], frames) -> None:
    """Every frame was drawn, as Python computed it, with the animations it should start."""
    total = len(frames)
    by_counter = {entry["counter"]: entry for entry in log}
    previous = None
    for f in frames:
        shown = by_counter.get(f"{f.index + 1} / {total}")
        assert shown is not None, f"frame {f.index} was never drawn"
        assert (shown["title"], shown["caption"]) == (f.title or "", f.caption)
        classes = {i: set(cls.split()) for i, cls, _ in shown["nodes"]}
        assert set(classes) == {n.id for n in f.nodes}, f"frame {f.index}: node ids"
        for n in f.nodes:
            assert n.state in classes[n.id], (f.index, n)
            assert ("locked" in classes[n.id]) == (n.lock_ref > 0), (f.index, n)
        assert shown["edges"] == len(f.nodes) - 1
        owners = f.pool.owners()
        assert len(shown["cells"]) == len(owners)
        for cls, owner in zip(shown["cells"], owners, strict=True):
            expected = "free" if owner is None else "request" if isinstance(owner, str) else None
            assert (expected or f.node(owner).state) in cls.split(), (f.index, owner, cls)
        if previous is not None and f.index == previous.index + 1:
            check_animations(shown, f, previous, by_counter[f"{previous.index + 1} / {total}"])
        previous = f


def check_animations(shown: dict, f, prev_frame, prev_shown: dict) -> None:
    """The step into ``f`` started the animations its changes call for, each with a length."""
    started: dict[str | None, set[str]] = {}
    for a in shown["animations"]:
        assert a["duration"] > 0, a
        started.setdefault(a["target"], set()).add(a["kind"])
    expected = {"added": "rv-grow", "accessed": "rv-flash", "evicted": "rv-fade"}
    for n in f.nodes:
        if n.state in expected:
            assert expected[n.state] in started.get(str(n.id), set()), (f.index, n)
    before = {i: t for i, _, t in prev_shown["nodes"]}
    for i, _, transform in shown["nodes"]:
        if i in before and before[i] != transform:  # a node that moved slides
            assert "transition:transform" in started.get(str(i), set()), (f.index, i)
    old_locks = {n.id: n.lock_ref for n in prev_frame.nodes}
    for n in f.nodes:
        if n.id in old_locks and n.lock_ref and n.lock_ref != old_locks[n.id]:
            bump = "rv-bump" if n.lock_ref > old_locks[n.id] else "rv-shrink"
            assert bump in started.get(str(n.id), set()), (f.index, n)


def check_colours(view, frame) -> None:
    """Once the animations end, each box has the paper's colours for its state."""
    styles = {s["id"]: s for s in box_styles(view)}
    for n in frame.nodes:
        if n.id == 0:
            continue
        s = styles[n.id]
        fill, stroke = COLORS[n.state]
        if n.lock_ref and n.state in ("idle", "split"):
            stroke = LOCK
        assert (s["fill"], s["stroke"]) == (rgb(fill), rgb(stroke)), (n, s)
        assert (s["dash"] != "none") == (n.state == "evicted"), (n, s)
        assert (float(s["opacity"]) < 1) == (n.state == "evicted"), (n, s)


def check_consistent(log: list[dict]) -> None:
    """What any player shows, whatever its frames: a tree (one edge per node but the root),
    one state per node, and a picture on every edge that starts with an image."""
    for shown in log:
        assert shown["edges"] == len(shown["nodes"]) - 1, shown["counter"]
        for i, cls, _ in shown["nodes"]:
            assert len(set(cls.split()) & set(COLORS)) == 1, (shown["counter"], i, cls)
        assert shown["thumbs"] == shown["imageEdges"], shown["counter"]


def expected_start(frames) -> dict:
    """What a player of ``frames`` shows on its first frame (see ``player_state``)."""
    return {"counter": f"1 / {len(frames)}", "title": frames[0].title or ""}


def play_and_check(view, frames) -> None:
    view.locator(".rv-first").click()
    record(view)
    play(view)
    log = recorded(view)
    check_played(log, frames)
    check_consistent(log)
    check_colours(view, frames[-1])


# ---------------------------------------------------------------------- JupyterLab
def test_chapter_runs_and_animates_in_jupyterlab(page, figure3, tmp_path):
    assert (ROOT / CHAPTER).exists(), f"{CHAPTER} is missing"
    before = (ROOT / CHAPTER).read_bytes()
    with jupyter_lab(tmp_path) as lab:
        run_all_cells(page, lab, CHAPTER)
        views = page.locator(".jp-OutputArea-output .radix-view")
        page.wait_for_function(
            "() => document.querySelectorAll('.jp-OutputArea-output .radix-view').length > 0"
        )
        assert page.get_by_text("Error displaying widget").count() == 0
        played = 0
        for i in range(views.count()):
            view = views.nth(i)
            view.scroll_into_view_if_needed()
            view.locator(".rv-first").click()
            state = player_state(view)
            frames = next((fs for fs in figure3.values() if state == expected_start(fs)), None)
            # The Figure 3 player is played whole; the others (per event: too many frames to
            # play here; engine runs) for a few steps.
            if frames is not None and len(frames) <= 20:
                play_and_check(view, frames)
                played += 1
                page.screenshot(path=str(tmp_path / "chapter07.png"))
            else:
                record(view)
                step_through(view, 6)
                check_consistent(recorded(view))
        assert played, "no Figure 3 player (viz.replay_scenario()) found in the chapter"
        assert page.get_by_text("Error displaying widget").count() == 0
    print(f"screenshot: {tmp_path / 'chapter07.png'}")
    assert not page.console.errors, page.console.errors
    assert (ROOT / CHAPTER).read_bytes() == before, "the run saved the chapter (autosave?)"


# ---------------------------------------------------------------------- the HTML export
def test_exported_page_plays_without_a_kernel(page, figure3, tmp_path):
    frames = figure3["step"]
    path = RadixView(frames, title="Figure 3").to_html(tmp_path / "figure3.html")
    page.goto(path.as_uri())
    view = page.locator(".radix-view")
    play_and_check(view, frames)
    page.screenshot(path=str(tmp_path / "figure3.png"))
    assert not page.console.errors, page.console.errors


def test_an_image_fork_shows_both_pictures(page, tmp_path):
    from PIL import Image
    from tiny_models import IMAGE_SIZE, tiny_llava_processor, tiny_model

    from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
    from viz import run_engine

    engine = LLMEngine(tiny_model("llava-llama"), tiny_llava_processor(), num_kv_slots=256)
    images = [Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), c) for c in ("red", "blue")]
    sp = SamplingParams(max_new_tokens=2)
    requests = [GenerateRequest("<s> w10 w11 <image> w12", [im], sp) for im in images]
    view, _ = run_engine(engine, requests)
    i = fork_frame(view.frames)
    view.step = i
    page.goto(view.to_html(tmp_path / "fork.html").as_uri())
    thumbs = page.locator(".rv-thumb image")
    assert thumbs.count() == 2
    srcs = {thumbs.nth(k).get_attribute("href") for k in range(2)}
    assert srcs == set(view._images.values()) and len(srcs) == 2
    assert all(s.startswith("data:image/png;base64,") for s in srcs)
    # Both pictures decode (a broken data URI would draw nothing).
    sizes = page.evaluate(
        """async (srcs) => Promise.all(srcs.map((s) => new Promise((ok) => {
             const img = new Image(); img.onload = () => ok([img.width, img.height]);
             img.onerror = () => ok(null); img.src = s; })))""",
        sorted(srcs),
    )
    assert all(s and min(s) > 0 for s in sizes), sizes
    assert not page.console.errors, page.console.errors


def test_a_big_tree_is_drawn_collapsed(page, tmp_path):
    from viz.bench import bench_python, make_trace

    frames = bench_python(make_trace(100)).frames
    f = max(frames, key=lambda f: len(f.nodes))
    max_nodes = 24
    assert len(f.nodes) > 3 * max_nodes
    path = RadixView(frames, max_nodes=max_nodes, step=f.index).to_html(tmp_path / "big.html")
    page.goto(path.as_uri())
    shown = page.evaluate(
        """() => [...document.querySelectorAll('.rv-node')].map((g) => [Number(g.dataset.id),
             Number((g.querySelector('.rv-fold')?.style.display !== 'none' &&
                     g.querySelector('.rv-fold')?.textContent.match(/\\d+/)?.[0]) || 0)])"""
    )
    ids = {i for i, _ in shown}
    by_id = {n.id: n for n in f.nodes}
    # The budget (plus the paths to the root that the changed nodes need), every changed or
    # locked node, each shown node's parent; every hidden node counted once in a fold mark.
    must = {n.id for n in f.nodes if n.state != "idle" or n.lock_ref}
    assert must <= ids
    assert len(ids) <= max(max_nodes, len(must)) + max(n.depth for n in f.nodes)
    assert all(by_id[i].parent in ids for i in ids if i != 0)
    assert sum(k for _, k in shown) == len(f.nodes) - len(ids)
    assert page.locator(".rv-edge").count() == len(ids) - 1
    assert not page.console.errors, page.console.errors


def test_figure3_text_is_readable_at_the_default_size(browser, figure3, tmp_path):
    """In an output area as wide as JupyterLab's (~968 px), with "fit" on (the default), the
    node text of every Figure 3 panel is drawn at 11 px or more, and the canvas is no bigger
    than the tree on screen."""
    frames = figure3["step"]
    context = browser.new_context(viewport={"width": 1000, "height": 900})
    page = context.new_page()
    console = Console().watch(page)
    path = RadixView(frames, title="Figure 3").to_html(tmp_path / "figure3.html")
    page.goto(path.as_uri())
    view = page.locator(".radix-view")
    assert view.locator(".rv-fit input").is_checked()
    for f in frames:
        page.wait_for_function(
            "(c) => document.querySelector('.rv-counter').textContent === c",
            arg=f"{f.index + 1} / {len(frames)}",
        )
        page.wait_for_function(  # boxes are measured at rest, not while they grow or slide
            "() => document.getAnimations().every((a) => a.playState !== 'running')"
        )
        shown = page.evaluate(
            """() => {
              const svg = document.querySelector('.rv-tree');
              const scale = svg.getBoundingClientRect().width / svg.viewBox.baseVal.width;
              const px = [...svg.querySelectorAll('.rv-node text.rv-text, .rv-node text.rv-head')]
                .map((t) => parseFloat(getComputedStyle(t).fontSize) * scale);
              const boxes = [...svg.querySelectorAll('rect.rv-box')]
                .map((b) => b.getBoundingClientRect());
              const r = svg.getBoundingClientRect();
              return { px, wrap: document.querySelector('.rv-tree-wrap').clientWidth,
                       hint: !document.querySelector('.rv-scroll-hint').hidden,
                       right: Math.max(...boxes.map((b) => b.right)) - r.left, width: r.width,
                       bottom: Math.max(...boxes.map((b) => b.bottom)) - r.top, height: r.height };
            }"""
        )
        assert 900 < shown["wrap"] < 1000, shown["wrap"]
        assert min(shown["px"], default=11) >= 10.99, (f.index, min(shown["px"]))
        # A tree wider than the view says so (it scrolls rather than shrink its text further).
        assert shown["hint"] == (shown["width"] > shown["wrap"] + 0.5), (f.index, shown)
        # No empty canvas: the drawing ends a margin (at most 24 px) after the last box.
        if len(f.nodes) > 1:
            assert shown["width"] - shown["right"] < 24 and shown["height"] - shown["bottom"] < 24
        view.locator(".rv-fwd").click()
    context.close()
    assert not console.errors, console.errors


def test_forced_tokens_are_drawn_teal_with_their_share_of_the_box(page, tmp_path):
    """Three JSON answers sampled from one prompt: in the player, every node's forced text
    (Label.forced) is in teal tspans, a teal bar per forced run sits under the box, and the
    legend shows "forced"; a tree without grammars shows neither."""
    from test_viz_forced import run

    from viz.svg import FORCED

    _, _, frames, _, _ = run(1)
    f = frames[-1]
    path = RadixView(frames, step=f.index).to_html(tmp_path / "forced.html")
    page.goto(path.as_uri())
    drawn = page.evaluate(
        """() => Object.fromEntries([...document.querySelectorAll('.rv-node')].map((g) => [
             g.dataset.id,
             [[...g.querySelectorAll('tspan.rv-forced')].map((t) => t.textContent).join(''),
              g.querySelectorAll('.rv-forced-bar').length,
              [...g.querySelectorAll('.rv-forced-bar')].map((r) => getComputedStyle(r).fill)]]))"""
    )
    for n in f.live:
        text, bars, fills = drawn[str(n.id)]
        assert text == "".join(t for k, t in n.label.parts if k == "forced"), n
        assert bars == len(n.label.forced), n
        assert all(fill == rgb(FORCED) for fill in fills), fills
    assert any(bars for _, bars, _ in drawn.values())
    assert page.locator(".rv-legend-item", has_text="forced").is_visible()
    plain = RadixView(scenario_frames(per="step")).to_html(tmp_path / "plain.html")
    page.goto(plain.as_uri())
    assert page.locator(".rv-forced-bar").count() == 0
    assert not page.locator(".rv-legend-item", has_text="forced").is_visible()
    assert not page.console.errors, page.console.errors


def test_tiers_show_as_chips_dashed_boxes_and_a_host_pool(page, tmp_path):
    """A HiRadixCache's frames in the player (tests/test_viz_tiers.py's story): stepping into a
    demotion drains the node's dev chip (rv-chip-out) and draws its box dashed brown, with its
    tier classes; the host pool panel has one cell per host page, classed by its owner; a
    load-back fills the dev chip again (rv-chip-up). A plain tree shows none of it."""
    from test_viz_tiers import story

    from viz.svg import HOST_ONLY

    frames, at = story()
    assert at["demote"] == at["before"] + 1
    path = RadixView(frames, step=at["before"]).to_html(tmp_path / "tiers.html")
    page.goto(path.as_uri())
    view = page.locator(".radix-view")
    record(view)
    view.locator(".rv-fwd").click()
    page.wait_for_function("() => document.querySelector('.radix-view').__rvlog.length > 1")
    f = frames[at["demote"]]
    [demoted] = [n for n in f.nodes if "demoted" in n.tier_marks]
    shown = recorded(view)[-1]
    assert shown["counter"] == f"{f.index + 1} / {len(frames)}"
    started = {(a["target"], a["kind"]) for a in shown["animations"]}
    assert (str(demoted.id), "rv-chip-out") in started, started
    classes = {i: set(cls.split()) for i, cls, _ in shown["nodes"]}
    for n in f.nodes:
        tiers = {c for c in classes[n.id] if c.startswith("tier-")}
        assert tiers == {f"tier-{t}" for t in n.tiers}, (n, classes[n.id])
        assert ("host-only" in classes[n.id]) == n.host_only, n
    assert "mark-demoted" in classes[demoted.id]
    chips = page.evaluate(
        """(id) => [...document.querySelectorAll(`.rv-node[data-id="${id}"] .rv-tier-chip`)]
             .filter((c) => c.style.display !== "none").map((c) => c.getAttribute("class"))""",
        demoted.id,
    )
    assert chips == ["rv-tier-chip device", "rv-tier-chip host on"]
    styles = {s["id"]: s for s in box_styles(view)}
    s = styles[demoted.id]
    assert (s["fill"], s["stroke"]) == (rgb(HOST_ONLY[0]), rgb(HOST_ONLY[1])), s
    assert s["dash"] != "none" and float(s["opacity"]) == 1
    cells = page.evaluate(
        "() => [...document.querySelectorAll('.rv-hcell')].map((c) => c.getAttribute('class'))"
    )
    owners = f.host_pool.owners()
    assert len(cells) == len(owners)
    for cls, owner in zip(cells, owners, strict=True):
        kind = "free" if owner is None else "host-only" if f.node(owner).host_only else "host-copy"
        assert kind in cls.split(), (owner, cls)
    assert page.locator(".rv-pool-head", has_text="Host pool:").is_visible()
    assert page.locator(".rv-legend-item", has_text="host-only").is_visible()
    # The load-back: the dev chip fills again, rising from the host.
    path = RadixView(frames, step=at["load_back"] - 1).to_html(tmp_path / "load.html")
    page.goto(path.as_uri())
    view = page.locator(".radix-view")
    record(view)
    view.locator(".rv-fwd").click()
    page.wait_for_function("() => document.querySelector('.radix-view').__rvlog.length > 1")
    shown = recorded(view)[-1]
    started = {(a["target"], a["kind"]) for a in shown["animations"]}
    assert (str(demoted.id), "rv-chip-up") in started, started
    assert "host-only" not in dict((i, c) for i, c, _ in shown["nodes"])[demoted.id].split()
    # A plain tree: no chips, no host pool, no tier legend.
    plain = RadixView(scenario_frames(per="step")).to_html(tmp_path / "plain.html")
    page.goto(plain.as_uri())
    assert page.locator(".rv-tier-chip").count() == 0 and page.locator(".rv-hcell").count() == 0
    assert not page.locator(".rv-pool-head", has_text="Host pool:").is_visible()
    assert not page.locator(".rv-legend-item", has_text="host-only").is_visible()
    assert not page.console.errors, page.console.errors
