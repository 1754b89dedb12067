"""A static SVG of one frame: the widget's fallback for viewers without a kernel.

GitHub, nbviewer and ``nbconvert`` cannot run the widget's JavaScript; they show this picture
instead, and nbval compares it byte for byte. So the output depends on the frame alone: no
ids from memory, no floats, no dates, nodes and cells in a fixed order.

The geometry and colours are those of ``viz/static/radix_view.js`` (keep the two in step):
a node is a box in its layout cell ``(col, depth)``, coloured by its state as in Figure 3 of
the SGLang paper (green added, blue accessed, red dashed evicted, grey untouched), with its
``lock_ref`` in an orange badge; the edges into locked nodes (the locked paths) are thick
orange; an edge that starts with an image (a fork at an image boundary) is purple; the text
a grammar forced (jump-forward) is teal, with a teal bar under its share of the box. Under
the tree, the KV pool: one cell per page, coloured by the owner's state (tree node), orange
(running request) or white (free).

A cache with tiers (HiRadixCache) adds chips on each box's top edge, ``dev`` ``host`` (and
``disk`` once written there), filled in the tier's colour where the node's KV is and hollow where
it is not; a host-only node's box is dashed brown, light brown when idle; a second strip under
the KV pool shows the host pool (light brown: backups of device nodes, darker: host-only nodes,
an amber outline: copied in this frame). A plain cache's drawing is unchanged.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from xml.sax.saxutils import escape, quoteattr

from minirad.events import plural

from .frame import Frame, NodeView

__all__ = ["COLORS", "HOST", "HOST_ONLY", "TIER_COLORS", "frame_svg", "side_by_side"]

# Layout geometry, in px (radix_view.js uses the same numbers).
COL_W, ROW_H = 148, 64
BOX_W, BOX_H = 136, 38
MARGIN = 12
# JupyterLab's output area is ~848 px wide in a 1280-px window with the file browser open: a
# wider drawing is scaled down to this width (the SVG's width attribute; its viewBox keeps
# the natural size).
MAX_WIDTH = 840
CELL, CELL_PITCH, CELLS_PER_ROW = 10, 12, 64
FONT = "Helvetica, Arial, sans-serif"

# state -> (fill, stroke); the paper's colours.
COLORS = {
    "added": ("#d4edcf", "#3a8a2e"),
    "accessed": ("#d6e6fb", "#2f62b0"),
    "split": ("#eeeeee", "#444444"),
    "idle": ("#eeeeee", "#777777"),
    "evicted": ("#ffffff", "#c62828"),
}
LOCK = "#e67e22"
IMAGE = "#8e44ad"
FORCED = "#00897b"  # tokens a grammar forced (jump-forward)
REQUEST = ("#f6c177", "#b7791f")
FREE = ("#ffffff", "#cccccc")
# Tiers (radix_view.css's --rv-device, --rv-host-line, --rv-disk...): the chips' fills, and the
# (fill, stroke) of host pool cells: a backup of a device node, a host-only node.
TIER_COLORS = {"device": "#37474f", "host": "#8d6e63", "disk": "#827717"}
HOST = ("#f3ede8", "#8d6e63")
HOST_ONLY = ("#d7ccc8", "#8d6e63")
TIER_NEW = "#ffb300"  # the outline of host pages copied in this frame
CHIP_W, CHIP_H, CHIP_X, CHIP_GAP = 20, 11, 2, 1
CHIP_TEXT = {"device": "dev", "host": "host", "disk": "disk"}


def _box(n: NodeView, top: int) -> tuple[int, int]:
    """Top-left corner of a node's box."""
    return MARGIN + n.col * COL_W, top + n.depth * ROW_H


def _edge(parent: NodeView, child: NodeView, top: int) -> str:
    px, py = _box(parent, top)
    cx, cy = _box(child, top)
    x1, y1 = px + BOX_W // 2, py + BOX_H
    x2, y2 = cx + BOX_W // 2, cy
    ym = (y1 + y2) // 2
    return f"M{x1},{y1} C{x1},{ym} {x2},{ym} {x2},{y2}"


