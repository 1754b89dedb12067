"""A node of the hybrid (Full, SWA) radix tree: our radix tree's node with one
:class:`ComponentData` per component.

SGLang 0.5.23's ``UnifiedTreeNode`` keeps, per component, its own ``value`` (pool slots),
``lock_ref`` and place in the component's LRU list (``ComponentData``). Here the Full
component is the tree node's own ``value`` (the tokens' full-pool slots), ``lock_ref`` and
``last_access_time``; the SWA component, added through the node's Component seam, holds the
same tokens' SWA-pool slots. ``swa.value is None`` while ``full.value`` stays is a
**tombstone**: the tree keeps the tokens and their full-attention KV, but their sliding-window
KV is gone, so no hit may end on them (:func:`~minirad.kvcache.swa_window.make_swa_validator`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple

from minirad.kvcache.radix_node import TreeNode

__all__ = ["ComponentData", "ComponentType", "SWAMatchResult", "SWANode"]


class ComponentType(enum.Enum):
    """The components of this cache, in SGLang's eviction priority order (Full first)."""

    FULL = "full"
    SWA = "swa"


@dataclass
class ComponentData:
    """One component's data on one node.

    Attributes:
        value: the slots of the node's tokens in this component's pool; None: a tombstone.
        lock_ref: running requests whose lock covers this node for this component.
        last_access: logical time of the last match or insert that refreshed it (Full's LRU
            rank; SWA's rank is its place in the tree's SWA list).
    """

    value: list[int] | None
    lock_ref: int = 0
    last_access: float = 0.0


def _alias(name: str) -> property:
    """A property read from and written to the viewed node's attribute ``name``."""
    return property(
        lambda self: getattr(self._node, name), lambda self, v: setattr(self._node, name, v)
    )


class _FullData:
    """The Full component's :class:`ComponentData`, read from the node itself: the radix
    tree's ``value``, ``lock_ref`` and ``last_access_time`` are the Full component's (the
    Component seam of :mod:`~minirad.kvcache.radix_node`), so split and insert keep them."""

    __slots__ = ("_node",)

    def __init__(self, node: TreeNode) -> None:
        self._node = node

    value = _alias("value")
    lock_ref = _alias("lock_ref")
    last_access = _alias("last_access_time")


class SWANode(TreeNode):
    """A :class:`~minirad.kvcache.radix_node.TreeNode` with an SWA component beside its own.

    Attributes (besides the tree's):
        full: the Full component: the node's ``value``, ``lock_ref`` and
            ``last_access_time`` seen as a :class:`ComponentData`.
        swa: the SWA component's :class:`ComponentData`.
        swa_uuid: the window-lock boundary stamp (SGLang's ``metadata["uuid"]``): a lock whose
            window was filled at this node releases up to here.
    """

    __slots__ = ("swa", "swa_uuid")

    def __init__(self, *args: Any) -> None:  # TreeNode's arguments
        super().__init__(*args)
        self.swa = ComponentData([])
        self.swa_uuid: int | None = None

    @property
    def full(self) -> _FullData:
        return _FullData(self)

    def data(self, ct: ComponentType) -> ComponentData | _FullData:
        return self.full if ct is ComponentType.FULL else self.swa

    @property
    def is_tombstone(self) -> bool:
        return self.swa.value is None

    def __repr__(self) -> str:
        kind = "tombstone" if self.is_tombstone else "live"
        return f"SWANode(id={self.id}, {len(self.key)} tokens, {kind})"


class SWAMatchResult(NamedTuple):
    """What :meth:`SWARadixCache.match_prefix` found.

    Attributes:
        indices: full slots of the valid prefix (one per token).
        last_node: the node the valid prefix ends on (the root when none); lock it.
        full_kv_hit_length: tokens the tree holds full KV for (may pass ``len(indices)``).
        swa_branching_seqlen: ``full_kv_hit_length`` when it passes the valid hit, else None:
            where the request should insert early so the next one finds a window there.
    """

    indices: list[int]
    last_node: SWANode
    full_kv_hit_length: int
    swa_branching_seqlen: int | None
