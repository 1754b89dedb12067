"""The visualizer over a cache with tiers (``HiRadixCache``: device, host, disk).

A real HiRadixCache is driven with small pools, so that evictions demote nodes, host evictions
delete them and load-backs bring them back; a FrameBuilder listens on its bus. After every
operation the last frame must agree with the cache it never reads: each node's tiers, the owner
of every host pool page (and device pool page), and the marks of what the operation moved.
"""

from __future__ import annotations

import inspect
import json
import random
import xml.etree.ElementTree as ET

import pytest

from minirad import RadixCache
from minirad.events import (
    BackupEvent,
    DemoteEvent,
    EventBus,
    EventRecorder,
    HostEvictEvent,
    PrefetchEvent,
    load_events,
    save_events,
)
from minirad.kvcache.hiradix_cache import HiRadixCache
from minirad.kvcache.kv_pool import PAGE_FREE, TokenToKVPoolAllocator
from viz import FrameBuilder, frames_from_events
from viz.frame import TIER_MARKS, TIERS, Frame, frames_to_wire
from viz.sources import builder_for
from viz.svg import HOST_ONLY, TIER_COLORS, frame_svg

A = list(range(100, 112))  # 12 tokens
B = A[:6] + list(range(200, 206))  # shares 6 with A
C = list(range(300, 308))


def make(size=24, page_size=1, **kw) -> tuple[HiRadixCache, TokenToKVPoolAllocator, FrameBuilder]:
    """A HiRadixCache whose device pool shares its bus, and a builder listening (one frame per
    event) set up by ``builder_for`` (so with the host pool's size)."""
    bus = EventBus()
    alloc = TokenToKVPoolAllocator(size, page_size, bus)
    kw.setdefault("load_back_threshold", 1)
    cache = HiRadixCache(page_size, token_to_kv_pool_allocator=alloc, bus=bus, **kw)
    builder, source_bus = builder_for(cache)
    assert source_bus is bus
    builder.attach(bus)
    return cache, alloc, builder


def put(cache: HiRadixCache, alloc: TokenToKVPoolAllocator, key: list[int]) -> None:
    """Insert ``key`` as a finished request would: fresh slots, duplicates freed."""
    value = alloc.alloc(len(key))
    prefix_len = cache.insert(key, value)
    alloc.free(value[:prefix_len])
    cache.check_invariants()


def real_tiers(node) -> tuple[str, ...]:
    on = (bool(node.value), node.host_value is not None, getattr(node, "on_disk", False))
    return tuple(t for t, o in zip(TIERS, on, strict=True) if o)