_SPAN = {
    "text": "",
    "image": " fill=" + quoteattr(IMAGE),
    "forced": f' fill="{FORCED}" font-weight="bold"',
}


def _node(n: NodeView, top: int) -> list[str]:
    x, y = _box(n, top)
    if n.id == 0:
        cx = x + BOX_W // 2
        return [
            f'<g class="node root" data-id="0"><circle cx="{cx}" cy="{y + BOX_H // 2}" r="16" '
            'fill="#eeeeee" stroke="#777777"/>'
            f'<text x="{cx}" y="{y + BOX_H // 2 + 4}" text-anchor="middle" font-size="12">'
            "root</text></g>"
        ]
    fill, stroke = COLORS[n.state]
    dash = ' stroke-dasharray="5,3"' if n.state == "evicted" else ""
    width = 2 if n.lock_ref or n.state != "idle" else 1
    if n.lock_ref and n.state in ("idle", "split"):
        stroke = LOCK
    host_only = n.host_only and n.state != "evicted"  # an evicted ghost is drawn as one
    if host_only:
        stroke, width, dash = HOST_ONLY[1], 2, ' stroke-dasharray="4,2"'
        if n.state in ("idle", "split"):
            fill = HOST_ONLY[0]
    ink = COLORS["evicted"][1] if n.state == "evicted" else "#222222"
    label = n.label
    hover = f"node {n.id}: {plural(n.num_tokens, 'token')}, lock_ref {n.lock_ref}, "
    hover += f"last access {n.last_access}"
    if n.extra_key is not None:
        hover += f", extra_key {n.extra_key}"
    if label.forced:
        hover += f", {plural(label.num_forced, 'forced token')} (jump-forward)"
    if n.tiers is not None:
        hover += f", KV on {' + '.join(n.tiers)}"
    if n.tier_marks:
        hover += f" ({', '.join(n.tier_marks).replace('_', ' ')})"
    head = f"#{n.id}  {n.num_tokens} tok  t={n.last_access}"
    if n.state == "evicted":
        head = f"#{n.id}  evicted  {n.num_tokens} tok"
    elif n.state == "split":
        head = f"✂ {head}"
    cls, data = n.state, ""
    if n.tiers is not None:
        cls += " host-only" if host_only else ""
        data = f' data-tiers="{" ".join(n.tiers)}"'
        if n.tier_marks:
            data += f' data-marks="{" ".join(n.tier_marks)}"'
    out = [
        f'<g class="node {cls}" data-id="{n.id}"{data}>',
        f"<title>{escape(hover + chr(10) + label.full)}</title>",
        f'<rect x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="6" fill="{fill}" '
        f'stroke="{stroke}" stroke-width="{width}"{dash}/>',
    ]
    if n.tiers is not None:
        out += _chips(n, x, y)
    if label.images and label.images[0][0] == 0:
        out.append(f'<rect x="{x}" y="{y + 3}" width="4" height="{BOX_H - 6}" fill="{IMAGE}"/>')
    out.append(
        f'<text x="{x + 8}" y="{y + 15}" font-size="12" font-weight="bold" fill="{ink}">'
        f"{escape(head)}</text>"
    )
    spans = "".join(f"<tspan{_SPAN[kind]}>{escape(t)}</tspan>" for kind, t in label.parts)
    out.append(
        f'<text x="{x + 8}" y="{y + 31}" font-size="12" fill="{ink}" xml:space="preserve">'
        f"{spans}</text>"
    )
    for offset, k in label.forced:  # the forced share of the edge's tokens, in place
        x0 = x + BOX_W * offset // n.num_tokens
        x1 = x + BOX_W * (offset + k) // n.num_tokens
        out.append(
            f'<rect class="forced" x="{x0}" y="{y + BOX_H - 5}" width="{max(x1 - x0, 2)}" '
            f'height="4" fill="{FORCED}"/>'
        )
    if n.lock_ref:
        bx, by = x + BOX_W - 11, y + 11
        out.append(
            f'<circle cx="{bx}" cy="{by}" r="9" fill="{LOCK}"/><text x="{bx}" y="{by + 4}" '
            f'text-anchor="middle" font-size="10" font-weight="bold" fill="#ffffff">'
            f"{n.lock_ref}</text>"
        )
    out.append("</g>")
    return out


