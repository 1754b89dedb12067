"""The KV slots the radix tree holds: the slot registry of the radix cache.

Each token of a node's edge has one KV slot (its ``value``). The tree must never hold a slot
twice, nor one the allocator has not handed out, and whatever it lets go must go back. This
part of :class:`~minirad.kvcache.radix_cache.RadixCache` keeps that account:

- ``_state``: one byte per KV page, ``PAGE_CACHED`` while a node holds the page (with an
  allocator, its own ``page_state``; without one, a growing array of this cache's);
- :meth:`RadixSlotsMixin._new_slots`: the checks on a new leaf's slots, run before an insert
  changes the tree (which then marks their pages ``PAGE_CACHED``);
- :meth:`RadixSlotsMixin._release`: the slots the tree lets go (evicted leaves, a reset) go
  back to the allocator, or to the simulated pool.

Component seam (SGLang 0.5.23's ``UnifiedRadixCache``): each component (Full, SWA) has its own
KV pool, so its values are checked and released against its own registry; freeing a node's
SWA value alone (a tombstone) or both (cascade Full > SWA) goes through :meth:`_release` of
each component whose value goes.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from minirad.errors import InvalidKeyError
from minirad.kvcache.kv_pool import PAGE_ALLOCATED, PAGE_CACHED
from minirad.kvcache.tokens import checked_token_ids

__all__ = ["MAX_SIMULATED_SLOT", "RadixSlotsMixin"]

# Without an allocator, slot ids index a mask in memory; beyond this, give the cache one.
MAX_SIMULATED_SLOT = 1 << 24


def _as_slots(slots: Sequence[int], name: str) -> tuple[list[int], np.ndarray]:
    """``slots`` as a list and as an int64 array of the same ids. The array views the one that
    validation builds: numpy's own conversion of a list is much slower. Ids of 2**63 or more
    become negative, which every range check refuses.

    Raises:
        InvalidKeyError: a slot is not an int >= 0.
    """
    ids, checked = checked_token_ids(slots, name)
    if ids and type(ids[0]) is not int and checked is not None:
        # A list of numpy ints or bools: plain ints, which the allocator hands out again.
        ids = checked.tolist()
    if checked is None:  # some ids are >= 2**64: 2**64 - 1 keeps the array as long as the list
        checked = array("Q", [min(s, 2**64 - 1) for s in ids])
    return ids, np.frombuffer(checked, np.int64)


class RadixSlotsMixin:
    """Which KV slots the tree holds: checks before it takes some, and release after. A part
    of RadixCache: it uses the tree's attributes (``radix_tree.py``)."""

    def _init_tree(self) -> None:
        super()._init_tree()
        self._next_sim_slot = 0  # slots handed out by insert(value=None)
        # _state[page] is PAGE_CACHED while a node holds that page: rejects giving a slot to
        # the tree twice. A numpy array, not a set: it is updated for every inserted and
        # evicted token. With an allocator it is the allocator's page_state (one array tells
        # allocated from cached, and its free() refuses cached pages); without one, every page
        # the tree does not hold counts as allocated (PAGE_ALLOCATED is 0: np.zeros).
        alloc = self.token_to_kv_pool_allocator
        self._state = alloc.page_state if alloc is not None else np.zeros(0, dtype=np.uint8)
        self._generation = alloc.generation if alloc is not None else 0

    def _new_slots(self, value, slots, i: int, n: int, allocated: bool) -> tuple[list, np.ndarray]:
        """The slots of a new leaf for tokens ``i:n`` (fresh ones when ``value`` is None), as
        a list and an array of their own; raise if the tree may not take them: out of range,
        repeated, the tree's already, not handed out by the allocator (unless ``allocated``),
        not whole pages."""
        alloc, simulated = self.token_to_kv_pool_allocator, value is None
        if simulated:
            slots = np.arange(self._next_sim_slot, self._next_sim_slot + n - i)
            self._next_sim_slot += n - i
            value = slots.tolist()
        else:  # the leaf's own array: a part would keep the whole one alive
            value, slots = value[i:n], slots if i == 0 and n == len(slots) else slots[i:n].copy()
        limit = alloc.size if alloc is not None else MAX_SIMULATED_SLOT
        ordered = slots.copy()  # one sort gives the range and the repeats (in place: np.sort
        ordered.sort()  # adds a Python wrapper)
        lo, hi = int(ordered[0]), int(ordered[-1])
        if lo < 0 or hi >= limit:
            bad = (hi if lo >= 0 else lo) % 2**64
            raise InvalidKeyError(f"slot {bad} is out of range (< {limit})")
        if hi // self.page_size >= len(self._state):
            self._grow_state(hi // self.page_size + 1)
        # One gather tells cached from free pages; count_nonzero runs in C (ndarray.any() goes
        # through a Python wrapper).
        state = self._state[slots if self.page_size == 1 else slots // self.page_size]
        repeated = np.count_nonzero(ordered[1:] == ordered[:-1])
        if repeated or np.count_nonzero(state):  # some page is not PAGE_ALLOCATED
            if repeated or np.count_nonzero(state == PAGE_CACHED):
                raise InvalidKeyError("insert would give the tree a slot it already owns")
            if alloc is not None and not allocated:
                alloc.check_allocated(slots)  # raises why not
        if self.page_size > 1 and not simulated:
            self._check_whole_pages(slots)
        return value, slots

    def _grow_state(self, size: int) -> None:
        if size > len(self._state):  # only without an allocator: slot ids are unbounded
            grown = np.zeros(max(size, 2 * len(self._state)), dtype=np.uint8)  # allocated
            grown[: len(self._state)] = self._state
            self._state = grown

    def _release(self, slots: list[int], slot_ids: np.ndarray) -> None:
        """Give back the slots the tree no longer holds (``slot_ids``: the same as an int64
        array): to the allocator, which marks their pages free, or else to the pool of pages
        the tree may take again. Component seam: each component's slots go to its own pool."""
        if self.token_to_kv_pool_allocator is not None:
            # The tree held them, so they are distinct and allocated: free_evicted() skips
            # free()'s checks.
            self.token_to_kv_pool_allocator.free_evicted(slots, slot_ids, self._generation)
        else:
            pages = slot_ids if self.page_size == 1 else slot_ids // self.page_size
            self._state[pages] = PAGE_ALLOCATED

    def _check_whole_pages(self, slots: np.ndarray) -> None:
        """Each page of tokens must sit in one whole KV page, in order: evicting a node frees
        whole pages, which must not belong to anyone else. ``len(slots)``: whole pages."""
        ps = self.page_size
        pages = slots.reshape(-1, ps)
        bad = (pages[:, :1] % ps != 0) | (pages != pages[:, :1] + np.arange(ps))
        if np.count_nonzero(bad):
            row = pages[bad.any(axis=1)][0].tolist()
            raise InvalidKeyError(f"slots {row} are not one whole page of size {ps}")
