"""Many KV-cache groups, one request: the coordinator runs every group's manager in step, and
finds the one prefix length every group can resume from.

A request has a block table per group (``single_type_kv_cache_manager.py``). Allocating,
caching, dropping out-of-window blocks and freeing are per group and simply repeated for each.
The hit is not: the model can only resume at a length where *every* layer has the KV it needs.
Full attention needs all blocks before it; a sliding window only the blocks of its last window.

:meth:`HybridKVCacheCoordinator.find_longest_cache_hit` finds that length by a fixed point.
Start from the longest allowed length; each attention type, in turn, either accepts the
candidate or shortens it to the longest length it can serve below it; repeat until a whole
round changes nothing. The length only ever shrinks and 0 is always accepted, so it ends, at
the longest length all types accept. Full attention is looked up once (its hits are
downward-closed: a shorter prefix of a hit is a hit), then only trimmed; with one full type
and one other type, one round suffices.

When full attention hit further than the agreed length, the extra tokens are a prefix other
requests share but a sparse group did not keep (``num_uncached_common_prefix_tokens``). The
manager turns it into a ``shared_prefix_boundary``, and the request, when it caches its own
blocks, keeps a window tail at that junction, so the *next* request sharing the prefix hits.

Follows ``vllm/v1/core/kv_cache_coordinator.py`` (0.32): ``UnitaryKVCacheCoordinator``,
``HybridKVCacheCoordinator``, ``replay_boundaries``; without EAGLE, context parallelism,
external KV or fine-grained hashes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from minirad.errors import InvalidArgumentError
from minirad.kvcache.block_pool import BlockHash, BlockPool, KVCacheBlock
from minirad.kvcache.kv_cache_groups import KVCacheGroupSpec
from minirad.kvcache.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from minirad.kvcache.single_type_kv_cache_manager import (
    SingleTypeKVCacheManager,
    cdiv,
    get_manager_for_kv_cache_spec,
)

__all__ = [
    "HybridKVCacheCoordinator",
    "KVCacheCoordinator",
    "UnitaryKVCacheCoordinator",
    "get_kv_cache_coordinator",
    "replay_boundaries",
]

BlocksPerGroup = tuple[list[KVCacheBlock], ...]


def replay_boundaries(num_prompt_tokens: int) -> tuple[int, ...]:
    """Where a later request replaying this prompt resumes: ``prompt - 1`` (the last prompt
    token is always recomputed for its logits). A sparse group keeps the window ending there."""
    return (num_prompt_tokens - 1,)


class KVCacheCoordinator:
    """The managers of every group over one block pool, driven in step.

    Args:
        kv_cache_groups: the groups (``kv_cache_groups.get_kv_cache_groups``).
        block_pool: the shared pool; it must have a null block.
        enable_caching: register full blocks in the pool's hash table.
        prefix_cache_retention_interval: sparse groups keep window tails only at reachable
            boundaries (0, vLLM's default), also once per this many tokens (> 0, a multiple
            of the block size), or everywhere (None: dense).

    Raises:
        InvalidArgumentError: no groups, groups of different block sizes, or a bad interval.
    """

    def __init__(
        self,
        kv_cache_groups: Sequence[KVCacheGroupSpec],
        block_pool: BlockPool,
        enable_caching: bool = True,
        prefix_cache_retention_interval: int | None = 0,
    ) -> None:
        groups = list(kv_cache_groups)
        if not groups or not all(isinstance(g, KVCacheGroupSpec) for g in groups):
            raise InvalidArgumentError(f"need one or more KVCacheGroupSpec, got {groups!r}")
        self.block_size = groups[0].spec.block_size
        if any(g.spec.block_size != self.block_size for g in groups):
            raise InvalidArgumentError("every KV-cache group must have the same block size")
        interval = prefix_cache_retention_interval
        if interval is not None and (
            not isinstance(interval, int) or interval < 0 or interval % self.block_size
        ):
            raise InvalidArgumentError(
                f"prefix_cache_retention_interval must be None or an int >= 0 that is a "
                f"multiple of the block size {self.block_size}, got {interval!r}"
            )
        if interval and not any(isinstance(g.spec, SlidingWindowSpec) for g in groups):
            raise InvalidArgumentError(
                "prefix_cache_retention_interval only applies to sliding-window groups"
            )
        self.kv_cache_groups = groups
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.retention_interval = interval
        self.single_type_managers = tuple(
            get_manager_for_kv_cache_spec(g.spec, block_pool, i, enable_caching)
            for i, g in enumerate(groups)
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: BlocksPerGroup,
        total_computed_tokens: int,
    ) -> int:
        """Free blocks all groups together would use (see the managers' method)."""
        return sum(
            m.get_num_blocks_to_allocate(request_id, num_tokens, hits, total_computed_tokens)
            for m, hits in zip(self.single_type_managers, new_computed_blocks, strict=True)
        )

    def add_local_computed_blocks(
        self, request_id: str, new_computed_blocks: BlocksPerGroup, num_computed: int
    ) -> None:
        """Open a new request's table in every group, with its hit blocks."""
        for m, hits in zip(self.single_type_managers, new_computed_blocks, strict=True):
            m.add_local_computed_blocks(request_id, hits, num_computed)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> BlocksPerGroup:
        return tuple(
            m.allocate_new_blocks(request_id, num_tokens) for m in self.single_type_managers
        )

    def cache_blocks(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        num_prompt_tokens: int,
        shared_prefix_boundary: int = 0,
    ) -> None:
        """Register the full blocks of every group, sparse groups keeping the window tails at
        the replay boundary and at the request's shared-prefix junction (if any)."""
        if not self.enable_caching:
            return
        boundaries = replay_boundaries(num_prompt_tokens)
        if shared_prefix_boundary:
            boundaries += (shared_prefix_boundary,)
        for m in self.single_type_managers:
            m.cache_blocks(
                request_id, block_hashes, num_tokens, self.retention_interval, boundaries
            )

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.single_type_managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def free(self, request_id: str) -> None:
        """Free the request in every group, each table tail first."""
        for m in self.single_type_managers:
            m.free(request_id)

    def get_blocks(self, request_id: str) -> BlocksPerGroup:
        return tuple(list(m.req_to_blocks.get(request_id, ())) for m in self.single_type_managers)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int, int]:
        """The hit blocks of every group, the hit length in tokens, and
        ``num_uncached_common_prefix_tokens`` (module docstring)."""
        raise NotImplementedError


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One group (a model of one attention type): its manager's hit is the hit."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int, int]:
        manager = self.single_type_managers[0]
        blocks, length = manager.find_longest_cache_hit(
            block_hashes, max_cache_hit_length, [0], self.block_pool, manager.kv_cache_spec
        )
        return blocks, length, 0


