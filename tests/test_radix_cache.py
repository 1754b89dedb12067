"""Unit tests of the radix prefix cache (``minirad.kvcache.radix_cache``).

Scenarios follow SGLang's semantics (``python/sglang/srt/mem_cache/radix_cache.py`` and its
unit tests): split on match, ``lock_ref`` on the whole path, page alignment, cascading
eviction, the ``len - 1`` rule and the dedupe contract of ``cache_*_req``. Expected values come
from the scenario itself (slots we chose, counts we can add up by hand), never from the code
under test. ``check_invariants()`` runs after every mutation that matters.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from minirad import (
    InvalidArgumentError,
    InvalidKeyError,
    InvariantError,
    LockError,
    OutOfMemoryError,
    RadixCache,
    Req,
    TokenToKVPoolAllocator,
    UnknownBlockError,
)
from minirad.course.dot import radix_tree


def nodes(cache: RadixCache) -> list:
    """Every node except the root (walked here, not with the cache's own iterator)."""
    out, stack = [], list(cache.root_node.children.values())
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def snapshot(cache: RadixCache) -> tuple:
    """Observable state: structure, slots, locks and sizes."""
    shape = sorted(
        (tuple(n.key), tuple(n.value), n.lock_ref, n.parent.id if n.parent else None)
        for n in nodes(cache)
    )
    return shape, cache.evictable_size(), cache.protected_size()


# ---------------------------------------------------------------------- match / insert
def test_match_returns_deepest_node_and_locking_it_spares_only_that_path() -> None:
    cache = RadixCache()
    assert cache.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    assert cache.insert([1, 2, 5, 6], [10, 11, 14, 15]) == 2
    indices, last = cache.match_prefix([1, 2, 3, 4, 7])
    assert indices == [10, 11, 12, 13]
    assert last is not cache.root_node
    assert last.key == [3, 4]
    cache.inc_lock_ref(last)
    assert sorted(cache.evict(100)) == [14, 15]
    assert cache.match_prefix([1, 2, 3, 4]).indices == [10, 11, 12, 13]
    assert cache.match_prefix([1, 2, 5, 6]).indices == [10, 11]
    cache.check_invariants()


def test_match_ending_inside_an_edge_splits_it() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5, 6], [10, 20, 30, 40, 50, 60])
    indices, last = cache.match_prefix([1, 2, 3, 9])
    assert indices == [10, 20, 30]
    assert last.key == [1, 2, 3]
    assert [c.key for c in last.children.values()] == [[4, 5, 6]]
    cache.inc_lock_ref(last)
    assert cache.protected_size() == 3
    assert cache.evictable_size() == 3
    cache.check_invariants()


def test_page_size_2_matches_and_stores_whole_pages_only() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    assert cache.match_prefix([1, 2, 3, 9]).indices == [10, 11]
    before = len(nodes(cache))
    indices, last = cache.match_prefix([1])
    assert indices == [] and last is cache.root_node
    assert len(nodes(cache)) == before
    # Odd lengths are cut to whole pages; a key that differs inside its first page shares
    # nothing with [1, 2, ...].
    assert cache.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 50]) == 4
    assert cache.insert([1, 3, 3], [14, 15, 32]) == 0
    assert cache.insert([1, 2, 7, 8, 9], [10, 11, 16, 17, 90]) == 2
    assert all(len(n.key) % 2 == 0 and len(n.value) == len(n.key) for n in nodes(cache))
    assert cache.total_size() == 4 + 2 + 2  # [1,2,3,4], [1,3], [7,8]
    cache.check_invariants()
    # A page of tokens must sit in one whole KV page: evicting it frees that page.
    with pytest.raises(InvalidKeyError):
        cache.insert([5, 6], [21, 22])
    cache.check_invariants()


def test_lock_pins_leaf_and_every_ancestor_and_unlock_returns_to_zero() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 20, 30])
    cache.insert([1, 2, 4, 5], [10, 20, 40, 50])
    cache.insert([7], [70])
    leaf = cache.match_prefix([1, 2, 4, 5]).last_node
    path = []
    n = leaf
    while n is not cache.root_node:
        path.append(n)
        n = n.parent
    assert [p.key for p in path] == [[4, 5], [1, 2]]
    assert cache.inc_lock_ref(leaf) == -4
    assert cache.inc_lock_ref(leaf) == 0  # second lock: nothing newly protected
    assert [p.lock_ref for p in path] == [2, 2]
    assert (cache.protected_size(), cache.evictable_size()) == (4, 2)
    # Everything not on the path can go; the path cannot.
    assert sorted(cache.evict(100)) == [30, 70]
    cache.check_invariants()
    assert cache.dec_lock_ref(leaf) == 0
    assert cache.dec_lock_ref(leaf) == 4
    assert all(n.lock_ref == 0 for n in nodes(cache))
    assert (cache.protected_size(), cache.evictable_size()) == (0, 4)
    cache.check_invariants()


def test_two_locked_branches_pass_the_invariant_check() -> None:
    # Regression: the root's constant lock_ref (1) was compared with its children's sum.
    cache = RadixCache()
    cache.insert([1, 2])
    cache.insert([3, 4])
    a = cache.match_prefix([1, 2]).last_node
    b = cache.match_prefix([3, 4]).last_node
    cache.inc_lock_ref(a)
    cache.inc_lock_ref(b)
    cache.check_invariants()


def test_extra_key_namespaces_never_share_nodes() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 11, 12], extra_key="lora-a")
    assert cache.match_prefix([1, 2, 3]).indices == []
    assert cache.match_prefix([1, 2, 3], extra_key="lora-b").indices == []
    assert cache.insert([1, 2, 3], [20, 21, 22]) == 0
    assert cache.insert([1, 2, 3], [30, 31, 32], extra_key="lora-b") == 0
    assert cache.match_prefix([1, 2, 3], extra_key="lora-a").indices == [10, 11, 12]
    assert cache.match_prefix([1, 2, 3]).indices == [20, 21, 22]
    assert cache.match_prefix([1, 2, 3], extra_key="lora-b").indices == [30, 31, 32]
    assert len(cache.root_node.children) == 3
    assert all(len(n.key) == 3 for n in nodes(cache))
    cache.check_invariants()


