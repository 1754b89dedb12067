// The RadixView widget's front end: an anywidget ES module with no dependencies and no build.
//
// Python computes every frame (viz/frames.py) and sends them once: the traits `_frames` and
// `_labels` (a label is the text of one edge, shared by the frames that show it), and
// `_images` (image name -> a small PNG data URI, drawn on the edges that start with that
// image). Everything here is playback: play/pause, step, slider, speed, and the animations
// between two frames, with no round trip to the kernel.
//
// Nodes are SVG groups keyed by their stable id, so a node that moves slides (CSS transition
// on its transform), a new node grows in green, an accessed node flashes blue, a split's new
// node slides out of the node that was cut, an evicted node turns red, dashed, and fades.
// Geometry and colours are those of viz/svg.py (the static fallback): keep the two in step.
//
// Big trees: a frame with more than `max_nodes` nodes is drawn collapsed: the nodes this
// frame changed or locks, then the most recently used ones, each with its path to the root,
// up to `max_nodes`; every other subtree is folded into a "+k" mark under its nearest shown
// ancestor, and the empty columns are squeezed out. Only nodes whose data changed are
// touched in the DOM, so a step costs time proportional to what it changed.
//
// Live mode: Python sends {kind: "append", ...} messages with the frames computed since.
//
// Jump-forward: the tokens a grammar forced are marked on their edges (label.forced, runs of
// [offset, num_tokens]): teal text, and a teal bar under their share of the box.
//
// Tiers (a HiRadixCache: a node's KV on the device, in the host pool, on disk): a row of chips
// on each box's top edge, "dev" "host" (and "disk" once written there), filled where the KV is,
// hollow where it is not; a host-only node's box is dashed brown on a light brown fill. A
// backup pops the host chip in, a demotion empties the dev chip, a load-back fills it again
// (node.marks, from NodeView.tier_marks). The pool panel gains the host pool (frame.host_pool):
// brown cells, darker for host-only nodes than for backups of device nodes.

const NS = "http://www.w3.org/2000/svg";
const COL_W = 148, ROW_H = 64, BOX_W = 136, BOX_H = 38, MARGIN = 12;
const CELL = 10, CELL_PITCH = 12, CELLS_PER_ROW = 64, MAX_POOL_CELLS = 2048;
const THUMB = 26; // px, the image drawn on an edge that starts with an image
// Node text is TEXT_PX (radix_view.css); "fit" shrinks the drawing to the width available but
// never makes that text smaller than the trait fit_min_text_px (MIN_TEXT_PX by default: a wider
// tree scrolls sideways instead). A player beside another (viz/beside.py) sets it to 0: there
// fit draws the whole tree, as small as that takes (a node's full text shows on hover).
const TEXT_PX = 12, MIN_TEXT_PX = 11;
const SPEEDS = [0.5, 1, 2, 4];
const STATES = ["added", "accessed", "split", "evicted", "idle"];
const ANIMATED = ["added", "accessed", "evicted", "split"];
const TIERS = ["device", "host", "disk"];
const TIER_MARKS = ["backed_up", "stored", "demoted", "loaded_back", "recomputed", "host_evicted", "prefetched"];
const CHIP_TEXT = { device: "dev", host: "host", disk: "disk" };
// Tier chips: on the box's top edge, left of where the edge from the parent comes in (BOX_W / 2).
const CHIP_W = 20, CHIP_H = 11, CHIP_X = 2, CHIP_GAP = 1;

function svgEl(tag, attrs, parent) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (parent) parent.appendChild(e);
  return e;
}

function htmlEl(tag, cls, parent, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}

// A node arrives as a list (viz/frames.py NodeView.to_wire): a tree per frame, kept small.
const plural = (n, noun) => `${n} ${noun}${n === 1 ? "" : "s"}`;
// A cache without tiers sends 10 fields: tiers is null and marks empty.
const unpackNode = ([id, parent, col, depth, n, lock, last, state, label, extra_key, tiers = null, marks = []]) =>
  ({ id, parent, col, depth, n, lock, last, state, label, extra_key, tiers, marks });
const unpackFrame = (f) => ({ ...f, nodes: f.nodes.map(unpackNode) });
const sameNode = (a, b) => a.parent === b.parent && a.col === b.col && a.depth === b.depth &&
  a.n === b.n && a.lock === b.lock && a.last === b.last && a.state === b.state &&
  a.label === b.label && a.extra_key === b.extra_key && String(a.tiers) === String(b.tiers) &&
  String(a.marks) === String(b.marks);
const hostOnly = (n) => n.tiers !== null && !n.tiers.includes("device");

// Screen position of a node's box: its layout cell, or its squeezed column when collapsed.
const boxX = (n) => MARGIN + n.x * COL_W;
const boxY = (n) => MARGIN + n.depth * ROW_H;

function edgeEnds(p, c) {
  return [boxX(p) + BOX_W / 2, boxY(p) + BOX_H, boxX(c) + BOX_W / 2, boxY(c)];
}

function edgePath(p, c) {
  const [x1, y1, x2, y2] = edgeEnds(p, c);
  const ym = (y1 + y2) / 2;
  return `M${x1},${y1} C${x1},${ym} ${x2},${ym} ${x2},${y2}`;
}

