"""The widget (``viz.widget``), its front end (``viz/static``) and the HTML export.

The JavaScript is run here without a browser: Node (when installed) loads the ES module with
a small stand-in for the DOM and plays every Figure 3 frame, and what the DOM then holds is
compared with the frames (node boxes and positions, states, captions, pool cells). The real
browser test (JupyterLab + Chromium) is separate.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from tiny_models import IMAGE_SIZE, tiny_llava_processor, tiny_model

from minirad import RadixCache
from minirad.events import EventBus, EventRecorder
from minirad.kvcache.kv_pool import TokenToKVPoolAllocator
from viz import RadixView, frames_from_events, run_engine
from viz.export import STATIC, html_page
from viz.frame import frames_to_wire
from viz.sources import scenario_frames
from viz.svg import COL_W, MARGIN, ROW_H

ROOT = Path(__file__).resolve().parent.parent
NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="node is not installed")


# ---------------------------------------------------------------------- packaging
def test_front_end_files_ship_with_the_package():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["viz"]
    for name in ("radix_view.js", "radix_view.css"):
        assert any(Path("static", name).match(p) for p in patterns), name
    js = (STATIC / "radix_view.js").read_text()
    assert js.rstrip().endswith("export default { render };")
    assert not re.search(r"^\s*import\s", js, re.M)  # no dependencies: nothing to fetch
    view = RadixView()
    assert view._esm == js and view._css == (STATIC / "radix_view.css").read_text()


@needs_node
def test_javascript_parses_as_a_module(tmp_path):
    module = tmp_path / "radix_view.mjs"
    module.write_text((STATIC / "radix_view.js").read_text())
    subprocess.run([NODE, "--check", str(module)], check=True, capture_output=True)


# ---------------------------------------------------------------------- the JS, headless
DOM = r"""
class ClassList {
  constructor(el) { this.el = el; }
  get set() { return new Set((this.el._attrs.class || "").split(/\s+/).filter(Boolean)); }
  write(s) { this.el._attrs.class = [...s].join(" "); }
  add(...cs) { const s = this.set; cs.forEach((c) => s.add(c)); this.write(s); }
  remove(...cs) { const s = this.set; cs.forEach((c) => s.delete(c)); this.write(s); }
  toggle(c, force) {
    const s = this.set, on = force === undefined ? !s.has(c) : !!force;
    on ? s.add(c) : s.delete(c);
    this.write(s);
    return on;
  }
  contains(c) { return this.set.has(c); }
}
class Text {
  constructor(t) { this.textContent = t; this.parentNode = null; }
}
class El {
  constructor(tag) {
    this.tagName = tag; this.childNodes = []; this._attrs = {}; this.parentNode = null;
    this.style = { setProperty(k, v) { this[k] = v; } };
    this.classList = new ClassList(this); this.listeners = {};
  }
  setAttribute(k, v) { this._attrs[k] = String(v); }
  getAttribute(k) { return this._attrs[k] ?? null; }
  get className() { return this._attrs.class || ""; }
  set className(v) { this._attrs.class = v; }
  get children() { return this.childNodes.filter((c) => c instanceof El); }
  appendChild(c) {
    if (typeof c === "string") c = new Text(c);
    if (c.parentNode) c.parentNode.childNodes = c.parentNode.childNodes.filter((x) => x !== c);
    c.parentNode = this; this.childNodes.push(c); return c;
  }
  append(...cs) { cs.forEach((c) => this.appendChild(c)); }
  replaceChildren(...cs) { this.childNodes = []; this.append(...cs); }
  remove() {
    const p = this.parentNode;
    if (p) p.childNodes = p.childNodes.filter((x) => x !== this);
    this.parentNode = null;
  }
  get textContent() { return this.childNodes.map((c) => c.textContent).join(""); }
  set textContent(v) { this.childNodes = []; if (v !== "") this.appendChild(String(v)); }
  addEventListener(t, f) { (this.listeners[t] ||= []).push(f); }
  fire(t) { (this.listeners[t] || []).forEach((f) => f({})); }
  getBoundingClientRect() { return { x: 0, y: 0, width: 0, height: 0 }; }
  get value() {
    if (this.tagName === "select") return this.children.find((o) => o.selected)?.value ?? "";
    return this._value ?? "";
  }
  set value(v) { this._value = String(v); }
}
const byId = {};
globalThis.document = {
  createElement: (t) => new El(t),
  createElementNS: (_ns, t) => new El(t),
  getElementById: (id) => byId[id],
};
// No layout here: the output area's width is never reported, so the drawing keeps scale 1.
globalThis.ResizeObserver = class { observe() {} disconnect() {} };
const all = (root, cls, out = []) => {
  for (const c of root.children) { if (c.classList.contains(cls)) out.push(c); all(c, cls, out); }
  return out;
};
const show = (el) => ({
  counter: all(el, "rv-counter")[0].textContent,
  caption: all(el, "rv-caption")[0].textContent,
  title: all(el, "rv-title")[0].textContent,
  nodes: all(el, "rv-node").map((g) =>
    [Number(g.getAttribute("data-id")), g.style.transform, g.getAttribute("class")]),
  edges: all(el, "rv-edge").length,
  cells: all(el, "rv-cell").map((c) => c.getAttribute("class")),
});
"""

PLAY_ALL = r"""
const report = { frames: [] };
const bar = (cls) => all(el, cls)[0];
report.frames.push(show(el));
for (let i = 1; i < state._frames.length; i++) {
  bar("rv-fwd").fire("click");
  report.frames.push(show(el));
}
bar("rv-back").fire("click");
report.back = show(el).counter;
const g = all(el, "rv-node").find((x) => x.getAttribute("data-id") !== "0");
g.fire("mouseenter");
report.hover = {
  id: Number(g.getAttribute("data-id")),
  details: all(el, "rv-details")[0].textContent,
  lit: all(el, "hl").map((x) => x.getAttribute("class")),
};
const cell = all(el, "rv-cell").findIndex((c) => !c.getAttribute("class").includes("free"));
all(el, "rv-cell")[cell].fire("mouseenter");
report.cellHover = { cell, details: all(el, "rv-details")[0].textContent };
const slider = bar("rv-slider");
slider.value = 0; slider.fire("input");
report.afterSlider = [state.step, show(el).counter];
state.interval_ms = 5;
bar("rv-play").fire("click");
for (let waited = 0; bar("rv-play").textContent !== "▶" && waited < 20000; waited += 20) {
  await new Promise((r) => setTimeout(r, 20));  // until the player stops by itself
}
report.afterPlay = [state.step, bar("rv-play").textContent];
console.log(JSON.stringify(report));
"""


def run_node(tmp_path: Path, script: str) -> dict:
    path = tmp_path / "run.mjs"
    path.write_text(script)
    out = subprocess.run([NODE, str(path)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def model_js(state: dict) -> str:
    return f"""