def test_reinserting_a_cached_key_returns_its_length_and_keeps_the_old_slots() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    before = snapshot(cache)
    assert cache.insert([1, 2, 3], [20, 21, 22]) == 3
    assert snapshot(cache) == before
    assert cache.match_prefix([1, 2, 3]).indices == [10, 11, 12]
    cache.check_invariants()


def test_inserting_a_strict_prefix_of_an_edge_splits_without_a_new_leaf() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    assert cache.insert([1, 2], [20, 21]) == 2
    ns = nodes(cache)
    assert sorted(n.key for n in ns) == [[1, 2], [3, 4]]
    assert [n.key for n in ns if not n.children] == [[3, 4]]
    assert cache.total_size() == 4
    assert cache.match_prefix([1, 2]).indices == [10, 11]
    cache.check_invariants()


def test_split_keeps_the_id_on_the_prefix_and_a_request_holding_the_suffix_can_unlock() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4])
    held = cache.match_prefix([1, 2, 3, 4]).last_node
    old_id = held.id
    cache.inc_lock_ref(held)
    prefix = cache.match_prefix([1, 2, 9]).last_node
    assert prefix.id == old_id and prefix.key == [1, 2]
    assert held.key == [3, 4] and held.parent is prefix
    assert held.id not in {0, old_id}
    assert len({n.id for n in nodes(cache)}) == 2
    assert prefix.lock_ref == held.lock_ref == 1  # the split copied the lock
    cache.check_invariants()
    assert cache.dec_lock_ref(held) == 4
    assert prefix.lock_ref == held.lock_ref == 0
    cache.check_invariants()


def test_insert_without_slots_gives_fresh_simulated_slots() -> None:
    cache = RadixCache()
    assert cache.insert([5, 5, 5]) == 0  # a repeated token still gets distinct slots
    assert cache.insert([5, 5, 6, 6]) == 2
    slots = cache.all_values_flatten()
    assert len(slots) == len(set(slots)) == 5
    assert cache.match_prefix([5, 5, 5]).indices == cache.match_prefix([5, 5, 5]).indices
    cache.check_invariants()
    with pytest.raises(InvalidArgumentError):  # with an allocator the caller owns the slots
        RadixCache(token_to_kv_pool_allocator=TokenToKVPoolAllocator(8)).insert([1])


def test_reset_frees_every_slot_and_refuses_while_locked() -> None:
    alloc = TokenToKVPoolAllocator(8)
    cache = RadixCache(token_to_kv_pool_allocator=alloc)
    slots = alloc.alloc(5)
    cache.insert([1, 2, 3, 4, 5], slots)
    node = cache.match_prefix([1, 2]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(LockError):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert alloc.available_size() == 8
    assert cache.total_size() == 0 and cache.match_prefix([1, 2]).indices == []
    with pytest.raises(LockError):  # a node from before the reset is gone
        cache.inc_lock_ref(node)
    cache.check_invariants()


# ---------------------------------------------------------------------- eviction
def test_cascading_eviction_takes_a_parent_that_becomes_an_unlocked_leaf() -> None:
    cache = RadixCache()
    cache.insert([1, 2], [10, 20])
    cache.insert([1, 2, 3], [10, 20, 30])
    assert cache.evict(3) == [30, 10, 20]
    assert cache.root_node.children == {}
    assert cache.evictable_size() == 0
    cache.check_invariants()


def test_a_locked_child_keeps_its_parent() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 20, 30])
    cache.insert([1, 2, 4], [10, 20, 40])
    cache.inc_lock_ref(cache.match_prefix([1, 2, 4]).last_node)
    assert cache.evict(100) == [30]
    assert cache.total_size() == 3
    cache.check_invariants()


def test_eviction_frees_whole_nodes() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5], [10, 20, 30, 40, 50])
    assert cache.evict(1) == [10, 20, 30, 40, 50]
    assert cache.evict(0) == []
    assert cache.evict(1) == []  # nothing left: fewer than asked, no error
    cache.check_invariants()


@pytest.mark.parametrize(
    ("policy", "order"),
    [
        # Scenario below: A=[1], B=[2], C=[3] inserted in that order; B matched twice,
        # then C once, then A twice. Last access: B < C < A. Hits: C=1 < B=2 = A=2, tie
        # broken by last access (B before A). Creation: A < B < C.
        ("lru", [[20], [30], [10]]),
        ("lfu", [[30], [20], [10]]),
        ("fifo", [[10], [20], [30]]),
    ],
)
def test_eviction_policies_order_leaves_differently(policy: str, order: list) -> None:
    cache = RadixCache(eviction_policy=policy)
    for token in (1, 2, 3):
        cache.insert([token], [10 * token])
    for key in ([2], [2], [3], [1], [1]):
        cache.match_prefix(key)
    assert [cache.evict(1) for _ in range(3)] == order
    cache.check_invariants()


# ---------------------------------------------------------------------- request lifecycle
def start(cache: RadixCache, alloc: TokenToKVPoolAllocator, rid: str, prompt: list[int]) -> Req:
    """Schedule a request: match (and lock) its prefix, give its other prompt tokens fresh
    slots (prefill), and sample one output token, which has no KV yet."""
    req = Req(rid, list(prompt))
    cache.match_prefix_for_req(req)
    req.kv_indices += alloc.alloc(len(prompt) - len(req.kv_indices), owner=rid)
    req.output_ids.append(99)
    return req


