"""Frames of a real engine run (``viz.sources``): one per engine step, from events only.

A tiny config-made LLaVA serves six requests (two images, three questions each) from a KV
pool so small that the run defers requests that share a prefix, evicts old branches and
preempts a request. Each step's frame is checked against the engine's own
:class:`~minirad.events.StepEvent` (recorded alongside), against the scheduler's running list
and the real tree (read here as the reference; the frames never read them), against the
per-event frames of the same run, and against frames rebuilt from the JSONL log.
"""

from __future__ import annotations

import pytest
from PIL import Image
from tiny_models import IMAGE_SIZE, tiny_llava_processor, tiny_model

from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.events import EventRecorder, StepEvent
from minirad.kvcache.multimodal import hash_image
from viz import RadixView, frames_from_events, image_names
from viz.sources import engine_frames

NUM_KV_SLOTS = 48  # small enough for evictions and a preemption in this workload
RED = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), "red")
BLUE = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), "blue")


@pytest.fixture(scope="module")
def llava():
    return tiny_model("llava-llama"), tiny_llava_processor()


def new_engine(llava) -> LLMEngine:
    return LLMEngine(*llava, num_kv_slots=NUM_KV_SLOTS, max_num_seqs=3)


def workload() -> list[GenerateRequest]:
    params = SamplingParams(max_new_tokens=6, stop_token_ids=())  # lengths fixed: no early stop
    return [
        GenerateRequest(f"<s> w10 w11 <image> w{12 + q}", [image], params)
        for image in (RED, BLUE)
        for q in range(3)
    ]


def expected_caption(number: int, e: StepEvent) -> str:
    """The caption's first part, in the format the chapter prints (written out here from the
    event's fields): prefill chunks with their token ranges, then decodes, then decisions."""
    rows = list(zip(e.rids, e.starts, e.num_tokens, e.is_prefill, strict=True))
    work = [
        f"prefill {r} (" + (f"token {s}" if n == 1 else f"tokens {s}-{s + n - 1}") + ")"
        for r, s, n, p in rows
        if p
    ]
    decodes = [r for r, _, _, p in rows if not p]
    work += ["decode " + ", ".join(decodes)] if decodes else []
    text = f"step {number}: " + ", ".join(work)
    for word, rids in (("finished", e.finished), ("preempted", e.preempted)):
        text += f"; {word} {', '.join(rids)}" if rids else ""
    return text + (f"; deferred {', '.join(e.deferred)}" if e.deferred else "")


@pytest.fixture(scope="module")
def run(llava):
    """``(frames, outputs, events)`` of one engine run, one frame per step."""
    engine = new_engine(llava)
    recorder = EventRecorder(engine.bus)
    frames, outputs = engine_frames(engine, workload())
    return frames, outputs, recorder.events


def steps_of(events) -> list[StepEvent]:
    return [e for e in events if isinstance(e, StepEvent)]


def test_the_workload_defers_evicts_and_preempts(run):
    frames, outputs, events = run
    steps = steps_of(events)
    assert any(e.deferred for e in steps) and any(e.preempted for e in steps)
    assert any(n.state == "evicted" for f in frames for n in f.nodes)
    assert [o.finished for o in outputs] == [True] * len(outputs)


