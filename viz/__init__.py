"""The minirad visualizer (chapter 07): an animated radix tree and KV pool in JupyterLab.

Its one contract: frames are computed from ``minirad.events`` only (live from an ``EventBus``
or replayed from a JSONL log), never by reading a cache's internals, and ``minirad`` never
imports ``viz``.

- :mod:`viz.frame`: what a :class:`Frame` holds (nodes, states, locks, KV pool, caption).
- :mod:`viz.frame_builder`: events -> frames (:class:`FrameBuilder`).
- :mod:`viz.layout`: the deterministic layout that keeps untouched nodes in place.
- :mod:`viz.svg`: a static SVG of one frame (the fallback shown without a kernel).
- :mod:`viz.widget`: :class:`RadixView`, the anywidget player (JS/CSS in ``viz/static``).
- :mod:`viz.export`: a standalone HTML replay.
- :mod:`viz.sources`: builders for an engine, a cache, the Figure 3 scenario.
- :mod:`viz.watch`: a real vLLM server's block cache, live from its KV events, or replayed
  (SGLang's radix tree too: ``schema="sglang"``).
- :mod:`viz.beside`: a real engine's cache beside ours, request by request (the real SGLang's
  radix tree beside our engine's: :func:`watch_sglang`, :func:`replay_sglang`).
- :mod:`viz.replicas`: several replicas' block caches side by side, and the router's choice
  for each request (chapter 10).
- :mod:`viz.charts`: matplotlib charts of the chapters (hit rates, forced tokens...).
- :mod:`viz.token_fsm`: a grammar's token-level state machine, explored through its mask and
  drawn with graphviz (chapter 09).

Example::

    import viz
    view = viz.replay_scenario()                  # SGLang Figure 3, one frame per step
    view
    view.to_html("figure3.html")
    view = viz.RadixView().attach(engine)         # live: a frame per event
"""

from .beside import BesideView, SGLangBesideOurs, replay_sglang, watch_sglang
from .frame import Frame, NodeView
from .frame_builder import FrameBuilder, frames_from_events, image_names
from .layout import StableLayout
from .replicas import ReplicaCacheView, replay_replicas, watch_replicas
from .svg import frame_svg
from .watch import BlockCacheView, replay_recording, watch
from .widget import RadixView, replay_scenario, run_engine

__all__ = [
    "BesideView",
    "BlockCacheView",
    "Frame",
    "FrameBuilder",
    "NodeView",
    "RadixView",
    "ReplicaCacheView",
    "SGLangBesideOurs",
    "StableLayout",
    "frame_svg",
    "frames_from_events",
    "image_names",
    "replay_recording",
    "replay_replicas",
    "replay_scenario",
    "replay_sglang",
    "run_engine",
    "watch",
    "watch_replicas",
    "watch_sglang",
]