def test_match_prefix_for_req_leaves_the_last_token_to_compute() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    cases = [([1, 2, 3, 4], [], 3), ([1, 2, 3, 4, 5], [], 4), ([1, 2], [3, 4], 3), ([1], [], 0)]
    for prompt, output, expected in cases:
        req = Req("r", prompt, output_ids=output)
        assert cache.match_prefix_for_req(req) == [10, 11, 12, 13][:expected]
        assert req.kv_indices == req.prefix_indices == [10, 11, 12, 13][:expected]
        assert req.cache_protected_len == expected
        assert cache.protected_size() == expected
        cache.dec_lock_ref(req.last_node)
    assert cache.match_prefix_for_req(Req("empty", [])) == []
    cache.check_invariants()


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_cache_finished_req_frees_duplicates_and_the_unaligned_tail(page_size: int) -> None:
    size = 32
    alloc = TokenToKVPoolAllocator(size, page_size)
    cache = RadixCache(page_size, token_to_kv_pool_allocator=alloc)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    aligned = len(prompt) // page_size * page_size
    # Two requests compute the same prompt concurrently (neither finds anything cached).
    a = start(cache, alloc, "a", prompt)
    b = start(cache, alloc, "b", prompt)
    a_slots, b_slots = list(a.kv_indices), list(b.kv_indices)
    pages = -(-len(prompt) // page_size)
    assert alloc.available_size() == size - 2 * pages * page_size

    cache.cache_finished_req(a)  # a's aligned part enters the tree; its tail page is freed
    assert alloc.available_size() == size - aligned - pages * page_size
    assert cache.match_prefix(prompt).indices == a_slots[:aligned]
    cache.check_invariants()

    cache.cache_finished_req(b)  # all of b's slots are duplicates or tail: all freed
    assert alloc.available_size() == size - aligned
    assert not any(alloc.is_allocated(s) for s in b_slots)
    assert all(alloc.is_allocated(s) for s in a_slots[:aligned])
    assert cache.match_prefix(prompt).indices == a_slots[:aligned]
    assert all(n.lock_ref == 0 for n in nodes(cache)) and cache.protected_size() == 0
    assert (a.last_node, a.kv_indices) == (None, [])
    cache.check_invariants()

    # A later request reuses the prefix (at most len - 1 tokens, whole pages).
    c = start(cache, alloc, "c", prompt + [8])
    assert c.prefix_indices == a_slots[:aligned]
    cache.cache_finished_req(c)
    assert alloc.available_size() == size - len(prompt + [8]) // page_size * page_size
    cache.check_invariants()


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_cache_unfinished_req_moves_the_lock_and_adopts_the_tree_slots(page_size: int) -> None:
    size = 32
    alloc = TokenToKVPoolAllocator(size, page_size)
    cache = RadixCache(page_size, token_to_kv_pool_allocator=alloc)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    aligned = len(prompt) // page_size * page_size
    pages = -(-len(prompt) // page_size)
    a = start(cache, alloc, "a", prompt)
    b = start(cache, alloc, "b", prompt)
    a_slots, b_slots = list(a.kv_indices), list(b.kv_indices)

    cache.cache_unfinished_req(a)
    assert a.kv_indices == a_slots  # nothing was cached before: a keeps its own slots
    assert a.cache_protected_len == aligned
    assert cache.protected_size() == aligned and cache.evictable_size() == 0
    assert alloc.available_size() == size - 2 * pages * page_size
    cache.check_invariants()

    cache.cache_unfinished_req(b)  # b's aligned part duplicates a's: freed, b adopts a's slots
    assert b.kv_indices == a_slots[:aligned] + b_slots[aligned:]
    assert not any(alloc.is_allocated(s) for s in b_slots[:aligned])
    assert all(alloc.is_allocated(s) for s in b_slots[aligned:])  # private tail kept
    assert alloc.available_size() == size - 2 * pages * page_size + aligned
    assert cache.protected_size() == aligned
    cache.check_invariants()

    cache.cache_finished_req(a)
    cache.cache_finished_req(b)
    assert all(n.lock_ref == 0 for n in nodes(cache))
    assert cache.protected_size() == 0 and cache.evictable_size() == aligned
    assert alloc.available_size() == size - aligned
    cache.check_invariants()


def test_cache_unfinished_req_after_decode_steps_extends_the_cached_prefix() -> None:
    alloc = TokenToKVPoolAllocator(16, 2)
    cache = RadixCache(2, token_to_kv_pool_allocator=alloc)
    req = start(cache, alloc, "r", [1, 2, 3])  # kv for 3 tokens; sampled 99 has none yet
    # Decode: feed 99 (its slot completes the private second page), sample 98.
    req.kv_indices.append(req.kv_indices[-1] + 1)
    req.output_ids.append(98)
    cache.cache_unfinished_req(req)
    assert cache.match_prefix([1, 2, 3, 99, 98]).indices == req.kv_indices[:4]
    assert req.cache_protected_len == 4 and cache.protected_size() == 4
    cache.cache_finished_req(req)
    assert cache.protected_size() == 0 and alloc.available_size() == 16 - 4
    cache.check_invariants()


def test_request_helpers_refuse_a_request_without_a_lock() -> None:
    cache = RadixCache()
    with pytest.raises(LockError):
        cache.cache_finished_req(Req("r", [1, 2]))
    req = Req("r", [1, 2])
    cache.match_prefix_for_req(req)
    req.kv_indices = [5, 6, 7]  # more slots than tokens
    with pytest.raises(InvalidKeyError):
        cache.cache_unfinished_req(req)
    cache.check_invariants()


def test_a_request_that_claims_a_tree_slot_as_its_own_changes_nothing() -> None:
    """Issue 11 point 13: finishing would free the claimed slot (in the partial last page,
    which is not cached): the allocator refuses it, before the tree changes."""
    alloc = TokenToKVPoolAllocator(8, page_size=2)
    cache = RadixCache(2, token_to_kv_pool_allocator=alloc)
    cache.insert([1, 2], alloc.alloc(2))
    req = Req("r", [7, 8, 9])
    cache.match_prefix_for_req(req)
    req.kv_indices = alloc.alloc(2) + [0]  # slot 0 is the tree's
    before = snapshot(cache), alloc.available_size()
    for finish in (cache.cache_finished_req, cache.cache_unfinished_req):
        with pytest.raises(InvalidKeyError):
            finish(req)
        assert (snapshot(cache), alloc.available_size()) == before
    cache.check_invariants()


# ---------------------------------------------------------------------- bad input
def _populated() -> tuple[RadixCache, TokenToKVPoolAllocator]:
    alloc = TokenToKVPoolAllocator(8)
    cache = RadixCache(token_to_kv_pool_allocator=alloc)
    cache.insert([1, 2, 3], alloc.alloc(3))
    cache.insert([1, 2, 4], [0, 1] + alloc.alloc(1))
    return cache, alloc


BAD_CALLS = {
    "unlock below zero": (LockError, lambda c, a: c.dec_lock_ref(c.match_prefix([1, 2, 3])[1])),
    "value length differs": (InvalidKeyError, lambda c, a: c.insert([5, 6], [7])),
    "negative token in insert": (InvalidKeyError, lambda c, a: c.insert([5, -1])),
    "negative token in match": (InvalidKeyError, lambda c, a: c.match_prefix([1, -2])),
    "float token": (InvalidKeyError, lambda c, a: c.insert([1, 2.5])),
    "string token": (InvalidKeyError, lambda c, a: c.match_prefix(["a"])),
    "None token": (InvalidKeyError, lambda c, a: c.insert([None])),
    "string key": (InvalidKeyError, lambda c, a: c.insert("abc")),
    "negative slot": (InvalidKeyError, lambda c, a: c.insert([5, 6], [7, -7])),
    "slot the tree owns": (InvalidKeyError, lambda c, a: c.insert([5, 6], [6, 0])),
    "slot twice in one value": (InvalidKeyError, lambda c, a: c.insert([5, 6], [6, 6])),
    "free an unknown slot": (UnknownBlockError, lambda c, a: a.free([7])),
    "free an out-of-range slot": (UnknownBlockError, lambda c, a: a.free([8])),
    "free a slot the tree owns": (InvalidKeyError, lambda c, a: a.free([2])),
    "free a tree slot with a free one": (InvalidKeyError, lambda c, a: a.free([3, 0])),
    "allocate past capacity": (OutOfMemoryError, lambda c, a: a.alloc(5)),
    "evict(-1)": (InvalidArgumentError, lambda c, a: c.evict(-1)),
    "evict a float": (InvalidArgumentError, lambda c, a: c.evict(1.5)),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_raises_a_typed_error_and_changes_nothing(name: str) -> None:
    error, call = BAD_CALLS[name]
    cache, alloc = _populated()
    before = snapshot(cache), alloc.available_size()
    with pytest.raises(error):
        call(cache, alloc)
    assert (snapshot(cache), alloc.available_size()) == before
    assert cache.match_prefix([1, 2, 3]).indices == [0, 1, 2]
    assert cache.match_prefix([1, 2, 4]).indices == [0, 1, 3]
    cache.check_invariants()


def test_insert_rejects_an_owned_slot_before_splitting() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    before = snapshot(cache)
    with pytest.raises(InvalidKeyError):
        cache.insert([1, 2, 9], [20, 21, 12])  # would split [1, 2, 3], then own 12 twice
    assert snapshot(cache) == before
    assert cache.match_prefix([1, 2, 3]).indices == [10, 11, 12]
    assert cache.match_prefix([1, 2, 9]).indices == [10, 11]
    assert cache.total_size() == 3 and cache.evictable_size() == 3
    cache.check_invariants()


def test_unknown_policy_and_bad_page_sizes_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError):
        RadixCache(eviction_policy="mru")
    with pytest.raises(InvalidArgumentError):
        RadixCache(page_size=0)
    with pytest.raises(InvalidArgumentError):
        RadixCache(page_size=2, token_to_kv_pool_allocator=TokenToKVPoolAllocator(8, 4))


def test_locking_an_evicted_node_raises() -> None:
    cache = RadixCache()
    cache.insert([1, 2], [10, 20])
    node = cache.match_prefix([1, 2]).last_node
    assert cache.evict(2) == [10, 20]
    with pytest.raises(LockError):
        cache.inc_lock_ref(node)
    with pytest.raises(LockError):
        cache.dec_lock_ref(node)
    assert (cache.evictable_size(), cache.protected_size()) == (0, 0)
    cache.check_invariants()


def test_a_failed_unlock_leaves_the_other_locks_alone() -> None:
    # dec_lock_ref checks the whole path before changing any count.
    cache = RadixCache()
    cache.insert([1, 2, 3, 4])
    top = cache.match_prefix([1, 2]).last_node
    leaf = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(top)
    with pytest.raises(LockError):
        cache.dec_lock_ref(leaf)
    assert (top.lock_ref, leaf.lock_ref) == (1, 0)
    assert cache.protected_size() == 2
    cache.check_invariants()


def test_check_invariants_detects_corruption() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3])
    cache.evictable_size_ += 1
    with pytest.raises(InvariantError):
        cache.check_invariants()
    cache.evictable_size_ -= 1
    cache.insert([1, 2, 4], priority=1)  # [1, 2] -> [3], [4]
    cache.check_invariants()
    for attr, bad in (("depth", 2), ("history_len", 99), ("priority", 2)):
        leaf = cache.root_node.children[1].children[4]
        good = getattr(leaf, attr)
        setattr(leaf, attr, bad)  # 2 tokens deep (should be 3), deeper than its parent, above it
        with pytest.raises(InvariantError):
            cache.check_invariants()
        setattr(leaf, attr, good)
    cache.check_invariants()


