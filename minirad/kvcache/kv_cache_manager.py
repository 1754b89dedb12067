"""vLLM's scheduler-facing block manager: a request's prefix lookup, its block allocation and
its free, over the hashed :class:`~minirad.kvcache.block_pool.BlockPool`.

Follows ``vllm/v1/core/kv_cache_manager.py`` (``get_computed_blocks``, ``allocate_slots``,
``free``); chapter 02 builds it and chapter 08 checks it against the real vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from minirad.errors import InvalidArgumentError, OutOfMemoryError, UnknownBlockError
from minirad.events import EventBus
from minirad.kvcache.block_pool import (
    BlockHash,
    BlockPool,
    KVCacheBlock,
    hash_block_tokens,
    none_hash,
)
from minirad.kvcache.multimodal import MultiModalItem, block_extra_keys
from minirad.kvcache.tokens import as_token_ids

__all__ = ["KVCacheManager", "serve_one_at_a_time"]


class KVCacheManager:
    """The scheduler-facing block manager with prefix caching (vLLM ``KVCacheManager``).

    Args:
        num_blocks: pool capacity in blocks.
        block_size: tokens per block.
        enable_caching: share full blocks between requests by hash.
        hash_seed: seeds the root of the hash chain (see :func:`none_hash`).
        bus: event bus (a private one if None).

    ``queries`` / ``hits`` count prompt tokens looked up and tokens found, as vLLM's
    ``PrefixCacheStats`` do.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_seed: int | str = 0,
        bus: EventBus | None = None,
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, bus)
        self.root_hash = none_hash(hash_seed)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.num_tokens: dict[str, int] = {}  # tokens with a slot, per request
        self.queries = 0
        self.hits = 0

    def block_hashes(
        self,
        token_ids: Sequence[int],
        mm_items: Sequence[MultiModalItem] = (),
        extra_key: str | None = None,
    ) -> list[BlockHash]:
        """Chained hashes of every *full* block of ``token_ids`` (a partial last block has
        none)."""
        token_ids = as_token_ids(token_ids, "token_ids", plain=True)
        hashes = []
        parent = self.root_hash
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            extra = block_extra_keys(start, start + bs, mm_items, extra_key)
            parent = hash_block_tokens(parent, token_ids[start : start + bs], extra)
            hashes.append(parent)
        return hashes

    def get_computed_blocks(
        self,
        token_ids: Sequence[int],
        mm_items: Sequence[MultiModalItem] = (),
        extra_key: str | None = None,
    ) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached blocks at the start of ``token_ids``, and its length in
        tokens. At most ``(len - 1) // block_size`` blocks hit: the last token always goes
        through the model, so a fully cached prompt recomputes its whole last block. A pure
        lookup: no reference changes (``allocate_slots`` claims the blocks)."""
        token_ids = as_token_ids(token_ids, "token_ids", plain=True)
        if not self.enable_caching:  # no lookup, no statistics (as vLLM)
            return [], 0
        blocks: list[KVCacheBlock] = []
        max_blocks = max(len(token_ids) - 1, 0) // self.block_size
        usable = token_ids[: max_blocks * self.block_size]
        for h in self.block_hashes(usable, mm_items, extra_key):
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break
            blocks.append(block)
        num_computed = len(blocks) * self.block_size
        self.queries += len(token_ids)
        self.hits += num_computed
        return blocks, num_computed

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        mm_items: Sequence[MultiModalItem] = (),
        extra_key: str | None = None,
    ) -> list[KVCacheBlock] | None:
        """Give ``request_id`` slots for ``num_new_tokens`` more tokens of ``token_ids``.

        For a new request, ``new_computed_blocks`` (from :meth:`get_computed_blocks`) are
        claimed first. All or nothing: if the free blocks (counting hit blocks that sit in the
        free queue, since claiming them uses free capacity) do not suffice, returns None and
        changes nothing. Full blocks are registered in the hash table at once, so later
        requests in the same batch can hit them.

        Returns:
            the request's whole block table (as blocks), or None.

        Raises:
            InvalidArgumentError: more tokens than ``token_ids`` holds, or computed blocks for
                a request that already has blocks.
        """
        if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise InvalidArgumentError(
                f"num_new_tokens must be an int >= 0, got {num_new_tokens!r}"
            )
        token_ids = as_token_ids(token_ids, "token_ids", plain=True)
        blocks = self.req_to_blocks.get(request_id, [])
        if new_computed_blocks and blocks:
            raise InvalidArgumentError("prefix hits are only claimed by a new request")
        computed = self.num_tokens.get(request_id, 0) + len(new_computed_blocks) * self.block_size
        need = computed + num_new_tokens
        if need > len(token_ids):
            raise InvalidArgumentError(
                f"{need} tokens need slots but the request has {len(token_ids)} tokens"
            )
        num_new_blocks = -(-need // self.block_size) - len(blocks) - len(new_computed_blocks)
        from_free_queue = sum(b.ref_cnt == 0 for b in new_computed_blocks)
        if max(num_new_blocks, 0) + from_free_queue > self.block_pool.get_num_free_blocks():
            return None
        self.block_pool.touch(new_computed_blocks)
        blocks = blocks + list(new_computed_blocks)
        if num_new_blocks > 0:
            blocks += self.block_pool.get_new_blocks(num_new_blocks, owner=request_id)
        self.req_to_blocks[request_id] = blocks
        self.num_tokens[request_id] = need
        num_full = need // self.block_size
        first = self.num_cached_block.get(request_id, len(new_computed_blocks))
        if self.enable_caching and num_full > first:
            hashes = self.block_hashes(token_ids[: num_full * self.block_size], mm_items, extra_key)
            self.block_pool.cache_full_blocks(blocks[first:num_full], hashes[first:num_full])
        self.num_cached_block[request_id] = max(first, num_full)
        return blocks

    def free(self, request_id: str) -> None:
        """Release a finished (or preempted) request's blocks, last block first: the tail
        hashes the most tokens and is the least likely to be reused.

        Raises:
            UnknownBlockError: the request holds no blocks.
        """
        if request_id not in self.req_to_blocks:
            raise UnknownBlockError(f"request {request_id!r} holds no blocks")
        blocks = self.req_to_blocks.pop(request_id)
        self.num_cached_block.pop(request_id, None)
        self.num_tokens.pop(request_id, None)
        self.block_pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's ``block_table``."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def serve_one_at_a_time(
    manager: KVCacheManager,
    requests: Iterable[tuple[Sequence[int], Sequence[int], Sequence[MultiModalItem]]],
) -> list[int]:
    """Drive ``manager`` as vLLM's scheduler drives its ``KVCacheManager`` when requests come
    one at a time, and return each request's cached prompt tokens (vLLM's
    ``num_cached_tokens``).

    For each ``(prompt ids, output ids, images)``: look the prompt up, allocate (and cache) its
    blocks, then one token per decode step (the step that computes output token ``i`` caches
    the blocks it filled; the last output token is sampled, never computed), then free the
    request's blocks, tail first. Chapter 08 and ``tests/test_vllm_parity.py`` compare the
    result with the real vLLM's, request for request.

    Raises:
        OutOfMemoryError: a request does not fit in the pool even when alone.
    """
    hits = []
    for i, (prompt, output, mm_items) in enumerate(requests):
        rid = f"one-at-a-time-{i}"
        blocks, hit = manager.get_computed_blocks(prompt, mm_items)
        if manager.allocate_slots(rid, prompt, len(prompt) - hit, blocks, mm_items) is None:
            raise OutOfMemoryError(f"request {i} ({len(prompt)} prompt tokens) does not fit")
        tokens = list(prompt)
        for token in output[:-1]:
            tokens.append(token)
            if manager.allocate_slots(rid, tokens, 1, mm_items=mm_items) is None:
                raise OutOfMemoryError(f"request {i} does not fit at {len(tokens)} tokens")
        manager.free(rid)
        hits.append(hit)
    return hits
