"""A tree layout that keeps nodes in place from one frame to the next.

A tidy tree recomputed for every frame would move half the drawing each time a leaf is added:
every leaf to the right of the new one shifts over. An animation then shows motion that means
nothing. Here, instead, each node gets a grid cell ``(column, depth)`` once and keeps it:

- ``depth`` is the number of edges from the root (the row).
- The first child of a childless node goes straight below its parent, in the same column.
  Any later child goes to the first column right of its parent's subtree: that column is
  reused if no node uses it, otherwise a column is inserted there and the columns to its
  right shift by one. That insertion is the only way a node moves sideways.
- A split (``A`` cut into ``A -> B``) puts the new node ``B`` in ``A``'s column one row down;
  ``B``'s subtree (the old children of ``A``) moves one row down. ``A`` keeps its cell.
- An evicted node stays as a *ghost*, in its cell, until the tree releases it
  (:meth:`minirad.kv_events.event_tree.EventTree.release`, then :meth:`StableLayout.release`), so
  the frame that evicts it can still draw it where it was. Its column then becomes free.

The tree itself (parents, children, ghosts) is the :class:`~minirad.kv_events.event_tree.EventTree`
that the caller updates from the cache's events; the layout only adds the cells.

Invariants (checked by :meth:`check` and the tests): no two nodes share a cell; a node's
column is at most its descendants' columns; sibling subtrees use disjoint column ranges, left
to right in creation order. Free columns between subtrees stay free (the layout never
compacts): those are the slots of evicted nodes, kept so that nothing else has to move.
"""

from __future__ import annotations

from collections.abc import Iterable

from minirad.kv_events.event_tree import EventNode, EventTree

__all__ = ["StableLayout"]


class StableLayout:
    """Grid cells ``(column, depth)`` for the nodes of an :class:`EventTree` that grows,
    splits and shrinks.

    Call :meth:`add`, :meth:`split` and :meth:`release` right after the tree applied the
    matching event (or released its ghosts). The root is ``0`` at cell ``(0, 0)``. Every
    method runs in time proportional to the nodes it moves (a column insertion touches every
    node).
    """

    def __init__(self, tree: EventTree) -> None:
        self.tree = tree
        self.reset()

    def reset(self) -> None:
        """Back to the root alone (the tree holds only its root)."""
        self.col: dict[int, int] = {0: 0}
        self.depth: dict[int, int] = {0: 0}
        self.moved: set[int] = set()  # nodes placed or moved since the caller last cleared it
        self._used: list[int] = [1]  # nodes (ghosts included) per column

    # ------------------------------------------------------------------ queries
    def position(self, node_id: int) -> tuple[int, int]:
        """``(column, depth)`` of a node or ghost."""
        return self.col[node_id], self.depth[node_id]

    @property
    def num_columns(self) -> int:
        """Columns in use, from column 0 to the rightmost used one."""
        return len(self._used)

    @property
    def num_rows(self) -> int:
        return 1 + max(self.depth.values())

    def _node(self, node_id: int) -> EventNode:
        """A node or a ghost of the tree."""
        node = self.tree.nodes.get(node_id)
        return node if node is not None else self.tree.evicted[node_id]

    def _rightmost(self, node_id: int) -> int:
        """The rightmost column of the subtree under ``node_id`` (ghosts included): the last
        child's subtree is always the rightmost one."""
        while kids := self._node(node_id).children:
            node_id = kids[-1]
        return self.col[node_id]

    # ------------------------------------------------------------------ changes
    def add(self, node_id: int) -> None:
        """Place a leaf the tree has just inserted (see the module docstring).

        Raises:
            KeyError: ``node_id`` is not in the tree, or is already placed.
        """
        if node_id in self.col:
            raise KeyError(f"node {node_id} is already in the layout")
        parent = self.tree.nodes[node_id].parent
        kids = self.tree.nodes[parent].children  # node_id is the last one
        if len(kids) == 1:
            c = self.col[parent]
        else:
            c = self._rightmost(kids[-2]) + 1
            if c == len(self._used):
                self._used.append(0)
            elif self._used[c]:
                self._insert_column(c)
        self.col[node_id] = c
        self.depth[node_id] = self.depth[parent] + 1
        self._used[c] += 1
        self.moved.add(node_id)

    def _insert_column(self, c: int) -> None:
        for n, col in self.col.items():
            if col >= c:
                self.col[n] = col + 1
                self.moved.add(n)
        self._used.insert(c, 0)

    def split(self, node_id: int, new_id: int) -> None:
        """The tree has just cut ``node_id``'s edge: ``new_id``, its only child now, goes one
        row down in the same column, and so does the subtree it took over."""
        stack = list(self._node(new_id).children)
        while stack:
            n = stack.pop()
            self.depth[n] += 1
            self.moved.add(n)
            stack.extend(self._node(n).children)
        self.col[new_id] = self.col[node_id]
        self.depth[new_id] = self.depth[node_id] + 1
        self._used[self.col[new_id]] += 1
        self.moved.add(new_id)

    def release(self, node_ids: Iterable[int]) -> None:
        """Free the cells of the ghosts the tree has just released."""
        for n in node_ids:
            self._used[self.col.pop(n)] -= 1
            del self.depth[n]
        while len(self._used) > 1 and not self._used[-1]:
            self._used.pop()

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Raise AssertionError if an invariant of the module docstring does not hold."""
        assert self.col.keys() == self.tree.nodes.keys() | self.tree.evicted.keys()
        cells = [(self.col[n], self.depth[n]) for n in self.col]
        assert len(set(cells)) == len(cells), "two nodes share a cell"
        for n in self.col:
            spans = []
            for k in self._node(n).children:
                assert self._node(k).parent == n and self.depth[k] == self.depth[n] + 1
                lo, hi = self._span(k)
                assert lo >= self.col[n], f"node {k} is left of its parent {n}"
                spans.append((lo, hi))
            for (_, hi), (lo, _) in zip(spans, spans[1:], strict=False):
                assert hi < lo, f"children of {n} overlap or are out of order"
        counts = [0] * len(self._used)
        for c in self.col.values():
            counts[c] += 1
        assert counts == self._used, "column counts out of sync"

    def _span(self, node_id: int) -> tuple[int, int]:
        cols = []
        stack = [node_id]
        while stack:
            n = stack.pop()
            cols.append(self.col[n])
            stack.extend(self._node(n).children)
        return min(cols), max(cols)
