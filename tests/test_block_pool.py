"""Unit tests of vLLM's block pool and prefix cache (``minirad.kvcache.block_pool``).

The expected behaviour is that of ``vllm/v1/core/{block_pool,kv_cache_utils,kv_cache_manager}.py``
(see ``shared/reference/research/vllm_blockpool.md``): an intrusive free queue with O(1)
removal, tail-first freeing, fresh blocks reused before cached ones, lazy eviction, chained
hashes, and an all-or-nothing ``allocate_slots`` whose capacity check counts hit blocks that sit
in the free queue.
"""

from __future__ import annotations

import pytest

from minirad import (
    BlockPool,
    FreeKVCacheBlockQueue,
    InvalidArgumentError,
    KVCacheBlock,
    KVCacheManager,
    OutOfMemoryError,
    UnknownBlockError,
)
from minirad.kvcache.block_pool import hash_block_tokens, none_hash


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def pool_state(mgr: KVCacheManager) -> tuple:
    """Everything allocate_slots could change."""
    pool = mgr.block_pool
    return (
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        queue_ids(pool),
        {h: list(copies) for h, copies in pool.cached_block_hash_to_block.items()},
        {r: [b.block_id for b in bs] for r, bs in mgr.req_to_blocks.items()},
        dict(mgr.num_tokens),
        dict(mgr.num_cached_block),
    )


def run(mgr: KVCacheManager, rid: str, tokens: list[int], **kw) -> tuple[list, int]:
    """Schedule a new request's whole prompt: look up hits, then allocate the rest."""
    hits, num_computed = mgr.get_computed_blocks(tokens, **kw)
    blocks = mgr.allocate_slots(rid, tokens, len(tokens) - num_computed, hits, **kw)
    assert blocks is not None
    mgr.block_pool.check_invariants()
    return hits, num_computed


# ---------------------------------------------------------------------- free queue
def test_free_queue_removes_from_the_middle_and_keeps_the_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 1, 3, 4]
    assert len(q) == 4
    # Only the neighbours were relinked; the removed block carries no links.
    assert blocks[1].next_free_block is blocks[3] and blocks[3].prev_free_block is blocks[1]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    with pytest.raises(UnknownBlockError):
        q.remove(blocks[2])
    q.prepend_n([blocks[2]])
    q.append_n([KVCacheBlock(7)])
    assert [q.popleft().block_id for _ in range(len(q))] == [2, 0, 1, 3, 4, 7]
    with pytest.raises(IndexError):
        q.popleft()


def test_free_queue_remove_is_constant_time() -> None:
    # Removing from the middle of a long queue must not walk it: poison every link except
    # the neighbours' and check that remove still works.
    blocks = [KVCacheBlock(i) for i in range(1000)]
    q = FreeKVCacheBlockQueue(blocks)
    target = blocks[500]
    saved = [(b.prev_free_block, b.next_free_block) for b in blocks]
    for b in blocks[:499] + blocks[502:]:
        b.prev_free_block = b.next_free_block = KVCacheBlock(-99)
    q.remove(target)
    assert blocks[499].next_free_block is blocks[501]
    assert blocks[501].prev_free_block is blocks[499]
    for b, (p, n) in zip(blocks, saved, strict=True):
        if b not in (target, blocks[499], blocks[501]):
            b.prev_free_block, b.next_free_block = p, n
    assert len(q.get_all_free_blocks()) == 999 == len(q)


# ---------------------------------------------------------------------- hashes
def test_chained_hashes_depend_on_parent_tokens_extra_keys_and_seed() -> None:
    root = none_hash(0)
    h = hash_block_tokens(root, [1, 2, 3, 4])
    assert h == hash_block_tokens(root, (1, 2, 3, 4))
    others = [
        hash_block_tokens(none_hash(1), [1, 2, 3, 4]),  # seed
        hash_block_tokens(hash_block_tokens(root, [9, 9, 9, 9]), [1, 2, 3, 4]),  # parent
        hash_block_tokens(root, [1, 2, 3, 5]),  # tokens
        hash_block_tokens(root, [1, 2, 3, 4], ("salt",)),  # extra key
        hash_block_tokens(root, [1, 2, 3, 4], (("img-a", 0),)),
        hash_block_tokens(root, [1, 2, 3, 4], (("img-b", 0),)),
        hash_block_tokens(root, [1, 2, 3, 4], (("img-a", -1),)),
    ]
    assert len({h, *others}) == 1 + len(others)


