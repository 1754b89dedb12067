"""A request's life in the hybrid cache (SGLang 0.5.23's ``UnifiedRadixCache`` with (FULL, SWA)).

- :meth:`SWARequestsMixin.start_req`: match the prompt, lock the hit (path lock + window lock),
  allocate slots in both pools for the rest (evicting if short);
- :meth:`SWARequestsMixin.decode`: one more token, one more slot in each pool;
- :meth:`SWARequestsMixin.free_out_of_window_slots`: free the SWA slots of the request's own
  tokens that fell out of the window; ``evicted_seqlen`` records how far, so the later insert
  makes those tokens a tombstone instead of live SWA nodes;
- :meth:`SWARequestsMixin.cache_unfinished_req` / :meth:`SWARequestsMixin.cache_finished_req`:
  insert the request's tokens, but only up to ``swa_branching_seqlen`` when the match found
  more full KV than SWA-valid KV (``prepare_for_caching_req``): the next request branching
  there then finds a window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minirad.errors import InvalidArgumentError, OutOfMemoryError, RequestError
from minirad.kvcache.swa_node import SWANode

if TYPE_CHECKING:
    from minirad.kvcache.swa_evict import SWAEvictionMixin

    _Base = SWAEvictionMixin
else:
    _Base = object

__all__ = ["SWAReq", "SWARequestsMixin"]


@dataclass(eq=False)
class SWAReq:
    """A running request's view of the cache.

    Attributes:
        rid: its id.
        tokens: prompt, then each decoded token.
        kv: full slots of the computed tokens, one per token; ``kv[:cache_protected_len]`` are
            the tree's, the rest the request's own.
        cache_protected_len: tokens the tree holds for it (matched or inserted).
        last_node, swa_uuid: its lock (see ``inc_lock_ref``).
        evicted_seqlen: its tokens before this have had their SWA slots freed.
        swa_branching_seqlen: see :class:`~minirad.kvcache.swa_node.SWAMatchResult`.
        finished: it has released everything.
    """

    rid: str
    tokens: list[int]
    kv: list[int] = field(default_factory=list)
    cache_protected_len: int = 0
    last_node: SWANode | None = None
    swa_uuid: int | None = None
    evicted_seqlen: int = 0
    swa_branching_seqlen: int | None = None
    finished: bool = False


class SWARequestsMixin(_Base):
    def _alloc(self, n: int) -> list[int]:
        """``n`` slots in each pool, evicting what is short first."""
        free_full, free_swa = self.pools.available()
        if free_full < n or free_swa < n:
            self.evict(max(0, n - free_full), max(0, n - free_swa))
        return self.pools.alloc(n)

    def start_req(self, rid: str, prompt: list[int]) -> SWAReq:
        """Match, lock and allocate a new request; its ``cache_protected_len`` is the hit.

        Raises:
            OutOfMemoryError: the pools cannot hold the prompt even after eviction (the lock
                is released first).
        """
        if not prompt:
            raise InvalidArgumentError("a request needs a prompt")
        m = self.match_prefix(prompt)
        req = SWAReq(rid, list(prompt), list(m.indices), len(m.indices), m.last_node)
        req.swa_branching_seqlen = m.swa_branching_seqlen
        req.swa_uuid = self.inc_lock_ref(m.last_node)
        try:
            req.kv += self._alloc(len(prompt) - len(m.indices))
        except OutOfMemoryError:
            self.dec_lock_ref(m.last_node, req.swa_uuid)
            raise
        self.running[rid] = req
        return req

    def decode(self, req: SWAReq, token: int) -> None:
        """Append one generated token and its slots."""
        self._check_running(req)
        req.kv += self._alloc(1)
        req.tokens.append(token)

    def free_out_of_window_slots(self, req: SWAReq, pre_len: int | None = None) -> int:
        """Free the SWA slots of the request's own tokens that the query at ``pre_len``
        (default: the last token, whose KV the next forward computes) no longer reads: those
        before ``pre_len - sliding_window_size``. Return how many were freed."""
        self._check_running(req)
        pre_len = len(req.kv) - 1 if pre_len is None else pre_len
        threshold = pre_len - self.sliding_window_size
        if threshold < req.evicted_seqlen + 1:
            return 0
        start = max(req.evicted_seqlen, req.cache_protected_len)
        freed = self.pools.free_swa_of(req.kv[start:threshold]) if threshold > start else 0
        req.evicted_seqlen = max(start, threshold)
        return freed

    def _insert_len(self, req: SWAReq, n: int) -> int:
        """SGLang's ``prepare_for_caching_req``: cut the insert at the branching point (not
        once the request has freed the SWA KV there: the cut would end on a tombstone)."""
        b = req.swa_branching_seqlen
        if b is not None and max(req.cache_protected_len, req.evicted_seqlen) < b <= n:
            return b
        return n

    def cache_unfinished_req(self, req: SWAReq) -> None:
        """Insert what the request computed so far and move its lock to the end of it; the
        tree's slots replace its own for the inserted tokens."""
        self._check_running(req)
        n = self._insert_len(req, len(req.kv))
        self.free_out_of_window_slots(req, n - 1)
        if n <= req.cache_protected_len:
            return  # nothing new since the last insert
        self.insert(req.tokens[:n], req.kv[:n], req.cache_protected_len, req.evicted_seqlen)
        node, indices = self._exact_node(req.tokens[:n])
        self.dec_lock_ref(req.last_node, req.swa_uuid)
        req.kv[:n] = indices
        req.last_node, req.cache_protected_len = node, n
        req.swa_uuid = self.inc_lock_ref(node)
        if n < len(req.kv):  # cut at the branching point: the branch is in the tree now
            req.swa_branching_seqlen = None
            self.free_out_of_window_slots(req)  # SGLang's cleanup_after_caching_req

    def cache_finished_req(self, req: SWAReq) -> None:
        """Insert the finished request's tokens, free what the tree does not take, unlock."""
        self._check_running(req)
        n = self._insert_len(req, len(req.kv))
        if n > req.cache_protected_len:
            self.insert(req.tokens[:n], req.kv[:n], req.cache_protected_len, req.evicted_seqlen)
        tail = req.kv[max(n, req.cache_protected_len) :]
        self.pools.free(tail)
        self.dec_lock_ref(req.last_node, req.swa_uuid)
        req.finished, req.kv, req.last_node = True, [], None
        del self.running[req.rid]
        self.finished.append(req)

    def _exact_node(self, key: list[int]) -> tuple[SWANode, list[int]]:
        """The node a just-inserted ``key`` ends on (no validator) and its full slots."""
        walked, _ = self._walk_split(key, None)
        return walked[-1], [s for n in walked for s in n.value]

    def _check_running(self, req: SWAReq) -> None:
        if req.finished or self.running.get(req.rid) is not req:
            raise RequestError(f"request {req.rid!r} is not running in this cache")
