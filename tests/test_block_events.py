"""vLLM's KV events <-> minirad's tree events (``minirad.kv_events.block_events``), both ways.

- :class:`BlockHashTree` (vLLM -> minirad) is fed vLLM-shaped events (the fields of a real
  LLaVA request, through our msgpack decoder) and its minirad events go to a real
  ``viz.frame_builder.FrameBuilder``: chains, the image fork, copies, removals of blocks that have
  children, a subscriber that joined late, resets, bad events, determinism.
- :class:`RadixBlockEvents` (minirad -> vLLM) listens to a real RadixCache; its hashes are
  checked against :class:`~minirad.kvcache.kv_cache_manager.KVCacheManager`'s ``block_hashes`` (the
  BlockPool chain), and a Hypothesis property checks, for random insert / evict / reset
  sequences, that the blocks the published events say are stored are exactly the full blocks
  of every path the cache holds, and that the view rebuilds that same block tree.
- The shipped tiny LLaVA engine publishes over ZMQ (``EngineConfig(kv_events_endpoint=...)``)
  to a :class:`~minirad.kv_events.KVEventSubscriber`, whose batches go through the view into
  frames: image chips, evictions, the same blocks as the engine's tree.
- :class:`BlockChains` redraws a block tree as a radix tree (SGLang's pages, one node per run
  stored together): splits where a chain forks, tails evicted by split and evict, and a
  Hypothesis property that it draws the same paths as the block view, in fewer nodes.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from minirad.errors import InvalidArgumentError, KVEventError
from minirad.events import EventBus, EventRecorder, EvictEvent, InsertEvent, ResetEvent
from minirad.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventSubscriber,
    Notice,
    decode_frames,
    encode_batch,
)
from minirad.kv_events.block_events import (
    MASK_64,
    BlockChains,
    BlockHashTree,
    RadixBlockEvents,
    block_hash_u64,
)
from minirad.kvcache.kv_cache_manager import KVCacheManager
from minirad.kvcache.multimodal import MultiModalItem, pad_value
from minirad.kvcache.radix_cache import RadixCache
from viz.frame import Frame, frames_to_wire
from viz.frame_builder import FrameBuilder

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "data" / "models" / "minirad-tiny-llava"
IMAGE_TOKEN_ID, VOCAB_SIZE = 3, 1024  # the shipped tiny LLaVA's
MM_A = "61906bc9c5ab53d2d6ed8d3e3c3c7f0c0e4d1b1a8a7c5b3c2b2a1f0e9d8c7e3925"
MM_B = "9f2c4e1a7b3d5f6081726354a5b6c7d8e9f0a1b2c3d4e5f60718293a4b5c6d7e"
# A LLaVA prompt's first three blocks as vLLM 0.32 publishes them: the image's 64
# placeholders start at token 3 and run through the second block (offset -29 from its start)
# into the third (offset -61), where the question follows.
LLAVA_TOKENS = [1, 432, 202] + [IMAGE_TOKEN_ID] * 64 + list(range(500, 529))
LLAVA_OFFSETS = (3, -29, -61)


def stored(hashes, parent=None, tokens=None, bs=4, extra_keys=None) -> BlockStored:
    if tokens is None:
        tokens = [h % 1000 for h in hashes for _ in range(bs)]
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=bs,
        medium="GPU",
        extra_keys=extra_keys,
    )


def llava_blocks(hashes, mm_hash) -> BlockStored:
    """A real-shaped BlockStored of the first ``len(hashes)`` blocks, sent through vLLM's wire
    format and our decoder."""
    n = len(hashes)
    extra_keys = [[[mm_hash, offset]] for offset in LLAVA_OFFSETS[:n]]
    event = stored(hashes, None, LLAVA_TOKENS[: 32 * n], 32, extra_keys)
    _, _, batch = decode_frames(encode_batch(0, KVEventBatch(1.0, [event], 0)))
    return batch.events[0]


def view_with_frames(**kw) -> tuple[BlockHashTree, FrameBuilder, EventRecorder]:
    bus = EventBus()
    view = BlockHashTree(bus, **kw)
    builder = FrameBuilder(**view.frame_settings())
    builder.images = view.images  # FrameBuilder copies it; the view adds names as images come
    builder.attach(bus)
    return view, builder, EventRecorder(bus)


def tree(frame: Frame) -> dict[int, int]:
    """``{node id: parent id}`` of the frame's live nodes, after checking that every live
    node hangs from the root or from another live node."""
    live = {n.id: n.parent for n in frame.live}
    for parent in live.values():
        assert parent == 0 or parent in live
    return live


def by_hash(view: BlockHashTree, frame: Frame) -> dict[int, int | None]:
    """``{block hash: parent block hash or None}`` of the drawn blocks, read from the frame."""
    hash_of = {node: h for h, node in view.node_ids().items()}
    return {hash_of[n]: hash_of.get(p) for n, p in tree(frame).items()}


# ====================================================================== vLLM -> minirad
def test_a_stored_chain_is_a_chain_of_nodes():
    view, builder, rec = view_with_frames()
    view.apply(stored([11, 12, 13], tokens=range(12)))
    frame = builder.frames[-1]
    assert tree(frame) == {1: 0, 2: 1, 3: 2}
    assert [n.num_tokens for n in frame.live] == [4, 4, 4]
    assert [n.label.tokens for n in frame.live] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert [n.extra_key for n in frame.live] == [f"{h:016x}" for h in (11, 12, 13)]
    assert frame.pool.num_cells == 0  # vLLM publishes no slots: no pool to draw
    last = rec.events[-1]
    assert (last.path, last.prefix_len, last.node_id, last.parent_id) == ((1, 2), 8, 3, 2)
    assert view.stored_blocks() == {
        11: (None, (0, 1, 2, 3)),
        12: (11, (4, 5, 6, 7)),
        13: (12, (8, 9, 10, 11)),
    }
    # A chain continued by a later store hangs from its parent's node.
    view.apply(stored([14], parent=12))
    assert tree(builder.frames[-1])[4] == 2


def test_two_images_fork_at_the_root_with_chips_named_by_their_hashes():
    view, builder, _ = view_with_frames(image_token_id=IMAGE_TOKEN_ID, vocab_size=VOCAB_SIZE)
    view.apply(llava_blocks([2**64 - 5, 2**63 + 7, 2**62], MM_A))
    view.apply(llava_blocks([42, 43], MM_B))
    frame = builder.frames[-1]
    assert tree(frame) == {1: 0, 2: 1, 3: 2, 4: 0, 5: 4}  # two chains: the fork is at block 0
    pad_a, pad_b = pad_value(MM_A, VOCAB_SIZE), pad_value(MM_B, VOCAB_SIZE)
    assert view.images == {pad_a: "img 61906b", pad_b: "img 9f2c4e"}
    first = frame.node(1).label
    assert first.tokens == (1, 432, 202) + (pad_a,) * 13
    assert first.images == ((3, 29, "img 61906b"),)
    assert frame.node(2).label.images == ((0, 32, "img 61906b"),)
    assert frame.node(3).label.images == ((0, 3, "img 61906b"),)  # then the question's text
    assert frame.node(3).label.tokens == (pad_a,) * 3 + tuple(range(500, 513))
    assert frame.node(4).label.images == ((3, 29, "img 9f2c4e"),)
    assert ("image", "img 9f2c4e x29") in frame.node(4).label.parts
    # What vLLM published is kept as published.
    assert view.stored_blocks()[42] == (None, tuple(LLAVA_TOKENS[:32]))
    # A request can name its image itself (vLLM's multi_modal_uuids): not hex, still a pad id.
    view.apply(llava_blocks([50], "-cat-photo_1"))
    (pad,) = set(view.images) - {pad_a, pad_b}
    assert pad >= VOCAB_SIZE and view.images[pad] == "img -cat-p"


def test_without_the_model_the_fork_shows_in_the_hashes_only():
    view, builder, _ = view_with_frames()
    view.apply(llava_blocks([21, 22], MM_A))
    view.apply(llava_blocks([31, 32], MM_B))
    a, b = builder.frames[-1].node(1), builder.frames[-1].node(3)
    assert a.parent == b.parent == 0
    assert a.label.tokens == b.label.tokens == tuple(LLAVA_TOKENS[:16])
    assert not a.label.images and not view.images
    assert (a.extra_key, b.extra_key) == (f"{21:016x}", f"{31:016x}")


def test_a_block_stays_while_one_of_its_copies_does():
    """vLLM does not de-duplicate: the same hash stored twice is removed twice."""
    view, builder, rec = view_with_frames()
    view.apply(stored([1, 2]))
    view.apply(stored([1, 2]))  # a second copy of both
    again = rec.events[-1]
    assert isinstance(again, InsertEvent) and again.node_id is None and again.path == (1, 2)
    assert builder.frames[-1].node(2).state == "accessed"
    view.apply(BlockRemoved([2]))
    assert tree(builder.frames[-1]) == {1: 0, 2: 1}
    view.apply(BlockRemoved([2]))
    assert builder.frames[-1].node(2).state == "evicted"
    assert tree(builder.frames[-1]) == {1: 0}


def test_a_removed_parent_hides_its_descendants_until_it_is_stored_again():
    view, builder, rec = view_with_frames()
    view.apply(stored([1, 2, 3]))  # A B C
    view.apply(stored([4], parent=2))  # D, a second child of B
    n = len(rec.events)
    view.apply(BlockRemoved([2]))  # B goes first: vLLM's free queue is LRU, not leaf-first
    gone = rec.events[n:]
    assert all(isinstance(e, EvictEvent) for e in gone)
    assert [e.node_id for e in gone] == [3, 4, 2]  # the leaves C and D first, then B
    assert [tree(f) for f in builder.frames[-3:]] == [{1: 0, 2: 1, 4: 2}, {1: 0, 2: 1}, {1: 0}]
    assert set(view.stored_blocks()) == {1, 3, 4}  # C and D are still in vLLM's cache...
    assert view.node_ids() == {1: 1}  # ...but no lookup can reach them
    view.apply(stored([2], parent=1))  # B is back (recomputed): C and D hang from it again
    assert by_hash(view, builder.frames[-1]) == {1: None, 2: 1, 3: 2, 4: 2}
    assert view.node_ids() == {1: 1, 2: 5, 3: 6, 4: 7}  # new ids: the old ones were evicted
    view.apply(BlockRemoved([2]))
    n = len(rec.events)
    view.apply(BlockRemoved([4]))  # a hidden block leaves without a trace in the drawing
    assert len(rec.events) == n and set(view.stored_blocks()) == {1, 3}
    view.apply(stored([2], parent=1))
    assert by_hash(view, builder.frames[-1]) == {1: None, 2: 1, 3: 2}


def test_a_late_subscriber_draws_unseen_parents_as_placeholders():
    view, builder, _ = view_with_frames()
    view.apply(stored([7, 8], parent=99))  # 99 was stored before this view joined
    view.apply(stored([9], parent=99))
    frame = builder.frames[-1]
    assert tree(frame) == {1: 0, 2: 1, 3: 2, 4: 1}
    holder = frame.node(1)
    assert (holder.num_tokens, holder.extra_key) == (0, f"{99:016x}")
    assert 99 not in view.stored_blocks()
    # vLLM removes the unseen block: what hangs from it can no longer be hit.
    view.apply(BlockRemoved([99]))
    assert tree(builder.frames[-1]) == {} and set(view.stored_blocks()) == {7, 8, 9}
    # It is stored again, now seen: a real node, with its chains under it.
    view.apply(stored([99], tokens=[5, 6, 7, 8]))
    assert by_hash(view, builder.frames[-1]) == {99: None, 7: 99, 8: 7, 9: 99}
    assert builder.frames[-1].node(view.node_ids()[99]).num_tokens == 4


def test_a_placeholder_becomes_real_or_leaves_with_its_last_child():
    view, builder, _ = view_with_frames()
    view.apply(stored([7], parent=99))
    view.apply(stored([99, 7], parent=98))  # 99 seen at last, under another unseen parent
    assert by_hash(view, builder.frames[-1]) == {98: None, 99: 98, 7: 99}
    assert view.stored_blocks()[7] == (99, (7,) * 4)
    view.apply(BlockRemoved([7]))
    view.apply(BlockRemoved([7]))  # both copies gone
    view.apply(BlockRemoved([99]))  # 98 holds nothing any more: it goes too
    assert tree(builder.frames[-1]) == {} and view.node_ids() == {}


def test_a_cache_reset_or_a_server_restart_empties_the_view():
    view, builder, rec = view_with_frames()
    view.apply(stored([1, 2]))
    view.apply(AllBlocksCleared())
    assert rec.events[-1] == ResetEvent(rec.events[-1].time, "radix_cache")
    assert tree(builder.frames[-1]) == {} and view.stored_blocks() == {}
    view.apply(stored([3]))
    assert tree(builder.frames[-1]) == {1: 0}  # ids start from 1 again, as a RadixCache's do
    view.restart()
    assert isinstance(rec.events[-1], ResetEvent) and tree(builder.frames[-1]) == {}
    # The restarted server's blocks chain to nothing the old one had.
    view.apply(stored([4], parent=3))
    assert by_hash(view, builder.frames[-1]) == {3: None, 4: 3}
    assert 3 not in view.stored_blocks()  # 3 is a placeholder now


@pytest.mark.parametrize(
    "bad",
    [
        stored([1, 2], tokens=range(7)),  # 7 token ids for 2 blocks of 4
        stored([1], bs=0, tokens=[]),
        stored([1, 2], extra_keys=[None]),  # one entry per block
        stored([1, 1]),  # a chain through itself
        stored([5], parent=5),
        KVEventBatch(1.0, []),  # not an event
    ],
)
def test_a_bad_event_is_refused_and_changes_nothing(bad):
    view, builder, rec = view_with_frames()
    view.apply(stored([5, 6]))
    before, n = view.stored_blocks(), len(rec.events)
    with pytest.raises(KVEventError):
        view.apply(bad)
    assert view.stored_blocks() == before and len(rec.events) == n


def test_a_batch_skips_its_bad_events_and_applies_the_rest():
    view, builder, _ = view_with_frames()
    with pytest.raises(KVEventError, match="event 1"):
        view.extend([stored([1]), stored([2], tokens=[0]), stored([3], parent=1)])
    assert by_hash(view, builder.frames[-1]) == {1: None, 3: 1}


def test_image_token_id_needs_the_vocabulary_size():
    with pytest.raises(InvalidArgumentError):
        BlockHashTree(image_token_id=IMAGE_TOKEN_ID)


def replay_story(view: BlockHashTree) -> None:
    view.apply(llava_blocks([1, 2], MM_A))
    view.apply(llava_blocks([3, 4], MM_B))
    view.apply(stored([5, 6], parent=2))
    view.apply(BlockRemoved([2]))
    view.apply(stored([8], parent=77))
    view.apply(llava_blocks([1, 2], MM_A))
    view.apply(AllBlocksCleared())
    view.apply(llava_blocks([3, 4], MM_B))


def test_the_same_events_give_the_same_frames():
    """A committed recording is replayed under nbval: ids, names and captions must depend on
    the events only."""
    wires = []
    for _ in range(2):
        view, builder, _ = view_with_frames(image_token_id=IMAGE_TOKEN_ID, vocab_size=VOCAB_SIZE)
        replay_story(view)
        wires.append(frames_to_wire(builder.frames))
    assert wires[0] == wires[1]
    assert len(wires[0]["frames"]) > 10


# Any sequence vLLM could send, and some it would not (a hash under two parents, cycles): a
# small pool of hashes makes copies, removals of blocks with children, unseen parents and
# placeholders that become real frequent.
hashes = st.integers(1, 10)
vllm_events = st.lists(
    st.one_of(
        st.tuples(
            st.just("store"),
            st.lists(hashes, min_size=1, max_size=3, unique=True),
            st.one_of(st.none(), hashes),
        ),
        st.tuples(st.just("remove"), hashes),
        st.just(("clear",)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(events=vllm_events)
def test_the_view_draws_exactly_the_reachable_stored_blocks(events):
    view, builder, _ = view_with_frames()
    builder.every_event = False
    model: dict[int, list] = {}  # hash -> [parent, copies]: the contract, without a tree
    for op in events:
        if op[0] == "store":
            _, chain, parent = op
            if parent in chain:
                with pytest.raises(KVEventError):
                    view.apply(stored(chain, parent))
                continue
            view.apply(stored(chain, parent))
            for h in chain:
                model.setdefault(h, [parent, 0])[1] += 1
                parent = h
        elif op[0] == "remove":
            view.apply(BlockRemoved([op[1]]))
            if op[1] in model:
                model[op[1]][1] -= 1
                if not model[op[1]][1]:
                    del model[op[1]]
        else:
            view.apply(AllBlocksCleared())
            model.clear()
        frame = builder.snapshot()
        builder.layout.check()
        assert view.stored_blocks() == {h: (p, (h,) * 4) for h, (p, _) in model.items()}
        drawn = by_hash(view, frame)  # checks that every node hangs from a live node
        for h, (parent, _) in model.items():
            if parent is None or parent in drawn:  # reachable from a drawn node...
                assert drawn.get(h, "hidden") == parent  # ...so drawn, under its parent
        for h, parent in drawn.items():
            if h in model:  # a stored block, under its parent's node
                assert model[h][0] == parent
            else:  # a placeholder: under the root, holding a stored block
                assert parent is None and any(p == h for p, _ in model.values())


# ====================================================================== minirad -> vLLM
def publisher(page_size: int = 1, block_size: int = 32) -> tuple[RadixCache, RadixBlockEvents]:
    bus = EventBus()
    cache = RadixCache(page_size, bus=bus)
    return cache, RadixBlockEvents(bus, block_size=block_size)


def chain_hashes(tokens, block_size=32, extra_key=None) -> list[int]:
    """BlockPool's chained hashes of every full block, masked as vLLM publishes them."""
    manager = KVCacheManager(1, block_size)
    return [block_hash_u64(d) for d in manager.block_hashes(tokens, extra_key=extra_key)]


