"""A hybrid radix cache for models with full-attention and sliding-window layers: SGLang 0.5.23's
``UnifiedRadixCache`` with components ``(FULL, SWA)``, on our radix tree.

One tree of token ids, :class:`~minirad.kvcache.radix_tree.RadixTree` (its nodes, child keys,
walk and split); each node carries a Full value (the tree node's own) and an SWA value
(:mod:`.swa_node`), added at the tree's Component seams. Two slot pools hold them
(:mod:`.swa_pools`, the SWA pool ``swa_full_tokens_ratio`` of the full one).
Read in this order:

- ``swa_window.py``: the two window rules (match validator, window lock) and the off-by-one;
- ``swa_node.py``: the per-component data, tombstones;
- ``swa_tree.py``: RadixTree with the SWA component: match (validated), split, insert
  (duplicates freed, tombstones recovered);
- ``swa_locks.py``: path lock (Full) and window lock (SWA), sizes per component;
- ``swa_evict.py``: cascade eviction Full > SWA, tombstoning;
- ``swa_requests.py``: a request's life, ``free_out_of_window_slots``, ``swa_branching_seqlen``;
- ``swa_invariants.py``: ``check_invariants``.

Checked against the real SGLang 0.5.23 in-process (``tests/test_swa_sglang_parity.py``): the
same match lengths, branching points, per-component sizes, tombstones and free slots, op by op.

Differences from SGLang, on purpose: page size 1 only; no host tier, sessions, EAGLE or Mamba;
sizes are recounted by walking the tree (SGLang keeps counters); a recovered tombstone keeps its
full slots and adopts the request's SWA slots even when unlocked (SGLang then adopts the
request's full slots instead: the same pool usage, other slot numbers); a finished request's
tokens are not split at the prompt end (SGLang does that only for a Full-only cache). As in
SGLang, a leaf whose children were evicted may stay a tombstone (its full KV is still there):
Full eviction deletes it later; no hit ends on it.
"""

from __future__ import annotations

from minirad.kvcache.swa_evict import SWAEvictionMixin
from minirad.kvcache.swa_invariants import SWAInvariantsMixin
from minirad.kvcache.swa_locks import SWALocksMixin
from minirad.kvcache.swa_node import ComponentType, SWAMatchResult, SWANode
from minirad.kvcache.swa_pools import SWASlotPools
from minirad.kvcache.swa_requests import SWAReq, SWARequestsMixin
from minirad.kvcache.swa_tree import SWATree

__all__ = ["ComponentType", "SWAMatchResult", "SWANode", "SWARadixCache", "SWAReq"]


class SWARadixCache(SWAInvariantsMixin, SWARequestsMixin, SWAEvictionMixin, SWALocksMixin, SWATree):
    """SGLang's ``UnifiedRadixCache`` with components ``(FULL, SWA)``, page size 1.

    Args:
        full_size: slots in the full-attention pool.
        sliding_window_size: SGLang's window, ``W - 1`` of Hugging Face's ``sliding_window=W``
            (:func:`~minirad.kvcache.swa_window.hf_to_sglang_window`).
        swa_full_tokens_ratio: SWA pool size over full pool size (SGLang's default 0.8).
    """

    components = (ComponentType.FULL, ComponentType.SWA)

    def __init__(
        self, full_size: int, sliding_window_size: int, swa_full_tokens_ratio: float = 0.8
    ) -> None:
        super().__init__(SWASlotPools(full_size, swa_full_tokens_ratio), sliding_window_size)
        self.running: dict[str, SWAReq] = {}
        self.finished: list[SWAReq] = []

    def format_tree(self) -> str:
        """One line per node: tokens, Full and SWA state, lock counts."""
        lines = []

        def walk(n: SWANode, depth: int) -> None:
            for c in n.children.values():
                swa = "tombstone" if c.swa.value is None else f"swa={len(c.swa.value)}"
                lines.append(
                    f"{'  ' * depth}[{c.id}] {len(c.key)} tok {swa}"
                    f" lock(full={c.full.lock_ref}, swa={c.swa.lock_ref})"
                )
                walk(c, depth + 1)

        walk(self.root_node, 0)
        return "\n".join(lines)