def _chips(n: NodeView, x: int, y: int) -> list[str]:
    """The tier chips on a box's top edge: dev and host always, disk once the node is there;
    filled where the node's KV is, hollow where it is not."""
    out = []
    for i, tier in enumerate(("device", "host", "disk")):
        on = tier in n.tiers
        if tier == "disk" and not on:
            continue
        cx, cy = x + CHIP_X + i * (CHIP_W + CHIP_GAP), y + 1 - CHIP_H
        fill, stroke, ink = (TIER_COLORS[tier], "none", "#ffffff") if on else FREE + ("#aaaaaa",)
        out.append(
            f'<g class="tier {tier}{" on" if on else ""}"><rect x="{cx}" y="{cy}" '
            f'width="{CHIP_W}" height="{CHIP_H}" rx="3" fill="{fill}" stroke="{stroke}"/>'
            f'<text x="{cx + CHIP_W // 2}" y="{cy + CHIP_H - 2}" text-anchor="middle" '
            f'font-size="8" font-weight="bold" fill="{ink}">{CHIP_TEXT[tier]}</text></g>'
        )
    return out


def _bars(start: int, length: int, top: int, fill: str, stroke: str, extra: str = "") -> list[str]:
    """One bar per pool row that the run of cells covers, not one rect per cell: a pool of
    hundreds of slots would otherwise make every frame's SVG tens of kilobytes."""
    out, i, end = [], start, start + length
    while i < end:
        r, c = divmod(i, CELLS_PER_ROW)
        n = min(end - i, CELLS_PER_ROW - c)
        out.append(
            f'<rect class="pool" x="{MARGIN + c * CELL_PITCH}" '
            f'y="{top + r * CELL_PITCH}" width="{(n - 1) * CELL_PITCH + CELL}" '
            f'height="{CELL}" fill="{fill}" stroke="{stroke}"{extra}/>'
        )
        i += n
    return out


