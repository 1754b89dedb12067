"""Why a real server's request missed, from its KV events and its ``cached_tokens`` alone.

:mod:`~minirad.kv_events.explain_trace` replays prompts through a cache of our own. A real
vLLM or SGLang server gives less: the KV-event stream it published (which blocks it stored,
with their chained hashes, parents and token ids; which it removed, and when) and, per
response, ``cached_tokens`` (``usage.prompt_tokens_details``). This module labels every prompt
token of such a session with the causes of :mod:`~minirad.kv_events.miss_causes`, plus one
more, ``unknown``: what the events and ``cached_tokens`` cannot explain is never guessed.

Per request (prompt ``P`` of ``n`` tokens, ``c`` cached tokens, blocks of ``B`` tokens):

- ``hit``: tokens ``0 .. c - 1``, whatever the events say (where they support fewer, the
  hit's ``detail`` says how many: ``{"events_support": s}``);
- the request's *chain*: the hashes of its full blocks. Its own stored blocks (events after its
  lookup) fix the chain through them (a block's parent hash gives every block above it); where
  it stored nothing, every chain of stored blocks whose token ids match is a candidate, and so
  is leaving that chain wherever a candidate's hash holds more than tokens (an image's extra
  key: two pictures have the same placeholder ids);
- the server hits the longest prefix of the chain that is present, but never the whole
  prompt: at most ``n - 1`` tokens in whole blocks. Tokens present and not counted because of
  that rule are ``last_token``; present and not counted for no reason the events show are
  ``unknown``;
- blocks of the chain stored once and removed before the request are ``evicted`` (the detail:
  the removing batch's ``seq`` and ``ts``, ``"cleared": True`` for an ``AllBlocksCleared``);
  a block still present after a removed one is ``evicted`` too (``after_an_evicted_block``);
- after the chain, an earlier request that had the same chain (prompt and answer, images told
  apart by the extra keys' hashes) may continue the prompt token by token: those tokens are
  ``block_floor`` (seen, but no full block of them stored); the rest ``first_seen`` (the detail
  says where, what earlier requests had there, and whether it is an image: then
  ``image_hash``, this prompt's image, and ``seen_next_images``, the earlier prompts', by
  their ``mm_hash`` where the events name them, since the placeholder id is the same).

Where several readings remain (candidate chains, an image whose hash no event carries, a
removal that may have come just before or just after the request), the readings that agree
with ``cached_tokens`` are kept; a token keeps its cause if they all agree, else it is
``unknown`` (the detail lists the causes it could have).

When was "before the request"? A request's own events are those whose stored blocks continue
its prompt and answer; the batches between the previous request's events and its own may be on
either side (:attr:`ServedRequest.events_before` gives a lower bound when the recorder knows
one). Only events of KV-cache group 0 (or none) are read; LoRA adapters and cache salts are
assumed absent (their hashes would differ from the token ids' without an extra key).

Example::

    requests, batches = load_served("data/recordings/vllm_ch08")
    explained = explain_events(requests, batches)
    totals(explained)   # {'hit': 224, 'last_token': 0, ..., 'unknown': 0}
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from minirad.errors import InvalidArgumentError, KVEventError
from minirad.kv_events.explain_trace import ExplainedRequest
from minirad.kv_events.miss_causes import CAUSES, Run
from minirad.kv_events.recording import load_recording
from minirad.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

__all__ = [
    "EVENT_CAUSES",
    "BlockHistory",
    "BlockRecord",
    "ServedRequest",
    "explain_events",
    "explain_recording",
    "load_served",
    "recording_totals",
    "totals",
]

EVENT_CAUSES = (*CAUSES, "unknown")

_Label = tuple[str, str]  # (cause, the detail as sorted JSON)


@dataclass(frozen=True, slots=True)
class ServedRequest:
    """What a server said about one request.

    Attributes:
        prompt_token_ids: the prompt as the server tokenized it (image placeholders included).
        cached_tokens: the prompt tokens it served from its prefix cache.
        output_token_ids: its answer (its blocks may be stored too, and continue later prompts).
        events_before: the first this many batches of the stream surely came before the
            request (0: nothing known; they are inferred).
    """

    prompt_token_ids: tuple[int, ...]
    cached_tokens: int
    output_token_ids: tuple[int, ...] = ()
    events_before: int = 0


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """One block the events stored: its hash, its parent's (None: the first block of a
    prompt), its tokens, its extra keys (None: none), and where in the chain it sits."""

    block_hash: int
    parent: int | None
    token_ids: tuple[int, ...]
    extra_keys: tuple | None
    depth: int | None  # None: its parent was never stored (events lost before the stream)


@dataclass
class BlockHistory:
    """Every block a server's events ever stored, and batch by batch when each was stored and
    removed. "Before ``b``" means in the first ``b`` batches of the stream.

    Raises (on construction):
        KVEventError: the blocks do not all have one size, or an event's token ids do not fill
            its blocks.
    """

    batches: Sequence[tuple[int, KVEventBatch]]
    medium: str | None = None
    block_size: int | None = None
    blocks: dict[int, BlockRecord] = field(default_factory=dict, init=False)
    children: dict[int | None, list[int]] = field(default_factory=dict, init=False)
    placeholders: set[int] = field(default_factory=set, init=False)
    # hash -> [(batch index, stored?, seq, ts)], and the AllBlocksCleared as (index, seq, ts)
    _log: dict[int, list[tuple[int, bool, int, float]]] = field(default_factory=dict, init=False)
    _clears: list[tuple[int, int, float]] = field(default_factory=list, init=False)
    # batch index -> its stores as (depth of the first block or None, hashes, token ids)
    stores: dict[int, list[tuple[int | None, list[int], list[int]]]] = field(
        default_factory=dict, init=False
    )

    def __post_init__(self) -> None:
        for index, (seq, batch) in enumerate(self.batches):
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    self._clears.append((index, seq, batch.ts))
                elif self._read(event):
                    if isinstance(event, BlockStored):
                        self._stored(index, seq, batch.ts, event)
                    elif isinstance(event, BlockRemoved):
                        for h in event.block_hashes:
                            self._log.setdefault(h, []).append((index, False, seq, batch.ts))

    def _read(self, event) -> bool:
        if getattr(event, "group_idx", None) not in (None, 0):
            return False
        return self.medium is None or event.medium in (None, self.medium)

    def _stored(self, index: int, seq: int, ts: float, e: BlockStored) -> None:
        if self.block_size is None:
            self.block_size = e.block_size
        bs = self.block_size
        if e.block_size != bs or len(e.token_ids) != bs * len(e.block_hashes):
            raise KVEventError(
                f"batch seq {seq}: {len(e.block_hashes)} blocks of {e.block_size} tokens with "
                f"{len(e.token_ids)} token ids (the stream's blocks hold {bs})"
            )
        parent = e.parent_block_hash
        first = 0 if parent is None else self._depth_below(parent)
        for j, h in enumerate(e.block_hashes):
            extra = e.extra_keys[j] if e.extra_keys and j < len(e.extra_keys) else None
            tokens = tuple(int(t) for t in e.token_ids[j * bs : (j + 1) * bs])
            if h not in self.blocks:
                depth = None if first is None else first + j
                self.blocks[h] = BlockRecord(h, parent, tokens, _freeze(extra), depth)
                self.children.setdefault(parent, []).append(h)
                for _, offset in _images(extra):
                    if 0 <= offset < bs:
                        self.placeholders.add(tokens[offset])
            self._log.setdefault(h, []).append((index, True, seq, ts))
            parent = h
        self.stores.setdefault(index, []).append((first, list(e.block_hashes), list(e.token_ids)))

    def _depth_below(self, parent: int) -> int | None:
        record = self.blocks.get(parent)
        return None if record is None or record.depth is None else record.depth + 1

    def ancestors(self, h: int) -> list[int]:
        """The chain from the first block down to ``h`` (as far up as the events go)."""
        out = []
        while h is not None and h in self.blocks:
            out.append(h)
            h = self.blocks[h].parent
        return out[::-1]

    def stored_before(self, h: int, b: int) -> bool:
        """Whether block ``h`` was stored at least once in the first ``b`` batches."""
        return any(stored and i < b for i, stored, _, _ in self._log.get(h, ()))

    def present(self, h: int, b: int) -> bool:
        """Whether block ``h`` was cached after the first ``b`` batches."""
        return self.removal(h, b) is None and self.stored_before(h, b)

    def removal(self, h: int, b: int) -> dict | None:
        """The last removal of ``h`` in the first ``b`` batches, if no store came after it:
        ``{"seq", "ts"}`` (``"cleared": True`` for an ``AllBlocksCleared``), else None."""
        last_store, last_removal = -1, None
        for i, stored, seq, ts in self._log.get(h, ()):
            if i < b and stored:
                last_store = i
            elif i < b:
                last_removal = (i, {"seq": seq, "ts": ts})
        for i, seq, ts in self._clears:
            if i < b and (last_removal is None or i >= last_removal[0]):
                last_removal = (i, {"seq": seq, "ts": ts, "cleared": True})
        if last_removal is None or last_removal[0] < last_store:
            return None
        return last_removal[1]


def _freeze(value):
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _images(extra) -> list[tuple[str, int]]:
    """The ``(mm_hash, offset from the block's start)`` pairs of a block's extra keys (vLLM
    puts an image overlapping the block there; other keys, a LoRA name or a salt, are not)."""
    out = []
    for key in extra or ():
        if (
            isinstance(key, list | tuple)
            and len(key) == 2
            and isinstance(key[0], str)
            and type(key[1]) is int
        ):
            out.append((key[0], key[1]))
    return out


@dataclass
class _Resolved:
    """What a later request needs of an explained one: its tokens (prompt and answer), its
    candidate chains, and the images its readings may have (position -> the mm_hashes; a
    position whose image some reading cannot name is left out)."""

    tokens: tuple[int, ...]
    chains: list[tuple[int, ...]]
    images: dict[int, frozenset[str]]


def _fits(history: BlockHistory, index: int, seq: tuple[int, ...]) -> bool:
    """Whether every block batch ``index`` stored continues ``seq`` where its depth says."""
    bs = history.block_size or 1
    for depth, _, tokens in history.stores.get(index, ()):
        if depth is None or tuple(seq[depth * bs : depth * bs + len(tokens)]) != tuple(tokens):
            return False
    return True


def _agrees(history: BlockHistory, index: int, known: dict[int, int]) -> bool:
    """Whether batch ``index``'s stored blocks can be a request's whose blocks ``known``
    already names (depth -> hash): the same parents, no other hash at a depth."""
    for depth, hashes, _ in history.stores.get(index, ()):
        if depth is None:
            continue
        parent = history.blocks[hashes[0]].parent
        if depth > 0 and known.get(depth - 1, parent) != parent:
            return False
        if any(known.get(depth + j, h) != h for j, h in enumerate(hashes)):
            return False
    return True


def _window(
    history: BlockHistory, seqs: Sequence[tuple[int, ...]], i: int, lo: int
) -> tuple[int, list[int]]:
    """Request ``i``'s ``(hi, own)``, the batches from ``lo`` on: the first ``b`` batches came
    before it for some ``b`` in ``lo .. hi``; ``own``: the batches with its own stored blocks
    (those that continue its prompt and answer, in one chain, before a later request's)."""
    k_all = len(history.batches)

    def owner(k: int) -> int | None:
        if k not in history.stores:
            return None
        return next((j for j in range(i, len(seqs)) if _fits(history, k, seqs[j])), -1)

    k = lo
    while k < k_all and owner(k) in (None, -1):
        k += 1
    own: list[int] = []
    if k < k_all and owner(k) == i:
        for m in range(k, k_all):
            o = owner(m)
            if o == i and _agrees(history, m, _known(history, own)):
                own.append(m)
            elif o not in (None, -1):
                break
    return k, own


def _known(history: BlockHistory, own: list[int]) -> dict[int, int]:
    """depth -> hash of the request's blocks that its own stored blocks name."""
    known: dict[int, int] = {}
    for index in own:
        for depth, hashes, _ in history.stores[index]:
            if depth is None:
                continue
            if depth > 0 and hashes:
                parent = history.blocks[hashes[0]].parent
                for d, h in enumerate(history.ancestors(parent)):
                    known.setdefault(d, h)
            for j, h in enumerate(hashes):
                known.setdefault(depth + j, h)
    return known


def _chains(
    history: BlockHistory, prompt: tuple[int, ...], known: dict[int, int], b: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each candidate chain: the request's blocks stored before batch ``b``, from the first,
    and the stored blocks with the next block's tokens that it is not (their extra keys
    differ: it left them)."""
    bs = history.block_size or 1
    k, out = len(prompt) // bs, []

    def dfs(j: int, parent: int | None, path: list[int]) -> None:
        if j == k:
            out.append((tuple(path), ()))
            return
        if j in known:
            h = known[j]
            if history.stored_before(h, b):
                dfs(j + 1, h, [*path, h])
            else:
                out.append((tuple(path), ()))
            return
        block = prompt[j * bs : (j + 1) * bs]
        cands = [
            h
            for h in history.children.get(parent, ())
            if history.stored_before(h, b) and history.blocks[h].token_ids == block
        ]
        if not cands or any(history.blocks[h].extra_keys for h in cands):
            out.append((tuple(path), tuple(cands)))  # this request's block may be none of them
        for h in cands:
            dfs(j + 1, h, [*path, h])

    dfs(0, None, [])
    return out


def _image_runs(starts: dict[int, set[str]], tokens) -> dict[int, frozenset[str]]:
    """Position -> mm_hashes, each image from its start over its run of placeholders."""
    out: dict[int, frozenset[str]] = {}
    ordered = sorted(starts)
    for n, start in enumerate(ordered):
        stop = min(ordered[n + 1] if n + 1 < len(ordered) else len(tokens), len(tokens))
        t = max(start, 0)
        while t < stop and tokens[t] == tokens[max(start, 0)]:
            out[t] = frozenset(starts[start])
            t += 1
    return out


def _image_positions(
    history: BlockHistory, blocks: Sequence[tuple[int, int]], tokens
) -> dict[int, frozenset[str]]:
    """Position -> mm_hashes of every image that one of ``blocks`` (``(depth, hash)`` pairs)
    names in its extra keys."""
    bs = history.block_size or 1
    starts: dict[int, set[str]] = {}
    for j, h in blocks:
        for mm_hash, offset in _images(history.blocks[h].extra_keys):
            starts.setdefault(j * bs + offset, set()).add(mm_hash)
    return _image_runs(starts, tokens)


def _same(history: BlockHistory, a, a_img, a_not, b, b_img, t: int) -> bool | None:
    """Token ``t`` of two sequences: the same (True), not (False), or unknown (None: image
    placeholders whose images the events do not tell apart). ``a_not``: position -> the
    images ``a`` is known not to have there."""
    if a[t] != b[t]:
        return False
    ia, ib = a_img.get(t), b_img.get(t)
    if ia is not None and ib is not None:
        if not ia & ib:
            return False
        return True if len(ia) == len(ib) == 1 else None
    if ib is not None and ib <= a_not.get(t, frozenset()):
        return False
    if ia is None and ib is None and a[t] not in history.placeholders:
        return True
    return None


def _label(
    history: BlockHistory,
    prompt: tuple[int, ...],
    cached: int,
    chain: tuple[int, ...],
    full: tuple[int, ...],
    left: tuple[int, ...],
    b: int,
    earlier: Sequence[_Resolved],
) -> tuple[list[list[_Label]], bool]:
    """The labels of one reading (a chain, a boundary ``b``): a label per token, in one list,
    or two where how far earlier requests continued the prompt is uncertain; and whether the
    reading explains ``cached`` (the events' hit is the server's)."""
    bs = history.block_size or 1
    n, e = len(prompt), len(chain)
    s = 0
    while s < e and history.present(chain[s], b):
        s += 1
    cap = (n - 1) // bs * bs
    expected = min(s * bs, cap)
    labels: list[_Label | None] = [None] * n

    def put(start: int, end: int, cause: str, detail: dict | None = None) -> None:
        text = json.dumps(detail or {}, sort_keys=True)
        for t in range(max(start, 0), min(end, n)):
            if labels[t] is None:
                labels[t] = (cause, text)

    put(0, min(cached, expected), "hit")
    put(expected, cached, "hit", {"events_support": expected})
    put(cached, expected, "unknown", {"why": "cached by the events, not counted by the server"})
    put(cap, s * bs, "last_token")
    for j in range(s, e):
        why = history.removal(chain[j], b) or {"after_an_evicted_block": True}
        put(j * bs, (j + 1) * bs, "evicted", why)
    start = max(cached, e * bs)
    consistent = expected == cached
    if start >= n:
        return [list(labels)], consistent
    mine = _image_positions(history, list(enumerate(full)), prompt)
    left_images = _image_positions(history, [(e, h) for h in left], prompt)
    seen_lo = seen_hi = start
    stops: list[tuple[int, int, _Resolved]] = []  # (sure stop, stop, request) per sharer
    for q in earlier:
        sharing = [len(c) >= e and (e == 0 or c[e - 1] == chain[e - 1]) for c in q.chains]
        if not any(sharing):
            continue
        t, sure_stop, sure = e * bs, e * bs, all(sharing)
        while t < min(n, len(q.tokens)):
            same = _same(history, prompt, mine, left_images, q.tokens, q.images, t)
            if same is False:
                break
            sure = sure and same is True
            t += 1
            sure_stop = t if sure else sure_stop
        stops.append((sure_stop, t, q))
        seen_lo, seen_hi = max(seen_lo, sure_stop), max(seen_hi, t)
    out = []
    for seen in sorted({seen_lo, seen_hi}):
        variant = list(labels)
        for t in range(start, seen):
            variant[t] = ("block_floor", "{}")
        if seen < n:
            nexts = {
                int(q.tokens[seen]) for a, z, q in stops if seen in (a, z) and seen < len(q.tokens)
            }
            detail: dict = {"at": seen, "token": int(prompt[seen]), "seen_next": sorted(nexts)[:8]}
            if prompt[seen] in history.placeholders:
                # The same placeholder id on both sides: the images are told apart by their
                # mm_hash (where the events name them), this prompt's and the earlier ones'.
                detail["image"] = True
                here = mine.get(seen, frozenset())
                if len(here) == 1:
                    detail["image_hash"] = next(iter(here))
                there = frozenset().union(
                    *(
                        q.images.get(seen, frozenset())
                        for a, z, q in stops
                        if seen in (a, z)
                        and seen < len(q.tokens)
                        and q.tokens[seen] == prompt[seen]
                    )
                )
                if there:
                    detail["seen_next_images"] = sorted(there)[:8]
            text = json.dumps(detail, sort_keys=True)
            for t in range(seen, n):
                variant[t] = ("first_seen", text)
        out.append(variant)
    return out, consistent


def _merge(readings: list[list[_Label]]) -> list[Run]:
    """One run list from the readings: a token keeps a cause they all agree on, else it is
    ``unknown``; a detail they disagree on becomes ``{"one_of": [...]}``."""
    runs: list[Run] = []
    for t in range(len(readings[0])):
        causes = {r[t][0] for r in readings}
        details = sorted({r[t][1] for r in readings})
        if len(causes) > 1:
            cause, detail = "unknown", {"one_of": sorted(causes)}
        else:
            cause = causes.pop()
            loaded = [json.loads(d) for d in details]
            detail = loaded[0] if len(loaded) == 1 else {"one_of": loaded}
        if runs and runs[-1].cause == cause and runs[-1].detail == detail:
            runs[-1] = Run(runs[-1].start, t + 1, cause, detail)
        else:
            runs.append(Run(t, t + 1, cause, detail))
    return runs


def explain_events(
    requests: Sequence[ServedRequest],
    batches: Sequence[tuple[int, KVEventBatch]],
    medium: str | None = None,
) -> list[ExplainedRequest]:
    """Every prompt token of ``requests`` (in the order they were sent, one at a time) labelled
    from the server's KV-event ``batches`` (``(seq, batch)`` in order, as
    :func:`~minirad.kv_events.load_recording` gives them) and each ``cached_tokens``. Causes:
    :data:`EVENT_CAUSES`. ``medium``: read only the events of that medium (None: all).

    Raises:
        InvalidArgumentError: an empty prompt, or ``cached_tokens`` outside ``0 .. len``.
        KVEventError: the events' blocks are inconsistent (:class:`BlockHistory`).
    """
    for i, r in enumerate(requests):
        if not r.prompt_token_ids:
            raise InvalidArgumentError(f"request {i}: an empty prompt")
        if not 0 <= r.cached_tokens <= len(r.prompt_token_ids):
            raise InvalidArgumentError(
                f"request {i}: cached_tokens {r.cached_tokens} outside 0 .. "
                f"{len(r.prompt_token_ids)}"
            )
    history = BlockHistory(batches, medium)
    seqs = [tuple(r.prompt_token_ids) + tuple(r.output_token_ids) for r in requests]
    resolved: list[_Resolved] = []
    out, pos = [], 0
    for i, r in enumerate(requests):
        prompt = tuple(int(t) for t in r.prompt_token_ids)
        lo = max(pos, min(r.events_before, len(batches)))
        hi, own = _window(history, seqs, i, lo)
        readings = _readings(history, prompt, r.cached_tokens, lo, hi, own, resolved)
        if own and not any(ok for _, _, ok in readings):
            # its "own" blocks may be a later request's with the same tokens (another image)
            retry = _readings(history, prompt, r.cached_tokens, lo, own[0], [], resolved)
            if any(ok for _, _, ok in retry):
                readings, own = retry, []
        pos = own[-1] + 1 if own else lo
        keep = [x for x in readings if x[2]] or readings
        out.append(ExplainedRequest(i, len(prompt), _merge([v for x in keep for v in x[0]])))
        chains = sorted({full for _, full, _ in keep})
        maps = [_image_positions(history, list(enumerate(c)), seqs[i]) for c in chains]
        images = {
            t: frozenset().union(*(m[t] for m in maps))
            for t in maps[0]
            if all(t in m for m in maps[1:])
        }
        resolved.append(_Resolved(seqs[i], chains, images))
    return out


def _readings(
    history: BlockHistory,
    prompt: tuple[int, ...],
    cached: int,
    lo: int,
    hi: int,
    own: list[int],
    earlier: Sequence[_Resolved],
) -> list[tuple[list[list[_Label]], tuple[int, ...], bool]]:
    """Every reading of a request: per boundary ``lo .. hi`` and candidate chain, its label
    variants, its full chain (its own stored blocks included) and whether it explains
    ``cached``."""
    known = _known(history, own)
    out = []
    for b in range(lo, hi + 1):
        for chain, left in _chains(history, prompt, known, b):
            full = chain + tuple(known[d] for d in sorted(known) if d >= len(chain))
            variants, ok = _label(history, prompt, cached, chain, full, left, b, earlier)
            out.append((variants, full, ok))
    return out


def totals(explained: Sequence[ExplainedRequest]) -> dict[str, int]:
    """Prompt tokens per cause of :data:`EVENT_CAUSES`, over every request (zeros included)."""
    return {c: sum(e.tokens(c) for e in explained) for c in EVENT_CAUSES}


def _recording_paths(path: str | Path) -> tuple[Path, Path]:
    path = Path(path)
    name = path.name
    for suffix in ("_outputs.json", "_events.jsonl"):
        if name.endswith(suffix):
            name = name.removesuffix(suffix)
    return path.with_name(f"{name}_outputs.json"), path.with_name(f"{name}_events.jsonl")


def load_served(
    path: str | Path,
) -> tuple[list[ServedRequest], list[tuple[int, KVEventBatch]]]:
    """A recorded session of a real server: ``PATH_outputs.json`` (a list of rows with
    ``prompt_token_ids``, ``cached_tokens``, and ``token_ids`` or ``output_ids``; an optional
    ``last_seq``, the last batch that had arrived when the request was done) and
    ``PATH_events.jsonl`` (:func:`~minirad.kv_events.save_recording`). ``path`` may name
    either file or their common prefix (``data/recordings/vllm_ch08``).

    Raises:
        InvalidArgumentError: the outputs file is missing or not such rows.
        KVEventError: the events file is missing or not a recording.
    """
    outputs, events = _recording_paths(path)
    try:
        rows = json.loads(outputs.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InvalidArgumentError(f"cannot read a session's outputs at {outputs}: {e}") from None
    batches = load_recording(events)
    if not isinstance(rows, list) or not rows:
        raise InvalidArgumentError(f"{outputs}: expected a non-empty list of requests")
    requests, before = [], 0
    for i, row in enumerate(rows):
        try:
            prompt = tuple(row["prompt_token_ids"])
            output = tuple(row.get("token_ids", row.get("output_ids")) or ())
            cached = row["cached_tokens"]
            if not all(type(t) is int for t in prompt + output) or type(cached) is not int:
                raise TypeError("token ids and cached_tokens must be ints")
        except (KeyError, TypeError, AttributeError) as e:
            raise InvalidArgumentError(f"{outputs}: request {i}: {e!r}") from None
        requests.append(ServedRequest(prompt, cached, output, before))
        last = row.get("last_seq")
        if type(last) is int:  # what had arrived when it was done came before the next one
            before = sum(1 for seq, _ in batches if seq <= last)
    return requests, batches


def explain_recording(path: str | Path, medium: str | None = None) -> list[ExplainedRequest]:
    """:func:`explain_events` of a recorded session (:func:`load_served`)."""
    requests, batches = load_served(path)
    return explain_events(requests, batches, medium)


def recording_totals(path: str | Path, medium: str | None = None) -> dict[str, int]:
    """Prompt tokens per cause over a recorded session (chapter 08's real vLLM:
    ``data/recordings/vllm_ch08``)."""
    return totals(explain_recording(path, medium))
