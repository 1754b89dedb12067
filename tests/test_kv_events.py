"""vLLM's KV-event wire format (``minirad.kv_events``), without vLLM: the structs against frames
shaped like a real vLLM 0.32 server's and SGLang 0.5's, bad frames, and the subscriber against
our publisher playing a server that drops, restarts, answers late or not at all.

Every socket is on 127.0.0.1 with a port the OS picks (``tcp://127.0.0.1:*``). Loops that wait
for the network are bounded by a number of rounds, never by a timed assert.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from minirad.errors import InvalidArgumentError, KVEventError
from minirad.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVEventSubscriber,
    Notice,
    decode_frames,
    encode_batch,
    load_recording,
    save_recording,
)

U64 = 2**64 - 1
ANY_PORT = "tcp://127.0.0.1:*"
FAST = {"replay_timeout_s": 0.5, "probe_interval_s": 0.2}
MM_HASH = "61906bc9c5ab53d2d6ed8d3e3c3c7f0c0e4d1b1a8a7c5b3c2b2a1f0e9d8c7e3925"


def real_vllm_payload() -> bytes:
    """A batch as vLLM 0.32's msgspec structs encode it (omit_defaults: a None ``extra_keys`` or
    ``group_idx`` is left out, ``lora_id``/``medium``/``lora_name`` are always there), with
    the field values of a real LLaVA request and a field from a newer vLLM (``locality``)."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [10858815316924877513, 16170593611046256769],
        "parent_block_hash": None,
        "token_ids": [1, 432, 202] + [3] * 61,
        "block_size": 32,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [[[MM_HASH, 3]], [[MM_HASH, -29]]],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "locality": "LOCAL",
    }
    removed = {"type": "BlockRemoved", "block_hashes": [16170593611046256769], "medium": "GPU"}
    return msgspec.msgpack.encode(
        [1712345678.25, [stored, removed, {"type": "AllBlocksCleared"}], 0]
    )


def sglang_payload(medium_field: bool = True, metadata: bool = False) -> bytes:
    """A batch as SGLang 0.5 encodes it: array events ``[tag, fields...]``, signed hashes,
    ``attn_dp_rank``; older versions omit a trailing None, ``BlockStoredWithMetadata`` appends
    a map."""
    stored = ["BlockStored", [-5, 7], -(2**63), [11] * 64, 32, None]
    if medium_field:
        stored.append("CPU_PINNED")
    if metadata:
        stored.append({"cache_salt": "s"})
    removed = ["BlockRemoved", [-5], "GPU"] if medium_field else ["BlockRemoved", [-5]]
    return msgspec.msgpack.encode([3.5, [stored, removed, ["AllBlocksCleared"]], 1])


def stored(h: int, parent: int | None = None) -> BlockStored:
    return BlockStored([h], parent, list(range(32)), 32, medium="GPU")


def collect(sub: KVEventSubscriber, done, rounds: int = 100, act=None) -> list:
    """``sub.recv`` until ``done(items)`` (calling ``act()`` between rounds); fails after
    ``rounds`` rounds of 0.1 s."""
    items: list = []
    for _ in range(rounds):
        if act is not None:
            act()
        items += sub.recv(0.1)
        if done(items):
            return items
    pytest.fail(f"gave up waiting; got {items!r}")


def seqs(items) -> list[int]:
    return [it[0] for it in items if not isinstance(it, Notice)]


def notices(items, kind: str) -> list[Notice]:
    return [it for it in items if isinstance(it, Notice) and it.kind == kind]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ wire format
