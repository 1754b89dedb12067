"""The hierarchical radix cache (device + host tiers): one test per rule, a hypothesis state
machine that checks the invariants and the KV itself after every step, and planted bugs that
the machine must catch.

The KV is modelled, not computed: every slot (device or host) holds the token prefix whose
last token's KV it stores. Inserting writes the request's slots; the cache's copies go through
:class:`DataTransfer`, which moves those labels. Whatever the tiers do, a matched slot must hold
the KV of the matched prefix.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from minirad.errors import InvalidArgumentError, InvariantError, LockError, OutOfMemoryError
from minirad.events import BackupEvent
from minirad.kv_events import BlockRemoved, BlockStored
from minirad.kv_events.block_events import RadixBlockEvents, block_hash_u64
from minirad.kv_events.event_tree import EventTree
from minirad.kvcache.block_pool import hash_block_tokens, none_hash
from minirad.kvcache.hicache_storage import HiCacheMemoryStorage
from minirad.kvcache.hiradix_cache import HiRadixCache, HiTreeNode
from minirad.kvcache.host_pool import RecordingTransfer, make_host_pool
from minirad.kvcache.kv_pool import PAGE_CACHED, TokenToKVPoolAllocator
from minirad.kvcache.radix_cache import Req


def make(size=32, page_size=1, **kw) -> tuple[HiRadixCache, TokenToKVPoolAllocator]:
    alloc = TokenToKVPoolAllocator(size, page_size)
    kw.setdefault("transfer", RecordingTransfer())
    return HiRadixCache(page_size, token_to_kv_pool_allocator=alloc, **kw), alloc


def put(cache: HiRadixCache, alloc: TokenToKVPoolAllocator, key: list[int]) -> list[int]:
    """Insert ``key`` as a finished request would: fresh slots, duplicates freed."""
    value = alloc.alloc(len(key))
    prefix_len = cache.insert(key, value)
    alloc.free(value[:prefix_len])
    cache.check_invariants()
    return value


A = list(range(100, 112))  # 12 tokens
B = A[:6] + list(range(200, 206))  # shares 6 with A


# ---------------------------------------------------------------------- host pool
def test_host_pool_is_hicache_ratio_times_the_device_pool():
    dev = TokenToKVPoolAllocator(16, 4)
    assert make_host_pool(dev).size == 32
    assert make_host_pool(dev, 1.5).size == 24
    assert make_host_pool(dev, 0.01).size == 4  # at least one page
    for bad in (0, -1, float("nan"), True, "2"):
        with pytest.raises(InvalidArgumentError):
            make_host_pool(dev, bad)
    cache, _ = make(16, 4)
    assert cache.host_pool.size == 32 and cache.host_pool.page_size == 4


def test_needs_an_allocator_and_a_known_policy():
    with pytest.raises(InvalidArgumentError):
        HiRadixCache()
    with pytest.raises(InvalidArgumentError):
        make(write_policy="write_around")
    with pytest.raises(InvalidArgumentError):
        make(load_back_threshold=-1)


# ---------------------------------------------------------------------- write policies
def test_write_through_backs_up_on_insert():
    cache, alloc = make()
    value = put(cache, alloc, A)
    node = cache.match_prefix(A).last_node
    assert node.backuped and len(node.host_value) == len(A)
    assert cache.transfer.log == [("write_backup", tuple(value), tuple(node.host_value))]
    put(cache, alloc, B)  # splits A's node: the backup splits with it
    shared = cache.match_prefix(B).last_node.parent
    assert shared.key == A[:6] and shared.host_value == node.parent.host_value
    assert len(cache.transfer.log) == 2 and len(cache.transfer.log[1][1]) == 6


def test_write_through_selective_backs_up_at_the_threshold():
    """SGLang's rule: a node's hits are counted in inserts (requests that cache it), not in
    matches; the second insert over a node backs it up."""
    cache, alloc = make(write_policy="write_through_selective", write_through_threshold=2)
    put(cache, alloc, A)
    cache.match_prefix(A)
    cache.match_prefix(A)
    assert not cache.match_prefix(A).last_node.backuped  # matches do not count
    put(cache, alloc, B)  # the second insert over A's first 6 tokens
    leaf = cache.match_prefix(B).last_node
    assert not leaf.backuped and leaf.parent.backuped and cache.host_size() == 6
    put(cache, alloc, B)
    assert leaf.backuped and cache.host_size() == 12
    put(cache, alloc, A)
    assert cache.host_size() == len(A) + 6


def test_write_back_backs_up_on_eviction_only():
    cache, alloc = make(write_policy="write_back")
    put(cache, alloc, A)
    assert cache.transfer.log == [] and cache.host_size() == 0
    assert len(cache.evict(1)) == len(A)
    res = cache.match_prefix(A)
    assert res.indices == [] and res.host_hit_length == len(A)
    assert [op for op, *_ in cache.transfer.log] == ["write_backup"]


def test_write_back_backs_up_the_whole_path_to_keep_backups_a_prefix():
    cache, alloc = make(write_policy="write_back")
    put(cache, alloc, A)
    put(cache, alloc, B)
    cache.inc_lock_ref(cache.match_prefix(A).last_node)  # A stays; B's tail is the leaf
    cache.evict(1)
    cache.check_invariants()
    tail = cache.match_prefix(B).last_host_node
    assert tail.evicted and tail.parent.backuped and not tail.parent.evicted


# ---------------------------------------------------------------------- demotion
def test_device_eviction_demotes_a_backed_up_node():
    cache, alloc = make()
    value = put(cache, alloc, A)
    node = cache.match_prefix(A).last_node
    host = node.host_value
    assert cache.evict(1) == value
    assert node.evicted and node.host_value == host and node.parent is cache.root_node
    assert alloc.available_size() == alloc.size and cache.evictable_size() == 0
    cache.check_invariants()


def test_device_eviction_deletes_a_node_never_backed_up():
    cache, alloc = make(write_policy="write_through_selective")
    put(cache, alloc, A)
    cache.evict(1)
    assert cache.match_prefix(A).host_hit_length == 0 and not cache.root_node.children


def test_a_parent_with_host_only_children_is_evicted_next():
    cache, alloc = make()
    put(cache, alloc, A)
    put(cache, alloc, B)
    assert len(cache.evict(len(A) + 6)) == len(A) + 6  # both leaves, then the shared node
    assert all(n.evicted for n in cache.nodes())
    cache.check_invariants()


def test_locks_protect_both_tiers():
    cache, alloc = make()
    put(cache, alloc, A)
    node = cache.match_prefix(A).last_node
    cache.inc_lock_ref(node)
    assert cache.evict(100) == [] and cache.evict_host(100) == 0
    assert node.value and node.host_value
    cache.dec_lock_ref(node)
    cache.evict(100)
    with pytest.raises(LockError):  # host-only: load it back first
        cache.inc_lock_ref(node)


# ---------------------------------------------------------------------- host eviction
def test_evict_host_deletes_host_only_leaves_lru():
    cache, alloc = make()
    put(cache, alloc, A)
    put(cache, alloc, B)
    cache.match_prefix(A)  # A's tail is used more recently than B's
    assert cache.evict_host(1) == 0  # nothing host-only yet
    cache.evict(100)
    assert cache.evict_host(1) == 6
    assert cache.match_prefix(B).host_hit_length == 6  # the shared part
    assert cache.match_prefix(A).host_hit_length == 12
    cache.check_invariants()
    assert cache.evict_host(100) == 12  # A's tail, then the shared node
    assert not cache.root_node.children and cache.host_pool.available_size() == 64


def test_a_full_host_pool_evicts_host_leaves_for_new_backups():
    cache, alloc = make(16, hicache_ratio=1)  # 16 host slots
    put(cache, alloc, A)
    cache.evict(100)
    put(cache, alloc, B[6:] + [7, 7])  # 8 new tokens: A's 12 host slots must go
    assert cache.match_prefix(A).host_hit_length == 0
    cache.check_invariants()


def test_without_host_room_a_node_stays_unbacked():
    cache, alloc = make(16, hicache_ratio=0.5)  # 8 host slots
    put(cache, alloc, A)
    node = cache.match_prefix(A).last_node
    assert not node.backuped  # 12 tokens do not fit
    cache.evict(100)
    assert not cache.root_node.children


# ---------------------------------------------------------------------- match + load back
def test_match_reports_device_and_host_lengths():
    cache, alloc = make()
    value = put(cache, alloc, A)
    put(cache, alloc, B)
    tail = cache.match_prefix(B).last_node
    cache.inc_lock_ref(cache.match_prefix(A).last_node)
    cache.evict(1)  # demotes B's tail only
    res = cache.match_prefix(B + [1])
    assert res.indices == value[:6] and res.host_hit_length == 6
    assert res.last_node.key == A[:6] and res.last_host_node is tail
    assert cache.cached_prefix_len(B) == 6
    res = cache.match_prefix(B[:9])  # ends inside the host-only edge: it splits
    assert res.host_hit_length == 3 and res.last_host_node.evicted
    assert len(res.last_host_node.host_value) == 3
    cache.check_invariants()


def test_load_back_brings_host_segments_to_the_device():
    cache, alloc = make()
    put(cache, alloc, A)
    put(cache, alloc, B)
    cache.evict(100)
    res = cache.match_prefix(B)
    assert res.indices == [] and res.host_hit_length == 12
    host = [s for n in (res.last_host_node.parent, res.last_host_node) for s in n.host_value]
    device = cache.load_back(res.last_host_node)
    assert len(device) == 12 and cache.transfer.log[-1] == ("load_back", tuple(host), tuple(device))
    again = cache.match_prefix(B)
    assert again.indices == device and again.host_hit_length == 0
    assert cache.match_prefix(A).host_hit_length == 6  # A's tail is still host-only
    assert cache.load_back(again.last_node) == []  # nothing to load
    cache.check_invariants()


def test_load_back_threshold():
    cache, alloc = make(load_back_threshold=10)
    put(cache, alloc, A)
    put(cache, alloc, B)
    cache.inc_lock_ref(cache.match_prefix(A).last_node)
    cache.evict(1)
    res = cache.match_prefix(B)
    assert res.host_hit_length == 6
    assert cache.load_back(res.last_host_node) is None  # 6 < 10: recompute instead
    assert res.last_host_node.evicted
    cache.load_back_threshold = 6
    assert len(cache.load_back(res.last_host_node)) == 6
    cache.check_invariants()


def test_load_back_evicts_the_device_to_make_room_but_not_its_own_path():
    cache, alloc = make(16, load_back_threshold=1)
    put(cache, alloc, A)
    cache.evict(100)
    put(cache, alloc, B[6:] + [1, 2])  # 8 device slots used, 8 free: A needs 12
    res = cache.match_prefix(A)
    device = cache.load_back(res.last_host_node)
    assert len(device) == 12 and cache.match_prefix(A).indices == device
    cache.check_invariants()
    cache.inc_lock_ref(cache.match_prefix(A).last_node)
    other = B[6:] + [1, 2]
    res = cache.match_prefix(other)
    assert cache.load_back(res.last_host_node) is None  # A is locked: no room
    cache.check_invariants()


def test_insert_over_host_only_nodes_revives_them():
    cache, alloc = make()
    put(cache, alloc, A)
    node = cache.match_prefix(A).last_node
    host = node.host_value
    cache.evict(100)
    value = alloc.alloc(len(A) + 2)
    assert cache.insert(A + [1, 2], value) == 0  # nothing was on the device: no duplicates
    assert node.value == value[:12] and node.host_value == host
    assert cache.match_prefix(A + [1, 2]).indices == value
    assert alloc.page_state[value[0]] == PAGE_CACHED
    cache.check_invariants()


def test_reset_frees_both_pools():
    cache, alloc = make()
    put(cache, alloc, A)
    put(cache, alloc, B)
    cache.evict(3)
    cache.reset()
    assert alloc.available_size() == alloc.size
    assert cache.host_pool.available_size() == cache.host_pool.size
    cache.check_invariants()


def test_request_lifecycle_loads_back_and_locks_the_prefix():
    """match_prefix_for_req loads the host-only prefix back (over the threshold) and locks it;
    below the threshold the request recomputes it."""
    cache, alloc = make()
    put(cache, alloc, A)
    cache.evict(100)
    req = Req("r", A + [1])
    prefix = cache.match_prefix_for_req(req)
    assert len(prefix) == 12 and (req.host_hit_length, req.storage_hit_length) == (12, 0)
    assert req.last_node.lock_ref == 1 and not req.last_node.evicted
    req.kv_indices = prefix + alloc.alloc(1)
    cache.cache_finished_req(req)
    assert cache.match_prefix(A).indices == prefix and alloc.available_size() == alloc.size - 13
    cache.check_invariants()
    cache.evict(100)
    short = Req("s", A[:5] + [1])  # 5 host-only tokens < load_back_threshold 10
    assert cache.match_prefix_for_req(short) == [] and short.host_hit_length == 0
    cache.cache_finished_req(short, is_insert=False)
    cache.check_invariants()


def test_the_disk_tier_refills_the_host_after_host_eviction():
    storage = HiCacheMemoryStorage()
    cache, alloc = make(storage=storage, storage_page_size=4, load_back_threshold=1)
    put(cache, alloc, A)  # 12 tokens: 3 pages of 4 on disk
    assert len(storage) == 3 and all(n.on_disk for n in cache.nodes())
    cache.evict(100)
    cache.evict_host(100)
    assert cache.total_size() == 0 and cache.host_size() == 0
    res = cache.match_prefix(A + [1])
    assert res.storage_hit_length == 12 and res.host_hit_length == 0
    req = Req("r", A + [1])
    assert len(cache.match_prefix_for_req(req)) == 12
    assert (req.host_hit_length, req.storage_hit_length) == (0, 12)
    cache.cache_finished_req(req, is_insert=False)
    cache.check_invariants()
    # Another namespace (another model) finds nothing on the same storage.
    other, _ = make(storage=storage, storage_page_size=4, storage_namespace="other-model")
    assert other.match_prefix(A).storage_hit_length == 0


# ---------------------------------------------------------------------- the state machine
class DataTransfer:
    """Copies the modelled KV (a label per slot) between the pools."""

    def __init__(self, device: dict, host: dict) -> None:
        self.device, self.host = device, host

    def write_backup(self, device_slots, host_slots) -> None:
        for d, h in zip(device_slots, host_slots, strict=True):
            self.host[h] = self.device[d]

    def load_back(self, host_slots, device_slots) -> None:
        for h, d in zip(host_slots, device_slots, strict=True):
            self.device[d] = self.host[h]

    # A storage page holds the labels as indices into a registry (pages hold tensors).
    labels: list[tuple] = []

    def read_host(self, host_slots) -> dict:
        ids = []
        for h in host_slots:
            self.labels.append(self.host[h])
            ids.append(len(self.labels) - 1)
        return {"labels": torch.tensor(ids)}

    def accepts(self, page, num_tokens) -> bool:
        return set(page) == {"labels"} and len(page["labels"]) == num_tokens

    def write_host(self, host_slots, pages, offset) -> None:
        ids = torch.cat([p["labels"] for p in pages])[offset:].tolist()
        for h, i in zip(host_slots, ids, strict=False):
            self.host[h] = self.labels[i]


keys = st.lists(st.integers(0, 2), min_size=1, max_size=8)


class HiRadixMachine(RuleBasedStateMachine):
    cache_cls = HiRadixCache
    page_size = 1
    write_policy = "write_through"
    storage = False  # a disk tier (in memory) behind the host

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.alloc = TokenToKVPoolAllocator(12 * ps, ps)
        self.device_kv: dict[int, tuple] = {}
        self.host_kv: dict[int, tuple] = {}
        self.cache = self.cache_cls(
            ps,
            token_to_kv_pool_allocator=self.alloc,
            hicache_ratio=1.5,
            write_policy=self.write_policy,
            load_back_threshold=2 * ps,
            transfer=DataTransfer(self.device_kv, self.host_kv),
            storage=HiCacheMemoryStorage() if self.storage else None,
            storage_page_size=2 * ps,
        )
        self.locks: list[HiTreeNode] = []
        # What a viewer and a router see: the tree and vLLM's block events, from events only.
        self.mirror = EventTree()
        self.cache.bus.subscribe(self.mirror.apply)
        self.blocks = RadixBlockEvents(self.cache.bus, block_size=2 * ps, medium="GPU")
        self.live: set[tuple[int, str]] = set()  # (block hash, medium) the events hold

    def aligned(self, key):
        return key[: len(key) - len(key) % self.page_size]

    @rule(key=keys)
    def insert(self, key):
        key = self.aligned(key)
        if not key:
            return
        try:
            value = self.alloc.alloc(len(key))
        except OutOfMemoryError:
            self.cache.evict(len(key) - self.alloc.available_size())
            if self.alloc.available_size() < len(key):
                return
            value = self.alloc.alloc(len(key))
        for j, slot in enumerate(value):  # the "model" computes the KV of each prefix
            self.device_kv[slot] = tuple(key[: j + 1])
        prefix_len = self.cache.insert(key, value)
        self.alloc.free(value[:prefix_len])

    @rule(key=keys, load=st.booleans())
    def request(self, key, load):
        """A whole request: match (and maybe load back) its prefix, compute the rest, cache it."""
        if load:
            self.cache.load_back(self.cache.match_prefix(key[:-1]).last_host_node)
        req = Req(f"r{len(self.device_kv)}", key)
        prefix = self.cache.match_prefix_for_req(req)
        self.check_kv(key, prefix, self.device_kv)
        need = len(key) - len(prefix)
        if self.alloc.available_size() < need:
            self.cache.evict(need - self.alloc.available_size())
        if self.alloc.available_size() < need:
            self.cache.cache_finished_req(req, is_insert=False)
            return
        new = self.alloc.alloc(need)
        for j, slot in enumerate(new, start=len(prefix)):
            self.device_kv[slot] = tuple(key[: j + 1])
        req.kv_indices = prefix + new
        self.cache.cache_finished_req(req)

    @rule(key=keys)
    def match(self, key):
        res = self.cache.match_prefix(key)
        assert res.host_hit_length == res.last_host_node.depth - res.last_node.depth
        assert len(res.indices) == res.last_node.depth
        self.check_kv(key, res.indices, self.device_kv)

    @rule(key=keys)
    def lock(self, key):
        node = self.cache.match_prefix(key).last_node
        if node is not self.cache.root_node:
            self.cache.inc_lock_ref(node)
            self.locks.append(node)

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        self.cache.dec_lock_ref(self.locks.pop(i % len(self.locks)))

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        self.cache.evict(n)

    @rule(n=st.integers(0, 12))
    def evict_host(self, n):
        self.cache.evict_host(n)

    @rule(key=keys)
    def load_back(self, key):
        res = self.cache.match_prefix(key)
        device = self.cache.load_back(res.last_host_node)
        if device is None:
            assert res.host_hit_length < 2 * self.page_size or self.alloc.available_size() < (
                res.host_hit_length
            )
            return
        assert len(device) == res.host_hit_length
        again = self.cache.match_prefix(key)
        assert again.indices == res.indices + device
        self.check_kv(key, again.indices, self.device_kv)

    def check_kv(self, key, slots, kv) -> None:
        for j, slot in enumerate(slots):
            assert kv[slot] == tuple(key[: j + 1]), f"slot {slot} holds the wrong KV"

    @invariant()
    def invariants_hold(self):
        self.cache.check_invariants()

    @invariant()
    def every_slot_holds_its_prefix_kv(self):
        for node in self.cache.nodes():
            path, n = [], node
            while n is not self.cache.root_node:
                path[:0] = n.key
                n = n.parent
            start = len(path) - len(node.key)
            for slots, kv in ((node.value, self.device_kv), (node.host_value or [], self.host_kv)):
                for j, slot in enumerate(slots):
                    assert kv[slot] == tuple(path[: start + j + 1]), f"slot {slot}: wrong KV"

    @invariant()
    def the_events_tell_the_tiers(self):
        """An EventTree fed the events holds each node's key and both tiers' slots; the
        block events hold each whole block once per tier it is in (GPU device, CPU host)."""
        self.mirror.release()
        nodes = {n.id: n for n in self.cache.nodes()}
        assert set(self.mirror.nodes) == set(nodes) | {0}
        expected = set()
        for i, n in nodes.items():
            m = self.mirror.nodes[i]
            assert (m.key, m.value) == (tuple(n.key), tuple(n.value)), f"node {i}"
            assert m.host_value == (None if n.host_value is None else tuple(n.host_value))
            path, p = [], n
            while p is not self.cache.root_node:
                path[:0] = p.key
                p = p.parent
            digest = none_hash(0)
            b = 2 * self.page_size  # the block size of the events, and of a storage page
            for j in range(len(path) // b):
                digest = hash_block_tokens(digest, path[b * j : b * j + b], None)
                if b * j + b > len(path) - len(n.key):  # the block ends inside this node
                    h = block_hash_u64(digest)
                    expected |= {(h, "GPU")} if n.value else set()
                    expected |= {(h, "CPU")} if n.host_value is not None else set()
                    expected |= {(h, "STORAGE")} if n.on_disk else set()
        for e in self.blocks.take_events():
            if isinstance(e, BlockStored):
                for h in e.block_hashes:
                    new = (h, e.medium) not in self.live or e.medium == "STORAGE"
                    assert new, f"block stored twice in {e.medium}"
                    self.live.add((h, e.medium))
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    self.live.remove((h, e.medium))
        disk = {b for b in self.live if b[1] == "STORAGE"}  # pages stay on disk: no removals
        assert self.live - disk == {b for b in expected if b[1] != "STORAGE"}
        assert {b for b in expected if b[1] == "STORAGE"} <= disk

    @invariant()
    def memory_adds_up(self):
        tree = sum(len(n.value) for n in self.cache.nodes())
        assert self.alloc.available_size() + tree == self.alloc.size
        assert self.cache.evictable_size() + self.cache.protected_size() == tree


MACHINES = [
    (ps, policy, False) for ps in (1, 2) for policy in ("write_through", "write_through_selective")
] + [(1, "write_back", False), (2, "write_back", False)]
MACHINES += [(1, "write_through", True), (2, "write_back", True)]


@pytest.mark.parametrize(("page_size", "write_policy", "storage"), MACHINES)
def test_state_machine(page_size, write_policy, storage):
    attrs = {"page_size": page_size, "write_policy": write_policy, "storage": storage}
    machine = type("M", (HiRadixMachine,), attrs)
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=60, stateful_step_count=40, deadline=None, database=None),
    )


# ---------------------------------------------------------------------- planted bugs
class ForgetsHostFree(HiRadixCache):
    """Host eviction deletes nodes but never frees their host slots."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.host_pool.free = lambda slots: None


