"""The hybrid (Full, SWA) radix cache, rule by rule (SGLang 0.5.23's ``UnifiedRadixCache`` with
an SWA component): the validator, the window lock, tombstones, cascade eviction, recovery,
out-of-window frees and the branching insert. ``check_invariants`` runs after each step."""

from __future__ import annotations

import pytest

from minirad.errors import (
    InvalidArgumentError,
    InvalidKeyError,
    LockError,
    OutOfMemoryError,
    RequestError,
)
from minirad.kvcache.swa_radix_cache import ComponentType, SWARadixCache
from minirad.kvcache.swa_window import (
    hf_to_sglang_window,
    make_swa_validator,
    window_lock_count,
    window_lock_mask,
)

FULL, SWA = ComponentType.FULL, ComponentType.SWA
SYS = list(range(100, 120))  # a 20-token system prompt


def run(cache, rid, prompt, decode=0, free_window=True, finish=True):
    req = cache.start_req(rid, prompt)
    cache.check_invariants()
    for t in range(decode):
        cache.decode(req, 1000 + t)
        if free_window:
            cache.free_out_of_window_slots(req)
        cache.check_invariants()
    if finish:
        cache.cache_finished_req(req)
        cache.check_invariants()
    return req


def test_hf_window_is_one_more_than_sglangs():
    assert hf_to_sglang_window(32) == 31
    with pytest.raises(InvalidArgumentError):
        hf_to_sglang_window(1)


def test_validator_starts_at_infinity_and_resets_at_a_tombstone():
    v = make_swa_validator(8)
    assert v(3, True)  # nothing dropped before: a short live prefix is a valid hit
    assert not v(30, False)  # a tombstone: no window
    assert not v(5, True)  # 5 < 8 tokens of live SWA since the tombstone
    assert v(3, True)  # 8: the window is full


@pytest.mark.parametrize(
    ("up", "window", "taken"),
    [([7, 9, 24], 8, 2), ([7, 9, 24], 7, 1), ([7, 9, 24], 16, 2), ([7, 9, 24], 17, 3)],
)
def test_window_lock_takes_whole_nodes_until_the_window_is_covered(up, window, taken):
    assert window_lock_count(up, window) == taken
    assert window_lock_mask(up[::-1], window) == [i >= 3 - taken for i in range(3)]


def test_decode_past_the_window_leaves_a_tombstone_and_a_live_tail():
    c = SWARadixCache(200, sliding_window_size=4)
    req = run(c, "a", SYS + [1, 2, 3], decode=10)
    assert req.evicted_seqlen == 33 - 1 - 4  # the last query (position 32) reads 28..32
    assert c.tombstones() == [(0, 28)]
    assert c.evictable_size(SWA) == 5 and c.evictable_size(FULL) == 33
    # The same sequence again: a full hit, the window before its end is live.
    again = c.start_req("b", SYS + [1, 2, 3] + [1000 + t for t in range(10)] + [7])
    assert again.cache_protected_len == 33 and again.swa_branching_seqlen is None
    # Only the system prompt: its end is inside the tombstone -> no hit, but full KV there.
    short = c.start_req("c", SYS + [9])
    assert short.cache_protected_len == 0 and short.swa_branching_seqlen == 20
    c.check_invariants()


def test_branching_insert_recovers_the_tombstone_inside_the_window():
    c = SWARadixCache(200, sliding_window_size=4)
    run(c, "a", SYS + [1, 2, 3], decode=10)
    req = c.start_req("c", SYS + [9])
    c.cache_unfinished_req(req)  # inserts up to the branching point, 20
    c.check_invariants()
    assert c.tombstones() == [(0, 15), (20, 28)]  # 15..20 recovered with c's SWA slots
    c.cache_finished_req(req)
    nxt = c.start_req("d", SYS + [5])
    assert nxt.cache_protected_len == 20  # the next branch finds a window at the junction
    c.check_invariants()


def test_window_lock_lets_swa_evict_the_old_part_of_a_running_path():
    c = SWARadixCache(200, sliding_window_size=4)
    run(c, "a", SYS + [1, 2, 3, 4, 5])  # 25 tokens: leaf capped at one window: 21 + 4
    assert [len(n.key) for n in c.nodes()] == [21, 4]
    req = c.start_req("b", SYS + [1, 2, 3, 4, 5, 6])
    assert req.cache_protected_len == 25
    old = next(n for n in c.nodes() if len(n.key) == 21)
    assert old.full.lock_ref == 1 and old.swa.lock_ref == 0  # outside b's window
    assert c.evict(0, 100) == (0, 21)  # SWA tombstones it: b's window stays
    assert old.swa.value is None and c.protected_size(SWA) == 4
    assert c.evict(100, 0) == (0, 0)  # Full: everything is locked by b
    c.check_invariants()
    c.cache_finished_req(req)
    assert c.evict(100, 0) == (26, 5)  # leaves go whole, full and SWA (the cascade)
    c.check_invariants()


def test_swa_eviction_deletes_an_evictable_leaf_and_full_eviction_takes_the_lru_leaf():
    c = SWARadixCache(100, sliding_window_size=8)
    run(c, "a", [1] * 5)
    run(c, "b", [2] * 5)
    assert c.evict(0, 3) == (5, 5)  # a's leaf (LRU) deleted whole
    assert [n.key[0] for n in c.nodes()] == [2]
    c.check_invariants()


def test_small_pools_evict_to_admit_and_refuse_what_cannot_fit():
    c = SWARadixCache(20, sliding_window_size=4, swa_full_tokens_ratio=0.5)
    assert c.pools.available() == (20, 10)
    run(c, "a", list(range(8)))
    run(c, "b", list(range(50, 58)))  # SWA pool (10) short: a's LRU node, then its leaf
    # a's older node is a tombstone leaf now: SGLang keeps it, its full KV is still there.
    assert c.tombstones() == [(0, 4)] and c.pools.available() == (8, 2)
    with pytest.raises(OutOfMemoryError):
        c.start_req("c", list(range(200, 212)))
    c.check_invariants()


def test_insert_frees_the_duplicate_prefix_slots_itself():
    c = SWARadixCache(100, sliding_window_size=4)
    a = c.start_req("a", [1, 2, 3, 4, 5, 6])
    b = c.start_req("b", [1, 2, 3, 4, 5, 6])  # both miss: each its own slots
    c.cache_finished_req(a)
    c.cache_finished_req(b)  # b's 6 slots are duplicates: freed by the insert
    assert c.pools.available() == (94, 74)
    c.check_invariants()


def test_misuse_raises_typed_errors():
    c = SWARadixCache(100, sliding_window_size=4)
    req = run(c, "a", [1, 2, 3])
    with pytest.raises(RequestError):
        c.decode(req, 5)
    with pytest.raises(LockError):
        c.dec_lock_ref(next(iter(c.nodes())), None)
    with pytest.raises(InvalidKeyError):
        c.match_prefix([1, -2])
    with pytest.raises(InvalidArgumentError):
        c.insert([1, 2], [7])
    with pytest.raises(InvalidArgumentError):
        SWARadixCache(100, sliding_window_size=0)
    with pytest.raises(InvalidArgumentError):
        SWARadixCache(100, 4, swa_full_tokens_ratio=1.5)