def test_format_tree_and_the_drawing_show_every_node() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3])
    cache.insert([1, 2, 4])
    cache.inc_lock_ref(cache.match_prefix([1, 2, 4]).last_node)
    text = cache.format_tree()
    assert text.splitlines()[0] == "root  #tokens=4"
    assert len(text.splitlines()) == 1 + 3
    assert "lock_ref=1 [1, 2]" in text
    dot = radix_tree(cache).source
    assert dot.count("->") == 3


def test_the_cache_imports_without_graphviz() -> None:
    """Drawing is not part of the cache: graphviz loads only when a tree is drawn."""
    code = (
        "import sys; from minirad.kvcache.radix_cache import RadixCache; c = RadixCache(); "
        "c.insert([1]); print('graphviz' in sys.modules); "
        "from minirad.course.dot import radix_tree; radix_tree(c); "
        "print('graphviz' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


# ---------------------------------------------------------------------- fast paths
BIG = 2**256 + 7  # a multimodal pad id: no 64-bit array holds it, so edges compare as lists


def test_keys_with_ids_of_64_bits_or_more_match_and_split_like_small_ones() -> None:
    cache = RadixCache()
    cache.insert([1, BIG, BIG, 4], [10, 11, 12, 13])
    assert cache.insert([1, 2, 3], [20, 21, 22]) == 1  # small ids after the shared token 1
    assert cache.match_prefix([1, BIG, BIG, 9]).indices == [10, 11, 12]
    assert cache.match_prefix([1, BIG, 5]).indices == [10, 11]  # splits [BIG, BIG, 4]
    assert cache.match_prefix([1, 2, 3, 4]).indices == [10, 21, 22]
    assert cache.match_prefix([BIG]).indices == []
    cache.check_invariants()


def test_a_mismatch_deep_inside_a_long_edge_is_found_exactly() -> None:
    cache = RadixCache()
    key = list(range(1000, 1700))
    cache.insert(key, list(range(700)))
    for cut in (1, 2, 63, 64, 65, 350, 699):
        probe = key[:cut] + [5] + key[cut + 1 :]
        assert len(cache.match_prefix(probe).indices) == cut
    cache.check_invariants()


def test_req_checks_tokens_appended_after_an_earlier_check() -> None:
    req = Req("r", [1, 2, 3])
    assert req.fill_ids == [1, 2, 3]
    req.output_ids.append(4)
    assert req.fill_ids == [1, 2, 3, 4]
    req.output_ids.append(-1)  # checked although the earlier ids were not checked again
    with pytest.raises(InvalidKeyError):
        _ = req.fill_ids
    req.output_ids = [5]
    req.origin_input_ids = [1, 2.5]  # a new list is checked again
    with pytest.raises(InvalidKeyError):
        _ = req.fill_ids
    req.origin_input_ids = [1, BIG]
    assert req.fill_ids == [1, BIG, 5]


def test_evicting_from_a_pool_cleared_under_the_cache_raises() -> None:
    alloc = TokenToKVPoolAllocator(8)
    cache = RadixCache(token_to_kv_pool_allocator=alloc)
    cache.insert([1, 2], alloc.alloc(2))
    alloc.clear()  # the documented misuse: the cache over it must be reset too
    with pytest.raises(UnknownBlockError):
        cache.evict(2)
    assert alloc.available_size() == 8


# ----------------------------------------------------------------- found by a new user (issue 12)
def test_closed_session_policy_takes_any_slot_and_a_late_close_is_not_lost():
    from minirad.kvcache.eviction import ClosedSessionLRUPolicy

    policy = ClosedSessionLRUPolicy()
    cache = RadixCache(1, policy)
    cache.insert([1, 2], [0, 1])
    cache.insert([3, 4, 5, 6, 7, 8], [2, 3, 4, 5, 1000, 10**6])  # slots of any size
    policy.close([10**6])  # after the leaf became evictable: it must still be evicted
    cache.check_invariants()
    assert sorted(cache.evict(8)) == [0, 1, 2, 3, 4, 5, 1000, 10**6]
    assert cache.evictable_size() == 0
    cache.check_invariants()
    for bad in ([-1], [1.5], None, 5, ["x"]):
        with pytest.raises(InvalidKeyError):
            policy.close(bad)


def test_closed_leaf_goes_first():
    from minirad.kvcache.eviction import ClosedSessionLRUPolicy

    policy = ClosedSessionLRUPolicy()
    cache = RadixCache(1, policy)
    cache.insert([1, 2], [0, 1])  # older: plain LRU would take it first
    policy.close([3])
    cache.insert([3, 4], [2, 3])
    assert cache.evict(1) == [2, 3]


def test_fill_ids_sees_every_change_after_a_check():
    alloc = TokenToKVPoolAllocator(32)
    cache = RadixCache(1, "lru", alloc)
    req = Req("r", [1, 2, 3])
    cache.match_prefix_for_req(req)
    req.output_ids = [4, 5]
    assert req.fill_ids == [1, 2, 3, 4, 5]
    req.output_ids.pop()
    req.output_ids.append(99)  # same list, same length, another token
    assert req.fill_ids == [1, 2, 3, 4, 99]
    req.output_ids[0] = -5  # an edit in place
    req.kv_indices += alloc.alloc(4)
    with pytest.raises(InvalidKeyError):
        cache.cache_finished_req(req)
    req.output_ids[0] = 4
    req.origin_input_ids[1] = 2.5
    with pytest.raises(InvalidKeyError):
        cache.cache_finished_req(req)
    cache.check_invariants()


@pytest.mark.parametrize("cap", [-1, -3, True, 1.5, "x"])
def test_bad_max_prefix_len_is_refused(cap):
    cache = RadixCache()
    cache.insert(list(range(1, 9)), list(range(8)))
    req = Req("r", list(range(1, 10)))
    with pytest.raises(InvalidArgumentError):
        cache.match_prefix_for_req(req, max_prefix_len=cap)
    assert req.last_node is None and cache.protected_size() == 0


def test_bytes_are_one_token_or_slot_per_byte():
    alloc = TokenToKVPoolAllocator(16)
    cache = RadixCache(1, "lru", alloc)
    slots = alloc.alloc(5)
    assert cache.insert(b"hello", bytes(slots)) == 0
    assert cache.match_prefix(bytearray(b"help")).indices == slots[:3]
    cache.check_invariants()
    alloc.free(bytes(alloc.alloc(1)))  # one slot, not an 8-byte word
    with pytest.raises(InvalidKeyError):
        alloc.free(bytes(slots[:1]))  # the tree's


def test_a_slot_of_64_bits_after_a_cached_prefix_is_refused():
    cache = RadixCache()
    cache.insert([1, 2], [0, 1])
    with pytest.raises(InvalidKeyError):
        cache.insert([1, 2, 3, 4], [0, 1, 5, 2**64])
    cache.check_invariants()
    assert cache.total_size() == 2


@pytest.mark.parametrize("size", [10**20, 10**12])
def test_a_pool_too_big_for_memory_is_a_typed_error(size):
    with pytest.raises(InvalidArgumentError):
        TokenToKVPoolAllocator(size)


def test_cached_prefix_len_reads_what_match_prefix_finds_without_changing_the_tree():
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], list(range(6)))
    before = [(n.key, n.last_access_time, n.hit_count) for n in cache.nodes()]
    assert cache.cached_prefix_len([1, 2, 3, 9]) == 2  # ends inside the edge: no split
    assert [(n.key, n.last_access_time, n.hit_count) for n in cache.nodes()] == before
    assert cache.cached_prefix_len([1, 2, 3, 9]) == len(cache.match_prefix([1, 2, 3, 9]).indices)


