"""The host tier of a hierarchical KV cache: slots in host (CPU) memory, and the copies between
them and the device pool.

SGLang's HiCache keeps a second pool in pinned host memory (``memory_pool_host.py``,
``--hicache-ratio`` times the device pool, 2 by default) and moves KV between the two with its
``HiCacheController`` (``managers/cache_controller.py``: ``write`` backs device slots up to host
slots, ``load`` brings them back). Here the host pool is a
:class:`~minirad.kvcache.kv_pool.TokenToKVPoolAllocator` of its own: the same pages, the same
ownership checks, only a different memory. The copies go through a :class:`KVTransfer`:
:class:`~minirad.kvcache.tensor_transfer.TensorTransfer` copies real K and V tensors (the
engine), :class:`NoTransfer` moves nothing (the tree alone) and :class:`RecordingTransfer`
remembers what would have moved (tests, the visualizer). A transfer also reads host slots
out as a storage page and writes pages read from the disk tier into host slots.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from minirad.errors import InvalidArgumentError
from minirad.kvcache.kv_pool import TokenToKVPoolAllocator
from minirad.kvcache.tiers import DEFAULT_HICACHE_RATIO

if TYPE_CHECKING:
    import torch

__all__ = ["KVTransfer", "NoTransfer", "Page", "RecordingTransfer", "make_host_pool"]

Page = dict[str, "torch.Tensor"]  # one storage page: named tensors (``k``, ``v``)


def make_host_pool(
    device_pool: TokenToKVPoolAllocator, hicache_ratio: float = DEFAULT_HICACHE_RATIO
) -> TokenToKVPoolAllocator:
    """A host pool ``hicache_ratio`` times the size of ``device_pool`` (whole pages, at least
    one), with its page size. It has a private event bus: its events are not the device pool's.

    SGLang refuses a host pool no larger than the device pool (ratio <= 1: the host would
    mostly hold copies of what the device has); it is allowed here, to show why.

    Raises:
        InvalidArgumentError: ``hicache_ratio`` is not a finite number > 0.
    """
    bad = f"hicache_ratio must be a finite number > 0, got {hicache_ratio!r}"
    if isinstance(hicache_ratio, bool) or not isinstance(hicache_ratio, numbers.Real):
        raise InvalidArgumentError(bad)
    try:
        ok = math.isfinite(float(hicache_ratio)) and hicache_ratio > 0
    except OverflowError:
        ok = False
    if not ok:
        raise InvalidArgumentError(bad)
    ps = device_pool.page_size
    pages = max(1, int(device_pool.num_pages * hicache_ratio))
    return TokenToKVPoolAllocator(pages * ps, ps)


class KVTransfer(Protocol):
    """Moves KV between the pools, one slot for one slot, in order."""

    def write_backup(self, device_slots: list[int], host_slots: list[int]) -> None:
        """Copy the KV of ``device_slots`` into ``host_slots`` (a backup)."""
        ...

    def load_back(self, host_slots: list[int], device_slots: list[int]) -> None:
        """Copy the KV of ``host_slots`` into ``device_slots`` (a load-back)."""
        ...

    def read_host(self, host_slots: list[int]) -> Page:
        """The KV of ``host_slots`` as one storage page."""
        ...

    def accepts(self, page: Page, num_tokens: int) -> bool:
        """Whether ``page`` (read from disk) has this cache's layout (names, shape, dtype) and
        holds ``num_tokens`` tokens."""
        ...

    def write_host(self, host_slots: list[int], pages: Sequence[Page], offset: int) -> None:
        """Copy tokens ``offset ..`` of ``pages`` (joined in order) into ``host_slots``."""
        ...


class NoTransfer:
    """Moves nothing: a cache without tensors (the course's trees, the benchmarks)."""

    def write_backup(self, device_slots: list[int], host_slots: list[int]) -> None:
        pass

    def load_back(self, host_slots: list[int], device_slots: list[int]) -> None:
        pass

    def read_host(self, host_slots: list[int]) -> Page:
        return {}

    def accepts(self, page: Page, num_tokens: int) -> bool:
        return True

    def write_host(self, host_slots: list[int], pages: Sequence[Page], offset: int) -> None:
        pass


class RecordingTransfer(NoTransfer):
    """Remembers every copy between the pools as ``("write_backup" | "load_back", source,
    destination)``."""

    def __init__(self) -> None:
        self.log: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []

    def write_backup(self, device_slots: list[int], host_slots: list[int]) -> None:
        self.log.append(("write_backup", tuple(device_slots), tuple(host_slots)))

    def load_back(self, host_slots: list[int], device_slots: list[int]) -> None:
        self.log.append(("load_back", tuple(host_slots), tuple(device_slots)))
