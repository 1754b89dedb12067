"""vLLM's block-level prefix cache: chained block hashes, a ref-counted block pool, and an LRU
free queue in which freed blocks stay findable until their memory is reused.

Follows ``vllm/v1/core/kv_cache_utils.py`` (``hash_block_tokens``, ``KVCacheBlock``,
``FreeKVCacheBlockQueue``) and ``vllm/v1/core/block_pool.py`` (``BlockPool``); the
scheduler-facing manager on top of them is in ``kv_cache_manager.py``.
The radix tree (``radix_cache.py``) shares at token granularity; this cache shares only whole
blocks whose entire prefix is identical, which chapter 02 compares.

Simplifications, on purpose: by default one KV-cache group (full attention) and no null block
(block ids start at 0; vLLM's pool of ``N`` blocks holds ``N - 1`` usable ones). A hybrid model's
manager (``kv_cache_coordinator.py``) asks for the null block (``use_null_block=True``): block 0
then stands for "no KV here" in block tables (a sliding window's skipped blocks) and is never
allocated, freed, cached or evicted; its cached-block table is keyed by
:func:`make_block_hash_with_group_id`, one entry per KV-cache group.

Like vLLM (``BlockHashToBlockMap``), the hash table does not de-duplicate: a block that becomes
full with a hash another block already holds is registered too (a request that recomputes a
block it could not hit, e.g. the last block of a fully cached prompt or an answer block of a
repeated request, keeps its own block: block tables only grow). Each copy is evicted on its
own, so a hash stays findable while any copy survives, and a copy costs a slot of the pool.
The real vLLM's ``num_cached_tokens`` match this, evictions included
(``tests/test_vllm_parity.py``); with one block per hash they did not.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from minirad.errors import InvalidArgumentError, InvariantError, OutOfMemoryError, UnknownBlockError
from minirad.events import (
    AllocEvent,
    BlockRemovedEvent,
    BlockStoredEvent,
    EventBus,
    FreeEvent,
    ResetEvent,
    TouchEvent,
)

__all__ = [
    "BlockHash",
    "BlockHashWithGroupId",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "get_group_id",
    "hash_block_tokens",
    "make_block_hash_with_group_id",
    "none_hash",
]

BlockHash = bytes  # a SHA-256 digest
BlockHashWithGroupId = bytes  # a BlockHash, then its KV-cache group id in 4 bytes


def none_hash(seed: int | str = 0) -> BlockHash:
    """The parent hash of block 0, derived from ``seed`` (vLLM's ``NONE_HASH``, seeded by
    ``PYTHONHASHSEED``). Caches built with different seeds never share blocks."""
    return hashlib.sha256(f"minirad-none-hash:{seed}".encode()).digest()


def hash_block_tokens(
    parent_block_hash: BlockHash,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    """``H(parent_hash, block_tokens, extra_keys)``: SHA-256 of the pickled triple.

    The parent hash chains the whole prefix into each block's hash, so equal hashes mean an
    equal prefix, not only an equal block. Extra keys (image hashes and offsets, a cache salt)
    go *into* the hashed value.
    """
    payload = (parent_block_hash, tuple(curr_block_token_ids), extra_keys)
    return hashlib.sha256(pickle.dumps(payload, protocol=4)).digest()


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """The cached-block table's key for one KV-cache group: the same tokens are cached, found
    and evicted per group (a sliding-window group may have dropped a block that the
    full-attention group keeps). A byte string, as vLLM's ``BlockHashWithGroupId`` is."""
    return block_hash + group_id.to_bytes(4, "big")


