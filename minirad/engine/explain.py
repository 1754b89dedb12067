"""Why each request of our engine missed the cache: every prompt token with one cause, read from
the engine's own events and its scheduler (issue 33, for ``minirad serve`` and the engine).

:mod:`minirad.kv_events.miss_causes` labels a prompt from a :class:`PrefixHistory` (every prefix
seen, cached, evicted). :mod:`minirad.kv_events.explain_trace` feeds one from a replay that serves
one request at a time; here the history is fed live, from the events on the engine's bus
(rebuilt into an :class:`~minirad.kv_events.event_tree.EventTree` mirror, which names the
tokens an evicted node held), and the scheduler tells what the events cannot: the request being
scheduled when something is evicted (it needed the room), what the tree held just before a
request's match, the requests in flight, the preemptions.

A request is labelled once, at its first admission (when the scheduler has set
``RequestStats.cached_tokens``), with the causes of the trace replay plus the engine's own:

- ``hit``, ``host``, ``storage``: served from the device, loaded back from the host pool, read
  from the disk tier (``RequestStats.cached_tokens_by_source``: they add up to
  ``cached_tokens``);
- ``in_flight``: another request is computing these tokens right now, in this step's batch or
  still running and not yet inserted into the tree (the detail names it). With in-batch prefix
  caching on (``in_batch_prefix_threshold``), the scheduler defers such a request one step and
  it then hits instead; with it off, both compute the prefix in the same step;
- ``preempted``: set at a readmission after a preemption, over the prompt tokens the request had
  computed, lost with its KV, and computes again (the detail keeps the cause they had);
- ``last_token``, ``evicted`` (when, for which request, under which policy; ``"<policy>,
  demoted to host"`` when the device dropped a node the host kept a copy of, ``"lru, host
  pool"`` when the host dropped it, ``"reset"`` for ``reset_prefix_cache``), ``block_floor``,
  ``first_seen``: as in the replay (:data:`~minirad.kv_events.miss_causes.CAUSES`).

Opt-in: ``EngineConfig(explain_misses=True)`` or :meth:`LLMEngine.explain`. The explainer is
a :class:`~minirad.engine.scheduler.SchedulerObserver` (:meth:`Scheduler.add_observer`); without
it the scheduler loops over no observer and nothing listens to the bus for it. A
failure inside the explainer never fails a request or the engine: it logs, stops explaining, and
keeps the exception in :attr:`MissExplainer.error`.

Attached to an engine that has served requests already, the explainer starts from the tree as
it is (everything in it counts as cached); what was evicted before it is unknown to it
(``first_seen`` or ``block_floor`` instead of ``evicted``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from minirad.errors import InvariantError
from minirad.events import (
    DemoteEvent,
    Event,
    EvictEvent,
    HostEvictEvent,
    InsertEvent,
    LoadBackEvent,
    PrefetchEvent,
    ResetEvent,
)
from minirad.kv_events.event_tree import RESET_SOURCE, EventNode, EventTree
from minirad.kv_events.miss_causes import CAUSES, Eviction, PrefixHistory, Run, label_runs

if TYPE_CHECKING:
    from minirad.engine.engine import LLMEngine
    from minirad.engine.request import Request, RequestStats

__all__ = ["ENGINE_CAUSES", "HIT_CAUSES", "MissExplainer", "check_runs", "tokens_by_cause"]

log = logging.getLogger(__name__)

HIT_CAUSES = ("hit", "host", "storage")  # the tokens served: they add up to cached_tokens
_ORDER = (*HIT_CAUSES, "last_token", "in_flight", "preempted", "evicted", "block_floor")
# Every cause the engine gives, in display order (any the replay adds, at the end).
ENGINE_CAUSES = (*_ORDER, "first_seen", *(c for c in CAUSES if c not in (*_ORDER, "first_seen")))
_TIER_OF = {"device": "hit", "host": "host", "storage": "storage"}


def check_runs(runs: Sequence[Run], stats: RequestStats) -> None:
    """Check a request's runs: contiguous from token 0 to its prompt's end, each of a known
    cause, and the served ones (:data:`HIT_CAUSES`) adding up to ``stats.cached_tokens``.

    Raises:
        InvariantError: on the first breach.
    """
    pos = 0
    for r in runs:
        if r.start != pos or r.end <= r.start or r.cause not in ENGINE_CAUSES:
            raise InvariantError(f"run {r} does not follow token {pos} (runs {list(runs)})")
        pos = r.end
    if pos != stats.prompt_tokens:
        raise InvariantError(f"runs end at token {pos}, the prompt at {stats.prompt_tokens}")
    served = sum(r.end - r.start for r in runs if r.cause in HIT_CAUSES)
    if served != stats.cached_tokens:
        raise InvariantError(f"{served} tokens labelled served, {stats.cached_tokens} cached")


def tokens_by_cause(runs: Sequence[Run]) -> dict[str, int]:
    """Tokens per cause of one request's runs (causes it does not have left out)."""
    out: Counter[str] = Counter()
    for r in runs:
        out[r.cause] += r.end - r.start
    return dict(out)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (bisection over slice compares, which
    run in C)."""
    a, b = list(a), list(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[lo:mid] == b[lo:mid] else (lo, mid)
    return lo


def _merge(runs: list[Run]) -> list[Run]:
    """Adjacent runs of one cause and detail joined; empty ones dropped."""
    out: list[Run] = []
    for r in runs:
        if r.end <= r.start:
            continue
        if out and out[-1].cause == r.cause and out[-1].detail == r.detail:
            out[-1] = Run(out[-1].start, r.end, r.cause, r.detail)
        else:
            out.append(r)
    return out


def _relabel(
    runs: Sequence[Run], start: int, end: int, cause: str, detail, keep: Sequence[str] = ()
) -> list[Run]:
    """``runs`` with tokens ``start .. end - 1`` given ``cause`` (but those of a cause in
    ``keep``); ``detail(run)`` is the new detail of a part of ``run``."""
    out: list[Run] = []
    for r in runs:
        if r.end <= start or r.start >= end or r.cause in keep:
            out.append(r)
            continue
        out.append(Run(r.start, max(r.start, start), r.cause, r.detail))
        out.append(Run(max(r.start, start), min(r.end, end), cause, detail(r)))
        out.append(Run(min(r.end, end), r.end, r.cause, r.detail))
    return _merge(out)


class MissExplainer:
    """Labels every request of ``engine`` at its first admission (module docstring); the runs
    land in ``RequestStats.miss_causes`` (and so in every :class:`RequestOutput` after it).
    Made by :meth:`LLMEngine.explain`; runs on the engine's thread, as its hooks do.

    Attributes:
        history: the :class:`PrefixHistory` the runs are read from.
        mirror: the tree as its events rebuild it (node ids -> tokens of evicted nodes).
        current: the rid of the request being scheduled (the one evictions make room for).
        error: the exception that stopped the explainer, or None.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.scheduler = engine.scheduler
        self.tree = engine.tree_cache
        self.unit = engine.config.page_size
        # The policy's registry name (EVICTION_POLICIES), as RadixCache resolved it.
        self.policy = getattr(self.tree.eviction_policy, "name", str(self.tree.eviction_policy))
        self.vocab_size = engine.vocab_size
        self.history = PrefixHistory()
        self.mirror = EventTree()
        self.current: str | None = None
        self.error: Exception | None = None
        self._totals: Counter[str] = Counter()
        self._held: dict[str, int] = {}  # rid -> the tree's device tokens before its match
        self._computed: dict[str, int] = {}  # rid -> its tokens with KV when preempted
        self._seed()
        self._unsubscribe = engine.bus.subscribe(self._on_event)
        self._unobserve = self.scheduler.add_observer(self)

    def close(self) -> None:
        """Stop explaining (requests admitted from now on get no runs)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._unobserve()

    def totals(self) -> dict[str, int]:
        """Prompt tokens per cause over every request labelled so far (zeros included)."""
        return {c: self._totals[c] for c in ENGINE_CAUSES}

    # ------------------------------------------------------------------ the events
    def _seed(self) -> None:
        """The mirror and the history from the tree as it is now (attached late)."""
        for node in self.tree.nodes():
            host = getattr(node, "host_value", None)
            self.mirror.nodes[node.id] = EventNode(
                node.id,
                node.parent.id,
                tuple(node.key),
                tuple(node.value),
                extra_key=node.extra_key,
                host_value=None if host is None else tuple(host),
                on_disk=bool(getattr(node, "on_disk", False)),
            )
            self.mirror.nodes[node.parent.id].children.append(node.id)
            if not node.children:
                path = self._path(node.id)
                self.history.cached(path, len(path), node.extra_key)

    def _node(self, node_id: int) -> EventNode:
        return self.mirror.nodes.get(node_id) or self.mirror.evicted[node_id]

    def _path(self, node_id: int) -> list[int]:
        """The tokens from the root to the end of ``node_id`` (an evicted one too)."""
        parts = []
        while node_id:
            node = self._node(node_id)
            parts.append(node.key)
            node_id = node.parent
        return [t for part in reversed(parts) for t in part]

    def _on_event(self, e: Event) -> None:
        if self.error is not None:
            return
        try:
            self._apply(e)
        except Exception as err:  # never the engine's failure: stop explaining, say why
            self._stop(err)

    def _stop(self, err: Exception) -> None:
        log.exception("the miss explainer stopped: %r", err)
        self.error = err
        self.close()

    def _apply(self, e: Event) -> None:
        self.mirror.apply(e)
        if isinstance(e, InsertEvent | PrefetchEvent) and e.node_id is not None:
            self._cached(e.node_id)
        elif isinstance(e, LoadBackEvent) and e.node_ids:
            self._cached(e.node_ids[-1])
        elif isinstance(e, EvictEvent | DemoteEvent | HostEvictEvent):
            policy = {
                DemoteEvent: f"{self.policy}, demoted to host",
                HostEvictEvent: "lru, host pool",
            }
            self._evicted(e.node_id, e.num_tokens, e.time, policy.get(type(e), self.policy))
            self.mirror.release()
        elif isinstance(e, ResetEvent) and e.source == RESET_SOURCE:
            for node_id, node in list(self.mirror.evicted.items()):
                self._evicted(node_id, len(node.key), e.time, "reset")
            self.mirror.release()

    def _cached(self, node_id: int) -> None:
        path = self._path(node_id)
        self.history.cached(path, len(path), self._node(node_id).extra_key)

    def _evicted(self, node_id: int, num_tokens: int, time: int, policy: str) -> None:
        path = self._path(node_id)
        why = Eviction(time, self.current, policy)
        extra_key = self._node(node_id).extra_key
        self.history.evicted(path, len(path) - num_tokens, len(path), why, extra_key)

    # ------------------------------------------------------------------ SchedulerObserver
    def scheduling(self, request: Request) -> None:
        """A running request gets its tokens' slots: evictions now make room for it."""
        self.current = request.rid

    def matching(self, request: Request) -> None:
        """A waiting request is about to be matched: what the tree holds of its prompt now,
        before the match's load-back or its allocation evicts anything."""
        self.current = request.rid
        if self.error is None and not request.stats.num_preemptions:
            self._forget_gone()
            key = request.origin_input_ids
            self._held[request.rid] = self.tree.cached_prefix_len(key, request.extra_key)

    def _forget_gone(self) -> None:
        """Drop what is kept of requests no longer in the engine (aborted while waiting), so
        that a long-running server keeps only its requests in flight."""
        live = self.scheduler.requests
        if len(self._held) + len(self._computed) > 2 * len(live) + 64:
            self._held = {r: n for r, n in self._held.items() if r in live}
            self._computed = {r: n for r, n in self._computed.items() if r in live}

    def preempting(self, request: Request) -> None:
        """A running request is preempted: its tokens with KV, before it loses them."""
        self._computed[request.rid] = request.num_computed_tokens

    def admitted(self, request: Request) -> None:
        """First admission, its hits counted: label it, then remember its prompt."""
        held = self._held.pop(request.rid, 0)
        if self.error is not None:
            return
        try:
            runs = self._label(request, held)
            self.history.see(request.origin_input_ids, request.extra_key)
        except Exception as err:
            self._stop(err)
            return
        request.stats.miss_causes = runs
        self._totals.update(tokens_by_cause(runs))

    def readmitted(self, request: Request) -> None:
        """Readmission after a preemption (its own KV matched again): the prompt tokens it had
        computed and finds no more are computed again, ``preempted``."""
        computed = self._computed.pop(request.rid, 0)
        runs = request.stats.miss_causes
        if self.error is not None or runs is None:
            return
        end = min(computed, request.num_prompt_tokens)
        start = min(request.cache_protected_len, end)

        def detail(r: Run) -> dict:
            return {"was": r.cause, "preemptions": request.stats.num_preemptions}

        new = _relabel(runs, start, end, "preempted", detail, keep=("preempted", *HIT_CAUSES))
        self._totals.subtract(tokens_by_cause(runs))
        self._totals.update(tokens_by_cause(new))
        request.stats.miss_causes = new

    # ------------------------------------------------------------------ labelling
    def _label(self, request: Request, held: int) -> list[Run]:
        """The runs of ``request`` at its first admission (``held``: the device tokens the
        tree had of its prompt just before its match)."""
        key = list(request.origin_input_ids)
        n, unit, stats = len(key), self.unit, request.stats
        served = stats.cached_tokens
        cached = min(max(served, held), n)
        runs = label_runs(
            self.history, key, served, cached, request.extra_key, self.vocab_size, unit
        )
        runs = self._split_served(runs, stats.cached_tokens_by_source)
        # In flight: tokens another running request computes (or computed) and has not
        # inserted yet; past what the request could ever be served (its last token, whole
        # pages), they would be recomputed anyway.
        flying, who = self._in_flight(request, key)
        if flying > cached:
            cap = min(len(self.scheduler.prefix_key(request)), n)
            cap = max(cap - cap % unit, cached)
            detail = {"by_request": who}
            runs = _relabel(runs, cached, min(flying, cap), "in_flight", lambda _: detail)
            runs = _relabel(runs, cap, flying, "last_token", lambda _: {})
        return runs

    @staticmethod
    def _split_served(runs: list[Run], by_source: dict[str, int]) -> list[Run]:
        """The replay's ``hit`` run (tokens ``0 .. cached_tokens - 1``) cut by tier, in path
        order: the device's first, then the host's, then the disk's."""
        if not runs or runs[0].cause != "hit":
            return runs
        out, pos = [], 0
        for source in ("device", "host", "storage"):
            n = by_source.get(source, 0)
            out.append(Run(pos, pos + n, _TIER_OF[source]))
            pos += n
        if pos != runs[0].end:
            raise InvariantError(f"cached tokens by source {by_source} but {runs[0].end} hits")
        return _merge(out + runs[1:])

    def _in_flight(self, request: Request, key: list[int]) -> tuple[int, str | None]:
        """The longest prefix of ``key`` (whole pages) whose tokens a running request has KV
        for or computes in this step, and that request's rid."""
        best, who = 0, None
        for other in self.scheduler.running:
            if other is request or other.extra_key != request.extra_key:
                continue
            done = other.num_computed_tokens
            k = _common_prefix(key[:done], other.fill_ids[:done])
            if k > best:
                best, who = k, other.rid
        return best - best % self.unit, who
