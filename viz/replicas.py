"""Replicas behind a router, drawn: each replica's prefix cache side by side, live from its KV
events, and the router's choice for each request (chapter 10).

Each replica (a ``minirad serve`` worker or a real vLLM server, started with KV events) gets a
:class:`~viz.watch.BlockCacheView` of its own, fed by its own subscriber, so the trees are
what the replicas' caches really hold. Under them, one row per request: the replica the
router picked (read from the workers' own request counters,
:func:`minirad.cluster.replicas.send_routed`) and the prompt tokens that replica found cached. The
request slider moves every tree to the moment that request's blocks had arrived; it runs in
the browser (:class:`RouteTable`, linked to the players with ``ipywidgets.jslink``), so a
saved notebook's slider works before its kernel runs.

A replica's status line names the worker it is (``minirad serve answering at ...``, ``vLLM
answering at ...``): both speak vLLM's wire format, so the subscriber is told the name.

Everything received is kept in arrival order (:attr:`ReplicaCacheView.records`), so a session
saves to one JSON-lines file (:meth:`ReplicaCacheView.save_recording`: KV-event batches
tagged with their replica, and route lines) and replays without a server
(:func:`replay_replicas`), frame for frame.

Example::

    with MiniradWorker(cpus=[0], kv_events=True) as a, MiniradWorker(cpus=[1], kv_events=True) as b:
        with Router("sglang", [a, b], policy="cache_aware") as router:
            view = viz.watch_replicas(router.workers)
            view                                              # the live widget
            for prompt in prompts:
                view.send(router, {"model": a.model_name, "prompt": prompt, "max_tokens": 4})
            view.save_recording("routing.jsonl"); view.stop()
    viz.replay_replicas("routing.jsonl")                      # the same, no server
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from html import escape
from pathlib import Path
from typing import Any

import anywidget
import ipywidgets
import traitlets

from minirad.cluster.replicas import send_routed
from minirad.errors import InvalidArgumentError, KVEventError
from minirad.kv_events import (
    KVEventBatch,
    KVEventSubscriber,
    Notice,
    batch_from_json,
    batch_to_json,
)
from minirad.models import DEFAULT_MODEL_DIR

from .export import STATIC
from .svg import side_by_side
from .watch import BlockCacheView
from .widget import VIEW_CLASS

__all__ = ["ReplicaCacheView", "Route", "RouteTable", "replay_replicas", "watch_replicas"]

# One colour per replica (the route table's marks), as matplotlib's tab10 starts.
REPLICA_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


@dataclass(frozen=True)
class Route:
    """Where the router sent one request.

    Attributes:
        replica: the index of the replica that served it.
        prompt: a short label of the prompt (its first words, or its length for token ids).
        prompt_tokens, cached_tokens: the prompt's length and the part of it that replica
            found in its prefix cache (``usage.prompt_tokens_details.cached_tokens``).
        frames: each replica's frame count once the request's blocks had arrived (what the
            request slider shows).
    """

    replica: int
    prompt: str
    prompt_tokens: int
    cached_tokens: int
    frames: tuple[int, ...] = ()


class RouteTable(anywidget.AnyWidget):
    """The request slider and the route table under a :class:`ReplicaCacheView`, drawn by
    ``viz/static/route_table.js``: one row per request (its replica's colour mark, the cached
    and prompt tokens), the row of request ``value`` highlighted.

    Attributes:
        value: the request shown (the slider's position).
        routes: one ``{"replica", "prompt", "prompt_tokens", "cached_tokens"}`` per request.
        colours: one colour per replica.
    """

    _esm = STATIC / "route_table.js"
    _css = STATIC / "radix_view.css"  # its rule for VIEW_CLASS, whichever widget draws first
    value = traitlets.Int(0).tag(sync=True)
    routes = traitlets.List().tag(sync=True)
    colours = traitlets.List(traitlets.Unicode()).tag(sync=True)


def prompt_label(body: dict, chars: int = 40) -> str:
    """A request body's prompt in a few words: the text of ``prompt`` (or of the last chat
    message), cut to ``chars`` characters; ``"N token ids"`` for a token-id prompt."""
    prompt = body.get("prompt")
    if prompt is None and body.get("messages"):
        content = body["messages"][-1].get("content", "")
        if isinstance(content, list):
            content = " ".join(c.get("text", "") for c in content if isinstance(c, dict))
        prompt = content
    if isinstance(prompt, list):
        return f"{len(prompt)} token ids"
    text = " ".join(str(prompt or "").split())
    return text if len(text) <= chars else text[: chars - 1] + "…"


class ReplicaCacheView(ipywidgets.VBox):
    """Several replicas' block caches side by side, with the router's choice per request.

    Args:
        names: one heading per replica (``"replica 0: minirad serve :8001"``).
        model_dir: the served model's folder (token labels, image chips), as in
            :class:`~viz.watch.BlockCacheView`.

    Attributes:
        views: one :class:`~viz.watch.BlockCacheView` per replica, in order.
        routes: one :class:`Route` per request sent through :meth:`send`, in order.
        records: every batch and route in arrival order, as :meth:`save_recording` writes them.
        request: the slider over the routes and the route table (a :class:`RouteTable`;
            ``request.value`` is the request shown).

    Raises:
        InvalidArgumentError: ``names`` is not a non-empty list of str, or ``model_dir``
            holds no ``config.json``.
    """

    def __init__(
        self, names: Sequence[str], model_dir: str | os.PathLike | None = DEFAULT_MODEL_DIR
    ) -> None:
        if isinstance(names, str) or not names or not all(isinstance(n, str) for n in names):
            raise InvalidArgumentError(
                f"names must be a non-empty list of str, one per replica, got {names!r}"
            )
        self.names = list(names)
        self.views = [BlockCacheView(model_dir, title=name) for name in self.names]
        self.routes: list[Route] = []
        self.records: list[dict] = []
        self._subscribers: list[KVEventSubscriber] = []
        self._lock = threading.Lock()  # each replica's batches arrive on its own thread
        self._last_arrival = time.monotonic()
        self.request = RouteTable(colours=[_colour(i) for i in range(len(self.names))])
        self.request.observe(self._show_request, "value")
        # In the browser, the slider moves each player to its frame of that request itself.
        self._links = [ipywidgets.jslink((self.request, "value"), (v, "mark")) for v in self.views]
        columns = []
        for i, (name, view) in enumerate(zip(self.names, self.views, strict=True)):
            heading = ipywidgets.HTML(
                f'<b style="color:{_colour(i)}">&#9632;</b> <b>{escape(name)}</b>'
            )
            columns.append(
                # A player needs ~460 px for its toolbar: narrower, the columns wrap (stack).
                ipywidgets.VBox(
                    [heading, view], layout=ipywidgets.Layout(flex="1 1 460px", min_width="460px")
                )
            )
        row = ipywidgets.HBox(columns, layout=ipywidgets.Layout(flex_flow="row wrap"))
        super().__init__([row, self.request])
        for box in (self, row, self.request, *columns, *(c.children[0] for c in columns)):
            box.add_class(VIEW_CLASS)  # drawn from saved state: no "no kernel" icon

    # ------------------------------------------------------------------ input
    def receive(self, replica: int, item: tuple[int, KVEventBatch] | Notice) -> None:
        """One item of replica ``replica``'s subscriber: a batch is drawn in its tree and
        kept; a notice goes to its status line.

        Raises:
            InvalidArgumentError: no such replica.
        """
        self._check_replica(replica)
        with self._lock:
            self._last_arrival = time.monotonic()
            if not isinstance(item, Notice):
                self.records.append({"replica": replica, **batch_to_json(*item)})
            self.views[replica].receive(item)

    def add_route(self, route: Route) -> None:
        """Record where a request went; ``route.frames`` is filled in with each tree's frame
        count now.

        Raises:
            InvalidArgumentError: no such replica, a prompt label that is not a str, or token
                counts that are not ints >= 0 with at most the prompt's tokens cached.
        """
        self._check_route(route)
        with self._lock:
            frames = tuple(len(v.frames) for v in self.views)
            route = dataclasses.replace(route, frames=frames)
            self.routes.append(route)
            self.records.append({"route": asdict(route)})
        for i, view in enumerate(self.views):
            view.marks = [max(0, r.frames[i] - 1) for r in self.routes]
        rows = [{k: v for k, v in asdict(r).items() if k != "frames"} for r in self.routes]
        self.request.routes = rows
        self.request.value = len(self.routes) - 1
        self._show_request()

    def _check_replica(self, replica: object) -> None:
        if not (_is_count(replica) and replica < len(self.views)):
            raise InvalidArgumentError(f"no replica {replica!r}: the view has {len(self.views)}")

    def _check_route(self, route: Route) -> None:
        self._check_replica(route.replica)
        if not isinstance(route.prompt, str):
            raise InvalidArgumentError(f"a route's prompt is a label (str), got {route.prompt!r}")
        if not (_is_count(route.prompt_tokens) and _is_count(route.cached_tokens)):
            raise InvalidArgumentError(f"token counts must be ints >= 0, got {route}")
        if route.cached_tokens > route.prompt_tokens:
            raise InvalidArgumentError(
                f"{route.cached_tokens} cached tokens of a {route.prompt_tokens}-token prompt"
            )

    def send(
        self,
        router,
        body: dict,
        path: str = "/v1/completions",
        *,
        label: str | None = None,
        quiet_s: float = 0.5,
    ) -> dict:
        """POST ``body`` through ``router`` (a :class:`minirad.cluster.replicas.Router` whose
        workers are this view's replicas, in order), wait until no batch has arrived for ``quiet_s``
        seconds, and add the request's :class:`Route`, under ``label`` (default:
        :func:`prompt_label`). Returns the response body. One request at a time
        (:func:`minirad.cluster.replicas.send_routed`).

        Raises:
            InvalidArgumentError: the router has another number of workers than the view.
            PeerError: as :func:`~minirad.cluster.replicas.send_routed`.
        """
        if len(router.workers) != len(self.views):
            raise InvalidArgumentError(
                f"the router has {len(router.workers)} workers, the view {len(self.views)}"
            )
        routed = send_routed(router, body, path)
        deadline = time.monotonic() + 10 * quiet_s
        while time.monotonic() - self._last_arrival < quiet_s and time.monotonic() < deadline:
            time.sleep(quiet_s / 10)
        label = prompt_label(body) if label is None else label
        self.add_route(Route(routed.worker, label, routed.prompt_tokens, routed.cached_tokens))
        return routed.reply

    def listen(self, workers: Sequence) -> ReplicaCacheView:
        """Subscribe to each worker's KV events (``kv_events_endpoint``, ``replay_endpoint``),
        worker ``i`` drawn in tree ``i``. Returns self.

        Raises:
            InvalidArgumentError: not one worker per replica, or one without KV events.
            RuntimeError: the view already listens.
        """
        if self._subscribers:
            raise RuntimeError("this view already listens; stop() it first")
        if len(workers) != len(self.views):
            raise InvalidArgumentError(f"{len(workers)} workers for {len(self.views)} replicas")
        silent = [w.base_url for w in workers if getattr(w, "kv_events_endpoint", None) is None]
        if silent:
            raise InvalidArgumentError(f"these workers publish no KV events: {silent}")
        for i, (worker, view) in enumerate(zip(workers, self.views, strict=True)):
            subscriber = KVEventSubscriber(
                worker.kv_events_endpoint,
                worker.replay_endpoint,
                name=getattr(worker, "name", None),
            )
            self._subscribers.append(subscriber)
            view.status = f"listening on {subscriber.endpoint}"
            subscriber.start(lambda item, i=i: self.receive(i, item))
        return self

    def stop(self) -> None:
        """Stop listening (the frames and routes stay)."""
        for subscriber, view in zip(self._subscribers, self.views, strict=False):
            subscriber.close()
            view.status = "stopped"
        self._subscribers = []

    # ------------------------------------------------------------------ recording
    def save_recording(self, path: str | os.PathLike) -> Path:
        """Write the replicas' names (``{"replicas": [...]}``), then every batch and route
        received, in arrival order, one JSON object a line: ``{"replica": 1, "seq": ...,
        "events": [...]}`` (a batch, as :func:`minirad.kv_events.batch_to_json`) or
        ``{"route": {...}}``. Returns the path."""
        with self._lock:
            records = [{"replicas": self.names}, *self.records]
            lines = [json.dumps(r) + "\n" for r in records]
        path = Path(path)
        path.write_text("".join(lines))
        return path

    # ------------------------------------------------------------------ display
    def _show_request(self, _change: Any = None) -> None:
        if self.routes:
            route = self.routes[self.request.value]
            for view, n in zip(self.views, route.frames, strict=True):
                view.step = n - 1

    def route_lines(self) -> list[str]:
        """The route table as text lines (the static picture's footer)."""
        lines = [f"{'request':>7}  {'replica':>7}  {'cached / prompt':>15}  prompt"]
        for k, r in enumerate(self.routes):
            mark = ">" if k == self.request.value else " "
            cached = f"{r.cached_tokens} / {r.prompt_tokens}"
            lines.append(f"{mark}{k:>6}  {r.replica:>7}  {cached:>15}  {r.prompt}")
        return lines

    def svg(self) -> str:
        """A static SVG: each replica's tree at the current request, and the route table."""
        drawings = [v.svg() for v in self.views]
        return side_by_side(drawings, self.names, self.route_lines())

    def __repr__(self) -> str:
        counts = [sum(r.replica == i for r in self.routes) for i in range(len(self.views))]
        cached = sum(r.cached_tokens for r in self.routes)
        prompt = sum(r.prompt_tokens for r in self.routes)
        return (
            f"ReplicaCacheView: {len(self.views)} replicas, {len(self.routes)} requests "
            f"(per replica {counts}), {cached:,} of {prompt:,} prompt tokens cached"
        )

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict, dict]:
        for view in self.views:  # the saved notebook keeps the trees' frames
            view.store_frames()
        bundle = super()._repr_mimebundle_(**kwargs)
        data, metadata = bundle if isinstance(bundle, tuple) else (bundle, {})
        data["text/plain"] = repr(self)
        if all(v.frames for v in self.views):
            data["image/svg+xml"] = self.svg()
        return data, metadata


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _colour(replica: int) -> str:
    return REPLICA_COLOURS[replica % len(REPLICA_COLOURS)]


