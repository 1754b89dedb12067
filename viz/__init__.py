"""The minirad visualizer (chapter 07): an animated radix tree and KV block pool in JupyterLab.

Its one contract, fixed now so that the library can be built against it: frames are computed
from ``minirad.events`` only (live from an ``EventBus`` or replayed from a JSONL log), never by
reading a cache's internals, and ``minirad`` never imports ``viz``. The widget itself arrives
with the visualizer milestone.
"""
