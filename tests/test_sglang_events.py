"""The real SGLang 0.5.23's KV events: decoded in its layout, followed without repeated notices,
drawn as its radix tree beside ours, and recorded for learners without the venv.

Without SGLang: the committed recording (``data/recordings/sglang_ch08_*``, made by ``python -m
minirad.course.sglang_recording``) holds the frames a real 0.5.23 server sent, as it sent them:
they must decode in its layout (tagged maps, signed hashes) to the committed batches, a
subscriber must follow a server replaying them, and the recording must draw (SGLang's tree, and
our engine's beside it) in the course venv alone. The subscriber's notices are tested against
servers played by raw ZMQ sockets.

With SGLang (``make sglang``; skipped without it, except under CI=true): one server for the
module, started with the recording's settings. A view watches it live while the session is
recorded again; the fresh recording must have the committed one's answers, cached tokens and
event structure, and the live view must draw, frame for frame, what the recording replays.
The server stops with the module: an idle SGLang busy-loops a core.
"""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import servers
import zmq

import viz
from minirad.course import recordings, sglang_recording
from minirad.kv_events import (
    END_SEQ,
    SGLANG_LAYOUTS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    KVEventSubscriber,
    Notice,
    decode_message,
)
from minirad.peers.text_model import text_model_dir

U64 = 2**64 - 1
FAST = {"replay_timeout_s": 0.5, "probe_interval_s": 0.2}
COMMITTED = sglang_recording.load()


def frames_of(batch_payload: bytes, seq: int = 0) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), batch_payload]


def notices(items, kind: str) -> list[Notice]:
    return [it for it in items if isinstance(it, Notice) and it.kind == kind]


def batches_of(items) -> list:
    return [it for it in items if not isinstance(it, Notice)]


def collect(sub: KVEventSubscriber, done, rounds: int = 100, act=None) -> list:
    """``sub.recv`` until ``done(items)``, calling ``act()`` between rounds of 0.1 s."""
    items: list = []
    for _ in range(rounds):
        if act is not None:
            act()
        items += sub.recv(0.1)
        if done(items):
            return items
    pytest.fail(f"gave up waiting; got {items!r}")


class FakeServer:
    """A PUB socket and a replay ROUTER that answer as SGLang does: 0.5.23 replies
    ``[b"", topic, seq, payload]``, earlier 0.5 releases ``[b"", seq, payload]``."""

    def __init__(self, frames: list[tuple[bytes, int, bytes]], topic_frame: bool = True) -> None:
        ctx = zmq.Context.instance()
        self.pub, self.router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
        port, rport = (s.bind_to_random_port("tcp://127.0.0.1") for s in (self.pub, self.router))
        self.endpoint, self.replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"
        self.frames, self.topic_frame = frames, topic_frame
        self.requests = 0

    def serve(self) -> None:
        while self.router.poll(0):
            ident, _, start = self.router.recv_multipart()
            self.requests += 1
            for topic, seq, payload in self.frames:
                if seq >= int.from_bytes(start, "big"):
                    head = [ident, b"", topic] if self.topic_frame else [ident, b""]
                    self.router.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            end = (
                [ident, b"", b"", END_SEQ, b""] if self.topic_frame else [ident, b"", END_SEQ, b""]
            )
            self.router.send_multipart(end)

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)


# ------------------------------------------------------------------------ the layout, decoded
def test_committed_frames_are_0_5_23s_tagged_maps_and_decode_to_the_committed_batches():
    raw = [msgspec.msgpack.decode(payload) for _, _, payload in COMMITTED.frames]
    ts, events, rank = raw[2]  # the first request's prompt, as the server sent it
    assert isinstance(ts, float) and rank == 0
    # Maps tagged by "type"; fields left at None are left out (medium is always set).
    assert set(events[0]) == {
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
    }
    assert (events[0]["type"], events[0]["block_size"], events[0]["medium"]) == (
        "BlockStored",
        1,
        "GPU",
    )
    signed = [h for b in raw for e in b[1] for h in e.get("block_hashes", ()) if h < 0]
    assert signed, "SGLang's hashes are signed 64-bit"
    batches, layouts = sglang_recording.wire_batches(COMMITTED.frames)
    assert layouts == {"maps"} and batches == COMMITTED.batches
    for _, batch in batches:
        for e in batch.events:
            assert all(0 <= h <= U64 for h in getattr(e, "block_hashes", ()))
    kinds = {type(e) for _, b in batches for e in b.events}
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}