@pytest.mark.parametrize(
    "ids", [[], [0, 1, 2**64 - 1], [True, 3], [1, -1], [1, 2.0], [1, None], [2**64], [1, "a"]]
)
def test_u64_array_is_the_array_constructor(ids):
    from array import array

    from minirad.kvcache.tokens import u64_array

    try:
        want = array("Q", ids)
    except Exception as e:  # the same exception type for the same bad id
        with pytest.raises(type(e)):
            u64_array(ids)
    else:
        assert u64_array(ids) == want


def test_leaf_key_arrays_after_a_split():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    cache.insert([1, 2, 7], [20, 21, 22])  # splits the first leaf after two tokens
    assert sorted(n.key_buf.tolist() for n in cache.nodes()) == [[1, 2], [3, 4], [7]]
    cache.check_invariants()


# ------------------------------------------------- SGLang's slru, tlru and priority (issue 31)
def test_slru_keeps_a_prefix_two_requests_cached_where_lru_evicts_it() -> None:
    # P is cached by two requests, then Q, newer, by one. LRU evicts the older leaf, P; SLRU
    # protects P (insert_count 2 >= protected_threshold 2) and evicts the probationary Q first.
    results = {}
    for policy in ("lru", "slru"):
        cache = RadixCache(eviction_policy=policy)
        cache.insert([1, 2], [10, 11])
        cache.insert([1, 2], [10, 11])  # a second request caches the same prompt
        cache.insert([3, 4], [30, 31])
        assert [n.insert_count for n in nodes(cache)] in ([2, 1], [1, 2])
        results[policy] = cache.evict(1)
        cache.check_invariants()
    assert results == {"lru": [10, 11], "slru": [30, 31]}


