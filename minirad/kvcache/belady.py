"""Belady's MIN for the radix cache: the best hit rate any eviction policy can reach on a trace.

Offline, on the request order and lifecycle that :func:`minirad.bench.radix.replay` runs: when
the pool is short, evict the cached token (page) whose next use is farthest in the future,
deepest first on ties, so the victim is always a leaf's tail and the cached set stays a tree.
Two accountings of that rule bracket the optimum (:class:`OptimalResult`): ``bound_hit_tokens``,
an upper bound on every policy's hits (a relaxation in which Belady's exchange argument holds),
and ``hit_tokens``, a schedule a token-granular radix cache reaches. Why both, the proof and the
measurements: docs/benchmarks.md, "MIN: the best any eviction policy can do".
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from minirad.errors import InvalidArgumentError
from minirad.kvcache.request_trace import ChatTrace

__all__ = ["OptimalResult", "belady"]

_NEVER = 1 << 62  # next use of a token that no later request uses


class _Segment:
    """A run of trie tokens that every request uses alike (a compressed-trie edge, also cut
    where any request's query ends), with the simulation's state."""

    __slots__ = (
        "cached",
        "children",
        "depth",
        "edge",
        "inserted",
        "length",
        "locks",
        "next",
        "seen",
        "uid",
        "users",
        "ver",
    )

    def __init__(self, edge: list[int], depth: int, uid: int) -> None:
        self.uid = uid  # creation order: breaks heap ties the same way on every run
        self.edge = edge  # the tokens, kept only while the trie is built
        self.depth = depth  # tokens above the segment
        self.length = len(edge)
        self.children: dict = {}
        self.users: list[int] = []  # start order of the requests whose query passes here
        self.next = 0  # index into users of the first request not started yet
        self.cached = 0  # tokens of the segment in the cache: always a prefix of it
        self.locks = 0  # running requests that hold it
        self.ver = 0  # bumped on every change that makes its heap entry stale
        self.seen = False  # has been in the cache (a free re-supply after that breaks MIN)
        self.inserted = False  # a finished request has computed it: it can be a hit


def _common_len(edge: list[int], key: list[int], i: int) -> int:
    """Length of the common prefix of ``edge`` and ``key[i:]`` (slice compares run in C)."""
    n = min(len(edge), len(key) - i)
    if key[i : i + n] == edge[:n]:
        return n
    lo, hi = 0, n - 1  # the first mismatch lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if key[i : i + mid + 1] == edge[: mid + 1]:
            lo = mid + 1
        else:
            hi = mid
    return lo


class _Trie:
    """The compressed trie of every request's page-aligned tokens, in pages."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.size = 1
        self.root = _Segment([], 0, 0)

    def _segment(self, edge: list[int], depth: int) -> _Segment:
        self.size += 1
        return _Segment(edge, depth, self.size - 1)

    def _child_key(self, key: list[int], i: int):
        return key[i] if self.page_size == 1 else tuple(key[i : i + self.page_size])

    def insert(self, key: list[int], cut: int) -> None:
        """Add ``key`` (a whole number of pages) and make ``cut`` a segment boundary."""
        p, node, i = self.page_size, self.root, 0
        while i < len(key):
            ck = self._child_key(key, i)
            child = node.children.get(ck)
            if child is None:
                node.children[ck] = self._segment(key[i:], i)
                break
            m = _common_len(child.edge, key, i)
            m -= m % p
            if m < child.length:
                self._split(node, ck, child, m)
                child = node.children[ck]
            node, i = child, i + child.length
        self._cut(key, cut)

    def _split(self, parent: _Segment, ck, child: _Segment, m: int) -> None:
        top = self._segment(child.edge[:m], child.depth)
        child.edge = child.edge[m:]
        child.depth += m
        child.length -= m
        top.children[self._child_key(child.edge, 0)] = child
        parent.children[ck] = top

    def _cut(self, key: list[int], cut: int) -> None:
        node, i = self.root, 0
        while i < cut:
            ck = self._child_key(key, i)
            child = node.children[ck]
            if i + child.length > cut:
                self._split(node, ck, child, cut - i)
                return
            node, i = child, i + child.length

    def path(self, key: list[int]) -> list[_Segment]:
        """The segments of an inserted ``key``, root first."""
        node, i, out = self.root, 0, []
        while i < len(key):
            node = node.children[self._child_key(key, i)]
            out.append(node)
            i += node.length
        return out


@dataclass(frozen=True)
class OptimalResult:
    """Belady's MIN on one trace and capacity (see the module docstring).

    Attributes:
        capacity: pool size in tokens.
        page_size: tokens per KV page.
        prompt_tokens: sum of prompt lengths, in tokens.
        hit_tokens: hits of the feasible schedule (farthest next use first, real accounting).
        bound_hit_tokens: an upper bound on the hits of every eviction policy on this order.
        evicted_tokens: tokens the feasible schedule evicted.
        peak_used_tokens: most slots the feasible schedule held at once (tree + private).
        resupplied_tokens: tokens that a finishing request's output put back into the cache
            in the relaxation after they had been cached before; 0 makes the bound a proof.
        request_hit_tokens: the feasible schedule's hits of each request, in the order of
            ``trace.requests`` (they sum to ``hit_tokens``).
    """

    capacity: int
    page_size: int
    prompt_tokens: int
    hit_tokens: int
    bound_hit_tokens: int
    evicted_tokens: int
    peak_used_tokens: int
    resupplied_tokens: int
    request_hit_tokens: tuple[int, ...] = ()

    @property
    def hit_rate(self) -> float:
        """Feasible schedule: ``hit_tokens / prompt_tokens``."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def bound_hit_rate(self) -> float:
        """Upper bound: ``bound_hit_tokens / prompt_tokens``."""
        return self.bound_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _ceil_to(n: int, page_size: int) -> int:
    return -(-n // page_size) * page_size


class _Plan:
    """Per request, in start order: its trie path, how many segments its query covers, and
    its slot need (``prompt + output[:-1]`` rounded up to whole pages)."""

    def __init__(self, trace: ChatTrace, page_size: int) -> None:
        p = page_size
        self.order = [e.request for e in trace.events if e.kind == "start"]
        keys, cuts, self.need = [], [], []
        for k in self.order:
            r = trace.requests[k]
            kv = r.prompt + r.output[:-1]
            n = len(kv) - len(kv) % p
            keys.append(kv[:n])
            q = len(r.prompt) - 1  # the last prompt token is always computed again
            cuts.append(q - q % p)
            self.need.append(_ceil_to(len(kv), p))
        trie = _Trie(p)
        for key, cut in zip(keys, cuts, strict=True):
            trie.insert(key, cut)
        self.paths: list[list[_Segment]] = []
        self.query: list[int] = []  # segments of the path inside the query
        for s, (key, cut) in enumerate(zip(keys, cuts, strict=True)):
            path = trie.path(key)
            nq = 0
            while nq < len(path) and path[nq].depth + path[nq].length <= cut:
                path[nq].users.append(s)
                nq += 1
            self.paths.append(path)
            self.query.append(nq)
        self.segments = list({id(seg): seg for path in self.paths for seg in path}.values())
        for seg in self.segments:
            seg.edge = []  # the tokens are no longer needed

    def reset(self) -> None:
        for seg in self.segments:
            seg.next = seg.cached = seg.locks = seg.ver = 0
            seg.seen = seg.inserted = False


def _simulate(
    plan: _Plan, trace: ChatTrace, capacity: int, relaxed: bool
) -> tuple[int, int, int, int, list[int]]:
    """One pass of farthest-next-use eviction; returns (hits, evicted, peak, resupplied, hits
    of each request by its index in ``trace.requests``).

    ``relaxed``: misses join the cache at the request's start and are shared (the bound);
    otherwise they are private until its finish (the feasible schedule).
    """
    plan.reset()
    heap: list[tuple[int, int, int, int, _Segment]] = []
    start_of = {k: s for s, k in enumerate(plan.order)}
    used = hits = evicted = peak = resupplied = 0
    request_hits = [0] * len(trace.requests)
    private = [0] * len(plan.order)
    locked = [0] * len(plan.order)  # segments of the path the request locked

    def push(seg: _Segment) -> None:
        seg.ver += 1
        if seg.locks == 0 and seg.cached:
            nxt = seg.users[seg.next] if seg.next < len(seg.users) else _NEVER
            # A min-heap: the farthest next use first, then the deepest tail.
            heapq.heappush(heap, (-nxt, -(seg.depth + seg.cached), seg.uid, seg.ver, seg))

    for ev in trace.events:
        s = start_of[ev.request]
        path, nq = plan.paths[s], plan.query[s]
        if ev.kind == "start":
            h = nl = 0
            for seg in path[:nq]:
                if not seg.inserted:  # only computed by running requests so far
                    break
                if seg.cached:
                    nl += 1
                h += seg.cached
                if seg.cached < seg.length:
                    break
            hits += h
            request_hits[ev.request] = h
            if relaxed:  # the whole query is held (and shared) from now on
                nl = nq
                for seg in path[:nq]:
                    used += seg.length - seg.cached
                    seg.cached = seg.length
                    seg.seen = True
                private[s] = plan.need[s] - (path[nq - 1].depth + path[nq - 1].length if nq else 0)
            else:
                private[s] = plan.need[s] - h
            locked[s] = nl
            for seg in path[:nl]:
                seg.locks += 1
                seg.ver += 1  # out of the heap while locked
            for seg in path[:nq]:
                seg.next += 1  # this request was the next use
            used += private[s]
            while used > capacity:
                if not heap:
                    raise InvalidArgumentError(
                        f"capacity {capacity} tokens is too small for this trace: its running "
                        "requests hold more at once"
                    )
                *_, ver, seg = heapq.heappop(heap)
                if ver != seg.ver:
                    continue
                take = min(used - capacity, seg.cached)
                seg.cached -= take
                used -= take
                evicted += take
                push(seg)
            peak = max(peak, used)
        else:
            used -= private[s]
            for j, seg in enumerate(path):
                add = seg.length - seg.cached
                if add and relaxed and j >= nq and seg.seen:
                    resupplied += add  # evicted earlier, back for free
                used += add
                seg.cached = seg.length
                seg.seen = seg.inserted = True
            for seg in path[: locked[s]]:
                seg.locks -= 1
            for seg in path:
                push(seg)
    return hits, evicted, peak, resupplied, request_hits


def belady(trace: ChatTrace, capacity: int, page_size: int = 1) -> OptimalResult:
    """Belady's MIN on ``trace`` with a pool of ``capacity`` tokens (module docstring).

    Args:
        trace: the workload, in the order its events will be replayed.
        capacity: KV pool size in tokens, a multiple of ``page_size``.
        page_size: tokens per KV page (hits and evictions are whole pages).

    Returns:
        the feasible schedule's hits and the upper bound, in tokens.

    Raises:
        InvalidArgumentError: ``capacity`` or ``page_size`` is not a positive int, ``capacity``
            is not a multiple of ``page_size``, or it is below
            :meth:`ChatTrace.peak_running_tokens` (as :func:`~minirad.bench.radix.replay`).
    """
    for name, v in (("capacity", capacity), ("page_size", page_size)):
        if not isinstance(v, int) or v <= 0:
            raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
    if capacity % page_size:
        raise InvalidArgumentError(
            f"capacity {capacity} is not a multiple of page_size {page_size}"
        )
    need_peak = trace.peak_running_tokens(page_size)
    if capacity < need_peak:  # the same admission rule as replay()
        raise InvalidArgumentError(
            f"capacity {capacity} tokens is too small for this trace: its running requests "
            f"hold up to {need_peak} tokens at once"
        )
    plan = _Plan(trace, page_size)
    hits, evicted, peak, _, request_hits = _simulate(plan, trace, capacity, relaxed=False)
    bound, _, _, resupplied, _ = _simulate(plan, trace, capacity, relaxed=True)
    return OptimalResult(
        capacity=capacity,
        page_size=page_size,
        prompt_tokens=trace.prompt_tokens,
        hit_tokens=hits,
        bound_hit_tokens=bound,
        evicted_tokens=evicted,
        peak_used_tokens=peak,
        resupplied_tokens=resupplied,
        request_hit_tokens=tuple(request_hits),
    )