def get_group_id(key: BlockHashWithGroupId) -> int:
    """The group id inside a key made by :func:`make_block_hash_with_group_id`."""
    return int.from_bytes(key[-4:], "big")


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of the physical KV tensor, with its reference count and (when full and
    committed) its hash. ``prev_free_block`` / ``next_free_block`` belong to the free queue;
    ``is_null`` marks a pool's null block (see :class:`BlockPool`)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, front = evicted (reused) first.

    A Python ``deque`` cannot remove from the middle in O(1); a prefix hit must take a cached
    block out of the free queue wherever it sits, so the links live in the blocks themselves.
    Two sentinel nodes remove every edge case.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front block. Raises ``IndexError`` when empty."""
        block = self._head.next_free_block
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the queue in O(1)."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise UnknownBlockError(f"block {block.block_id} is not in the free queue")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def _insert_before(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        prev = anchor.prev_free_block
        prev.next_free_block = block
        block.prev_free_block = prev
        block.next_free_block = anchor
        anchor.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add blocks at the back (reused last), in order."""
        for block in blocks:
            self._insert_before(self._tail, block)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Add blocks at the front (reused first), keeping their order."""
        anchor = self._head.next_free_block
        for block in blocks:
            self._insert_before(anchor, block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out = []
        block = self._head.next_free_block
        while block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """A fixed set of ``num_blocks`` blocks with reference counts and a hash table
    (``cached_block_hash_to_block``: hash -> ``{block_id: block}``, every copy of that
    hash in registration order; a lookup takes the oldest).

    Args:
        num_blocks: capacity in blocks.
        enable_caching: keep freed full blocks findable by hash until reused.
        bus: event bus (a private one if None).
        use_null_block: keep block 0 aside as ``null_block`` (vLLM's): a placeholder for
            positions a block table holds no KV for. It is never handed out, its ``ref_cnt``
            stays 0, ``touch`` and ``free_blocks`` pass over it, and it is never cached; the
            pool then holds ``num_blocks - 1`` usable blocks.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        bus: EventBus | None = None,
        *,
        use_null_block: bool = False,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise InvalidArgumentError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if use_null_block and num_blocks < 2:
            raise InvalidArgumentError("a pool with a null block needs 2 or more blocks, got 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.bus = bus if bus is not None else EventBus()
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.null_block: KVCacheBlock | None = None
        if use_null_block:
            self.null_block = self.free_block_queue.popleft()
            self.null_block.is_null = True

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold KV: all but the null block."""
        return self.num_blocks - (self.null_block is not None)

    def get_num_free_blocks(self) -> int:
        """Blocks with ``ref_cnt == 0`` (cached or not)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The oldest block registered under ``block_hash``, or None. Changes nothing."""
        copies = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(copies.values())) if copies else None

    def get_new_blocks(self, num_blocks: int, owner: str | None = None) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the front of the free queue, each with ``ref_cnt=1``.
        A popped block that was still cached loses its hash now (lazy eviction).

        Raises:
            InvalidArgumentError: ``num_blocks`` is not an int >= 0.
            OutOfMemoryError: fewer free blocks than asked; nothing changes.
        """
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        if num_blocks > self.get_num_free_blocks():
            raise OutOfMemoryError(
                f"need {num_blocks} blocks, only {self.get_num_free_blocks()} free"
            )
        self.bus.tick()
        blocks = [self.free_block_queue.popleft() for _ in range(num_blocks)]
        evicted = [b for b in blocks if b.block_hash is not None]
        for b in evicted:  # only this copy: other blocks with the same hash stay findable
            copies = self.cached_block_hash_to_block[b.block_hash]
            del copies[b.block_id]
            if not copies:
                del self.cached_block_hash_to_block[b.block_hash]
            b.block_hash = None
        for b in blocks:
            b.ref_cnt = 1
        if self.bus.active:
            if evicted:
                ids = tuple(b.block_id for b in evicted)
                self.bus.emit(BlockRemovedEvent(self.bus.time, "block_pool", ids))
            ids = tuple(b.block_id for b in blocks)
            self.bus.emit(AllocEvent(self.bus.time, "block_pool", "block", ids, owner))
        return blocks

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A prefix hit reuses ``blocks``: take free ones out of the free queue (so they
        cannot be evicted while in use) and add one reference to each (the null block is
        passed over).

        Raises:
            UnknownBlockError: a block belongs to another pool; nothing changes.
        """
        self._check_own(blocks)
        blocks = [b for b in blocks if not b.is_null]
        self.bus.tick()
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1
        if self.bus.active and blocks:
            self.bus.emit(
                TouchEvent(
                    self.bus.time,
                    "block_pool",
                    tuple(b.block_id for b in blocks),
                    tuple(b.ref_cnt for b in blocks),
                )
            )

    def free_blocks(self, ordered_blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue.

        ``ordered_blocks`` is in eviction order (first = evict first). Uncached blocks go to
        the *front* (their memory is worthless, reuse it first); cached blocks go to the back,
        which is what makes the queue LRU (vLLM PR #42656). The null block is passed over.

        Raises:
            UnknownBlockError: a block would drop below zero references (a double free), or
                belongs to another pool; nothing changes.
        """
        self._check_own(ordered_blocks)
        ordered_blocks = [b for b in ordered_blocks if not b.is_null]
        counts = Counter(b.block_id for b in ordered_blocks)
        for b in ordered_blocks:
            if b.ref_cnt < counts[b.block_id]:
                raise UnknownBlockError(
                    f"block {b.block_id} has ref_cnt {b.ref_cnt}, cannot free it "
                    f"{counts[b.block_id]} time(s)"
                )
        self.bus.tick()
        released = []
        for b in ordered_blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                released.append(b)
        self.free_block_queue.prepend_n([b for b in released if b.block_hash is None])
        self.free_block_queue.append_n([b for b in released if b.block_hash is not None])
        if self.bus.active and released:
            ids = tuple(b.block_id for b in released)
            self.bus.emit(FreeEvent(self.bus.time, "block_pool", "block", ids))

    def _check_own(self, blocks: Sequence[KVCacheBlock]) -> None:
        for b in blocks:
            if not (0 <= b.block_id < self.num_blocks and self.blocks[b.block_id] is b):
                raise UnknownBlockError(f"{b!r} is not a block of this pool")

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash]
    ) -> None:
        """Register each block under its hash (``blocks[i]`` <-> ``block_hashes[i]``).

        A block that already carries a hash (it came from a prefix hit) is left alone; a hash
        that another block holds gets this block as one more copy (see the module docstring).
        The null block is never cached.
        """
        if not self.enable_caching:
            return
        self.bus.tick()
        stored = []
        for b, h in zip(blocks, block_hashes, strict=True):
            if b.block_hash is not None or b.is_null:
                continue
            b.block_hash = h
            self.cached_block_hash_to_block.setdefault(h, {})[b.block_id] = b
            stored.append(b)
        if self.bus.active and stored:
            self.bus.emit(
                BlockStoredEvent(
                    self.bus.time,
                    "block_pool",
                    tuple(b.block_id for b in stored),
                    tuple(b.block_hash.hex() for b in stored),
                )
            )

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; only allowed when no block is in use. Returns success."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for b in self.blocks:
            b.block_hash = None
        self.cached_block_hash_to_block.clear()
        t = self.bus.tick()
        if self.bus.active:
            self.bus.emit(ResetEvent(t, "block_pool"))
        return True

    def check_invariants(self) -> None:
        """Raise :class:`~minirad.errors.InvariantError` if the bookkeeping is inconsistent:
        a block both free and referenced, a queue count that is off, a hash table entry that
        does not point back to its block, or a null block that is free, referenced or cached."""
        free = self.free_block_queue.get_all_free_blocks()
        if len(free) != self.free_block_queue.num_free_blocks:
            raise InvariantError("free-queue length differs from num_free_blocks")
        if len({b.block_id for b in free}) != len(free):
            raise InvariantError("a block is in the free queue twice")
        free_ids = {b.block_id for b in free}
        table = self.cached_block_hash_to_block
        null = self.null_block
        if null is not None:
            if null.block_id in free_ids or null.ref_cnt != 0 or null.block_hash is not None:
                raise InvariantError(f"null block {null!r} is free, referenced or cached")
        for b in self.blocks:
            if b.is_null is not (b is null):
                raise InvariantError(f"block {b.block_id}: is_null is {b.is_null}")
            if b is null:
                continue
            if (b.block_id in free_ids) != (b.ref_cnt == 0):
                raise InvariantError(f"block {b.block_id}: ref_cnt {b.ref_cnt} vs free queue")
            if b.block_hash is not None and table.get(b.block_hash, {}).get(b.block_id) is not b:
                raise InvariantError(f"block {b.block_id}: hash not registered to it")
        if any(not copies for copies in table.values()):
            raise InvariantError("hash table keeps a hash with no block")
        if sum(b.block_hash is not None for b in self.blocks) != sum(map(len, table.values())):
            raise InvariantError("hash table has entries for blocks without a hash")
