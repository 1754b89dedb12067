"""Misuse found by trying to break the library: each raises a typed error and leaves every
structure consistent (``check_invariants()``), or is accepted and handled correctly."""

import json

import numpy as np
import pytest
import torch

from minirad import (
    BlockPool,
    EventBus,
    EventRecorder,
    InvalidArgumentError,
    InvalidKeyError,
    KVCacheManager,
    LockError,
    RadixCache,
    Req,
    TokenToKVPoolAllocator,
    UnknownBlockError,
)
from minirad.course.dot import radix_tree
from minirad.events import ResetEvent, event_from_dict


def _cache(size: int = 16, page_size: int = 1) -> tuple[RadixCache, TokenToKVPoolAllocator]:
    alloc = TokenToKVPoolAllocator(size, page_size)
    return RadixCache(page_size, token_to_kv_pool_allocator=alloc), alloc


def _accounted(cache: RadixCache, alloc: TokenToKVPoolAllocator, private: int = 0) -> bool:
    return alloc.available_size() + cache.total_size() + private == alloc.size


def test_finishing_a_request_whose_slot_was_freed_changes_nothing() -> None:
    cache, alloc = _cache(16, 4)
    r0 = Req("r0", [1, 2, 3, 4, 5])
    cache.match_prefix_for_req(r0)
    r0.kv_indices += alloc.alloc(5)
    cache.cache_finished_req(r0)
    r = Req("r", list(range(1, 11)))
    cache.match_prefix_for_req(r)
    slots = alloc.alloc(6)
    r.kv_indices += slots
    alloc.free([slots[5]])  # the caller's mistake
    size = cache.total_size()
    with pytest.raises(UnknownBlockError):
        cache.cache_finished_req(r)
    assert cache.total_size() == size and cache.protected_size() > 0  # nothing happened
    cache.check_invariants()


def test_freeing_a_slot_the_tree_holds_fails_at_the_free() -> None:
    cache, alloc = _cache()
    for key in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        cache.insert(key, alloc.alloc(3))
    with pytest.raises(InvalidKeyError):
        alloc.free(cache.match_prefix([4, 5, 6]).indices)  # the caller's mistake
    assert alloc.available_size() == 7  # nothing was freed
    assert len(cache.evict(9)) == 9 and alloc.available_size() == 16
    cache.check_invariants()


@pytest.mark.parametrize("slots", [[0, 1], [100, 101]])
def test_insert_rejects_slots_the_allocator_never_handed_out(slots) -> None:
    cache, alloc = _cache(8)
    with pytest.raises((UnknownBlockError, InvalidKeyError)):
        cache.insert([1, 2], slots)
    assert cache.total_size() == 0
    cache.check_invariants()


def test_matching_a_request_twice_is_refused_instead_of_leaking_a_lock() -> None:
    cache, alloc = _cache()
    cache.insert([1, 2, 3, 4], alloc.alloc(4))
    req = Req("r", [1, 2, 3, 4, 5])
    cache.match_prefix_for_req(req)
    with pytest.raises(LockError):
        cache.match_prefix_for_req(req)
    req.kv_indices += alloc.alloc(1)
    cache.cache_finished_req(req)
    assert cache.protected_size() == 0
    assert _accounted(cache, alloc)


@pytest.mark.parametrize("wrap", [np.array, torch.tensor, tuple])
def test_req_accepts_arrays_and_tensors_as_token_lists(wrap) -> None:
    req = Req("r", wrap([1, 2, 3]), output_ids=wrap([7, 8, 9]))
    assert req.fill_ids == [1, 2, 3, 7, 8, 9]
    assert all(type(t) is int for t in req.fill_ids)


def test_numpy_scalars_become_ints_so_event_logs_serialise(tmp_path) -> None:
    bus = EventBus()
    rec = EventRecorder(bus)
    cache = RadixCache(bus=bus)
    cache.insert([np.int64(5), np.int64(6)], [np.int64(0), np.int64(1)])
    rec.save(tmp_path / "log.jsonl")
    assert json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])["key"] == [5, 6]