def test_decodes_a_real_vllm_batch():
    seq, topic, batch = decode_frames([b"", (41).to_bytes(8, "big"), real_vllm_payload()])
    assert (seq, topic, batch.ts, batch.data_parallel_rank) == (41, b"", 1712345678.25, 0)
    s, r, c = batch.events
    assert s == BlockStored(
        block_hashes=[10858815316924877513, 16170593611046256769],
        parent_block_hash=None,
        token_ids=[1, 432, 202] + [3] * 61,
        block_size=32,
        medium="GPU",
        extra_keys=[[[MM_HASH, 3]], [[MM_HASH, -29]]],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    assert r == BlockRemoved([16170593611046256769], medium="GPU")
    assert c == AllBlocksCleared()


def test_encodes_in_vllms_shape():
    """What vLLM's own decoder needs: an array batch, maps tagged "type", and the fields it
    declares without defaults present even when None."""
    batch = KVEventBatch(2.0, [stored(U64), BlockRemoved([1]), AllBlocksCleared()], 0)
    topic, seq, payload = encode_batch(7, batch, topic=b"kv")
    assert (topic, seq) == (b"kv", (7).to_bytes(8, "big"))
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert (ts, rank) == (2.0, 0)
    assert [e["type"] for e in events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert {"lora_id", "medium", "lora_name"} <= events[0].keys()
    assert events[0]["block_hashes"] == [U64]


hashes = st.lists(st.integers(0, U64), min_size=1, max_size=4)
events = st.one_of(
    st.builds(
        BlockStored,
        hashes,
        st.none() | st.integers(0, U64),
        st.lists(st.integers(0, 1023), max_size=64),
        st.just(32),
        lora_id=st.none() | st.integers(0, 9),
        medium=st.sampled_from([None, "GPU", "CPU"]),
        extra_keys=st.none() | st.lists(st.none() | st.just([[MM_HASH, -3]]), max_size=4),
    ),
    st.builds(BlockRemoved, hashes, medium=st.sampled_from([None, "GPU"])),
    st.just(AllBlocksCleared()),
)
batches = st.builds(KVEventBatch, st.floats(0, 2e9), st.lists(events, max_size=5), st.just(0))


@given(st.integers(0, U64 - 1), batches)
def test_encode_decode_round_trip(seq, batch):
    assert decode_frames(encode_batch(seq, batch)) == (seq, b"", batch)


@pytest.mark.parametrize(
    ("medium_field", "metadata"), [(True, False), (False, False), (True, True)]
)
def test_decodes_sglang_batches(medium_field, metadata):
    frames = [b"", (0).to_bytes(8, "big"), sglang_payload(medium_field, metadata)]
    _, _, batch = decode_frames(frames, schema="sglang")
    assert batch.data_parallel_rank == 1  # attn_dp_rank
    s, r, c = batch.events
    # Signed hashes made unsigned: -5 and 2**64 - 5 are the same 64 bits.
    assert s.block_hashes == [2**64 - 5, 7] and s.parent_block_hash == 2**63
    assert (s.token_ids, s.block_size, s.extra_keys) == ([11] * 64, 32, None)
    assert s.medium == ("CPU_PINNED" if medium_field else None)
    assert r == BlockRemoved([2**64 - 5], medium="GPU" if medium_field else None)
    assert c == AllBlocksCleared()


def test_wrong_schema_says_which_one_fits():
    with pytest.raises(KVEventError, match="schema='sglang'.*tagged arrays"):
        decode_frames([b"", bytes(8), sglang_payload()], schema="vllm")
    with pytest.raises(InvalidArgumentError):
        decode_frames([b"", bytes(8), real_vllm_payload()], schema="trtllm")


BAD_FRAMES = {
    "two frames": [bytes(8), real_vllm_payload()],
    "four frames": [b"", bytes(8), real_vllm_payload(), b""],
    "seq of 7 bytes": [b"", bytes(7), real_vllm_payload()],
    "not bytes": [b"", bytes(8), "text"],
    "garbage": [b"", bytes(8), b"\xc1\xc1 not msgpack"],
    "truncated": [b"", bytes(8), real_vllm_payload()[:-20]],
    "empty payload": [b"", bytes(8), b""],
    "a map, not a batch": [b"", bytes(8), msgspec.msgpack.encode({"ts": 1.0})],
    "unknown event type": [b"", bytes(8), msgspec.msgpack.encode([1.0, [{"type": "Nope"}], 0])],
    "hash is a string": [
        b"",
        bytes(8),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["ab"]}], 0]),
    ],
    "bytes hashes": [
        b"",
        bytes(8),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [b"\x01"]}], 0]),
    ],
}