def test_manager_hashes_chain_the_prefix_and_skip_the_partial_block() -> None:
    mgr = KVCacheManager(8, 4)
    a = mgr.block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = mgr.block_hashes([0, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and len(b) == 2  # the 9th token's block is not full
    assert a[1] != b[1]  # same tokens in block 1, different prefix
    assert a[0] == hash_block_tokens(none_hash(0), [1, 2, 3, 4])
    assert a[1] == hash_block_tokens(a[0], [5, 6, 7, 8])
    assert KVCacheManager(8, 4, hash_seed=1).block_hashes([1, 2, 3, 4]) != a[:1]
    assert mgr.block_hashes([1, 2, 3, 4], extra_key="salt") != a[:1]


# ---------------------------------------------------------------------- prefix hits
def test_a_fully_cached_prompt_recomputes_its_last_block() -> None:
    mgr = KVCacheManager(16, 4)
    assert run(mgr, "r1", list(range(1, 9)))[1] == 0
    first_blocks = mgr.req_to_blocks["r1"]
    hits, n = run(mgr, "r2", list(range(1, 9)))
    assert n == 4 and hits == first_blocks[:1]
    hits, n = run(mgr, "r3", list(range(1, 10)))
    assert n == 8 and hits == first_blocks[:2]
    assert [b.ref_cnt for b in first_blocks] == [3, 2]
    assert (mgr.queries, mgr.hits) == (8 + 8 + 9, 0 + 4 + 8)


def test_extra_key_separates_caches() -> None:
    mgr = KVCacheManager(16, 4)
    tokens = list(range(1, 10))
    run(mgr, "a", tokens, extra_key="tenant-a")
    assert mgr.get_computed_blocks(tokens, extra_key="tenant-b")[1] == 0
    assert mgr.get_computed_blocks(tokens)[1] == 0
    assert mgr.get_computed_blocks(tokens, extra_key="tenant-a")[1] == 8


def test_blocks_are_registered_when_they_become_full() -> None:
    mgr = KVCacheManager(8, 4)
    tokens = list(range(1, 10))
    assert mgr.allocate_slots("r", tokens, 5) is not None  # block 0 full, block 1 partial
    assert mgr.get_computed_blocks(tokens)[1] == 4
    assert mgr.allocate_slots("r", tokens, 3) is not None  # block 1 now full
    assert mgr.get_computed_blocks(tokens)[1] == 8
    assert len(mgr.get_block_ids("r")) == 2
    assert mgr.allocate_slots("r", tokens, 1) is not None  # 9th token: a third block
    assert len(mgr.get_block_ids("r")) == 3
    mgr.block_pool.check_invariants()


def test_concurrent_duplicates_are_both_registered() -> None:
    mgr = KVCacheManager(8, 4)
    tokens = list(range(1, 9))
    # Both were looked up before either allocated (same scheduling step): no hits.
    mgr.allocate_slots("a", tokens, 8)
    mgr.allocate_slots("b", tokens, 8)
    a, b = mgr.req_to_blocks["a"], mgr.req_to_blocks["b"]
    pool = mgr.block_pool
    assert [x.block_hash for x in b] == [x.block_hash for x in a]
    assert {h: list(c) for h, c in pool.cached_block_hash_to_block.items()} == {
        x.block_hash: [x.block_id, y.block_id] for x, y in zip(a, b, strict=True)
    }
    assert pool.get_cached_block(a[1].block_hash) is a[1]  # the oldest copy
    mgr.free("b")  # cached copies: to the back, tail first
    assert queue_ids(pool)[-2:] == [b[1].block_id, b[0].block_id]
    pool.check_invariants()


def test_a_recomputed_block_is_a_copy_that_outlives_the_first() -> None:
    """vLLM does not de-duplicate (``BlockHashToBlockMap``): the block a repeated prompt
    recomputes (its last block, which it may not hit) is cached again, at the back of the
    LRU queue. The hash then survives the eviction of the older copy, and the copy costs a
    slot. The real vLLM's ``num_cached_tokens`` show both (tests/test_vllm_parity.py)."""
    mgr = KVCacheManager(8, 4)
    pool = mgr.block_pool
    t, u = list(range(1, 9)), list(range(11, 19))  # two blocks each
    for rid, tokens in (("t1", t), ("u", u)):
        run(mgr, rid, tokens)
        mgr.free(rid)
    x0, x1 = (pool.get_cached_block(h) for h in mgr.block_hashes(t))
    u0, u1 = (pool.get_cached_block(h) for h in mgr.block_hashes(u))
    hits, n = run(mgr, "t2", t)  # hits x0 only (the last token is always computed)
    assert hits == [x0] and n == 4
    y1 = mgr.req_to_blocks["t2"][1]
    assert y1 is not x1 and y1.block_hash == x1.block_hash
    mgr.free("t2")
    assert queue_ids(pool)[-4:] == [u1.block_id, u0.block_id, y1.block_id, x0.block_id]
    # Memory pressure takes the 3 untouched blocks, x1, then u1: t's second block lives on
    # in its copy, u's is gone.
    h1, hu1 = x1.block_hash, u1.block_hash
    hits, _ = run(mgr, "p", list(range(100, 120)))  # 20 tokens: 5 new blocks
    assert not hits and {x1, u1} <= set(mgr.req_to_blocks["p"])
    assert pool.get_cached_block(h1) is y1 and pool.get_cached_block(hu1) is None
    assert mgr.get_computed_blocks(t + [9])[1] == 8
    assert mgr.get_computed_blocks(u + [19])[1] == 4
    pool.check_invariants()


# ---------------------------------------------------------------------- free order, lazy eviction
def test_free_order_tail_first_and_uncached_before_cached() -> None:
    mgr = KVCacheManager(6, 4)
    tokens = list(range(1, 11))  # 10 tokens: blocks 0, 1 full (cached), block 2 partial
    run(mgr, "r", tokens)
    b0, b1, b2 = mgr.req_to_blocks["r"]
    untouched = queue_ids(mgr.block_pool)
    mgr.free("r")
    # The partial block has no hash: reused first. The cached ones go to the back, tail
    # first (b1 hashes more tokens than b0, so it is less likely to be hit again).
    assert queue_ids(mgr.block_pool) == [b2.block_id, *untouched, b1.block_id, b0.block_id]
    assert [b.ref_cnt for b in (b0, b1, b2)] == [0, 0, 0]
    mgr.block_pool.check_invariants()


def test_without_caching_every_freed_block_is_reused_first_tail_first() -> None:
    mgr = KVCacheManager(5, 4, enable_caching=False)
    run(mgr, "r", list(range(1, 11)))
    ids = mgr.get_block_ids("r")
    mgr.free("r")
    assert queue_ids(mgr.block_pool)[:3] == ids[::-1]
    assert mgr.block_pool.cached_block_hash_to_block == {}
    assert mgr.get_computed_blocks(list(range(1, 11)))[1] == 0


def test_a_freed_cached_block_stays_findable_until_its_memory_is_reused() -> None:
    mgr = KVCacheManager(4, 4)
    tokens = list(range(1, 10))
    run(mgr, "r1", tokens)
    b0, b1, _ = mgr.req_to_blocks["r1"]
    h0, h1 = b0.block_hash, b1.block_hash
    mgr.free("r1")
    assert mgr.block_pool.get_cached_block(h0) is b0 and b0.ref_cnt == 0
    # A hit takes b0 out of the middle of the free queue.
    hits, n = run(mgr, "r2", [1, 2, 3, 4, 50, 51])
    assert hits == [b0] and n == 4 and b0.ref_cnt == 1
    assert b0.block_id not in queue_ids(mgr.block_pool)
    assert mgr.block_pool.get_cached_block(h1) is b1  # still findable, still free
    # Use up the free blocks; b1 is reused last and only then loses its hash.
    pool = mgr.block_pool
    taken = pool.get_new_blocks(pool.get_num_free_blocks() - 1)
    assert b1 not in taken and pool.get_cached_block(h1) is b1
    assert pool.get_new_blocks(1) == [b1]
    assert pool.get_cached_block(h1) is None and b1.block_hash is None
    assert pool.get_cached_block(h0) is b0
    pool.check_invariants()


# ---------------------------------------------------------------------- allocate_slots
def test_allocate_slots_is_all_or_nothing() -> None:
    mgr = KVCacheManager(3, 4)
    run(mgr, "a", list(range(1, 9)))  # 2 blocks
    before = pool_state(mgr)
    assert mgr.allocate_slots("b", list(range(20, 30)), 10) is None  # needs 3, 1 free
    assert mgr.allocate_slots("a", list(range(1, 19)), 10) is None  # growing "a": same
    assert pool_state(mgr) == before
    assert mgr.allocate_slots("b", list(range(20, 24)), 4) is not None
    mgr.block_pool.check_invariants()


def test_capacity_check_counts_hit_blocks_in_the_free_queue() -> None:
    mgr = KVCacheManager(3, 4)
    run(mgr, "a", list(range(1, 10)))  # 3 blocks, the first two cached
    mgr.free("a")  # all 3 free; 2 of them still cached
    tokens = list(range(1, 9)) + [50, 51, 52, 53, 54]  # 13 tokens: 4 blocks, 2 of them hits
    hits, n = mgr.get_computed_blocks(tokens)
    assert n == 8
    # 2 new blocks + 2 hit blocks that must leave the free queue = 4 > 3 free blocks.
    before = pool_state(mgr)
    assert mgr.allocate_slots("b", tokens, len(tokens) - n, hits) is None
    assert pool_state(mgr) == before
    # 9 tokens: 1 new + 2 hits = 3: fits exactly.
    short = tokens[:9]
    hits, n = mgr.get_computed_blocks(short)
    assert mgr.allocate_slots("c", short, len(short) - n, hits) is not None
    assert mgr.block_pool.get_num_free_blocks() == 0
    mgr.block_pool.check_invariants()


def test_free_blocks_twice_raises_and_never_queues_a_block_twice() -> None:
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    ids = queue_ids(pool)
    with pytest.raises(UnknownBlockError):
        pool.free_blocks([b])
    assert queue_ids(pool) == ids and b.ref_cnt == 0
    (c,) = pool.get_new_blocks(1)
    ids = queue_ids(pool)
    with pytest.raises(UnknownBlockError):
        pool.free_blocks([c, c])  # one reference, freed twice in one call
    assert queue_ids(pool) == ids and c.ref_cnt == 1
    pool.check_invariants()


def test_bad_arguments_raise_typed_errors_and_change_nothing() -> None:
    mgr = KVCacheManager(4, 4)
    run(mgr, "a", list(range(1, 6)))
    before = pool_state(mgr)
    with pytest.raises(InvalidArgumentError):
        mgr.allocate_slots("a", list(range(1, 6)), 1)  # 6 tokens > 5 in token_ids
    with pytest.raises(InvalidArgumentError):
        mgr.allocate_slots("a", list(range(1, 6)), -1)
    with pytest.raises(UnknownBlockError):
        mgr.free("nobody")
    with pytest.raises(OutOfMemoryError):
        mgr.block_pool.get_new_blocks(3)
    hits, _ = mgr.get_computed_blocks(list(range(1, 10)))
    with pytest.raises(InvalidArgumentError):
        mgr.allocate_slots("a", list(range(1, 10)), 1, hits)  # hits only for new requests
    assert pool_state(mgr) == before
    mgr.block_pool.check_invariants()
    with pytest.raises(InvalidArgumentError):
        BlockPool(0)
    with pytest.raises(InvalidArgumentError):
        KVCacheManager(4, 0)


def test_usage_and_reset_prefix_cache() -> None:
    mgr = KVCacheManager(4, 4)
    run(mgr, "a", list(range(1, 9)))
    assert mgr.block_pool.get_usage() == pytest.approx(2 / 4)
    assert mgr.block_pool.reset_prefix_cache() is False  # blocks in use
    mgr.free("a")
    assert mgr.block_pool.get_usage() == 0.0
    assert mgr.block_pool.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(list(range(1, 10)))[1] == 0
    mgr.block_pool.check_invariants()
