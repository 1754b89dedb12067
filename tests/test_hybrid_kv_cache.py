"""vLLM 0.32's hybrid prefix cache, piece by piece: grouping, the per-type hit rules, the
fixed point, sliding-window skipping and retention, the null block, and the scripted trace the
real vLLM was measured on (``shared/reference/hybrid-caches.md``).

The property tests over random traces are in ``test_hybrid_kv_cache_properties.py``; the
same trace against the real vLLM is in ``test_vllm_hybrid.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

from minirad.errors import InvalidArgumentError, InvariantError, UnknownBlockError
from minirad.kvcache.block_pool import BlockPool, hash_block_tokens, make_block_hash_with_group_id
from minirad.kvcache.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    UnitaryKVCacheCoordinator,
)
from minirad.kvcache.kv_cache_groups import KVCacheGroupSpec, get_kv_cache_groups
from minirad.kvcache.kv_cache_manager import KVCacheManager, serve_one_at_a_time
from minirad.kvcache.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from minirad.kvcache.single_type_kv_cache_manager import (
    FullAttentionManager,
    SlidingWindowManager,
)


def sw(window: int, block_size: int = 4) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size, 1, 8, torch.float32, sliding_window=window)


def full(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size, 1, 8, torch.float32)


def chain(n: int) -> list[bytes]:
    """``n`` chained block hashes (any distinct values would do)."""
    hashes, parent = [], b"root"
    for i in range(n):
        parent = hash_block_tokens(parent, [i])
        hashes.append(parent)
    return hashes


def cache(pool: BlockPool, hashes: list[bytes], group_id: int, positions) -> None:
    """Leave blocks cached (and free) in ``group_id`` at ``positions`` of the hash chain."""
    blocks = pool.get_new_blocks(len(positions))
    keys = [make_block_hash_with_group_id(hashes[i], group_id) for i in positions]
    pool.cache_full_blocks(blocks, keys)
    pool.free_blocks(blocks)


# ---------------------------------------------------------------------- grouping
def test_gemma3_five_sliding_to_one_full_gives_six_groups_of_one_layer() -> None:
    groups = get_kv_cache_groups([sw(32)] * 5 + [full()])
    assert [g.layer_ids for g in groups] == [(0,), (1,), (2,), (3,), (4,), (5,)]
    assert [type(g.spec) for g in groups] == [SlidingWindowSpec] * 5 + [FullAttentionSpec]


def test_52_sliding_and_10_full_layers_give_groups_of_10_the_last_sliding_ones_padded() -> None:
    """Gemma-3-27B's pattern (every 6th layer full). The group size is 10, the smaller count;
    the 52 sliding layers are dealt round robin into cdiv(52, 10) = 6 groups (vLLM:
    ``layers[i::6]``), so the last two hold 8 layers and 2 padding slots each."""
    specs = [full() if i % 6 == 5 else sw(32) for i in range(62)]
    groups = get_kv_cache_groups(specs)
    sliding = [g.layer_ids for g in groups if isinstance(g.spec, SlidingWindowSpec)]
    [full_layers] = [g.layer_ids for g in groups if isinstance(g.spec, FullAttentionSpec)]
    assert [len(g) for g in sliding] == [9, 9, 9, 9, 8, 8]
    assert len(full_layers) == 10 and full_layers[:2] == (5, 11)
    assert sorted(i for g in sliding for i in g) == [i for i in range(62) if i % 6 != 5]
    assert sliding[0][:3] == (0, 7, 14)  # every 6th sliding layer


def test_near_equal_counts_take_the_larger_as_group_size() -> None:
    groups = get_kv_cache_groups([sw(32)] * 12 + [full()] * 13)
    assert [len(g.layer_ids) for g in groups] == [12, 13]


def test_disabling_the_hybrid_manager_makes_one_full_attention_group() -> None:
    [group] = get_kv_cache_groups([sw(32)] * 5 + [full()], disable_hybrid=True)
    assert group == KVCacheGroupSpec(tuple(range(6)), full())
    # An all-sliding model is not a hybrid: it keeps its window.
    [group] = get_kv_cache_groups([sw(32)] * 3, disable_hybrid=True)
    assert group.spec == sw(32)


def test_grouping_rejects_what_it_cannot_group() -> None:
    with pytest.raises(InvalidArgumentError):
        get_kv_cache_groups([])
    with pytest.raises(InvalidArgumentError):
        get_kv_cache_groups([full(), "full"])
    with pytest.raises(InvalidArgumentError, match="page size"):
        get_kv_cache_groups([full(), FullAttentionSpec(4, 2, 8, torch.float32)])


# ---------------------------------------------------------------------- per-type hits
def test_a_sliding_window_hit_ends_with_its_window_and_starts_with_null_blocks() -> None:
    """vLLM's own example: block size 4, window 8, so a hit needs cdiv(7, 4) = 2 cached
    blocks before it: ``[NULL, NULL, b7, b8]``."""
    pool = BlockPool(20, use_null_block=True)
    hashes = chain(6)
    cache(pool, hashes, 0, [2, 3, 5])  # 4 is missing: the run 2, 3 is the last full window
    (blocks,), length = SlidingWindowManager.find_longest_cache_hit(hashes, 6 * 4, [0], pool, sw(8))
    assert length == 16
    assert [b.is_null for b in blocks] == [True, True, False, False]
    assert [b.block_hash for b in blocks[2:]] == [
        make_block_hash_with_group_id(h, 0) for h in hashes[2:4]
    ]


def test_without_a_whole_window_a_sliding_hit_is_the_run_from_block_0() -> None:
    pool = BlockPool(20, use_null_block=True)
    hashes = chain(6)
    cache(pool, hashes, 0, [0, 3])
    blocks, length = SlidingWindowManager.find_longest_cache_hit(hashes, 24, [0], pool, sw(12))
    assert length == 4 and not blocks[0][0].is_null  # window 12 needs 3 blocks: only block 0


def test_full_attention_hits_left_to_right_and_groups_of_a_spec_hit_together() -> None:
    pool = BlockPool(20, use_null_block=True)
    hashes = chain(5)
    cache(pool, hashes, 0, [0, 1, 2, 4])
    cache(pool, hashes, 1, [0, 1])
    assert FullAttentionManager.find_longest_cache_hit(hashes, 20, [0], pool, full())[1] == 12
    blocks, length = FullAttentionManager.find_longest_cache_hit(hashes, 20, [0, 1], pool, full())
    assert length == 8 and [len(b) for b in blocks] == [2, 2]
    assert FullAttentionManager.find_longest_cache_hit(hashes, 11, [0], pool, full())[1] == 8


def test_the_fixed_point_repeats_until_every_type_accepts() -> None:
    """Window 8 (2 blocks) in group 0, window 13 (3 blocks) in group 1, full attention in
    group 2. Round 1: full hits 9 blocks (36 tokens); window 8 finds its last window at 32;
    window 13 shortens to 24. Round 2: window 8 cannot serve 24 (block 5 missing), shortens
    to 20; window 13 serves 20. Round 3: all accept 20. One round would have said 24."""
    groups = [KVCacheGroupSpec((0,), sw(8)), KVCacheGroupSpec((1,), sw(13))]
    groups.append(KVCacheGroupSpec((2,), full()))
    pool = BlockPool(64, use_null_block=True)
    coordinator = HybridKVCacheCoordinator(groups, pool)
    hashes = chain(10)
    cache(pool, hashes, 2, range(9))
    cache(pool, hashes, 0, [3, 4, 6, 7])
    cache(pool, hashes, 1, [2, 3, 4, 5])
    blocks, length, uncached = coordinator.find_longest_cache_hit(hashes, 39)
    assert (length, uncached) == (20, 36 - 20)
    assert [len(b) for b in blocks] == [5, 5, 5]
    assert [b.is_null for b in blocks[0]] == [True, True, True, False, False]


# ---------------------------------------------------------------------- skipping and retention
def test_blocks_that_leave_the_window_become_the_null_block_and_return_to_the_pool() -> None:
    """Block size 4, window 8: after n computed tokens, the first n - 7 are skipped."""
    mgr = KVCacheManager(20, 4, layer_specs=[sw(8), full()])
    tokens = list(range(1, 14))  # 13 tokens: 4 blocks
    blocks, hit, boundary = mgr.get_computed_blocks(tokens)
    mgr.allocate_slots("a", tokens, len(tokens), blocks, shared_prefix_boundary=boundary)
    mgr.check_invariants()
    swa_table = mgr.get_block_ids("a")[0]
    assert 0 not in swa_table  # nothing computed yet: nothing skipped
    tokens.append(99)
    mgr.allocate_slots("a", tokens, 1)  # 13 computed: 6 skipped, block 0 wholly before
    swa_now, full_now = mgr.get_block_ids("a")
    assert swa_now[0] == 0 and swa_now[1:] == swa_table[1:]
    assert 0 not in full_now
    free_ids = [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_ids[0] == swa_table[0]  # uncached (not retained): reused first
    assert 0 not in free_ids  # the null block never
    mgr.remove_skipped_blocks("a", 14)  # 7 skipped: still one whole block
    assert mgr.get_block_ids("a")[0] == swa_now
    mgr.check_invariants()
    mgr.free("a")
    mgr.check_invariants()
    assert mgr.block_pool.get_num_free_blocks() == 19


def test_a_sliding_group_retains_only_the_window_tails_a_hit_can_end_on() -> None:
    """Block size 32, window 32: a hit needs cdiv(31, 32) = 1 block. A 200-token prompt's
    replay boundary is 199, so block 5 (tokens 160-191) is its only tail; a junction at 32
    adds block 0; an interval of 64 tokens adds the last block of every 2-block segment."""
    mask = SlidingWindowManager.reachable_block_mask
    spec = sw(32, 32)
    assert mask(0, 6, spec, 0, (199,)) == [False] * 5 + [True]
    assert mask(0, 6, spec, 0, (199, 32)) == [True] + [False] * 4 + [True]
    assert mask(0, 6, spec, 64, (199,)) == [False, True, False, True, False, True]
    assert mask(3, 6, spec, 0, (199,)) == [False, False, True]
    assert mask(0, 6, spec, None, (199,)) is None  # dense
    assert FullAttentionManager.reachable_block_mask(0, 6, full(32), 0, (199,)) is None


def test_a_retention_interval_keeps_a_tail_per_segment_so_a_mid_prompt_sharer_hits() -> None:
    rng = random.Random(1)
    a = [rng.randrange(1, 1000) for _ in range(200)]
    b = a[:130] + [rng.randrange(1, 1000) for _ in range(70)]
    specs = [sw(32, 32)] * 5 + [full(32)]
    for interval, expected in ((0, 0), (64, 128), (None, 128)):
        mgr = KVCacheManager(100, 32, layer_specs=specs, prefix_cache_retention_interval=interval)
        assert serve_one_at_a_time(mgr, [(a, [1, 2], ()), (b, [1, 2], ())]) == [0, expected]


# ---------------------------------------------------------------------- the measured trace
def trace_requests(seed: int = 0) -> list[list[int]]:
    """The trace vLLM 0.32 was measured on: A (200 tokens), A + 50, A, two prompts that share
    only A's first 40 tokens, A."""
    rng = random.Random(seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1000, 2000) for _ in range(n)]

    a = [rng.randrange(1, 1000) for _ in range(200)]
    return [a, a + fresh(50), a, a[:40] + fresh(160), a[:40] + fresh(160), a]