@pytest.mark.parametrize("wrap", [list, np.array, torch.tensor])
def test_block_cache_hits_do_not_depend_on_the_container(wrap) -> None:
    mgr = KVCacheManager(8, 4)
    tokens = list(range(1, 10))
    mgr.allocate_slots("a", wrap(tokens), 9)
    assert mgr.get_computed_blocks(wrap(tokens))[1] == 8
    assert mgr.block_hashes(wrap(tokens)) == mgr.block_hashes(tokens)


def test_the_tree_drawing_escapes_text_that_looks_like_markup() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3])
    dot = radix_tree(cache, decode=lambda ids: "<image><image>\\l")
    dot.pipe(format="svg")  # raises CalledProcessError on invalid DOT


def test_a_custom_policy_with_ties_still_evicts_by_id() -> None:
    class Constant:
        name = "constant"

        def priority(self, node):
            return (0,)

    cache = RadixCache(eviction_policy=Constant())
    cache.insert([1, 2, 3])
    cache.insert([1, 2, 4])
    assert len(cache.evict(10)) == 4


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.insert(None),
        lambda c: c.insert(5),
        lambda c: c.insert([1], extra_key=["unhashable"]),
        lambda c: c.insert([50], [2**63]),
        lambda c: c.insert([50], [10**11]),
        lambda c: c.inc_lock_ref(None),
        lambda c: RadixCache(eviction_policy=42),
    ],
)
def test_bad_arguments_raise_typed_errors(call) -> None:
    cache = RadixCache()
    with pytest.raises((InvalidKeyError, InvalidArgumentError, LockError)):
        call(cache)
    cache.check_invariants()


@pytest.mark.parametrize("slots", [None, 3, "ab", [None], [1.0]])
def test_allocator_free_of_a_non_sequence_is_a_typed_error(slots) -> None:
    alloc = TokenToKVPoolAllocator(8)
    alloc.alloc(4)
    with pytest.raises(UnknownBlockError):
        alloc.free(slots)
    assert alloc.available_size() == 4  # nothing was freed


def test_allocator_takes_a_numpy_count_and_hands_out_plain_ints() -> None:
    slots = TokenToKVPoolAllocator(8, page_size=2).alloc(np.int64(3))
    assert slots == [0, 1, 2] and all(type(s) is int for s in slots)


def test_allocator_is_allocated_is_false_out_of_range() -> None:
    alloc = TokenToKVPoolAllocator(8)
    alloc.alloc(8)
    assert not alloc.is_allocated(100) and not alloc.is_allocated(-1)


def test_block_pool_rejects_another_pools_block_and_bad_counts() -> None:
    pool, other = BlockPool(4), BlockPool(4)
    (foreign,) = other.get_new_blocks(1)
    with pytest.raises(UnknownBlockError):
        pool.touch([foreign])
    with pytest.raises(UnknownBlockError):
        pool.free_blocks([foreign])
    for bad in (-1, 1.5):
        with pytest.raises(InvalidArgumentError):
            pool.get_new_blocks(bad)
    with pytest.raises(InvalidArgumentError):
        KVCacheManager(4, 2).allocate_slots("r", [1, 2, 3], 1.5)
    pool.check_invariants()


def test_loading_an_event_without_its_fields_is_an_error() -> None:
    with pytest.raises(InvalidArgumentError):
        event_from_dict({"kind": "insert", "time": 1})


def test_resets_are_published() -> None:
    bus = EventBus()
    rec = EventRecorder(bus)
    BlockPool(2, bus=bus).reset_prefix_cache()
    TokenToKVPoolAllocator(4, bus=bus).clear()
    resets = [e.source for e in rec.events if isinstance(e, ResetEvent)]
    assert resets == ["block_pool", "token_pool", "token_pool"]  # the 2nd: its constructor