def test_images_go_out_as_vllm_sends_them():
    """A pad id (the image's whole hash) goes out as vLLM's placeholder plus the image's
    ``(mm_hash, offset - block start)`` in every block it overlaps, hashed as vLLM's block pool
    hashes it; a leaf that starts inside an image still gives the image's true offset."""
    bus = EventBus()
    cache = RadixCache(bus=bus)
    pub = RadixBlockEvents(bus, block_size=4, image_token_id=IMAGE_TOKEN_ID, vocab_size=VOCAB_SIZE)
    key = [10, 11] + [pad_value(MM_A, VOCAB_SIZE)] * 6 + [12, 13, 14, 15]
    cache.insert(key[:6])  # a cached prefix that ends inside the image (a prefill chunk)
    cache.insert(key)  # the new leaf starts at token 6, inside block 1
    first, rest = pub.take_events()
    tokens = [10, 11] + [IMAGE_TOKEN_ID] * 6 + [12, 13, 14, 15]
    image = [MultiModalItem(2, 6, MM_A)]
    assert first.token_ids == tokens[:4] and first.extra_keys == [[(MM_A, 2)]]
    assert rest.token_ids == tokens[4:] and rest.extra_keys == [[(MM_A, -2)], None]
    expected = KVCacheManager(1, 4).block_hashes(tokens, image)
    assert first.block_hashes + rest.block_hashes == [block_hash_u64(d) for d in expected]
    with pytest.raises(InvalidArgumentError):
        RadixBlockEvents(bus, image_token_id=IMAGE_TOKEN_ID)  # no vocab_size


