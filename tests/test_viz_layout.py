"""The stable layout (``viz.layout``): a valid tree drawing in which untouched nodes stay put.

Checked on random operation sequences (against the rules of the module docstring: who may
move, and how far) and on the Figure 3 frames (an untouched node keeps its cell from one
frame to the next; a split moves only the subtree under the cut, one row down).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minirad.events import EvictEvent, InsertEvent, SplitEvent
from minirad.kv_events.event_tree import EventTree
from viz import StableLayout
from viz.sources import scenario_frames


class Tree:
    """An EventTree fed with events, and its layout updated as FrameBuilder does."""

    def __init__(self) -> None:
        self.tree = EventTree()
        self.layout = StableLayout(self.tree)

    def add(self, node: int, parent: int) -> None:
        self.tree.apply(InsertEvent(0, (parent,), 0, node, parent, (1, 2, 3), (0, 1, 2)))
        self.layout.add(node)

    def split(self, node: int, new: int) -> None:
        self.tree.apply(SplitEvent(0, node, new, 1))
        self.layout.split(node, new)

    def remove(self, node: int) -> None:
        self.tree.apply(EvictEvent(0, node, 1))

    def release(self) -> list[int]:
        gone = self.tree.release()
        self.layout.release(gone)
        return sorted(gone)

    def children(self, node: int) -> list[int]:
        return (self.tree.nodes.get(node) or self.tree.evicted[node]).children


def cells(t: Tree) -> dict[int, tuple[int, int]]:
    return {n: t.layout.position(n) for n in t.layout.col}


def subtree(t: Tree, node: int) -> set[int]:
    out, stack = set(), [node]
    while stack:
        n = stack.pop()
        out.add(n)
        stack.extend(t.children(n))
    return out


actions = st.lists(
    st.tuples(st.sampled_from(["add", "add", "add", "split", "remove", "release"]), st.integers()),
    max_size=60,
)


@settings(max_examples=150)
@given(actions=actions)
def test_random_changes_keep_a_valid_drawing_and_move_only_what_they_must(actions):
    t = Tree()
    next_id = 1
    for action, pick in actions:
        live = sorted(t.tree.nodes)
        before = cells(t)
        if action == "add":
            parent = live[pick % len(live)]
            t.add(next_id, parent)
            c, d = t.layout.position(next_id)
            assert d == before[parent][1] + 1
            shifted = {n for n in before if t.layout.position(n) != before[n]}
            # Only a column insertion moves nodes: exactly those at or right of the new
            # column, one column right, same row.
            assert shifted == ({n for n in before if before[n][0] >= c} if shifted else set())
            for n in shifted:
                assert t.layout.position(n) == (before[n][0] + 1, before[n][1])
            next_id += 1
        elif action == "split" and len(live) > 1:
            node = live[1:][pick % (len(live) - 1)]
            below = subtree(t, node) - {node}
            t.split(node, next_id)
            assert t.layout.position(node) == before[node]
            assert t.layout.position(next_id) == (before[node][0], before[node][1] + 1)
            assert t.tree.nodes[next_id].parent == node and t.children(node) == [next_id]
            for n in before:
                col, depth = before[n]
                assert t.layout.position(n) == ((col, depth + 1) if n in below else (col, depth))
            next_id += 1
        elif action == "remove":
            # Only leaves are evicted: nodes whose children are all ghosts already.
            leaves = [n for n in live[1:] if all(k in t.tree.evicted for k in t.children(n))]
            if leaves:
                t.remove(leaves[pick % len(leaves)])
                assert cells(t) == before  # a ghost stays where it was
        elif action == "release":
            ghosts = set(t.tree.evicted)
            t.release()
            assert cells(t) == {n: p for n, p in before.items() if n not in ghosts}
        t.layout.check()


def test_first_child_goes_below_later_children_to_the_right():
    t = Tree()
    for node, parent in [(1, 0), (2, 1), (3, 1), (4, 0), (5, 2)]:
        t.add(node, parent)
    where = [t.layout.position(n) for n in (1, 2, 3, 4, 5)]
    assert where == [(0, 1), (0, 2), (1, 2), (2, 1), (0, 3)]
    t.add(6, 1)  # column 2 is taken by 4: a column is inserted there, 4 shifts right
    assert [t.layout.position(n) for n in (4, 6)] == [(3, 1), (2, 2)]
    t.remove(6)
    t.release()
    t.add(7, 1)  # the column freed by 6 is reused: nothing moves
    assert [t.layout.position(n) for n in (4, 7)] == [(3, 1), (2, 2)]
    t.layout.check()


def test_a_ghost_keeps_its_cell_until_released():
    t = Tree()
    t.add(1, 0)
    t.remove(1)
    t.add(2, 0)  # the root's column below it is still the ghost's
    assert t.layout.position(2) == (1, 1)
    assert t.release() == [1]
    with pytest.raises(KeyError):
        t.add(2, 0)  # already placed


# ---------------------------------------------------------------------- Figure 3
def below_a_cut(i: int | None, new_suffixes: set[int], parents: dict) -> bool:
    """True if ``i`` or an ancestor is the new lower half of a cut edge (its subtree moved
    down one row)."""
    while i is not None:
        if i in new_suffixes:
            return True
        i = parents[i]
    return False


@pytest.mark.parametrize("per", ["step", "event"])
def test_untouched_nodes_do_not_move_in_figure3(tokenizer, per):
    frames = scenario_frames(per=per, tokenizer=tokenizer)
    for prev, frame in zip(frames, frames[1:], strict=False):
        before = {n.id: n for n in prev.nodes}
        cut = {n.id for n in frame.nodes if n.state == "split" and n.parent in before}
        parents = {n.id: n.parent for n in frame.nodes}

        for n in frame.nodes:
            if n.id not in before or n.state != "idle":
                continue
            old = before[n.id]
            if below_a_cut(n.parent, cut - before.keys(), parents):
                assert (n.col, n.depth) == (old.col, old.depth + 1), (frame.caption, n.id)
            else:
                assert (n.col, n.depth) == (old.col, old.depth), (frame.caption, n.id)


@pytest.mark.parametrize("per", ["step", "event"])
def test_every_figure3_frame_is_a_valid_drawing(tokenizer, per):
    for frame in scenario_frames(per=per, tokenizer=tokenizer):
        where = {(n.col, n.depth) for n in frame.nodes}
        assert len(where) == len(frame.nodes), frame.caption  # no two boxes overlap
        by_id = {n.id: n for n in frame.nodes}
        for n in frame.nodes:
            if n.parent is not None:
                p = by_id[n.parent]
                assert n.depth == p.depth + 1 and n.col >= p.col


def test_frames_are_deterministic(tokenizer):
    a = scenario_frames(per="event", tokenizer=tokenizer)
    b = scenario_frames(per="event", tokenizer=tokenizer)
    assert [f.to_dict() for f in a] == [f.to_dict() for f in b]