GEMMA3 = [sw(32, 32)] * 5 + [full(32)]


def test_the_trace_gives_vllm_s_cached_tokens_with_the_hybrid_manager_on_and_off() -> None:
    """Block size 32, window 32, so a sliding hit needs 1 cached block (31 tokens) before it.

    Hybrid manager on (1 full + 5 sliding groups): 0 / 192 / 192 / 0 / 32 / 192.

    1. A, 200 tokens: nothing cached: 0. Its 6 full blocks (192 tokens) are cached in the full
       group; the sliding groups keep only block 5, the window before its replay boundary
       (199, rounded down to 192). Blocks 0-4 leave the window during prefill's successor
       steps, become null, and go back to the pool uncached.
    2. A + 50 (250 tokens, at most 249 hit): full attention hits blocks 0-5 (block 6 holds
       the new tokens): 192; the sliding groups find block 5, a whole window: 192.
    3. A: the same, capped at 199: 192.
    4. The first prompt sharing A's first 40 tokens: full attention hits block 0 (32 tokens),
       but no sliding group kept block 0: the hit is 0. The 32 tokens full attention found are
       a shared prefix the sliding groups lack: ``shared_prefix_boundary`` = 32, and this
       request, caching its own blocks, keeps the window ending at 32 (its block 0).
    5. The second sharer: full attention hits block 0, and now so do the sliding groups: 32.
    6. A: still cached: 192.

    Hybrid manager off (one full-attention group, nothing dropped): the first sharer already
    hits block 0: 0 / 192 / 192 / 32 / 32 / 192. The one-group manager of chapters 02 and 08
    gives the same.
    """
    requests = [(prompt, [7, 8, 9, 10, 11, 12, 13, 14], ()) for prompt in trace_requests()]
    on = KVCacheManager(400, 32, layer_specs=GEMMA3)
    assert isinstance(on.coordinator, HybridKVCacheCoordinator)
    assert len(on.kv_cache_groups) == 6
    assert serve_one_at_a_time(on, requests) == [0, 192, 192, 0, 32, 192]
    on.check_invariants()
    off = KVCacheManager(400, 32, layer_specs=GEMMA3, disable_hybrid_kv_cache_manager=True)
    assert isinstance(off.coordinator, UnitaryKVCacheCoordinator)
    assert serve_one_at_a_time(off, requests) == [0, 192, 192, 32, 32, 192]
    assert serve_one_at_a_time(KVCacheManager(399, 32), requests) == [0, 192, 192, 32, 32, 192]