def test_each_batch_says_its_layout_and_extra_fields_are_taken_leniently():
    stored = {
        "type": "BlockStored",
        "block_hashes": [-5, 7],
        "parent_block_hash": -(2**63),
        "token_ids": [11, [12, 13]],  # a bigram page (EAGLE) publishes [token, next token]
        "block_size": 1,
        "lora_id": None,
        "medium": "CPU_PINNED",
        "cache_salt": "salt",
        "session_id": "s1",
        "lora_name": "adapter",
        "a_field_of_a_later_release": {"x": 1},
    }
    maps = msgspec.msgpack.encode([1.5, [stored, {"type": "AllBlocksCleared"}], 2])
    seq, _, batch, layout = decode_message(frames_of(maps, 7), "sglang")
    assert (seq, layout, batch.data_parallel_rank) == (7, "maps", 2)
    s = batch.events[0]
    assert s.block_hashes == [U64 - 4, 7] and s.parent_block_hash == 2**63
    assert (s.token_ids, s.medium, s.lora_name) == ([11, 12], "CPU_PINNED", "adapter")
    arrays = msgspec.msgpack.encode([1.5, [["BlockRemoved", [-5], "GPU"]], 0])
    assert decode_message(frames_of(arrays), "sglang").layout == "arrays"
    empty = msgspec.msgpack.encode([1.5, [], 0])  # reads the same in both layouts
    assert decode_message(frames_of(empty), "sglang").layout is None
    _, seq, payload = COMMITTED.frames[2]  # vLLM's decoder reads 0.5.23 too: its encoding
    assert decode_message(frames_of(payload, seq), "vllm").layout is None  # vLLM: one layout
    assert SGLANG_LAYOUTS["maps"].startswith("SGLang 0.5.23 layout: ")


# --------------------------------------------------------------------------- the subscriber
@pytest.mark.parametrize("topic_frame", [True, False])
def test_a_subscriber_follows_a_0_5_23_server_and_names_its_layout_once(topic_frame):
    server = FakeServer(COMMITTED.frames, topic_frame)
    try:
        with KVEventSubscriber(server.endpoint, server.replay, schema="sglang", **FAST) as sub:
            # Several probes: each asks for what follows the last batch, and says nothing new.
            items = collect(
                sub,
                lambda items: (
                    len(batches_of(items)) == len(COMMITTED.batches) and server.requests >= 4
                ),
                act=server.serve,
            )
    finally:
        server.close()
    assert batches_of(items) == COMMITTED.batches
    [layout] = notices(items, "layout")
    assert layout.message.startswith("SGLang 0.5.23 layout: events are tagged maps")
    assert sub.layout == "maps"
    assert not notices(items, "bad_frame") and not notices(items, "lost")


def test_a_fault_on_every_batch_gives_one_notice_however_many_probes():
    """The issue's 258 notices in 25 s: a subscriber of the wrong schema (vLLM's, on an SGLang
    of the earlier array layout) read every batch on every replay probe as a new bad frame."""
    arrays = msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [5], 1, None, "GPU"]], 0])
    server = FakeServer([(b"", seq, arrays) for seq in range(20)], topic_frame=False)
    try:
        with KVEventSubscriber(server.endpoint, server.replay, schema="vllm", **FAST) as sub:
            items = collect(sub, lambda items: server.requests >= 6, act=server.serve)
            assert server.requests == 6
            counts = dict(sub.notice_counts)
    finally:
        server.close()
    [bad] = notices(items, "bad_frame")
    assert "schema='sglang'" in bad.message and "without another notice" in bad.message
    assert not batches_of(items) and not notices(items, "lost")
    assert not notices(items, "recovered")  # nothing was: every batch was bad
    # Each batch was read once; each later probe asked only for what follows the last one.
    assert 20 <= counts[("bad_frame", bad.message.replace("batch 0", "batch N"))] < 20 + 6


