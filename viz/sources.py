"""Where the visualizer's events come from: a cache, an engine, the Figure 3 scenario.

Each function here only *subscribes* to a bus and, for the settings a frame needs (the pool's
size, the tokenizer, the vocabulary size that separates image pad ids from text), reads the
component's public configuration. The tree itself is always rebuilt from the events
(:class:`~viz.frame_builder.FrameBuilder`), never read from the cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from minirad.course.scenario import ScenarioReplay, load_scenario
from minirad.events import EventBus

from .frame import Frame
from .frame_builder import FrameBuilder, image_names

__all__ = ["builder_for", "engine_frames", "engine_image_names", "scenario_frames"]


def _decoder(tokenizer):
    if tokenizer is None or not hasattr(tokenizer, "decode"):
        return None
    return lambda ids: tokenizer.decode(ids)


def engine_image_names(engine, images: Iterable) -> dict[int, str]:
    """``{pad id: "img <hash prefix>"}`` for images as the engine hashes them."""
    from minirad.engine.processing import load_image  # the engine needs transformers: lazy
    from minirad.kvcache.multimodal import hash_image

    proc = engine.input_processor
    params = getattr(proc, "preprocess_params", {})
    hashes = [hash_image(load_image(im), **params) for im in images]
    return image_names(hashes, proc.vocab_size)


def builder_for(source: Any, images: Iterable = (), **overrides) -> tuple[FrameBuilder, EventBus]:
    """A :class:`FrameBuilder` set up for ``source`` and the bus to attach it to.

    Args:
        source: an :class:`~minirad.engine.LLMEngine` (tree + allocator + tokenizer), a
            :class:`~minirad.kvcache.radix_cache.RadixCache` (a
            :class:`~minirad.kvcache.hiradix_cache.HiRadixCache`'s frames show its tiers and
            host pool), a
            :class:`~minirad.course.scenario.ScenarioReplay`, or an
            :class:`~minirad.events.EventBus`.
        images: PIL images (or paths) the engine will see, to name their spans by hash
            (engines only; other pad ids get a generic name).
        overrides: :class:`FrameBuilder` arguments that replace the derived ones; with
            ``every_event=False`` an engine gives one frame per step (each
            :class:`~minirad.events.StepEvent` ends a frame).

    Raises:
        ValueError: the cache (or pool) already holds tokens: frames are built from events,
            so a view must start listening before the first insert.
        TypeError: ``source`` is none of the above.
    """
    kw: dict[str, Any] = {}
    if isinstance(source, EventBus):
        bus, cache, alloc = source, None, None
    elif hasattr(source, "tree_cache") and hasattr(source, "input_processor"):  # an engine
        bus, cache, alloc = source.bus, source.tree_cache, source.allocator
        kw["decode"] = _decoder(source.tokenizer)
        kw["vocab_size"] = source.input_processor.vocab_size
        if images:
            kw["images"] = engine_image_names(source, images)
    elif hasattr(source, "cache") and hasattr(source, "scenario"):  # a ScenarioReplay
        bus, cache, alloc = source.bus, source.cache, source.allocator
        kw["decode"] = _decoder(source.tokenizer)
    elif hasattr(source, "match_prefix") and hasattr(source, "bus"):  # a RadixCache
        bus, cache, alloc = source.bus, source, source.token_to_kv_pool_allocator
    else:
        raise TypeError(f"cannot visualize a {type(source).__name__}")
    if cache is not None:
        kw["page_size"] = cache.page_size
        if cache.evictable_size() + cache.protected_size():
            raise ValueError(
                "the cache already holds tokens: attach the view before the first insert "
                "(or after cache.reset()), since frames are built from events only"
            )
    host = getattr(cache, "host_pool", None)  # a cache with tiers (HiRadixCache)
    if host is not None:
        kw["host_pool_size"] = host.size
        if host.available_size() != host.size:
            raise ValueError("the host pool already has slots in use: attach the view first")
    if alloc is not None:
        kw["pool_size"] = alloc.size
        if alloc.available_size() != alloc.size:
            raise ValueError("the KV pool already has slots in use: attach the view first")
    kw.update(overrides)
    return FrameBuilder(**kw), bus


def scenario_frames(
    scenario=None, *, per: str = "step", tokenizer=None, eviction_policy: str = "lru"
) -> list[Frame]:
    """Replay a scenario (Figure 3 by default) through a real RadixCache and return its frames.

    Args:
        scenario: a :class:`~minirad.course.scenario.Scenario`, the path of a scenario file, or None
            for ``data/scenarios/figure3.json``.
        per: ``"step"``: one frame per scenario step (the figure's panels); ``"event"``: one
            frame per cache or pool event, after a first frame of the empty cache.
        tokenizer, eviction_policy: as in :class:`~minirad.course.scenario.ScenarioReplay`.

    Each frame's title is the step it belongs to, ``"(4) Chat 2 starts ..."``.

    Raises:
        ValueError: ``per`` is neither ``"step"`` nor ``"event"``.
    """
    if per not in ("step", "event"):
        raise ValueError(f"per must be 'step' or 'event', got {per!r}")
    if isinstance(scenario, str | Path):
        scenario = load_scenario(scenario)
    replay = ScenarioReplay(scenario, tokenizer, eviction_policy)
    builder, bus = builder_for(replay, every_event=per == "event")
    unsubscribe = builder.attach(bus)
    for step in replay.scenario.steps:
        builder.title = f"({step.number}) {step.title}"
        if per == "event" and not builder.frames:
            builder.snapshot()
        replay.step()
        if per == "step":
            builder.snapshot()
    unsubscribe()
    return builder.frames


def engine_frames(engine, requests: Sequence, *, per: str = "step") -> tuple[list[Frame], list]:
    """Run ``requests`` through ``engine`` to completion, recording frames.

    Args:
        engine: a fresh :class:`~minirad.engine.LLMEngine` (nothing cached yet).
        requests: :class:`~minirad.engine.GenerateRequest` objects (or prompts), all queued
            before the first step; their images name the image spans.
        per: ``"step"``: one frame per engine step, ended by the step's
            :class:`~minirad.events.StepEvent` and titled ``"engine step k"``; ``"event"``:
            one frame per event (the StepEvent's own frame closes each step).

    The first frame is the empty cache with the requests queued. A step frame's caption
    says what the step computed, then what changed in the tree
    (``"step 3: prefill req-1 (tokens 70-85), decode req-0 | insert: ..."``), and its
    :attr:`~viz.frame.Frame.step` lists the batch and the running requests.

    Returns:
        ``(frames, outputs)``: the frames and each request's final
        :class:`~minirad.engine.RequestOutput`, in request order.

    Raises:
        ValueError: ``per`` is neither ``"step"`` nor ``"event"``, or the cache is not empty.
    """
    if per not in ("step", "event"):
        raise ValueError(f"per must be 'step' or 'event', got {per!r}")
    images = [im for r in requests for im in getattr(r, "images", ())]
    builder, bus = builder_for(engine, images=images, every_event=per == "event")
    unsubscribe = builder.attach(bus)
    builder.title = "engine: requests queued"
    builder.snapshot()
    try:
        rids = [engine.add_request(r) for r in requests]
        done: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            builder.title = f"engine step {builder.num_steps + 1}"
            for out in engine.step():  # its StepEvent ends the step's frame
                if out.finished:
                    done[out.rid] = out
    finally:
        unsubscribe()
    return builder.frames, [done[rid] for rid in rids]
