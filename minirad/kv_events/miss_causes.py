"""Why a request missed the cache: every prompt token with one cause.

A prompt's tokens fall, left to right, into runs with one cause each (the order is forced by
the prefix property: what is cached now is a prefix of what was ever cached, which is a prefix
of what was ever seen):

- ``hit``: served from the cache;
- ``last_token``: cached, but recomputed anyway: a full hit still runs the model over its last
  token (a whole page or block of it where the cache works in pages or blocks);
- ``evicted``: cached once after this prefix, then evicted (the detail says when, to make room
  for which request, under which policy);
- ``block_floor``: an earlier prompt had these tokens after this prefix, but they were never
  cached: the tail of a page or block that was not full;
- ``first_seen``: no earlier prompt continued this prefix so; the detail says where the
  prompt left the nearest path seen before (token ``at``), and what each side holds there.

(The engine's own causes, ``in_flight`` and ``preempted``, and the tiers', ``host`` and
``storage``, come with the engine as a source; they never occur in an offline replay of one
request at a time.)

:class:`PrefixHistory` remembers, for every prefix ever seen, whether it was ever cached and its
last eviction: a radix tree of its own (a :class:`~minirad.kvcache.radix_cache.RadixCache`
without KV, whose nodes carry that record, cut wherever the record changes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from minirad.errors import InvalidArgumentError
from minirad.kvcache.radix_cache import RadixCache, TreeNode

__all__ = [
    "CAUSES",
    "Eviction",
    "PrefixHistory",
    "Run",
    "describe_fork",
    "label",
    "label_runs",
    "span",
]

CAUSES = ("hit", "last_token", "evicted", "block_floor", "first_seen")
# An image in a detail: its hash's first hex digits ("image 3fa2c1..."), as a replay names it.
IMAGE_DIGITS = 12


@dataclass(frozen=True, slots=True)
class Eviction:
    """When a cached range left the cache: the logical time, the request being served (the
    one that needed the room), and the eviction policy."""

    time: int
    request: int | str | None
    policy: str


@dataclass(frozen=True, slots=True)
class Run:
    """Tokens ``start .. end - 1`` of a prompt, all with one ``cause`` (see :data:`CAUSES`)."""

    start: int
    end: int
    cause: str
    detail: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"start": self.start, "end": self.end, "cause": self.cause, "detail": self.detail}


class _HistoryNode(TreeNode):
    __slots__ = ("cached", "eviction")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cached = False  # these tokens, after this prefix, were cached at some point
        self.eviction: Eviction | None = None  # their last eviction


class _HistoryTree(RadixCache):
    node_class = _HistoryNode

    def _split_node(self, child: TreeNode, m: int, t: int) -> TreeNode:
        new = super()._split_node(child, m, t)
        new.cached, new.eviction = child.cached, child.eviction
        return new


class PrefixHistory:
    """Every prompt seen, every range ever cached, every eviction; token by token (a cache's
    pages and blocks are ranges of tokens here)."""

    def __init__(self) -> None:
        self.tree = _HistoryTree()

    def _range(self, tokens: Sequence[int], start: int, end: int, extra_key) -> list[TreeNode]:
        """The history's nodes that cover ``tokens[start:end]`` exactly (cut there)."""
        tokens = list(tokens)
        for cut in (start, end):
            if cut:
                self.tree.insert(tokens[:cut], extra_key=extra_key)
        walked, _, _ = self.tree._walk(tokens[:end], None, extra_key)
        out, pos = [], 0
        for n in walked:
            if pos >= start:
                out.append(n)
            pos += len(n.key)
        return out

    def see(self, tokens: Sequence[int], extra_key: str | None = None) -> None:
        """A prompt arrived (after it is explained)."""
        if len(tokens):
            self.tree.insert(list(tokens), extra_key=extra_key)

    def cached(self, tokens: Sequence[int], end: int, extra_key: str | None = None) -> None:
        """``tokens[:end]`` is in the cache now (an older eviction of it no longer explains
        anything)."""
        for n in self._range(tokens, 0, end, extra_key):
            n.cached, n.eviction = True, None

    def evicted(
        self, tokens: Sequence[int], start: int, end: int, why: Eviction, extra_key=None
    ) -> None:
        """``tokens[start:end]`` (after ``tokens[:start]``) left the cache."""
        for n in self._range(tokens, start, end, extra_key):
            n.eviction = why

    def walk(self, tokens: Sequence[int], extra_key: str | None = None):
        """``(node, start, end)`` of each history node along ``tokens``, the last one cut at the
        end of the match (read only), and the next tokens each seen path holds there."""
        tokens = list(tokens)
        walked, seen, cut = self.tree._walk(tokens, None, extra_key)
        spans, pos = [], 0
        for n in walked:
            spans.append((n, pos, min(pos + len(n.key), seen)))
            pos += len(n.key)
        if cut:  # the prompt leaves the last edge inside it: that edge holds the other side
            other = [walked[-1].key[cut]]
        else:
            node = walked[-1] if walked else self.tree.root_node
            other = sorted(c.key[0] for c in node.children.values())
        return spans, seen, other


