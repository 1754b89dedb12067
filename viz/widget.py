"""RadixView: the animated radix tree and KV pool as a Jupyter widget (anywidget).

Python owns the frames (:mod:`viz.frame_builder`); the browser only plays them. All frames go to the
front end once, as the synced traits ``_frames`` and ``_labels``; playback (play/pause, step,
slider, speed) runs in ``viz/static/radix_view.js`` with no kernel round trip, and the
``step`` trait follows it so Python (and ``jslink``) can read or set the current frame.

In live mode (:meth:`RadixView.attach`) the view subscribes to a cache's or engine's event bus
and sends each new frame as a custom message (re-sending the whole list on every event would
cost time quadratic in its length); a view displayed later asks for what it missed.

Images: the edges that start with an image span show a thumbnail of the picture (the trait
``_images``, name -> PNG data URI), so a fork at an image boundary reads at a glance.
:func:`run_engine` and :meth:`RadixView.attach` make them from the requests' images.

Big trees: beyond ``max_nodes`` nodes, the browser draws a frame collapsed (the changed,
locked and most recently used nodes with their paths; the rest folded into "+k" marks).

For viewers without a kernel (GitHub, nbviewer, nbconvert, nbval) the MIME bundle also holds
a static ``image/svg+xml`` of the current frame (:func:`viz.svg.frame_svg`) and a one-line
``text/plain`` summary with no memory address in it.

Example::

    view = viz.replay_scenario()          # SGLang Figure 3, one frame per step
    view                                  # the widget
    view.step = 3; print(view)            # RadixView: step 4/9 (4) Chat 2 ..., 4 nodes, ...
    view.to_html("figure3.html")          # plays in any browser, offline

    live = viz.RadixView().attach(engine) # frames appear as the engine runs
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anywidget
import traitlets
from PIL import Image

from .export import STATIC, write_html
from .frame import Frame, frame_labels, frames_to_wire
from .frame_builder import FrameBuilder, frames_from_events
from .sources import builder_for, engine_frames, engine_image_names, scenario_frames
from .svg import frame_svg

__all__ = ["RadixView", "image_thumbnails", "replay_scenario", "run_engine", "thumbnail"]


# The DOM class of every widget viz displays: radix_view.css hides ipywidgets' "no kernel"
# icon on them, since they draw and play from a saved notebook's widget state alone.
VIEW_CLASS = "minirad-view"


class RadixView(anywidget.AnyWidget):
    """A player for radix-tree frames.

    Args:
        frames: the frames to play (e.g. :func:`viz.frame_builder.frames_from_events`); empty for a
            view that :meth:`attach` will fill.
        title: shown above the player in the HTML export.
        thumbnails: ``{image name: PNG data URI}`` for the image spans the frames name
            (see :func:`image_thumbnails`).
        kwargs: trait values: ``step`` (the frame shown), ``interval_ms`` (time per frame at
            1x speed), ``duration_ms`` (length of one animation), ``max_nodes`` (frames
            with more nodes are drawn collapsed), ``fit_min_text_px`` (the smallest node text,
            in px, that the "fit" checkbox draws: 11; 0 fits the whole tree at any size).

    Attributes:
        frames: the :class:`~viz.frame.Frame` objects, in order (grows in live mode).
    """

    _esm = STATIC / "radix_view.js"
    _css = STATIC / "radix_view.css"
    _frames = traitlets.List().tag(sync=True)
    _labels = traitlets.List().tag(sync=True)
    _images = traitlets.Dict().tag(sync=True)
    step = traitlets.Int(0).tag(sync=True)
    interval_ms = traitlets.Int(900).tag(sync=True)
    duration_ms = traitlets.Int(450).tag(sync=True)
    max_nodes = traitlets.Int(300).tag(sync=True)
    # "fit" (the player's checkbox) shrinks the tree to the view's width, but never draws node
    # text smaller than this (px; a wider tree scrolls); 0: fit always draws the whole tree.
    fit_min_text_px = traitlets.Float(11.0, min=0.0).tag(sync=True)
    # One line about a live source (shown above the player when not empty): where it listens,
    # what went wrong (no server, a bad frame, a restart), so a learner never faces a frozen view.
    status = traitlets.Unicode("").tag(sync=True)
    # Marks: a frame index per mark (``marks``), and the mark to show (``mark``, -1: none).
    # Another widget linked to ``mark`` with ``ipywidgets.jslink`` (the request slider of
    # viz/replicas.py) moves the player in the browser alone: it works from a notebook's
    # saved widget state, before any kernel runs.
    marks = traitlets.List(traitlets.Int()).tag(sync=True)
    mark = traitlets.Int(-1).tag(sync=True)

    def __init__(
        self,
        frames: Sequence[Frame] = (),
        title: str = "",
        thumbnails: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        self.frames: list[Frame] = list(frames)
        self.title = title
        self._builder: FrameBuilder | None = None
        self._unsubscribe = None
        self._wire_memo: dict = {}  # wire form of the last sent frame's node views and pool
        wire = frames_to_wire(self.frames)
        self._labels_sent = set(frame_labels(self.frames))
        super().__init__(
            _frames=wire["frames"], _labels=wire["labels"], _images=dict(thumbnails or {}), **kwargs
        )
        self.add_class(VIEW_CLASS)
        self.on_msg(self._on_front_end_message)

    @traitlets.validate("step")
    def _valid_step(self, proposal: dict) -> int:
        return max(0, min(proposal["value"], len(self.frames) - 1))

    @traitlets.observe("mark")
    def _show_mark(self, change: dict) -> None:
        if 0 <= change["new"] < len(self.marks):
            self.step = self.marks[change["new"]]

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_events(cls, events: Iterable | str | Path, **builder_kwargs: Any) -> RadixView:
        """A view of a recorded event log (a list of events or an EventRecorder JSONL file);
        ``builder_kwargs`` as in :class:`~viz.frame_builder.FrameBuilder` (``decode``,
        ``pool_size``...)."""
        return cls(frames_from_events(events, **builder_kwargs))

    # ------------------------------------------------------------------ live mode
    def attach(
        self, source: Any, *, every_event: bool = True, images: Iterable = (), **builder_kwargs
    ) -> RadixView:
        """Follow ``source`` live: an engine, a RadixCache, a ScenarioReplay or an EventBus
        (see :func:`viz.sources.builder_for`). Starts with a frame of the empty cache, then
        one frame per event (``every_event``) or per :meth:`snapshot`. Returns ``self``.
        ``images``: PIL images or paths an engine will see, to name their spans by hash and
        draw their thumbnails (engines only).

        Raises:
            ValueError: the view already has frames, or the cache is not empty.
            RuntimeError: the view is already attached.
        """
        if self._unsubscribe is not None:
            raise RuntimeError("this view is already attached; call detach() first")
        if self.frames:
            raise ValueError("attach() fills an empty view: make a new RadixView()")
        images = list(images)
        builder, bus = builder_for(source, images=images, every_event=every_event, **builder_kwargs)
        if images and hasattr(source, "input_processor"):  # an engine: it names the images
            self._images = image_thumbnails(source, images)
        self._builder = builder
        builder.snapshot()
        self._unsubscribe = bus.subscribe(self._on_event)
        self._append(0)
        return self

    def detach(self) -> None:
        """Stop following the source (the frames stay)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def snapshot(self, title: str | None = None) -> Frame:
        """Take a frame now (live mode with ``every_event=False``): the events since the last
        frame, under ``title``.

        Raises:
            RuntimeError: the view is not attached.
        """
        if self._builder is None:
            raise RuntimeError("snapshot() needs an attached view")
        start = len(self.frames)
        if title is not None:
            self._builder.title = title
        frame = self._builder.snapshot()
        self._append(start)
        return frame

    def _on_event(self, event) -> None:
        start = len(self._builder.frames)
        self._builder.apply(event)
        if len(self._builder.frames) > start:
            self._append(start)

    def _append(self, start: int) -> None:
        """Frames ``start:`` of the builder are new: keep them and send them to the views."""
        new = self._builder.frames[start:]
        following = self.step >= len(self.frames) - 1
        self.frames.extend(new)
        self._send_frames(start)
        if following:
            self.step = len(self.frames) - 1

    def _send_frames(self, start: int, all_labels: bool = False) -> None:
        """Send frames ``start:`` with the labels the front end lacks (all of theirs for a
        view that has just asked)."""
        frames = self.frames[start:]
        labels = frame_labels(frames)
        if not all_labels:
            labels = {i: lab for i, lab in labels.items() if i not in self._labels_sent}
        self._labels_sent.update(labels)
        memo = self._wire_memo
        wire = [f.to_dict(memo) for f in frames]
        # Only the last frame's views can be reused by the next one: keep just those.
        last = frames[-1]
        kept = (*last.nodes, last.pool, *([last.host_pool] if last.host_pool else []))
        self._wire_memo = {id(o): memo[id(o)] for o in kept}
        self.send(
            {
                "kind": "append",
                "start": start,
                "frames": wire,
                "labels": [[i, lab.to_dict()] for i, lab in labels.items()],
            }
        )

    def _on_front_end_message(self, _widget, content: dict, _buffers) -> None:
        if isinstance(content, dict) and content.get("kind") == "hello":
            have = int(content.get("frames", 0))
            if have < len(self.frames):
                self._send_frames(have, all_labels=True)

    # ------------------------------------------------------------------ static views
    def svg(self, step: int | None = None) -> str:
        """The static SVG of frame ``step`` (the current one by default)."""
        i = self.step if step is None else step
        return frame_svg(self.frames[i], heading=f"step {i + 1}/{len(self.frames)}")

    def to_html(self, path: str | Path, title: str | None = None) -> Path:
        """Write a standalone HTML player of every frame (no kernel, no network)."""
        return write_html(
            self.frames,
            path,
            title=title or self.title or "minirad radix tree",
            step=self.step,
            interval_ms=self.interval_ms,
            duration_ms=self.duration_ms,
            max_nodes=self.max_nodes,
            thumbnails=self._images,
            fit_min_text_px=self.fit_min_text_px,
        )

    def __len__(self) -> int:
        return len(self.frames)

    def __getitem__(self, i: int) -> Frame:
        return self.frames[i]

    def __repr__(self) -> str:
        if not self.frames:
            return "RadixView: no frames"
        f = self.frames[self.step]
        title = f" {f.title}" if f.title else ""
        return f"RadixView: step {self.step + 1}/{len(self.frames)}{title}, {f.summary()}"

    def store_frames(self) -> None:
        """Put every frame so far into the synced traits ``_frames`` and ``_labels``: what a
        saved notebook keeps of the player (frames appended live travel as messages, which
        the file does not keep). Called on display; does nothing if they are all there."""
        if len(self._frames) == len(self.frames):
            return
        wire = frames_to_wire(self.frames)
        self._labels_sent = set(frame_labels(self.frames))
        self.set_trait("_labels", wire["labels"])
        self.set_trait("_frames", wire["frames"])

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict, dict]:
        self.store_frames()
        bundle = super()._repr_mimebundle_(**kwargs)
        data, metadata = bundle if isinstance(bundle, tuple) else (bundle, {})
        data["text/plain"] = repr(self)
        if self.frames:
            data["image/svg+xml"] = self.svg()
        return data, metadata


