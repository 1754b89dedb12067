"""Graphviz drawings with the course's defaults: the one module that imports ``graphviz``.

Drawing is not part of the cache, so ``graphviz`` is imported inside the functions: importing
``minirad`` (or ``minirad.scenario``) does not load it, and a library user without Graphviz
can run everything but the pictures.

The defaults: Helvetica everywhere, and a ``size`` so that a drawing never overflows
JupyterLab's output area (about 968 px wide at the default window size; Graphviz scales a
larger drawing down to fit, never a smaller one up). Rendering needs Graphviz's ``dot``
program (``make lab`` installs it).

Example::

    from minirad.dot import digraph, escape
    g = digraph("tree", node_attr={"shape": "box"})
    g.node("0", escape("<image> x64"))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import graphviz

__all__ = ["MAX_WIDTH_IN", "digraph", "escape"]

# JupyterLab's output area is ~968 px wide; Graphviz's SVG is in points (1 pt = 4/3 px), so
# 968 px is 726 pt, 10.08 in. The height bound only stops a pathological drawing.
MAX_WIDTH_IN = 10
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
            ``"10,40"`` (inches; a drawing wider than ~968 px is scaled down to fit).
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
