"""The real SGLang serving a short chat session, recorded: answers, cached tokens, KV events.

SGLang 0.5.23 runs on this CPU from its own venv (``make sglang``) and serves the shipped
LLaVA's text half (:mod:`minirad.peers.text_model`). A learner without that venv still sees its
radix tree: the session below was recorded once on a real server (``python -m
minirad.course.sglang_recording``) and committed under ``data/recordings/``:

- ``sglang_ch08_outputs.json``: per request, the prompt token ids sent, SGLang's output ids,
  its text, ``cached_tokens`` and finish reason, and the seq of the last KV-event batch that had
  arrived once the request was done (where a player shows "after request k");
- ``sglang_ch08_events.jsonl``: every KV-event batch the server published, decoded
  (:func:`minirad.kv_events.save_recording`);
- ``sglang_ch08_wire.json``: the same batches as the server sent them (its replay socket's
  ``[topic, seq, payload]``, base64): SGLang 0.5.23's layout, tagged maps, for the decoder's
  tests.

The server runs at ``--page-size 1`` with a small KV pool (:data:`SERVER_SETTINGS`), so its tree
splits where prompts part and evicts before the session ends; the session ends with
``/flush_cache`` (an ``AllBlocksCleared``). Requests go one at a time, each after the previous
one's events have arrived, so the recording is the same on every run but for hashes and
timestamps: :func:`minirad.course.recordings.structure` is what a CI test compares.

The first batches are SGLang's own: an ``AllBlocksCleared`` when its cache starts, then one
token, id 0, stored by its health check (``GET /health`` runs a one-token generation on
``input_ids=[0]``, and the tree caches it like any request).

Example::

    with SGLangServer(text_model_dir(), **SERVER_SETTINGS) as server:
        session = record(server)
    save(session)                        # data/recordings/sglang_ch08_*
    session = load()                     # what a chapter reads
    viz.replay_recording(session.batches, schema="sglang")
    replay_cached_tokens([o.served() for o in session.outputs], 96)  # SGLang's cached tokens
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import zmq

from minirad.course.recordings import RECORDINGS_DIR, drain, structure
from minirad.course.scenes import SYSTEM_PROMPTS
from minirad.errors import MiniradError, PeerError
from minirad.kv_events import (
    END_SEQ,
    KVEventBatch,
    KVEventSubscriber,
    load_recording,
    save_recording,
)
from minirad.kv_events.wire import decode_message
from minirad.kvcache.cached_tokens import ServedRequest

__all__ = [
    "NAME",
    "SERVER_SETTINGS",
    "SGLANG_REQUESTS",
    "RecordedGeneration",
    "SGLangSession",
    "TextRequest",
    "load",
    "record",
    "replay_frames",
    "save",
    "structure",
    "wire_batches",
]

NAME = "sglang_ch08"
# A pool of 96 tokens: the session's prompts (14 to 35 tokens each) and answers fill it by the
# fifth request, so SGLang evicts (LRU, its default) before the end.
SERVER_SETTINGS = {"page_size": 1, "max_total_tokens": 96}


@dataclass(frozen=True)
class TextRequest:
    """One chat turn on the text model: an optional system prompt and a question; greedy, at
    most ``max_new_tokens`` new tokens."""

    question: str
    system: str | None = None
    max_new_tokens: int = 8

    def prompt_ids(self, tokenizer) -> list[int]:
        """The prompt's token ids: the model's chat template, as a server applies it."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": self.question})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])


_SYSTEM, _OTHER = SYSTEM_PROMPTS[1], SYSTEM_PROMPTS[2]
# Two questions behind one system prompt (a split where they part), the first one again (a
# hit of all but the last token), another system prompt (a split inside the first one's chat
# markup), no system prompt at all (it shares one token), and the other system prompt's second
# question. The last two do not fit the 96-token pool beside the others: SGLang evicts the least
# recently used leaves to make room.
SGLANG_REQUESTS = (
    TextRequest("Describe the image.", _SYSTEM),
    TextRequest("How many shapes are there?", _SYSTEM),
    TextRequest("Describe the image.", _SYSTEM),
    TextRequest("Describe the image.", _OTHER),
    TextRequest("What colour is the circle?"),
    TextRequest("How many shapes are there?", _OTHER),
)