def _pool_height(num_cells: int) -> int:
    """The height of a pool panel: its heading, then its rows of cells."""
    return 18 + -(-num_cells // CELLS_PER_ROW) * CELL_PITCH


def _host_pool(frame: Frame, top: int) -> list[str]:
    """The host pool of a cache with tiers, as the KV pool is drawn."""
    pool, nodes = frame.host_pool, {n.id: n for n in frame.nodes}
    used = {"copy": 0, "only": 0, "free": 0}
    out = []
    for start, length, owner in pool.runs:
        node = nodes.get(owner) if owner is not None else None
        extra = ""
        if owner is None:
            (fill, stroke), kind = FREE, "free"
        elif node is not None and node.host_only:
            (fill, stroke), kind = HOST_ONLY, "only"
        else:
            (fill, stroke), kind = HOST, "copy"
        if node is not None and {"backed_up", "prefetched"} & set(node.tier_marks):
            stroke, extra = TIER_NEW, ' stroke-width="2"'
        used[kind] += length
        out += _bars(start, length, top + 18, fill, stroke, extra)
    unit = "slots" if pool.page_size == 1 else f"pages of {pool.page_size} tokens"
    head = (
        f"Host pool: {pool.num_cells} {unit}: {used['copy']} back up device nodes, "
        f"{used['only']} hold host-only nodes, {used['free']} free"
    )
    return [f'<text x="{MARGIN}" y="{top + 12}" font-size="11">{escape(head)}</text>', *out]


def _pool(frame: Frame, top: int) -> list[str]:
    pool = frame.pool
    states = {n.id: n for n in frame.nodes}
    used = {"tree": 0, "request": 0, "free": 0}
    out = []
    for start, length, owner in pool.runs:
        if owner is None:
            (fill, stroke), kind = FREE, "free"
        elif isinstance(owner, str):
            (fill, stroke), kind = REQUEST, "request"
        else:
            node = states.get(owner)
            fill, stroke = COLORS[node.state if node is not None else "idle"]
            if node is not None and node.lock_ref:
                stroke = LOCK
            kind = "tree"
        used[kind] += length
        out += _bars(start, length, top + 18, fill, stroke)
    unit = "slots" if pool.page_size == 1 else f"pages of {pool.page_size} tokens"
    name = "KV pool" if frame.host_pool is None else "Device KV pool"
    head = (
        f"{name}: {pool.num_cells} {unit}: {used['tree']} in the tree, "
        f"{used['request']} held by running requests, {used['free']} free"
    )
    return [f'<text x="{MARGIN}" y="{top + 12}" font-size="11">{escape(head)}</text>', *out]


LEGEND_ROW = 16  # px between the legend's rows


def _legend(y: int, forced: bool, tiered: bool = False) -> list[str]:
    """The legend: one row, and a second one for the tiers of a cache with tiers."""
    items = [(s, *COLORS[s]) for s in ("added", "accessed", "split", "evicted", "idle")]
    items += [("locked", "#ffffff", LOCK), ("request", *REQUEST), ("free", *FREE)]
    if forced:  # only where a grammar forced tokens: other frames keep their legend
        items.append(("forced", FORCED, FORCED))
    rows = [items]
    if tiered:
        tiers = [("host-only", *HOST_ONLY)]
        where = {"device": "on device", "host": "in host pool", "disk": "on disk"}
        tiers += [(f"{CHIP_TEXT[t]}: {where[t]}", c, c) for t, c in TIER_COLORS.items()]
        tiers += [("host cell: a backup", *HOST), ("copied this frame", "#ffffff", TIER_NEW)]
        rows.append(tiers)
    out = []
    for row in rows:
        x = MARGIN
        for name, fill, stroke in row:
            dash = ' stroke-dasharray="3,2"' if name in ("evicted", "host-only") else ""
            out.append(
                f'<rect x="{x}" y="{y}" width="10" height="10" fill="{fill}" stroke="{stroke}" '
                f'stroke-width="2"{dash}/><text x="{x + 14}" y="{y + 9}" font-size="10">'
                f"{name}</text>"
            )
            x += 24 + 7 * len(name)
        y += LEGEND_ROW
    return out


def frame_svg(frame: Frame, heading: str | None = None, caption_width: int = 110) -> str:
    """The frame as a standalone SVG document (a str).

    Args:
        frame: the frame to draw.
        heading: the first line (e.g. ``"step 4/9"``); the frame's title is appended.
        caption_width: characters per line of the wrapped caption (at most 4 lines).

    A drawing wider than :data:`MAX_WIDTH` px is shown scaled down to that width, so it fits
    JupyterLab's output area.
    """
    heading = " · ".join(h for h in (heading, frame.title) if h)
    caption = textwrap.wrap(frame.caption, caption_width) or [""]
    if len(caption) > 4:
        caption = caption[:3] + [caption[3][: caption_width - 1] + "…"]
    top = MARGIN + 16 * (len(caption) + (1 if heading else 0)) + 8
    cols = 1 + max(n.col for n in frame.nodes)
    rows = 1 + max(n.depth for n in frame.nodes)
    pool_top = top + rows * ROW_H
    # A source without a pool (a vLLM server's KV events carry no slots) draws none.
    host_top = pool_top + (_pool_height(frame.pool.num_cells) + 10 if frame.pool.num_cells else 0)
    host_cells = frame.host_pool.num_cells if frame.host_pool is not None else 0
    legend_y = host_top + (_pool_height(host_cells) + 10 if host_cells else 0)
    width = max(MARGIN * 2 + cols * COL_W, MARGIN * 2 + CELLS_PER_ROW * CELL_PITCH, 640)
    height = legend_y + 10 + MARGIN + (LEGEND_ROW if frame.host_pool is not None else 0)
    shown_w = min(width, MAX_WIDTH)
    shown_h = -(-height * shown_w // width)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{shown_w}" height="{shown_h}" '
        f'viewBox="0 0 {width} {height}" font-family="{FONT}" class="radix-view-static">',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    y = MARGIN + 12
    if heading:
        out.append(
            f'<text x="{MARGIN}" y="{y}" font-size="13" font-weight="bold">{escape(heading)}</text>'
        )
        y += 16
    for line in caption:
        out.append(f'<text x="{MARGIN}" y="{y}" font-size="12">{escape(line)}</text>')
        y += 16
    by_id = {n.id: n for n in frame.nodes}
    for n in frame.nodes:
        if n.parent is None:
            continue
        color, w, dash = "#888888", 1.5, ""
        if n.state == "evicted":
            color, dash = COLORS["evicted"][1], ' stroke-dasharray="5,3"'
        elif n.lock_ref:
            color, w = LOCK, 4
        elif n.label.images and n.label.images[0][0] == 0:
            color, w = IMAGE, 2.5
        out.append(
            f'<path d="{_edge(by_id[n.parent], n, top)}" fill="none" stroke="{color}" '
            f'stroke-width="{w}"{dash}/>'
        )
        if n.state == "split":  # the cut: where the old edge was divided
            px, py = _box(by_id[n.parent], top)
            out.append(
                f'<text x="{px + BOX_W // 2 + 6}" y="{py + BOX_H + 14}" font-size="12" '
                f'fill="#555555">✂</text>'
            )
    for n in frame.nodes:
        out += _node(n, top)
    if frame.pool.num_cells:
        out += _pool(frame, pool_top)
    if host_cells:
        out += _host_pool(frame, host_top)
    forced = any(n.label is not None and n.label.forced for n in frame.nodes)
    out += _legend(legend_y, forced, frame.host_pool is not None)
    out.append("</svg>")
    return "\n".join(out)


def side_by_side(
    drawings: Sequence[str], headings: Sequence[str], footer: Sequence[str] = ()
) -> str:
    """Several SVG documents (:func:`frame_svg`'s) in one row, each under its heading, with
    ``footer`` lines of monospaced text below: one replica's tree per column (chapter 10).
    Scaled down to :data:`MAX_WIDTH` px as a whole.

    Raises:
        ValueError: not one heading per drawing, or a drawing that is not an ``<svg>`` with
            ``width`` and ``height``.
    """
    if len(drawings) != len(headings):
        raise ValueError(f"{len(drawings)} drawings but {len(headings)} headings")
    gap, head_h, line_h = 16, 22, 16
    x, height, out = 0, 0, []
    for drawing, heading in zip(drawings, headings, strict=True):
        size = re.match(r'<svg [^>]*?width="(\d+)" height="(\d+)"', drawing)
        if size is None:
            raise ValueError("a drawing must start <svg ... width=... height=...>")
        w, h = int(size[1]), int(size[2])
        out.append(
            f'<text x="{x + MARGIN}" y="{MARGIN + 12}" font-size="14" font-weight="bold">'
            f"{escape(heading)}</text>"
        )
        out.append(drawing.replace("<svg ", f'<svg x="{x}" y="{MARGIN + head_h}" ', 1))
        x, height = x + w + gap, max(height, h)
    width = max(x - gap, 640)
    y = MARGIN + head_h + height + 8
    for line in footer:
        y += line_h
        out.append(
            f'<text x="{MARGIN}" y="{y}" font-size="12" font-family="monospace" '
            f'xml:space="preserve">{escape(line)}</text>'
        )
    total_h = y + MARGIN
    shown_w = min(width, MAX_WIDTH)
    shown_h = -(-total_h * shown_w // width)
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{shown_w}" height="{shown_h}" '
            f'viewBox="0 0 {width} {total_h}" font-family="{FONT}" class="radix-view-static">',
            f'<rect x="0" y="0" width="{width}" height="{total_h}" fill="#ffffff"/>',
            *out,
            "</svg>",
        ]
    )
