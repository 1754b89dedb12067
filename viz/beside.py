"""A real engine's cache beside ours: players side by side, moved together request by request.

:class:`BesideView` puts players (:class:`~viz.widget.RadixView`) in one row, each under its
heading, with a request slider under them: request ``k`` shows every player at its frame
after request ``k`` (0: before the first). The slider is linked to each player's ``mark`` in
the browser (``ipywidgets.jslink``), so a saved notebook's slider works before its kernel runs.
A player is half a row wide (at least 460 px): its "fit" box draws the whole tree in that width
(``RadixView.fit_min_text_px`` 0: the node text as small as that takes, each node's full text
in the details on hover; unticked, full size and a sideways scroll). Under the players, a table
of each engine's cached prompt tokens per request.

:class:`SGLangBesideOurs` is the chapter's pair: the real SGLang's radix tree, drawn from its KV
events (:func:`viz.watch.watch` with ``schema="sglang"``: one node per run of pages, as its tree
holds them), beside our engine's radix tree (its own events), both serving the same token ids
one request at a time, with KV pools of the same size. At page size 1 the two trees have the
same shape but for what each caches at a request's end (SGLang with its overlap scheduler also
caches the stop token), SGLang's first node (the token its health check cached), and splits
that change no page: a match that ends inside a node splits it in both caches, but SGLang
publishes no event for that, so its drawing keeps the node whole.

Example::

    pair = viz.replay_sglang()                                # the committed session, no SGLang
    pair
    with SGLangServer(text_model_dir()) as server:            # live (make sglang)
        pair = viz.watch_sglang(server)
        pair.generate(prompt_ids, max_new_tokens=8)           # both serve it; both trees grow
        pair.stop()
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from html import escape
from typing import Any

import ipywidgets

from minirad.errors import InvalidArgumentError
from minirad.models import DEFAULT_MODEL_DIR

from .svg import side_by_side
from .watch import BlockCacheView, end_replay, replay_recording, watch
from .widget import VIEW_CLASS, RadixView

__all__ = ["BesideView", "SGLangBesideOurs", "replay_sglang", "watch_sglang"]

THEIRS, OURS = "SGLang 0.5.23 (its KV events)", "minirad (our engine's events)"


class BesideView(ipywidgets.VBox):
    """Players side by side, and a slider over the requests they served.

    Args:
        views: the players, left to right.
        names: one heading per player.

    Attributes:
        views, names: as given.
        requests: one ``(label, cached tokens per player)`` per :meth:`add_request`.
        request: the slider (``request.value``: 0 before the first request, ``k`` after
            request ``k``).
        table: the requests and each player's cached tokens, as HTML.

    Raises:
        InvalidArgumentError: not one name (a str) per view, or no view.
    """

    def __init__(self, views: Sequence[RadixView], names: Sequence[str]) -> None:
        views, names = list(views), list(names)
        if not views or len(views) != len(names) or not all(isinstance(n, str) for n in names):
            raise InvalidArgumentError(f"one heading (a str) per view, got {names!r}")
        if not all(isinstance(v, RadixView) for v in views):
            raise InvalidArgumentError("views must be RadixView players")
        self.views, self.names = views, names
        self.requests: list[tuple[str, tuple[int | None, ...]]] = []
        for view in views:
            view.marks = [0]  # request 0: before the first one
            # A column is ~460 px: "fit" draws each whole tree in it, however small its text
            # (a node's full text shows on hover; unticking fit draws it full size).
            view.fit_min_text_px = 0
        self.request = ipywidgets.IntSlider(
            0, min=0, max=0, description="request", layout=ipywidgets.Layout(width="460px")
        )
        # In the browser the slider moves each player itself (its mark); here, the same.
        self._links = [ipywidgets.jslink((self.request, "value"), (v, "mark")) for v in views]
        self.request.observe(self._show_request, "value")
        self.table = ipywidgets.HTML(self._table_html())
        columns = [
            ipywidgets.VBox(
                [ipywidgets.HTML(f"<b>{escape(name)}</b>"), view],
                layout=ipywidgets.Layout(flex="1 1 460px", min_width="460px"),
            )
            for name, view in zip(names, views, strict=True)
        ]
        row = ipywidgets.HBox(columns, layout=ipywidgets.Layout(flex_flow="row wrap"))
        super().__init__([row, self.request, self.table])
        for box in (self, row, self.request, self.table, *columns):
            box.add_class(VIEW_CLASS)  # drawn from saved state: no "no kernel" icon
        for c in columns:
            c.children[0].add_class(VIEW_CLASS)

    def add_request(self, label: str, cached: Sequence[int | None] = ()) -> None:
        """Mark each player's last frame as the moment after this request, and show it.

        Args:
            label: the request in a few words.
            cached: the prompt tokens each player's engine found cached (None: unknown).

        Raises:
            InvalidArgumentError: ``cached`` has another length than the views.
        """
        cached = tuple(cached) or (None,) * len(self.views)
        if len(cached) != len(self.views):
            raise InvalidArgumentError(f"{len(cached)} cached counts for {len(self.views)} views")
        for view in self.views:
            view.marks = [*view.marks, max(0, len(view.frames) - 1)]
        self.requests.append((str(label), cached))
        self.request.max = len(self.requests)
        self.request.value = len(self.requests)
        self._show_request()
        self.table.value = self._table_html()

    def _show_request(self, _change: Any = None) -> None:
        k = self.request.value
        for view in self.views:
            if k < len(view.marks):
                view.step = view.marks[k]

    def _table_html(self) -> str:
        """The requests, one row each: its number, each engine's cached prompt tokens (one
        column per player, under one "cached tokens" heading), its prompt. Every cell padded
        and ruled (inline styles: the same in JupyterLab, an export, any notebook viewer)."""
        n = len(self.names)
        head = "".join(f"<th {_CELL}>{escape(_short(name))}</th>" for name in self.names)
        rows = [
            f'<tr><th {_CELL} rowspan="2">request</th>'
            f'<th {_CELL} colspan="{n}">cached tokens</th>'
            f'<th {_CELL} rowspan="2">prompt</th></tr>',
            f"<tr>{head}</tr>",
        ]
        for k, (label, cached) in enumerate(self.requests, 1):
            cells = "".join(f"<td {_NUMBER}>{'?' if c is None else c}</td>" for c in cached)
            rows.append(f"<tr><td {_NUMBER}>{k}</td>{cells}<td {_CELL}>{escape(label)}</td></tr>")
        return f'<table style="border-collapse:collapse;font-size:12px">{"".join(rows)}</table>'

    def lines(self) -> list[str]:
        """The request table as text lines (the static picture's footer)."""
        names = [_short(n) for n in self.names]
        width = max(len(n) for n in names)
        out = [f"{'request':>8}  " + "  ".join(f"{n:>{width}}" for n in names) + "  prompt"]
        for k, (label, cached) in enumerate(self.requests, 1):
            mark = ">" if k == self.request.value else " "
            counts = "  ".join(f"{'?' if c is None else c:>{width}}" for c in cached)
            out.append(f"{mark}{k:>7}  {counts}  {label}")
        return out

    def svg(self) -> str:
        """A static SVG: each player's current frame, and the request table."""
        return side_by_side([v.svg() for v in self.views], self.names, self.lines())

    def __repr__(self) -> str:
        sizes = ", ".join(f"{len(v.frames)}" for v in self.views)
        return (
            f"{type(self).__name__}: {len(self.views)} players ({sizes} frames), "
            f"{len(self.requests)} requests"
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


_CELL = 'style="border:1px solid #bbb;padding:2px 8px;text-align:left"'
_NUMBER = 'style="border:1px solid #bbb;padding:2px 8px;text-align:right"'


def _short(name: str) -> str:
    """A heading without its parenthesis: the table's column name."""
    return name.split(" (")[0]


class SGLangBesideOurs(BesideView):
    """SGLang's radix tree (its KV events) beside our engine's, serving the same requests.

    Args:
        theirs: the SGLang player (:func:`viz.watch.watch` with ``schema="sglang"``, or a
            recording's :class:`~viz.watch.BlockCacheView`).
        engine: our :class:`~minirad.engine.LLMEngine`, nothing cached yet (default: a fresh
            one on the shipped LLaVA, whose text half is the model SGLang serves
            (:mod:`minirad.peers.text_model`), with a KV pool of ``pool_tokens``).
        pool_tokens: the default engine's KV pool, in tokens: SGLang's ``max_total_tokens``,
            so that both evict when the same requests fill the same room.
        server: the :class:`~minirad.peers.sglang_server.SGLangServer` ``theirs`` listens to,
            for :meth:`generate` (None: a recording).

    Attributes:
        theirs, ours: the two players; engine, server: as given.
    """

    def __init__(
        self, theirs: BlockCacheView, engine=None, server=None, *, pool_tokens: int = 4096
    ) -> None:
        from minirad.engine import LLMEngine  # torch: only when our side is drawn

        if engine is None:
            engine = LLMEngine.from_pretrained(DEFAULT_MODEL_DIR, num_kv_slots=pool_tokens)
        self.engine = engine
        self.server = server
        self.theirs = theirs
        self.ours = RadixView(title="minirad radix cache").attach(self.engine, every_event=False)
        super().__init__([theirs, self.ours], [THEIRS, OURS])

    def serve_ours(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Any:
        """Our engine serves the request (greedy); returns its
        :class:`~minirad.engine.RequestOutput`."""
        from minirad.engine import GenerateRequest, SamplingParams

        sampling = SamplingParams(max_new_tokens=max_new_tokens)
        [out] = self.engine.generate([GenerateRequest(list(prompt_ids), sampling_params=sampling)])
        return out

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 8,
        *,
        label: str | None = None,
        quiet_s: float = 0.5,
    ) -> tuple[dict, Any]:
        """Send the request to the live SGLang, wait until its events stop coming for
        ``quiet_s`` s, serve it with our engine, and mark it. Returns ``(SGLang's reply, our
        RequestOutput)``.

        Raises:
            InvalidArgumentError: no server (a recording).
            PeerError: the server failed.
        """
        if self.server is None:
            raise InvalidArgumentError("a recorded view has no server to ask")
        reply = self.server.generate(list(prompt_ids), max_new_tokens=max_new_tokens)
        _wait_quiet(self.theirs, quiet_s)
        ours = self.serve_ours(prompt_ids, max_new_tokens)
        label = label if label is not None else f"{len(prompt_ids)} token ids"
        self.add_request(label, (reply["cached_tokens"], ours.stats.cached_tokens))
        return reply, ours

    def stop(self) -> None:
        """Stop listening to SGLang (the frames stay)."""
        self.theirs.stop()
        self.ours.detach()


def _wait_quiet(view: BlockCacheView, quiet_s: float, limit_s: float = 10.0) -> None:
    """Until no batch has reached ``view`` for ``quiet_s`` s (at most ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    seen, since = len(view.batches), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(quiet_s / 10)
        if len(view.batches) != seen:
            seen, since = len(view.batches), time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return


def watch_sglang(
    server, engine=None, *, model_dir: str | os.PathLike | None = None
) -> SGLangBesideOurs:
    """The live pair on a running :class:`~minirad.peers.sglang_server.SGLangServer` (with
    KV events): :meth:`SGLangBesideOurs.generate` sends a request to both.

    Args:
        model_dir: for the SGLang player's token labels (default: the server's model).
    """
    theirs = watch(
        server.kv_events_endpoint,
        server.replay_endpoint,
        schema="sglang",
        model_dir=model_dir if model_dir is not None else server.model_dir,
    )
    return SGLangBesideOurs(theirs, engine, server, pool_tokens=server.max_total_tokens)


def replay_sglang(session=None, engine=None) -> SGLangBesideOurs:
    """The pair on a recorded session (default: the committed one,
    :func:`minirad.course.sglang_recording.load`): SGLang's batches replayed as they came,
    request by request, and our engine serving the same prompts; no SGLang needed.
    The session's last batches (after its requests: the ``/flush_cache``) come as a last
    request, ``flush_cache``, for which our engine's cache is reset too."""
    from minirad.course import sglang_recording

    if session is None:
        session = sglang_recording.load()
    theirs = replay_recording((), schema="sglang")
    pool = sglang_recording.SERVER_SETTINGS["max_total_tokens"]
    pair = SGLangBesideOurs(theirs, engine, pool_tokens=pool)
    batches = list(session.batches)
    for o in session.outputs:
        while batches and o.last_seq is not None and batches[0][0] <= o.last_seq:
            theirs.apply_batch(*batches.pop(0))
        ours = pair.serve_ours(o.prompt_token_ids, o.request.max_new_tokens)
        pair.add_request(_label(o.request), (o.cached_tokens, ours.stats.cached_tokens))
    if batches:
        for batch in batches:
            theirs.apply_batch(*batch)
        pair.engine.reset_prefix_cache()
        pair.add_request("flush_cache", (None, None))
    end_replay(theirs)
    return pair


def _label(request) -> str:
    system = "system + " if request.system else ""
    return f"{system}{request.question}"
