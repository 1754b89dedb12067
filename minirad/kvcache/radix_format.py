"""The radix tree as text: :meth:`~RadixFormatMixin.format_tree`, ``pretty_print`` and the
cache's ``repr``.

Component seam: a node's line shows its one value's size and ``lock_ref``; with components
(SGLang 0.5.23's ``UnifiedRadixCache``) it shows each component's, a tombstone marked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minirad.kvcache.radix_node import TreeNode

__all__ = ["RadixFormatMixin"]


class RadixFormatMixin:
    """Print the tree. A part of RadixCache: it reads the tree (``radix_tree.py``)."""

    def format_tree(self, decode: Callable[[list[int]], str] | None = None) -> str:
        """The tree as indented text: one line per node with its id, size, lock_ref and key
        (decoded with ``decode`` if given, else the first token ids)."""
        lines = [f"root  #tokens={self.total_size()}"]

        def walk(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                if decode is not None:
                    label = repr(decode(child.key))
                else:
                    label = str(child.key[:10])[:-1] + (", ...]" if len(child.key) > 10 else "]")
                lines.append(
                    f"{'  ' * depth}[{child.id}] len={len(child.key)} "
                    f"lock_ref={child.lock_ref} {label}"
                )
                walk(child, depth + 1)

        walk(self.root_node, 1)
        return "\n".join(lines)

    def pretty_print(self, decode: Callable[[list[int]], str] | None = None) -> None:
        """Print :meth:`format_tree`."""
        print(self.format_tree(decode))

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self.page_size}, policy={self.eviction_policy.name!r}, "
            f"nodes={sum(1 for _ in self.nodes())}, evictable={self.evictable_size_}, "
            f"protected={self.protected_size_})"
        )