const state = {json.dumps(state)};
const handlers = new Map();
const sent = [];
const model = {{
  get: (k) => state[k],
  set(k, v) {{
    if (state[k] === v) return;
    state[k] = v;
    (handlers.get(`change:${{k}}`) || []).forEach((f) => f());
  }},
  save_changes() {{}},
  send: (m) => sent.push(m),
  on(n, f) {{ handlers.set(n, [...(handlers.get(n) || []), f]); }},
  off(n, f) {{ handlers.set(n, (handlers.get(n) || []).filter((g) => g !== f)); }},
}};
const emit = (n, m) => (handlers.get(n) || []).forEach((f) => f(m));
"""


def check_played(report: dict, frames, totals=None) -> None:
    """What the headless DOM showed at each frame is that frame (``totals``: how many frames
    the player had at each point; all of them by default)."""
    totals = totals or [len(frames)] * len(frames)
    for shown, frame, total in zip(report["frames"], frames, totals, strict=True):
        assert shown["counter"] == f"{frame.index + 1} / {total}"
        assert shown["caption"] == frame.caption and shown["title"] == (frame.title or "")
        boxes = {i: (t, cls.split()) for i, t, cls in shown["nodes"]}
        assert set(boxes) == {n.id for n in frame.nodes}
        for n in frame.nodes:
            transform, classes = boxes[n.id]
            x, y = MARGIN + n.col * COL_W, MARGIN + n.depth * ROW_H
            assert transform == f"translate({x}px, {y}px)"
            assert n.state in classes and ("locked" in classes) == (n.lock_ref > 0)
        assert shown["edges"] == len(frame.nodes) - 1
        owners = frame.pool.owners()
        assert len(shown["cells"]) == len(owners)
        for cls, owner in zip(shown["cells"], owners, strict=True):
            if owner is None:
                assert cls == "rv-cell free"
            elif isinstance(owner, str):
                assert cls == "rv-cell request"
            else:
                assert frame.node(owner).state in cls.split()


@needs_node
def test_the_widget_plays_every_frame_headless(tmp_path, tokenizer):
    frames = scenario_frames(per="event", tokenizer=tokenizer)
    module = tmp_path / "radix_view.mjs"
    module.write_text((STATIC / "radix_view.js").read_text())
    view = RadixView(frames)
    state = {k: getattr(view, k) for k in ("_frames", "_labels", "step", "interval_ms")}
    state["duration_ms"] = view.duration_ms
    script = (
        f'import widget from "{module.as_uri()}";\n{DOM}{model_js(state)}'
        'const el = document.createElement("div");\n'
        "widget.render({ model, el });\n" + PLAY_ALL
    )
    report = run_node(tmp_path, script)
    check_played(report, frames)
    n = len(frames)
    assert report["back"] == f"{n - 1} / {n}"
    hovered = frames[n - 2].node(report["hover"]["id"])
    assert report["hover"]["details"].startswith(f"node {hovered.id} (parent {hovered.parent})")
    owned = frames[n - 2].pool.owners().count(hovered.id)
    assert len(report["hover"]["lit"]) == 1 + owned  # the node and its pool cells
    cell = report["cellHover"]["cell"]
    owner = frames[n - 2].pool.owners()[cell]
    ref = frames[n - 2].node(owner).lock_ref
    assert report["cellHover"]["details"].startswith(
        f"pool cell {cell}: node {owner}, ref count {ref} (its lock_ref)node {owner} (parent"
    )
    assert report["afterSlider"] == [0, f"1 / {n}"]
    assert report["afterPlay"] == [n - 1, "▶"]  # played to the end, then stopped


@needs_node
def test_live_messages_rebuild_the_same_frames_in_the_browser(tmp_path):
    bus = EventBus()
    cache = RadixCache(bus=bus)
    view = RadixView().attach(cache)
    sent = []
    view.send = sent.append  # what would go over the comm
    cache.insert([1, 2, 3, 4])
    cache.match_prefix([1, 2, 9])
    cache.insert([1, 2, 9])
    assert [m["start"] for m in sent] == [1, 2, 3, 4]
    module = tmp_path / "radix_view.mjs"
    module.write_text((STATIC / "radix_view.js").read_text())
    first = frames_to_wire(view.frames[:1])
    state = {"_frames": first["frames"], "_labels": first["labels"], "step": 0}
    state |= {"interval_ms": 900, "duration_ms": 450}
    script = (
        f'import widget from "{module.as_uri()}";\n{DOM}{model_js(state)}'
        'const el = document.createElement("div");\n'
        "widget.render({ model, el });\n"
        f"const messages = {json.dumps(sent)};\n"
        "const report = { hello: sent[0], frames: [] };\n"
        "emit('msg:custom', messages[2]);  // too early: frame 2 is missing, ignored\n"
        "for (const m of messages) { emit('msg:custom', m); report.frames.push(show(el)); }\n"
        "await new Promise((done) => setTimeout(done, 600));  // keep()'s half second\n"
        "report.stored = state._kept.frames.length;\n"
        "const reopened = document.createElement('div');  // the saved state, no kernel\n"
        "widget.render({ model: { ...model, send() {} }, el: reopened });\n"
        "report.reopened = show(reopened);\n"
        "console.log(JSON.stringify(report));\n"
    )
    report = run_node(tmp_path, script)
    # The frames that came as messages are in the model's state (``_kept``), which JupyterLab
    # saves: a live player saved, its kernel gone, reopened, showed only the frames it had
    # when displayed (found by a learner in chapter 08's live vLLM cell).
    assert report["stored"] == len(view.frames)
    check_played({"frames": [report["reopened"]]}, view.frames[-1:], totals=[len(view.frames)])
    assert report["hello"] == {"kind": "hello", "frames": 1, "labels": 0}
    # The view followed along: each message added one frame and showed it.
    check_played({"frames": report["frames"]}, view.frames[1:], totals=[2, 3, 4, 5])
    # A view displayed late says how many frames it has; the widget sends the rest.
    sent.clear()
    view._on_front_end_message(view, {"kind": "hello", "frames": 1}, [])
    assert [(m["start"], len(m["frames"])) for m in sent] == [(1, 4)]
    shown = {n.label.index for f in view.frames[1:] for n in f.nodes if n.label}
    assert {i for i, _ in sent[0]["labels"]} == shown


# ---------------------------------------------------------------------- live mode (Python)
def test_attach_gives_the_frames_of_the_recorded_events():
    bus = EventBus()
    alloc = TokenToKVPoolAllocator(64, bus=bus)
    cache = RadixCache(token_to_kv_pool_allocator=alloc, bus=bus)
    recorder = EventRecorder(bus)
    view = RadixView().attach(cache)
    slots = alloc.alloc(5, owner="r0")
    cache.insert([1, 2, 3, 4, 5], slots)
    idx, node = cache.match_prefix([1, 2, 7])
    cache.inc_lock_ref(node)
    cache.evict(100)
    view.detach()
    cache.dec_lock_ref(node)  # after detach: no frame
    replayed = frames_from_events(recorder.events[:-1], pool_size=64)
    assert [f.to_dict() for f in view.frames] == [f.to_dict() for f in replayed]
    assert view.step == len(view.frames) - 1


def test_attach_refuses_a_cache_that_is_not_empty():
    cache = RadixCache()
    cache.insert([1, 2])
    with pytest.raises(ValueError, match="already holds tokens"):
        RadixView().attach(cache)
    view = RadixView().attach(RadixCache())
    with pytest.raises(RuntimeError):
        view.attach(RadixCache())
    with pytest.raises(TypeError):
        RadixView().attach(object())


def test_snapshot_mode_takes_frames_on_request():
    bus = EventBus()
    cache = RadixCache(bus=bus)
    view = RadixView().attach(bus, every_event=False)
    cache.insert([1, 2, 3])
    cache.insert([1, 2, 4])
    frame = view.snapshot("two inserts")
    assert len(view) == 2 and view[1] is frame and frame.title == "two inserts"
    # Node 1 was added, then cut by the second insert: every token here is new (green).
    assert [(n.id, n.num_tokens, n.state) for n in frame.live] == [
        (1, 2, "added"),
        (2, 1, "added"),
        (3, 1, "added"),
    ]
    assert [e.split()[0] for e in frame.events] == ["insert:", "split", "insert:"]
    assert frame.caption == "; ".join(frame.events)


# ---------------------------------------------------------------------- the HTML export
@pytest.fixture(scope="module")
def page(steps, tmp_path_factory):
    path = tmp_path_factory.mktemp("html") / "fig3.html"
    view = RadixView(steps, title="Figure 3 <replay>")
    assert view.to_html(path) == path
    return path.read_text(encoding="utf-8")


def test_html_export_is_standalone(page, steps):
    assert not re.search(r"""(src|href)\s*=\s*["']?https?:""", page)
    assert not re.search(r"""import\s*(\(|[^;]*from)\s*["']https?:""", page)
    assert "@import" not in page and "url(" not in page
    urls = set(re.findall(r"https?://[^\s\"'`)]+", page))
    assert urls <= {"http://www.w3.org/2000/svg"}  # the SVG namespace, not a download
    assert (STATIC / "radix_view.css").read_text() in page
    assert "Figure 3 &lt;replay&gt;" in page
    data = re.search(r'id="radix-view-data">(.*?)</script>', page, re.S).group(1)
    state = json.loads(data)
    wire = frames_to_wire(steps)
    assert state["_frames"] == json.loads(json.dumps(wire["frames"]))
    assert state["_labels"] == wire["labels"]