@dataclass(frozen=True)
class RecordedGeneration:
    """What SGLang answered to one request.

    Attributes:
        prompt_token_ids: the prompt sent (``input_ids`` of ``POST /generate``).
        output_ids: the answer, the stop token included if it stopped on one.
        cached_tokens: prompt tokens SGLang served from its radix tree.
        finish_reason: SGLang's (``{"type": "length", "length": 8}``, ``{"type": "stop",
            "matched": 2}``).
        last_seq: the seq of the last KV-event batch that had arrived when the request was
            done (None: none yet).
    """

    request: TextRequest
    prompt_token_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    text: str
    cached_tokens: int
    finish_reason: dict | None
    last_seq: int | None

    @property
    def stopped(self) -> bool:
        """Whether it ended on a stop token (which ``output_ids`` then ends with)."""
        return (self.finish_reason or {}).get("type") == "stop"

    def served(self) -> ServedRequest:
        """The request as :func:`minirad.kvcache.cached_tokens.replay_cached_tokens` replays
        it."""
        return ServedRequest(
            self.prompt_token_ids, self.output_ids, self.request.max_new_tokens, self.stopped
        )


@dataclass
class SGLangSession:
    """A recorded session: the outputs in request order, the event batches in seq order, and
    those batches as the server sent them (``(topic, seq, payload)``)."""

    outputs: list[RecordedGeneration]
    batches: list[tuple[int, KVEventBatch]]
    frames: list[tuple[bytes, int, bytes]]


