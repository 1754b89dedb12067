"""Stateful property test of the radix cache against a reference model.

Hypothesis drives random sequences of insert / match / lock / unlock / evict and the request
lifecycle (``match_prefix_for_req``, private slots from a :class:`TokenToKVPoolAllocator`,
decode steps, ``cache_unfinished_req``, ``cache_finished_req``) for every page size and
eviction policy, with tokens 0..3 so that sharing and splits are frequent.

The reference model knows nothing about trees: it is a dict from ``(extra_key, prefix)`` (a
token tuple of whole pages) to the KV slots of that prefix's last page. A cached sequence puts
every page-aligned prefix of itself in the dict, so the longest cached prefix of a key is found
by growing it one page at a time. Locks are the prefixes that locks and requests hold. After
every step the tree must hold exactly the model's prefixes and slots, and the memory must add
up: free + evictable + protected + request-private == capacity, no slot owned twice, no free
slot still in use.

The model also keeps, per prefix, what the eviction policies read, by SGLang's rules: how many
inserts counted it (each request once: not again for what it had inserted already), the highest
priority of those inserts, and the deepest the branch through it has been since it was cached;
every node must agree with the model on each of its pages. Every eviction must free exactly the
leaves that a plain re-enactment picks: the policy's smallest key first, a parent joining when
its last child goes.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minirad import (
    EVICTION_POLICIES,
    EventBus,
    RadixCache,
    Req,
    TokenToKVPoolAllocator,
    TreeNode,
    get_policy,
)
from minirad.events import EvictEvent
from minirad.kvcache.kv_pool import block_table_from_slots

PAGE_SIZES = (1, 2, 4)
CAPACITY_PAGES = 12
MAX_FILL = 16  # tokens per request, prompt plus output

picks = st.integers(0, 1000)  # an index into a list, taken modulo its length
# A key is drawn as (an earlier sequence, where to cut it, fresh tokens to append), so that
# keys share prefixes and diverge at any offset, inside a page or on its boundary.
keys = st.tuples(picks, st.integers(0, 12), st.lists(st.integers(0, 3), max_size=6))
extra_keys = st.sampled_from([None, "ns"])
priorities = st.integers(-2, 2)
# Parameters that make the policies' rules bite on keys of at most MAX_FILL tokens: with tlru's
# defaults (a 64-token budget) every leaf would be safe and tlru would be lru.
POLICY_PARAMS = {"tlru": {"threshold": 6, "next_prompt_estimate": 2}}

Prefix = tuple  # (extra_key, token tuple)


@dataclass
class Running:
    """The model's copy of a running request: its slots and how many are the tree's."""

    req: Req
    kv: list[int]
    protected_len: int
    inserted_len: int = 0


class RadixMachine(RuleBasedStateMachine):
    """The cache under test plus the model; one subclass per page size and policy (below)."""

    page_size = 1
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.capacity = CAPACITY_PAGES * ps
        bus = EventBus()
        self.events: list = []
        bus.subscribe(self.events.append)
        self.alloc = TokenToKVPoolAllocator(self.capacity, ps, bus)
        policy = get_policy(self.policy, **POLICY_PARAMS.get(self.policy, {}))
        self.cache = RadixCache(ps, policy, self.alloc, bus)
        self.cached: dict[Prefix, tuple[int, ...]] = {}
        # What the policies read, per cached prefix: (inserts counted, priority, history).
        self.stats: dict[Prefix, tuple[int, int, int]] = {}
        self.locks: list[tuple[TreeNode, Prefix]] = []
        self.running: dict[str, Running] = {}
        self.next_rid = 0
        self.seen: list[list[int]] = [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]]

    def key(self, shape: tuple[int, int, list[int]], min_len: int = 0) -> list[int]:
        """A key built from a drawn shape, remembered so that later keys can share it."""
        i, cut, tail = shape
        key = self.seen[i % len(self.seen)][:cut] + tail
        key = key or [0] * min_len
        self.seen = (self.seen + [key])[-16:]
        return key

    # ------------------------------------------------------------------ the model
    def ref_match(self, key: list[int], extra_key) -> list[int]:
        """Slots of the longest cached page-aligned prefix of ``key``."""
        ps, slots = self.page_size, []
        for end in range(ps, len(key) + 1, ps):
            page = self.cached.get((extra_key, tuple(key[:end])))
            if page is None:
                break
            slots += page
        return slots

    def ref_insert(
        self, key: list[int], value: list[int], extra_key, inserted_len: int = 0, priority: int = 0
    ) -> int:
        """Cache the whole pages of ``key``; return how many tokens were cached already.

        Every page it walks or creates counts the insert (unless the page ends within
        ``inserted_len``) and takes at least ``priority``; when it creates pages, every page on
        its path has now been ``n`` tokens deep."""
        ps = self.page_size
        n = len(key) - len(key) % ps
        have = len(self.ref_match(key[:n], extra_key))
        for end in range(ps, n + 1, ps):
            p = (extra_key, tuple(key[:end]))
            count, prio, history = self.stats.get(p, (0, priority, end))
            if end > have:
                self.cached[p] = tuple(value[end - ps : end])
            self.stats[p] = (
                count + (end > inserted_len),
                max(prio, priority),
                max(history, n if n > have else 0),
            )
        return have

    def protected(self) -> set[Prefix]:
        """Every cached prefix that a lock or a running request holds."""
        held = [p for _, p in self.locks]
        held += [
            (r.req.extra_key, tuple(r.req.fill_ids[: r.protected_len]))
            for r in self.running.values()
        ]
        ps = self.page_size
        return {(ek, key[:end]) for ek, key in held for end in range(ps, len(key) + 1, ps)}

    def private_slots(self) -> list[int]:
        return [s for r in self.running.values() for s in r.kv[r.protected_len :]]

    def do_evict(self, num_tokens: int) -> None:
        protected = self.protected()
        evictable = self.page_size * (len(self.cached) - len(protected))
        start = len(self.events)
        expected = self.expected_victims(num_tokens)
        freed = self.cache.evict(num_tokens)
        assert freed == expected, "evicted other leaves than the policy ranks first"
        leaves = [e.num_tokens for e in self.events[start:] if isinstance(e, EvictEvent)]
        assert sum(leaves) == len(freed)
        assert not leaves or len(freed) - leaves[-1] < num_tokens, "evicted past the target"
        owner = {s: p for p, page in self.cached.items() for s in page}
        gone = {owner[s] for s in freed}  # KeyError: the tree freed a slot it did not own
        assert sorted(freed) == sorted(s for p in gone for s in self.cached[p])  # whole pages
        assert not gone & protected, "evicted a locked prefix"
        for p in gone:
            del self.cached[p]
            del self.stats[p]
        ps = self.page_size
        for ek, key in self.cached:  # only leaves went: what stays is prefix-closed
            assert len(key) == ps or (ek, key[:-ps]) in self.cached
        if evictable >= num_tokens:
            assert len(freed) >= num_tokens
        else:
            assert len(freed) == evictable
        assert not any(self.alloc.is_allocated(s) for s in freed)

    def expected_victims(self, num_tokens: int) -> list[int]:
        """The slots that evicting ``num_tokens`` must free, in order, from a fresh heap of the
        unlocked leaves ranked by the policy's key (the cache keeps its heap between calls and
        trusts its entries to be current)."""
        root, rank = self.cache.root_node, self.cache.eviction_policy.priority
        children, heap = {}, []
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            children[node.id] = len(node.children)
            if not node.children and node.lock_ref == 0:
                heap.append((rank(node), node.id, node))  # keys end with the id: distinct
            stack += node.children.values()
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_tokens and heap:
            node = heapq.heappop(heap)[2]
            freed += node.value
            parent = node.parent
            if parent is not root:
                children[parent.id] -= 1
                if children[parent.id] == 0 and parent.lock_ref == 0:
                    heapq.heappush(heap, (rank(parent), parent.id, parent))
        return freed

    def do_alloc(self, num_tokens: int) -> list[int] | None:
        """Slots for ``num_tokens`` tokens, evicting first if needed (as SGLang's scheduler
        does); None when even that is not enough."""
        ps = self.page_size
        need = -(-num_tokens // ps) * ps
        if need > self.alloc.available_size():
            self.do_evict(need - self.alloc.available_size())
        if need > self.alloc.available_size():
            return None
        return self.alloc.alloc(num_tokens)

    def pick(self, i: int) -> Running:
        return self.running[sorted(self.running)[i % len(self.running)]]

    # ------------------------------------------------------------------ rules
    @rule(shape=keys, extra_key=extra_keys, priority=priorities)
    def insert(self, shape, extra_key, priority) -> None:
        key = self.key(shape)
        value = self.do_alloc(len(key))
        if value is None:
            return
        expected = self.ref_insert(key, value, extra_key, priority=priority)
        assert self.cache.insert(key, value, extra_key, priority=priority) == expected
        n = len(key) - len(key) % self.page_size
        self.alloc.free(value[:expected] + value[n:])  # duplicates and the partial page

    @rule(shape=keys, extra_key=extra_keys, lock=st.booleans())
    def match(self, shape, extra_key, lock) -> None:
        key = self.key(shape)
        expected = self.ref_match(key, extra_key)
        indices, node = self.cache.match_prefix(key, extra_key)
        assert indices == expected
        assert (node is self.cache.root_node) == (not expected)
        if lock:
            before = self.protected()
            self.locks.append((node, (extra_key, tuple(key[: len(expected)]))))
            newly = len(self.protected() - before)
            assert self.cache.inc_lock_ref(node) == -self.page_size * newly

    @precondition(lambda self: self.locks)
    @rule(i=picks)
    def unlock(self, i) -> None:
        before = self.protected()
        node, _ = self.locks.pop(i % len(self.locks))
        released = len(before - self.protected())
        assert self.cache.dec_lock_ref(node) == self.page_size * released

    @rule(num_tokens=st.integers(0, 8))
    def evict(self, num_tokens) -> None:
        self.do_evict(num_tokens)

    @rule(shape=keys, extra_key=extra_keys, sampled=st.integers(0, 3), priority=priorities)
    def start_request(self, shape, extra_key, sampled, priority) -> None:
        prompt = self.key(shape, min_len=1)[: MAX_FILL - 2]
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        req = Req(rid, list(prompt), extra_key=extra_key, priority=priority)
        expected = self.ref_match(prompt[:-1], extra_key)  # the last token is recomputed
        assert self.cache.match_prefix_for_req(req) == expected
        running = Running(req, list(expected), len(expected))
        self.running[rid] = running  # its prefix is locked while we allocate
        slots = self.do_alloc(len(prompt) - len(expected))
        if slots is None:  # no room even after eviction: the scheduler gives up on it
            self.cache.dec_lock_ref(req.last_node)
            del self.running[rid]
            return
        req.kv_indices += slots  # prefill computes the rest of the prompt
        running.kv += slots
        req.output_ids.append(sampled)  # sampled, not yet fed back: no KV

    @precondition(lambda self: self.running)
    @rule(i=picks, sampled=st.integers(0, 3))
    def decode(self, i, sampled) -> None:
        r = self.pick(i)
        if len(r.req.fill_ids) >= MAX_FILL:
            return
        if len(r.kv) % self.page_size:  # the last page is private and has room
            slot = r.kv[-1] + 1
        else:
            slots = self.do_alloc(1)
            if slots is None:
                return
            (slot,) = slots
        r.req.kv_indices.append(slot)
        r.kv.append(slot)
        r.req.output_ids.append(sampled)

    def model_cache_req(self, r: Running) -> tuple[list[int], list[int], int]:
        """Insert a request's computed tokens into the model; return the tree's slots for
        the aligned part, the request's duplicate slots, and the aligned length."""
        key = r.req.fill_ids[: len(r.kv)]
        n = len(key) - len(key) % self.page_size
        have = self.ref_insert(key[:n], r.kv[:n], r.req.extra_key, r.inserted_len, r.req.priority)
        r.inserted_len = max(r.inserted_len, n)
        assert have >= r.protected_len
        return self.ref_match(key[:n], r.req.extra_key), r.kv[r.protected_len : have], n

    @precondition(lambda self: self.running)
    @rule(i=picks)
    def cache_unfinished(self, i) -> None:
        r = self.pick(i)
        canonical, duplicates, n = self.model_cache_req(r)
        self.cache.cache_unfinished_req(r.req)
        r.kv = canonical + r.kv[n:]
        r.protected_len = n
        assert r.req.kv_indices == r.kv
        assert r.req.cache_protected_len == n
        assert not any(self.alloc.is_allocated(s) for s in duplicates)

    def finish(self, r: Running) -> None:
        _, duplicates, n = self.model_cache_req(r)
        tail = r.kv[n:]
        self.seen = (self.seen + [r.req.fill_ids])[-16:]
        self.cache.cache_finished_req(r.req)
        del self.running[r.req.rid]
        assert r.req.last_node is None and r.req.kv_indices == []
        assert not any(self.alloc.is_allocated(s) for s in duplicates + tail)

    @precondition(lambda self: self.running)
    @rule(i=picks)
    def cache_finished(self, i) -> None:
        self.finish(self.pick(i))

    @rule()
    def release_everything(self) -> None:
        while self.locks:
            self.cache.dec_lock_ref(self.locks.pop()[0])
        for rid in sorted(self.running):
            self.finish(self.running[rid])
        self.check_all_unlocked()

    # ------------------------------------------------------------------ checks
    def tree_entries(self) -> dict[Prefix, tuple[int, ...]]:
        """The tree read back as the model's dict (walked here, not with the cache's code)."""
        ps, out = self.page_size, {}
        stack = [(child, []) for child in self.cache.root_node.children.values()]
        while stack:
            node, above = stack.pop()
            key = above + node.key
            for j in range(0, len(node.key), ps):
                end = len(above) + j + ps
                out[(node.extra_key, tuple(key[:end]))] = tuple(node.value[j : j + ps])
            stack += [(child, key) for child in node.children.values()]
        return out

    def check_all_unlocked(self) -> None:
        assert not self.locks and not self.running
        stack = list(self.cache.root_node.children.values())
        while stack:
            node = stack.pop()
            assert node.lock_ref == 0
            stack += node.children.values()
        assert self.cache.protected_size() == 0

    @invariant()
    def tree_matches_the_model(self) -> None:
        self.cache.check_invariants()
        assert self.tree_entries() == self.cached

    @invariant()
    def nodes_carry_what_the_policies_read(self) -> None:
        ps = self.page_size
        stack = [(child, []) for child in self.cache.root_node.children.values()]
        while stack:
            node, above = stack.pop()
            key = above + node.key
            assert node.depth == len(key)
            for end in range(len(above) + ps, len(key) + 1, ps):
                count, prio, history = self.stats[(node.extra_key, tuple(key[:end]))]
                assert (node.insert_count, node.priority, node.history_len) == (
                    count,
                    prio,
                    history,
                ), f"node {node.id}, page ending at {end}"
            stack += [(child, key) for child in node.children.values()]

    @invariant()
    def memory_adds_up(self) -> None:
        ps, cache = self.page_size, self.cache
        protected = self.protected()
        assert cache.protected_size() == ps * len(protected)
        assert cache.evictable_size() == ps * (len(self.cached) - len(protected))
        tree_slots = [s for page in self.cached.values() for s in page]
        private = self.private_slots()
        private_pages = {s // ps for s in private}
        assert len(set(tree_slots)) == len(tree_slots)
        assert len(set(private)) == len(private)
        assert private_pages.isdisjoint(s // ps for s in tree_slots)
        per_request = [{s // ps for s in r.kv[r.protected_len :]} for r in self.running.values()]
        assert sum(map(len, per_request)) == len(private_pages)  # no page in two requests
        assert all(self.alloc.is_allocated(s) for s in tree_slots + private)
        total = (
            self.alloc.available_size()
            + cache.evictable_size()
            + cache.protected_size()
            + ps * len(private_pages)
        )
        assert total == self.capacity

    @invariant()
    def requests_hold_their_prefix(self) -> None:
        for r in self.running.values():
            req = r.req
            assert req.kv_indices == r.kv
            assert len(r.kv) == len(req.fill_ids) - 1
            prefix = req.fill_ids[: r.protected_len]
            assert self.ref_match(prefix, req.extra_key) == r.kv[: r.protected_len]
            block_table_from_slots(r.kv, self.page_size)  # raises if a slot is misplaced

    @invariant()
    def no_locks_when_nothing_is_held(self) -> None:
        if not self.locks and not self.running:
            self.check_all_unlocked()


def _test_case(page_size: int, policy: str):
    machine = type(
        f"RadixMachinePage{page_size}{policy.upper()}",
        (RadixMachine,),
        {"page_size": page_size, "policy": policy},
    )
    case = machine.TestCase
    case.settings = settings(max_examples=40, stateful_step_count=50)
    return case


for _ps in PAGE_SIZES:
    for _policy in EVICTION_POLICIES:
        globals()[f"TestRadixPage{_ps}{_policy.upper()}"] = _test_case(_ps, _policy)