def test_html_data_cannot_close_its_script_tag():
    from viz.frame import Frame, NodeView, PoolView

    root = NodeView(0, None, 0, 0, 0, 0, 0, "idle", None)
    frame = Frame(0, 0, "</script><!--", "cap", (), (root,), PoolView(0, 1, ()))
    page = html_page([frame])
    assert page.count("</script>") == 2 and "<!--" not in page


@needs_node
def test_exported_page_plays_headless(page, steps, tmp_path):
    data = re.search(r'id="radix-view-data">(.*?)</script>', page, re.S).group(1)
    module = re.search(r'<script type="module">\n(.*)</script>', page, re.S).group(1)
    script = (
        f"{DOM}\n"
        f"byId['radix-view-data'] = {{ textContent: {json.dumps(data)} }};\n"
        "const el = document.createElement('div');\n"
        "byId['radix-view'] = el;\n"
        f"{module}\n"
        "const report = { frames: [] };\n"
        "for (let i = 0; i < state._frames.length; i++) {\n"
        "  report.frames.push(show(el)); all(el, 'rv-fwd')[0].fire('click');\n"
        "}\n"
        "console.log(JSON.stringify(report));\n"
    )
    check_played(run_node(tmp_path, script), steps)


# ---------------------------------------------------------------------- an engine run
def test_run_engine_shows_the_engines_tree_and_image_chips():
    from PIL import Image

    from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
    from minirad.kvcache.multimodal import hash_image

    model, processor = tiny_model("llava-llama"), tiny_llava_processor()
    engine = LLMEngine(model, processor, num_kv_slots=256)
    red = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), "red")
    blue = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), "blue")
    sp = SamplingParams(max_new_tokens=3)
    requests = [
        GenerateRequest("<s> w10 w11 <image> w12", [red], sp),
        GenerateRequest("<s> w10 w11 <image> w12", [blue], sp),
    ]
    view, outputs = run_engine(engine, requests)
    assert [o.finished for o in outputs] == [True, True]
    last = view.frames[-1]
    assert view.frames[0].title == "engine: requests queued"
    assert last.title.startswith("engine step ")
    real = {}
    stack = [engine.tree_cache.root_node]
    while stack:
        node = stack.pop()
        for c in node.children.values():
            real[c.id] = (node.id, len(c.key))
            stack.append(c)
    assert {n.id: (n.parent, n.num_tokens) for n in last.live} == real
    params = engine.input_processor.preprocess_params
    names = {f"img {hash_image(im, **params)[:6]}" for im in (red, blue)}
    chips = {name for n in last.live for _, _, name in n.label.images}
    assert chips == names  # the fork at the image boundary, both sides named by hash
    assert len(view.frames) == 1 + max(int(f.title.split()[-1]) for f in view.frames[1:])
