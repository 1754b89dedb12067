"""One KV-cache group's block tables, and the hit rule of its attention type.

Each KV-cache group (``kv_cache_groups.py``) gets a manager that keeps every request's block
table for that group: which blocks it holds, how many of them are already cached. What differs
between attention types is small, and lives in four methods:

- ``find_longest_cache_hit``: full attention takes the cached blocks from the start, left to
  right; a sliding window scans right to left for the first run of ``cdiv(W - 1, block_size)``
  cached blocks, with the null block before it.
- ``get_num_skipped_tokens``: 0 for full attention; ``n - W + 1`` for a window (the spec's).
- ``remove_skipped_blocks``: nothing to drop for full attention; a window's blocks wholly
  before it become the null block and go back to the pool.
- ``reachable_block_mask``: full attention registers every full block; a window only those a
  later hit can end on (the window tails before the replay boundary and the junctions).

A hit for a sliding window needs only the ``W - 1`` tokens before the resume point, so the
blocks before them can be null (no KV); a full-attention hit needs every block. The mask keeps
the sliding groups' cache sparse: a block whose window ends nowhere a request can resume never
serves a hit, so it is never registered in the hash table. vLLM applies the mask when the
blocks become full (``cache_blocks``), not when the request finishes; the effect shows at the
free: those blocks, uncached, go to the front of the free queue and are reused first.

Follows ``vllm/v1/core/single_type_kv_cache_manager.py`` (0.32) without EAGLE, context
parallelism, fine-grained hashes or external KV: every group has the same block size, so the
hit alignment is one block.
"""

from __future__ import annotations

from collections.abc import Sequence

from minirad.errors import InvalidArgumentError
from minirad.kvcache.block_pool import (
    BlockHash,
    BlockPool,
    KVCacheBlock,
    make_block_hash_with_group_id,
)
from minirad.kvcache.kv_cache_spec import KVCacheSpec, SlidingWindowSpec

__all__ = [
    "FullAttentionManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "get_manager_for_kv_cache_spec",
]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def get_cached_blocks(
    block_pool: BlockPool, block_hash: BlockHash, group_ids: Sequence[int]
) -> list[KVCacheBlock] | None:
    """The block cached under ``block_hash`` in each group, or None if any group misses:
    groups of one spec are looked up together and hit together."""
    blocks = []
    for group_id in group_ids:
        block = block_pool.get_cached_block(make_block_hash_with_group_id(block_hash, group_id))
        if block is None:
            return None
        blocks.append(block)
    return blocks


