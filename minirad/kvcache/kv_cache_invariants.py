"""``KVCacheManager.check_invariants()``: the rules a paged prefix cache must keep, checked from
the outside after any operation (the property tests call it after every step).

The pool's own rules first (:meth:`BlockPool.check_invariants`: the free queue holds exactly
the unreferenced blocks, the hash table points back to its blocks, the null block is neither
free, referenced nor cached). Then the block tables, in either mode:

- the tables and the per-request bookkeeping name exactly the running requests: a finished
  request holds nothing, in no group;
- every table has one block per ``block_size`` slotted tokens, and each block's ``ref_cnt``
  is the number of table entries naming it (the null block is never counted);
- a cached block sits where its hash says: its key is the request's chained hash of that
  position (and, per group, that group's id).

Per-group mode adds the window and retention rules:

- full attention: no null block, and every full block the request cached is in the table;
- sliding window: the table starts with exactly ``num_skipped_tokens(computed) // block_size``
  null blocks (none held wholly before the window, none dropped inside it), and every block
  the retention rule keeps (the window tail before the replay boundary, before the junction,
  and one per interval) was registered.

The retention rule is recomputed here from its definition, not taken from the managers, so
that a manager that forgets it is caught.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from minirad.errors import InvariantError
from minirad.kvcache.block_pool import KVCacheBlock, make_block_hash_with_group_id
from minirad.kvcache.kv_cache_spec import SlidingWindowSpec

if TYPE_CHECKING:
    from minirad.kvcache.kv_cache_manager import KVCacheManager

__all__ = ["check_kv_cache_manager", "retained_positions"]


def check_kv_cache_manager(manager: KVCacheManager) -> None:
    """Raise :class:`~minirad.errors.InvariantError` at the first broken rule (module
    docstring); return None if all hold."""
    pool = manager.block_pool
    pool.check_invariants()
    held = sum(b.ref_cnt > 0 for b in pool.blocks)
    if held + pool.get_num_free_blocks() != pool.num_usable_blocks:
        raise InvariantError("blocks are lost: neither free nor referenced")
    if manager.coordinator is None:
        tables = {(0, rid): table for rid, table in manager.req_to_blocks.items()}
        if set(manager.req_to_blocks) != set(manager.num_tokens):
            raise InvariantError("block tables and num_tokens name different requests")
    else:
        tables = _check_per_group(manager)
    _check_tables(manager, tables)


def _check_tables(manager: KVCacheManager, tables: dict[tuple[int, str], list]) -> None:
    """Table lengths, reference counts, and blocks cached under their own position's hash."""
    bs = manager.block_size
    uses: Counter[int] = Counter()
    owner: dict[int, int] = {}
    for (group_id, rid), table in tables.items():
        if len(table) != -(-manager.num_tokens[rid] // bs):
            raise InvariantError(
                f"request {rid!r}, group {group_id}: {len(table)} blocks for "
                f"{manager.num_tokens[rid]} tokens"
            )
        hashes = _request_hashes(manager, rid)
        for i, block in enumerate(table):
            if block.is_null:
                continue
            uses[block.block_id] += 1
            if owner.setdefault(block.block_id, group_id) != group_id:
                raise InvariantError(f"block {block.block_id} is in two groups' tables")
            if block.block_hash is not None and hashes is not None:
                want = _key(manager, hashes, i, group_id)
                if block.block_hash != want:
                    raise InvariantError(
                        f"request {rid!r}, group {group_id}: block {block.block_id} at position "
                        f"{i} is cached under another position's hash"
                    )
    for block in manager.block_pool.blocks:
        if not block.is_null and block.ref_cnt != uses[block.block_id]:
            raise InvariantError(
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but {uses[block.block_id]} "
                "table entries"
            )


def _request_hashes(manager: KVCacheManager, rid: str) -> list[bytes] | None:
    if manager.coordinator is None:
        return None  # the one-group manager keeps no hashes per request
    return manager.req_block_hashes[rid]


def _key(manager: KVCacheManager, hashes: list[bytes], i: int, group_id: int) -> bytes | None:
    if i >= len(hashes):
        return None  # a block that is not full has no hash to be cached under
    return make_block_hash_with_group_id(hashes[i], group_id)


def _check_per_group(manager: KVCacheManager) -> dict[tuple[int, str], list[KVCacheBlock]]:
    """The per-group rules; returns every table, keyed by ``(group id, request id)``."""
    running = set(manager.num_tokens)
    for name, per_request in (
        ("num_computed_tokens", manager.num_computed_tokens),
        ("num_prompt_tokens", manager.num_prompt_tokens),
        ("shared_prefix_boundary", manager.shared_prefix_boundary),
        ("req_block_hashes", manager.req_block_hashes),
    ):
        if set(per_request) != running:
            raise InvariantError(f"{name} names other requests than the running ones")
    tables = {}
    for group_id, m in enumerate(manager.coordinator.single_type_managers):
        for name, per_request in (("block table", m.req_to_blocks), ("count", m.num_cached_block)):
            if set(per_request) != running:
                gone = sorted(set(per_request) - running)
                raise InvariantError(
                    f"group {group_id}: a {name} for {gone or 'too few'} requests "
                    f"(running: {sorted(running)}); a finished request holds nothing"
                )
        for rid, table in m.req_to_blocks.items():
            _check_window_and_retention(manager, group_id, rid, table)
            tables[(group_id, rid)] = table
    return tables


def _check_window_and_retention(
    manager: KVCacheManager, group_id: int, rid: str, table: list[KVCacheBlock]
) -> None:
    m = manager.coordinator.single_type_managers[group_id]
    spec = m.kv_cache_spec
    bs = manager.block_size
    nulls = next((i for i, b in enumerate(table) if not b.is_null), len(table))
    if any(b.is_null for b in table[nulls:]):
        raise InvariantError(f"request {rid!r}, group {group_id}: a null block after real ones")
    skipped = 0
    if isinstance(spec, SlidingWindowSpec):
        skipped = spec.num_skipped_tokens(manager.num_computed_tokens[rid]) // bs
    if nulls < skipped:
        raise InvariantError(
            f"request {rid!r}, group {group_id}: holds block {table[nulls].block_id} at position "
            f"{nulls}, wholly before its window ({skipped} blocks skipped)"
        )
    if nulls > skipped:
        raise InvariantError(f"request {rid!r}, group {group_id}: dropped a block of its window")
    if not manager.enable_caching:
        return
    hashes = manager.req_block_hashes[rid]
    cached = m.num_cached_block[rid]
    keep = retained_positions(
        spec,
        cached,
        manager.coordinator.retention_interval,
        (manager.num_prompt_tokens[rid] - 1, manager.shared_prefix_boundary[rid]),
    )
    for i in range(nulls, cached):
        if i in keep and table[i].block_hash != _key(manager, hashes, i, group_id):
            raise InvariantError(
                f"request {rid!r}, group {group_id}: block {table[i].block_id} at position {i} "
                "should be retained (a later hit can end there) but is not cached"
            )


def retained_positions(
    spec: object, num_blocks: int, retention_interval: int | None, boundaries: tuple[int, ...]
) -> set[int]:
    """Block positions below ``num_blocks`` that a group of ``spec`` must register: all of
    them for full attention or dense retention; for a sliding window, the
    ``cdiv(W - 1, block_size)`` blocks before each (non-zero) boundary, rounded down to a
    block, and the last as many blocks of each ``retention_interval`` segment."""
    if not isinstance(spec, SlidingWindowSpec) or retention_interval is None:
        return set(range(num_blocks))
    bs = spec.block_size
    need = -(-(spec.sliding_window - 1) // bs)
    keep = set()
    for boundary in boundaries:
        if boundary > 0:
            end = boundary // bs
            keep |= set(range(max(0, end - need), min(end, num_blocks)))
    if retention_interval > 0:
        per_segment = retention_interval // bs
        keep |= {i for i in range(num_blocks) if i % per_segment >= per_segment - need}
    return keep
