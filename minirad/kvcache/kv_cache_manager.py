"""vLLM's scheduler-facing block manager: a request's prefix lookup, its block allocation and
its free, over the hashed :class:`~minirad.kvcache.block_pool.BlockPool`.

Follows ``vllm/v1/core/kv_cache_manager.py`` (``get_computed_blocks``, ``allocate_slots``,
``free``); chapter 02 builds it and chapter 08 checks it against the real vLLM.

Two modes:

- **one group** (the default, chapters 02 and 08): every layer is full attention, one block
  table per request, no null block. This path is the one the chapters and the parity tests
  measure, and it is unchanged by the second mode.
- **per group** (``layer_specs=`` or ``kv_cache_groups=``): vLLM's hybrid design. The layers
  are grouped (``kv_cache_groups.py``), each group keeps its own block table per request
  (``single_type_kv_cache_manager.py``), and a coordinator (``kv_cache_coordinator.py``) finds
  the hit every group agrees on. The pool has a null block, and its cached-block table is keyed
  by ``(block hash, group id)``. :meth:`KVCacheManager.get_computed_blocks` then returns one
  block list per group and a third value, ``shared_prefix_boundary``, which the caller passes
  back to :meth:`KVCacheManager.allocate_slots`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:  # the per-group modules import torch (specs carry a dtype): loaded on use
    from minirad.kvcache.kv_cache_coordinator import KVCacheCoordinator
    from minirad.kvcache.kv_cache_groups import KVCacheGroupSpec
    from minirad.kvcache.kv_cache_spec import KVCacheSpec

__all__ = ["KVCacheManager", "serve_one_at_a_time"]


class KVCacheManager:
    """The scheduler-facing block manager with prefix caching (vLLM ``KVCacheManager``).

    Args:
        num_blocks: pool capacity in blocks (per-group mode: the null block included, as
            vLLM's ``num_gpu_blocks``, so ``num_blocks - 1`` hold KV).
        block_size: tokens per block (per-group mode: the specs' block size).
        enable_caching: share full blocks between requests by hash.
        hash_seed: seeds the root of the hash chain (see :func:`none_hash`).
        bus: event bus (a private one if None).
        layer_specs: per-group mode: each layer's spec, in model order; grouped by
            :func:`~minirad.kvcache.kv_cache_groups.get_kv_cache_groups`.
        kv_cache_groups: per-group mode: the groups themselves (instead of ``layer_specs``).
        disable_hybrid_kv_cache_manager: with ``layer_specs``, treat sliding layers as full
            attention (vLLM's flag of that name): one group, nothing ever skipped.
        prefix_cache_retention_interval: sparse groups' retention (see
            :class:`~minirad.kvcache.kv_cache_coordinator.KVCacheCoordinator`); default 0.

    ``queries`` / ``hits`` count prompt tokens looked up and tokens found, as vLLM's
    ``PrefixCacheStats`` do.

    Raises:
        InvalidArgumentError: a bad block size, both ``layer_specs`` and ``kv_cache_groups``,
            specs whose block size is not ``block_size``, or bad groups.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_seed: int | str = 0,
        bus: EventBus | None = None,
        *,
        layer_specs: Sequence[KVCacheSpec] | None = None,
        kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
        disable_hybrid_kv_cache_manager: bool = False,
        prefix_cache_retention_interval: int | None = 0,
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
        if layer_specs is not None and kv_cache_groups is not None:
            raise InvalidArgumentError("give layer_specs or kv_cache_groups, not both")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.root_hash = none_hash(hash_seed)
        self.num_tokens: dict[str, int] = {}  # tokens with a slot, per request
        self.queries = 0
        self.hits = 0
        self.kv_cache_groups: list[KVCacheGroupSpec] | None = None
        self.coordinator: KVCacheCoordinator | None = None
        if layer_specs is None and kv_cache_groups is None:  # one group: the chapters' manager
            self.block_pool = BlockPool(num_blocks, enable_caching, bus)
            self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
            self.num_cached_block: dict[str, int] = {}
            return
        self._init_per_group(
            num_blocks,
            bus,
            layer_specs,
            kv_cache_groups,
            disable_hybrid_kv_cache_manager,
            prefix_cache_retention_interval,
        )

    def _init_per_group(
        self,
        num_blocks: int,
        bus: EventBus | None,
        layer_specs: Sequence[KVCacheSpec] | None,
        kv_cache_groups: Sequence[KVCacheGroupSpec] | None,
        disable_hybrid: bool,
        retention_interval: int | None,
    ) -> None:
        from minirad.kvcache.kv_cache_coordinator import get_kv_cache_coordinator
        from minirad.kvcache.kv_cache_groups import KVCacheGroupSpec, get_kv_cache_groups

        if layer_specs is not None:
            kv_cache_groups = get_kv_cache_groups(layer_specs, disable_hybrid=disable_hybrid)
        groups = list(kv_cache_groups)
        if any(not isinstance(g, KVCacheGroupSpec) for g in groups):
            raise InvalidArgumentError(f"kv_cache_groups must be KVCacheGroupSpecs: {groups!r}")
        if any(g.spec.block_size != self.block_size for g in groups):
            raise InvalidArgumentError(f"every group's spec must have block_size {self.block_size}")
        self.kv_cache_groups = groups
        self.block_pool = BlockPool(num_blocks, self.enable_caching, bus, use_null_block=True)
        self.coordinator = get_kv_cache_coordinator(
            groups, self.block_pool, self.enable_caching, retention_interval
        )
        # Per request, beside num_tokens: what vLLM keeps on its Request object. The block
        # tables themselves are per group, in the coordinator's managers.
        self.num_computed_tokens: dict[str, int] = {}  # KV computed (slots before this step)
        self.num_prompt_tokens: dict[str, int] = {}
        self.shared_prefix_boundary: dict[str, int] = {}
        self.req_block_hashes: dict[str, list[BlockHash]] = {}  # hashes of its full blocks

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
    ) -> tuple[list[KVCacheBlock], int] | tuple[tuple[list[KVCacheBlock], ...], int, int]:
        """The longest run of cached blocks at the start of ``token_ids``, and its length in
        tokens. At most ``(len - 1) // block_size`` blocks hit: the last token always goes
        through the model, so a fully cached prompt recomputes its whole last block. A pure
        lookup: no reference changes (``allocate_slots`` claims the blocks).

        Per-group mode: ``(blocks per group, length, shared_prefix_boundary)``, the length every
        group can resume from (a sliding group's list starts with null blocks) and, when full
        attention hit further than a sliding group kept, the block-aligned end of that shared
        prefix (else 0), for :meth:`allocate_slots`."""
        if self.coordinator is not None:
            return self._get_computed_blocks_per_group(token_ids, mm_items, extra_key)
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
        new_computed_blocks: Sequence[KVCacheBlock] | Sequence[Sequence[KVCacheBlock]] = (),
        mm_items: Sequence[MultiModalItem] = (),
        extra_key: str | None = None,
        *,
        shared_prefix_boundary: int = 0,
    ) -> list[KVCacheBlock] | tuple[list[KVCacheBlock], ...] | None:
        """Give ``request_id`` slots for ``num_new_tokens`` more tokens of ``token_ids``.

        For a new request, ``new_computed_blocks`` (from :meth:`get_computed_blocks`) are
        claimed first. All or nothing: if the free blocks (counting hit blocks that sit in the
        free queue, since claiming them uses free capacity) do not suffice, returns None and
        changes nothing. Full blocks are registered in the hash table at once, so later
        requests in the same batch can hit them.

        Per-group mode: ``new_computed_blocks`` is one list per group, and a new request's
        ``shared_prefix_boundary`` (from :meth:`get_computed_blocks`) is kept, so that its
        sliding groups retain the window at that junction (the one-group mode ignores it).
        First the request's blocks wholly before its window become null blocks and go back to
        the pool (as in vLLM, even when the allocation then fails); the rest is all or nothing.

        Returns:
            the request's whole block table (as blocks; per-group mode: one per group), or None.

        Raises:
            InvalidArgumentError: more tokens than ``token_ids`` holds, or computed blocks for
                a request that already has blocks.
        """
        if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise InvalidArgumentError(
                f"num_new_tokens must be an int >= 0, got {num_new_tokens!r}"
            )
        if self.coordinator is not None:
            return self._allocate_slots_per_group(
                request_id,
                token_ids,
                num_new_tokens,
                new_computed_blocks,
                mm_items,
                extra_key,
                shared_prefix_boundary,
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

        Per-group mode: every group's table, group by group, each tail first (vLLM's order).

        Raises:
            UnknownBlockError: the request holds no blocks.
        """
        if self.coordinator is not None:
            if request_id not in self.num_tokens:
                raise UnknownBlockError(f"request {request_id!r} holds no blocks")
            self.coordinator.free(request_id)
            for per_request in self._per_request_state():
                per_request.pop(request_id, None)
            return
        if request_id not in self.req_to_blocks:
            raise UnknownBlockError(f"request {request_id!r} holds no blocks")
        blocks = self.req_to_blocks.pop(request_id)
        self.num_cached_block.pop(request_id, None)
        self.num_tokens.pop(request_id, None)
        self.block_pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int] | tuple[list[int], ...]:
        """The request's ``block_table`` (per-group mode: one per group, the null block's id
        where a window skipped a block)."""
        if self.coordinator is not None:
            return tuple([b.block_id for b in t] for t in self.coordinator.get_blocks(request_id))
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """The request has computed ``num_computed_tokens`` tokens' KV: in every sliding
        group, its blocks wholly before the window become the null block and are freed (vLLM
        calls this as decode moves; :meth:`allocate_slots` does it too). Nothing to do with
        full attention only.

        Raises:
            UnknownBlockError: the request holds no blocks.
            InvalidArgumentError: more tokens than the request has slots for.
        """
        if request_id not in self.num_tokens:
            raise UnknownBlockError(f"request {request_id!r} holds no blocks")
        slots = self.num_tokens[request_id]
        if not isinstance(num_computed_tokens, int) or not 0 <= num_computed_tokens <= slots:
            raise InvalidArgumentError(
                f"num_computed_tokens must be an int in [0, {slots}], got {num_computed_tokens!r}"
            )
        if self.coordinator is None:
            return
        self.coordinator.remove_skipped_blocks(request_id, num_computed_tokens)
        done = self.num_computed_tokens
        done[request_id] = max(done[request_id], num_computed_tokens)

    def check_invariants(self) -> None:
        """Raise :class:`~minirad.errors.InvariantError` if the pool or any block table is
        inconsistent (:func:`~minirad.kvcache.kv_cache_invariants.check_kv_cache_manager`)."""
        from minirad.kvcache.kv_cache_invariants import check_kv_cache_manager

        check_kv_cache_manager(self)

    # ------------------------------------------------------------------ per-group mode
    def _per_request_state(self) -> tuple[dict, ...]:
        return (
            self.num_tokens,
            self.num_computed_tokens,
            self.num_prompt_tokens,
            self.shared_prefix_boundary,
            self.req_block_hashes,
        )

    def _get_computed_blocks_per_group(
        self, token_ids: Sequence[int], mm_items: Sequence[MultiModalItem], extra_key: str | None
    ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        token_ids = as_token_ids(token_ids, "token_ids", plain=True)
        if not self.enable_caching:
            return tuple([] for _ in self.kv_cache_groups), 0, 0
        max_length = max(len(token_ids) - 1, 0)
        usable = token_ids[: max_length // self.block_size * self.block_size]
        hashes = self.block_hashes(usable, mm_items, extra_key)
        blocks, num_computed, num_uncached = self.coordinator.find_longest_cache_hit(
            hashes, max_length
        )
        self.queries += len(token_ids)
        self.hits += num_computed
        # The junction: where the group that hit furthest stopped (vLLM's rule).
        boundary = num_computed + num_uncached if num_uncached else 0
        return blocks, num_computed, boundary

    def _allocate_slots_per_group(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        mm_items: Sequence[MultiModalItem],
        extra_key: str | None,
        shared_prefix_boundary: int,
    ) -> tuple[list[KVCacheBlock], ...] | None:
        token_ids = as_token_ids(token_ids, "token_ids", plain=True)
        groups = len(self.kv_cache_groups)
        hits = tuple([] for _ in range(groups))
        if new_computed_blocks:
            hits = tuple(list(h) if isinstance(h, list | tuple) else h for h in new_computed_blocks)
            if len(hits) != groups or any(not isinstance(h, list) for h in hits):
                raise InvalidArgumentError(
                    f"new_computed_blocks must be {groups} lists (one per group), from "
                    "get_computed_blocks"
                )
            if len({len(h) for h in hits}) != 1:
                raise InvalidArgumentError("new_computed_blocks: every group's list has one length")
        new = request_id not in self.num_tokens
        if hits[0] and not new:
            raise InvalidArgumentError("prefix hits are only claimed by a new request")
        if not isinstance(shared_prefix_boundary, int) or not (
            0 <= shared_prefix_boundary <= len(token_ids)
        ):
            raise InvalidArgumentError(
                f"shared_prefix_boundary must be an int in [0, {len(token_ids)}], "
                f"got {shared_prefix_boundary!r}"
            )
        computed = self.num_tokens.get(request_id, 0) + len(hits[0]) * self.block_size
        need = computed + num_new_tokens
        if need > len(token_ids):
            raise InvalidArgumentError(
                f"{need} tokens need slots but the request has {len(token_ids)} tokens"
            )
        coordinator = self.coordinator
        if not new:  # the KV of every slotted token is computed by now
            coordinator.remove_skipped_blocks(request_id, computed)
            self.num_computed_tokens[request_id] = computed
        needed = coordinator.get_num_blocks_to_allocate(request_id, need, hits, computed)
        if needed > self.block_pool.get_num_free_blocks():
            return None
        if new:
            coordinator.add_local_computed_blocks(request_id, hits, computed)
            self.num_computed_tokens[request_id] = computed
            self.num_prompt_tokens[request_id] = len(token_ids)
            self.shared_prefix_boundary[request_id] = shared_prefix_boundary
            self.req_block_hashes[request_id] = []
        coordinator.allocate_new_blocks(request_id, need)
        self.num_tokens[request_id] = need
        hashes = self.req_block_hashes[request_id]
        parent = hashes[-1] if hashes else self.root_hash
        bs = self.block_size
        for start in range(len(hashes) * bs, need // bs * bs, bs):  # the new full blocks
            extra = block_extra_keys(start, start + bs, mm_items, extra_key)
            parent = hash_block_tokens(parent, token_ids[start : start + bs], extra)
            hashes.append(parent)
        coordinator.cache_blocks(
            request_id,
            hashes,
            need,
            self.num_prompt_tokens[request_id],
            self.shared_prefix_boundary[request_id],
        )
        return coordinator.get_blocks(request_id)


def serve_one_at_a_time(
    manager: KVCacheManager,
    requests: Iterable[tuple[Sequence[int], Sequence[int], Sequence[MultiModalItem]]],
) -> list[int]:
    """Drive ``manager`` as vLLM's scheduler drives its ``KVCacheManager`` when requests come
    one at a time, and return each request's cached prompt tokens (vLLM's
    ``num_cached_tokens``).

    For each ``(prompt ids, output ids, images)``: look the prompt up, allocate (and cache) its
    blocks, then one token per decode step (the step that computes output token ``i`` caches
    the blocks it filled; the last output token is sampled, never computed; in per-group mode
    each step first drops the blocks that left the window), then free the request's blocks,
    tail first. Chapter 08 and ``tests/test_vllm_parity.py`` compare the
    result with the real vLLM's, request for request.

    Raises:
        OutOfMemoryError: a request does not fit in the pool even when alone.
    """
    hits = []
    for i, (prompt, output, mm_items) in enumerate(requests):
        rid = f"one-at-a-time-{i}"
        kw = {}
        if manager.coordinator is None:
            blocks, hit = manager.get_computed_blocks(prompt, mm_items)
        else:  # per-group mode: the scheduler keeps the junction for allocate_slots
            blocks, hit, kw["shared_prefix_boundary"] = manager.get_computed_blocks(
                prompt, mm_items
            )
        if manager.allocate_slots(rid, prompt, len(prompt) - hit, blocks, mm_items, **kw) is None:
            raise OutOfMemoryError(f"request {i} ({len(prompt)} prompt tokens) does not fit")
        tokens = list(prompt)
        for token in output[:-1]:
            tokens.append(token)
            if manager.allocate_slots(rid, tokens, 1, mm_items=mm_items) is None:
                raise OutOfMemoryError(f"request {i} does not fit at {len(tokens)} tokens")
        manager.free(rid)
        hits.append(hit)
    return hits