def test_page_size_1_publishes_whole_blocks_only():
    cache, pub = publisher()
    tokens = [t % 7 + 10 for t in range(140)]
    cache.insert(tokens[:100])
    (s,) = pub.take_events()
    assert s == BlockStored(
        block_hashes=chain_hashes(tokens[:96]),
        parent_block_hash=None,
        token_ids=tokens[:96],
        block_size=32,
        medium="CPU",
    )
    assert all(0 <= h <= MASK_64 for h in s.block_hashes)
    cache.insert(tokens[:120])  # tokens 100..119 complete no block
    assert pub.take_events() == []
    cache.insert(tokens[:140])  # block 3 = tokens 96..127, over two edges
    (s,) = pub.take_events()
    hashes = chain_hashes(tokens[:128])
    assert (s.block_hashes, s.parent_block_hash, s.token_ids) == (
        hashes[3:],
        hashes[2],
        tokens[96:128],
    )


def test_numpy_token_ids_hash_as_the_ints_they_equal():
    cache, pub = publisher(block_size=8)
    tokens = list(range(16))
    cache.insert([np.int64(t) for t in tokens])  # a list is stored as given
    (s,) = pub.take_events()
    assert s.block_hashes == chain_hashes(tokens, 8)
    assert all(type(t) is int for t in s.token_ids)


