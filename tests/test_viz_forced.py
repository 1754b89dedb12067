"""Forced runs in the frames (jump-forward decoding, :class:`minirad.events.JumpForwardEvent`).

The shipped model answers a JSON-schema request three times from one image and prompt, at
temperature 50 with three seeds: its choices are then nearly uniform among the tokens the mask
allows, so the answers fork whatever the weights. The grammar forces ``{"shapes": [{"colour": "``
and every key and brace after it. The frames are built from the events only; the reference is
what each request was forced to write, read from its own ``JumpForwardEvent``s and its output
ids, and the tokens the tree holds along its path (the builder's
:class:`~minirad.kv_events.event_tree.EventTree`, checked against the real cache). Whatever the
model samples, a token of the tree is marked forced exactly where the request that computed it was
forced: the marks do not depend on the model's answers being right.
"""

from __future__ import annotations

import functools

import pytest

from minirad.course.scenes import JSON_PROMPT, SHAPES_JSON_SCHEMA
from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.events import EventBus, EventRecorder, JumpForwardEvent, load_events, save_events
from minirad.kvcache.radix_cache import RadixCache
from minirad.models import DEFAULT_MODEL_DIR, load_model
from viz import FrameBuilder, frame_svg, frames_from_events
from viz.sources import builder_for, engine_frames
from viz.svg import FORCED

IMAGE = DEFAULT_MODEL_DIR.parents[1] / "images" / "purple_circle_green_square_red_triangle.png"
FIRST_RUN = '{"shapes": [{"colour": "'


@functools.cache
def shipped():
    return load_model(DEFAULT_MODEL_DIR)