def replay_frames(replay_endpoint: str, timeout_s: float = 5.0) -> list[tuple[bytes, int, bytes]]:
    """Every batch a server's replay socket still holds, as it sends them: ``(topic, seq,
    payload)`` in seq order.

    Raises:
        PeerError: no answer within ``timeout_s``, or a reply that is not ``[b"", topic, seq,
            payload]`` (SGLang 0.5.23's, and vLLM's).
    """
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    out = []
    try:
        sock.connect(replay_endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            if not sock.poll(int(timeout_s * 1000)):
                raise PeerError(f"no replay from {replay_endpoint} within {timeout_s:g} s")
            frames = sock.recv_multipart()
            if len(frames) != 4 or frames[0] != b"":
                raise PeerError(f"a replay reply of {len(frames)} frames from {replay_endpoint}")
            _, topic, seq, payload = frames
            if seq == END_SEQ:
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        sock.close()


def wire_batches(
    frames: Sequence[tuple[bytes, int, bytes]],
) -> tuple[list[tuple[int, KVEventBatch]], set[str]]:
    """Raw frames decoded (``schema="sglang"``): the batches, and the layouts they came in.

    Raises:
        KVEventError: a frame that does not decode.
    """
    batches, layouts = [], set()
    for topic, seq, payload in frames:
        message = decode_message([topic, seq.to_bytes(8, "big"), payload], "sglang")
        batches.append((message.seq, message.batch))
        if message.layout is not None:
            layouts.add(message.layout)
    return batches, layouts


def record(
    server,
    requests: Sequence[TextRequest] = SGLANG_REQUESTS,
    *,
    tokenizer=None,
    quiet_s: float = 1.0,
    flush: bool = True,
) -> SGLangSession:
    """Send ``requests`` one at a time to a running, freshly started
    :class:`~minirad.peers.sglang_server.SGLangServer` (with KV events), collect its answers and
    KV events, then (``flush``) drop its cache, and read back the raw frames of it all.

    Args:
        tokenizer: makes the prompts' ids (default: the server's model's).

    Raises:
        PeerError: the server failed, or its events were lost or not in 0.5.23's layout.
    """
    if tokenizer is None:
        from minirad.models.tokenizer import load_tokenizer  # transformers: only here

        tokenizer = load_tokenizer(server.model_dir)
    subscriber = KVEventSubscriber(
        server.kv_events_endpoint, server.replay_endpoint, schema="sglang"
    )
    try:
        # its start: a reset, the health check's token
        batches = drain(subscriber, quiet_s, layout="maps")
        outputs = []
        for r in requests:
            ids = r.prompt_ids(tokenizer)
            reply = server.generate(ids, max_new_tokens=r.max_new_tokens)
            batches += drain(subscriber, quiet_s, layout="maps")
            outputs.append(
                RecordedGeneration(
                    r,
                    tuple(ids),
                    tuple(reply["output_ids"]),
                    reply["text"],
                    reply["cached_tokens"],
                    reply["finish_reason"],
                    batches[-1][0] if batches else None,
                )
            )
        if flush:
            if not server.flush_cache():
                raise PeerError("SGLang refused /flush_cache with no request running")
            batches += drain(subscriber, quiet_s, layout="maps")
    finally:
        subscriber.close()
    frames = replay_frames(server.replay_endpoint)
    if [s for s, _ in batches] != [s for _, s, _ in frames]:
        raise PeerError(
            f"the subscriber delivered batches {[s for s, _ in batches]}, the replay socket holds "
            f"{[s for _, s, _ in frames]}"
        )
    return SGLangSession(outputs, batches, frames)


def _paths(directory: Path) -> tuple[Path, Path, Path]:
    return (
        directory / f"{NAME}_outputs.json",
        directory / f"{NAME}_events.jsonl",
        directory / f"{NAME}_wire.json",
    )


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def save(session: SGLangSession, directory: str | os.PathLike = RECORDINGS_DIR) -> None:
    """Write the three files of a session (see the module docstring)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    outputs, events, wire = _paths(directory)
    rows = [asdict(o) for o in session.outputs]
    outputs.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    save_recording(session.batches, events)
    frames = [{"topic": _b64(t), "seq": s, "payload": _b64(p)} for t, s, p in session.frames]
    wire.write_text(json.dumps(frames, indent=0) + "\n", encoding="utf-8")


def load(directory: str | os.PathLike = RECORDINGS_DIR) -> SGLangSession:
    """The session saved in ``directory`` (the committed one by default)."""
    outputs, events, wire = _paths(Path(directory))
    rows = json.loads(outputs.read_text(encoding="utf-8"))
    loaded = [
        RecordedGeneration(
            TextRequest(**row["request"]),
            tuple(row["prompt_token_ids"]),
            tuple(row["output_ids"]),
            row["text"],
            row["cached_tokens"],
            row["finish_reason"],
            row["last_seq"],
        )
        for row in rows
    ]
    frames = [
        (base64.b64decode(f["topic"]), f["seq"], base64.b64decode(f["payload"]))
        for f in json.loads(wire.read_text(encoding="utf-8"))
    ]
    return SGLangSession(loaded, load_recording(events), frames)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m minirad.course.sglang_recording [--out DIR]``: record the session on a fresh
    real SGLang server (``make sglang`` first; about a minute) and save it."""
    from minirad.peers.sglang_server import SGLangServer
    from minirad.peers.text_model import text_model_dir

    parser = argparse.ArgumentParser(
        prog="python -m minirad.course.sglang_recording", description=main.__doc__
    )
    parser.add_argument("--out", type=Path, default=RECORDINGS_DIR, help="where to write")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    try:
        with SGLangServer(text_model_dir(), **SERVER_SETTINGS) as server:
            session = record(server)
    except MiniradError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    save(session, args.out)
    for o in session.outputs:
        prompt = f"{len(o.prompt_token_ids)} prompt tokens"
        print(f"{o.cached_tokens:>3} cached of {prompt}  {o.request.question!r} -> {o.text!r}")
    print(
        f"{len(session.batches)} event batches, {time.monotonic() - t0:.0f} s; saved in {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
