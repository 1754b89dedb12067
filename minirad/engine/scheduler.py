"""The scheduler: which requests run in the next step, with how many tokens, in which slots.

Continuous batching, as in vLLM v1 (``vllm/v1/core/sched/scheduler.py``) and nano-vllm
(``engine/scheduler.py``), with SGLang's radix cache for prefix reuse
(``managers/schedule_policy.py``, ``mem_cache/radix_cache.py``). There is no separate
"prefill phase" and "decode phase": every request has ``num_tokens`` (prompt + generated)
and ``num_computed_tokens`` (tokens with KV), and each step gives it up to
``num_tokens - num_computed_tokens`` new tokens within a token budget. A decode is the case
of one token; a prefill chunk, a cached-prefix remainder and the recompute of a preempted
request are the others. All of them go into ONE forward batch.

One step of :meth:`Scheduler.schedule`:

1. Running requests, oldest first, each get their tokens and KV slots. Slots come from the
   allocator; when it is short, unlocked leaves are evicted from the radix tree; when that is
   not enough, the newest running request is *preempted*: its computed KV goes into the tree
   (where it stays reusable until evicted) and it returns to the front of the waiting queue,
   to be recomputed later. Its output so far is kept, so the result does not change.
2. If nothing was preempted, waiting requests are admitted, in the order of the schedule
   policy (:mod:`minirad.engine.schedule_policy`: ``fcfs``, arrival order; ``lpm``, longest
   cached prefix first). Each is matched against the tree
   (``match_prefix_for_req``: locks the prefix, the ``len - 1`` rule) and needs slots only for
   the rest. A request whose prompt shares a not-yet-cached prefix with a request computed in
   this same step is deferred one step (SGLang's in-batch prefix caching): after this step the
   prefix is in the tree (``cache_unfinished_req``) and it is computed once, not twice.

Prefix strategies (chapter 05 compares them): ``"radix"`` matches the whole key, whose image
placeholders are per-image pad ids; ``"truncate"`` reuses only the text before the first
image; ``"none"`` reuses nothing (the tree stays empty).

Observers (:class:`SchedulerObserver`, :meth:`Scheduler.add_observer`) are told of each
request the scheduler gives slots to, matches, preempts and admits: the engine's miss explainer
(:mod:`minirad.engine.explain`) is one. With none, each such moment costs an empty loop.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from minirad.engine.request import Request, RequestStatus
from minirad.engine.schedule_policy import PREFIX_STRATEGIES, SCHEDULE_POLICIES
from minirad.errors import InvalidArgumentError, InvariantError, RequestError
from minirad.kvcache.radix_cache import RadixCache

__all__ = [
    "PREFIX_STRATEGIES",
    "SCHEDULE_POLICIES",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerObserver",
    "SchedulerOutput",
]


def __getattr__(name: str) -> object:
    """``POLICIES``: the scheduling policies' old name, deprecated (an eviction registry had
    the same name)."""
    if name == "POLICIES":
        warnings.warn(
            "minirad.engine.scheduler.POLICIES is deprecated: use SCHEDULE_POLICIES "
            "(minirad.engine.schedule_policy)",
            DeprecationWarning,
            stacklevel=2,
        )
        return tuple(SCHEDULE_POLICIES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler limits and policies.

    Attributes:
        max_num_seqs: most running requests at once.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes); a
            prompt longer than what is left is cut into chunks (chunked prefill). None: no
            limit, every prompt in one piece.
        policy: the waiting queue's order, a name in
            :data:`~minirad.engine.schedule_policy.SCHEDULE_POLICIES` (SGLang's
            ``--schedule-policy``: ``"fcfs"``, ``"lpm"``).
        prefix_strategy: one of :data:`~minirad.engine.schedule_policy.PREFIX_STRATEGIES`
            (module docstring).
        in_batch_prefix_threshold: defer a waiting request when a request computed in this
            step would give it at least this many more cached tokens next step. None: off.
        max_model_len: the model's context, in tokens (prompt + output).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    policy: str = "fcfs"
    prefix_strategy: str = "radix"
    in_batch_prefix_threshold: int | None = 16
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        def positive(name: str, v: object, optional: bool = False) -> None:
            if optional and v is None:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")

        positive("max_num_seqs", self.max_num_seqs)
        positive("max_num_batched_tokens", self.max_num_batched_tokens, optional=True)
        positive("in_batch_prefix_threshold", self.in_batch_prefix_threshold, optional=True)
        positive("max_model_len", self.max_model_len)
        if self.policy not in SCHEDULE_POLICIES:
            raise InvalidArgumentError(
                f"policy must be one of {tuple(SCHEDULE_POLICIES)}, got {self.policy!r}"
            )
        if self.prefix_strategy not in PREFIX_STRATEGIES:
            raise InvalidArgumentError(
                f"prefix_strategy must be one of {PREFIX_STRATEGIES}, got {self.prefix_strategy!r}"
            )


class SchedulerObserver(Protocol):
    """What the scheduler tells its observers (:meth:`Scheduler.add_observer`), on the engine's
    thread, in the middle of :meth:`Scheduler.schedule`: an observer reads, never changes, the
    scheduler's state."""

    def scheduling(self, request: Request) -> None:
        """A running request is about to get slots for its next tokens (evictions that follow
        make room for it)."""
        ...

    def matching(self, request: Request) -> None:
        """A waiting request is about to be matched against the tree (nothing loaded back or
        evicted for it yet)."""
        ...

    def preempting(self, request: Request) -> None:
        """A running request is about to lose its KV (it still holds it)."""
        ...

    def admitted(self, request: Request) -> None:
        """A request was admitted for the first time, its prefix hits counted
        (``request.stats.cached_tokens``)."""
        ...

    def readmitted(self, request: Request) -> None:
        """A preempted request was admitted again, what it found again counted
        (``request.stats.preempted_cached_tokens``)."""
        ...


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: tokens ``start .. start + num_tokens - 1``.

    Attributes:
        is_prefill: False only for a decode (the one token sampled last step).
        sample: the chunk reaches the request's last token, so the step samples a new one.
    """

    request: Request
    start: int
    num_tokens: int
    is_prefill: bool
    sample: bool

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    """What :meth:`Scheduler.schedule` decided for one step.

    Attributes:
        scheduled: the requests in this step's forward batch, in batch order.
        preempted: running requests that lost their KV this step.
        deferred: waiting requests held back because a request in this step computes
            their prefix (in-batch prefix caching).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    deferred: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if not s.is_prefill)