def test_insert_count_counts_each_request_once_as_sglang_counts_hit_count() -> None:
    # SGLang counts a node when an insert walks or creates it, not when a match walks it, and
    # not again for the tokens the same request inserted before (chunked prefill).
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    (node,) = nodes(cache)
    cache.match_prefix([1, 2, 3, 4])
    assert (node.insert_count, node.hit_count) == (1, 1)
    cache.insert([1, 2, 9], [20, 21, 22])  # walks [1, 2] (a split: both parts keep 1), +1
    counts = {tuple(n.key): n.insert_count for n in nodes(cache)}
    assert counts == {(1, 2): 2, (3, 4): 1, (9,): 1}
    cache.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14], inserted_len=4)  # its own [1..4]
    counts = {tuple(n.key): n.insert_count for n in nodes(cache)}
    assert counts == {(1, 2): 2, (3, 4): 1, (9,): 1, (5,): 1}
    with pytest.raises(InvalidArgumentError):
        cache.insert([1], [10], inserted_len=-1)


def test_a_chunked_request_counts_once_and_a_second_request_twice_on_the_shared_part() -> None:
    alloc = TokenToKVPoolAllocator(32)
    cache = RadixCache(token_to_kv_pool_allocator=alloc)
    first = Req("first", [1, 2, 3, 4, 5, 6])
    cache.match_prefix_for_req(first)
    first.kv_indices += alloc.alloc(3)  # chunk 1: [1, 2, 3]
    cache.cache_unfinished_req(first)
    first.kv_indices += alloc.alloc(2)  # chunk 2: up to [.., 5]; 6 is the last token
    cache.cache_unfinished_req(first)
    first.output_ids.append(7)
    first.kv_indices += alloc.alloc(1)
    cache.cache_finished_req(first)  # caches [1..6]
    assert {n.insert_count for n in nodes(cache)} == {1}  # three inserts, one request
    assert len(nodes(cache)) == 3  # [1, 2, 3] [4, 5] [6]
    second = start(cache, alloc, "second", [1, 2, 3, 4, 8])  # shares [1..4]
    second.kv_indices += alloc.alloc(1)
    cache.cache_finished_req(second)
    counts = {tuple(n.key): n.insert_count for n in nodes(cache)}
    assert counts == {(1, 2, 3): 2, (4,): 2, (5,): 1, (6,): 1, (8, 99): 1}
    cache.check_invariants()


