"""A real server's prefix cache, live: vLLM's (or SGLang's) KV events drawn by the visualizer
(chapter 08).

A vLLM server started with ``--kv-events-config`` publishes every block it caches or drops
(:mod:`minirad.kv_events`). :func:`watch` subscribes to it and feeds each batch to a
:class:`~minirad.kv_events.block_events.BlockHashTree`, which turns blocks into minirad tree
events, so the same :class:`~viz.frame_builder.FrameBuilder` and player that draw our radix tree
draw vLLM's block cache: one node per 32-token block along its hash chain, new blocks green,
removed ones red, and a fork wherever two chains part, at an image too (its placeholders get the
image's pad id, from the hash vLLM publishes in ``extra_keys``).

SGLang (``schema="sglang"``) publishes its radix tree page by page, one block per token at
``--page-size 1``: its view is *compact* (:class:`~minirad.kv_events.block_events.BlockChains`),
each run of blocks stored together drawn as one node, so SGLang's radix tree looks like ours.
:func:`viz.watch_sglang` (:mod:`viz.beside`) draws it beside our own engine's tree.

The view keeps what it received (:attr:`BlockCacheView.batches`), so a session can be saved
(:meth:`BlockCacheView.save_recording`) and replayed later without a server
(:func:`replay_recording`), frame for frame: one frame per batch, in seq order.

Whatever goes wrong on the wire (no server at that address, a bad frame, a restart, a reset)
is said on the player's status line; the view keeps listening.

Example::

    server = VLLMServer().start()                                 # or any vLLM with kv events
    view = viz.watch(server.kv_events_endpoint, server.replay_endpoint)
    view                                                          # the live widget
    server.chat("Describe the image.", image)                     # blocks appear
    view.save_recording("session.jsonl"); view.stop()
    viz.replay_recording("session.jsonl")                         # the same frames, no server
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from minirad.errors import InvalidArgumentError, KVEventError
from minirad.events import plural
from minirad.kv_events import (
    AllBlocksCleared,
    KVEventBatch,
    KVEventSubscriber,
    Notice,
    load_recording,
    save_recording,
)
from minirad.kv_events.block_events import BlockChains, BlockHashTree
from minirad.kv_events.wire import check_schema
from minirad.kvcache.multimodal import pad_value
from minirad.models import DEFAULT_MODEL_DIR

from .frame_builder import image_names
from .widget import RadixView, thumbnail

__all__ = ["BlockCacheView", "replay_recording", "watch"]


def _model_settings(model_dir: str | os.PathLike | None) -> dict[str, Any]:
    """``image_token_id``, ``vocab_size`` and a token decoder for the model a server runs
    (read from its folder; nothing is loaded but the tokenizer)."""
    if model_dir is None:
        return {}
    from minirad.models.tokenizer import load_tokenizer  # transformers: only when labels are wanted

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(
            f"no model folder (a readable config.json) at {model_dir}"
        ) from e
    text = config.get("text_config", config)
    tokenizer = load_tokenizer(model_dir)
    return {
        "image_token_id": config.get("image_token_index"),
        "vocab_size": text["vocab_size"],
        "decode": tokenizer.decode,
    }


class BlockCacheView(RadixView):
    """The player over a block-level prefix cache rebuilt from KV events: one frame per
    :class:`~minirad.kv_events.KVEventBatch`, titled by its ``seq``.

    Args:
        model_dir: the served model's folder, for token labels and image chips (its
            ``image_token_index`` and ``vocab_size``); None: raw ids, images fork by hash only.
        title: the player's title (in its HTML export).
        compact: draw each run of blocks stored together as one node (a radix tree, as
            SGLang's is: :class:`~minirad.kv_events.block_events.BlockChains`) rather than
            one node per block.
        kwargs: :class:`~viz.widget.RadixView` traits.

    Raises:
        InvalidArgumentError: ``model_dir`` holds no readable ``config.json``.

    Attributes:
        tree: the :class:`~minirad.kv_events.block_events.BlockHashTree` the frames are drawn from.
        chains: its :class:`~minirad.kv_events.block_events.BlockChains` when ``compact``, else
            None.
        batches: every ``(seq, batch)`` applied, in order (what :meth:`save_recording` writes).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike | None = DEFAULT_MODEL_DIR,
        title: str = "vLLM prefix cache (KV events)",
        compact: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(title=title, **kwargs)
        settings = _model_settings(model_dir)
        decode = settings.pop("decode", None)
        self.tree = BlockHashTree(**settings)
        self.batches: list[tuple[int, KVEventBatch]] = []
        self._subscriber: KVEventSubscriber | None = None
        self._lock = threading.Lock()  # batches arrive on the subscriber's thread
        self._restarted = False  # the view was cleared for a restart; no batch since
        self.chains = BlockChains(self.tree.bus) if compact else None
        bus = self.chains.bus if self.chains is not None else self.tree.bus
        self.attach(bus, every_event=False, decode=decode, **self.tree.frame_settings())
        # The tree names images as they arrive: the builder must read the tree's own dict.
        self._builder.images = self.tree.images

    def apply_batch(self, seq: int, batch: KVEventBatch) -> None:
        """Draw one batch as one frame, titled by its seq (two if it resets the cache midway:
        a reset always ends a frame). A bad event is skipped, said on the status line, and
        the rest of the batch still applies."""
        with self._lock:
            if self.batches and seq <= self.batches[-1][0] and not self._restarted:
                self._restart()  # seq went back: a new server process (a recording replays it)
            self._restarted = False
            self.batches.append((seq, batch))
            self._frame(f"seq {seq}: {plural(len(batch.events), 'event')}", self._apply, batch)
            if any(isinstance(e, AllBlocksCleared) for e in batch.events):
                self.status = f"seq {seq}: the server reset its prefix cache (AllBlocksCleared)"

    def apply_events(self, events: list) -> None:
        """Draw ``events`` as the next batch (seq one past the last): a sink for
        :class:`~minirad.kv_events.block_events.RadixBlockEvents`, to follow our own engine
        in-process."""
        seq = self.batches[-1][0] + 1 if self.batches else 0
        self.apply_batch(seq, KVEventBatch(ts=0.0, events=list(events)))

    def _apply(self, batch: KVEventBatch) -> None:
        try:
            self.tree.extend(batch.events)
        except KVEventError as e:
            self.status = str(e)
        finally:
            if self.chains is not None:
                self.chains.flush()  # a batch's runs of blocks end with it

    def _frame(self, title: str, change, *args) -> None:
        """Run ``change`` with frames titled ``title``; end with a frame of what it left."""
        before = len(self.frames)
        self._builder.title = title
        change(*args)
        if self._builder.has_pending or len(self.frames) == before:
            self.snapshot()

    def _restart(self) -> None:
        self._frame("server restarted: its cache starts empty", self.tree.restart)
        self._restarted = True

    def receive(self, item: tuple[int, KVEventBatch] | Notice) -> None:
        """Take one item of a :class:`~minirad.kv_events.KVEventSubscriber`: a ``(seq,
        batch)`` is drawn (:meth:`apply_batch`), a notice goes to the status line (and a
        restart clears the view)."""
        if isinstance(item, Notice):
            with self._lock:
                self.status = item.message
                if item.kind == "restart" and self.batches and not self._restarted:
                    self._restart()
            return
        self.apply_batch(*item)

    def listen(self, subscriber: KVEventSubscriber) -> BlockCacheView:
        """Follow ``subscriber`` from its background thread until :meth:`stop`. Returns self.

        Raises:
            RuntimeError: the view already listens.
        """
        if self._subscriber is not None:
            raise RuntimeError("this view already listens; stop() it first")
        self._subscriber = subscriber
        self.status = f"listening on {subscriber.endpoint}"
        subscriber.start(self.receive)
        return self

    def stop(self) -> None:
        """Stop listening and close the subscriber (the frames stay)."""
        if self._subscriber is not None:
            self._subscriber.close()
            self._subscriber = None
            self.status = "stopped"

    def save_recording(self, path: str | os.PathLike) -> Path:
        """Write the batches received so far as a JSON-lines recording
        (:func:`minirad.kv_events.save_recording`); :func:`replay_recording` draws it again."""
        with self._lock:
            return save_recording(list(self.batches), path)


def watch(
    endpoint: str = "tcp://127.0.0.1:5557",
    replay_endpoint: str | None = None,
    *,
    model_dir: str | os.PathLike | None = DEFAULT_MODEL_DIR,
    schema: str = "vllm",
    compact: bool | None = None,
) -> BlockCacheView:
    """A live view of the server publishing KV events at ``endpoint``.

    Args:
        endpoint: the server's event socket (``"endpoint"`` of its ``--kv-events-config``,
            with ``*`` replaced by the host, e.g. ``"tcp://127.0.0.1:5557"``).
        replay_endpoint: its replay socket, if it has one: then batches published before the
            view started, or dropped on the way, are fetched again, and a dead endpoint or a
            wrong port is reported within a second or two (without it, silence is all a ZMQ
            subscriber can see).
        model_dir: as in :class:`BlockCacheView`.
        schema: ``"vllm"`` or ``"sglang"`` (:func:`minirad.kv_events.decode_frames`; either
            of SGLang's layouts, the status line says which one the server speaks).
        compact: as in :class:`BlockCacheView`; by default True for SGLang (its radix tree,
            one node per run of pages) and False for vLLM (one node per block).

    Raises:
        InvalidArgumentError: a malformed endpoint or an unknown schema.
    """
    subscriber = KVEventSubscriber(endpoint, replay_endpoint, schema=schema)
    return BlockCacheView(model_dir, **_view_settings(schema, compact)).listen(subscriber)


def _view_settings(schema: str, compact: bool | None) -> dict[str, Any]:
    sglang = schema == "sglang"
    return {
        "title": "SGLang radix cache (KV events)" if sglang else "vLLM prefix cache (KV events)",
        "compact": sglang if compact is None else compact,
    }


def replay_recording(
    source: str | os.PathLike | Iterable[tuple[int, KVEventBatch]],
    *,
    model_dir: str | os.PathLike | None = DEFAULT_MODEL_DIR,
    images: Mapping[str, Any] | None = None,
    schema: str = "vllm",
    compact: bool | None = None,
) -> BlockCacheView:
    """The frames of a recording (a file of :func:`minirad.kv_events.save_recording`, or
    ``(seq, batch)`` pairs), exactly as :func:`watch` drew them live; no server needed.

    Args:
        images: ``{image hash as the server published it: PIL image or path}``, to draw
            each image chip with its picture (vLLM publishes hashes, not pixels).
        schema, compact: the server the recording came from and how to draw it, as in
            :func:`watch` (a recording holds decoded batches: ``schema`` only picks the
            title and the default ``compact``).

    Raises:
        KVEventError: the file is not a readable recording.
        InvalidArgumentError: an unknown schema.
    """
    batches = load_recording(source) if isinstance(source, str | os.PathLike) else source
    check_schema(schema)
    view = BlockCacheView(model_dir, **_view_settings(schema, compact))
    if images and view.tree.vocab_size is not None:
        names = image_names(images, view.tree.vocab_size)  # the names BlockHashTree gives
        view._images = {
            names[pad_value(h, view.tree.vocab_size)]: thumbnail(im) for h, im in images.items()
        }
    for seq, batch in batches:
        view.apply_batch(seq, batch)
    end_replay(view)
    view.step = 0
    return view


def end_replay(view: BlockCacheView) -> None:
    """After a recording is replayed into ``view``: the status line says what a live server
    just did, so a recording's last reset (a frame of its own, titled so) must not caption
    every other frame of the player."""
    if view.status.endswith("(AllBlocksCleared)"):
        view.status = ""