@pytest.mark.parametrize("frames", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_bad_frames_raise_kv_event_error(frames):
    with pytest.raises(KVEventError):
        decode_frames(frames)


def test_bytes_hashes_get_a_hint():
    with pytest.raises(KVEventError, match="VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"):
        decode_frames(BAD_FRAMES["bytes hashes"])


@pytest.mark.parametrize(
    "bad",
    [lambda: encode_batch(-1, KVEventBatch(0.0, [])), lambda: encode_batch(0, "batch")],
)
def test_encode_rejects_bad_input(bad):
    with pytest.raises(InvalidArgumentError):
        bad()


# ------------------------------------------------------------------------------ recordings
@settings(max_examples=25)
@given(st.lists(st.tuples(st.integers(0, 2**40), batches), max_size=4))
def test_recording_round_trip(tmp_path_factory, items):
    path = tmp_path_factory.mktemp("rec") / "events.jsonl"
    save_recording(items, path)
    assert load_recording(path) == items
    first = path.read_bytes()
    save_recording(load_recording(path), path)
    assert path.read_bytes() == first  # deterministic


def test_recording_writes_hashes_as_hex(tmp_path):
    path = save_recording(
        [(0, KVEventBatch(1.0, [stored(U64, parent=2**53 + 1)], 0))], tmp_path / "r"
    )
    event = json.loads(path.read_text())["events"][0]
    assert event["block_hashes"] == ["ffffffffffffffff"]
    assert event["parent_block_hash"] == "0020000000000001"
    assert "lora_id" not in event  # None fields left out
    assert load_recording(path)[0][1].events[0].parent_block_hash == 2**53 + 1


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        '{"seq": 0, "ts": 1.0}',
        '{"seq": -1, "ts": 1.0, "events": []}',
        '{"seq": 0, "ts": 1.0, "events": [{"type": "BlockRemoved", "block_hashes": [5]}]}',
        '{"seq": 0, "ts": 1.0, "events": [{"type": "Nope"}]}',
    ],
)
def test_bad_recording_line_names_its_number(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"seq": 0, "ts": 1.0, "events": []}\n' + line + "\n")
    with pytest.raises(KVEventError, match=r"bad.jsonl:2:"):
        load_recording(path)


# ------------------------------------------------------------------------------ publisher
def test_publisher_answers_replay_as_vllm_does():
    """DEALER sends [b"", start]; the ROUTER answers [b"", topic, seq, payload] from start on,
    then [b"", b"", -1, b""]."""
    with KVEventPublisher(ANY_PORT, ANY_PORT, topic="kv") as pub:
        sent = [pub.publish([stored(i)], ts=float(i)) for i in range(4)]
        assert sent == [0, 1, 2, 3]
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        replies = []
        while dealer.poll(5000):
            replies.append(dealer.recv_multipart())
            if replies[-1][2] == END_SEQ:
                break
        dealer.close(linger=0)
    assert [len(r) for r in replies] == [4, 4, 4]
    assert replies[-1] == [b"", b"", END_SEQ, b""]
    decoded = [decode_frames(r[1:]) for r in replies[:2]]
    assert [(s, t) for s, t, _ in decoded] == [(2, b"kv"), (3, b"kv")]
    assert decoded[0][2] == KVEventBatch(2.0, [stored(2)], 0)