def test_the_first_sharer_misses_and_marks_the_junction_the_second_hits_there() -> None:
    a, _, _, b, c, _ = trace_requests()
    mgr = KVCacheManager(400, 32, layer_specs=GEMMA3)
    serve_one_at_a_time(mgr, [(a, [1, 2], ())])
    blocks, hit, boundary = mgr.get_computed_blocks(b)
    assert (hit, boundary) == (0, 32)
    mgr.allocate_slots("b", b, len(b), blocks, shared_prefix_boundary=boundary)
    block0 = mgr.get_block_ids("b")[0][0]
    assert mgr.block_pool.blocks[block0].block_hash is not None  # the junction's window kept
    mgr.free("b")
    blocks, hit, boundary = mgr.get_computed_blocks(c)
    assert (hit, boundary) == (32, 0)
    assert blocks[0][0].block_id == block0
    # A caller that drops the junction loses the second hit too.
    mgr = KVCacheManager(400, 32, layer_specs=GEMMA3)
    serve_one_at_a_time(mgr, [(a, [1, 2], ())])
    blocks, _, _ = mgr.get_computed_blocks(b)
    mgr.allocate_slots("b", b, len(b), blocks)  # shared_prefix_boundary not passed back
    mgr.free("b")
    assert mgr.get_computed_blocks(c)[1] == 0


