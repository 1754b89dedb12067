"""The real vLLM serving chapter 08's requests, recorded: answers, cached tokens, KV events.

Chapter 08 compares our engine and caches with the real vLLM on one short session of chat
requests (:data:`CHAPTER_REQUESTS`). The chapter must run in seconds and without vLLM (the
notebooks under nbval need no vLLM venv), so the session is recorded once on a real server
(``python -m minirad.course.recordings``, which needs ``make vllm``) and committed under
``data/recordings/``:

- ``vllm_ch08_outputs.json``: per request, vLLM's prompt and output token ids, its text and
  ``cached_tokens`` (``usage.prompt_tokens_details``), and the hash vLLM gave the image;
- ``vllm_ch08_events.jsonl``: every KV-event batch the server published
  (:func:`minirad.kv_events.save_recording`).

Requests are sent one at a time, each after the previous one's events have arrived, so the
recording is the same on every run except for the hashes and timestamps, which depend on the
vLLM process (its hash seed). :func:`structure` is what must stay the same: a CI test records
again and compares it.

Example::

    with VLLMServer() as server:
        session = record(server, CHAPTER_REQUESTS)
    save(session)                        # data/recordings/vllm_ch08_*
    session = load()                     # what the chapter reads
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from minirad.course.scenes import SYSTEM_PROMPTS
from minirad.engine import GenerateRequest, SamplingParams
from minirad.errors import MiniradError, PeerError
from minirad.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventSubscriber,
    Notice,
    load_recording,
    save_recording,
)
from minirad.kvcache.multimodal import MultiModalItem, placeholder_runs
from minirad.peers.vllm_env import REPO_ROOT

__all__ = [
    "CHAPTER_REQUESTS",
    "RECORDINGS_DIR",
    "ChatRequest",
    "RecordedOutput",
    "Session",
    "load",
    "record",
    "save",
    "structure",
]

RECORDINGS_DIR = REPO_ROOT / "data" / "recordings"
IMAGES_DIR = REPO_ROOT / "data" / "images"
NAME = "vllm_ch08"


@dataclass(frozen=True)
class ChatRequest:
    """One chat turn: an optional system prompt, one image (a file of ``data/images``), a
    question; greedy, at most ``max_tokens`` new tokens."""

    question: str
    image: str
    system: str | None = None
    max_tokens: int = 16

    @property
    def image_path(self) -> Path:
        return IMAGES_DIR / self.image

    def prompt(self, processor) -> str:
        """The prompt text in ``processor``'s chat template (the image first, then the
        question), as a server applies it to the same chat messages."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        content = [{"type": "image"}, {"type": "text", "text": self.question}]
        messages.append({"role": "user", "content": content})
        return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def generate_request(self, processor) -> GenerateRequest:
        """The same request for our engine (greedy, at most ``max_tokens`` new tokens)."""
        sampling = SamplingParams(max_new_tokens=self.max_tokens)
        return GenerateRequest(self.prompt(processor), [self.image_path], sampling)


_A, _B, _A2 = (
    "red_circle_left_of_blue_square.png",
    "blue_square_left_of_red_circle.png",
    "red_circle_left_of_blue_square_2.png",
)
_SYSTEM = SYSTEM_PROMPTS[1]
# Two questions about A, two about B (same system prompt, another picture), A's first question
# again, and A' (A's caption, other pixels) with no system prompt: a fork at the image, a
# repeat, and a request that shares nothing at all.
CHAPTER_REQUESTS = (
    ChatRequest("Describe the image.", _A, _SYSTEM),
    ChatRequest("How many shapes are there?", _A, _SYSTEM),
    ChatRequest("Describe the image.", _B, _SYSTEM),
    ChatRequest("How many shapes are there?", _B, _SYSTEM),
    ChatRequest("Describe the image.", _A, _SYSTEM),
    ChatRequest("What colour is the circle?", _A2),
)


@dataclass(frozen=True)
class RecordedOutput:
    """What vLLM answered to one request.

    Attributes:
        prompt_token_ids: the prompt as vLLM tokenized it (64 placeholders per image).
        token_ids: the answer, the stop token included.
        cached_tokens: prompt tokens vLLM served from its prefix cache.
        mm_hash: the hash vLLM gave the image (from the first ``extra_keys`` of the request's
            events), or None if no new block of this request held the image.
    """

    request: ChatRequest
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    cached_tokens: int
    mm_hash: str | None

    def block_request(
        self, image_token_id: int
    ) -> tuple[tuple[int, ...], tuple[int, ...], list[MultiModalItem]]:
        """``(prompt ids, output ids, images)`` for
        :func:`~minirad.kvcache.kv_cache_manager.serve_one_at_a_time`: every run of placeholders
        keyed by the image's file name (any key that tells images apart gives vLLM's hits)."""
        runs = placeholder_runs(self.prompt_token_ids, image_token_id)
        items = [MultiModalItem(offset, length, self.request.image) for offset, length in runs]
        return self.prompt_token_ids, self.token_ids, items


@dataclass
class Session:
    """A recorded session: the outputs in request order, the event batches in seq order."""

    outputs: list[RecordedOutput]
    batches: list[tuple[int, KVEventBatch]]