def test_a_peer_that_asks_for_replays_and_never_reads_cannot_grow_the_server():
    """3000 replay requests from a peer that reads nothing grew the server by 50 MB: each
    answer queued without bound. Now one peer's queue holds one replay at most, the rest is
    dropped, and a peer that reads still gets its whole replay."""
    psutil = pytest.importorskip("psutil")
    me = psutil.Process()
    with KVEventPublisher(ANY_PORT, ANY_PORT, buffer_size=100) as pub:
        for i in range(100):
            pub.publish([BlockStored([i], None, list(range(256)), 256, medium="GPU")])
        greedy = zmq.Context.instance().socket(zmq.DEALER)
        greedy.setsockopt(zmq.RCVHWM, 1)
        greedy.connect(pub.replay_endpoint)
        before = me.memory_info().rss
        for _ in range(3000):
            greedy.send_multipart([b"", (0).to_bytes(8, "big")])
        grown = 0
        for _ in range(60):  # while the server answers them (a bound in rounds, not time)
            time.sleep(0.05)
            grown = max(grown, me.memory_info().rss - before)
        reader = zmq.Context.instance().socket(zmq.DEALER)
        reader.connect(pub.replay_endpoint)
        reader.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while reader.poll(5000):
            frames = reader.recv_multipart()
            if frames[2] == END_SEQ:
                break
            seqs.append(int.from_bytes(frames[2], "big"))
        greedy.close(linger=0)
        reader.close(linger=0)
    assert seqs == list(range(100))
    assert grown < 30 * 2**20, f"the server grew by {grown / 2**20:.0f} MB"


def test_a_loopback_address_listens_on_loopback_alone():
    """Unlike vLLM's rule (only ``*`` binds, on every interface), ``tcp://127.0.0.1:PORT``
    binds: a fixed port that only this machine can reach."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with KVEventPublisher(f"tcp://127.0.0.1:{port}") as pub:
        assert pub.endpoint == f"tcp://127.0.0.1:{port}"
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        for _ in range(100):
            pub.publish([AllBlocksCleared()])
            if sub.poll(50):
                break
        assert decode_frames(sub.recv_multipart())[2].events == [AllBlocksCleared()]
        sub.close(linger=0)


def test_publisher_connects_to_an_address_neither_wildcard_nor_loopback():
    """vLLM's rule: ``tcp://HOST:PORT`` connects (to a bound subscriber or proxy); 0.0.0.0 is
    neither ``*`` nor a loopback address, and connecting to it reaches this machine."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    with KVEventPublisher(f"tcp://0.0.0.0:{port}") as pub:
        for _ in range(100):
            pub.publish([AllBlocksCleared()])
            if sub.poll(50):
                break
        seq, _, batch = decode_frames(sub.recv_multipart())
    sub.close(linger=0)
    assert batch.events == [AllBlocksCleared()]


@pytest.mark.parametrize(
    "events",
    [["BlockStored"], [BlockRemoved([-1])], [BlockRemoved([2**64])], [stored(1, parent=-2)]],
)
def test_publish_rejects_bad_events(events):
    with KVEventPublisher(ANY_PORT) as pub:
        with pytest.raises(InvalidArgumentError):
            pub.publish(events)


def test_publisher_reports_a_port_in_use():
    with KVEventPublisher(ANY_PORT) as pub:
        with pytest.raises(InvalidArgumentError, match="cannot open"):
            KVEventPublisher(pub.endpoint.replace("127.0.0.1", "*"))


def test_publisher_closes_cleanly():
    pub = KVEventPublisher(ANY_PORT, ANY_PORT)
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    pub.close()
    pub.close()  # idempotent
    assert "kv-event-replay" not in [t.name for t in threading.enumerate()]
    with pytest.raises(InvalidArgumentError):
        pub.publish([AllBlocksCleared()])
    KVEventPublisher(endpoint.replace("127.0.0.1", "*"), replay).close()  # ports are free again


# ------------------------------------------------------------------------------ subscriber
@settings(max_examples=20)
@given(st.lists(st.booleans(), min_size=1, max_size=12), st.integers(0, 4))
def test_gaps_are_recovered_through_replay(live, before):
    """Batches the PUB dropped (``live=False``) anywhere, the last ones included, and batches
    sent before the subscriber joined, all arrive once, in order, and nothing is lost."""
    with KVEventPublisher(ANY_PORT, ANY_PORT) as pub:
        for i in range(before):
            pub.publish([stored(i)])
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, **FAST) as sub:
            collect(sub, lambda items: notices(items, "connected"))  # joined
            for i, flag in enumerate(live):
                pub.publish([stored(before + i)], live=flag)
            n = before + len(live)
            items = collect(sub, lambda items: len(seqs(items)) >= n - before)
    got = [it for it in items if not isinstance(it, Notice)]
    assert [s for s, _ in got] == list(range(before, n))
    assert [b.events[0].block_hashes[0] for _, b in got] == list(range(before, n))
    assert not notices(items, "lost") and not notices(items, "bad_frame")


