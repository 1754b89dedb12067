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
- :class:`minirad.block_pool.BlockPool`: vLLM's block pool with reference counts and a hashed
  prefix cache, used for comparison in chapter 02.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Sequence

import numpy as np
import torch

from .errors import InvalidArgumentError, InvalidKeyError, OutOfMemoryError, UnknownBlockError
from .events import AllocEvent, EventBus, FreeEvent, ResetEvent

__all__ = ["KVCache", "TokenToKVPoolAllocator", "block_table_from_slots", "slot_mapping"]


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

    Attributes:
        cache_owned: ``[size]`` bool, set and cleared by the :class:`~minirad.RadixCache` over
            this allocator for the slots it holds; :meth:`free` refuses them (at once).
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
        self.cache_owned = np.zeros(size, dtype=bool)
        self.clear()

    def clear(self) -> None:
        """Free every page (a :class:`ResetEvent`); the cache over it must be reset too."""
        # A FIFO queue as a list plus a head index: slicing runs in C, where a deque would
        # pop one page at a time in Python (the allocator is on every request's hot path).
        self._free_pages: list[int] = list(range(self.num_pages))
        self._head = 0
        self._allocated = np.zeros(self.num_pages, dtype=bool)  # page handed out?
        self.cache_owned[:] = False  # in place: the cache holds this array
        if self.bus.active:
            self.bus.emit(ResetEvent(self.bus.tick(), "token_pool"))

    def available_size(self) -> int:
        """Free capacity in tokens."""
        return self._num_free_pages() * self.page_size

    def _num_free_pages(self) -> int:
        return len(self._free_pages) - self._head

    def alloc(self, num_tokens: int, owner: str | None = None) -> list[int]:
        """Slots for ``num_tokens`` tokens, in whole fresh pages: the first ``num_tokens``
        slots of ``ceil(num_tokens / page_size)`` pages (the rest of the last page stays with
        the caller until it frees that page).

        Raises:
            InvalidArgumentError: ``num_tokens`` is negative.
            OutOfMemoryError: not enough free pages; nothing is allocated.
        """
        if not isinstance(num_tokens, numbers.Integral) or num_tokens < 0:  # numpy ints too
            raise InvalidArgumentError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        num_tokens = int(num_tokens)
        n_pages = -(-num_tokens // self.page_size)
        if n_pages > self._num_free_pages():
            raise OutOfMemoryError(
                f"need {n_pages} pages ({num_tokens} tokens), only {self._num_free_pages()} free"
            )
        pages = self._free_pages[self._head : self._head + n_pages]
        self._head += n_pages
        if self._head > self.num_pages:  # compact: drop the consumed front of the list
            del self._free_pages[: self._head]
            self._head = 0
        self._allocated[pages] = True
        ps = self.page_size
        slots = pages if ps == 1 else [p * ps + o for p in pages for o in range(ps)][:num_tokens]
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
        # dict.fromkeys keeps the order and drops repeats: a page is freed once.
        pages = list(dict.fromkeys((self._checked(slots) // self.page_size).tolist()))
        self._allocated[pages] = False
        self._free_pages.extend(pages)
        self.bus.tick()
        if self.bus.active:
            self.bus.emit(FreeEvent(self.bus.time, "token_pool", "slot", tuple(slots)))

    def check_allocated(self, slots: Sequence[int]) -> None:
        """Raise what :meth:`free` would raise for ``slots``: every slot must be an int in
        range whose page is handed out, and not held by the cache."""
        if len(slots):
            self._checked(slots)

    def _checked(self, slots: Sequence[int]) -> np.ndarray:
        """``slots`` as an int array if :meth:`free` may free them all; else raise why not."""
        arr = np.asarray(slots)
        if (
            arr.dtype.kind not in "iu"
            or arr.ndim != 1
            or arr.min() < 0
            or arr.max() >= self.size
            or not self._allocated[arr // self.page_size].all()
            or self.cache_owned[arr].any()
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
            if not self._allocated[s // self.page_size]:
                raise UnknownBlockError(f"slot {s} (page {s // self.page_size}) is not allocated")
            if self.cache_owned[s]:
                raise InvalidKeyError(f"slot {s} is held by the radix cache (freed on eviction)")
        raise UnknownBlockError(f"slots must be ints, got {slots!r}")  # e.g. bools

    def is_allocated(self, slot: int) -> bool:
        """True if ``slot`` is in range and its page is handed out."""
        return 0 <= slot < self.size and bool(self._allocated[slot // self.page_size])

    def __repr__(self) -> str:
        return (
            f"TokenToKVPoolAllocator(size={self.size}, page_size={self.page_size}, "
            f"available={self.available_size()})"
        )