def json_requests(processor, seeds=(1, 2, 3)) -> list[GenerateRequest]:
    content = [{"type": "image"}, {"type": "text", "text": JSON_PROMPT}]
    messages = [{"role": "user", "content": content}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return [
        GenerateRequest(
            prompt,
            [IMAGE],
            SamplingParams(
                max_new_tokens=120, json_schema=SHAPES_JSON_SCHEMA, temperature=50.0, seed=seed
            ),
        )
        for seed in seeds
    ]


@functools.cache
def run(page_size: int):
    """``(engine, requests, frames, outputs, events)``: one frame per engine step."""
    model, processor = shipped()
    engine = LLMEngine(model, processor, num_kv_slots=2048, page_size=page_size)
    recorder = EventRecorder(engine.bus)
    requests = json_requests(processor)
    frames, outputs = engine_frames(engine, requests)
    return engine, requests, frames, outputs, recorder.events


def path_marks(builder_tree, key: list[int], forced_of_node) -> list[tuple[int, bool]]:
    """``(token id, marked forced)`` for each token of ``key`` the tree holds, root down."""
    out, node, i = [], builder_tree.nodes[0], 0
    while i < len(key):
        # With pages, siblings may share a first token: the edge must match as far as it goes.
        live = (builder_tree.nodes[c] for c in node.children if c in builder_tree.nodes)
        child = next(
            (c for c in live if tuple(key[i : i + len(c.key)]) == c.key[: len(key) - i]), None
        )
        if child is None:
            break
        marks = forced_of_node(child.id)
        for j, t in enumerate(child.key):
            if i + j >= len(key) or key[i + j] != t:
                return out
            out.append((t, j in marks))
        i += len(child.key)
        node = child
    return out


@pytest.mark.parametrize("page_size", [1, 4])
def test_forced_tokens_are_marked_where_each_request_was_forced(page_size):
    engine, requests, frames, outputs, events = run(page_size)
    engine.check_invariants()
    last = frames[-1]
    forced = {n.id: {o + k for o, m in n.label.forced for k in range(m)} for n in last.live}
    # The builder's tree, rebuilt from the same events (the frames' source), and the cache's
    # own keys must agree; read the tree from a fresh builder over the log.
    builder = FrameBuilder(vocab_size=engine.input_processor.vocab_size, page_size=page_size)
    builder.extend(events)
    assert sorted(builder.tree.nodes) == sorted([0, *forced])
    jumps = [e for e in events if isinstance(e, JumpForwardEvent)]
    assert jumps and all(e.num_tokens > 0 for e in jumps)
    for request, out in zip(requests, outputs, strict=True):
        key = engine.input_processor.process(request.prompt, request.images).key_ids
        full = [*key, *out.token_ids[:-1]]  # the last token has no KV: never in the tree
        full = full[: len(full) // page_size * page_size]  # the tree holds whole pages only
        expected = set()
        for e in jumps:
            if e.rid == out.rid:
                expected.update(range(e.start, e.start + e.num_tokens))
        marks = path_marks(builder.tree, full, lambda i: forced[i])
        assert [t for t, _ in marks] == full  # the whole request is cached
        assert {p for p, (_, m) in enumerate(marks) if m} == expected & set(range(len(full)))
        assert out.stats.forced_tokens == len(expected)


def test_the_first_forced_run_is_shared_and_the_tree_forks_below_it():
    engine, _, frames, outputs, events = run(1)
    last = frames[-1]
    by_id = {n.id: n for n in last.nodes}
    leaves = [n for n in last.live if not any(m.parent == n.id for m in last.live)]
    assert len(leaves) == len({o.text for o in outputs}) > 1  # the sampled answers differ

    def ancestors(n):
        while n.parent is not None:
            yield n.id
            n = by_id[n.parent]

    shared = set.intersection(*(set(ancestors(leaf)) for leaf in leaves))
    builder = FrameBuilder()
    builder.extend(events)
    forced_ids = [
        t
        for n in sorted((by_id[i] for i in shared), key=lambda n: n.depth)
        for o, m in n.label.forced
        for t in builder.tree.nodes[n.id].key[o : o + m]
    ]
    assert engine.tokenizer.decode(forced_ids).startswith(FIRST_RUN)
    # Below the shared nodes the tree forks at a sampled (unforced) token.
    forks = [n for n in last.live if n.parent in shared and n.id not in shared]
    assert len(forks) > 1 and all(n.label.parts[0][0] == "text" for n in forks)


def test_step_captions_name_each_jump():
    _, _, frames, outputs, events = run(1)
    jumps = [e for e in events if isinstance(e, JumpForwardEvent)]
    captions = " ".join(f.caption for f in frames)
    for e in jumps:
        assert e.describe() in captions
    assert "jump-forward: req-0 + 18 forced tokens" in frames[1].caption


def test_per_event_a_jump_gets_a_frame_and_marks_appear_with_the_step():
    model, processor = shipped()
    engine = LLMEngine(model, processor, num_kv_slots=2048)
    builder, bus = builder_for(engine)  # every_event=True
    builder.attach(bus)
    [request] = json_requests(processor, seeds=(1,))
    engine.add_request(request)
    assert builder.frames[-1].caption == "jump-forward: req-0 + 18 forced tokens"
    engine.step()
    [prompt_node] = builder.frames[-1].live
    assert prompt_node.label.forced == ((prompt_node.num_tokens - 18, 18),)
    assert builder.frames[-1].caption.startswith("step 1: prefill req-0")


def test_forced_frames_survive_a_jsonl_log(tmp_path):
    _, _, frames, _, events = run(1)
    save_events(events, tmp_path / "json.jsonl")
    assert load_events(tmp_path / "json.jsonl") == events
    replayed = frames_from_events(tmp_path / "json.jsonl", every_event=False, initial=False)
    marked = [n.label.forced for n in frames[-1].live]
    assert [n.label.forced for n in replayed[-1].live] == marked


def test_the_svg_marks_forced_text_only_where_there_is_some():
    _, _, frames, _, _ = run(1)
    svg = frame_svg(frames[-1])
    assert f'fill="{FORCED}" font-weight="bold"' in svg and 'class="forced"' in svg
    assert ">forced</text>" in svg  # the legend item
    bus = EventBus()
    cache = RadixCache(bus=bus)
    plain = FrameBuilder()
    plain.attach(bus)
    cache.insert([1, 2, 3])
    assert FORCED not in frame_svg(plain.frames[-1])  # frames without grammars are unchanged


def test_events_without_jumps_are_framed_as_before():
    """A JumpForwardEvent alone in a log (no engine step after it) changes no node."""
    bus = EventBus()
    cache = RadixCache(bus=bus)
    recorder = EventRecorder(bus)
    cache.insert([1, 2, 3])
    bus.emit(JumpForwardEvent(bus.tick(), "r0", 3, 2))
    cache.insert([1, 2, 3, 4, 5])
    frames = frames_from_events(recorder.events)
    assert [f.caption for f in frames][-2] == "jump-forward: r0 + 2 forced tokens"
    assert all(not n.label.forced for f in frames for n in f.live)
