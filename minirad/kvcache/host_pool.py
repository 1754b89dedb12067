"""The host tier of a hierarchical KV cache: slots in host (CPU) memory, and the copies between
them and the device pool.

SGLang's HiCache keeps a second pool in pinned host memory (``memory_pool_host.py``,
``--hicache-ratio`` times the device pool, 2 by default) and moves KV between the two with its
``HiCacheController`` (``managers/cache_controller.py``: ``write`` backs device slots up to host
slots, ``load`` brings them back). Here the host pool is a
:class:`~minirad.kvcache.kv_pool.TokenToKVPoolAllocator` of its own: the same pages, the same
ownership checks, only a different memory. The copies go through a :class:`KVTransfer`:
:class:`TensorTransfer` copies real K and V tensors (the engine), :class:`NoTransfer` moves
nothing (the tree alone) and :class:`RecordingTransfer` remembers what would have moved (tests,
the visualizer). A transfer also reads host slots out as a storage page and writes pages read
from the disk tier into host slots.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from minirad.errors import InvalidArgumentError
from minirad.kvcache.kv_pool import KVCache, TokenToKVPoolAllocator

__all__ = ["KVTransfer", "NoTransfer", "RecordingTransfer", "TensorTransfer", "make_host_pool"]

Page = dict[str, torch.Tensor]  # one storage page: named tensors (``k``, ``v``)

DEFAULT_HICACHE_RATIO = 2.0  # SGLang's --hicache-ratio


def make_host_pool(
    device_pool: TokenToKVPoolAllocator, hicache_ratio: float = DEFAULT_HICACHE_RATIO
) -> TokenToKVPoolAllocator:
    """A host pool ``hicache_ratio`` times the size of ``device_pool`` (whole pages, at least
    one), with its page size. It has a private event bus: its events are not the device pool's.

    Raises:
        InvalidArgumentError: ``hicache_ratio`` is not a positive number.
    """
    if isinstance(hicache_ratio, bool) or not isinstance(hicache_ratio, int | float):
        raise InvalidArgumentError(f"hicache_ratio must be a number, got {hicache_ratio!r}")
    if not math.isfinite(hicache_ratio) or hicache_ratio <= 0:
        raise InvalidArgumentError(f"hicache_ratio must be > 0, got {hicache_ratio!r}")
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

    def accepts(self, page: Page) -> bool:
        """Whether ``page`` (read from disk) has this cache's layout: names, shape, dtype."""
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

    def accepts(self, page: Page) -> bool:
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


class TensorTransfer:
    """Copies real K and V between a device :class:`KVCache` and a host one of the same layout
    (both in CPU memory on this machine; on a GPU the device cache lives there and each copy
    is a host<->device transfer). A storage page holds ``k`` and ``v`` as
    ``[num_layers, tokens, num_kv_heads, head_dim]``.

    Raises:
        InvalidArgumentError: the two caches differ in layers, heads, head size or dtype.
    """

    def __init__(self, device: KVCache, host: KVCache) -> None:
        same = ("num_layers", "num_kv_heads", "head_dim", "dtype")
        if any(getattr(device, a) != getattr(host, a) for a in same):
            raise InvalidArgumentError(f"host cache {host!r} differs in layout from {device!r}")
        self.device, self.host = device, host

    @staticmethod
    def _flat(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (cache.num_layers, cache.num_slots, cache.num_kv_heads, cache.head_dim)
        return cache.k_cache.view(shape), cache.v_cache.view(shape)

    @classmethod
    def _copy(cls, src: KVCache, src_slots, dst: KVCache, dst_slots) -> None:
        s, d = torch.as_tensor(src_slots), torch.as_tensor(dst_slots)
        for a, b in zip(cls._flat(src), cls._flat(dst), strict=True):
            b[:, d] = a[:, s]

    def write_backup(self, device_slots: list[int], host_slots: list[int]) -> None:
        self._copy(self.device, device_slots, self.host, host_slots)

    def load_back(self, host_slots: list[int], device_slots: list[int]) -> None:
        self._copy(self.host, host_slots, self.device, device_slots)

    def read_host(self, host_slots: list[int]) -> Page:
        k, v = self._flat(self.host)
        idx = torch.as_tensor(host_slots)
        return {"k": k[:, idx], "v": v[:, idx]}  # advanced indexing copies

    def accepts(self, page: Page) -> bool:
        h = self.host
        ok = isinstance(page, dict) and set(page) == {"k", "v"}
        return ok and all(
            isinstance(t, torch.Tensor)
            and t.dtype == h.dtype
            and t.dim() == 4
            and (t.shape[0], t.shape[2], t.shape[3]) == (h.num_layers, h.num_kv_heads, h.head_dim)
            and t.shape == page["k"].shape
            for t in page.values()
        )

    def write_host(self, host_slots: list[int], pages: Sequence[Page], offset: int) -> None:
        idx = torch.as_tensor(host_slots)
        for name, dst in zip(("k", "v"), self._flat(self.host), strict=True):
            src = torch.cat([p[name] for p in pages], dim=1)[:, offset : offset + len(idx)]
            dst[:, idx] = src