def test_a_split_publishes_nothing_and_an_eviction_removes_what_lost_a_token():
    cache, pub = publisher()
    a = list(range(100, 180))  # 80 tokens: blocks 0 and 1
    b = a[:40] + list(range(500, 540))  # leaves a at token 40: splits a's node there
    cache.insert(a)
    cache.insert(b)
    stored_a, stored_b = pub.take_events()
    ha, hb = chain_hashes(a), chain_hashes(b)
    assert stored_a.block_hashes == ha and ha[0] == hb[0]
    assert (stored_b.block_hashes, stored_b.parent_block_hash) == (hb[1:], hb[0])
    cache.evict(1)  # a's leaf (tokens 40..79, the older one): block 1 ends in it
    assert pub.take_events() == [BlockRemoved([ha[1]], medium="CPU")]
    cache.evict(1000)  # b's leaf, then the shared 40 tokens
    assert pub.take_events() == [
        BlockRemoved([hb[1]], medium="CPU"),
        BlockRemoved([ha[0]], medium="CPU"),
    ]


def test_a_namespace_changes_every_hash():
    cache, pub = publisher(block_size=8)
    tokens = list(range(20))
    cache.insert(tokens)
    cache.insert(tokens, extra_key="lora-a")
    plain, lora = pub.take_events()
    assert plain.block_hashes == chain_hashes(tokens, 8)
    assert lora.block_hashes == chain_hashes(tokens, 8, "lora-a")
    assert not set(plain.block_hashes) & set(lora.block_hashes)
    assert lora.extra_keys == [["lora-a"], None] and plain.extra_keys is None