def test_slow_joiner_gets_the_batches_sent_before_it_connected():
    """PUB/SUB drops what is published before a subscriber connects: the replay supplies it,
    and the live stream then follows on without a duplicate."""
    with KVEventPublisher(ANY_PORT, ANY_PORT) as pub:
        for i in range(10):
            pub.publish([stored(i)])
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, **FAST) as sub:
            items = collect(sub, lambda items: len(seqs(items)) >= 10)
            items += collect(
                sub, lambda more: len(seqs(more)) >= 3, act=lambda: pub.publish([stored(99)])
            )
    assert seqs(items) == list(range(len(seqs(items))))
    (recovered, *_) = notices(items, "recovered")
    assert recovered.message.startswith("recovered batches 0 to 9 through the replay socket")


def test_slow_joiner_without_replay_is_reported_lost():
    with KVEventPublisher(ANY_PORT) as pub:
        for i in range(5):
            pub.publish([stored(i)])
        with KVEventSubscriber(pub.endpoint, **FAST) as sub:
            items = collect(sub, lambda items: seqs(items), act=lambda: pub.publish([]))
    (lost,) = notices(items, "lost")
    first = seqs(items)[0]
    assert first >= 5 and lost.seq == 0
    assert (
        f"batches 0 to {first - 1} missed" in lost.message and "no replay endpoint" in lost.message
    )


def test_a_restart_without_replay_is_not_blamed_on_joining_late():
    """After a restart, a missed seq 0 was dropped, not "sent before this subscriber
    connected": it has been connected all along."""
    pub = KVEventPublisher(ANY_PORT)
    sub = KVEventSubscriber(pub.endpoint, **FAST)
    try:
        collect(sub, lambda items: len(seqs(items)) >= 30, act=lambda: pub.publish([stored(1)]))
        endpoint = pub.endpoint
        pub.close()
        pub = KVEventPublisher(endpoint.replace("127.0.0.1", "*"))  # a new process: seq from 0
        pub.publish([stored(3)], live=False)  # its seq 0 never reaches the subscriber
        items = collect(
            sub,
            lambda items: notices(items, "restart") and notices(items, "lost"),
            act=lambda: pub.publish([stored(4)]),
        )
    finally:
        sub.close()
        pub.close()
    (lost,) = notices(items, "lost")
    assert lost.seq == 0 and "before this subscriber connected" not in lost.message


def test_what_replay_no_longer_holds_is_reported():
    with KVEventPublisher(ANY_PORT, ANY_PORT, buffer_size=3) as pub:
        for i in range(10):
            pub.publish([stored(i)])
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, **FAST) as sub:
            items = collect(sub, lambda items: len(seqs(items)) >= 3)
    (lost,) = notices(items, "lost")
    assert (lost.seq, seqs(items)) == (0, [7, 8, 9])
    assert "batches 0 to 6 missed" in lost.message and "replay buffer" in lost.message
    assert items.index(lost) < next(i for i, it in enumerate(items) if not isinstance(it, Notice))


def test_a_gap_newer_than_the_replay_request_is_asked_for_again():
    """The server may read a replay request before it publishes the batch that the live stream
    then drops: an answer without it does not mean it is gone. A hand-driven server: XPUB (to
    see the subscription arrive) and ROUTER."""
    ctx = zmq.Context.instance()
    xpub, router = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)
    port, rport = (s.bind_to_random_port("tcp://127.0.0.1") for s in (xpub, router))
    frames = [encode_batch(i, KVEventBatch(float(i), [stored(i)], 0)) for i in range(2)]
    slow = {"replay_timeout_s": 5.0, "probe_interval_s": 5.0}
    with KVEventSubscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", **slow) as sub:
        for _ in range(100):  # until subscribed, and the first probe (from seq 0) is here
            assert not sub.recv(0.05)
            if xpub.poll(0) and router.poll(0):
                break
        xpub.recv()
        ident, _, start = router.recv_multipart()
        assert int.from_bytes(start, "big") == 0
        xpub.send_multipart(frames[1])  # seq 0 never goes out live
        assert not sub.recv(0.2)  # batch 1 waits for batch 0
        router.send_multipart([ident, b"", b"", END_SEQ, b""])  # answered "before" seq 0 existed

        def serve():
            while router.poll(0):
                ident, _, start = router.recv_multipart()
                assert int.from_bytes(start, "big") == 0
                router.send_multipart([ident, b"", *frames[0]])
                router.send_multipart([ident, b"", b"", END_SEQ, b""])

        items = collect(sub, lambda items: len(seqs(items)) >= 2, act=serve)
    xpub.close(linger=0)
    router.close(linger=0)
    assert seqs(items) == [0, 1] and not notices(items, "lost")


