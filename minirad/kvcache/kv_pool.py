"""KV memory: one physical K/V tensor, and a token-slot allocator over it.

Layout. ``KVCache.k_cache`` and ``KVCache.v_cache`` each have shape
``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``. Layer first, because the
engine runs one layer at a time: ``k_cache[layer]`` is a contiguous
``[num_blocks, block_size, num_kv_heads, head_dim]`` tensor, and its flat view
``[num_blocks * block_size, num_kv_heads, head_dim]`` is indexed directly by a *slot*
``slot = block_id * block_size + offset``. vLLM keeps one such tensor per layer for the same
reason (``vllm/v1/worker/gpu_model_runner.py``): blocks first would stride every write.

Two allocators share that slot space:

- :class:`TokenToKVPoolAllocator` (here): SGLang's token-slot allocator
  (``sglang/srt/mem_cache/allocator.py``), used by the radix tree. With ``page_size > 1`` it
  hands out whole pages, so a page is a block of the physical tensor.
- :class:`minirad.kvcache.block_pool.BlockPool`: vLLM's block pool with reference counts and a
  hashed prefix cache, used for comparison in chapter 02.
"""

from __future__ import annotations

import numbers
import operator
from array import array
from collections.abc import Sequence

import numpy as np
import torch

from minirad.errors import (
    InvalidArgumentError,
    InvalidKeyError,
    OutOfMemoryError,
    UnknownBlockError,
)
from minirad.events import AllocEvent, EventBus, FreeEvent, ResetEvent

__all__ = ["KVCache", "TokenToKVPoolAllocator", "block_table_from_slots", "slot_mapping"]

# The state of a page in ``TokenToKVPoolAllocator.page_state``. Allocated is 0: the radix
# cache checks that new slots are all allocated with one count_nonzero.
PAGE_ALLOCATED, PAGE_FREE, PAGE_CACHED = 0, 1, 2


class KVCache:
    """The physical KV memory of a model: K and V for every layer, block and token slot.

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: the tensor shape (see the
            module docstring). ``block_size`` is in tokens.
        dtype: element type (fp32 on CPU for exact parity with Hugging Face).

    Raises:
        InvalidArgumentError: a dimension is not a positive integer.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        dims = dict(
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        for name, v in dims.items():
            if not isinstance(v, int) or v <= 0:
                raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_slots(self) -> int:
        """Token capacity: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K plus V that one token occupies across all layers."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def nbytes(self) -> int:
        """Total bytes of both tensors."""
        return self.bytes_per_token * self.num_slots

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as flat slot views, each ``[num_slots, num_kv_heads, head_dim]``."""
        shape = (self.num_slots, self.num_kv_heads, self.head_dim)
        return self.k_cache[layer].view(shape), self.v_cache[layer].view(shape)

    def store(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write new keys/values: ``k``, ``v`` are ``[num_tokens, num_kv_heads, head_dim]``,
        ``slot_mapping`` is ``[num_tokens]`` (int64), one slot per token."""
        k_flat, v_flat = self.layer(layer)
        k_flat[slot_mapping] = k.to(self.dtype)
        v_flat[slot_mapping] = v.to(self.dtype)

    def __repr__(self) -> str:
        return (
            f"KVCache(num_layers={self.num_layers}, num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, nbytes={self.nbytes})"
        )


def slot_mapping(
    block_table: Sequence[int], positions: Sequence[int], block_size: int
) -> list[int]:
    """Physical slot of each token position of one sequence (vLLM's ``slot_mapping``).

    ``slot = block_table[pos // block_size] * block_size + pos % block_size``.

    Raises:
        InvalidArgumentError: a position lies beyond the blocks in ``block_table``.
    """
    out = []
    for pos in positions:
        i = pos // block_size
        if pos < 0 or i >= len(block_table):
            raise InvalidArgumentError(
                f"position {pos} is outside the {len(block_table)} blocks of the block table"
            )
        out.append(block_table[i] * block_size + pos % block_size)
    return out