def replay_scenario(scenario=None, *, per: str = "step", **kwargs: Any) -> RadixView:
    """A view of a scenario replayed through a real RadixCache (SGLang Figure 3 by default).

    Args:
        scenario: a :class:`~minirad.course.scenario.Scenario`, a scenario file, or None.
        per: ``"step"`` (one frame per panel of the figure) or ``"event"``.
        kwargs: ``tokenizer``, ``eviction_policy``, as in
            :class:`~minirad.course.scenario.ScenarioReplay`.
    """
    frames = scenario_frames(scenario, per=per, **kwargs)
    return RadixView(frames, title="SGLang Figure 3, replayed" if scenario is None else "")


def run_engine(engine, requests: Sequence, *, per: str = "step") -> tuple[RadixView, list]:
    """Run ``requests`` through a fresh ``engine`` and return ``(view, outputs)``: one frame
    per engine step (or per event), outputs in request order
    (see :func:`viz.sources.engine_frames`)."""
    frames, outputs = engine_frames(engine, requests, per=per)
    images = [im for r in requests for im in getattr(r, "images", ())]
    thumbs = image_thumbnails(engine, images)
    return RadixView(frames, title="minirad engine run", thumbnails=thumbs), outputs


def image_thumbnails(engine, images: Iterable, size: int = 48) -> dict[str, str]:
    """``{image name: PNG data URI}``: a picture of at most ``size`` x ``size`` px for each
    image (PIL image or path), under the name the frames give its span (its hash as the
    engine computes it, :func:`viz.frame_builder.image_names`)."""
    thumbs = {}
    for image in images:
        (name,) = engine_image_names(engine, [image]).values()
        thumbs[name] = thumbnail(image, size)
    return thumbs


def thumbnail(image, size: int = 48) -> str:
    """A PNG data URI of ``image`` (PIL image or path), at most ``size`` x ``size`` px."""
    from minirad.engine.processing import load_image  # the engine needs transformers: lazy

    picture = load_image(image).convert("RGB")
    picture.thumbnail((size, size), Image.Resampling.LANCZOS)
    png = io.BytesIO()
    picture.save(png, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode("ascii")
