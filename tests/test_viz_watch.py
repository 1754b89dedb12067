"""viz.watch / viz.replay_recording: a block cache drawn from KV events.

The live tests use minirad's own ``KVEventPublisher`` as the server (real ZMQ sockets on
127.0.0.1, no vLLM): it speaks vLLM's wire format, replay socket included, and a test can make
it drop a batch, restart, or send garbage. ``tests/test_browser_vllm.py`` does the same with
the real vLLM in JupyterLab.
"""

import time

import zmq

import viz
from minirad.course import recordings
from minirad.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    encode_batch,
)

WAIT_S = 15.0


def stored(hashes, parent=None, first_token=10):
    n = 32 * len(hashes)
    return BlockStored(list(hashes), parent, list(range(first_token, first_token + n)), 32)


def wait_for(condition, what: str, act=None) -> None:
    """Poll ``condition`` (calling ``act()`` before each try) until it holds or WAIT_S pass."""
    deadline = time.monotonic() + WAIT_S
    while True:
        if act is not None:
            act()
        if condition():
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def live_nodes(view) -> int:
    return len(view.frames[-1].live) if view.frames else 0


def publisher() -> KVEventPublisher:
    return KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")


def test_the_committed_recording_replays_to_the_chapters_tree():
    session = recordings.load()
    view = viz.replay_recording(session.batches)
    # One frame per batch after the empty one, titled by seq; the final tree holds every
    # block the events stored and did not remove.
    assert [f.title for f in view.frames[1:]] == [
        f"seq {seq}: {len(b.events)} event{'s' * (len(b.events) != 1)}"
        for seq, b in session.batches
    ]
    blocks = {}
    for _, batch in session.batches:
        for e in batch.events:
            if isinstance(e, BlockStored):
                blocks.update(dict.fromkeys(e.block_hashes))
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    blocks.pop(h, None)
    assert live_nodes(view) == len(blocks) > 0
    # Every image the session sent is a chip of its own: the fork at the image.
    chips = {name for f in view.frames for n in f.nodes if n.label for _, _, name in n.label.images}
    assert len(chips) == len({o.request.image for o in session.outputs})
    again = viz.replay_recording(session.batches)
    assert [f.to_dict({}) for f in again.frames] == [f.to_dict({}) for f in view.frames]


def test_watch_draws_a_server_and_survives_garbage_gaps_and_a_restart():
    pub = publisher()
    view = viz.watch(pub.endpoint, pub.replay_endpoint)
    try:
        wait_for(lambda: view.status.startswith("vLLM answering at"), "the probe")
        pub.publish([stored([1, 2])])
        wait_for(lambda: live_nodes(view) == 2, "two blocks")
        # A batch the live stream never carried is fetched through the replay socket.
        pub.publish([stored([3], parent=2)], live=False)
        pub.publish([stored([4], parent=3)])
        wait_for(lambda: live_nodes(view) == 4, "the gap filled")
        pub.publish([BlockRemoved([4])])
        wait_for(lambda: live_nodes(view) == 3, "an eviction")
        pub.publish([AllBlocksCleared()])
        wait_for(lambda: live_nodes(view) == 0 and "reset" in view.status, "a reset")
        # A new server process on the same ports starts at seq 0: the view clears and follows.
        endpoint, replay = pub.endpoint, pub.replay_endpoint
        pub.publish([stored([5])])
        wait_for(lambda: live_nodes(view) == 1, "a block after the reset")
        pub.close()
        pub = KVEventPublisher(endpoint, replay)
        pub.publish([stored([6, 7], first_token=500)])
        wait_for(lambda: live_nodes(view) == 2 and view.batches[-1][0] == 0, "the new server")
        assert any((f.title or "").startswith("server restarted") for f in view.frames)
    finally:
        view.stop()
        pub.close()
    assert view.status == "stopped"


def test_garbage_frames_are_reported_and_skipped():
    """A bare PUB socket as the server (no replay socket): a malformed message is said on
    the status line and skipped; the next good batch is drawn."""
    sock = zmq.Context.instance().socket(zmq.PUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    view = viz.watch(f"tcp://127.0.0.1:{port}")
    try:
        garbage = [b"", (0).to_bytes(8, "big"), b"\xc1 not msgpack"]
        good = encode_batch(1, KVEventBatch(ts=0.0, events=[stored([1])]))
        # Sent again and again: a PUB drops what it sends before the SUB has joined.
        wait_for(
            lambda: "seq 0" in view.status or "skipped" in view.status,
            "the bad-frame notice",
            act=lambda: sock.send_multipart(garbage),
        )
        wait_for(
            lambda: live_nodes(view) == 1,
            "the next good batch",
            act=lambda: sock.send_multipart(good),
        )
    finally:
        view.stop()
        sock.close(linger=0)


def test_a_dead_endpoint_is_said_on_the_status_line():
    pub = publisher()
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    pub.close()  # nobody there any more
    view = viz.watch(endpoint, replay)
    try:
        wait_for(lambda: "no vLLM answering" in view.status, "the no-server notice")
        assert view.frames  # the player is there, empty, and keeps listening
    finally:
        view.stop()


def test_our_engine_in_process_follows_the_same_viewer():
    from minirad.kv_events.block_events import RadixBlockEvents
    from minirad.kvcache.radix_cache import RadixCache

    cache = RadixCache()
    follower = viz.BlockCacheView(model_dir=None)
    publisher = RadixBlockEvents(cache.bus, follower.apply_events)
    cache.insert(list(range(100)))  # 3 full blocks of 32
    cache.insert(list(range(40)) + [999] * 30)  # shares block 0, forks in block 1
    publisher.flush()
    assert live_nodes(follower) == 3 + 1
    assert [seq for seq, _ in follower.batches] == list(range(len(follower.batches)))


def test_an_unreadable_recording_is_a_kv_event_error(tmp_path):
    import pytest

    from minirad.errors import KVEventError

    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    for path in (tmp_path / "missing.jsonl", binary, tmp_path):
        with pytest.raises(KVEventError, match="recording"):
            viz.replay_recording(path)
