"""The real vLLM 0.32 OpenAI server on the shipped model: its KV events through our subscriber,
its cached tokens against what its block hashes predict, and its answers against our engine's.

One server for the module (a start costs ~40 s on 2 cores): the session's (the ``vllm_server``
fixture of tests/conftest.py, which first records chapter 08's session on it for
tests/test_vllm_recording.py), restarted once, by the last test. The tests share its cache and
run in file order: each request's events are those delivered between the request and a quiet
moment, and :class:`Stream` keeps a model of the cache (block hash -> parent) built from every
event since the server started (the replay brings the ones sent before the module's
subscriber joined).
"""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time

import msgspec
import pytest

from minirad.course.scenes import SYSTEM_PROMPTS, questions, random_scene, render
from minirad.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventSubscriber,
    Notice,
    encode_batch,
)
from minirad.kv_events.block_events import VLLM_BLOCK_SIZE
from minirad.kvcache.multimodal import MultiModalItem, block_extra_keys
from minirad.peers.vllm_server import DEFAULT_MODEL_DIR, VLLMServer

IMAGE_TOKEN_ID = 3  # data/models/minirad-tiny-llava/config.json: image_token_index
IMAGE_START = 3  # the prompt is [<|im_start|>, user, \n, image x 64, \n, question...]
# Scenes drawn from a seed training (seed 0, stream by step) and its evaluation (1_000_003)
# never use: requests the model and vLLM have not seen.
FRESH_SEED = 2_024_601


class Stream:
    """The module's subscriber, what it delivered, and the cache those events describe."""

    def __init__(self, sub: KVEventSubscriber) -> None:
        self.sub = sub
        self.items: list = []
        self.parent: dict[int, int | None] = {}  # cached block hash -> its parent's

    def drain(self) -> list:
        """Everything delivered until a quiet 0.3 s (vLLM has published a request's events
        by the time its HTTP answer arrives)."""
        new: list = []
        for _ in range(100):
            got = self.sub.recv(0.3)
            if not got:
                break
            new += got
        for item in new:
            if isinstance(item, Notice):
                if item.kind == "restart":
                    self.parent.clear()
                continue
            for e in item[1].events:
                if isinstance(e, BlockStored):
                    parent = e.parent_block_hash
                    for h in e.block_hashes:
                        self.parent[h], parent = parent, h
                elif isinstance(e, BlockRemoved):
                    for h in e.block_hashes:
                        self.parent.pop(h, None)
                else:
                    self.parent.clear()
        self.items += new
        return new

    def ask(self, server: VLLMServer, question: str, image=None, system=None, cache_salt=None):
        """One request and the batches it caused."""
        self.drain()
        answer = server.chat(question, image=image, system=system, cache_salt=cache_salt)
        return answer, [it[1] for it in self.drain() if not isinstance(it, Notice)]

    def depth(self, h: int | None) -> int:
        """Blocks in the cached chain that ends at ``h``."""
        n = 0
        while h is not None:
            assert h in self.parent, f"block {h:016x} is not in the cache the events describe"
            h, n = self.parent[h], n + 1
        return n


def stored_events(batches: list[KVEventBatch]) -> list[BlockStored]:
    return [e for b in batches for e in b.events if isinstance(e, BlockStored)]


