"""Graphviz drawings with the course's defaults: the one module that imports ``graphviz``.

Drawing is not part of the cache, so ``graphviz`` is imported inside the functions: importing
``minirad`` (or ``minirad.course.scenario``) does not load it, and a library user without Graphviz
can run everything but the pictures.

The defaults: Helvetica everywhere, and a ``size`` so that a drawing never overflows
JupyterLab's output area (about 848 px wide in a 1280-px window with the file browser open;
Graphviz scales a larger drawing down to fit, never a smaller one up). Rendering needs
Graphviz's ``dot`` program (``make lab`` installs it).

Example::

    from minirad.course.dot import radix_tree
    radix_tree(cache, decode=tokenizer.decode)  # a RadixCache, drawn
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import graphviz

    from minirad.kvcache.radix_cache import RadixCache

__all__ = ["MAX_WIDTH_IN", "digraph", "escape", "radix_tree"]

# JupyterLab's output area is ~848 px wide in a 1280-px window with the file browser open (968
# px without it); Graphviz's SVG is in points (1 pt = 4/3 px): 8.5 in = 612 pt = 816 px. The
# height bound only stops a pathological drawing.
MAX_WIDTH_IN = 8.5
MAX_HEIGHT_IN = 40
FONT = "Helvetica"


def digraph(
    name: str,
    graph_attr: dict | None = None,
    node_attr: dict | None = None,
    edge_attr: dict | None = None,
) -> graphviz.Digraph:
    """A ``graphviz.Digraph`` with the house defaults, overridden by the given attributes.

    Args:
        name: the graph's name (the SVG's ``<title>``).
        graph_attr, node_attr, edge_attr: Graphviz attributes (strings), applied over the
            defaults: ``fontname`` Helvetica for all three, and the graph's ``size``
            ``"8.5,40"`` (inches; a drawing wider than 816 px is scaled down to fit).
    """
    import graphviz

    return graphviz.Digraph(
        name,
        graph_attr={"fontname": FONT, "size": f"{MAX_WIDTH_IN},{MAX_HEIGHT_IN}"}
        | (graph_attr or {}),
        node_attr={"fontname": FONT} | (node_attr or {}),
        edge_attr={"fontname": FONT} | (edge_attr or {}),
    )


def escape(text: str) -> str:
    """``text`` with DOT markup escaped (``graphviz.escape``), so that decoded text such as
    ``"<image>"`` or a backslash is drawn as written."""
    import graphviz

    return graphviz.escape(text)


def radix_tree(
    cache: RadixCache, decode: Callable[[list[int]], str] | None = None, max_label: int = 24
) -> graphviz.Digraph:
    """A drawing of a :class:`~minirad.kvcache.radix_cache.RadixCache`: one box per node (id,
    tokens, ``lock_ref``; locked nodes shaded), each edge labelled with its key, decoded by
    ``decode`` if given and cut to ``max_label`` characters."""
    dot = digraph(
        "radix_tree",
        graph_attr={"rankdir": "LR"},
        node_attr={"shape": "box", "fontsize": "10"},
        edge_attr={"fontsize": "9"},
    )
    dot.node("0", "root", shape="circle")
    for n in cache.nodes():
        text = decode(n.key) if decode is not None else " ".join(map(str, n.key))
        if len(text) > max_label:
            text = text[: max_label - 1] + "…"
        style = {"style": "filled", "fillcolor": "#cfe2ff"} if n.lock_ref else {}
        dot.node(str(n.id), f"#{n.id}  {len(n.key)} tok\\nlock_ref={n.lock_ref}", **style)
        # escape(): decoded text such as "<image>" must not be read as DOT markup.
        dot.edge(str(n.parent.id), str(n.id), label=escape(text))
    return dot