def drain(
    subscriber: KVEventSubscriber, quiet_s: float, layout: str | None = None
) -> list[tuple[int, KVEventBatch]]:
    """Batches until nothing arrives for ``quiet_s`` seconds (a request's events are published
    by the engine step that computes its blocks, before or just after the HTTP reply).

    Raises:
        PeerError: batches were lost or bad, the server restarted, or (with ``layout``, one of
            SGLang's :data:`~minirad.kv_events.SGLANG_LAYOUTS`) it speaks another layout: the
            recording would be wrong.
    """
    out = []
    while items := subscriber.recv(timeout_s=quiet_s):
        for item in items:
            if not isinstance(item, Notice):
                out.append(item)
            elif item.kind in ("lost", "restart", "bad_frame"):
                raise PeerError(f"recording abandoned: {item.message}")
            elif item.kind == "layout" and layout is not None and subscriber.layout != layout:
                raise PeerError(f"recording abandoned: not the {layout!r} layout: {item.message}")
    return out


def _first_mm_hash(batches: Sequence[tuple[int, KVEventBatch]]) -> str | None:
    for _, batch in batches:
        for event in batch.events:
            for keys in getattr(event, "extra_keys", None) or ():
                for key in keys or ():
                    if isinstance(key, list | tuple) and len(key) == 2:
                        return str(key[0])
    return None


def record(server, requests: Sequence[ChatRequest] = CHAPTER_REQUESTS, quiet_s: float = 1.0):
    """Send ``requests`` one at a time to a running, freshly started
    :class:`~minirad.peers.vllm_server.VLLMServer` and collect its answers and KV events.

    Raises:
        PeerError: the server failed.
    """
    subscriber = KVEventSubscriber(server.kv_events_endpoint, server.replay_endpoint)
    try:
        batches = drain(subscriber, quiet_s)  # nothing yet, but the replay probe has answered
        outputs = []
        for r in requests:
            reply = server.chat(r.question, r.image_path, max_tokens=r.max_tokens, system=r.system)
            new = drain(subscriber, quiet_s)
            batches += new
            outputs.append(
                RecordedOutput(
                    r,
                    tuple(reply["prompt_token_ids"]),
                    tuple(reply["token_ids"]),
                    reply["text"],
                    reply["cached_tokens"],
                    _first_mm_hash(new),
                )
            )
    finally:
        subscriber.close()
    return Session(outputs, batches)


def _paths(directory: Path) -> tuple[Path, Path]:
    return directory / f"{NAME}_outputs.json", directory / f"{NAME}_events.jsonl"


def save(session: Session, directory: str | os.PathLike = RECORDINGS_DIR) -> None:
    """Write the two files of a session (see the module docstring)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    outputs, events = _paths(directory)
    rows = [asdict(o) for o in session.outputs]
    outputs.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    save_recording(session.batches, events)


def load(directory: str | os.PathLike = RECORDINGS_DIR) -> Session:
    """The session saved in ``directory`` (the committed one by default)."""
    outputs, events = _paths(Path(directory))
    rows = json.loads(outputs.read_text(encoding="utf-8"))
    loaded = [
        RecordedOutput(
            ChatRequest(**row["request"]),
            tuple(row["prompt_token_ids"]),
            tuple(row["token_ids"]),
            row["text"],
            row["cached_tokens"],
            row["mm_hash"],
        )
        for row in rows
    ]
    return Session(loaded, load_recording(events))


def structure(batches: Sequence[tuple[int, KVEventBatch]]) -> list[tuple]:
    """What a recording must keep from one vLLM run to the next: every event in order, with
    its blocks' token ids, each hash replaced by the order in which it first appeared (so
    parents and repeats still show) and no seq, timestamp or hash value."""
    index: dict[int, int] = {}

    def ref(h: int | None) -> int | None:
        return None if h is None else index.setdefault(h, len(index))

    out: list[tuple] = []
    for _, batch in batches:
        for e in batch.events:
            if isinstance(e, BlockStored):
                out.append(
                    (
                        "BlockStored",
                        ref(e.parent_block_hash),
                        tuple(ref(h) for h in e.block_hashes),
                        tuple(e.token_ids),
                        e.block_size,
                    )
                )
            elif isinstance(e, BlockRemoved):
                out.append(("BlockRemoved", tuple(ref(h) for h in e.block_hashes)))
            elif isinstance(e, AllBlocksCleared):
                out.append(("AllBlocksCleared",))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m minirad.course.recordings [--out DIR]``: record chapter 08's session on a fresh
    real vLLM server (``make vllm`` first) and save it."""
    from minirad.peers.vllm_server import VLLMServer

    parser = argparse.ArgumentParser(
        prog="python -m minirad.course.recordings", description=main.__doc__
    )
    parser.add_argument("--out", type=Path, default=RECORDINGS_DIR, help="where to write")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    try:
        with VLLMServer() as server:
            session = record(server)
    except MiniradError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    save(session, args.out)
    for o in session.outputs:
        print(
            f"{o.cached_tokens:>3} cached  {o.request.image:<38} {o.request.question!r}"
            f" -> {o.text!r}"
        )
    print(
        f"{len(session.batches)} event batches, {time.monotonic() - t0:.0f} s; saved in {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
