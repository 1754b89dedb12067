"""The event stream (``minirad.events``): every mutation of a cache or pool publishes one typed
event on the shared bus, in logical-time order, and a JSONL log round-trips exactly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from minirad import (
    EventBus,
    EventRecorder,
    KVCacheManager,
    RadixCache,
    TokenToKVPoolAllocator,
    load_events,
    save_events,
)
from minirad.events import (
    AllocEvent,
    BlockRemovedEvent,
    BlockStoredEvent,
    Event,
    EvictEvent,
    FreeEvent,
    InsertEvent,
    LockEvent,
    MatchEvent,
    ResetEvent,
    SplitEvent,
    TouchEvent,
    UnlockEvent,
    event_from_dict,
)


class Log:
    """Records the bus and hands back what one call emitted."""

    def __init__(self, bus: EventBus) -> None:
        self.recorder = EventRecorder(bus)

    def of(self, fn: Callable[[], object]) -> list[Event]:
        start = len(self.recorder)
        fn()
        return self.recorder.events[start:]


@pytest.fixture
def radix() -> tuple[RadixCache, TokenToKVPoolAllocator, Log]:
    bus = EventBus()
    log = Log(bus)
    alloc = TokenToKVPoolAllocator(16, bus=bus)
    return RadixCache(token_to_kv_pool_allocator=alloc, bus=bus), alloc, log


def test_every_radix_mutation_emits_its_typed_event(radix) -> None:
    cache, alloc, log = radix
    (ev,) = log.of(lambda: alloc.alloc(3, owner="r1"))
    assert isinstance(ev, AllocEvent) and (ev.pool, ev.unit, ev.ids, ev.owner) == (
        "token_pool",
        "slot",
        (0, 1, 2),
        "r1",
    )

    (ev,) = log.of(lambda: cache.insert([1, 2, 3], [0, 1, 2]))
    assert isinstance(ev, InsertEvent)
    assert (ev.path, ev.prefix_len, ev.parent_id) == ((), 0, 0)
    assert (ev.key, ev.value) == ((1, 2, 3), (0, 1, 2))
    first = ev.node_id

    slots = alloc.alloc(3)
    split, ins = log.of(lambda: cache.insert([1, 2, 4], slots))
    assert isinstance(split, SplitEvent) and isinstance(ins, InsertEvent)
    assert (split.node_id, split.split_len) == (first, 2)  # the prefix keeps the id
    assert ins.path == (first,) and ins.prefix_len == 2 and ins.parent_id == first
    assert ins.key == (4,) and ins.value == (slots[2],)
    alloc.free(slots[:2])  # the caller's duplicates

    (ev,) = log.of(lambda: cache.insert([1, 2, 4], slots))
    assert ev.node_id is None and ev.prefix_len == 3 and ev.key == ()

    (ev,) = log.of(lambda: cache.match_prefix([1, 2, 4, 7], extra_key=None))
    assert isinstance(ev, MatchEvent)
    assert (ev.path, ev.num_tokens, ev.query_len) == ((first, ins.node_id), 3, 4)

    node = cache.match_prefix([1, 2, 4]).last_node
    (ev,) = log.of(lambda: cache.inc_lock_ref(node))
    assert isinstance(ev, LockEvent)
    assert (ev.node_ids, ev.lock_refs) == ((ins.node_id, first), (1, 1))
    (ev,) = log.of(lambda: cache.dec_lock_ref(node))
    assert isinstance(ev, UnlockEvent)
    assert (ev.node_ids, ev.lock_refs) == ((ins.node_id, first), (0, 0))

    evicted = log.of(lambda: cache.evict(1))
    assert [type(e) for e in evicted] == [EvictEvent, FreeEvent]
    assert evicted[0].num_tokens == 1 and evicted[1].ids == evicted[0].value

    reset = log.of(cache.reset)
    assert [type(e) for e in reset] == [FreeEvent, ResetEvent]
    assert reset[1].source == "radix_cache"
    assert alloc.available_size() == 16


def test_every_block_pool_mutation_emits_its_typed_event() -> None:
    bus = EventBus()
    log = Log(bus)
    mgr = KVCacheManager(3, 4, bus=bus)
    tokens = list(range(1, 10))
    events = log.of(lambda: mgr.allocate_slots("a", tokens, 9))
    assert [type(e) for e in events] == [AllocEvent, BlockStoredEvent]
    assert events[0].ids == (0, 1, 2) and events[0].owner == "a"
    assert events[1].ids == (0, 1)
    assert events[1].block_hashes == tuple(h.hex() for h in mgr.block_hashes(tokens))

    (ev,) = log.of(lambda: mgr.free("a"))
    assert isinstance(ev, FreeEvent) and ev.ids == (2, 1, 0)  # tail first

    hits, n = mgr.get_computed_blocks(tokens)
    events = log.of(lambda: mgr.allocate_slots("b", tokens, len(tokens) - n, hits))
    assert [type(e) for e in events] == [TouchEvent, AllocEvent]
    assert events[0].ids == (0, 1) and events[0].ref_cnts == (1, 1)
    # 2 is the only free block (uncached): nothing was evicted.
    assert events[1].ids == (2,)
    mgr.free("b")

    # Block 2 (uncached) first, then cached 1 and 0 lose their hashes when reused.
    events = log.of(lambda: mgr.allocate_slots("c", [7] * 12, 12))
    removed = [e for e in events if isinstance(e, BlockRemovedEvent)]
    assert [e.ids for e in removed] == [(1, 0)]
    assert mgr.block_pool.get_cached_block(mgr.block_hashes(tokens)[0]) is None


def test_logical_time_never_decreases_across_components(radix) -> None:
    cache, alloc, log = radix
    mgr = KVCacheManager(4, 2, bus=cache.bus)
    for i in range(3):
        slots = alloc.alloc(4)
        prefix = cache.insert([1, 2, i, 3], slots)
        alloc.free(slots[:prefix])
        node = cache.match_prefix([1, 2, i]).last_node
        cache.inc_lock_ref(node)
        tokens = [1, 2, 3, 4, i]
        hits, n = mgr.get_computed_blocks(tokens)
        assert mgr.allocate_slots(f"r{i}", tokens, len(tokens) - n, hits) is not None
        cache.dec_lock_ref(node)
        cache.evict(2)
        mgr.free(f"r{i}")
    times = [e.time for e in log.recorder.events]
    assert len(times) > 30
    assert times == sorted(times)
    # Radix operations each take their own tick.
    ticks = [e.time for e in log.recorder.events if isinstance(e, (MatchEvent, LockEvent))]
    assert len(set(ticks)) == len(ticks)


def test_jsonl_round_trip_equals_the_original_events(radix, tmp_path: Path) -> None:
    cache, alloc, log = radix
    mgr = KVCacheManager(4, 2, bus=cache.bus)
    cache.insert([1, 2, 3], alloc.alloc(3), extra_key="lora")
    cache.insert([1, 2, 4], [0, 1] + alloc.alloc(1), extra_key="lora")
    cache.inc_lock_ref(cache.match_prefix([1, 2, 3], extra_key="lora").last_node)
    cache.evict(5)
    mgr.allocate_slots("r", [1, 2, 3, 4, 5], 5)
    mgr.free("r")
    events = log.recorder.events
    kinds = {e.kind for e in events}
    assert {"insert", "split", "match", "lock", "evict", "alloc", "free", "block_stored"} <= kinds
    path = tmp_path / "log.jsonl"
    log.recorder.save(path)
    assert len(path.read_text().splitlines()) == len(events)
    assert load_events(path) == events
    assert EventRecorder.load(path).events == events
    save_events(events[:3], path)
    assert load_events(path) == events[:3]
    for e in events:
        assert event_from_dict(e.to_dict()) == e and e.to_dict()["kind"] == e.kind


def test_recorder_replay_close_and_unknown_kind(tmp_path: Path) -> None:
    bus = EventBus()
    rec = EventRecorder(bus)
    cache = RadixCache(bus=bus)
    cache.insert([1, 2])
    rec.close()
    cache.insert([3])
    assert len(rec) == 1
    seen = []
    rec.replay(seen.append)
    assert seen == rec.events
    with pytest.raises(KeyError):
        event_from_dict({"kind": "nope", "time": 1})


def test_a_bus_without_subscribers_builds_no_events() -> None:
    bus = EventBus()
    assert not bus.active
    unsubscribe = bus.subscribe(lambda e: None)
    assert bus.active
    unsubscribe()
    assert not bus.active
    assert bus.tick() == 1 and bus.tick() == 2


def test_descriptions_count_tokens_in_words(radix) -> None:
    cache, alloc, log = radix
    slots = alloc.alloc(3)
    cache.insert([1, 2, 3], slots)
    more = slots + alloc.alloc(1)
    (one,) = log.of(lambda: cache.insert([1, 2, 3, 4], more))
    assert one.describe() == "insert: 3 tokens cached, new node 2 (1 token) under node 1"
    evictions = log.of(lambda: cache.evict(1))
    assert [e.describe() for e in evictions if e.kind == "evict"] == ["evicted node 2: 1 token"]