// Restart CSS animations: drop the classes, force one style flush, add them back. Batched
// (one flush per frame drawn, not one per node: each flush restyles the whole drawing).
function restartAnimations(pending, flushEl) {
  if (!pending.length) return;
  for (const [el, cls] of pending) el.classList.remove(cls);
  void flushEl.getBoundingClientRect();
  for (const [el, cls] of pending) el.classList.add(cls);
  pending.length = 0;
}

// The nodes to draw for frame `f`: all of them, or (more than `max` nodes) the frame's
// changed (a tier move too), locked and pinned nodes, then those of `before` (the nodes drawn for the previous
// frame: a step keeps what was on screen, so little moves), then the most recently accessed
// ones, each with its ancestors, up to `max`.
// Returns {nodes, folded: id -> hidden descendants, x: id -> screen column}.
function visibleNodes(f, max, pinned, before) {
  if (f.nodes.length <= max) {
    const x = new Map(f.nodes.map((n) => [n.id, n.col]));
    return { nodes: f.nodes, folded: new Map(), x };
  }
  const byId = new Map(f.nodes.map((n) => [n.id, n]));
  const keep = new Set();
  const add = (n) => {
    for (; n && !keep.has(n.id); n = byId.get(n.parent)) keep.add(n.id);
  };
  add(byId.get(0));
  for (const n of f.nodes) if (n.state !== "idle" || n.lock > 0 || n.marks.length || n.id === pinned) add(n);
  const cold = f.nodes.filter((n) => !keep.has(n.id));
  const hot = (n) => (before.has(n.id) ? 1 : 0);
  cold.sort((a, b) => hot(b) - hot(a) || b.last - a.last || a.depth - b.depth || a.id - b.id);
  for (const n of cold) {
    if (keep.size >= max) break;
    add(n);
  }
  // Each hidden node counts towards the fold mark of its nearest shown ancestor (parents
  // are resolved first: by depth, not by id, since a split's new node is an older node's
  // parent).
  const anchor = new Map();
  const folded = new Map();
  for (const n of [...f.nodes].sort((a, b) => a.depth - b.depth)) {
    if (keep.has(n.id)) { anchor.set(n.id, n.id); continue; }
    const a = anchor.get(n.parent);
    anchor.set(n.id, a);
    folded.set(a, (folded.get(a) || 0) + 1);
  }
  const nodes = f.nodes.filter((n) => keep.has(n.id));
  // Squeeze out the columns no shown node uses; the order of columns (and so the layout's
  // left-to-right order of subtrees) is kept.
  const cols = [...new Set(nodes.map((n) => n.col))].sort((a, b) => a - b);
  const rank = new Map(cols.map((c, i) => [c, i]));
  const x = new Map(nodes.map((n) => [n.id, rank.get(n.col)]));
  return { nodes, folded, x };
}