def block_table_from_slots(slots: Sequence[int], block_size: int) -> list[int]:
    """The block ids that hold a sequence's slots, in order (SGLang's ``req_to_token`` row
    turned into vLLM's ``block_table``).

    Raises:
        InvalidArgumentError: the slots do not fill their pages in order (a token sits at the
            wrong offset), so no block table describes them.
    """
    table: list[int] = []
    for pos, slot in enumerate(slots):
        if slot % block_size != pos % block_size:
            raise InvalidArgumentError(
                f"token {pos} sits at offset {slot % block_size} of its block; "
                f"a block table needs offset {pos % block_size}"
            )
        if pos % block_size == 0:
            table.append(slot // block_size)
        elif slot // block_size != table[-1]:
            raise InvalidArgumentError(f"token {pos} jumps to another block mid-page")
    return table


class TokenToKVPoolAllocator:
    """Hands out KV slots one page at a time (SGLang ``TokenToKVPoolAllocator`` /
    ``PagedTokenToKVPoolAllocator``, ``sglang/srt/mem_cache/allocator.py``).

    Slots are ``0 .. size - 1``; page ``p`` holds slots ``p * page_size .. (p+1) * page_size - 1``.
    Free pages are reused first-in first-out, so allocation order is deterministic.

    Args:
        size: capacity in tokens, a multiple of ``page_size``.
        page_size: tokens per page (= ``block_size`` of the :class:`KVCache`).
        bus: event bus for :class:`AllocEvent` / :class:`FreeEvent` (a private one if None).

    Raises:
        InvalidArgumentError: ``size`` is not a positive multiple of ``page_size``, or too
            large for this machine's memory.

    Attributes:
        page_state: ``[num_pages]`` uint8, each page ``PAGE_FREE``, ``PAGE_ALLOCATED`` or
            ``PAGE_CACHED``: the :class:`~minirad.RadixCache` over this allocator moves the
            pages it takes from allocated to cached, and :meth:`free` refuses those (at once).
        generation: how many times :meth:`clear` ran; the cache compares it with the one it
            started under before it frees what it evicts.
        peak_used_size: the most slots ever handed out at once since :meth:`clear`, in tokens
            (whole pages; the radix tree's cached slots count as used, whereas vLLM's "KV
            cache usage" counts free cached blocks as free).
    """

    def __init__(self, size: int, page_size: int = 1, bus: EventBus | None = None) -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise InvalidArgumentError(f"page_size must be a positive int, got {page_size!r}")
        if not isinstance(size, int) or size <= 0 or size % page_size:
            raise InvalidArgumentError(
                f"size must be a positive multiple of page_size={page_size}, got {size!r}"
            )
        self.size, self.page_size = size, page_size
        self.num_pages = size // page_size
        self.bus = bus if bus is not None else EventBus()
        self.generation = 0
        try:
            self.page_state = np.zeros(self.num_pages, dtype=np.uint8)
            # One int object per slot, handed out again and again: gathering them (C) is
            # cheaper than making new ints and freeing them on eviction (page_size > 1; with
            # page_size 1 the free ring's list holds the slots themselves).
            self._slot_ints = np.arange(size, dtype=object)
        except (MemoryError, ValueError) as e:  # beyond this machine's memory, or numpy's sizes
            raise InvalidArgumentError(f"cannot hold a pool of {size:,} slots here ({e})") from None
        self.clear()

    def clear(self) -> None:
        """Free every page (a :class:`ResetEvent`); the cache over it must be reset too."""
        # The free pages, first in first out, in a ring of fixed size (a growing queue would
        # reallocate and touch new memory), kept twice: as an int64 array, whose slices index
        # page_state without converting a list (numpy converts one Python int at a time), and
        # as a list of the same ids, whose slices are the slots of page_size 1 (no gather).
        self._ring = np.arange(self.num_pages, dtype=np.int64)
        self._ring_list = list(range(self.num_pages))
        self._head, self._num_free = 0, self.num_pages
        self.peak_used_size = 0
        self.page_state[:] = PAGE_FREE  # in place: the cache holds this array
        self.generation += 1
        if self.bus.active:
            self.bus.emit(ResetEvent(self.bus.tick(), "token_pool"))

    def available_size(self) -> int:
        """Free capacity in tokens."""
        return self._num_free * self.page_size

    def used_size(self) -> int:
        """Slots handed out and not yet freed, in tokens (``size - available_size()``)."""
        return self.size - self.available_size()

    def alloc(self, num_tokens: int, owner: str | None = None) -> list[int]:
        """Slots for ``num_tokens`` tokens, in whole fresh pages: the first ``num_tokens``
        slots of ``ceil(num_tokens / page_size)`` pages (the rest of the last page stays with
        the caller until it frees that page).

        Raises:
            InvalidArgumentError: ``num_tokens`` is negative.
            OutOfMemoryError: not enough free pages; nothing is allocated.
        """
        if type(num_tokens) is not int:
            if not isinstance(num_tokens, numbers.Integral):
                raise InvalidArgumentError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
            num_tokens = int(num_tokens)  # numpy ints too
        if num_tokens < 0:
            raise InvalidArgumentError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        n_pages = -(-num_tokens // self.page_size)
        free = self._num_free
        if n_pages > free:
            raise OutOfMemoryError(f"need {n_pages} pages ({num_tokens} tokens), only {free} free")
        head, end, ps = self._head, self._head + n_pages, self.page_size
        if end <= self.num_pages:
            page_ids, page_list = self._ring[head:end], self._ring_list[head:end]
        else:  # wraps around the ring
            end -= self.num_pages
            page_ids = np.concatenate((self._ring[head:], self._ring[:end]))
            page_list = self._ring_list[head:] + self._ring_list[:end]
        self._head, self._num_free = end, free - n_pages
        self.page_state[page_ids] = PAGE_ALLOCATED
        if ps == 1:
            slots = page_list
        else:
            ids = (page_ids[:, None] * ps + np.arange(ps)).ravel()[:num_tokens]
            slots = self._slot_ints[ids].tolist()
        self.peak_used_size = max(self.peak_used_size, self.size - (free - n_pages) * ps)
        self.bus.tick()
        if self.bus.active and slots:
            self.bus.emit(AllocEvent(self.bus.time, "token_pool", "slot", tuple(slots), owner))
        return slots

    def free(self, slots: Sequence[int]) -> None:
        """Return the pages that hold ``slots`` (a page is freed once, whichever of its slots
        are named).

        Raises (nothing is freed then):
            UnknownBlockError: a slot is out of range or its page is not allocated.
            InvalidKeyError: the radix cache holds a slot (it frees it when it evicts it).
        """
        if not isinstance(slots, Sequence | np.ndarray):
            raise UnknownBlockError(f"slots must be a sequence of ints, got {slots!r}")
        if len(slots) == 0:
            return
        arr = self._checked(slots)
        pages = arr if self.page_size == 1 else arr // self.page_size
        if len(pages) > 1:
            ordered = np.sort(pages)
            if np.count_nonzero(ordered[1:] == ordered[:-1]):  # a page named twice: free it once
                pages = pages[np.sort(np.unique(pages, return_index=True)[1])]
        pages = pages.astype(np.int64, copy=False)
        self._release(pages, pages.tolist(), arr)

    def free_evicted(self, slots: list[int], slot_ids: np.ndarray, generation: int) -> None:
        """Free the slots the radix cache has just evicted: ``slots`` (whole pages, in order)
        and ``slot_ids``, the same as an int64 array.

        The cache's invariants already prove them distinct, cached and its own, as long as the
        pool was not cleared under it: only ``generation`` (the cache's) is checked here.

        Raises:
            UnknownBlockError: the pool was cleared since the cache took these slots.
        """
        if generation != self.generation:
            raise UnknownBlockError("the radix cache evicted slots of a pool cleared since")
        if slots:
            ps = self.page_size
            pages = slot_ids if ps == 1 else slot_ids[::ps] // ps
            self._release(pages, slots if ps == 1 else pages.tolist(), slots)

    def _release(self, pages: np.ndarray, page_list: list[int], slots) -> None:
        """Queue the (distinct, int64) ``pages``, also given as ``page_list``, as free;
        ``slots`` (a list or an array) are the slots named, for the event."""
        self.page_state[pages] = PAGE_FREE
        tail, k = (self._head + self._num_free) % self.num_pages, len(page_list)
        if tail + k <= self.num_pages:
            self._ring[tail : tail + k], self._ring_list[tail : tail + k] = pages, page_list
        else:  # the rest wraps to the front of the ring
            cut = self.num_pages - tail
            self._ring[tail:], self._ring[: k - cut] = pages[:cut], pages[cut:]
            self._ring_list[tail:], self._ring_list[: k - cut] = page_list[:cut], page_list[cut:]
        self._num_free += k
        self.bus.tick()
        if self.bus.active:
            self.bus.emit(
                FreeEvent(self.bus.time, "token_pool", "slot", tuple(np.asarray(slots).tolist()))
            )

    def check_allocated(self, slots: Sequence[int]) -> None:
        """Raise what :meth:`free` would raise for ``slots``: every slot must be an int in
        range whose page is handed out, and not held by the cache."""
        if len(slots):
            self._checked(slots)

    def _checked(self, slots: Sequence[int]) -> np.ndarray:
        """``slots`` as an int64 array if :meth:`free` may free them all; else raise why not."""
        if isinstance(slots, np.ndarray):
            if slots.dtype.kind not in "iu" or slots.ndim != 1:
                self._raise_bad_free(slots)
            arr = slots
        else:
            if isinstance(slots, bytes | bytearray | memoryview):  # ints, not 8-byte words
                slots = list(slots)
            try:  # 'Q' type-checks at C speed (~8x numpy's list conversion); >= 2**63 wraps < 0
                arr = np.frombuffer(array("Q", slots), np.int64)
            except (TypeError, OverflowError):
                self._raise_bad_free(slots)
        lo = int(np.minimum.reduce(arr))  # ufunc reductions: C, unlike arr.min()
        if (
            lo < 0
            or np.maximum.reduce(arr) >= self.size
            or np.count_nonzero(self.page_state[arr // self.page_size])  # not all allocated
            # array("Q") takes bools as 0 and 1: only then look at the types
            or (lo <= 1 and not isinstance(slots, np.ndarray) and bool in set(map(type, slots)))
        ):
            self._raise_bad_free(slots)
        return arr

    def _raise_bad_free(self, slots: Sequence[int]) -> None:
        """Raise the error that says what is wrong with ``slots``."""
        for s in slots:
            try:
                s = operator.index(s)
            except TypeError:
                raise UnknownBlockError(f"slot {s!r} is not an int") from None
            if not 0 <= s < self.size:
                raise UnknownBlockError(f"slot {s} is not in 0..{self.size - 1}")
            state = self.page_state[s // self.page_size]
            if state == PAGE_FREE:
                raise UnknownBlockError(f"slot {s} (page {s // self.page_size}) is not allocated")
            if state == PAGE_CACHED:
                raise InvalidKeyError(f"slot {s} is held by the radix cache (freed on eviction)")
        raise UnknownBlockError(f"slots must be ints, got {slots!r}")  # e.g. bools

    @property
    def cache_owned(self) -> np.ndarray:
        """``[size]`` bool, a new array: True for each slot whose page the radix cache holds."""
        return np.repeat(self.page_state == PAGE_CACHED, self.page_size)

    def is_allocated(self, slot: int) -> bool:
        """True if ``slot`` is in range and its page is handed out (cached pages included)."""
        return 0 <= slot < self.size and bool(self.page_state[slot // self.page_size] != PAGE_FREE)

    def __repr__(self) -> str:
        return (
            f"TokenToKVPoolAllocator(size={self.size}, page_size={self.page_size}, "
            f"available={self.available_size()})"
        )
