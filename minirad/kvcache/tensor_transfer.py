"""Real KV copies between the device pool and the host pool of a hierarchical cache: the
:class:`~minirad.kvcache.host_pool.KVTransfer` the engine gives its
:class:`~minirad.kvcache.hiradix_cache.HiRadixCache`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minirad.errors import InvalidArgumentError
from minirad.kvcache.host_pool import Page
from minirad.kvcache.kv_pool import KVCache

__all__ = ["TensorTransfer"]


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
        """Gather on the source's device, move once, scatter on the destination's (a CUDA
        device pool and a CPU host pool: one transfer per tensor)."""
        for a, b in zip(cls._flat(src), cls._flat(dst), strict=True):
            s = torch.as_tensor(src_slots, device=a.device)
            d = torch.as_tensor(dst_slots, device=b.device)
            b[:, d] = a[:, s].to(b.device)

    def write_backup(self, device_slots: list[int], host_slots: list[int]) -> None:
        self._copy(self.device, device_slots, self.host, host_slots)

    def load_back(self, host_slots: list[int], device_slots: list[int]) -> None:
        self._copy(self.host, host_slots, self.device, device_slots)

    def read_host(self, host_slots: list[int]) -> Page:
        k, v = self._flat(self.host)
        idx = torch.as_tensor(host_slots)
        return {"k": k[:, idx], "v": v[:, idx]}  # advanced indexing copies

    def accepts(self, page: Page, num_tokens: int) -> bool:
        h = self.host
        want = (h.num_layers, num_tokens, h.num_kv_heads, h.head_dim)
        return (
            isinstance(page, dict)
            and set(page) == {"k", "v"}
            and all(
                isinstance(t, torch.Tensor) and t.dtype == h.dtype and tuple(t.shape) == want
                for t in page.values()
            )
        )

    def write_host(self, host_slots: list[int], pages: Sequence[Page], offset: int) -> None:
        idx = torch.as_tensor(host_slots)
        for name, dst in zip(("k", "v"), self._flat(self.host), strict=True):
            src = torch.cat([p[name] for p in pages], dim=1)[:, offset : offset + len(idx)]
            dst[:, idx] = src