@pytest.mark.parametrize("old_batches", [1, 5])
def test_restart_is_noticed_and_the_new_server_followed(old_batches):
    """A new server on the same ports starts at seq 0 again. With 5 old batches its seqs go
    backwards; with 1, the SUB may miss the new seq 0 while it reconnects and see seq 1 next,
    which looks like a continuation: the check after the reconnect tells them apart."""
    old = KVEventPublisher(ANY_PORT, ANY_PORT)
    endpoint, replay = old.endpoint, old.replay_endpoint
    with KVEventSubscriber(endpoint, replay, **FAST) as sub:
        for i in range(old_batches):
            old.publish([stored(100 + i)])
        before = collect(sub, lambda items: len(seqs(items)) >= old_batches)
        old.close()
        with KVEventPublisher(endpoint.replace("127.0.0.1", "*"), replay) as new:
            sent: list[int] = []
            after = collect(
                sub,
                lambda items: notices(items, "restart") and len(seqs(items)) >= 3,
                act=lambda: sent.append(new.publish([stored(200 + len(sent))])),
            )
    assert seqs(before) == list(range(old_batches))
    (restart,) = notices(after, "restart")
    assert restart.message.startswith("vLLM restarted") and "empty" in restart.message
    rest = after[after.index(restart) + 1 :]
    got = [it for it in rest if not isinstance(it, Notice)]
    # After the restart: the new server's batches from 0, none missing (what the SUB missed
    # while reconnecting comes through the replay), none of the old server's.
    assert not seqs(after[: after.index(restart)])
    assert [s for s, _ in got] == list(range(len(got)))
    assert [b.events[0].block_hashes[0] for _, b in got] == [200 + s for s, _ in got]
    assert not notices(after, "lost")


def test_restart_is_noticed_before_the_new_server_publishes():
    """The probe asks for the last batch delivered: a new server does not have it."""
    old = KVEventPublisher(ANY_PORT, ANY_PORT)
    endpoint, replay = old.endpoint, old.replay_endpoint
    with KVEventSubscriber(endpoint, replay, **FAST) as sub:
        for i in range(3):
            old.publish([stored(i)])
        collect(sub, lambda items: len(seqs(items)) >= 3)
        old.close()
        with KVEventPublisher(endpoint.replace("127.0.0.1", "*"), replay):
            items = collect(sub, lambda items: notices(items, "restart"))
    assert "no longer has batch 2" in notices(items, "restart")[0].message
    assert not seqs(items)


def test_garbage_is_skipped_and_the_subscriber_keeps_running():
    pub = zmq.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    good = encode_batch(0, KVEventBatch(1.0, [stored(1)], 0))

    def send():
        for frames in BAD_FRAMES.values():
            if all(isinstance(f, bytes) for f in frames):
                pub.send_multipart(frames)
        pub.send(b"one frame")
        pub.send_multipart(good)

    with KVEventSubscriber(f"tcp://127.0.0.1:{port}", **FAST) as sub:
        items = collect(sub, seqs, act=send)
    pub.close(linger=0)
    bad = notices(items, "bad_frame")
    assert len(bad) >= len(BAD_FRAMES) - 1  # each before the first good batch was skipped
    assert all(n.message.startswith("skipped a bad message") for n in bad)
    assert items[-1] == (0, KVEventBatch(1.0, [stored(1)], 0))