class BacksUpOnlyTheNode(HiRadixCache):
    """A backup that skips the ancestors: backups stop being a prefix."""

    def _write_backup(self, node) -> bool:
        if node is self.root_node or node.backuped:
            return True
        host = self._alloc_host(len(node.key))
        if host is None:
            return False
        node.host_value = host
        self.transfer.write_backup(node.value, host)
        self._record(BackupEvent, self.bus.time, [node], host, "CPU")
        return True


class DemotesWithoutHostValue(HiRadixCache):
    """Demotion that drops the host copy it should keep."""

    def evict(self, num_tokens):
        freed = super().evict(num_tokens)
        for n in self.nodes():
            if n.evicted:
                n.host_value = None
        return freed


class LoadsBackOutOfOrder(HiRadixCache):
    """A load-back that copies the host slots in the wrong order."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        real = self.transfer

        class Reversed:
            def write_backup(self, device_slots, host_slots):
                real.write_backup(device_slots, host_slots)

            def load_back(self, host_slots, device_slots):
                real.load_back(host_slots[::-1], device_slots)

        self.transfer = Reversed()


class RevivesWithoutClaimingSlots(HiRadixCache):
    """An insert over host-only nodes that gives them slots the registry never hears of."""

    def _set_device(self, node, value, value_buf) -> None:
        node.value, node.value_buf = value, value_buf
        self.evictable_size_ += len(value)
        self.evictable_leaves.discard(node.parent)
        self._maybe_device_leaf(node)


PLANTED = [  # the bug, the policy that exposes it, what the machine reports
    (ForgetsHostFree, "write_through", "host pool out of sync"),
    (BacksUpOnlyTheNode, "write_back", "backups must be a prefix"),
    # caught by the invariant, or by the load-back that trips over the missing copy
    (DemotesWithoutHostValue, "write_through", "neither device nor host|not iterable"),
    (LoadsBackOutOfOrder, "write_through", "wrong KV"),
    (RevivesWithoutClaimingSlots, "write_through", "slot registry out of sync"),
]


@pytest.mark.parametrize(
    ("bug", "write_policy", "report"), PLANTED, ids=[b.__name__ for b, *_ in PLANTED]
)
def test_state_machine_catches_planted_bug(bug, write_policy, report):
    machine = type("Planted", (HiRadixMachine,), {"cache_cls": bug, "write_policy": write_policy})
    with pytest.raises((AssertionError, InvariantError, TypeError, Flaky), match=report):
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=200,
                stateful_step_count=40,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
                report_multiple_bugs=False,
            ),
        )