class Scheduler:
    """Waiting and running queues over a radix cache and its slot allocator.

    Args:
        tree_cache: the :class:`~minirad.kvcache.radix_cache.RadixCache`; it must have a
            ``token_to_kv_pool_allocator`` (the slots of the KV pool).
        config: see :class:`SchedulerConfig`.

    The engine calls :meth:`add_request`, then per step :meth:`schedule`, runs the model,
    and hands the sampled tokens to :meth:`update_from_output`.
    """

    def __init__(self, tree_cache: RadixCache, config: SchedulerConfig | None = None) -> None:
        if tree_cache.token_to_kv_pool_allocator is None:
            raise InvalidArgumentError("the scheduler needs a tree cache with an allocator")
        self.tree_cache = tree_cache
        self.allocator = tree_cache.token_to_kv_pool_allocator
        self.page_size = tree_cache.page_size
        self.config = config if config is not None else SchedulerConfig()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by rid
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens found in the tree, first admissions only
        self.num_queried_tokens = 0  # prompt tokens looked up there, first admissions only
        self.num_preempted_cached_tokens = 0  # tokens readmitted requests found again
        self.cached_tokens_by_source: dict[str, int] = {}  # num_cached_tokens by tier
        self.tiers = getattr(tree_cache, "host_pool", None) is not None  # a HiRadixCache
        self.schedule_policy = SCHEDULE_POLICIES[self.config.policy]()
        self._observers: tuple[SchedulerObserver, ...] = ()

    # ------------------------------------------------------------------ observers
    @property
    def observers(self) -> tuple[SchedulerObserver, ...]:
        """The observers told of this scheduler's decisions, in the order they were added."""
        return self._observers

    def add_observer(self, observer: SchedulerObserver) -> Callable[[], None]:
        """Tell ``observer`` of every request this scheduler gives slots to, matches, preempts
        and admits (:class:`SchedulerObserver`), until the returned function is called (once
        or more: the later calls do nothing)."""
        self._observers = (*self._observers, observer)

        def remove() -> None:
            self._observers = tuple(o for o in self._observers if o is not observer)

        return remove

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue a request.

        Raises:
            RequestError: duplicate rid; the prompt does not leave room for one output token
                in ``max_model_len``; or its largest KV footprint exceeds the whole pool, so
                it could never run even alone.
        """
        if request.rid in self.requests:
            raise RequestError(f"request id {request.rid!r} is already in the engine")
        max_len = self.config.max_model_len
        if request.num_prompt_tokens >= max_len:
            raise RequestError(
                f"prompt has {request.num_prompt_tokens} tokens; the model's context is "
                f"{max_len} (prompt + at least one output token)"
            )
        pages = math.ceil(self._max_kv_tokens(request) / self.page_size)
        if pages > self.allocator.num_pages:
            raise RequestError(
                f"request needs up to {self._max_kv_tokens(request)} KV slots "
                f"({pages} pages); the pool has {self.allocator.num_pages} pages"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.rid] = request

    def _max_kv_tokens(self, request: Request) -> int:
        """Most tokens the request ever has KV for: every token but the last sampled one."""
        total = request.num_prompt_tokens + request.sampling_params.max_new_tokens
        return min(total, self.config.max_model_len) - 1

    def finish_request(
        self,
        rid: str,
        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
        *,
        keep_kv: bool = True,
    ) -> Request | None:
        """Finish a request now, with ``status`` (vLLM's ``finish_requests``: an abort, a stop
        string the engine found in its text, or a failure). Its computed KV stays in the tree,
        unless ``keep_kv`` is False: then its private slots are freed uncached (a step whose
        forward pass failed left them unwritten). Returns it (None if no such unfinished
        request)."""
        request = self.requests.pop(rid, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request, insert=keep_kv)
        else:
            if request in self.waiting:  # else caught mid-admission (a match that raised)
                self.waiting.remove(request)
            if request.last_node is not None:
                self._release(request, insert=False)
        request.status = status
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and tokens, and give them KV slots (module docstring).

        Each scheduled request's ``kv_indices`` grows by its new tokens' slots, so its
        ``num_computed_tokens`` already counts them (vLLM does the same).
        """
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens or math.inf
        # The prefixes computed in this step, in a simulated radix tree (no KV, no events on
        # the engine's bus): SGLang's waiting_queue_radix_tree for in-batch prefix caching.
        in_batch = None
        if self.waiting and cfg.in_batch_prefix_threshold and cfg.prefix_strategy != "none":
            in_batch = RadixCache(page_size=self.page_size)
        budget = self._schedule_running(out, budget, in_batch)
        if not out.preempted:  # vLLM: no new requests after a preemption
            self._schedule_waiting(out, budget, in_batch)
        return out

    def _schedule_running(
        self, out: SchedulerOutput, budget: float, in_batch: RadixCache | None
    ) -> float:
        """Running requests, oldest first, get their tokens and slots, preempting the newest
        when short. Returns the budget left."""
        for request in list(self.running):
            if budget <= 0 or request.status is not RequestStatus.RUNNING:
                break  # out of budget, or preempted below as a victim (so are all after it)
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            for observer in self._observers:
                observer.scheduling(request)
            if not self._allocate_or_preempt(request, n, out.preempted):
                break
            self._add_scheduled(out, request, n, in_batch)
            budget -= n
        return budget

    def _schedule_waiting(
        self, out: SchedulerOutput, budget: float, in_batch: RadixCache | None
    ) -> None:
        """Admit waiting requests while budget, seats and slots last: each is matched against
        the tree, deferred if a request in this step computes its prefix, else scheduled."""
        cfg = self.config

        def can_admit() -> bool:
            return bool(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs

        if not can_admit():
            return
        self.waiting = self.schedule_policy.order(self.waiting, self._cached_len)
        while can_admit():
            request = self.waiting.popleft()
            for observer in self._observers:
                observer.matching(request)
            self.tree_cache.match_prefix_for_req(request, self._max_prefix_len(request))
            if in_batch is not None and self._shares_in_batch(request, in_batch):
                self._release(request, insert=False)
                out.deferred.append(request)
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate(request, n):
                self._release(request, insert=False)
                self.waiting.appendleft(request)
                break  # head-of-line: later requests do not jump a request short of memory
            self._count_prefix_hits(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_scheduled(out, request, n, in_batch)
            budget -= n
        self.waiting.extendleft(reversed(out.deferred))  # they keep their place

    def _count_prefix_hits(self, request: Request) -> None:
        """Credit the prefix an admitted request found in the tree: hits at a first admission,
        recompute saved at a readmission after preemption (its own KV: not hits, vLLM #25787)."""
        found = request.cache_protected_len
        if request.stats.num_preemptions:
            request.stats.preempted_cached_tokens += found
            self.num_preempted_cached_tokens += found
            for observer in self._observers:
                observer.readmitted(request)
            return
        # Prompt tokens only: a grammar's first forced run (outputs appended before admission,
        # Request.jump_forward) may be found in the tree too; it saves compute but is not a
        # prompt hit, and would push the hit rate past 100%.
        hits = min(found, request.num_prompt_tokens)
        request.stats.cached_tokens = hits
        request.stats.cached_forced_tokens = found - hits
        self.num_cached_tokens += hits
        self.num_queried_tokens += request.num_prompt_tokens
        by_source = _by_source(request, hits) if self.tiers else {"device": hits}
        request.stats.cached_tokens_by_source = by_source
        for source, n in by_source.items():
            self.cached_tokens_by_source[source] = self.cached_tokens_by_source.get(source, 0) + n
        for observer in self._observers:
            observer.admitted(request)

    def _add_scheduled(
        self, out: SchedulerOutput, request: Request, n: int, in_batch: RadixCache | None
    ) -> None:
        end = request.num_computed_tokens  # already grown by n
        start = end - n
        # A decode computes exactly the one token sampled last step (past the prompt).
        is_decode = n == 1 and request.num_prompt_tokens <= start == request.num_tokens - 1
        out.scheduled.append(
            ScheduledRequest(request, start, n, not is_decode, end == request.num_tokens)
        )
        if in_batch is not None and not is_decode:
            in_batch.insert(request.fill_ids[:end])

    def _shares_in_batch(self, request: Request, in_batch: RadixCache) -> bool:
        ahead = len(in_batch.match_prefix(self.prefix_key(request)).indices)
        return ahead - request.num_computed_tokens >= self.config.in_batch_prefix_threshold

    def _cached_len(self, request: Request) -> int:
        """How many tokens of ``request``'s :meth:`prefix_key` the tree holds now (for the
        schedule policy)."""
        return len(self.tree_cache.match_prefix(self.prefix_key(request)).indices)

    # ------------------------------------------------------------------ prefix and KV
    def _max_prefix_len(self, request: Request) -> int | None:
        """The prefix strategy's cap on the tokens that may come from the cache (None: only
        the last-token rule of ``match_prefix_for_req``)."""
        strategy = self.config.prefix_strategy
        if strategy == "none":
            return 0
        if strategy == "truncate" and request.segments:
            return request.segments[0].offset  # the text before the first image
        return None

    def prefix_key(self, request: Request) -> list[int]:
        """The part of ``request``'s key that may come from the cache: every token but the
        last (whose logits must be computed), cut by the prefix strategy."""
        fill = request.fill_ids
        cap = len(fill) - 1  # the last token is always computed: its logits are needed
        max_prefix_len = self._max_prefix_len(request)
        return fill[: cap if max_prefix_len is None else min(cap, max_prefix_len)]

    def _allocate(self, request: Request, n: int) -> bool:
        """Give the request KV slots for its next ``n`` tokens: first the free slots of its
        last (private, partly filled) page, then fresh pages, evicting unlocked tree leaves
        if the allocator is short. Returns False, changing nothing, if that is not enough."""
        kv = request.kv_indices
        ps = self.page_size
        in_page = min(-len(kv) % ps, n)
        need = n - in_page
        new: list[int] = []
        if need:
            need_slots = math.ceil(need / ps) * ps
            short = need_slots - self.allocator.available_size()
            if short > self.tree_cache.evictable_size():
                return False  # evicting would destroy cache and still not make room
            if short > 0:
                self.tree_cache.evict(short)
            if need_slots > self.allocator.available_size():
                return False
            new = self.allocator.alloc(need, owner=request.rid)
        if in_page:
            kv.extend(range(kv[-1] + 1, kv[-1] + 1 + in_page))
        kv.extend(new)
        return True

    def _allocate_or_preempt(self, request: Request, n: int, preempted: list[Request]) -> bool:
        """:meth:`_allocate`, preempting the newest running request until it succeeds.
        False if the request had to preempt itself."""
        while not self._allocate(request, n):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        for observer in self._observers:
            observer.preempting(request)
        self._release(request, insert=True)
        request.status = RequestStatus.PREEMPTED
        request.stats.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request, insert: bool) -> None:
        """Give up the request's KV and its lock (``cache_finished_req``). With ``insert``, its
        computed tokens go into the tree first (the tree keeps them, evictable); without (or
        with the ``"none"`` strategy) its private slots are simply freed."""
        if request.last_node is not None:
            is_insert = insert and self.config.prefix_strategy != "none"
            self.tree_cache.cache_finished_req(request, is_insert)

    # ------------------------------------------------------------------ after the forward
    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: list[int]
    ) -> list[Request]:
        """Apply one step's results.

        Args:
            out: the step's :class:`SchedulerOutput`.
            sampled_token_ids: one token per scheduled request with ``sample`` set, in order.

        Returns:
            the requests that got a new token (finished ones included, now ``FINISHED_*``,
            their KV cached in the tree and their locks released).
        """
        sampled = iter(sampled_token_ids)
        advanced = []
        for s in out.scheduled:
            request = s.request
            if s.is_prefill:
                request.stats.prefill_tokens += s.num_tokens
            else:
                request.stats.decode_tokens += s.num_tokens
            if s.sample:
                request.append_output_token_id(next(sampled), self.config.max_model_len)
                advanced.append(request)
            if request.is_finished:
                self._release(request, insert=True)
                del self.requests[request.rid]
            elif s.is_prefill and self.config.prefix_strategy != "none":
                # Make the computed prompt (or chunk) matchable now, for requests that share it.
                self.tree_cache.cache_unfinished_req(request)
        if any(r.is_finished for r in advanced):
            self.running = [r for r in self.running if not r.is_finished]
        return advanced

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Check the tree and that every KV page is accounted for exactly once.

        Checked: :meth:`RadixCache.check_invariants`; every node's ``lock_ref`` equals the
        number of running requests whose locked prefix passes through it; each running
        request's slots are its tree prefix followed by private pages no one else holds;
        waiting requests hold no slot or lock; allocated pages = tree pages + private pages.

        Raises:
            InvariantError: on the first breach.
        """
        tree, ps = self.tree_cache, self.page_size
        tree.check_invariants()
        root = tree.root_node
        tree_pages = {s // ps for s in tree.all_values_flatten()}
        locks: Counter = Counter()
        private: set[int] = set()
        for r in self.running:
            if r.status is not RequestStatus.RUNNING or r.last_node is None:
                raise InvariantError(f"{r.rid}: in the running queue without a lock")
            node = r.last_node
            while node is not root:
                locks[node] += 1
                node = node.parent
            mine = {s // ps for s in r.kv_indices[r.cache_protected_len :]}
            shared = {s // ps for s in r.kv_indices[: r.cache_protected_len]}
            if not shared <= tree_pages:
                raise InvariantError(f"{r.rid}: its cached prefix is not in the tree")
            if mine & (tree_pages | private):
                raise InvariantError(f"{r.rid}: a private KV page is also held by another")
            private |= mine
        for r in self.waiting:
            if r.last_node is not None or r.kv_indices:
                raise InvariantError(f"{r.rid}: waiting but holds KV slots or a lock")
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            if node.lock_ref != locks[node]:
                raise InvariantError(
                    f"node {node.id}: lock_ref {node.lock_ref}, but {locks[node]} running "
                    f"requests hold it"
                )
            stack.extend(node.children.values())
        used = self.allocator.num_pages - self.allocator.available_size() // ps
        if used != len(tree_pages) + len(private):
            raise InvariantError(
                f"{used} pages allocated, but the tree holds {len(tree_pages)} and running "
                f"requests {len(private)}"
            )


def _by_source(request: Request, hits: int) -> dict[str, int]:
    """The first ``hits`` matched tokens by tier: the device's come first on the path, then
    the host's, then the disk's (SGLang's ``host_hit_length``, ``storage_hit_length``)."""
    storage, host = request.storage_hit_length, request.host_hit_length
    device = min(hits, request.cache_protected_len - host - storage)
    host = min(hits - device, host)
    return {"device": device, "host": host, "storage": hits - device - host}