def test_dead_endpoint_is_reported_then_a_late_server_followed():
    endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    with KVEventSubscriber(endpoint, replay, **FAST) as sub:
        items = collect(sub, lambda items: notices(items, "no_server"), rounds=30)
        (dead,) = notices(items, "no_server")
        assert f"no vLLM answering at {replay}" in dead.message
        assert f"still listening on {endpoint}" in dead.message
        assert not collect(sub, lambda items: True)  # not repeated while still dead
        with KVEventPublisher(endpoint.replace("127.0.0.1", "*"), replay) as pub:
            pub.publish([stored(1)])
            # The batch may come on the live socket before the probe that says "connected".
            later = collect(
                sub, lambda items: seqs(items) and notices(items, "connected"), rounds=30
            )
    assert notices(later, "connected") and seqs(later) == [0]


def test_silence_without_replay_is_reported():
    with KVEventSubscriber(f"tcp://127.0.0.1:{free_port()}", **FAST) as sub:
        items = collect(sub, lambda items: items, rounds=30)
    (silent,) = items
    assert silent.kind == "silent" and "look the same" in silent.message


def test_sglang_server_replies_without_a_topic_frame():
    """SGLang's replay replies are [b"", seq, payload] and [b"", END, b""]."""
    ctx = zmq.Context.instance()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    port, rport = (s.bind_to_random_port("tcp://127.0.0.1") for s in (pub, router))
    payload = sglang_payload()

    def serve():
        while router.poll(0):
            ident, _, start = router.recv_multipart()
            for seq in range(int.from_bytes(start, "big"), 2):
                router.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
            router.send_multipart([ident, b"", END_SEQ, b""])
        pub.send_multipart([b"", (2).to_bytes(8, "big"), payload])

    with KVEventSubscriber(
        f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", schema="sglang", **FAST
    ) as sub:
        items = collect(sub, lambda items: len(seqs(items)) >= 3, act=serve)
    pub.close(linger=0)
    router.close(linger=0)
    assert seqs(items)[:3] == [0, 1, 2]
    first = next(it for it in items if not isinstance(it, Notice))
    assert first[1].events[0].medium == "CPU_PINNED" and not notices(items, "lost")
    [layout] = notices(items, "layout")  # said once, before the first batch
    assert items.index(layout) < items.index(first) and "tagged arrays" in layout.message
    assert sub.layout == "arrays"


def test_background_thread_delivers_and_stops_on_close():
    got: list = []
    with KVEventPublisher(ANY_PORT, ANY_PORT) as pub:
        sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint, **FAST)
        sub.start(got.append)
        with pytest.raises(InvalidArgumentError):
            sub.recv(0.1)  # the thread owns the sockets
        for i in range(3):
            pub.publish([stored(i)])
        for _ in range(100):
            if len(seqs(got)) >= 3:
                break
            time.sleep(0.05)
        sub.close()
    assert seqs(got) == [0, 1, 2]
    assert "kv-event-subscriber" not in [t.name for t in threading.enumerate()]
    sub.close()  # idempotent
    with pytest.raises(InvalidArgumentError, match="closed"):
        sub.recv(0.1)


def test_subscriber_rejects_bad_arguments():
    with pytest.raises(InvalidArgumentError):
        KVEventSubscriber("not an endpoint")
    with pytest.raises(InvalidArgumentError):
        KVEventSubscriber("tcp://127.0.0.1:1", "nonsense")
    with pytest.raises(InvalidArgumentError):
        KVEventSubscriber("tcp://127.0.0.1:1", schema="trtllm")
    with pytest.raises(InvalidArgumentError):
        KVEventSubscriber("tcp://127.0.0.1:1", replay_timeout_s=0)


@pytest.mark.parametrize("endpoint, replay", [(None, None), (123, None), ("tcp://127.0.0.1:5", 7)])
def test_an_endpoint_that_is_not_a_string_is_refused(endpoint, replay):
    with pytest.raises(InvalidArgumentError, match="ZMQ address string"):
        KVEventSubscriber(endpoint, replay)