OUR_BATCH = KVEventBatch(
    12.5,
    [
        BlockStored(
            [2**64 - 1, 5],
            None,
            [1] * 64,
            32,
            medium="GPU",
            extra_keys=[[["ab" * 32, 3]], None],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        BlockRemoved([2**64 - 1], medium="GPU"),
        AllBlocksCleared(),
    ],
    0,
)
DECODE_WITH_VLLM = """
import sys, json, msgspec
from vllm.distributed.kv_events import KVEventBatch
batch = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=KVEventBatch)
print(json.dumps(msgspec.to_builtins(batch)))
"""


@pytest.fixture(scope="module")
def vllm_decoder(vllm_python, tmp_path_factory):
    """vLLM's own structs decoding our frame of :data:`OUR_BATCH`, in a subprocess of the vLLM
    venv; started before the server, so that its import of vllm (~10 s) overlaps the start."""
    frame = tmp_path_factory.mktemp("decoder") / "payload"
    frame.write_bytes(encode_batch(0, OUR_BATCH)[2])
    with open(frame, "rb") as stdin:
        proc = subprocess.Popen(
            [str(vllm_python), "-c", DECODE_WITH_VLLM],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    yield proc
    proc.kill()
    proc.communicate()


@pytest.fixture(scope="module")
def server(vllm_decoder, vllm_server):
    """The session's server (tests/conftest.py), after chapter 08's recording: the module's
    subscriber gets those batches through the replay, so its model of the cache is whole."""
    srv, _recording = vllm_server
    return srv


@pytest.fixture(scope="module")
def stream(server):
    with KVEventSubscriber(server.kv_events_endpoint, server.replay_endpoint) as sub:
        yield Stream(sub)


@pytest.fixture(scope="module")
def scenes():
    rng = random.Random(FRESH_SEED)
    return [random_scene(rng) for _ in range(8)]


def test_an_image_request_stores_chained_blocks(server, stream, scenes):
    answer, batches = stream.ask(server, "Describe the image.", image=render(scenes[0]))
    assert answer["cached_tokens"] == 0
    prompt = answer["prompt_token_ids"]
    assert prompt[IMAGE_START : IMAGE_START + 64] == [IMAGE_TOKEN_ID] * 64
    (first, *rest) = stored_events(batches)
    assert first.parent_block_hash is None  # a fresh image: nothing to share
    hashes, tokens, extra = [], [], []
    for e in [first, *rest]:
        assert (e.block_size, e.medium, e.lora_id, e.group_idx) == (32, "GPU", None, 0)
        assert e.kv_cache_spec_kind == "full_attention"
        assert len(e.token_ids) == VLLM_BLOCK_SIZE * len(e.block_hashes)
        assert len(e.extra_keys) == len(e.block_hashes)
        assert e.parent_block_hash == (hashes[-1] if hashes else None)  # one chain
        hashes += e.block_hashes
        tokens += e.token_ids
        extra += e.extra_keys
    assert len(set(hashes)) == len(hashes) and all(0 <= h < 2**64 for h in hashes)
    assert tokens == (prompt + answer["token_ids"])[: len(tokens)]
    # Every block the image overlaps names it, with the image's start relative to the block.
    (mm_hash, _), *_ = extra[0]
    assert len(mm_hash) == 64 and int(mm_hash, 16) >= 0
    for i, keys in enumerate(extra):
        overlaps = (
            IMAGE_START < VLLM_BLOCK_SIZE * (i + 1) and VLLM_BLOCK_SIZE * i < IMAGE_START + 64
        )
        assert keys == ([[mm_hash, IMAGE_START - VLLM_BLOCK_SIZE * i]] if overlaps else None)


def test_a_salted_image_request_keys_its_blocks_in_our_order(server, stream, scenes):
    """vLLM publishes a salted first block's extra keys as the image, then the salt; ours
    (``block_extra_keys``, which our block hashes and events use) come in the same order."""
    answer, batches = stream.ask(
        server, "Describe the image.", image=render(scenes[0]), cache_salt="course-salt"
    )
    assert answer["cached_tokens"] == 0  # salted: nothing unsalted is shared
    extra = [k for e in stored_events(batches) for k in e.extra_keys]
    (mm_hash, offset), salt = extra[0]
    assert (offset, salt) == (IMAGE_START, "course-salt")
    image = [MultiModalItem(IMAGE_START, 64, mm_hash)]
    for i, keys in enumerate(extra):
        ours = block_extra_keys(VLLM_BLOCK_SIZE * i, VLLM_BLOCK_SIZE * (i + 1), image, salt)
        assert keys == ([list(k) if isinstance(k, tuple) else k for k in ours] if ours else None)


def test_another_image_forks_through_the_hashes(server, stream, scenes):
    """Same question, other picture: the same token ids (placeholders), other hashes."""
    a, batches_a = stream.ask(server, "How many shapes are there?", image=render(scenes[1]))
    b, batches_b = stream.ask(server, "How many shapes are there?", image=render(scenes[2]))
    assert a["prompt_token_ids"] == b["prompt_token_ids"]
    sa, sb = stored_events(batches_a)[0], stored_events(batches_b)[0]
    assert sa.token_ids == sb.token_ids and sb.parent_block_hash is None
    assert not set(sa.block_hashes) & set(sb.block_hashes)
    assert sa.extra_keys[0][0][0] != sb.extra_keys[0][0][0]  # the images' hashes


def test_cached_tokens_are_what_the_block_hashes_predict(server, stream, scenes):
    """A request reuses the cached chain its first new block hangs from (its parent), or all
    its full blocks (vLLM leaves at least the last prompt token to compute) if it stores
    none."""
    image_a, image_b = render(scenes[0]), render(scenes[3])
    requests = [
        ("Describe the image.", image_a, None),  # the first test's request again
        ("What shape is the red one?", image_a, None),  # same image, other question
        ("Describe the image.", image_b, None),
        ("Describe the image.", image_b, SYSTEM_PROMPTS[0]),  # a system turn first: no share
        ("Describe the image.", image_b, SYSTEM_PROMPTS[0]),
        ("How many shapes are there?", None, None),  # text only
        ("How many shapes are there?", None, None),
    ]
    predicted, reported = [], []
    for question, image, system in requests:
        answer, batches = stream.ask(server, question, image=image, system=system)
        n = len(answer["prompt_token_ids"])
        stored = stored_events(batches)
        if stored:
            blocks = stream.depth(stored[0].parent_block_hash)
        else:
            blocks = min(n // VLLM_BLOCK_SIZE, (n - 1) // VLLM_BLOCK_SIZE)
        predicted.append(VLLM_BLOCK_SIZE * blocks)
        reported.append(answer["cached_tokens"])
    assert reported == predicted
    assert any(predicted) and not all(predicted)  # both hits and misses were checked


def test_replay_gives_a_late_subscriber_everything(server, stream):
    stream.drain()
    delivered = [it for it in stream.items if not isinstance(it, Notice)]
    with KVEventSubscriber(server.kv_events_endpoint, server.replay_endpoint) as late:
        items: list = []
        for _ in range(100):
            items += late.recv(0.2)
            if len([it for it in items if not isinstance(it, Notice)]) >= len(delivered):
                break
    assert [it for it in items if not isinstance(it, Notice)] == delivered
    assert [n.kind for n in items if isinstance(n, Notice)] == ["recovered", "connected"]


def test_answers_equal_our_engine_on_fresh_scenes(server, stream, scenes):
    """Greedy tokens and prompt ids (so the chat template too) on requests neither has seen."""
    from minirad.engine import GenerateRequest, LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(DEFAULT_MODEL_DIR)
    rng = random.Random(FRESH_SEED + 1)
    cases = []
    for i, scene in enumerate(scenes[4:]):
        system = SYSTEM_PROMPTS[i % len(SYSTEM_PROMPTS)] if i % 2 else None
        cases += [(q.prompt, render(scene), system) for q in questions(scene, rng)]

    def prompt(question, system):
        messages = [{"role": "system", "content": system}] if system else []
        content = [{"type": "image"}, {"type": "text", "text": question}]
        return engine.processor.apply_chat_template(
            [*messages, {"role": "user", "content": content}],
            add_generation_prompt=True,
            tokenize=False,
        )

    ours = engine.generate(
        [
            GenerateRequest(prompt(q, s), [img], SamplingParams(max_new_tokens=16))
            for q, img, s in cases
        ]
    )
    theirs = [server.chat(q, image=img, system=s, max_tokens=16) for q, img, s in cases]
    stream.drain()
    assert len(cases) >= 16
    assert [t["prompt_token_ids"] for t in theirs] == [o.prompt_token_ids for o in ours]
    assert [t["token_ids"] for t in theirs] == [o.token_ids for o in ours]
    assert [t["text"] for t in theirs] == [o.text for o in ours]


def test_reset_prefix_cache_gives_all_blocks_cleared(server, stream, scenes):
    """vLLM publishes events after an engine step: the AllBlocksCleared of a reset comes with
    the next request's batch, before its blocks."""
    assert server.reset_prefix_cache()
    answer, batches = stream.ask(server, "Describe the image.", image=render(scenes[0]))
    events = [e for b in batches for e in b.events]
    assert events[0] == AllBlocksCleared()
    assert answer["cached_tokens"] == 0  # cached before the reset
    assert stored_events(batches)[0].parent_block_hash is None


def test_our_frames_decode_with_vllms_own_structs(vllm_decoder):
    """What our engine publishes, a KV-aware router built on vLLM's structs can read."""
    out = vllm_decoder.communicate(timeout=120)[0].decode()
    assert vllm_decoder.returncode == 0, out[-2000:]
    ts, events, rank = json.loads(out.strip().splitlines()[-1])
    assert (ts, rank) == (OUR_BATCH.ts, 0)
    for theirs, ours in zip(events, msgspec.to_builtins(OUR_BATCH.events), strict=True):
        # vLLM's structs omit fields at their default (None) when they encode.
        assert {k: theirs.get(k) for k in ours} == ours


def test_a_restart_is_noticed_and_followed(server, stream, scenes):
    """Stop and start the server on the same ports while a subscriber runs in its background
    thread: it reports the server gone, then the restart, then the new server's batches."""
    assert server.reset_prefix_cache()
    before, batches = stream.ask(server, "Describe the image.", image=render(scenes[0]))
    hashes_before = stored_events(batches)[0].block_hashes
    got: list = []
    lock = threading.Lock()

    def keep(item):
        with lock:
            got.append(item)

    def wait_for(kind: str) -> None:
        for _ in range(200):
            with lock:
                if any(isinstance(i, Notice) and i.kind == kind for i in got):
                    return
            time.sleep(0.1)
        pytest.fail(f"no {kind!r} notice; got {got!r}")

    watcher = KVEventSubscriber(server.kv_events_endpoint, server.replay_endpoint)
    watcher.start(keep)
    try:
        wait_for("connected")
        server.stop()
        wait_for("no_server")  # the watcher notices the dead server on its own
        server.start()
        print(f"vLLM server up again in {server.startup_s:.1f} s")
        after, batches = stream.ask(server, "Describe the image.", image=render(scenes[0]))
        wait_for("restart")
    finally:
        watcher.close()
    assert (after["token_ids"], after["cached_tokens"]) == (before["token_ids"], 0)
    # The module's subscriber saw it too, and follows the new server from seq 0.
    (restart,) = [i for i in stream.items if isinstance(i, Notice) and i.kind == "restart"]
    new = [
        it for it in stream.items[stream.items.index(restart) + 1 :] if not isinstance(it, Notice)
    ]
    assert new and new[0][0] == 0
    # vLLM's sha256 block hashes start from a fixed seed: the same prompt, the same hashes.
    first = stored_events(batches)[0]
    assert first.parent_block_hash is None and first.block_hashes == hashes_before