def test_repeated_restarts_are_each_noticed():
    """Not a repeat: a second restart with the same words is news (a new server each time)."""
    first = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    endpoint, replay = first.endpoint, first.replay_endpoint
    restarts = []
    with KVEventSubscriber(endpoint, replay, **FAST) as sub:
        server = first
        for _ in range(3):
            for i in range(3):
                server.publish([BlockStored([i + 1], None, [i], 1)])
            items = collect(sub, lambda items: len(batches_of(items)) >= 3)
            restarts += notices(items, "restart")
            server.close()
            time.sleep(0.05)
            server = KVEventPublisher(endpoint.replace("127.0.0.1", "*"), replay)
        items = collect(sub, lambda items: notices(items, "restart"))
        server.close()
    restarts += notices(items, "restart")
    assert len(restarts) == 3
    assert len({n.message for n in restarts}) == 1  # the same words, each time a new server


# ----------------------------------------------------------------------- the recording, drawn
def final_tree(view) -> dict[int, tuple[int | None, int]]:
    """``{node id: (parent id, tokens)}`` of the live nodes of the view's last frame before
    the session's ``/flush_cache``."""
    frame = view.frames[-2]
    return {n.id: (n.parent, n.num_tokens) for n in frame.live}


def test_the_committed_recording_draws_sglangs_radix_tree_without_sglang():
    view = viz.replay_recording(COMMITTED.batches, schema="sglang")
    assert view.title == "SGLang radix cache (KV events)" and view.chains is not None
    assert [f.title for f in view.frames[1:]] == [
        f"seq {seq}: {len(b.events)} event{'s' * (len(b.events) != 1)}"
        for seq, b in COMMITTED.batches
    ]
    # One node per run of pages: a 33-token prompt is one node, not 33.
    assert view.frames[3].caption == "insert: 0 tokens cached, new node 2 (33 tokens) under node 0"
    captions = " ".join(f.caption for f in view.frames)
    assert "split node 2 at token 24" in captions and "evicted node" in captions
    stored = sum(
        len(e.block_hashes)
        for _, b in COMMITTED.batches
        for e in b.events
        if isinstance(e, BlockStored)
    )
    assert max(len(f.nodes) for f in view.frames) < stored / 5
    assert len(final_tree(view)) == 11 and not view.frames[-1].live  # then flushed
    per_block = viz.replay_recording(COMMITTED.batches, schema="sglang", compact=False)
    assert len(per_block.frames[-2].live) == sum(n for _, n in final_tree(view).values())
    assert view.svg().startswith("<svg")


def test_sglang_beside_ours_from_the_recording():
    pair = viz.replay_sglang()
    ours = [cached for _, (_, cached) in pair.requests[:-1]]
    theirs = [o.cached_tokens for o in COMMITTED.outputs]
    assert ours == theirs  # page size 1, the same pool: the same hits, request by request
    assert pair.requests[-1] == ("flush_cache", (None, None))
    pair.request.value = 2  # after r2: both trees split where the two questions part
    for view in pair.views:
        assert view.step == view.marks[2]
        assert "split node" in " ".join(f.caption for f in view.frames[: view.step + 1])
    bundle, _ = pair._repr_mimebundle_()
    assert "SGLang 0.5.23" in bundle["image/svg+xml"] and "minirad" in bundle["image/svg+xml"]
    assert repr(pair).startswith("SGLangBesideOurs: 2 players")
    # Each player is half a row wide: "fit" draws its whole tree (issue 43; tests/test_viz_beside)
    assert [v.fit_min_text_px for v in pair.views] == [0, 0]


# ------------------------------------------------------------------------- the real server
def shapes(view) -> list[tuple]:
    """What a view draws, frame by frame, without hashes or timestamps."""
    return [
        (
            f.title,
            f.caption,
            tuple(
                (n.id, n.parent, n.num_tokens, n.state, n.label.full if n.label else None)
                for n in f.nodes
            ),
        )
        for f in view.frames
    ]