class SpecGroup(NamedTuple):
    """The groups of one spec: looked up together, hit together."""

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups: the hit is the fixed point of the per-type hits (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        by_spec: dict[KVCacheSpec, SpecGroup] = {}
        for i, m in enumerate(self.single_type_managers):
            by_spec.setdefault(m.kv_cache_spec, SpecGroup(m.kv_cache_spec, [], type(m)))
            by_spec[m.kv_cache_spec].group_ids.append(i)
        # Full attention first: its left-to-right scan gives the tightest first candidate.
        self.attention_groups = sorted(
            by_spec.values(), key=lambda g: not isinstance(g.spec, FullAttentionSpec)
        )

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int, int]:
        hit_blocks: list[list[KVCacheBlock]] = [[] for _ in self.single_type_managers]
        full_hit: int | None = None  # full attention's own hit, once looked up
        longest = 0  # the longest hit any type reported
        hit_length = max_cache_hit_length
        simple = len(self.attention_groups) == 2 and full_first(self.attention_groups)
        while True:
            candidate = hit_length
            for spec, group_ids, manager_cls in self.attention_groups:
                if isinstance(spec, FullAttentionSpec) and full_hit is not None:
                    candidate = min(candidate, full_hit)  # downward-closed: only trim
                    continue
                blocks, candidate = manager_cls.find_longest_cache_hit(
                    block_hashes, candidate, group_ids, self.block_pool, spec
                )
                for group_id, group_blocks in zip(group_ids, blocks, strict=True):
                    hit_blocks[group_id] = group_blocks
                if isinstance(spec, FullAttentionSpec):
                    full_hit = candidate
                longest = max(longest, candidate)
            if candidate >= hit_length:
                break  # a whole round accepted the candidate
            hit_length = candidate
            if simple:
                break  # the one other type already answered at a length full attention serves
        for spec, group_ids, _ in self.attention_groups:
            if isinstance(spec, FullAttentionSpec):
                for group_id in group_ids:
                    del hit_blocks[group_id][cdiv(hit_length, self.block_size) :]
        return tuple(hit_blocks), hit_length, longest - hit_length


def full_first(attention_groups: Sequence[SpecGroup]) -> bool:
    return isinstance(attention_groups[0].spec, FullAttentionSpec)


def get_kv_cache_coordinator(
    kv_cache_groups: Sequence[KVCacheGroupSpec],
    block_pool: BlockPool,
    enable_caching: bool = True,
    prefix_cache_retention_interval: int | None = 0,
) -> KVCacheCoordinator:
    """The unitary coordinator for one group, the hybrid one for several."""
    cls = UnitaryKVCacheCoordinator if len(kv_cache_groups) == 1 else HybridKVCacheCoordinator
    return cls(kv_cache_groups, block_pool, enable_caching, prefix_cache_retention_interval)
