"""The settings of a hierarchical cache that the command lines name without loading torch:
SGLang's write policies and its default host pool ratio."""

from __future__ import annotations

__all__ = ["DEFAULT_HICACHE_RATIO", "WRITE_POLICIES"]

# When the host pool gets a copy of a node: at insert, once hot, on device eviction.
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
DEFAULT_HICACHE_RATIO = 2.0  # SGLang's --hicache-ratio: host pool size over device pool size