def test_one_frame_per_engine_step(run):
    frames, _, events = run
    steps = steps_of(events)
    assert len(frames) == 1 + len(steps)
    assert frames[0].title == "engine: requests queued" and frames[0].step is None
    # The events between two steps belong to the later one; its StepEvent comes last.
    chunks, chunk = [], []
    for e in events:
        chunk.append(e)
        if isinstance(e, StepEvent):
            chunks.append(chunk)
            chunk = []
    assert chunk == []
    for k, (frame, e, chunk) in enumerate(zip(frames[1:], steps, chunks, strict=True), 1):
        assert frame.title == f"engine step {k}" and frame.time == e.time
        assert frame.step.number == k
        assert frame.step.batch == tuple(
            zip(e.rids, e.starts, e.num_tokens, e.is_prefill, strict=True)
        )
        assert (frame.step.finished, frame.step.preempted, frame.step.deferred) == (
            e.finished,
            e.preempted,
            e.deferred,
        )
        caption = expected_caption(k, e)
        assert frame.caption == caption or frame.caption.startswith(caption + " | ")
        # Everything the tree did in the step is in the frame's event list, in order.
        tracked = [x for x in chunk if getattr(x, "pool", "token_pool") == "token_pool"]
        assert frame.events == tuple(x.describe() for x in tracked)


def tree_of(engine) -> dict[int, tuple]:
    """The real tree (the reference): id -> (parent id, tokens, lock_ref)."""
    real, stack = {}, [engine.tree_cache.root_node]
    while stack:
        node = stack.pop()
        for c in node.children.values():
            real[c.id] = (node.id, len(c.key), c.lock_ref)
            stack.append(c)
    return real


def test_live_view_per_step_shows_the_running_requests(llava, run):
    engine = new_engine(llava)
    view = RadixView().attach(engine, every_event=False, images=[RED, BLUE])
    for r in workload():
        engine.add_request(r)
    while engine.has_unfinished_requests():
        engine.step()
        frame = view.frames[-1]
        assert set(frame.step.running) == {r.rid for r in engine.scheduler.running}
        holders = {o for o in frame.pool.owners() if isinstance(o, str)}
        assert holders <= set(frame.step.running)  # only running requests hold own slots
        drawn = {n.id: (n.parent, n.num_tokens, n.lock_ref) for n in frame.live}
        assert drawn == tree_of(engine)
    view.detach()
    # The same frames as engine_frames() gave for the same run (it also sets titles).
    frames = run[0]
    assert len(view.frames) == len(frames)
    for mine, theirs in zip(view.frames, frames, strict=True):
        assert {**mine.to_dict(), "title": None} == {**theirs.to_dict(), "title": None}


def test_step_frames_are_the_event_frames_at_each_step(llava, run):
    frames = run[0]
    per_event, _ = engine_frames(new_engine(llava), workload(), per="event")
    at_steps = [f for f in per_event if f.step is not None]
    assert len(at_steps) == len(frames) - 1
    assert all(f.title == f"engine step {f.step.number}" for f in at_steps)
    for step, event in zip(frames[1:], at_steps, strict=True):
        assert (event.step, event.time, event.pool) == (step.step, step.time, step.pool)
        assert [(n.id, n.parent, n.col, n.depth, n.num_tokens, n.lock_ref) for n in event.live] == [
            (n.id, n.parent, n.col, n.depth, n.num_tokens, n.lock_ref) for n in step.live
        ]
        assert {n.state for n in event.nodes} == {"idle"}  # the step event itself did nothing


def test_step_frames_from_the_jsonl_log(llava, run, tmp_path):
    frames, _, events = run
    EventRecorder(events=events).save(tmp_path / "engine.jsonl")
    engine = new_engine(llava)  # only for its settings: vocabulary, image hashing
    params = engine.input_processor.preprocess_params
    names = image_names(
        [hash_image(im, **params) for im in (RED, BLUE)], engine.input_processor.vocab_size
    )
    replayed = frames_from_events(
        tmp_path / "engine.jsonl",
        every_event=False,
        decode=engine.tokenizer.decode,
        vocab_size=engine.input_processor.vocab_size,
        images=names,
        pool_size=NUM_KV_SLOTS,
    )
    assert [{**f.to_dict(), "title": None} for f in replayed] == [
        {**f.to_dict(), "title": None} for f in frames
    ]
    chips = {name for f in replayed for n in f.nodes if n.label for *_, name in n.label.images}
    assert chips == set(names.values())  # the fork at each image, named by its hash
