"""Request routing across replicas: which engine's prefix cache a request meets.

A router in front of ``n`` replicas picks one replica per request. The policies and their
parameter names follow SGLang's router (``sgl-router/src/policies/``: ``round_robin.rs``,
``random.rs``, ``power_of_two.rs``, ``cache_aware.rs`` with its approximate tree ``tree.rs``)
and, for ``kv_aware``, vLLM's router and NVIDIA Dynamo, which route from the replicas' KV events.

Every policy sees the request's key and ``loads``: the requests the router has in flight on
each replica (SGLang's ``Worker::load()``), in requests. "Least loaded" means the first
replica of smallest load (Rust's ``min_by_key`` returns the first minimum). That is why, at
load 0 (one client at a time), the least-loaded rule always answers replica 0: the first in
the router's own order, which need not be the order of its ``--worker-urls`` (the measured
pile-ups went to either worker, the same one all run long).

Keys: SGLang's tree holds request *text*, one character per edge step; here a key is any
sequence of hashable items (a ``str``, or token ids standing in for text, one id per
character), and lengths are in those items.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Hashable, Sequence

from minirad.errors import InvalidArgumentError

__all__ = [
    "POLICIES",
    "ApproxTree",
    "CacheAwarePolicy",
    "KVAwarePolicy",
    "PowerOfTwoPolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "RoutingPolicy",
]

POLICIES: tuple[str, ...] = ("round_robin", "random", "power_of_two", "cache_aware", "kv_aware")


def _is_seq(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str)


def _check_count(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
    return value


class RoutingPolicy:
    """Base of the policies: ``select(key, loads)`` returns a replica index in ``0 .. n-1``.

    Args:
        num_workers: replicas behind the router.

    Raises:
        InvalidArgumentError: ``num_workers`` is not a positive int; ``loads`` passed to
            :meth:`select` does not have ``num_workers`` entries.
    """

    name = "base"

    def __init__(self, num_workers: int) -> None:
        self.num_workers = _check_count("num_workers", num_workers)

    def select(self, key: Sequence[Hashable], loads: Sequence[int], now: float = 0.0) -> int:
        """The replica for ``key``, given the in-flight requests per replica ``loads`` at
        time ``now`` (only policies with timed state read it)."""
        if len(loads) != self.num_workers:
            raise InvalidArgumentError(f"loads has {len(loads)} entries for {self.num_workers}")
        return self._select(key, loads, now)

    def _select(self, key: Sequence[Hashable], loads: Sequence[int], now: float = 0.0) -> int:
        raise NotImplementedError

    def finish(self, replica: int, key: Sequence[Hashable]) -> None:
        """A request for ``key`` routed to ``replica`` has finished (only policies that keep
        a ledger of what is in flight read it; among equal keys, the oldest finishes).

        Raises:
            InvalidArgumentError: no such request is in flight there (ledger policies).
        """


def _least_loaded(loads: Sequence[int]) -> int:
    """The first replica with the smallest load (``min_by_key`` over the workers)."""
    return min(range(len(loads)), key=loads.__getitem__)


class RoundRobinPolicy(RoutingPolicy):
    """One counter, incremented per request, modulo the replicas (``round_robin.rs``)."""

    name = "round_robin"

    def __init__(self, num_workers: int) -> None:
        super().__init__(num_workers)
        self._counter = 0

    def _select(self, key: Sequence[Hashable], loads: Sequence[int], now: float = 0.0) -> int:
        i = self._counter % self.num_workers
        self._counter += 1
        return i


class RandomPolicy(RoutingPolicy):
    """A uniform random replica (``random.rs``); ``seed`` makes it reproducible."""

    name = "random"

    def __init__(self, num_workers: int, seed: int = 0) -> None:
        super().__init__(num_workers)
        self._rng = random.Random(seed)

    def _select(self, key: Sequence[Hashable], loads: Sequence[int], now: float = 0.0) -> int:
        return self._rng.randrange(self.num_workers)


class PowerOfTwoPolicy(RandomPolicy):
    """Two distinct random replicas, the less loaded one wins, the first on a tie
    (``power_of_two.rs``); one replica alone is always chosen."""

    name = "power_of_two"

    def _select(self, key: Sequence[Hashable], loads: Sequence[int], now: float = 0.0) -> int:
        if self.num_workers == 1:
            return 0
        a, b = self._rng.sample(range(self.num_workers), 2)
        return a if loads[a] <= loads[b] else b


class _Node:
    __slots__ = ("children", "parent", "step", "tenants")

    def __init__(self, parent: _Node | None, step: Hashable) -> None:
        self.children: dict[Hashable, _Node] = {}
        self.parent = parent
        self.step = step
        self.tenants: dict[int, int] = {}  # replica -> logical time of its last access


class ApproxTree:
    """SGLang's approximate tree (``tree.rs``): one trie over every replica's request keys,
    each node tagged with the replicas ("tenants") that were sent a key through it.

    It is what the router *believes* each replica caches: it never hears of evictions in the
    replicas, only of its own decisions. Uncompressed (one node per key item), which changes
    no answer, only speed. Sizes are in key items (characters for text).

    Args:
        max_tree_size: per replica, the most items it may hold; past it, that replica's least
            recently used leaves are dropped (``evict_tenant_by_size``). SGLang runs this
            every ``eviction_interval_secs``; here it runs after each insert.
    """

    def __init__(self, max_tree_size: int = 2**26) -> None:
        self.max_tree_size = _check_count("max_tree_size", max_tree_size)
        self.root = _Node(None, None)
        self.size: dict[int, int] = {}  # replica -> items it holds (tenant_char_count)
        self._time = 0

    def insert(self, key: Sequence[Hashable], tenant: int) -> None:
        """Tag the path of ``key`` with ``tenant`` (created where missing), then evict."""
        self._time += 1
        node = self.root
        node.tenants[tenant] = self._time
        self.size.setdefault(tenant, 0)
        for step in key:
            child = node.children.get(step)
            if child is None:
                child = node.children[step] = _Node(node, step)
            if tenant not in child.tenants:
                self.size[tenant] += 1
            child.tenants[tenant] = self._time
            node = child
        if self.size[tenant] > self.max_tree_size:
            self.evict_tenant(tenant, self.max_tree_size)

    def prefix_match(self, key: Sequence[Hashable]) -> tuple[int, int | None]:
        """The longest prefix of ``key`` in the tree, and the tenant to send it to.

        Returns:
            ``(matched, tenant)``: ``matched`` items; ``tenant`` the most recent of the
            replicas on the last matched node, None when nothing matched.
        """
        node, matched = self.root, 0
        for step in key:
            child = node.children.get(step)
            if child is None or not child.tenants:
                break
            node, matched = child, matched + 1
        if not matched:
            return 0, None
        self._time += 1
        tenant = max(node.tenants, key=lambda t: (node.tenants[t], -t))
        return matched, tenant

    def evict_tenant(self, tenant: int, max_size: int) -> None:
        """Drop ``tenant``'s least recently used leaves until it holds at most ``max_size``
        items (a leaf of a tenant: a node it tags and none of whose children it tags)."""
        heap: list[tuple[int, int, _Node]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            tagged = [c for c in node.children.values() if tenant in c.tenants]
            if node is not self.root and tenant in node.tenants and not tagged:
                heapq.heappush(heap, (node.tenants[tenant], id(node), node))
            stack.extend(tagged)
        while self.size.get(tenant, 0) > max_size and heap:
            _, _, node = heapq.heappop(heap)
            del node.tenants[tenant]
            self.size[tenant] -= 1
            parent = node.parent
            if not node.tenants and not node.children and parent is not None:
                del parent.children[node.step]
            if parent is not None and parent is not self.root:
                if not any(tenant in c.tenants for c in parent.children.values()):
                    heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))


class CacheAwarePolicy(RoutingPolicy):
    """SGLang's ``cache_aware``: an approximate tree of past requests per replica, unless
    the load is imbalanced.

    Per request:

    1. Imbalanced when ``max(loads) - min(loads) > balance_abs_threshold`` **and**
       ``max(loads) > balance_rel_threshold * min(loads)``: the least-loaded replica.
    2. Else the tree's longest prefix match: its replica if ``matched / len(key) >
       cache_threshold``, else the least-loaded replica (older SGLang versions took the
       replica with the smallest tree, ``get_smallest_tenant``; sglang-router 0.3.2, as
       measured here, behaves as the least-loaded rule predicts). At load 0 that is replica 0,
       so under light traffic every poorly matched prefix, and then everything that
       matches it, lands on replica 0.

    The chosen replica's path is inserted in both cases.

    Args:
        num_workers: replicas.
        cache_threshold: share of the key that must match, in [0, 1] (default 0.3).
        balance_abs_threshold: load difference, in requests (default 64).
        balance_rel_threshold: load ratio (default 1.5).
        max_tree_size: per replica, in key items (default 2**26, SGLang's).

    Raises:
        InvalidArgumentError: a threshold out of range, a count not positive.
    """

    name = "cache_aware"

    def __init__(
        self,
        num_workers: int,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int = 2**26,
    ) -> None:
        super().__init__(num_workers)
        if not 0.0 <= cache_threshold <= 1.0:
            raise InvalidArgumentError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if not isinstance(balance_abs_threshold, int) or balance_abs_threshold < 0:
            raise InvalidArgumentError(
                f"balance_abs_threshold must be an int >= 0, got {balance_abs_threshold!r}"
            )
        if balance_rel_threshold < 1.0:
            raise InvalidArgumentError(
                f"balance_rel_threshold must be >= 1, got {balance_rel_threshold}"
            )
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = ApproxTree(max_tree_size)

    def _select(self, key: Sequence[Hashable], loads: Sequence[int], now: float = 0.0) -> int:
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            choice = _least_loaded(loads)
        else:
            matched, tenant = self.tree.prefix_match(key)
            rate = matched / len(key) if len(key) else 0.0
            choice = tenant if tenant is not None and rate > self.cache_threshold else None
            if choice is None:
                choice = _least_loaded(loads)
        self.tree.insert(key, choice)
        return choice


class KVAwarePolicy(RoutingPolicy):
    """vllm-router's ``kv_aware`` (0.1.17): route by the replicas' real caches, as its index
    fed by their KV events (block stored / removed) sees them, weighed against the prefill
    work already sent to each replica.

    What the router does, as its decision log says (``--log-level debug``: ``KV prefix
    decision outcome="prefix_cost" worker=... input_tokens=260 new_prefill_tokens=81
    credited_prefix_tokens=179``):

    1. Each replica's cached prefix of the request, in whole ``block_size``-token blocks, is
       credited at ``credit`` per token: vllm-router's ``--kv-penalty-*`` for the memory the
       events name (1.0 for vLLM's ``"GPU"`` blocks; ``kv_penalty_host`` 0.8 for ``"CPU"``,
       which our workers publish). The rest is the request's new prefill there.
    2. A replica's cost: that new prefill plus the new prefill of every request the router
       has in flight on it (its ledger, kept from :meth:`select` to :meth:`finish`).
    3. The cheapest replica wins, the first on a tie: with nothing cached and nothing in
       flight, new prefixes pile onto replica 0.

    So a cached prefix is worth its tokens, and no more: under load a request goes past the
    replica that holds its prompt when that replica's queue of uncomputed prompt tokens is
    longer than what the prefix saves. (Versions before 0.1.17 took the longest prefix
    whatever the load, ``src/policies/kv_aware.rs``; this one measured as modelled here, within
    a point, on the two-replica runs of ``minirad.bench.replicas``.) Unlike
    :class:`CacheAwarePolicy` it sees evictions and requests that bypassed the router.
    Here ``cached_tokens`` reads the replicas' trees directly: an event stream with no delay.

    Args:
        num_workers: replicas.
        cached_tokens: ``cached_tokens(replica, key)``: how many leading tokens of ``key``
            that replica has cached, without touching its cache.
        block_size: tokens per block (vLLM's ``--block-size``; the router's default 16).
        credit: the credit per cached token, one for all replicas or one per replica.

    Raises:
        InvalidArgumentError: ``block_size`` not a positive int, a credit outside [0, 1] or
            not one per replica.
    """

    name = "kv_aware"

    def __init__(
        self,
        num_workers: int,
        cached_tokens: Callable[[int, Sequence[int]], int],
        block_size: int = 16,
        credit: float | Sequence[float] = 1.0,
    ) -> None:
        super().__init__(num_workers)
        self.block_size = _check_count("block_size", block_size)

        def is_credit(c: object) -> bool:
            return isinstance(c, int | float) and not isinstance(c, bool) and 0.0 <= c <= 1.0

        one = isinstance(credit, int | float) and not isinstance(credit, bool)
        credits = [credit] * num_workers if one else list(credit) if _is_seq(credit) else []
        if len(credits) != num_workers or not all(map(is_credit, credits)):
            raise InvalidArgumentError(
                f"credit must be a number in [0, 1], or one per replica, got {credit!r}"
            )
        self.cached_tokens = cached_tokens
        self.credits = credits
        self.in_flight = [0] * num_workers  # new-prefill tokens routed and not finished
        self._ledger: dict[tuple[int, tuple], list[int]] = {}

    def new_prefill(self, replica: int, key: Sequence[int]) -> int:
        """Tokens of ``key`` that ``replica`` would compute: all but its credited prefix
        (whole blocks, at most the whole key).

        Raises:
            InvalidArgumentError: no such replica.
        """
        if not (isinstance(replica, int) and 0 <= replica < self.num_workers):
            raise InvalidArgumentError(f"no replica {replica!r} of {self.num_workers}")
        bs = self.block_size
        cached = min(self.cached_tokens(replica, key), len(key)) // bs * bs
        return len(key) - int(cached * self.credits[replica])

    def _select(self, key: Sequence[Hashable], loads: Sequence[int], now: float = 0.0) -> int:
        new = [self.new_prefill(i, key) for i in range(self.num_workers)]  # type: ignore[arg-type]
        costs = [n + q for n, q in zip(new, self.in_flight, strict=True)]
        choice = costs.index(min(costs))
        self.in_flight[choice] += new[choice]
        self._ledger.setdefault((choice, tuple(key)), []).append(new[choice])
        return choice

    def finish(self, replica: int, key: Sequence[Hashable]) -> None:
        entries = self._ledger.get((replica, tuple(key)))
        if not entries:
            raise InvalidArgumentError(f"no request of this key is in flight on {replica}")
        self.in_flight[replica] -= entries.pop(0)