def wait_until(condition, what: str, limit_s: float = 15.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def live(sglang_python):
    """One SGLang server with the recording's settings; a view and a subscriber follow it while
    the session is recorded again. Yields ``(server, view, items, session)``."""
    from minirad.peers.sglang_server import SGLangServer

    said: list[str] = []  # what start(progress=...) said
    server = SGLangServer(
        text_model_dir(), python=sglang_python, **sglang_recording.SERVER_SETTINGS
    )
    with server.start(progress=said.append):
        server.start_lines = said
        view = viz.watch(
            server.kv_events_endpoint,
            server.replay_endpoint,
            schema="sglang",
            model_dir=server.model_dir,
        )
        items: list = []
        sub = KVEventSubscriber(server.kv_events_endpoint, server.replay_endpoint, schema="sglang")
        sub.start(items.append)
        try:
            session = sglang_recording.record(server)
            n = len(session.batches)
            wait_until(lambda: len(view.batches) >= n and len(batches_of(items)) >= n, "events")
            yield server, view, items, session
        finally:
            view.stop()
            sub.close()
        pid = server._proc.pid
    with pytest.raises(ProcessLookupError):  # stopped: the server and its children are gone
        os.killpg(pid, 0)


def test_the_session_recorded_again_is_the_committed_one(live):
    _, _, _, fresh = live
    assert [o.request for o in fresh.outputs] == list(sglang_recording.SGLANG_REQUESTS)
    for new, old in zip(fresh.outputs, COMMITTED.outputs, strict=True):
        assert new.prompt_token_ids == old.prompt_token_ids
        assert (new.output_ids, new.text) == (old.output_ids, old.text)
        assert (new.cached_tokens, new.finish_reason) == (old.cached_tokens, old.finish_reason)
        assert new.last_seq == old.last_seq
    assert recordings.structure(fresh.batches) == recordings.structure(COMMITTED.batches)
    batches, layouts = sglang_recording.wire_batches(fresh.frames)
    assert layouts == {"maps"} and batches == fresh.batches


def test_the_live_subscriber_names_the_layout_once_and_repeats_nothing(live):
    _, view, items, _ = live
    [layout] = notices(items, "layout")
    assert layout.message.startswith(SGLANG_LAYOUTS["maps"])
    assert not notices(items, "bad_frame") and not notices(items, "lost")
    given = [(n.kind, n.message) for n in items if isinstance(n, Notice)]
    assert len(given) == len(set(given))  # probes every 2 s, no notice twice


def test_the_live_view_draws_what_the_recording_replays(live):
    _, view, _, fresh = live
    assert [s for s, _ in view.batches] == [s for s, _ in fresh.batches]
    assert shapes(view) == shapes(viz.replay_recording(fresh.batches, schema="sglang"))
    assert shapes(view) == shapes(viz.replay_recording(COMMITTED.batches, schema="sglang"))


def test_sglang_live_beside_ours(live):
    server = live[0]
    pair = viz.watch_sglang(server)  # its replay brings the session's batches first
    try:
        tokenizer_prompt = list(COMMITTED.outputs[0].prompt_token_ids)
        first, ours1 = pair.generate(tokenizer_prompt, max_new_tokens=4, label="r1 again")
        second, ours2 = pair.generate(tokenizer_prompt[:-3] + [17, 18, 19], max_new_tokens=4)
    finally:
        pair.stop()
    assert (first["cached_tokens"], second["cached_tokens"]) == (0, len(tokenizer_prompt) - 3)
    assert (ours1.stats.cached_tokens, ours2.stats.cached_tokens) == (0, len(tokenizer_prompt) - 3)
    # SGLang's tree split where the second prompt parts from the first: a node of 30 tokens.
    after = pair.theirs.frames[pair.theirs.marks[-1]]
    assert 30 in {n.num_tokens for n in after.live}
    assert len(pair.requests) == 2


def test_flush_cache_empties_the_tree_and_the_answers_stay(live):
    """Last in the file: it flushes the server's cache."""
    server = live[0]
    prompt = list(range(10, 40))
    first = server.generate(prompt, max_new_tokens=4)
    again = server.generate(prompt + [7, 8], max_new_tokens=4)
    assert server.flush_cache()
    flushed = server.generate(prompt, max_new_tokens=4)
    assert first["prompt_tokens"] == 30 and len(first["output_ids"]) == 4
    assert again["cached_tokens"] >= len(prompt)  # the whole first prompt was cached
    assert flushed["cached_tokens"] == 0 and flushed["output_ids"] == first["output_ids"]


def test_a_replayed_reset_does_not_caption_every_frame():
    """The session ends with /flush_cache (AllBlocksCleared): that frame's title says so, the
    status line (what a live server just did) stays empty for a recording."""
    assert isinstance(COMMITTED.batches[-1][1].events[-1], AllBlocksCleared)
    assert viz.replay_recording(COMMITTED.batches, schema="sglang").status == ""
    assert viz.replay_sglang(COMMITTED).theirs.status == ""


def test_sglangs_start_says_each_stage(live):
    servers.check_start_lines(live[0])