def test_batches_go_to_the_sink_on_flush_and_reset():
    bus = EventBus()
    cache = RadixCache(4, bus=bus)
    batches = []
    pub = RadixBlockEvents(bus, batches.append, block_size=4)
    cache.insert(list(range(8)))
    cache.insert(list(range(4)) + [9, 9, 9, 9])
    assert batches == []  # they wait for the end of the step
    pub.flush()
    assert [len(b) for b in batches] == [2]
    cache.reset()
    assert batches[-1] == [AllBlocksCleared()]
    pub.close()
    cache.insert(list(range(8)))
    pub.flush()
    assert len(batches) == 2 and pub.pending == []


@pytest.mark.parametrize("bad", [0, -32, 1.5, True, None])
def test_block_size_must_be_a_positive_int(bad):
    with pytest.raises(InvalidArgumentError):
        RadixBlockEvents(EventBus(), block_size=bad)


# ------------------------------------------------------------------ the property
def vllm_tokens(path: list[int]) -> tuple[list[int], list[MultiModalItem]]:
    """A radix path as vLLM keys it: each run of one image pad id (the image's whole hash,
    ``pad_value``) becomes placeholders plus a ``MultiModalItem`` with that hash."""
    tokens, items, i = list(path), [], 0
    for pad, run in itertools.groupby(path):
        n = len(list(run))
        if pad >= VOCAB_SIZE:
            tokens[i : i + n] = [IMAGE_TOKEN_ID] * n
            items.append(MultiModalItem(i, n, f"{pad - VOCAB_SIZE:064x}"))
        i += n
    return tokens, items