def test_priority_keeps_what_the_important_request_cached() -> None:
    evicted = {}
    for policy in ("lru", "priority"):
        alloc = TokenToKVPoolAllocator(32)
        cache = RadixCache(eviction_policy=policy, token_to_kv_pool_allocator=alloc)
        vip = Req("vip", [1, 2, 3, 4], priority=5)
        cache.match_prefix_for_req(vip)
        vip.kv_indices += alloc.alloc(4)
        vip_tail = tuple(vip.kv_indices[2:])
        cache.cache_finished_req(vip)
        low = Req("low", [1, 2, 7, 8])  # priority 0, later: shares [1, 2] with vip
        cache.match_prefix_for_req(low)
        low.kv_indices += alloc.alloc(2)
        low_tail = tuple(low.kv_indices[2:])
        cache.cache_finished_req(low)
        prios = {tuple(n.key): n.priority for n in nodes(cache)}
        assert prios == {(1, 2): 5, (3, 4): 5, (7, 8): 0}  # the shared prefix keeps the max
        cache.check_invariants()
        evicted[policy] = [tuple(cache.evict(1)) for _ in range(2)]
    # LRU takes vip's older tail [3, 4] first; priority takes low's newer [7, 8] (priority 0)
    assert evicted == {"lru": [vip_tail, low_tail], "priority": [low_tail, vip_tail]}


@pytest.mark.parametrize("bad", [True, 1.5, "1", None])
def test_a_priority_that_is_not_an_int_is_refused_before_anything_changes(bad) -> None:
    alloc = TokenToKVPoolAllocator(8)
    cache = RadixCache(token_to_kv_pool_allocator=alloc)
    with pytest.raises(InvalidArgumentError):
        cache.insert([1], alloc.alloc(1), priority=bad)
    req = Req("r", [1, 2], priority=bad)
    cache.match_prefix_for_req(req)
    req.kv_indices += alloc.alloc(2)
    with pytest.raises(InvalidArgumentError):
        cache.cache_finished_req(req)
    assert cache.total_size() == 0 and req.last_node is not None
    cache.check_invariants()


def test_tlru_trims_a_conversation_by_threshold_minus_estimate_then_falls_back_to_lru() -> None:
    from minirad.kvcache.eviction import get_policy

    threshold, estimate = 6, 2  # keep all but threshold - estimate = 4 tokens of a branch
    tlru = get_policy("tlru", threshold=threshold, next_prompt_estimate=estimate)
    order = {}
    for name, policy in (("lru", "lru"), ("tlru", tlru)):
        cache = RadixCache(eviction_policy=policy)
        old = list(range(100, 110))  # an older one-turn conversation, 10 tokens
        cache.insert(old, old)
        a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]  # three turns, 4 tokens each
        for turn in (a, a + b, a + b + c):
            cache.insert(turn, turn)
        order[name] = [cache.evict(1) for _ in range(4)]
        cache.check_invariants()
    # The rule, from the test's own numbers: a leaf is safe when the tokens above it are at
    # least L + estimate - threshold, L the longest its conversation has been.
    budget_new = max(12 + estimate - threshold, 0)  # 8
    budget_old = max(10 + estimate - threshold, 0)  # 6
    assert len(a + b) >= budget_new  # c is safe: evicting it keeps 8 of 12 cached
    assert len(a) < budget_new  # then b is not: L stays 12 once c is gone
    assert 0 < budget_old  # the old conversation is never safe (nothing above it)
    c_, b_, a_ = [9, 10, 11, 12], [5, 6, 7, 8], [1, 2, 3, 4]
    assert order["lru"] == [old, c_, b_, a_]  # the least recently used first
    assert order["tlru"] == [c_, old, b_, a_]  # the safe tail first, then LRU


def test_policy_parameters_are_sglangs_config_keys_and_are_checked() -> None:
    from minirad.kvcache.eviction import EVICTION_POLICIES, SLRUPolicy, TLRUPolicy, get_policy

    assert {"lru", "lfu", "fifo", "slru", "tlru", "priority"} <= set(EVICTION_POLICIES)
    assert get_policy("slru").protected_threshold == 2  # SGLang's default
    assert get_policy("slru", protected_threshold=4).protected_threshold == 4
    tlru = get_policy("tlru", threshold=4096, next_prompt_estimate=512)
    assert (tlru.threshold, tlru.next_prompt_estimate) == (4096, 512)
    assert isinstance(tlru, TLRUPolicy) and "4096" in repr(tlru)
    assert get_policy("tlru", threshold=7.5, next_prompt_estimate=0.5).threshold == 7.5
    policy = SLRUPolicy(3)
    assert get_policy(policy) is policy
    assert RadixCache(eviction_policy=policy).eviction_policy is policy
    bad = [
        ("slru", {"protected_threshold": 0}),
        ("slru", {"protected_threshold": 1.5}),
        ("slru", {"protected_threshold": True}),
        ("slru", {"threshold": 2}),  # tlru's key
        ("tlru", {"threshold": 8, "next_prompt_estimate": 8}),  # nothing ever safe: lru
        ("tlru", {"threshold": 4, "next_prompt_estimate": 8}),
        ("tlru", {"threshold": -1, "next_prompt_estimate": 0}),
        ("tlru", {"threshold": float("inf")}),
        ("tlru", {"threshold": float("nan")}),
        ("tlru", {"threshold": "64"}),
        ("tlru", {"protected_threshold": 2}),
        ("lru", {"threshold": 1}),
        (policy, {"protected_threshold": 2}),  # a policy object takes no parameters
    ]
    for name, params in bad:
        with pytest.raises(InvalidArgumentError):
            get_policy(name, **params)


