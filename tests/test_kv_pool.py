"""Unit tests of the physical KV tensor and the token-slot allocator
(``minirad.kvcache.kv_pool``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minirad import (
    InvalidArgumentError,
    InvalidKeyError,
    KVCache,
    OutOfMemoryError,
    RadixCache,
    TokenToKVPoolAllocator,
    UnknownBlockError,
    block_table_from_slots,
    slot_mapping,
)

DIMS = dict(num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8)


# ---------------------------------------------------------------------- KVCache
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kv_cache_shapes_and_byte_counts(dtype: torch.dtype) -> None:
    kv = KVCache(**DIMS, dtype=dtype)
    shape = (3, 5, 4, 2, 8)
    assert kv.k_cache.shape == kv.v_cache.shape == shape
    assert kv.k_cache.dtype == dtype
    assert kv.num_slots == 5 * 4
    elem = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}[dtype]
    assert kv.bytes_per_token == 2 * 3 * 2 * 8 * elem  # K and V, every layer
    assert kv.bytes_per_block == kv.bytes_per_token * 4
    assert kv.nbytes == kv.bytes_per_token * 20
    tensor_bytes = sum(t.numel() * t.element_size() for t in (kv.k_cache, kv.v_cache))
    assert kv.nbytes == tensor_bytes


def test_store_then_gather_returns_what_was_written() -> None:
    kv = KVCache(**DIMS)
    slots = torch.tensor([0, 5, 6, 19, 13])
    k = torch.randn(5, 2, 8)
    v = torch.randn(5, 2, 8)
    kv.store(1, slots, k, v)
    k_flat, v_flat = kv.layer(1)
    assert k_flat.shape == (20, 2, 8)
    assert torch.equal(k_flat[slots], k) and torch.equal(v_flat[slots], v)
    # The flat slot view is the [block, offset] layout, not a copy.
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(kv.k_cache[1, s // 4, s % 4], k[i])
        assert torch.equal(kv.v_cache[1, s // 4, s % 4], v[i])
    # Other layers and other slots are untouched.
    assert kv.k_cache[0].abs().sum() == 0 and kv.v_cache[2].abs().sum() == 0
    untouched = [s for s in range(20) if s not in slots.tolist()]
    assert k_flat[untouched].abs().sum() == 0


def test_kv_cache_rejects_bad_dimensions() -> None:
    for name in DIMS:
        with pytest.raises(InvalidArgumentError):
            KVCache(**{**DIMS, name: 0})
    with pytest.raises(InvalidArgumentError):
        KVCache(**{**DIMS, "head_dim": 8.0})


# ---------------------------------------------------------------------- slot mapping
def test_slot_mapping_and_block_table_round_trip() -> None:
    table = [3, 0, 2]
    slots = slot_mapping(table, range(10), block_size=4)
    assert slots == [12, 13, 14, 15, 0, 1, 2, 3, 8, 9]  # blocks 3, 0, 2 in turn
    assert block_table_from_slots(slots, 4) == table
    assert slot_mapping(table, [9, 1], 4) == [9, 13]  # any subset of positions


def test_slot_mapping_rejects_positions_outside_the_table() -> None:
    with pytest.raises(InvalidArgumentError):
        slot_mapping([1, 2], [8], block_size=4)
    with pytest.raises(InvalidArgumentError):
        slot_mapping([1, 2], [-1], block_size=4)


def test_block_table_from_slots_rejects_misaligned_slots() -> None:
    with pytest.raises(InvalidArgumentError):
        block_table_from_slots([4, 6], 4)  # token 1 at offset 2
    with pytest.raises(InvalidArgumentError):
        block_table_from_slots([5], 4)  # token 0 at offset 1
    with pytest.raises(InvalidArgumentError):
        block_table_from_slots([4, 9], 4)  # offset right, block changes mid-page


# ---------------------------------------------------------------------- allocator
@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_allocator_hands_out_whole_pages(page_size: int) -> None:
    alloc = TokenToKVPoolAllocator(8 * page_size, page_size)
    assert alloc.available_size() == 8 * page_size
    slots = alloc.alloc(5)
    pages = -(-5 // page_size)
    assert len(slots) == 5 and len(set(slots)) == 5
    assert alloc.available_size() == (8 - pages) * page_size
    # Every slot sits at its position's page offset, pages are distinct and whole.
    assert [s % page_size for s in slots] == [i % page_size for i in range(5)]
    assert len(block_table_from_slots(slots, page_size)) == pages
    assert all(alloc.is_allocated(s) for s in slots)
    assert alloc.alloc(0) == []
    alloc.free(slots)
    assert alloc.available_size() == 8 * page_size
    assert not any(alloc.is_allocated(s) for s in slots)


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_allocator_out_of_memory_changes_nothing(page_size: int) -> None:
    alloc = TokenToKVPoolAllocator(4 * page_size, page_size)
    held = alloc.alloc(2 * page_size)
    with pytest.raises(OutOfMemoryError):
        alloc.alloc(2 * page_size + 1)
    assert alloc.available_size() == 2 * page_size
    rest = alloc.alloc(2 * page_size)  # exactly what was free still works
    assert set(rest).isdisjoint(held) and alloc.available_size() == 0


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_allocator_double_free_and_unknown_slots_raise(page_size: int) -> None:
    alloc = TokenToKVPoolAllocator(4 * page_size, page_size)
    a = alloc.alloc(page_size)
    b = alloc.alloc(page_size)
    alloc.free(a)
    for bad in (a, [a[0]], b + a, [4 * page_size], [-1], [1.0]):
        with pytest.raises(UnknownBlockError):
            alloc.free(bad)
        assert alloc.available_size() == 3 * page_size  # nothing freed on error
        assert all(alloc.is_allocated(s) for s in b)


def test_allocator_frees_a_page_once_whichever_slots_are_named() -> None:
    alloc = TokenToKVPoolAllocator(8, 4)
    slots = alloc.alloc(3)  # one page, 3 of its 4 slots used
    alloc.free([slots[2], slots[0]])
    assert alloc.available_size() == 8
    with pytest.raises(UnknownBlockError):
        alloc.free([slots[1]])


def test_allocator_reuses_freed_pages_in_fifo_order() -> None:
    alloc = TokenToKVPoolAllocator(4)
    first = alloc.alloc(4)
    alloc.free([first[2]])
    alloc.free([first[0]])
    assert alloc.alloc(2) == [first[2], first[0]]


def test_allocator_rejects_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError):
        TokenToKVPoolAllocator(6, 4)  # not whole pages
    with pytest.raises(InvalidArgumentError):
        TokenToKVPoolAllocator(8, 0)
    alloc = TokenToKVPoolAllocator(8)
    with pytest.raises(InvalidArgumentError):
        alloc.alloc(-1)
    assert alloc.available_size() == 8


def test_free_refuses_the_slots_the_radix_cache_holds_until_it_evicts_them() -> None:
    """Issue 11 point 13: the mistake fails at the free, not later in evict."""
    alloc = TokenToKVPoolAllocator(8, page_size=2)
    cache = RadixCache(2, token_to_kv_pool_allocator=alloc)
    held = alloc.alloc(4)
    cache.insert([1, 2], held[:2])
    cache.insert([3, 4], held[2:])
    private = alloc.alloc(2)
    for slots in ([held[1]], [held[2]], private + [held[3]]):  # any slot of a held page
        with pytest.raises(InvalidKeyError):
            alloc.free(slots)
        assert alloc.available_size() == 2  # nothing was freed
    with pytest.raises(InvalidKeyError):
        alloc.check_allocated(held)
    alloc.free(private)
    assert cache.evict(2) == held[:2]  # the cache frees what it evicts (LRU first)...
    assert alloc.available_size() == 6 and alloc.cache_owned.tolist() == [0] * 2 + [1] * 2 + [0] * 4
    cache.reset()  # ...and what it drops
    assert alloc.available_size() == 8 and not alloc.cache_owned.any()
    alloc.free(alloc.alloc(8))  # every slot is an ordinary slot again
    cache.check_invariants()


def test_allocator_refuses_bools_and_numpy_floats_as_slots() -> None:
    alloc = TokenToKVPoolAllocator(4)
    alloc.alloc(4)
    for bad in ([True], [0, False], np.array([1.0]), [np.float64(2.0)]):
        with pytest.raises(UnknownBlockError):
            alloc.free(bad)
        assert alloc.available_size() == 0
    alloc.free(np.array([3, 1]))  # integer arrays are fine
    got = alloc.alloc(2)
    assert got == [3, 1] and all(type(s) is int for s in got)  # FIFO, plain ints


@pytest.mark.parametrize("page_size", [1, 2])
def test_allocator_free_queue_wraps_around_in_fifo_order(page_size: int) -> None:
    """The free pages sit in a ring of fixed size: order holds across its end."""
    alloc = TokenToKVPoolAllocator(5 * page_size, page_size)
    a = alloc.alloc(3 * page_size)
    b = alloc.alloc(2 * page_size)
    alloc.free(a[page_size:])  # pages 1 and 2 at the ring's start
    alloc.free(b)  # ... and pages 3, 4
    alloc.free(a[:page_size])  # page 0 wraps around to the front
    again = alloc.alloc(5 * page_size)  # the whole ring, wrapping
    assert again == a[page_size:] + b + a[:page_size]
    assert alloc.available_size() == 0 and all(type(s) is int for s in again)
    alloc.free(again)
    assert alloc.available_size() == 5 * page_size


def test_allocator_hands_out_plain_ints_after_the_cache_held_numpy_ints() -> None:
    alloc = TokenToKVPoolAllocator(4)
    cache = RadixCache(token_to_kv_pool_allocator=alloc)
    slots = alloc.alloc(4)
    cache.insert([1, 2, 3, 4], [np.int64(s) for s in slots])
    assert cache.evict(4) == slots
    assert all(type(s) is int for s in alloc.alloc(4))


def test_reset_after_the_pool_was_cleared_frees_nothing_twice() -> None:
    alloc = TokenToKVPoolAllocator(8)
    cache = RadixCache(token_to_kv_pool_allocator=alloc)
    cache.insert([1, 2], alloc.alloc(2))
    alloc.clear()
    taken = alloc.alloc(8)  # someone else holds every slot now, the cache's old ones too
    cache.reset()  # its slots went back with the clear: not freed again
    assert alloc.available_size() == 0 and cache.total_size() == 0
    alloc.free(taken)
    cache.insert([1, 2], alloc.alloc(2))  # the reset cache works with the pool again
    assert cache.evict(2) and alloc.available_size() == 8
    cache.check_invariants()


def test_evicting_from_a_pool_cleared_and_handed_out_again_frees_nothing() -> None:
    alloc = TokenToKVPoolAllocator(4)
    cache = RadixCache(token_to_kv_pool_allocator=alloc)
    cache.insert([1, 2], alloc.alloc(2))
    alloc.clear()
    taken = alloc.alloc(4)  # the cache's old slots belong to someone else now
    with pytest.raises(UnknownBlockError):
        cache.evict(2)
    assert alloc.available_size() == 0  # nothing of theirs was freed
    alloc.free(taken)
