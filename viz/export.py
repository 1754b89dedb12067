"""A standalone HTML replay: the widget's own JavaScript and CSS, inlined with the frames.

The page needs no kernel and no network: the script and style are in the file, the frames
are a JSON block, and a small stand-in for the widget model (``get``/``set``/``on``) feeds
them to the same ``render()`` the notebook uses. Open it from disk in any browser.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path

from .frame import Frame, frames_to_wire

__all__ = ["STATIC", "html_page", "write_html"]

STATIC = Path(__file__).resolve().parent / "static"
JS_EXPORT = "export default { render };"  # the module's last statement

_BOOT = """
const state = JSON.parse(document.getElementById("radix-view-data").textContent);
const handlers = new Map();
const model = {
  get: (key) => state[key],
  set(key, value) {
    if (state[key] === value) return;
    state[key] = value;
    for (const f of handlers.get(`change:${key}`) || []) f();
  },
  save_changes() {},
  send() {},
  on(name, f) { handlers.set(name, [...(handlers.get(name) || []), f]); },
  off(name, f) { handlers.set(name, (handlers.get(name) || []).filter((g) => g !== f)); },
};
widget.render({ model, el: document.getElementById("radix-view") });
"""


def html_page(
    frames: Sequence[Frame],
    title: str = "minirad radix tree",
    step: int = 0,
    interval_ms: int = 900,
    duration_ms: int = 450,
    max_nodes: int = 300,
    thumbnails: Mapping[str, str] | None = None,
    fit_min_text_px: float = 11.0,
) -> str:
    """The page as a string (see :func:`write_html`); the arguments are the widget's traits
    (:class:`viz.widget.RadixView`)."""
    js = (STATIC / "radix_view.js").read_text(encoding="utf-8")
    css = (STATIC / "radix_view.css").read_text(encoding="utf-8")
    if js.count(JS_EXPORT) != 1 or "</script" in js:
        raise ValueError("radix_view.js must end with one `export default { render };`")
    js = js.replace(JS_EXPORT, "const widget = { render };")
    wire = frames_to_wire(frames)
    state = {
        "_frames": wire["frames"],
        "_labels": wire["labels"],
        "step": step,
        "interval_ms": interval_ms,
        "duration_ms": duration_ms,
        "max_nodes": max_nodes,
        "_images": dict(thumbnails or {}),
        "fit_min_text_px": fit_min_text_px,
    }
    # "<" escaped inside JSON strings: no "</script>" or "<!--" can end the data block early.
    data = json.dumps(state, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en">',
            "<head>",
            '<meta charset="utf-8">',
            f"<title>{escape(title)}</title>",
            f"<style>\nbody {{ margin: 16px; font-family: Helvetica, Arial, sans-serif; }}\n"
            f"{css}</style>",
            "</head>",
            "<body>",
            f"<h3>{escape(title)}</h3>",
            '<div id="radix-view"></div>',
            f'<script type="application/json" id="radix-view-data">{data}</script>',
            f'<script type="module">\n{js}\n{_BOOT}</script>',
            "</body>",
            "</html>",
            "",
        ]
    )


def write_html(frames: Sequence[Frame], path: str | Path, **kwargs) -> Path:
    """Write :func:`html_page` to ``path`` (UTF-8); returns the path."""
    path = Path(path)
    path.write_text(html_page(frames, **kwargs), encoding="utf-8")
    return path