def cached_blocks(cache: RadixCache, block_size: int) -> dict[int, tuple[int | None, tuple]]:
    """``{hash: (parent hash, token ids)}`` of every full block of every path in the cache,
    read from the cache's own nodes, hashed as vLLM's block pool hashes them."""
    out = {}
    stack = [(child, list(child.key)) for child in cache.root_node.children.values()]
    while stack:
        node, path = stack.pop()
        tokens, items = vllm_tokens(path)
        manager = KVCacheManager(1, block_size)
        hashes = [block_hash_u64(d) for d in manager.block_hashes(tokens, items, node.extra_key)]
        for j, h in enumerate(hashes):
            parent = hashes[j - 1] if j else None
            out[h] = (parent, tuple(tokens[j * block_size : (j + 1) * block_size]))
        stack += [(c, path + list(c.key)) for c in node.children.values()]
    return out


def fold(batches) -> dict[int, tuple[int | None, tuple]]:
    """What the events say is stored; checks that each block is stored once, under a stored
    parent, and removed only while stored and childless."""
    state: dict[int, tuple[int | None, tuple]] = {}
    for batch in batches:
        for e in batch:
            if isinstance(e, AllBlocksCleared):
                state.clear()
            elif isinstance(e, BlockStored):
                parent, bs = e.parent_block_hash, e.block_size
                for i, h in enumerate(e.block_hashes):
                    assert h not in state, "a block published twice"
                    assert parent is None or parent in state, "a block under an unknown parent"
                    state[h] = (parent, tuple(e.token_ids[i * bs : (i + 1) * bs]))
                    parent = h
            else:
                for h in e.block_hashes:
                    del state[h]
                    assert all(p != h for p, _ in state.values()), "a parent removed first"
    return state


# Small blocks put block boundaries everywhere; 32 is vLLM's CPU block size.
BLOCK_SIZES = (4, 8, 32)
fresh_tokens = st.tuples(
    st.lists(st.integers(0, 2), max_size=12), st.integers(0, 2), st.integers(0, 70)
).map(lambda f: f[0] + [f[1]] * f[2])
ops = st.lists(
    st.one_of(
        # (an earlier key, where to cut it: k blocks plus an offset, fresh tokens), so that
        # keys share prefixes and part on a block boundary or next to one
        st.tuples(
            st.just("insert"),
            st.integers(0, 100),
            st.tuples(st.integers(0, 6), st.sampled_from([0, 0, 0, 1, -1, 3])),
            fresh_tokens,
            st.sampled_from([None, None, "ns"]),
        ),
        st.tuples(st.just("evict"), st.integers(1, 120)),
        st.just(("reset",)),
    ),
    max_size=30,
)


@settings(max_examples=100, deadline=None)
@given(ops=ops, page_size=st.sampled_from([1, 1, 4]), block_size=st.sampled_from(BLOCK_SIZES))
def test_published_blocks_are_the_full_blocks_of_the_cached_paths(ops, page_size, block_size):
    bus, view_bus = EventBus(), EventBus()
    cache = RadixCache(page_size, bus=bus)
    view = BlockHashTree(view_bus)
    builder = FrameBuilder(every_event=False)
    builder.attach(view_bus)
    batches: list[list] = []

    def publish(events: list) -> None:
        batches.append(events)
        view.extend(events)
        builder.snapshot()

    pub = RadixBlockEvents(bus, publish, block_size=block_size)
    keys: list[list[int]] = [[]]
    for op in ops:
        if op[0] == "insert":
            _, pick, (blocks, offset), fresh, extra_key = op
            key = keys[pick % len(keys)][: max(blocks * block_size + offset, 0)] + fresh
            keys.append(key)
            cache.insert(key, extra_key=extra_key)
        elif op[0] == "evict":
            cache.evict(op[1])
        else:
            cache.reset()
        pub.flush()
    expected = cached_blocks(cache, block_size)
    assert fold(batches) == expected
    assert view.stored_blocks() == expected
    assert set(view.node_ids()) == set(expected)  # nothing hidden, no placeholder
    frame = builder.snapshot()
    assert by_hash(view, frame) == {h: parent for h, (parent, _) in expected.items()}
    assert all(n.num_tokens == block_size for n in frame.live)
    builder.layout.check()


# ====================================================================== blocks -> radix nodes
def chains_with_builder() -> tuple[BlockHashTree, BlockChains, FrameBuilder, EventRecorder]:
    view = BlockHashTree()
    chains = BlockChains(view.bus)
    builder = FrameBuilder(every_event=False)
    builder.attach(chains.bus)
    return view, chains, builder, EventRecorder(chains.bus)


def apply_batch(view, chains, builder, events) -> Frame:
    view.extend(events)
    chains.flush()
    return builder.snapshot()


def nodes(builder: FrameBuilder) -> dict[tuple[int, ...], int]:
    """``{key: parent's key}``, keyed by token ids, of the tree the frames show."""
    t = builder.tree.nodes
    return {t[i].key: (t[t[i].parent].key if t[i].parent else ()) for i in t if i != 0}


def page1(hashes, parent=None, first=0) -> BlockStored:
    """SGLang at page size 1: one block per token, token ``first + i`` for block ``i``."""
    return stored(hashes, parent, range(first, first + len(hashes)), bs=1)