def label_runs(
    history: PrefixHistory,
    tokens: Sequence[int],
    hit: int,
    cached: int,
    extra_key: str | None = None,
    vocab_size: int | None = None,
    unit: int = 1,
) -> list[Run]:
    """The runs of one prompt, from the cache's state at its admission (``hit``: the tokens it
    was served; ``cached``: the tokens the cache held, the last token's page included) and the
    history before it. ``unit``: the cache's page or block size, in tokens: a tail of the
    prompt shorter than one can never be served, whatever was cached after that prefix. Call
    before :meth:`PrefixHistory.see` of this prompt.

    Raises:
        InvalidArgumentError: ``hit <= cached <= len(tokens)`` does not hold.
    """
    n = len(tokens)
    if not 0 <= hit <= cached <= n:
        raise InvalidArgumentError(f"need 0 <= hit {hit} <= cached {cached} <= {n} tokens")
    runs: list[Run] = []

    def add(start: int, end: int, cause: str, detail: dict | None = None) -> None:
        if end <= start:
            return
        detail = detail or {}
        last = runs[-1] if runs else None
        if last is not None and last.cause == cause and last.detail == detail:
            runs[-1] = Run(last.start, end, cause, detail)
        else:
            runs.append(Run(start, end, cause, detail))

    add(0, hit, "hit")
    add(hit, cached, "last_token")
    spans, seen, other = history.walk(tokens, extra_key)
    # Caches hold whole units (pages, blocks): a unit was cached once after this prefix iff the
    # history's node of its last token was. Those form a prefix of the prompt.
    ever, evictions, k = 0, [], 0
    for e in range(unit, min(seen, n) - (min(seen, n) % unit) + 1, unit):
        while spans[k][2] < e:
            k += 1
        node = spans[k][0]
        if not node.cached:
            break
        ever = e
        evictions.append(node.eviction)
    for u, why in enumerate(evictions):
        start, end = max(u * unit, cached), (u + 1) * unit
        if why is not None:
            detail = {"time": why.time, "by_request": why.request, "policy": why.policy}
        else:  # still cached, out of reach: a block before it was evicted (block caches)
            detail = {"after_an_evicted_block": True}
        add(start, end, "evicted", detail)
    add(max(ever, cached), max(seen, cached), "block_floor")
    at = max(seen, cached)
    if at < n:

        def show(t: int) -> int | str:  # an image's pad id, 77 digits, as its hash's head
            if vocab_size is not None and t >= vocab_size:
                return f"image {t - vocab_size:064x}"[: len("image ") + IMAGE_DIGITS]
            return int(t)

        detail: dict = {"at": at, "token": show(int(tokens[at]))}
        detail["seen_next"] = [show(int(t)) for t in other[:8]]
        if len(other) > 8:
            detail["seen_next_more"] = len(other) - 8
        add(at, n, "first_seen", detail)
    return runs


def label(request: int | str) -> str:
    """A request as the report names it: ``r1`` for the first (index 0) of the trace or
    recording; another name (an engine's request id) as it is."""
    return f"r{request + 1}" if type(request) is int else str(request)


def span(start: int, end: int) -> str:
    """Prompt positions ``start .. end - 1`` as a report names them: ``token 7`` for one,
    ``tokens 7-12`` for more."""
    return f"token {start}" if end - start == 1 else f"tokens {start}-{end - 1}"


def _token(t: int | str) -> str:
    """A token of a detail: ``token id 432``, or an image as a replay names it
    (``image 3fa2c1...``)."""
    return t if isinstance(t, str) else f"token id {t}"


def describe_fork(detail: dict) -> str:
    """Where a ``first_seen`` run's prompt left the earlier ones (its detail): its token there
    and theirs, ``"token id 432 where earlier prompts had token id 614"``; an image by its
    hash's first digits, ``"image 398e8ba9e76b where earlier prompts had image e96150181102"``
    (a real server's events name this prompt's and the earlier ones' apart from the token, a
    placeholder id that is the same for every image; a replay names images in the tokens)."""
    here = _token(detail["token"])
    theirs = [_token(t) for t in detail["seen_next"]]
    if detail.get("image"):
        if "image_hash" in detail:
            here = f"image {detail['image_hash'][:IMAGE_DIGITS]}"
        else:
            here = f"{here}, an image the events do not name,"
        images = [f"image {h[:IMAGE_DIGITS]}" for h in detail.get("seen_next_images", ())]
        if images:
            theirs = images + [_token(t) for t in detail["seen_next"] if t != detail["token"]]
    more = detail.get("seen_next_more", 0)
    return f"{here} where earlier prompts had {' or '.join(theirs)}" + (
        f" or {more} more" if more else ""
    )