@pytest.mark.parametrize("seed", range(4))
def test_policies_evict_single_leaves_in_the_order_of_their_rule(seed: int) -> None:
    """Leaves under the root only: each policy's rule, computed from the test's own record of
    what happened to each key, gives the eviction order."""
    import random

    from minirad.kvcache.eviction import EVICTION_POLICIES, get_policy

    threshold, estimate = 6, 2
    rng = random.Random(seed)
    keys = {k: [k] + [50 + k] * (k % 6) for k in range(1, 9)}  # 1 to 6 tokens, own first token
    ops = [
        (rng.choice(("insert", "match")), rng.randrange(1, 9), rng.randrange(-1, 3))
        for _ in range(40)
    ]
    tlru = {"threshold": threshold, "next_prompt_estimate": estimate}
    for name in EVICTION_POLICIES:
        cache = RadixCache(eviction_policy=get_policy(name, **(tlru if name == "tlru" else {})))
        rec: dict[int, dict] = {}  # key -> created, last, inserts, matches, priority
        for step, (op, k, prio) in enumerate(ops):
            if op == "insert":
                cache.insert(keys[k], [10 * k + i for i in range(len(keys[k]))], priority=prio)
                r = rec.setdefault(k, {"created": step, "inserts": 0, "matches": 0, "prio": prio})
                r["inserts"] += 1
                r["prio"] = max(r["prio"], prio)
                r["last"] = step
            elif k in rec:
                cache.match_prefix(keys[k])
                rec[k]["matches"] += 1
                rec[k]["last"] = step
        rule = {
            "lru": lambda k, r: (r["last"],),
            "lfu": lambda k, r: (r["matches"], r["last"]),
            "fifo": lambda k, r: (r["created"],),
            "slru": lambda k, r: (r["inserts"] >= 2, r["last"]),
            # one node per conversation: nothing above it, L its length: safe if L <= 4
            "tlru": lambda k, r: (len(keys[k]) + estimate - threshold > 0, r["last"]),
            "priority": lambda k, r: (r["prio"], r["last"]),
        }[name]
        expected = [10 * k for k in sorted(rec, key=lambda k: rule(k, rec[k]))]
        assert [cache.evict(1)[0] for _ in rec] == expected, name
        cache.check_invariants()


def test_our_keys_order_nodes_as_sglangs_strategies_do(sglang_python) -> None:
    """SGLang 0.5.23's own ``evict_policy.py`` (run in its venv) ranks the nodes of a tree
    that our cache built exactly as our policies do, given the node state they read."""
    import json
    import random
    import textwrap

    from minirad.kvcache.eviction import get_policy

    rng = random.Random(0)
    configs = {
        "lru": {},
        "lfu": {},
        "fifo": {},
        "slru": {"protected_threshold": 2},
        "tlru": {"threshold": 6, "next_prompt_estimate": 2},
        "priority": {},
    }
    cache = RadixCache()
    seen = [[1, 2, 3, 4, 5, 6]]
    for _ in range(60):
        base = rng.choice(seen)
        key = base[: rng.randrange(len(base) + 1)] + [rng.randrange(4) for _ in range(3)]
        seen.append(key)
        if rng.random() < 0.7:
            cache.insert(key, priority=rng.randrange(-1, 3))
        else:
            cache.match_prefix(key)
    all_nodes = nodes(cache)
    state = {
        name: [
            {
                # SGLang's names for what our nodes keep. Its hit_count is our insert_count,
                # except that our lfu reads hit_count, the matches (on purpose: radix_cache's
                # docstring): the rule is SGLang's, the count is not.
                "hit_count": n.hit_count if name == "lfu" else n.insert_count,
                "last_access_time": n.last_access_time,
                "creation_time": n.creation_time,
                "priority": n.priority,
                "_tlru_history_len": n.history_len,
                "_tlru_cached_prefix_len": n.depth,
                "key": n.key,
            }
            for n in all_nodes
        ]
        for name in configs
    }
    script = textwrap.dedent(
        """
        import importlib.util, json, sys, types
        # the file alone: importing the sglang package would take seconds
        root = importlib.util.find_spec("sglang").submodule_search_locations[0]
        path = root + "/srt/mem_cache/evict_policy.py"
        spec = importlib.util.spec_from_file_location("evict_policy", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        classes = {"lru": mod.LRUStrategy, "lfu": mod.LFUStrategy, "fifo": mod.FIFOStrategy,
                   "slru": mod.SLRUStrategy, "tlru": mod.TLRUStrategy,
                   "priority": mod.PriorityStrategy}
        configs, state = json.load(sys.stdin)
        out = {"slru default": mod.SLRUStrategy().protected_threshold}
        for name, config in configs.items():
            strategy = classes[name](**config)
            nodes = [types.SimpleNamespace(**s) for s in state[name]]
            out[name] = [strategy.get_priority(n) for n in nodes]
        json.dump(out, sys.stdout)
        """
    )
    done = subprocess.run(
        [str(sglang_python), "-c", script],
        input=json.dumps([configs, state]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    theirs = json.loads(done.stdout)
    assert get_policy("slru").protected_threshold == theirs["slru default"]
    for name, config in configs.items():
        ours = get_policy(name, **config).priority
        keys = theirs[name]
        # SGLang leaves ties to the heap; ours break them by id
        by_sglang = sorted(range(len(all_nodes)), key=lambda i: (keys[i], all_nodes[i].id))
        by_ours = sorted(range(len(all_nodes)), key=lambda i: ours(all_nodes[i]))
        assert by_ours == by_sglang, name
    # the rules bite on this tree: safe and unsafe leaves, both segments, several priorities
    assert {k[0] for k in theirs["tlru"]} == {-1, 0}
    assert {k[0] for k in theirs["slru"]} == {0, 1}
    assert len({k[0] for k in theirs["priority"]}) > 2