def test_a_run_of_pages_is_one_node_and_a_fork_splits_it():
    view, chains, builder, rec = chains_with_builder()
    apply_batch(view, chains, builder, [page1([1, 2, 3, 4, 5])])
    assert nodes(builder) == {(0, 1, 2, 3, 4): ()}
    apply_batch(view, chains, builder, [page1([6, 7], parent=3, first=10)])  # after token 2
    assert nodes(builder) == {(0, 1, 2): (), (3, 4): (0, 1, 2), (10, 11): (0, 1, 2)}
    assert [type(e).__name__ for e in rec.events[-2:]] == ["SplitEvent", "InsertEvent"]
    # Blocks stored under the end of a node: a new node, as an insert under a leaf makes one.
    apply_batch(view, chains, builder, [page1([8], parent=7, first=20)])
    assert nodes(builder)[(20,)] == (10, 11)
    assert len(view.node_ids()) == 8 and len(chains.node_ids()) == 8  # every block, 4 nodes


def test_a_removed_tail_splits_then_leaves_and_a_whole_node_leaves_at_once():
    view, chains, builder, rec = chains_with_builder()
    apply_batch(view, chains, builder, [page1([1, 2, 3, 4, 5])])
    before = len(rec.events)
    frame = apply_batch(view, chains, builder, [BlockRemoved([4, 5])])
    assert nodes(builder) == {(0, 1, 2): ()}
    kinds = [type(e).__name__ for e in rec.events[before:]]
    assert kinds == ["SplitEvent", "EvictEvent"]  # the tail: split off, then evicted
    assert [n.num_tokens for n in frame.nodes if n.state == "evicted"] == [2]
    # SGLang removes a node's pages first to last: the view takes the leaf first.
    apply_batch(view, chains, builder, [BlockRemoved([1, 2, 3])])
    assert nodes(builder) == {}
    assert type(rec.events[-1]).__name__ == "EvictEvent" and rec.events[-1].num_tokens == 3


def test_a_repeat_marks_the_path_and_a_reset_clears():
    view, chains, builder, rec = chains_with_builder()
    apply_batch(view, chains, builder, [page1([1, 2, 3])])
    frame = apply_batch(view, chains, builder, [page1([1, 2])])  # already there: accessed
    assert [n.state for n in frame.live] == ["accessed"]
    apply_batch(view, chains, builder, [AllBlocksCleared()])
    apply_batch(view, chains, builder, [page1([9], first=7)])
    assert nodes(builder) == {(7,): ()} and chains.node_ids() == {1: 1}  # ids from 1 again


def test_a_placeholder_stays_a_node_of_its_own():
    view, chains, builder, _ = chains_with_builder()
    apply_batch(view, chains, builder, [page1([5, 6], parent=99, first=3)])
    assert nodes(builder) == {(): (), (3, 4): ()}  # the unknown parent, then the run under it


def random_ops(seed: int, n: int = 150) -> list[tuple]:
    """Inserts that branch off earlier keys anywhere (a tree with many forks), evictions of a
    few tokens and a rare reset."""
    rng = np.random.default_rng(seed)
    out: list[tuple] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.7:
            fresh = [int(t) for t in rng.integers(0, 50, int(rng.integers(1, 12)))]
            cut = (int(rng.integers(0, 8)), int(rng.integers(-1, 4)))
            out.append(("insert", int(rng.integers(0, 1000)), cut, fresh, None))
        elif r < 0.98:
            out.append(("evict", int(rng.integers(1, 30))))
        else:
            out.append(("reset",))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_compact_view_on_a_bushy_tree(seed):
    test_compact_view_draws_the_block_views_paths_in_fewer_nodes.hypothesis.inner_test(
        random_ops(seed), 1 + 3 * (seed % 2)
    )


@settings(max_examples=60, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 1, 4]))
def test_compact_view_draws_the_block_views_paths_in_fewer_nodes(ops, block_size):
    bus = EventBus()
    cache = RadixCache(1, bus=bus)
    view = BlockHashTree()
    chains = BlockChains(view.bus)
    blocks, compact = FrameBuilder(every_event=False), FrameBuilder(every_event=False)
    blocks.attach(view.bus)
    compact.attach(chains.bus)

    def publish(events: list) -> None:
        view.extend(events)
        chains.flush()
        blocks.snapshot()
        compact.snapshot()

    pub = RadixBlockEvents(bus, publish, block_size=block_size)
    keys: list[list[int]] = [[]]
    for op in ops:
        if op[0] == "insert":
            _, pick, (n, offset), fresh, _ = op
            key = keys[pick % len(keys)][: max(n * block_size + offset, 0)] + fresh
            keys.append(key)
            cache.insert(key)
        elif op[0] == "evict":
            cache.evict(op[1])
        else:
            cache.reset()
        pub.flush()
    assert leaf_paths(compact) == leaf_paths(blocks)
    assert len(compact.tree.nodes) <= len(blocks.tree.nodes)
    assert set(chains.node_ids()) == set(view.node_ids().values())  # every drawn block
    assert all(node.key for node in compact.tree.nodes.values() if node.id != 0)
    compact.layout.check()