function render({ model, el }) {
  let raw = [...model.get("_frames")]; // wire frames, unpacked on demand (see frame())
  let labels = [...model.get("_labels")];
  const kept = model.get("_kept"); // frames a live player received, saved (see keep())
  if (kept && kept.frames.length > raw.length) {
    raw = [...kept.frames];
    labels = [...kept.labels];
  }
  let thumbs = model.get("_images") || {};
  const maxNodes = () => model.get("max_nodes") || 300;
  let index = 0, shown = -1, timer = null, pinned = null;
  let ext = { cols: 1, rows: 1 }, sized = 0; // drawing size: the largest seen so far
  let cur = { cols: 1, rows: 1 }; // the size of the frame on screen
  let scale = 1, availW = 0; // screen px per drawing unit; the width the drawing may take
  const cache = new Map(); // index -> unpacked frame (the few most recent)
  const nodes = new Map(); // id -> {g, box, head, text, badge, badgeText, title, fold, ...}
  const edges = new Map(); // child id -> {path, cut, thumb, thumbImg, image}
  const pending = []; // [element, animation class] to restart once the frame is drawn

  function frame(i) {
    let f = cache.get(i);
    if (!f) {
      f = unpackFrame(raw[i]);
      if (cache.size >= 4) cache.delete(cache.keys().next().value);
      cache.set(i, f);
    }
    return f;
  }

  // ---------------------------------------------------------------- the DOM
  const root = htmlEl("div", "radix-view", el);
  const bar = htmlEl("div", "rv-bar", root);
  const button = (cls, text, title) => {
    const b = htmlEl("button", `rv-btn ${cls}`, bar, text);
    b.title = title;
    return b;
  };
  const firstBtn = button("rv-first", "|◀", "first frame");
  const backBtn = button("rv-back", "◀", "step back");
  const playBtn = button("rv-play", "▶", "play / pause");
  const fwdBtn = button("rv-fwd", "▶|", "step forward");
  const slider = htmlEl("input", "rv-slider", bar);
  slider.type = "range";
  slider.min = 0;
  const counter = htmlEl("span", "rv-counter", bar);
  const speedSel = htmlEl("select", "rv-speed", bar);
  for (const s of SPEEDS) {
    const o = htmlEl("option", "", speedSel, `${s}×`);
    o.value = s;
    o.selected = s === 1;
  }
  const fit = htmlEl("label", "rv-fit", bar);
  const fitBox = htmlEl("input", "", fit);
  fitBox.type = "checkbox";
  fitBox.checked = true;
  fit.append(" fit");
  // A live source's state ("listening on ...", "server restarted: view cleared"), if any.
  const statusDiv = htmlEl("div", "rv-status", root);
  const showStatus = () => {
    statusDiv.textContent = model.get("status") || "";
    statusDiv.hidden = !statusDiv.textContent;
  };
  showStatus();
  const titleDiv = htmlEl("div", "rv-title", root);
  const captionDiv = htmlEl("div", "rv-caption", root);
  const eventsBox = htmlEl("details", "rv-events", root);
  const eventsSummary = htmlEl("summary", "", eventsBox);
  const eventsList = htmlEl("ol", "", eventsBox);
  const treeWrap = htmlEl("div", "rv-tree-wrap", root);
  const tree = svgEl("svg", { class: "rv-tree" }, treeWrap);
  // Shown when the tree is wider than the view: "fit" is off, or it keeps the text at its floor.
  const scrollHint = htmlEl("div", "rv-scroll-hint", root);
  const edgeLayer = svgEl("g", { class: "rv-edges" }, tree);
  const nodeLayer = svgEl("g", { class: "rv-nodes" }, tree);
  const thumbLayer = svgEl("g", { class: "rv-thumbs" }, tree);
  // The device pool, and the host pool of a cache with tiers (drawn only for such frames).
  const makePool = (headCls, svgCls, cellCls) => ({
    head: htmlEl("div", headCls, root),
    svg: svgEl("svg", { class: svgCls }, root),
    cellCls, cells: [], group: 1, owners: [],
  });
  const pools = {
    device: makePool("rv-pool-head", "rv-pool", "rv-cell"),
    host: makePool("rv-pool-head rv-host-head", "rv-pool rv-host-pool", "rv-hcell"),
  };
  const details = htmlEl("div", "rv-details", root, "Hover over a node or a pool cell.");
  const legend = htmlEl("div", "rv-legend", root);
  const legendItems = {};
  const LEGEND = ["added", "accessed", "split", "evicted", "idle", "locked", "request", "free", "forced",
    "host-only", "tier-device", "tier-host", "tier-disk"];
  const LEGEND_TEXT = { "tier-device": "dev: on device", "tier-host": "host: in host pool", "tier-disk": "disk: on disk" };
  for (const s of LEGEND) {
    const item = htmlEl("span", "rv-legend-item", legend);
    htmlEl("span", `rv-swatch ${s}`, item);
    item.append(LEGEND_TEXT[s] || s);
    legendItems[s] = item;
  }
  // "forced" only where a grammar forced tokens (a label has forced runs); the tiers only for
  // a cache with tiers (its frames have a host pool).
  const showForcedLegend = () => {
    legendItems.forced.hidden = !labels.some((l) => l && l.forced && l.forced.length);
    const tiered = raw.some((f) => f.host_pool);
    for (const s of ["host-only", "tier-device", "tier-host", "tier-disk"]) legendItems[s].hidden = !tiered;
  };
  showForcedLegend();

  // ---------------------------------------------------------------- drawing
  // The drawing keeps one scale while it plays (no zooming from frame to frame), set by the
  // extent of every frame drawn uncollapsed, and of each collapsed frame once drawn; the
  // canvas is only as big as the frame on screen (a small tree leaves no empty space).
  function grow(cols, rows) {
    if (cols <= ext.cols && rows <= ext.rows) return false;
    ext = { cols: Math.max(ext.cols, cols), rows: Math.max(ext.rows, rows) };
    return true;
  }

  function sizeTree(force) {
    let changed = force;
    for (; sized < raw.length; sized++) {
      const f = raw[sized];
      if (f.nodes.length > maxNodes()) continue;
      let cols = 1, rows = 1;
      for (const n of f.nodes) {
        cols = Math.max(cols, n[2] + 1);
        rows = Math.max(rows, n[3] + 1);
      }
      changed = grow(cols, rows) || changed;
    }
    slider.max = Math.max(raw.length - 1, 0);
    if (changed) place();
  }

  const width = (cols) => 2 * MARGIN + cols * COL_W;
  const height = (rows) => 2 * MARGIN + (rows - 1) * ROW_H + BOX_H;

  // The smallest node text "fit" draws, in px (0: fit always draws the whole tree's width).
  const minTextPx = () => {
    const px = Number(model.get("fit_min_text_px"));
    return Number.isFinite(px) && px >= 0 ? px : MIN_TEXT_PX;
  };

  function place() {
    const fitted = Math.min(1, availW / width(ext.cols));
    const floor = Math.min(1, minTextPx() / TEXT_PX);
    scale = fitBox.checked && availW > 0 ? Math.max(floor, fitted) : 1;
    const w = width(cur.cols), h = height(cur.rows);
    // Rounded up (text never under its floor), but not for a float's last bit: a drawing
    // fitted to the view is never a pixel wider than it.
    const shownW = Math.ceil(w * scale - 1e-6), shownH = Math.ceil(h * scale - 1e-6);
    tree.setAttribute("viewBox", `0 0 ${w} ${h}`);
    tree.style.width = `${shownW}px`;
    tree.style.height = `${shownH}px`;
    scrollHint.hidden = !(availW > 0 && shownW > availW);
    scrollHint.textContent = fitBox.checked
      ? `wider than the view: scroll sideways → (fit keeps node text at ${minTextPx()} px or more)`
      : "wider than the view: scroll sideways →, or tick fit";
  }

  // The width the output area gives the drawing is known once the view is on the page, and
  // changes with the window.
  const resized = new ResizeObserver(() => {
    if (treeWrap.clientWidth === availW) return;
    availW = treeWrap.clientWidth;
    place();
  });
  resized.observe(treeWrap);

  // A node: the group `g` is placed (its transform slides), `body` holds what is drawn (it
  // grows in as a whole when the node is new).
  function makeNode(n) {
    const g = svgEl("g", { class: "rv-node", "data-id": n.id }, nodeLayer);
    const r = { g, label: -1, lock: 0, pos: "", data: null, fold: null };
    r.title = svgEl("title", {}, g);
    const body = svgEl("g", { class: "rv-body" }, g);
    r.body = body;
    if (n.id === 0) {
      r.box = svgEl("circle", { class: "rv-box", cx: BOX_W / 2, cy: BOX_H / 2, r: 16 }, body);
      svgEl("text", { x: BOX_W / 2, y: BOX_H / 2 + 4, "text-anchor": "middle" }, body).textContent = "root";
      g.classList.add("root");
      return r;
    }
    r.box = svgEl("rect", { class: "rv-box", width: BOX_W, height: BOX_H, rx: 6 }, body);
    r.imageBar = svgEl("rect", { class: "rv-image-bar", x: 0, y: 3, width: 4, height: BOX_H - 6 }, body);
    r.head = svgEl("text", { class: "rv-head", x: 8, y: 15 }, body);
    r.text = svgEl("text", { class: "rv-text", x: 8, y: 31 }, body);
    r.forcedBars = svgEl("g", { class: "rv-forced-bars" }, body);
    // Tier chips (caches with tiers): built on the first frame that has tiers.
    r.chips = null;
    r.badge = svgEl("g", { class: "rv-badge", transform: `translate(${BOX_W - 11},11)` }, body);
    svgEl("circle", { r: 9 }, r.badge);
    r.badgeText = svgEl("text", { y: 4, "text-anchor": "middle" }, r.badge);
    g.addEventListener("mouseenter", () => highlight(n.id));
    g.addEventListener("mouseleave", () => highlight(pinned));
    g.addEventListener("click", () => {
      pinned = pinned === n.id ? null : n.id;
      highlight(pinned);
    });
    return r;
  }

  // The "+k" mark under a node whose subtree is partly hidden (collapsed frames only).
  function setFold(r, hidden) {
    if (!hidden) {
      if (r.fold) r.fold.style.display = "none";
      return;
    }
    if (!r.fold) {
      r.fold = svgEl("text", { class: "rv-fold", x: BOX_W / 2, y: BOX_H + 13, "text-anchor": "middle" }, r.g);
    }
    r.fold.style.display = "";
    r.fold.textContent = `+${hidden} hidden`;
  }

  // The chips "dev" "host" "disk" on the box's top edge: filled (class "on") where the KV is.
  function setChips(r, n) {
    if (n.tiers === null) {
      if (r.chips) r.chips.g.style.display = "none";
      return;
    }
    if (!r.chips) {
      const g = svgEl("g", { class: "rv-tiers" }, r.body);
      r.chips = { g };
      TIERS.forEach((t, i) => {
        const chip = svgEl("g", { class: `rv-tier-chip ${t}`, transform: `translate(${CHIP_X + i * (CHIP_W + CHIP_GAP)},${1 - CHIP_H})` }, g);
        svgEl("rect", { width: CHIP_W, height: CHIP_H, rx: 3 }, chip);
        svgEl("text", { class: "rv-chip-text", x: CHIP_W / 2, y: CHIP_H - 2.5, "text-anchor": "middle" }, chip).textContent = CHIP_TEXT[t];
        r.chips[t] = chip;
      });
    }
    r.chips.g.style.display = "";
    for (const t of TIERS) {
      const on = n.tiers.includes(t);
      r.chips[t].classList.toggle("on", on);
      // The disk chip only for a node whose pages reached the disk tier.
      r.chips[t].style.display = t === "disk" && !on ? "none" : "";
    }
  }

  function updateNode(r, n, animate) {
    const g = r.g;
    for (const s of STATES) g.classList.toggle(s, n.state === s);
    g.classList.toggle("locked", n.lock > 0);
    for (const t of TIERS) g.classList.toggle(`tier-${t}`, n.tiers !== null && n.tiers.includes(t));
    g.classList.toggle("host-only", hostOnly(n));
    for (const m of TIER_MARKS) g.classList.toggle(`mark-${m}`, n.marks.includes(m));
    r.data = n;
    if (n.id === 0) return;
    setChips(r, n);
    const label = labels[n.label];
    if (r.label !== n.label) {
      r.label = n.label;
      r.text.replaceChildren();
      for (const [kind, t] of label.parts) {
        const cls = kind === "image" ? "rv-chip" : kind === "forced" ? "rv-forced" : "";
        svgEl("tspan", { class: cls }, r.text).textContent = t;
      }
      r.imageBar.style.display = startsWithImage(label) ? "" : "none";
      r.forcedBars.replaceChildren();
      for (const [offset, k] of label.forced || []) {
        const x0 = Math.floor((BOX_W * offset) / n.n), x1 = Math.floor((BOX_W * (offset + k)) / n.n);
        svgEl("rect", { class: "rv-forced-bar", x: x0, y: BOX_H - 5, width: Math.max(x1 - x0, 2), height: 4 }, r.forcedBars);
      }
    }
    r.head.textContent = n.state === "evicted"
      ? `#${n.id}  evicted  ${n.n} tok`
      : `${n.state === "split" ? "✂ " : ""}#${n.id}  ${n.n} tok  t=${n.last}`;
    let hover = `node ${n.id}: ${plural(n.n, "token")}, lock_ref ${n.lock}, last access ${n.last}`;
    if (n.extra_key !== null) hover += `, extra_key ${n.extra_key}`;
    const forced = numForced(label);
    if (forced) hover += `, ${plural(forced, "forced token")} (jump-forward)`;
    if (n.tiers !== null) hover += `, KV on ${n.tiers.join(" + ")}`;
    if (n.marks.length) hover += ` (${n.marks.join(", ").replaceAll("_", " ")})`;
    r.title.textContent = `${hover}\n${label.full}`;
    r.badge.style.display = n.lock > 0 ? "" : "none";
    r.badgeText.textContent = n.lock;
    r.badge.classList.remove("up", "down");
    if (animate && n.lock !== r.lock) pending.push([r.badge, n.lock > r.lock ? "up" : "down"]);
    r.lock = n.lock;
    g.classList.remove(...ANIMATED.map((s) => `anim-${s}`), ...TIER_MARKS.map((m) => `anim-${m}`));
    if (animate && ANIMATED.includes(n.state)) pending.push([g, `anim-${n.state}`]);
    if (animate) for (const m of n.marks) pending.push([g, `anim-${m}`]);
  }

  const startsWithImage = (label) => label.images.length > 0 && label.images[0][0] === 0;
  const numForced = (label) => (label.forced || []).reduce((sum, [, k]) => sum + k, 0);

  function drawTree(f, animate) {
    const view = visibleNodes(f, maxNodes(), pinned, animate ? new Set(nodes.keys()) : new Set());
    const byId = new Map(view.nodes.map((n) => [n.id, n]));
    let cols = 1, rows = 1;
    for (const n of view.nodes) {
      n.x = view.x.get(n.id);
      cols = Math.max(cols, n.x + 1);
      rows = Math.max(rows, n.depth + 1);
    }
    const grew = view.nodes !== f.nodes && grow(cols, rows);
    if (grew || cols !== cur.cols || rows !== cur.rows) {
      cur = { cols, rows };
      place();
    }
    for (const n of view.nodes) {
      let r = nodes.get(n.id);
      const pos = `translate(${boxX(n)}px, ${boxY(n)}px)`;
      if (!r) {
        r = makeNode(n);
        nodes.set(n.id, r);
        // A split's new node slides out of the node that was cut (its parent, as it was).
        const from = animate && n.state === "split" && nodes.get(n.parent);
        if (from && from.pos) {
          r.g.style.transform = from.pos;
          void r.g.getBoundingClientRect();
        }
      }
      if (r.pos !== pos) {
        r.pos = pos;
        r.g.style.transform = pos;
      }
      // An idle node that was idle and is unchanged needs nothing (most of a big tree).
      const same = r.data && sameNode(r.data, n) && n.state === "idle";
      if (!same) updateNode(r, n, animate);
      else r.data = n;
      setFold(r, view.folded.get(n.id) || 0);
    }
    for (const [id, r] of nodes) if (!byId.has(id)) { r.g.remove(); nodes.delete(id); }
    for (const n of view.nodes) {
      if (n.parent === null) continue;
      let e = edges.get(n.id);
      const fresh = !e;
      if (fresh) {
        e = { path: svgEl("path", { class: "rv-edge" }, edgeLayer), d: "", cls: "" };
        e.cut = svgEl("text", { class: "rv-cut" }, edgeLayer);
        e.cut.textContent = "✂";
        edges.set(n.id, e);
      }
      const p = byId.get(n.parent);
      const d = `path("${edgePath(p, n)}")`;
      if (e.d !== d) {
        e.d = d;
        e.path.style.d = d;
      }
      const label = labels[n.label];
      const image = startsWithImage(label);
      const cls = ["rv-edge"];
      if (n.lock > 0 && n.state !== "evicted") cls.push("locked");
      if (n.state === "evicted") cls.push("evicted");
      if (image) cls.push("image");
      if (fresh && animate) cls.push("anim-new");
      if (e.cls !== cls.join(" ")) {
        e.cls = cls.join(" ");
        e.path.setAttribute("class", e.cls);
      }
      const cut = n.state === "split";
      e.cut.style.display = cut ? "" : "none";
      if (cut) {
        e.cut.setAttribute("x", boxX(p) + BOX_W / 2 + 6);
        e.cut.setAttribute("y", boxY(p) + BOX_H + 14);
      }
      drawThumb(e, image ? thumbs[label.images[0][2]] : undefined, p, n, fresh && animate);
    }
    for (const [id, e] of edges) {
      if (byId.has(id)) continue;
      e.path.remove();
      e.cut.remove();
      if (e.thumb) e.thumb.remove();
      edges.delete(id);
    }
    restartAnimations(pending, tree);
  }

  // The picture of an image span, at the middle of the edge that starts with it: a fork at
  // an image boundary shows as two edges with two different pictures.
  function drawThumb(e, src, p, n, fresh) {
    if (!src) {
      if (e.thumb) e.thumb.style.display = "none";
      return;
    }
    if (!e.thumb) {
      e.thumb = svgEl("g", { class: "rv-thumb" }, thumbLayer);
      svgEl("rect", { x: -1, y: -1, width: THUMB + 2, height: THUMB + 2, rx: 3 }, e.thumb);
      e.thumbImg = svgEl("image", { width: THUMB, height: THUMB, preserveAspectRatio: "xMidYMid slice" }, e.thumb);
      e.thumbPos = "";
    }
    e.thumb.style.display = "";
    if (e.src !== src) {
      e.src = src;
      e.thumbImg.setAttribute("href", src);
    }
    const [x1, y1, x2, y2] = edgeEnds(p, n);
    const pos = `translate(${(x1 + x2 - THUMB) / 2}px, ${(y1 + y2 - THUMB) / 2}px)`;
    if (e.thumbPos !== pos) {
      e.thumbPos = pos;
      e.thumb.style.transform = pos;
    }
    e.thumb.classList.toggle("evicted", n.state === "evicted");
    if (fresh) pending.push([e.thumb, "anim-new"]);
  }

  // One cell per page; a pool of more than MAX_POOL_CELLS pages is drawn with one cell per
  // `group` pages, coloured by the first page in it that is in use.
  function drawCells(p, pv, byId, cellClass) {
    const owners = [];
    for (const [, n, owner] of pv.runs) for (let i = 0; i < n; i++) owners.push(owner);
    p.owners = owners;
    const group = Math.max(1, Math.ceil(owners.length / MAX_POOL_CELLS));
    const count = Math.ceil(owners.length / group);
    if (p.cells.length !== count || p.group !== group) {
      p.svg.replaceChildren();
      p.group = group;
      p.cells = Array.from({ length: count }, (_, i) => {
        const c = svgEl("rect", {
          class: p.cellCls,
          x: MARGIN + (i % CELLS_PER_ROW) * CELL_PITCH,
          y: 2 + Math.floor(i / CELLS_PER_ROW) * CELL_PITCH,
          width: CELL, height: CELL,
        }, p.svg);
        c.cls = p.cellCls;
        c.addEventListener("mouseenter", () => highlight(c.owner, i, p));
        c.addEventListener("mouseleave", () => highlight(pinned));
        return c;
      });
      const rows = Math.ceil(count / CELLS_PER_ROW);
      p.svg.setAttribute("width", 2 * MARGIN + CELLS_PER_ROW * CELL_PITCH);
      p.svg.setAttribute("height", 4 + rows * CELL_PITCH);
    }
    p.cells.forEach((c, i) => {
      let owner = owners[i * group];
      for (let k = i * group + 1; owner === null && k < Math.min((i + 1) * group, owners.length); k++) {
        owner = owners[k];
      }
      c.owner = owner;
      const cls = `${p.cellCls} ${cellClass(owner, byId.get(owner))}${c.classList.contains("hl") ? " hl" : ""}`;
      if (c.cls !== cls) {
        c.cls = cls;
        c.setAttribute("class", cls);
      }
    });
    return owners;
  }

  function showPool(p, on) {
    p.svg.style.display = on ? "" : "none";
    p.head.hidden = !on;
    if (!on) p.owners = [];
  }

  function drawPool(f) {
    const byId = new Map(f.nodes.map((n) => [n.id, n]));
    const per = (p) => (p.group > 1 ? ` (a cell per ${p.group})` : "");
    const unit = (pv) => (pv.page_size === 1 ? "slots" : `pages of ${pv.page_size} tokens`);
    // A source without a pool (a vLLM server's KV events carry no slots): no pool panel.
    const dev = pools.device, hasPool = f.pool.cells > 0;
    showPool(dev, hasPool);
    if (hasPool) {
      const owners = drawCells(dev, f.pool, byId, (owner, n) => {
        if (owner === null) return "free";
        if (typeof owner === "string") return "request";
        return `${n ? n.state : "idle"}${n && n.lock > 0 ? " locked" : ""}`;
      });
      const used = { tree: 0, request: 0, free: 0 };
      for (const owner of owners) {
        used[owner === null ? "free" : typeof owner === "string" ? "request" : "tree"] += 1;
      }
      // The counts are cells (slots or pages), not requests: say who holds them.
      const name = f.host_pool ? "Device KV pool" : "KV pool";
      dev.head.textContent = `${name}: ${f.pool.cells} ${unit(f.pool)}${per(dev)}: ${used.tree} in the tree, ` +
        `${used.request} held by running requests, ${used.free} free`;
    }
    // The host pool (a cache with tiers): the pages of the nodes' host copies.
    const host = pools.host, hasHost = Boolean(f.host_pool && f.host_pool.cells > 0);
    showPool(host, hasHost);
    if (!hasHost) return;
    const used = { copy: 0, only: 0, free: 0 };
    const owners = drawCells(host, f.host_pool, byId, (owner, n) => {
      if (owner === null) return "free";
      const fresh = n && (n.marks.includes("backed_up") || n.marks.includes("prefetched"));
      return `${n && hostOnly(n) ? "host-only" : "host-copy"}${fresh ? " fresh" : ""}`;
    });
    for (const owner of owners) {
      const n = owner === null ? null : byId.get(owner);
      used[owner === null ? "free" : n && hostOnly(n) ? "only" : "copy"] += 1;
    }
    host.head.textContent = `Host pool: ${f.host_pool.cells} ${unit(f.host_pool)}${per(host)}: ` +
      `${used.copy} back up device nodes, ${used.only} hold host-only nodes, ${used.free} free`;
  }

  // Hovered or pinned node: its box and its pool cells (both pools) light up together.
  function highlight(owner, cell, p = pools.device) {
    const f = shown >= 0 ? frame(shown) : null;
    for (const [id, r] of nodes) r.g.classList.toggle("hl", id === owner);
    for (const q of Object.values(pools)) {
      q.cells.forEach((c) => {
        const on = owner !== null && c.owner === owner;
        if (on !== c.classList.contains("hl")) {
          c.classList.toggle("hl", on);
          c.cls = c.getAttribute("class");
        }
      });
    }
    const n = f && typeof owner === "number" ? f.nodes.find((m) => m.id === owner) : null;
    details.replaceChildren();
    if (cell !== undefined) {
      const hostCell = p === pools.host;
      // A cell's reference count: the requests using its node (lock_ref), or the one request
      // that holds it. A host pool cell: the node whose host copy is there.
      const who = owner === null ? (hostCell ? "free" : "free, ref count 0")
        : typeof owner === "string" ? `held by running request ${owner}, ref count 1`
        : hostCell ? `host copy of node ${owner}${n && hostOnly(n) ? " (host-only)" : ""}`
        : `node ${owner}, ref count ${n ? n.lock : 0} (its lock_ref)`;
      const name = hostCell ? "host pool cell" : "pool cell";
      const where = p.group === 1 ? `${name} ${cell}`
        : `${name}s ${cell * p.group}-${Math.min((cell + 1) * p.group, p.owners.length) - 1}`;
      htmlEl("div", "", details, `${where}: ${who}`);
    }
    if (n && n.id !== 0) {
      const label = labels[n.label];
      const count = pools.device.owners.filter((o) => o === n.id).length;
      let about = `node ${n.id} (parent ${n.parent}): ${plural(n.n, "token")}, lock_ref ${n.lock}, ` +
        `last access t=${n.last}, state ${n.state}, ${count} pool cells`;
      if (n.tiers !== null) {
        const hostCount = pools.host.owners.filter((o) => o === n.id).length;
        about += `, ${hostCount} host pool cells; KV on ${n.tiers.join(" + ")}`;
        if (n.marks.length) about += ` (this frame: ${n.marks.join(", ").replaceAll("_", " ")})`;
      }
      htmlEl("div", "", details, about);
      if (label.images.length) {
        const spans = label.images.map(([o, k, name]) => `${name} (${plural(k, "token")} at ${o})`);
        const line = htmlEl("div", "rv-chip", details, `images: ${spans.join(", ")}`);
        for (const [, , name] of label.images) {
          if (!thumbs[name]) continue;
          const img = htmlEl("img", "rv-detail-thumb", line);
          img.src = thumbs[name];
          img.alt = name;
        }
      }
      const forced = numForced(label);
      if (forced) {
        const runs = label.forced.map(([o, k]) => `${plural(k, "token")} at ${o}`);
        htmlEl("div", "rv-forced", details, `forced by the grammar (jump-forward): ${runs.join(", ")}`);
      }
      htmlEl("pre", "", details, label.full);
      const more = n.n > label.tokens.length ? " …" : "";
      htmlEl("div", "rv-tokens", details, `token ids: ${label.tokens.join(" ")}${more}`);
    } else if (cell === undefined) {
      details.textContent = "Hover over a node or a pool cell (click a node to pin it).";
    }
  }

  function draw(i) {
    if (!raw.length) {
      captionDiv.textContent = "no frames yet";
      return;
    }
    const f = frame(i);
    const animate = shown >= 0 && shown < raw.length && Math.abs(i - shown) === 1;
    root.classList.toggle("rv-instant", !animate);
    const speed = Number(speedSel.value);
    const dur = Math.min(model.get("duration_ms"), (0.8 * model.get("interval_ms")) / speed);
    root.style.setProperty("--rv-dur", `${Math.round(dur)}ms`);
    drawTree(f, animate);
    drawPool(f);
    shown = i;
    slider.value = i;
    counter.textContent = `${i + 1} / ${raw.length}`;
    titleDiv.textContent = f.title || "";
    captionDiv.textContent = f.caption;
    eventsSummary.textContent = `${f.events.length} event${f.events.length === 1 ? "" : "s"} (t=${f.time})`;
    eventsList.replaceChildren(...f.events.map((e) => htmlEl("li", "", null, e)));
    highlight(pinned);
  }

  // ---------------------------------------------------------------- playback
  function go(i) {
    index = Math.max(0, Math.min(i, raw.length - 1));
    draw(index);
    if (model.get("step") !== index) {
      model.set("step", index);
      model.save_changes();
    }
  }

  function stop() {
    clearTimeout(timer);
    timer = null;
    playBtn.textContent = "▶";
  }

  function tick() {
    if (index >= raw.length - 1) return stop();
    go(index + 1);
    timer = setTimeout(tick, model.get("interval_ms") / Number(speedSel.value));
  }

  playBtn.addEventListener("click", () => {
    if (timer) return stop();
    if (index >= raw.length - 1) go(0);
    playBtn.textContent = "❚❚";
    timer = setTimeout(tick, model.get("interval_ms") / Number(speedSel.value));
  });
  firstBtn.addEventListener("click", () => { stop(); go(0); });
  backBtn.addEventListener("click", () => { stop(); go(index - 1); });
  fwdBtn.addEventListener("click", () => { stop(); go(index + 1); });
  slider.addEventListener("input", () => { stop(); go(Number(slider.value)); });
  fitBox.addEventListener("change", place);

  const onStep = () => {
    const s = model.get("step");
    if (s !== index && s < raw.length) { index = s; draw(s); }
  };
  const reload = () => {
    raw = [...model.get("_frames")];
    labels = [...model.get("_labels")];
    thumbs = model.get("_images") || {};
    cache.clear();
    showForcedLegend();
    shown = -1;
    ext = { cols: 1, rows: 1 };
    sized = 0;
    sizeTree(true);
    go(Math.min(model.get("step"), raw.length - 1));
  };
  const onMessage = (msg) => {
    // A view that appeared late has asked for what it missed (see "hello" below); until the
    // answer comes, later frames cannot be placed.
    if (!msg || msg.kind !== "append" || msg.start > raw.length) return;
    const follow = index >= raw.length - 1;
    raw.length = msg.start;
    for (const f of msg.frames) raw.push(f);
    for (const i of cache.keys()) if (i >= msg.start) cache.delete(i);
    sized = Math.min(sized, msg.start);
    for (const [i, label] of msg.labels) labels[i] = label;
    showForcedLegend();
    if (msg.images) thumbs = { ...thumbs, ...msg.images };
    sizeTree(false);
    if (follow) go(raw.length - 1);
    else counter.textContent = `${index + 1} / ${raw.length}`;
    keep();
  };
  // Frames sent as messages live only in this page, and Python stores in `_frames` only what
  // it had when the player was displayed (store_frames). So the page keeps them in the
  // model's state as `_kept`, an attribute Python has no trait for (it ignores it, echoes
  // nothing, and no view reloads on it): JupyterLab saves it with the notebook, and a saved
  // live player shows them after a reload with no kernel. Half a second after the last
  // message, so a stream of frames costs one copy, not one per frame.
  let keeping = null;
  const keep = () => {
    clearTimeout(keeping);
    keeping = setTimeout(() => model.set("_kept", { frames: [...raw], labels: [...labels] }), 500);
  };
  // A mark picked elsewhere (a request slider linked to `mark` with jslink: viz/replicas.py)
  // shows its frame, `marks[mark]`; no kernel needed.
  const onMark = () => {
    const m = model.get("mark"), marks = model.get("marks") || [];
    if (!(m >= 0 && m < marks.length)) return;
    stop();
    go(marks[m]);
  };
  model.on("change:step", onStep);
  model.on("change:mark", onMark);
  model.on("change:_frames", reload);
  model.on("change:_images", reload);
  model.on("change:max_nodes", reload);
  model.on("change:fit_min_text_px", place);
  model.on("msg:custom", onMessage);
  model.on("change:status", showStatus);

  sizeTree(true);
  go(Math.min(model.get("step"), raw.length - 1));
  // Frames appended in Python before this view existed (live mode) are sent on request.
  model.send({ kind: "hello", frames: raw.length, labels: labels.length });

  return () => {
    stop();
    clearTimeout(keeping);
    resized.disconnect();
    model.off("change:step", onStep);
    model.off("change:mark", onMark);
    model.off("change:_frames", reload);
    model.off("change:_images", reload);
    model.off("change:max_nodes", reload);
    model.off("change:fit_min_text_px", place);
    model.off("msg:custom", onMessage);
    model.off("change:status", showStatus);
  };
}

export default { render };