def check(frame: Frame, cache: HiRadixCache) -> None:
    """The frame shows the cache as it is: its nodes, their tiers, both pools' owners."""
    real = {n.id: n for n in cache.nodes()}
    assert {n.id for n in frame.live} == set(real), frame.caption
    assert frame.node(0).tiers == ("device",)
    for n in frame.live:
        assert n.tiers == real_tiers(real[n.id]), (frame.caption, n)
        assert n.host_only == (not real[n.id].value)
        assert n.num_tokens == len(real[n.id].key)
    # The host pool: each page owned by the node whose host copy holds it, the rest free, and
    # exactly the pages the host pool allocator has handed out.
    host = cache.host_pool
    ps = host.page_size
    expected: list[int | None] = [None] * host.num_pages
    for n in real.values():
        for s in n.host_value or ():
            expected[s // ps] = n.id
    assert frame.host_pool is not None
    assert (frame.host_pool.num_cells, frame.host_pool.page_size) == (host.num_pages, ps)
    assert frame.host_pool.owners() == expected, frame.caption
    handed = [i for i, st in enumerate(host.page_state.tolist()) if st != PAGE_FREE]
    assert [i for i, o in enumerate(expected) if o is not None] == handed
    # The device pool: tree pages owned by their node.
    device = frame.pool.owners()
    for n in real.values():
        assert all(device[s // ps] == n.id for s in n.value), (frame.caption, n.id)
    tree_pages = {s // ps for n in real.values() for s in n.value}
    assert {i for i, o in enumerate(device) if isinstance(o, int)} == tree_pages


def story() -> tuple[list[Frame], dict[str, int]]:
    """A short write_through story, one frame per event: A and B share a prefix, A's tail is
    demoted, then loaded back, then everything is demoted. Returns the frames and the index
    of the frame of the first demotion ("demote"), of the load-back ("load_back"), and the
    last frame before them ("before")."""
    cache, alloc, builder = make()
    put(cache, alloc, A)
    put(cache, alloc, B)
    before = len(builder.frames) - 1
    cache.evict(6)
    demote = next(i for i, f in enumerate(builder.frames) if f.events[0].startswith("demoted"))
    assert cache.load_back(cache.match_prefix(A).last_host_node)
    load_back = len(builder.frames) - 1
    cache.evict(6)
    return builder.frames, {"before": before, "demote": demote, "load_back": load_back}


def marks_since(builder: FrameBuilder, start: int) -> list[tuple[int, str]]:
    """``(node id, mark)`` of every tier mark in the frames from ``start`` on, in order."""
    return [(n.id, m) for f in builder.frames[start:] for n in f.nodes for m in n.tier_marks]


# ---------------------------------------------------------------------- one rule at a time
def test_write_through_backup_demote_load_back_and_host_eviction():
    cache, alloc, builder = make()
    put(cache, alloc, A)
    check(builder.frames[-1], cache)
    a = builder.frames[-1].live[0].id
    assert marks_since(builder, 0) == [(a, "backed_up")]  # write_through: on insert
    backup = next(f for f in builder.frames if f.events and f.events[0].startswith("backup"))
    assert backup.node(a).tiers == ("device", "host") and backup.node(a).state == "idle"

    n = len(builder.frames)
    put(cache, alloc, B)  # splits A after 6 tokens, adds B's leaf, backs it up
    check(builder.frames[-1], cache)
    assert {m for _, m in marks_since(builder, n)} == {"backed_up"}

    n = len(builder.frames)
    cache.evict(6)  # the LRU leaf (A's tail) is demoted: it stays, host-only
    f = builder.frames[-1]
    check(f, cache)
    [(demoted, mark)] = marks_since(builder, n)
    assert mark == "demoted"
    demote_frame = next(f for f in builder.frames[n:] if f.node(demoted).tier_marks)
    assert demote_frame.caption == f"demoted node {demoted} to the host: 6 tokens"
    assert demote_frame.node(demoted).tiers == ("host",)
    assert demote_frame.node(demoted).state == "idle"  # still in the tree

    n = len(builder.frames)
    m = cache.match_prefix(A)
    assert m.host_hit_length == 6
    assert cache.load_back(m.last_host_node) is not None
    check(builder.frames[-1], cache)
    assert marks_since(builder, n) == [(demoted, "loaded_back")]
    load_frame = next(f for f in builder.frames[n:] if f.node(demoted).tier_marks)
    assert load_frame.caption.startswith(f"loaded back: nodes [{demoted}]")

    n = len(builder.frames)
    cache.evict(24)  # everything leaves the device: the nodes stay, host-only
    check(builder.frames[-1], cache)
    assert all(n.tiers == ("host",) for n in builder.frames[-1].live)
    assert {m for _, m in marks_since(builder, n)} == {"demoted"}

    n = len(builder.frames)
    cache.evict_host(100)
    check(builder.frames[-1], cache)
    gone = [(f, v) for f in builder.frames[n:] for v in f.nodes if v.tier_marks]
    assert gone and all(v.tier_marks == ("host_evicted",) for _, v in gone)
    for f, v in gone:  # drawn where it was, as it was: a host-only ghost
        assert (v.state, v.tiers) == ("evicted", ("host",))
        assert f.caption.startswith(f"evicted node {v.id} from the host")
    assert builder.frames[-1].host_pool.owners() == [None] * cache.host_pool.num_pages


def test_one_frame_per_operation_lists_every_move_in_order():
    """write_back: an eviction backs the leaf up, then demotes it, in one snapshot."""
    cache, alloc, builder = make(write_policy="write_back")
    builder.every_event = False
    put(cache, alloc, A)
    builder.snapshot()
    assert builder.frames[-1].live[0].tiers == ("device",)  # not backed up yet
    assert not builder.frames[-1].live[0].tier_marks
    check(builder.frames[-1], cache)
    cache.evict(12)
    f = builder.snapshot()
    check(f, cache)
    [node] = f.live
    assert node.tier_marks == ("backed_up", "demoted")
    assert node.tiers == ("host",)
    assert "backup: nodes" in f.caption and "demoted node" in f.caption
    host = [o for o in f.host_pool.owners() if o is not None]
    assert host == [node.id] * 12
    f = builder.snapshot()  # nothing happened: the marks are gone
    assert f.live[0].tier_marks == () and f.live[0].tiers == ("host",)


def test_an_insert_over_host_only_nodes_marks_them_recomputed():
    cache, alloc, builder = make()
    put(cache, alloc, A)
    cache.evict(12)
    n = len(builder.frames)
    put(cache, alloc, A)  # the request computed A again: its slots revive the node
    check(builder.frames[-1], cache)
    [(node, mark)] = marks_since(builder, n)
    assert mark == "recomputed"
    f = next(f for f in builder.frames[n:] if f.node(node).tier_marks)
    assert f.node(node).tiers == ("device", "host")
    assert f.caption.startswith(f"recomputed: nodes [{node}]")


def test_selective_write_through_backs_up_hot_nodes_only():
    cache, alloc, builder = make(
        size=40, write_policy="write_through_selective", write_through_threshold=2
    )
    put(cache, alloc, A)
    put(cache, alloc, C)
    check(builder.frames[-1], cache)
    assert not marks_since(builder, 0)
    n = len(builder.frames)
    for _ in range(2):
        cache.match_prefix(A)  # matches do not count (SGLang counts a node's inserts)
    assert not marks_since(builder, n)
    put(cache, alloc, A)  # a second request caches A: hot
    check(builder.frames[-1], cache)
    [(node, mark)] = marks_since(builder, n)
    assert mark == "backed_up"
    tiers = {v.id: v.tiers for v in builder.frames[-1].live}
    assert sorted(tiers.values()) == [("device",), ("device", "host")]
    assert tiers[node] == ("device", "host")


def test_a_full_host_pool_evicts_host_only_leaves_for_a_backup():
    cache, alloc, builder = make(size=12, hicache_ratio=1.0)
    put(cache, alloc, A)
    n = len(builder.frames)
    cache.evict(len(C))  # A leaves the device, host-only
    put(cache, alloc, C)  # C's backup needs A's host slots: A leaves the tree
    check(builder.frames[-1], cache)
    marks = marks_since(builder, n)
    assert [m for _, m in marks] == ["demoted", "host_evicted", "backed_up"]


def test_a_reset_frees_both_pools():
    cache, alloc, builder = make()
    put(cache, alloc, A)
    put(cache, alloc, B)
    cache.evict(6)
    cache.reset()
    f = builder.frames[-1]
    assert not f.live and all(n.state == "evicted" for n in f.nodes if n.id)
    assert f.host_pool.owners() == [None] * cache.host_pool.num_pages
    put(cache, alloc, C)  # ids start from 0 again
    check(builder.frames[-1], cache)


@pytest.mark.parametrize("page_size", [1, 2])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_random_operations_keep_the_frames_in_step_with_the_cache(policy, page_size):
    rng = random.Random(f"{policy}-{page_size}")
    # write_through_selective backs up a node at its first match.
    cache, alloc, builder = make(
        16, page_size, write_policy=policy, hicache_ratio=1.5, write_through_threshold=1
    )
    prefixes = [rng.sample(range(1, 40), 4) for _ in range(3)]
    seen: set[str] = set()
    for _ in range(120):
        op = rng.choice(["insert", "insert", "evict", "load", "evict_host"])
        key = rng.choice(prefixes) + [rng.randrange(1, 6) for _ in range(2 * rng.randrange(1, 4))]
        n = len(builder.frames)
        if op == "insert":
            if alloc.available_size() < len(key):
                cache.evict(len(key))
            if alloc.available_size() >= len(key):
                put(cache, alloc, key)
        elif op == "evict":
            cache.evict(rng.randrange(1, 9))
        elif op == "load":
            m = cache.match_prefix(key)
            cache.load_back(m.last_host_node)
        else:
            cache.evict_host(rng.randrange(1, 9))
        cache.check_invariants()
        if len(builder.frames) > n:
            check(builder.frames[-1], cache)
        for f in builder.frames[n:]:
            for v in f.nodes:
                assert set(v.tier_marks) <= set(TIER_MARKS) and set(v.tiers) <= set(TIERS)
                seen.update(v.tier_marks)
    assert {"backed_up", "demoted", "host_evicted"} <= seen, seen
    assert seen & {"loaded_back", "recomputed"}, seen


def test_the_real_disk_tier_writes_and_prefetches():
    """With a storage backend: a backup is written to disk too (``stored``); once the node
    left both the device and the host, a prefetch reads it back as a new host-only node."""
    storage = pytest.importorskip("minirad.kvcache.hicache_storage")
    if "storage" not in inspect.signature(HiRadixCache).parameters:
        pytest.skip("HiRadixCache has no disk tier yet")
    cache, alloc, builder = make(storage=storage.HiCacheMemoryStorage(), storage_page_size=4)
    put(cache, alloc, A)
    check(builder.frames[-1], cache)
    [node] = builder.frames[-1].live
    assert marks_since(builder, 0) == [(node.id, "backed_up"), (node.id, "stored")]
    assert node.tiers == ("device", "host", "disk")
    cache.evict(len(A))
    cache.evict_host(len(A))
    check(builder.frames[-1], cache)
    n = len(builder.frames)
    leaf, read = cache.prefetch_from_storage(A)
    assert read == len(A)
    f = builder.frames[-1]
    check(f, cache)
    assert marks_since(builder, n) == [(leaf.id, "prefetched")]
    v = f.node(leaf.id)
    assert (v.state, v.tiers, v.num_tokens) == ("added", ("host", "disk"), len(A))
    assert f.caption == f"prefetched node {leaf.id} from disk to the host: 12 tokens under node 0"
    assert f.host_pool.owners().count(leaf.id) == len(A)
    assert '<g class="tier disk on">' in frame_svg(f) and "disk: on disk" in frame_svg(f)


# ---------------------------------------------------------------------- events only
def test_the_disk_tier_from_its_events():
    """Pages written to disk (a STORAGE backup) and a prefetch from disk, as events appended
    to a real cache's log: the builder follows them and a replay gives the same frames."""
    cache, alloc, builder = make()
    recorder = EventRecorder(cache.bus)
    put(cache, alloc, C)
    a = builder.frames[-1].live[0].id
    t = cache.bus.tick()
    free_host = [i for i, st in enumerate(cache.host_pool.page_state.tolist()) if st == PAGE_FREE]
    free_host = free_host[:4]  # page_size 1: a page is a slot
    events = [
        BackupEvent(t, (a,), (), "STORAGE"),
        PrefetchEvent(t + 1, 42, a, (7, 8, 9, 10), tuple(free_host)),
    ]
    for e in events:
        builder.apply(e)
    stored, fetched = builder.frames[-2:]
    assert stored.node(a).tiers == ("device", "host", "disk")
    assert stored.node(a).tier_marks == ("stored",)
    assert stored.caption == f"backup: nodes [{a}] copied to the disk"
    node = fetched.node(42)
    assert (node.state, node.tiers, node.tier_marks) == ("added", ("host", "disk"), ("prefetched",))
    assert (node.parent, node.num_tokens) == (a, 4)
    assert node.label.tokens == (7, 8, 9, 10)
    owners = fetched.host_pool.owners()
    assert [owners[s] for s in free_host] == [42] * 4
    # Replayed from a file, the same frames.
    sizes = {"pool_size": alloc.size, "host_pool_size": cache.host_pool.size}
    replay = frames_from_events(recorder.events + events, initial=False, **sizes)
    assert [f.to_dict() for f in replay] == [f.to_dict() for f in builder.frames]
    evicted = HostEvictEvent(t + 2, 42, 4, tuple(free_host))
    builder.apply(evicted)
    f = builder.frames[-1]
    assert (f.node(42).state, f.node(42).tier_marks) == ("evicted", ("host_evicted",))
    assert [f.host_pool.owners()[s] for s in free_host] == [None] * 4


# ---------------------------------------------------------------------- wire, replay
def test_wire_format_carries_tiers_only_for_a_cache_with_tiers(tmp_path):
    cache, alloc, builder = make()
    recorder = EventRecorder(cache.bus)
    put(cache, alloc, A)
    put(cache, alloc, B)
    cache.evict(6)
    wire = json.loads(json.dumps(frames_to_wire(builder.frames)))
    for f, w in zip(builder.frames, wire["frames"], strict=True):
        assert w["host_pool"] == f.host_pool.to_dict()
        for n, wn in zip(f.nodes, w["nodes"], strict=True):
            assert len(wn) == 12
            assert wn[10:] == [list(n.tiers), list(n.tier_marks)]
    demoted = [wn for w in wire["frames"] for wn in w["nodes"] if "demoted" in wn[11]]
    assert demoted and all(wn[10] == ["host"] for wn in demoted)
    # A recording replays into the same frames (the builder learns the tiers from the events
    # or, given its size, shows the host pool from the first frame).
    path = tmp_path / "hicache.jsonl"
    save_events(recorder.events, path)
    assert [type(e) for e in load_events(path)] == [type(e) for e in recorder.events]
    kinds = {type(e) for e in recorder.events}
    assert {BackupEvent, DemoteEvent} <= kinds
    sizes = {"pool_size": alloc.size, "host_pool_size": cache.host_pool.size}
    replay = frames_from_events(path, initial=False, **sizes)
    assert [f.to_dict() for f in replay] == [f.to_dict() for f in builder.frames]
    auto = frames_from_events(path, initial=False, pool_size=alloc.size)
    first_tier = next(i for i, f in enumerate(auto) if f.host_pool is not None)
    assert all(f.host_pool is None for f in auto[:first_tier])
    assert all(n.tiers is None for f in auto[:first_tier] for n in f.nodes)
    assert auto[first_tier].events[0].startswith("backup")
    assert [n.tiers for n in auto[-1].nodes] == [n.tiers for n in builder.frames[-1].nodes]
    grown, fixed = auto[-1].host_pool.owners(), builder.frames[-1].host_pool.owners()
    assert 0 < len(grown) < len(fixed)  # no size given: as far as the highest host slot
    assert fixed == grown + [None] * (len(fixed) - len(grown))


def test_a_plain_radix_cache_keeps_its_wire_format():
    bus = EventBus()
    alloc = TokenToKVPoolAllocator(32, 1, bus)
    cache = RadixCache(token_to_kv_pool_allocator=alloc, bus=bus)
    builder, _ = builder_for(cache)
    builder.attach(bus)
    cache.insert(A, alloc.alloc(12))
    cache.evict(12)
    wire = frames_to_wire(builder.frames)
    assert all("host_pool" not in f for f in wire["frames"])
    assert all(len(n) == 10 for f in wire["frames"] for n in f["nodes"])
    assert all(n.tiers is None and not n.tier_marks for f in builder.frames for n in f.nodes)
    assert "tier" not in frame_svg(builder.frames[-1]) and "Host pool" not in frame_svg(
        builder.frames[-1]
    )


def test_builder_for_refuses_a_host_pool_in_use():
    bus = EventBus()
    alloc = TokenToKVPoolAllocator(16, 1, bus)
    cache = HiRadixCache(1, token_to_kv_pool_allocator=alloc, bus=bus)
    cache.host_pool.alloc(4)
    with pytest.raises(ValueError, match="host pool"):
        builder_for(cache)


# ---------------------------------------------------------------------- SVG
def test_svg_draws_host_only_nodes_dashed_with_tier_chips_and_the_host_pool():
    cache, alloc, builder = make()
    put(cache, alloc, A)
    put(cache, alloc, B)
    cache.evict(6)
    f = builder.frames[-1]
    [host_only] = [n for n in f.live if n.host_only]
    svg = ET.fromstring(frame_svg(f))
    ns = {"s": "http://www.w3.org/2000/svg"}
    nodes = {g.get("data-id"): g for g in svg.iter("{http://www.w3.org/2000/svg}g")}
    for n in f.live:
        g = nodes[str(n.id)]
        box = g.find("s:rect", ns)
        chips = {c.get("class"): c for c in g.findall("s:g", ns)}
        assert g.get("data-tiers") == " ".join(n.tiers)
        if n is host_only:
            assert "host-only" in g.get("class").split()
            assert box.get("stroke-dasharray") == "4,2"
            assert (box.get("fill"), box.get("stroke")) == HOST_ONLY
            assert set(chips) == {"tier device", "tier host on"}
        else:
            assert "host-only" not in g.get("class").split()
            assert box.get("stroke-dasharray") is None
            assert set(chips) == {"tier device on", "tier host on"}
            fill = chips["tier device on"].find("s:rect", ns).get("fill")
            assert fill == TIER_COLORS["device"]
    texts = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    head = next(t for t in texts if t and t.startswith("Host pool:"))
    copies = sum(o is not None and o != host_only.id for o in f.host_pool.owners())
    assert head == (
        f"Host pool: {f.host_pool.num_cells} slots: {copies} back up device nodes, "
        f"6 hold host-only nodes, {f.host_pool.owners().count(None)} free"
    )
    assert any(t and t.startswith("Device KV pool:") for t in texts)
    assert "host-only" in texts and "host: in host pool" in texts