class SingleTypeKVCacheManager:
    """The block tables of one KV-cache group (``kv_cache_group_id``), over the shared pool.

    Attributes:
        req_to_blocks: each running request's block table (null blocks included).
        num_cached_block: how many leading blocks of each table were already offered to the
            hash table (registered, or skipped by the mask or as null); a request is running
            here once it has an entry.
    """

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        enable_caching: bool = True,
    ) -> None:
        if block_pool.null_block is None:
            raise InvalidArgumentError("a group manager needs a pool with a null block")
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.enable_caching = enable_caching
        self.null_block: KVCacheBlock = block_pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    # ------------------------------------------------------------------ allocation
    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
    ) -> int:
        """Free blocks this group would use to give the request ``num_tokens`` slots: new
        blocks, plus the hit blocks that sit in the free queue (claiming them uses free
        capacity). Hit blocks the window already skips are not claimed at all."""
        num_required = cdiv(num_tokens, self.block_size)
        held = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:  # running: no new hits
            return max(num_required - held, 0)
        num_skipped = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new = max(num_required - max(num_skipped, len(new_computed_blocks) + held), 0)
        claimed = new_computed_blocks[max(0, num_skipped - held) :]
        return num_new + sum(b.ref_cnt == 0 and not b.is_null for b in claimed)

    def add_local_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock], num_computed: int
    ) -> None:
        """Start a new request's table with its hit blocks: those the window already skips
        become null blocks, the rest get a reference (``touch``). They are cached already."""
        num_skipped = self.get_num_skipped_tokens(num_computed) // self.block_size
        kept = list(new_computed_blocks[num_skipped:])
        if self.enable_caching:
            self.block_pool.touch(kept)
        table = [self.null_block] * min(num_skipped, len(new_computed_blocks)) + kept
        self.req_to_blocks[request_id] = table
        self.num_cached_block[request_id] = len(table)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's table to ``cdiv(num_tokens, block_size)`` blocks; returns the
        new ones."""
        table = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(table)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new, owner=request_id)
        table += new_blocks
        return new_blocks

    # ------------------------------------------------------------------ caching
    def cache_blocks(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        retention_interval: int | None,
        reachable_boundaries: Sequence[int],
    ) -> None:
        """Register the request's blocks that became full (up to ``num_tokens``), keyed by
        ``(hash, group id)``; null blocks and blocks outside :meth:`reachable_block_mask` are
        passed over for good (``num_cached_block`` moves past them)."""
        start = self.num_cached_block.get(request_id, 0)
        end = num_tokens // self.block_size
        if start >= end:
            return
        mask = self.reachable_block_mask(
            start, end, self.kv_cache_spec, retention_interval, reachable_boundaries
        )
        table = self.req_to_blocks[request_id]
        chosen = [
            i
            for i in range(start, end)
            if not table[i].is_null and (mask is None or mask[i - start])
        ]
        keys = [
            make_block_hash_with_group_id(block_hashes[i], self.kv_cache_group_id) for i in chosen
        ]
        self.block_pool.cache_full_blocks([table[i] for i in chosen], keys)
        self.num_cached_block[request_id] = end

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        kv_cache_spec: KVCacheSpec,
        retention_interval: int | None,
        reachable_boundaries: Sequence[int],
    ) -> list[bool] | None:
        """Which of blocks ``[start_block, end_block)`` to register (True), or None for all
        of them: the dense rule of full attention, where every prefix is a possible hit."""
        return None

    # ------------------------------------------------------------------ freeing
    def free(self, request_id: str) -> None:
        """Release the request's blocks, last first (the tail is the least likely reused)."""
        table = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.block_pool.free_blocks(list(reversed(table)))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replace the blocks no later query of the request attends to (wholly before its
        window, ``num_computed_tokens`` computed) by the null block, and free them. Walks back
        from the window and stops at the first null: the earlier ones went before."""
        num_skipped = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        table = self.req_to_blocks.get(request_id)
        if num_skipped <= 0 or not table:
            return
        freed = []
        for i in range(min(num_skipped, len(table)) - 1, -1, -1):
            if table[i].is_null:
                break
            freed.append(table[i])
            table[i] = self.null_block
        if freed:
            self.block_pool.free_blocks(freed)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no later query attends to: none, unless the type says otherwise."""
        return 0

    # ------------------------------------------------------------------ hits
    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest prefix, at most ``max_length`` tokens and whole blocks, that every group
        of ``kv_cache_group_ids`` (all of this spec) can resume from: one block list per group,
        and the length in tokens."""
        raise NotImplementedError


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: a hit needs every block of the prefix, so scan from the left and stop
    at the first miss (chained hashes: every later block misses too)."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        for block_hash in block_hashes[: max_length // kv_cache_spec.block_size]:
            blocks = get_cached_blocks(block_pool, block_hash, kv_cache_group_ids)
            if blocks is None:
                break
            for table, block in zip(computed, blocks, strict=True):
                table.append(block)
        return computed, len(computed[0]) * kv_cache_spec.block_size


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention, window ``W`` (HF's count): resuming at a block boundary needs
    only the ``W - 1`` tokens before it, that is ``cdiv(W - 1, block_size)`` blocks."""

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return self.kv_cache_spec.num_skipped_tokens(num_computed_tokens)

    @staticmethod
    def contiguous_blocks_for_hit(kv_cache_spec: SlidingWindowSpec) -> int:
        """Cached blocks a hit must end with: those holding the window's ``W - 1`` tokens."""
        return cdiv(kv_cache_spec.sliding_window - 1, kv_cache_spec.block_size)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Right to left: the first (rightmost) run of ``need`` cached blocks ends the hit,
        everything before it is the null block. With no such run, only a run from block 0 can
        hit (the window then reaches the start)."""
        bs = kv_cache_spec.block_size
        need = cls.contiguous_blocks_for_hit(kv_cache_spec)
        max_blocks = max_length // bs
        null = block_pool.null_block
        computed = tuple([null] * max_blocks for _ in kv_cache_group_ids)
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            blocks = get_cached_blocks(block_pool, block_hashes[i], kv_cache_group_ids)
            if blocks is None:
                run = 0
                continue
            for table, block in zip(computed, blocks, strict=True):
                table[i] = block
            run += 1
            if run >= need:  # blocks i .. i + run - 1 hold the window: a hit ends there
                for table in computed:
                    del table[i + run :]
                return computed, (i + run) * bs
        for table in computed:  # no full window anywhere: the run that starts at block 0
            del table[run:]
        return computed, run * bs

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        kv_cache_spec: KVCacheSpec,
        retention_interval: int | None,
        reachable_boundaries: Sequence[int],
    ) -> list[bool] | None:
        """Register only the window tails a later hit can end on: the ``need`` blocks before
        each boundary of ``reachable_boundaries`` (the replay boundary, ``prompt - 1``, and a
        shared-prefix junction), rounded down to a block, and, if ``retention_interval > 0``,
        the last ``need`` blocks of every ``retention_interval``-token segment. None
        (``retention_interval=None``): dense, register every block."""
        if retention_interval is None:
            return None
        bs = kv_cache_spec.block_size
        need = cls.contiguous_blocks_for_hit(kv_cache_spec)
        mask = [False] * (end_block - start_block)
        if retention_interval > 0:
            per_segment = retention_interval // bs
            if need >= per_segment:
                return None  # every block is some segment's tail
            for i in range(start_block, end_block):
                mask[i - start_block] = i % per_segment >= per_segment - need
        for boundary in reachable_boundaries:
            end = boundary // bs  # the hit would end after block end - 1
            for i in range(max(start_block, end - need), min(end_block, end)):
                mask[i - start_block] = True
        return mask


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int, enable_caching: bool
) -> SingleTypeKVCacheManager:
    """The manager class of the spec's attention type."""
    cls = (
        SlidingWindowManager
        if isinstance(kv_cache_spec, SlidingWindowSpec)
        else FullAttentionManager
    )
    return cls(kv_cache_spec, block_pool, kv_cache_group_id, enable_caching)
