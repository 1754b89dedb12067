"""``minirad explain``'s engine-free replay: requests through a cache, one at a time, each
prompt labelled token by token with why it hit or missed (:mod:`minirad.kv_events.miss_causes`).

Two cache designs, as the two engines build them:

- ``radix`` (SGLang): a :class:`~minirad.kvcache.radix_cache.RadixCache` over a pool of
  ``capacity`` token slots in pages of ``page_size``, with an eviction ``policy``. Each request
  is matched (at most its length less one, in whole pages) and locked, gets slots for the rest
  (evicting unlocked leaves if short), and is inserted whole pages at a time.
- ``block`` (vLLM): a :class:`~minirad.kvcache.kv_cache_manager.KVCacheManager` of
  ``capacity // block_size`` blocks: chained block hashes, only full blocks cached, LRU free
  queue, a fully cached prompt recomputes its last block.

The cache's own events say what was evicted and when (the radix tree's ``EvictEvent``, the
block pool's ``BlockRemovedEvent``); the request being served then is the one that needed the
room.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from minirad.errors import InvalidArgumentError, OutOfMemoryError
from minirad.events import BlockRemovedEvent, Event, EventBus, EvictEvent
from minirad.kv_events.event_tree import EventTree
from minirad.kv_events.miss_causes import CAUSES, Eviction, PrefixHistory, Run, label_runs
from minirad.kvcache.belady import OptimalResult, belady
from minirad.kvcache.kv_cache_manager import KVCacheManager
from minirad.kvcache.kv_pool import TokenToKVPoolAllocator
from minirad.kvcache.radix_cache import RadixCache, Req
from minirad.kvcache.request_trace import ChatTrace, TraceEvent, TraceRequest

__all__ = [
    "CACHE_DESIGNS",
    "ExplainedRequest",
    "check_trace",
    "explain_trace",
    "optimal",
    "totals",
]

CACHE_DESIGNS = ("radix", "block")


@dataclass(frozen=True, slots=True)
class ExplainedRequest:
    """One request of the trace: its index, prompt length and runs."""

    request: int
    num_tokens: int
    runs: list[Run]

    def tokens(self, cause: str) -> int:
        return sum(r.end - r.start for r in self.runs if r.cause == cause)

    def to_dict(self) -> dict:
        return {
            "request": self.request,
            "num_tokens": self.num_tokens,
            "runs": [r.to_dict() for r in self.runs],
        }


def totals(explained: Sequence[ExplainedRequest]) -> dict[str, int]:
    """Prompt tokens per cause, over every request (every cause, zeros included)."""
    return {c: sum(e.tokens(c) for e in explained) for c in CAUSES}


class _RadixReplay:
    def __init__(self, history, capacity: int, page_size: int, policy: str, bus=None) -> None:
        self.bus = bus if bus is not None else EventBus()
        self.alloc = TokenToKVPoolAllocator(capacity, page_size, self.bus)
        self.cache = RadixCache(page_size, policy, self.alloc, self.bus)
        self.history, self.policy, self.current = history, policy, None
        self.mirror = EventTree()
        self.bus.subscribe(self._on_event)

    def _path(self, node_id: int) -> list[int]:
        parts = []
        while node_id:
            node = self.mirror.nodes.get(node_id) or self.mirror.evicted[node_id]
            parts.append(node.key)
            node_id = node.parent
        return [t for part in reversed(parts) for t in part]

    def _on_event(self, e: Event) -> None:
        self.mirror.apply(e)
        if isinstance(e, EvictEvent):
            path = self._path(e.node_id)
            why = Eviction(e.time, self.current, self.policy)
            self.history.evicted(path, len(path) - e.num_tokens, len(path), why)
            self.mirror.release()

    def serve(self, i: int, prompt: list[int]) -> tuple[int, int]:
        cache, alloc = self.cache, self.alloc
        self.current = i
        cached = cache.cached_prefix_len(prompt)
        req = Req(f"r{i}", prompt)
        hit = len(cache.match_prefix_for_req(req))
        short = -(-(len(prompt) - hit) // alloc.page_size) * alloc.page_size
        short -= alloc.available_size()
        if short > 0:
            cache.evict(short)
        try:
            req.kv_indices = req.kv_indices + alloc.alloc(len(prompt) - hit)
        except OutOfMemoryError:
            cache.cache_finished_req(req, is_insert=False)
            raise
        cache.cache_finished_req(req)
        return hit, cached

    def inserted(self, prompt: list[int]) -> int:
        return len(prompt) - len(prompt) % self.alloc.page_size


class _BlockReplay:
    def __init__(self, history, capacity: int, block_size: int) -> None:
        self.bus = EventBus()
        self.manager = KVCacheManager(capacity // block_size, block_size, bus=self.bus)
        self.history, self.current = history, None
        self.block_range: dict[int, tuple[list[int], int]] = {}  # block id -> (prompt, index)
        self.bus.subscribe(self._on_event)

    def _on_event(self, e: Event) -> None:
        if isinstance(e, BlockRemovedEvent):
            bs = self.manager.block_size
            for b in e.ids:
                if (owner := self.block_range.pop(b, None)) is None:
                    continue
                prompt, j = owner
                why = Eviction(e.time, self.current, "lru")
                self.history.evicted(prompt, j * bs, (j + 1) * bs, why)

    def serve(self, i: int, prompt: list[int]) -> tuple[int, int]:
        m, rid = self.manager, f"r{i}"
        self.current = i
        pool = m.block_pool
        cached = 0
        for h in m.block_hashes(prompt):
            if pool.get_cached_block(h) is None:
                break
            cached += m.block_size
        blocks, hit = m.get_computed_blocks(prompt)
        table = m.allocate_slots(rid, prompt, len(prompt) - hit, blocks)
        if table is None:
            raise OutOfMemoryError(f"request {i} ({len(prompt)} tokens) does not fit")
        for j in range(len(prompt) // m.block_size):
            self.block_range[table[j].block_id] = (prompt, j)
        m.free(rid)
        return hit, cached

    def inserted(self, prompt: list[int]) -> int:
        return len(prompt) - len(prompt) % self.manager.block_size


def check_trace(
    prompts: Sequence[Sequence[int]], cache: str, capacity: int, page_size: int, block_size: int
) -> list[list[int]]:
    """The prompts as lists of ints, once the replay's settings and prompts are checked.

    Raises:
        InvalidArgumentError: an unknown design, a bad size, an empty prompt, or a prompt
            longer than the cache (it could never be cached whole: its labels would mean
            nothing).
    """
    if cache not in CACHE_DESIGNS:
        raise InvalidArgumentError(f"cache must be one of {CACHE_DESIGNS}, got {cache!r}")
    for name, v in (("capacity", capacity), ("page_size", page_size), ("block_size", block_size)):
        if type(v) is not int or v <= 0:
            raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
    unit = page_size if cache == "radix" else block_size
    if unit > capacity:
        what = "page_size" if cache == "radix" else "block_size"
        raise InvalidArgumentError(f"{what} {unit} is larger than the capacity {capacity}")
    out = []
    for i, prompt in enumerate(prompts):
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise InvalidArgumentError(f"request {i}: an empty prompt")
        if -(-len(prompt) // unit) * unit > capacity - capacity % unit:
            raise InvalidArgumentError(
                f"request {i}: {len(prompt)} tokens do not fit in a cache of {capacity}"
            )
        out.append(prompt)
    return out


def simulated_capacity(prompts: Sequence[Sequence[int]], capacity: int, unit: int) -> int:
    """``capacity``, or less when the trace cannot fill it: a cache larger than every prompt
    together (in whole units) never evicts, and the replay's pool need not be that large in
    memory (``--capacity 10**9`` must not allocate a billion slots)."""
    need = sum(-(-len(p) // unit) * unit for p in prompts)
    return min(capacity, max(need, unit))


def optimal(prompts: Sequence[Sequence[int]], capacity: int, unit: int) -> OptimalResult:
    """Belady's MIN on the same requests, in the same order, one at a time, with a pool of
    ``capacity`` tokens in pages of ``unit`` (:func:`minirad.kvcache.belady.belady`): what
    the best eviction could have served each request."""
    capacity = simulated_capacity(prompts, capacity, unit)
    requests = [TraceRequest(f"r{i}", i, 0, [int(t) for t in p], []) for i, p in enumerate(prompts)]
    events = [
        TraceEvent(float(i), kind, i) for i in range(len(requests)) for kind in ("start", "finish")
    ]
    return belady(ChatTrace(requests, events, []), capacity - capacity % unit, unit)


def explain_trace(
    prompts: Sequence[Sequence[int]],
    cache: str = "radix",
    capacity: int = 4096,
    page_size: int = 1,
    block_size: int = 16,
    policy: str = "lru",
    vocab_size: int | None = None,
    min_hits: Sequence[int] | None = None,
    bus: EventBus | None = None,
) -> list[ExplainedRequest]:
    """Replay ``prompts`` in order, one at a time, through a ``cache`` of ``capacity`` tokens;
    every prompt's runs. (``page_size`` and ``policy`` are the radix tree's, ``block_size``
    the block cache's, whose policy is LRU.) With ``min_hits`` (each request's hits under
    Belady's MIN, :func:`optimal`), an evicted run's detail says whether MIN would have kept
    it (``min_kept``: how many of the run's tokens MIN served this request; a run of tokens
    past the last servable page counts only its servable part). ``bus``: the radix cache's
    and its pool's event bus (a viewer attached to it sees the replay; radix only).

    Raises:
        InvalidArgumentError: see :func:`check_trace`.
    """
    prompts = check_trace(prompts, cache, capacity, page_size, block_size)
    capacity = simulated_capacity(prompts, capacity, page_size if cache == "radix" else block_size)
    history = PrefixHistory()
    if cache == "radix":
        replay = _RadixReplay(history, capacity - capacity % page_size, page_size, policy, bus)
    else:
        if bus is not None:
            raise InvalidArgumentError("bus: only the radix replay publishes a tree's events")
        replay = _BlockReplay(history, capacity, block_size)
    out = []
    unit = page_size if cache == "radix" else block_size
    for i, prompt in enumerate(prompts):
        hit, cached = replay.serve(i, prompt)
        runs = label_runs(history, prompt, hit, cached, vocab_size=vocab_size, unit=unit)
        if min_hits is not None:  # MIN served what could be served of the run
            servable = (len(prompt) - 1) // unit * unit
            runs = [
                Run(
                    r.start,
                    r.end,
                    r.cause,
                    r.detail | {"min_kept": max(0, min(min_hits[i], servable, r.end) - r.start)},
                )
                if r.cause == "evicted"
                else r
                for r in runs
            ]
        history.see(prompt)
        history.cached(prompt, replay.inserted(prompt))
        out.append(ExplainedRequest(i, len(prompt), runs))
    return out
