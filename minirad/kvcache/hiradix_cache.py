"""A radix cache over two tiers: device memory and host memory (SGLang's HiCache).

Each node holds its KV on the device (``value``), in the host pool (``host_value``), or both.
Device slots are scarce; host slots are ``hicache_ratio`` times as many. The rules:

- **Backups.** A node is *backed up* once its KV is copied to host slots. ``write_through``
  backs a node up as soon as it is inserted, ``write_through_selective`` once
  ``write_through_threshold`` requests have inserted it (its ``insert_count``: SGLang counts
  a node's hits in its insert, not in a match), ``write_back`` only when the device evicts it.
  A backup always covers the path from the root: backed-up nodes form a contiguous prefix.
- **Demotion.** Evicting a backed-up node from the device frees its device slots but keeps the
  node, host-only. An evicted node that was never backed up is deleted, as in RadixCache.
  Device-resident nodes also form a prefix: only nodes without device children are evicted.
- **Host eviction.** :meth:`evict_host` deletes host-only leaves, least recently used first.
  A locked node is on the device, and its host copy is never evicted either.
- **Match and load-back.** :meth:`match_prefix` returns the device prefix plus
  ``host_hit_length``, the host-only tokens that follow it; :meth:`load_back` copies them to
  fresh device slots, unless they are fewer than ``load_back_threshold`` (recomputing a few
  tokens is cheaper than a transfer). An insert over host-only nodes gives them the request's
  device slots again.

Follows SGLang's ``hiradix_cache.py`` / ``unified_radix_cache.py`` (``write_backup``,
``evict_host``, ``load_back``, ``load_back_threshold = 10``) with KV copies through a
:class:`~minirad.kvcache.host_pool.KVTransfer`, and a disk tier behind the host
(``storage``: pages written when a path is backed up, prefetched on a request's match). Not
here: asynchronous copies (SGLang overlaps them with compute; ours are synchronous).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from minirad.errors import InvalidArgumentError, InvariantError, LockError
from minirad.events import (
    BackupEvent,
    DemoteEvent,
    EventBus,
    EvictEvent,
    HostEvictEvent,
    LoadBackEvent,
    PrefetchEvent,
)
from minirad.kvcache.eviction import EvictionPolicy
from minirad.kvcache.host_pool import (
    KVTransfer,
    NoTransfer,
    make_host_pool,
)
from minirad.kvcache.kv_pool import PAGE_CACHED, PAGE_FREE, TokenToKVPoolAllocator
from minirad.kvcache.radix_cache import (
    MatchResult,
    RadixCache,
    Req,
    TreeNode,
    _check_extra_key,
)
from minirad.kvcache.tiers import DEFAULT_HICACHE_RATIO, WRITE_POLICIES
from minirad.kvcache.tokens import checked_token_ids

if TYPE_CHECKING:
    from minirad.kvcache.hicache_storage import HiCacheStorage

log = logging.getLogger(__name__)

__all__ = ["WRITE_POLICIES", "HiMatchResult", "HiRadixCache", "HiTreeNode"]


class HiTreeNode(TreeNode):
    """A :class:`TreeNode` with a host tier.

    Attributes:
        host_value: host slots holding a copy of this edge's KV (one per token), or None.
        host_lock_ref: operations (a load-back) that need the host copy to stay.
        on_disk: the storage pages that end in this edge are written to the disk tier.
    """

    __slots__ = ("host_value", "host_lock_ref", "on_disk")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.host_value: list[int] | None = None
        self.host_lock_ref = 0
        self.on_disk = False

    @property
    def backuped(self) -> bool:
        return self.host_value is not None

    @property
    def evicted(self) -> bool:
        """Host-only: no device slots (the root, with no key, is never evicted)."""
        return not self.value and bool(self.key)


class HiMatchResult(NamedTuple):
    """What :meth:`HiRadixCache.match_prefix` found (SGLang's ``MatchResult`` fields).

    Attributes:
        indices: device slots of the matched device prefix.
        last_node: the deepest matched node on the device (lock this one).
        host_hit_length: matched tokens past it that only the host holds.
        last_host_node: the deepest matched node (``last_node`` when nothing is host-only);
            :meth:`HiRadixCache.load_back` takes it.
        storage_hit_length: tokens past ``last_host_node`` that the disk tier holds (whole
            storage pages); :meth:`HiRadixCache.prefetch_from_storage` reads them to the host.
    """

    indices: list[int]
    last_node: TreeNode
    host_hit_length: int
    last_host_node: TreeNode
    storage_hit_length: int = 0


class HiRadixCache(RadixCache):
    """:class:`RadixCache` with a host tier. Sizes (``evictable_size()``...) count device tokens.

    Args:
        page_size, eviction_policy, bus: as :class:`RadixCache`'s.
        token_to_kv_pool_allocator: the device pool (required: load-back allocates from it).
        host_pool: the host pool; by default one ``hicache_ratio`` times the device pool.
        hicache_ratio: host pool size over device pool size (SGLang's default, 2).
        write_policy: one of :data:`WRITE_POLICIES`.
        write_through_threshold: inserts (requests) that make ``write_through_selective`` back
            a node up (SGLang's default 2).
        load_back_threshold: fewer host-only tokens than this are not loaded back.
        transfer: performs the copies (default: :class:`NoTransfer`).
        storage: the disk tier (L3), or None. Backed-up paths are written to it page by page;
            :meth:`match_prefix_for_req` reads the pages that follow a match back to the host.
        storage_page_size: tokens per storage page (a multiple of ``page_size``; default the
            smallest multiple >= 32, vLLM's CPU block size): one file per page.
        storage_namespace: goes into every page hash, so that caches of different models
            sharing a folder never share (or overwrite) pages (the engine gives its model's
            fingerprint).
    """

    node_class = HiTreeNode

    def __init__(
        self,
        page_size: int = 1,
        eviction_policy: str | EvictionPolicy = "lru",
        token_to_kv_pool_allocator: TokenToKVPoolAllocator | None = None,
        bus: EventBus | None = None,
        *,
        host_pool: TokenToKVPoolAllocator | None = None,
        hicache_ratio: float = DEFAULT_HICACHE_RATIO,
        write_policy: str = "write_through",
        write_through_threshold: int = 2,
        load_back_threshold: int = 10,
        transfer: KVTransfer | None = None,
        storage: HiCacheStorage | None = None,
        storage_page_size: int | None = None,
        storage_namespace: str = "",
    ) -> None:
        if not isinstance(token_to_kv_pool_allocator, TokenToKVPoolAllocator):
            raise InvalidArgumentError("HiRadixCache needs a device TokenToKVPoolAllocator")
        if write_policy not in WRITE_POLICIES:
            raise InvalidArgumentError(
                f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}"
            )
        thresholds = {
            "write_through_threshold": write_through_threshold,
            "load_back_threshold": load_back_threshold,
        }
        for name, v in thresholds.items():
            if type(v) is not int or v < 0:
                raise InvalidArgumentError(f"{name} must be an int >= 0, got {v!r}")
        if host_pool is None:
            host_pool = make_host_pool(token_to_kv_pool_allocator, hicache_ratio)
        if host_pool.page_size != page_size:
            raise InvalidArgumentError(
                f"host pool page_size {host_pool.page_size} differs from page_size {page_size}"
            )
        self.host_pool = host_pool
        self.write_policy = write_policy
        # SGLang: 1 under write_through (every insert), else the threshold.
        selective = write_policy == "write_through_selective"
        self.write_through_threshold = write_through_threshold if selective else 1
        self.load_back_threshold = load_back_threshold
        self.transfer: KVTransfer = transfer if transfer is not None else NoTransfer()
        if storage_page_size is None:
            storage_page_size = -(-32 // page_size) * page_size
        if (
            type(storage_page_size) is not int
            or storage_page_size <= 0
            or (storage_page_size % page_size)
        ):
            raise InvalidArgumentError(
                f"storage_page_size must be a positive multiple of page_size {page_size}, "
                f"got {storage_page_size!r}"
            )
        if not isinstance(storage_namespace, str):
            raise InvalidArgumentError(
                f"storage_namespace must be a str, got {storage_namespace!r}"
            )
        self.storage, self.storage_page_size = storage, storage_page_size
        self.storage_namespace = storage_namespace
        super().__init__(page_size, eviction_policy, token_to_kv_pool_allocator, bus)

    # ------------------------------------------------------------------ hooks
    def _device_leaf(self, node: TreeNode) -> bool:
        return all(not c.value for c in node.children.values())

    def _host_only(self, node: TreeNode) -> bool:
        return node.evicted

    def _split_node(self, child: TreeNode, m: int, t: int) -> TreeNode:
        new = super()._split_node(child, m, t)
        if child.host_value is not None:
            new.host_value, child.host_value = child.host_value[:m], child.host_value[m:]
        new.on_disk = child.on_disk
        return new

    def _maybe_device_leaf(self, node: TreeNode) -> None:
        """Make ``node`` an eviction candidate if it is an unlocked device node whose children
        are all host-only (RadixCache only looks for nodes without children)."""
        if (
            node is not self.root_node
            and node.value
            and node.lock_ref == 0
            and node not in self.evictable_leaves
            and self._device_leaf(node)
        ):
            self._add_evictable(node)

    # ------------------------------------------------------------------ match
    def _match_all(self, key, buf, extra_key, hit: bool) -> tuple[list[int], TreeNode, TreeNode]:
        """Device slots, deepest device node and deepest node of a match."""
        indices, node = super()._match(key, buf, extra_key, hit)  # host-only nodes add no slots
        device = node
        while device.evicted:
            device = device.parent
        return indices, device, node

    def _match(self, key, buf, extra_key, hit: bool) -> MatchResult:
        indices, device, _ = self._match_all(key, buf, extra_key, hit)
        return MatchResult(indices, device)  # requests lock device nodes only

    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> HiMatchResult:
        """:meth:`RadixCache.match_prefix` over both tiers: the device prefix's slots and node,
        and how many tokens past it the host holds (and the node that ends them)."""
        key, buf = checked_token_ids(key, "key")
        _check_extra_key(extra_key)
        key = self._aligned(key)
        indices, device, node = self._match_all(key, buf, extra_key, hit=True)
        stored = self._storage_hit(key, extra_key, node.depth)[0] if self.storage else 0
        return HiMatchResult(indices, device, node.depth - device.depth, node, stored)

    def match_prefix_for_req(self, req: Req, max_prefix_len: int | None = None) -> list[int]:
        """:meth:`RadixCache.match_prefix_for_req` over the tiers: what the disk holds past the
        tree is prefetched to the host, then what the host holds past the device is loaded
        back (if not under ``load_back_threshold``), and the request locks it all. Sets
        ``req.host_hit_length`` and ``req.storage_hit_length`` (SGLang's names): how many of
        the matched tokens came from the host, and from the disk (through the host)."""
        indices = super().match_prefix_for_req(req, max_prefix_len)
        req.host_hit_length = req.storage_hit_length = 0
        fill, buf = req.checked_fill_ids()
        cap = (
            max(len(fill) - 1, 0) if max_prefix_len is None else min(len(fill) - 1, max_prefix_len)
        )
        key = self._aligned(fill[: max(cap, 0)])
        _, device, node = self._match_all(key, buf, req.extra_key, hit=False)
        stored = 0
        if self.storage is not None:
            node, stored = self.prefetch_from_storage(key, req.extra_key, node)
        if node is device:
            return indices
        loaded = self.load_back(node)
        if not loaded:
            return indices
        indices = indices + loaded
        self._hold(req, node, indices, list(indices))
        req.storage_hit_length = min(stored, len(loaded))
        req.host_hit_length = len(loaded) - req.storage_hit_length
        return indices

    def cached_prefix_len(self, key: Sequence[int], extra_key: str | None = None) -> int:
        """Tokens of ``key`` on the device (read only; host-only tokens not counted)."""
        key, buf = checked_token_ids(key, "key")
        _check_extra_key(extra_key)
        walked, i, _ = self._walk(self._aligned(key), buf, extra_key)
        device = sum(len(n.key) for n in walked if n.value)
        return min(i, device)

    # ------------------------------------------------------------------ insert
    def _insert(
        self, key, buf, value, slots, extra_key, priority=0, inserted_len=0, allocated=False
    ) -> int:
        """RadixCache's insert, except that host-only nodes on the path take the caller's
        slots (they are on the device again, and keep their backup). Returns the tokens that
        were on the device already: only those slots of the caller's are duplicates."""
        walked, i, cut = self._walk(key, buf, extra_key)
        d = 0
        for n in walked:
            if n.evicted:
                break
            d += len(n.key)
        d = min(d, i)
        if d < i:  # revive the host-only part of the path with value[d:i]
            self._new_slots(value, slots, d, len(key), allocated)  # checks only
            if cut and walked[-1].evicted:  # touched first, as RadixCache._visit does
                t = self.bus.tick()
                walked[-1].last_access_time = t
                walked[-1] = self._split_node(walked[-1], cut, t)
            start, revived = 0, []
            for n in walked:
                end = start + len(n.key)
                if n.evicted:
                    self._set_device(n, value[start:end], slots[start:end].copy())
                    revived.append(n)
                start = end
            self._record(LoadBackEvent, self.bus.time, revived, value[d:i], True)
            allocated = True  # value[i:] was checked above
        super()._insert(key, buf, value, slots, extra_key, priority, inserted_len, allocated)
        if self.write_policy != "write_back" and key:
            hot = self._walk(key, buf, extra_key)[0][-1]
            # Insert counts never grow down a path: back up to the deepest node that is hot.
            while (
                self.write_policy == "write_through_selective"
                and hot is not self.root_node
                and hot.insert_count < self.write_through_threshold
            ):
                hot = hot.parent
            self._write_backup(hot)
        return d

    def _set_device(self, node: TreeNode, value: list[int], value_buf: np.ndarray) -> None:
        """Give the host-only ``node`` (unlocked) device slots."""
        node.value, node.value_buf = value, value_buf
        self._state[value_buf if self.page_size == 1 else value_buf // self.page_size] = PAGE_CACHED
        self.evictable_size_ += len(value)
        self.evictable_leaves.discard(node.parent)
        self._maybe_device_leaf(node)

    # ------------------------------------------------------------------ backup
    def _write_backup(self, node: TreeNode) -> bool:
        """Back up ``node`` and every ancestor not backed up yet (all on the device), copying
        their KV to new host slots, evicting host-only leaves if the host pool is full.
        Returns False (and backs up nothing) if the host pool cannot hold them."""
        path = []
        while node is not self.root_node and not node.backuped:
            path.append(node)
            node = node.parent
        if not path:
            return True
        path.reverse()
        host = self._alloc_host(sum(len(n.key) for n in path))
        if host is None:
            return False
        device, start = [], 0
        for n in path:
            n.host_value = host[start : start + len(n.key)]
            device += n.value
            start += len(n.key)
        self.transfer.write_backup(device, host)
        self._record(BackupEvent, self.bus.time, path, host, "CPU")
        if self.storage is not None:
            try:
                self._backup_storage(path[-1])
            except Exception:  # the disk is a cache: a page it did not keep is a later miss
                log.exception("hicache storage: writing the pages of node %d failed", path[-1].id)
        return True

    def _alloc_host(self, num_tokens: int) -> list[int] | None:
        pool = self.host_pool
        if pool.available_size() < num_tokens:
            self.evict_host(num_tokens - pool.available_size())
        if pool.available_size() < num_tokens:
            return None
        return pool.alloc(num_tokens)

    # ------------------------------------------------------------------ storage (L3)
    def _path(self, node: TreeNode) -> list[TreeNode]:
        path = []
        while node is not self.root_node:
            path.append(node)
            node = node.parent
        return path[::-1]

    def _page_hashes(self, key: list[int], extra_key: str | None) -> list[str]:
        """The chained hashes of ``key``'s whole storage pages, in this cache's namespace."""
        from minirad.kvcache.hicache_storage import page_hashes  # torch: with a disk tier only

        if self.storage_namespace:
            extra_key = f"{self.storage_namespace}|{extra_key or ''}"
        return page_hashes(key, self.storage_page_size, extra_key)

    def _backup_storage(self, node: TreeNode) -> None:
        """Write the storage pages that end on the path to ``node`` (backed up) and are not
        on disk yet: each page's KV read from its host slots, keyed by its chained hash."""
        path = self._path(node)
        todo = [n for n in path if not n.on_disk]
        if not todo:
            return
        key = [t for n in path for t in n.key]
        host = [s for n in path for s in n.host_value]
        ps = self.storage_page_size
        hashes = self._page_hashes(key, path[0].extra_key)
        written, start = [], 0
        for n in path:
            end = start + len(n.key)
            pages = range(start // ps, end // ps)  # pages ending inside this edge
            if not n.on_disk and pages:
                for j in pages:
                    self.storage.set(
                        hashes[j], self.transfer.read_host(host[j * ps : (j + 1) * ps])
                    )
                n.on_disk = True
                written.append(n)
            start = end
        if written:
            self._record(BackupEvent, self.bus.time, written, [], "STORAGE")

    def _storage_hit(self, key: list[int], extra_key, depth: int) -> tuple[int, list[str], int]:
        """Tokens of ``key`` past ``depth`` (the tree's match) that whole stored pages hold,
        the hashes of those pages, and the index of the first."""
        ps = self.storage_page_size
        first = depth // ps
        hashes = self._page_hashes(key, extra_key)[first:]
        n = self.storage.exists(hashes) if hashes else 0
        return max((first + n) * ps - depth, 0), hashes[:n], first

    def prefetch_from_storage(
        self, key: Sequence[int], extra_key: str | None = None, node: TreeNode | None = None
    ) -> tuple[TreeNode, int]:
        """Read the stored pages that follow the tree's match of ``key`` into new host slots,
        as one new host-only leaf (SGLang's ``prefetch_from_storage``, here synchronous).
        A page that cannot be read (missing, corrupt) ends the run: what follows is a miss.

        Args:
            node: the deepest node matching ``key`` (found again if None).

        Returns:
            the deepest matched node afterwards, and the tokens read from disk.
        """
        if self.storage is None:
            return (node or self.root_node), 0
        if node is None:
            key, buf = checked_token_ids(key, "key")
            _check_extra_key(extra_key)
            key = self._aligned(key)
            node = self._match_all(key, buf, extra_key, hit=False)[2]
        depth, ps = node.depth, self.storage_page_size
        _, hashes, first = self._storage_hit(list(key), extra_key, depth)
        pages = []
        for h in hashes:
            try:
                data = self.storage.get(h)
                ok = data is not None and self.transfer.accepts(data, ps)
            except Exception:  # a storage backend's failure is a miss, never the request's
                log.exception("hicache storage: reading page %s failed", h[:12])
                ok = False
            if not ok:
                break  # a miss from here on: never KV of the wrong shape
            pages.append(data)
        end = (first + len(pages)) * ps
        if end <= depth or (node is not self.root_node and not self._write_backup(node)):
            return node, 0  # a host-only leaf needs a backed-up parent (backups are a prefix)
        node.host_lock_ref += 1  # making room on the host must not evict the parent
        try:
            host = self._alloc_host(end - depth)
        finally:
            node.host_lock_ref -= 1
        if host is None:
            return node, 0
        try:
            self.transfer.write_host(host, pages, depth - first * ps)
        except Exception:
            log.exception("hicache storage: copying %d pages to the host failed", len(pages))
            self.host_pool.free(host)
            return node, 0
        t = self.bus.tick()
        leaf = self._new_node(list(key[depth:end]), [], node, t, extra_key)
        leaf.value_buf = np.empty(0, dtype=np.int64)
        leaf.host_value, leaf.on_disk = host, True
        node.children[self._child_key(leaf.key, 0, extra_key)] = leaf
        self._record(PrefetchEvent, t, leaf)
        return leaf, end - depth

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> list[int]:
        """Free at least ``num_tokens`` device tokens (device leaves, in policy order): a
        backed-up leaf is demoted to host-only, one not backed up is deleted (``write_back``
        backs it up first if the host pool can take it).

        Returns:
            the freed device slots (also freed to the device pool).
        """
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidArgumentError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        t = self.bus.tick()
        freed: list[int] = []
        bufs: list[np.ndarray] = []
        while len(freed) < num_tokens and (leaf := self._pop_evictable()) is not None:
            if self.write_policy == "write_back" and not leaf.backuped:
                self._write_backup(leaf)
            self._record(DemoteEvent if leaf.backuped else EvictEvent, t, leaf)
            freed += leaf.value
            bufs.append(leaf.value_buf)
            parent = leaf.parent
            if leaf.backuped:  # demote: the node stays, host-only
                self.evictable_size_ -= len(leaf.value)
                self.evictable_leaves.discard(leaf)
                leaf.value, leaf.value_buf = [], leaf.value_buf[:0]
            else:  # never backed up, so it has no children (backups are a prefix)
                self._delete_leaf(leaf)
            self._maybe_device_leaf(parent)
        if bufs:
            self._release(freed, bufs[0] if len(bufs) == 1 else np.concatenate(bufs))
        return freed

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens by deleting host-only leaves, least
        recently used first (a parent left host-only and childless joins at once).

        Returns:
            the host tokens freed (fewer when nothing else is evictable).
        """
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidArgumentError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        heap = [(n.last_access_time, n.id, n) for n in self.nodes() if self._host_leaf(n)]
        heapq.heapify(heap)
        freed: list[int] = []
        t = self.bus.tick() if heap else self.bus.time
        while len(freed) < num_tokens and heap:
            node = heapq.heappop(heap)[2]
            self._record(HostEvictEvent, t, node)
            freed += node.host_value
            parent = node.parent
            del parent.children[self._child_key(node.key, 0, node.extra_key)]
            node.parent, node.host_value = None, None
            if parent is not self.root_node and self._host_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        if freed:
            self.host_pool.free(freed)
        return len(freed)

    @staticmethod
    def _host_leaf(node: TreeNode) -> bool:
        return node.evicted and not node.children and node.host_lock_ref == 0

    # ------------------------------------------------------------------ load back
    def load_back(self, node: TreeNode) -> list[int] | None:
        """Bring the host-only nodes on the path to ``node`` (a match's ``last_host_node``)
        back to the device: new device slots (evicting if needed), the KV copied in.

        Returns:
            the new device slots, in path order (empty if ``node`` is on the device); None if
            they are fewer than ``load_back_threshold`` tokens or the device cannot hold them.

        Raises:
            LockError: ``node`` is not in this tree.
        """
        self._path_to_root(node)  # raises if it is not in the tree
        path = []
        while node.evicted:
            path.append(node)
            node = node.parent
        path.reverse()
        total = sum(len(n.key) for n in path)
        if not path:
            return []
        if total < self.load_back_threshold:
            return None
        # Lock both tiers while the device makes room: the ancestor on the device, the host
        # copies (a write_back eviction may evict host leaves).
        if node is not self.root_node:
            self.inc_lock_ref(node)
        for n in path:
            n.host_lock_ref += 1
        try:
            device = self._alloc_device(total)
        finally:
            for n in path:
                n.host_lock_ref -= 1
            if node is not self.root_node:
                self.dec_lock_ref(node)
        if device is None:
            return None
        host = [s for n in path for s in n.host_value]
        self.transfer.load_back(host, device)
        buf, start = np.asarray(device, dtype=np.int64), 0
        for n in path:
            end = start + len(n.key)
            self._set_device(n, device[start:end], buf[start:end].copy())
            start = end
        self._record(LoadBackEvent, self.bus.tick(), path, device, False)
        return device

    def _alloc_device(self, num_tokens: int) -> list[int] | None:
        pool = self.token_to_kv_pool_allocator
        if pool.available_size() < num_tokens:
            self.evict(num_tokens - pool.available_size())
        if pool.available_size() < num_tokens:
            return None
        return pool.alloc(num_tokens)

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: TreeNode) -> int:
        """:meth:`RadixCache.inc_lock_ref`; only a node on the device can be locked.

        Raises:
            LockError: ``node`` is host-only (load it back first) or not in the tree.
        """
        if isinstance(node, HiTreeNode) and node.evicted:
            raise LockError(f"node {node.id} is host-only: load it back before locking it")
        return super().inc_lock_ref(node)

    def dec_lock_ref(self, node: TreeNode) -> int:
        delta = super().dec_lock_ref(node)
        n = node
        while n is not self.root_node and n.lock_ref == 0:
            self._maybe_device_leaf(n)  # RadixCache missed those with host-only children
            n = n.parent
        return delta

    # ------------------------------------------------------------------ sizes, reset
    def host_size(self) -> int:
        """Host slots the tree holds (backups of device nodes and host-only nodes)."""
        return sum(len(n.host_value) for n in self.nodes() if n.host_value is not None)

    def reset(self) -> None:
        """:meth:`RadixCache.reset`, the host slots freed too."""
        host = [s for n in self.nodes() if n.host_value is not None for s in n.host_value]
        super().reset()
        if host:
            self.host_pool.free(host)

    def check_invariants(self) -> None:
        """:meth:`RadixCache.check_invariants` plus the tiers': every node holds device or host
        slots; a host value is as long as its key; device nodes and backed-up nodes each form
        a prefix from the root; host-only nodes are unlocked; the host slots the tree holds
        are distinct and exactly those the host pool has handed out."""
        super().check_invariants()
        root, host = self.root_node, []
        for n in self.nodes():

            def fail(msg: str, n=n) -> None:
                raise InvariantError(f"node {n.id}: {msg}")

            top = n.parent is root
            if n.host_value is not None:
                if len(n.host_value) != len(n.key):
                    fail(f"host value of {len(n.host_value)} slots for {len(n.key)} tokens")
                if not top and n.parent.host_value is None:
                    fail("backed up under a parent that is not (backups must be a prefix)")
                host += n.host_value
            elif not n.value:
                fail("holds neither device nor host slots")
            if n.value and not top and not n.parent.value:
                fail("on the device under a host-only parent")
            if n.evicted and n.lock_ref:
                fail(f"host-only but locked (lock_ref={n.lock_ref})")
            if n.host_lock_ref:
                fail(f"host_lock_ref {n.host_lock_ref} outside a load-back")
        if len(set(host)) != len(host):
            raise InvariantError("a host slot is owned by two nodes")
        pool = self.host_pool
        handed = np.repeat(pool.page_state != PAGE_FREE, pool.page_size)
        if set(host) != set(np.flatnonzero(handed).tolist()):
            raise InvariantError("host pool out of sync with the tree's host slots")