def leaf_paths(builder: FrameBuilder) -> set[tuple[int, ...]]:
    """The token ids from the root to each leaf of the tree the frames show."""
    t = builder.tree.nodes
    out, stack = set(), [(0, ())]
    while stack:
        i, path = stack.pop()
        path += t[i].key
        live = [c for c in t[i].children if c in t]
        if not live and i != 0:
            out.add(path)
        stack += [(c, path) for c in live]
    return out


# ====================================================================== the engine
@pytest.fixture(scope="module")
def shipped():
    from minirad.models import load_model

    return load_model(SHIPPED)


PROMPT = "<|im_start|>user\n<image>\n{}<|im_end|>\n<|im_start|>assistant\n"


def test_the_engine_publishes_nothing_unless_asked(shipped):
    from minirad.engine import LLMEngine

    engine = LLMEngine(*shipped)
    assert engine.kv_events is None and engine.kv_event_publisher is None
    engine.generate(["<|im_start|>user\nHello<|im_end|>\n"])
    assert not engine.bus.active  # no subscriber: the tree builds no events at all
    engine.close()  # nothing to close


def test_the_engine_checks_the_block_size_before_opening_a_socket(shipped):
    from minirad.engine import LLMEngine

    with pytest.raises(InvalidArgumentError, match="block_size"):
        LLMEngine(*shipped, kv_events_endpoint="tcp://127.0.0.1:*", kv_events_block_size=0)


def collect_batches(sub: KVEventSubscriber, last_seq: int) -> list[KVEventBatch]:
    """``sub.recv`` until batch ``last_seq`` has come (100 rounds of 0.1 s at most)."""
    got: dict[int, KVEventBatch] = {}
    notices = []
    for _ in range(100):
        for item in sub.recv(0.1):
            if isinstance(item, Notice):
                notices.append(item)
            else:
                got[item[0]] = item[1]
        if last_seq in got:
            break
    assert sorted(got) == list(range(last_seq + 1)), notices
    assert not [n for n in notices if n.kind in ("lost", "bad_frame", "restart")]
    return [got[s] for s in range(last_seq + 1)]


def test_our_engine_publishes_to_the_view_through_zmq(shipped):
    """Our engine -> KVEventPublisher -> ZMQ -> KVEventSubscriber -> BlockHashTree ->
    FrameBuilder, on the shipped model with a pool small enough to evict."""
    from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
    from viz.sources import engine_image_names

    images = [
        Image.open(p).convert("RGB") for p in sorted((REPO / "data" / "images").glob("*.png"))[:3]
    ]
    engine = LLMEngine(
        *shipped,
        num_kv_slots=160,
        max_num_seqs=1,
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
    )
    sent: list[int] = []
    publish = engine.kv_events.sink
    engine.kv_events.sink = lambda events: sent.append(publish(events))
    params = SamplingParams(max_new_tokens=8)
    order = [0, 1, 0, 2, 1]
    try:
        engine.generate(
            [
                GenerateRequest(PROMPT.format("Describe the image."), [images[i]], params)
                for i in order
            ]
        )
        endpoint = engine.kv_event_publisher.endpoint
        replay = engine.kv_event_publisher.replay_endpoint
        with KVEventSubscriber(endpoint, replay, replay_timeout_s=0.5, probe_interval_s=0.2) as sub:
            batches = collect_batches(sub, sent[-1])
    finally:
        engine.close()
    assert engine.kv_events is None

    names = engine_image_names(engine, images)
    view, builder, _ = view_with_frames(
        image_token_id=IMAGE_TOKEN_ID, vocab_size=VOCAB_SIZE, images=names
    )
    for batch in batches:
        view.extend(batch.events)
    events = [e for b in batches for e in b.events]
    assert {e.medium for e in events} == {"CPU"}
    assert {e.block_size for e in events if isinstance(e, BlockStored)} == {32}
    assert any(isinstance(e, BlockRemoved) for e in events)  # the pool was too small
    assert any(n.state == "evicted" for f in builder.frames for n in f.nodes)

    expected = cached_blocks(engine.tree_cache, 32)
    assert view.stored_blocks() == expected and set(view.node_ids()) == set(expected)
    frame = builder.frames[-1]
    assert by_hash(view, frame) == {h: parent for h, (parent, _) in expected.items()}
    # Every prompt's first block holds the start of its image: one chip, named by our hash.
    firsts = [n for n in frame.live if n.parent == 0]
    assert firsts and all(n.label.images[0][:2] == (3, 29) for n in firsts)
    assert {n.label.images[0][2] for n in firsts} <= set(names.values())
    seen = {n.label.images[0][2] for f in builder.frames for n in f.live if n.parent == 0}
    assert seen == set(names.values())  # all three images were drawn at some point