# ---------------------------------------------------------------------- the null block, errors
def test_the_null_block_is_never_handed_out_freed_cached_or_evicted() -> None:
    pool = BlockPool(4, use_null_block=True)
    null = pool.null_block
    assert null.block_id == 0 and null.is_null and pool.num_usable_blocks == 3
    blocks = pool.get_new_blocks(3)
    assert null not in blocks
    pool.touch([null])
    pool.free_blocks([null, null])
    pool.cache_full_blocks([null], [b"h"])
    assert (null.ref_cnt, null.block_hash) == (0, None)
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0 and pool.reset_prefix_cache()
    pool.check_invariants()
    null.ref_cnt = 1
    with pytest.raises(InvariantError, match="null block"):
        pool.check_invariants()


def snapshot(mgr: KVCacheManager) -> tuple:
    pool = mgr.block_pool
    return (
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        {r: mgr.get_block_ids(r) for r in mgr.num_tokens},
        dict(mgr.num_tokens),
    )


def test_bad_arguments_raise_typed_errors_and_change_nothing() -> None:
    with pytest.raises(InvalidArgumentError):
        KVCacheManager(8, 4, layer_specs=[full()], kv_cache_groups=get_kv_cache_groups([full()]))
    with pytest.raises(InvalidArgumentError, match="block_size"):
        KVCacheManager(8, 8, layer_specs=[full()])
    for interval in (-4, 6, "4"):
        with pytest.raises(InvalidArgumentError, match="retention"):
            KVCacheManager(
                8, 4, layer_specs=[sw(8), full()], prefix_cache_retention_interval=interval
            )
    with pytest.raises(InvalidArgumentError, match="sliding"):
        KVCacheManager(8, 4, layer_specs=[full()], prefix_cache_retention_interval=8)
    with pytest.raises(InvalidArgumentError):
        KVCacheManager(1, 4, layer_specs=[full()])  # no room beside the null block
    with pytest.raises(InvalidArgumentError):
        KVCacheManager(8, 4, kv_cache_groups=[full()])

    mgr = KVCacheManager(12, 4, layer_specs=[sw(8), full()])
    tokens = list(range(1, 11))
    serve_one_at_a_time(mgr, [(tokens, [1], ())])
    blocks, _, _ = mgr.get_computed_blocks(tokens)
    mgr.allocate_slots("a", tokens, 2, blocks)
    before = snapshot(mgr)
    flat = blocks[1]  # the one-group manager's shape: refused
    with pytest.raises(InvalidArgumentError, match="one per group"):
        mgr.allocate_slots("b", tokens, 2, flat)
    with pytest.raises(InvalidArgumentError, match="one length"):
        mgr.allocate_slots("b", tokens, 2, (blocks[0], blocks[1][:1]))
    with pytest.raises(InvalidArgumentError, match="only claimed by a new request"):
        mgr.allocate_slots("a", tokens, 1, blocks)
    with pytest.raises(InvalidArgumentError, match="shared_prefix_boundary"):
        mgr.allocate_slots("b", tokens, 2, blocks, shared_prefix_boundary=-1)
    with pytest.raises(InvalidArgumentError):
        mgr.allocate_slots("a", tokens, 99)
    with pytest.raises(UnknownBlockError):
        mgr.remove_skipped_blocks("nobody", 1)
    with pytest.raises(InvalidArgumentError):
        mgr.remove_skipped_blocks("a", 999)  # more than it has slots for
    with pytest.raises(UnknownBlockError):
        mgr.free("nobody")
    assert snapshot(mgr) == before
    mgr.check_invariants()


def test_a_new_request_that_does_not_fit_changes_nothing() -> None:
    mgr = KVCacheManager(6, 4, layer_specs=[sw(8), full()])
    tokens = list(range(1, 14))  # 4 blocks in each of 2 groups: 8 > 5 usable
    blocks, _, _ = mgr.get_computed_blocks(tokens)
    before = snapshot(mgr)
    assert mgr.allocate_slots("a", tokens, len(tokens), blocks) is None
    assert snapshot(mgr) == before
    mgr.check_invariants()


def test_the_one_group_manager_has_the_new_checks_too() -> None:
    mgr = KVCacheManager(8, 4)
    serve_one_at_a_time(mgr, [(list(range(1, 10)), [1, 2], ())])
    mgr.check_invariants()
    mgr.allocate_slots("a", list(range(1, 10)), 9)
    mgr.remove_skipped_blocks("a", 9)  # full attention: nothing to drop
    mgr.block_pool.blocks[mgr.req_to_blocks["a"][0].block_id].ref_cnt += 1
    with pytest.raises(InvariantError):
        mgr.check_invariants()
