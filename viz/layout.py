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
- A removed (evicted) node stays as a *ghost*, in its cell, until :meth:`release_ghosts`, so
  the frame that evicts it can still draw it where it was. Its column then becomes free.

Invariants (checked by :meth:`check` and the tests): no two nodes share a cell; a node's
column is at most its descendants' columns; sibling subtrees use disjoint column ranges, left
to right in creation order. Free columns between subtrees stay free (the layout never
compacts): those are the slots of evicted nodes, kept so that nothing else has to move.
"""

from __future__ import annotations

__all__ = ["StableLayout"]


class StableLayout:
    """Grid cells ``(column, depth)`` for the nodes of a tree that grows, splits and shrinks.

    Node ids are ints; the root is ``0`` at cell ``(0, 0)``. Every method runs in time
    proportional to the nodes it moves (a column insertion touches every node).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Back to the root alone."""
        self.col: dict[int, int] = {0: 0}
        self.depth: dict[int, int] = {0: 0}
        self.parent: dict[int, int | None] = {0: None}
        self.children: dict[int, list[int]] = {0: []}
        self.ghosts: set[int] = set()
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

    def _rightmost(self, node_id: int) -> int:
        """The rightmost column of the subtree under ``node_id`` (ghosts included): the last
        child's subtree is always the rightmost one."""
        while self.children[node_id]:
            node_id = self.children[node_id][-1]
        return self.col[node_id]

    # ------------------------------------------------------------------ changes
    def add(self, node_id: int, parent_id: int) -> None:
        """Place a new leaf under ``parent_id`` (see the module docstring).

        Raises:
            KeyError: ``parent_id`` is unknown, or ``node_id`` is already placed.
        """
        if node_id in self.col:
            raise KeyError(f"node {node_id} is already in the layout")
        kids = self.children[parent_id]
        if not kids:
            c = self.col[parent_id]
        else:
            c = self._rightmost(parent_id) + 1
            if c == len(self._used):
                self._used.append(0)
            elif self._used[c]:
                self._insert_column(c)
        kids.append(node_id)
        self.col[node_id] = c
        self.depth[node_id] = self.depth[parent_id] + 1
        self.parent[node_id] = parent_id
        self.children[node_id] = []
        self._used[c] += 1
        self.moved.add(node_id)

    def _insert_column(self, c: int) -> None:
        for n, col in self.col.items():
            if col >= c:
                self.col[n] = col + 1
                self.moved.add(n)
        self._used.insert(c, 0)

    def split(self, node_id: int, new_id: int) -> None:
        """``node_id``'s edge was cut: ``new_id`` is its only child and takes its children,
        one row further down (their subtree moves down with them)."""
        kids = self.children[node_id]
        for k in kids:
            self.parent[k] = new_id
        stack = list(kids)
        while stack:
            n = stack.pop()
            self.depth[n] += 1
            self.moved.add(n)
            stack.extend(self.children[n])
        self.children[new_id] = kids
        self.children[node_id] = [new_id]
        self.parent[new_id] = node_id
        self.col[new_id] = self.col[node_id]
        self.depth[new_id] = self.depth[node_id] + 1
        self._used[self.col[new_id]] += 1
        self.moved.update(kids)
        self.moved.add(new_id)

    def remove(self, node_id: int) -> None:
        """Turn a node into a ghost; it keeps its cell until :meth:`release_ghosts`.

        Raises:
            KeyError: unknown node, or the root.
        """
        if node_id == 0 or node_id not in self.col:
            raise KeyError(f"cannot remove node {node_id}")
        self.ghosts.add(node_id)

    def remove_all(self) -> None:
        """Every node but the root becomes a ghost (a cache reset)."""
        self.ghosts.update(n for n in self.col if n != 0)

    def release_ghosts(self) -> list[int]:
        """Drop every ghost (and free its cell); returns their ids, in id order."""
        gone = sorted(self.ghosts)
        for n in gone:
            p = self.parent.pop(n)
            if p in self.children:  # the parent may be a ghost dropped just before
                self.children[p].remove(n)
            self._used[self.col.pop(n)] -= 1
            del self.depth[n], self.children[n]
        self.ghosts.clear()
        while len(self._used) > 1 and not self._used[-1]:
            self._used.pop()
        return gone

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Raise AssertionError if an invariant of the module docstring does not hold."""
        cells = [(self.col[n], self.depth[n]) for n in self.col]
        assert len(set(cells)) == len(cells), "two nodes share a cell"
        for n, kids in self.children.items():
            spans = []
            for k in kids:
                assert self.parent[k] == n and self.depth[k] == self.depth[n] + 1
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
            stack.extend(self.children[n])
        return min(cols), max(cols)