def watch_replicas(
    workers: Sequence,
    *,
    names: Sequence[str] | None = None,
    model_dir: str | os.PathLike | None = DEFAULT_MODEL_DIR,
) -> ReplicaCacheView:
    """A live view of ``workers``' caches (each with ``kv_events_endpoint``: a
    :class:`~minirad.cluster.replicas.MiniradWorker` started with ``kv_events=True``, a
    :class:`~minirad.peers.vllm_server.VLLMServer`), in the router's worker order.

    Args:
        names: one heading per worker; by default ``"replica i: <name> <url>"``.

    Raises:
        InvalidArgumentError: as :meth:`ReplicaCacheView.listen`.
    """
    if names is None:
        names = [f"replica {i}: {w.name} {w.base_url}" for i, w in enumerate(workers)]
    return ReplicaCacheView(names, model_dir).listen(workers)


def replay_replicas(
    path: str | os.PathLike,
    *,
    names: Sequence[str] | None = None,
    model_dir: str | os.PathLike | None = DEFAULT_MODEL_DIR,
) -> ReplicaCacheView:
    """The view of a recording of :meth:`ReplicaCacheView.save_recording`, as it was drawn
    live: the same frames in every tree, the same routes; no server needed.

    Args:
        names: one heading per replica; by default the recorded ones.

    Raises:
        KVEventError: the file is not a readable recording (the message gives the line).
        InvalidArgumentError: not one name per replica.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KVEventError(f"cannot read a replica recording at {path}: {e}") from e
    lines: list[tuple[int, Any]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        if raw.strip():
            try:
                lines.append((lineno, json.loads(raw)))
            except ValueError as e:
                raise KVEventError(f"{path}:{lineno}: not JSON: {e}") from e
    if not lines or not isinstance(lines[0][1], dict) or "replicas" not in lines[0][1]:
        raise KVEventError(f'{path}:1: not a replica recording: no {{"replicas": [...]}} line')
    recorded = lines.pop(0)[1]["replicas"]
    if names is not None and len(names) != len(recorded):
        raise InvalidArgumentError(f"{len(names)} names for {len(recorded)} replicas in {path}")
    try:
        view = ReplicaCacheView(names or recorded, model_dir)
    except InvalidArgumentError as e:
        raise KVEventError(f"{path}:1: {e}") from e
    for lineno, d in lines:
        try:
            if not isinstance(d, dict):
                raise TypeError(f"a JSON object, got {type(d).__name__}")
            if "route" in d:
                view.add_route(Route(**{k: v for k, v in d["route"].items() if k != "frames"}))
            else:
                view.receive(d["replica"], batch_from_json(d))
        except KeyError as e:
            raise KVEventError(f"{path}:{lineno}: not a replica recording line: no {e}") from e
        except (KVEventError, InvalidArgumentError, AttributeError, TypeError) as e:
            raise KVEventError(f"{path}:{lineno}: not a replica recording line: {e}") from e
    return view
