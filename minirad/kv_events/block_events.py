"""vLLM's KV-cache events and minirad's tree events, translated both ways.

vLLM publishes its block-level prefix cache as ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` (``vllm/distributed/kv_events.py``, emitted by
``vllm/v1/core/block_pool.py``); :mod:`minirad.kv_events` decodes and publishes that wire
format. This module translates:

- **vLLM -> minirad** (:class:`BlockHashTree`): the blocks a real vLLM holds become a tree
  of minirad :class:`~minirad.events.InsertEvent` / :class:`~minirad.events.EvictEvent` /
  :class:`~minirad.events.ResetEvent` on an :class:`~minirad.events.EventBus`, so the
  visualizer's ``FrameBuilder`` draws vLLM's cache as it draws our radix tree: one node per
  block (its ``block_size`` token ids), chained under its parent block's node.
- **minirad -> vLLM** (:class:`RadixBlockEvents`): our radix tree's cached paths, cut into
  full ``block_size``-token blocks with :class:`~minirad.kvcache.block_pool.BlockPool`'s chained
  hashes, become vLLM events, so the same viewer, or any KV-aware router that reads vLLM's
  events, can follow a minirad engine (``EngineConfig(kv_events_endpoint=...)``).

Example (the two directions joined, no socket)::

    bus = EventBus()
    view = BlockHashTree()                  # its own bus: view.bus, for a FrameBuilder
    pub = RadixBlockEvents(bus, view.extend, block_size=4)
    cache = RadixCache(bus=bus)
    cache.insert(list(range(10)))
    pub.flush()                             # an engine flushes at the end of every step
    view.stored_blocks()                    # {<hash>: (None, (0, 1, 2, 3)),
                                            #  <hash>: (<first hash>, (4, 5, 6, 7))}
"""

from __future__ import annotations

import hashlib
import itertools
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from minirad.errors import InvalidArgumentError, KVEventError
from minirad.events import (
    BackupEvent,
    DemoteEvent,
    Event,
    EventBus,
    EvictEvent,
    HostEvictEvent,
    InsertEvent,
    LoadBackEvent,
    PrefetchEvent,
    ResetEvent,
    SplitEvent,
    StepEvent,
)
from minirad.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from minirad.kv_events.event_tree import EventTree
from minirad.kvcache.block_pool import hash_block_tokens, none_hash
from minirad.kvcache.multimodal import MultiModalItem, block_extra_keys, pad_value

__all__ = [
    "MASK_64",
    "VLLM_BLOCK_SIZE",
    "BlockChains",
    "BlockHashTree",
    "RadixBlockEvents",
    "block_hash_u64",
]

# The block size of our published block events and of the real vLLM beside us: vLLM's CPU
# attention backend accepts only multiples of 32 (16, the GPU default, fails with "No common
# block size"), and like-for-like events need one size on both sides.
VLLM_BLOCK_SIZE = 32
MASK_64 = (1 << 64) - 1  # vLLM's int block hashes are the low 64 bits of the digest
RESET_SOURCE = "radix_cache"  # the ResetEvent source that clears a FrameBuilder's tree
_HEX_DIGITS = frozenset(string.hexdigits)


def _pad_hash(pad: int, vocab_size: int) -> str:
    """The image hash a pad id holds (:func:`~minirad.kvcache.multimodal.pad_value`, inverted)."""
    return f"{pad - vocab_size:064x}"


def block_hash_u64(digest: bytes) -> int:
    """A :func:`~minirad.kvcache.block_pool.hash_block_tokens` digest as vLLM publishes block
    hashes: the big-endian integer masked to 64 bits, unsigned (vLLM's ``maybe_convert_block_hash``
    with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    return int.from_bytes(digest, "big") & MASK_64


def _hex(block_hash: int) -> str:
    # SGLang publishes signed int64 hashes: masking gives both engines the same 16 digits.
    return f"{block_hash & MASK_64:016x}"


# ====================================================================== vLLM -> minirad
@dataclass(slots=True, eq=False)
class _Block:
    """One block hash the view knows. ``token_ids`` is None for a *placeholder*: a parent
    hash that stored blocks chain to but whose own BlockStored the view never saw."""

    block_hash: int
    parent: int | None  # parent_block_hash (None: the first block of a sequence)
    token_ids: tuple[int, ...] | None  # as published
    key: tuple[int, ...]  # as drawn: image placeholders replaced by pad ids
    copies: int = 0  # BlockStored minus BlockRemoved of this hash
    node_id: int | None = None  # its node while drawn


class BlockHashTree:
    """vLLM's block-level prefix cache rebuilt from its KV events, re-published on ``bus`` as
    minirad tree events for ``viz.frame_builder.FrameBuilder``.

    What is drawn, and why (from how ``vllm/v1/core/block_pool.py`` emits events):

    - **One node per block hash**, key = the block's token ids, under the node of its
      ``parent_block_hash`` (the root for None). A BlockStored of k blocks is a chain of k
      nodes, one :class:`~minirad.events.InsertEvent` each (``value`` is empty: vLLM does not
      publish slots, so a FrameBuilder without ``pool_size`` shows no pool cells). Node ids
      count from 1 in drawing order and from 1 again after a reset, as a RadixCache's do;
      ``extra_key`` is the block hash in 16 hex digits (shown in the node's hover text).
    - **Copies are counted.** vLLM does not de-duplicate blocks: two requests of one step
      that compute the same prefix, or a request that recomputes its last full block, store
      the same hash twice, and each copy (in any ``medium``) is removed on its own. A node
      stays while at least one copy does; a BlockStored of a hash already drawn marks its
      path as accessed (an InsertEvent with ``node_id=None``). A removal of a hash the view
      never saw stored is ignored.
    - **A block whose parent is removed is hidden, not lost.** vLLM's free queue is LRU by
      free time, so a block can be removed while blocks chained to it stay stored. A prefix
      lookup stops at the first missing hash, so those descendants can no longer be hit:
      they leave the drawing (an EvictEvent each, leaves first), stay known (with their
      copies), and are drawn again, under new node ids, when the parent hash is stored again.
      A removal of a hidden block only forgets it. The drawing is therefore exactly the set
      of stored blocks that a prefix lookup can reach.
    - **A parent the view never saw** (a subscriber that joined late, or missed events)
      becomes a *placeholder*: a 0-token node under the root whose ``extra_key`` is that
      hash, holding the chains that hang from it. vLLM only stores a block while its parent
      is in the cache, so those chains are shown as reachable. The placeholder becomes a
      real node (its subtree redrawn) when its hash is stored, and leaves when vLLM removes
      that hash (its subtree is then hidden, as above) or when its last child is removed.
    - **AllBlocksCleared** and :meth:`restart` (the publisher restarted: its ``seq`` went
      back) empty the view with ``ResetEvent(source="radix_cache")``, the reset that clears
      a FrameBuilder's tree and ends its frame.
    - **Images.** vLLM puts the placeholder id (``image_token_id``) at every image position,
      so two images give sibling nodes with the same tokens and different hashes. Given
      ``image_token_id`` and ``vocab_size``, the placeholders of each image are drawn as the
      pad id :func:`minirad.kvcache.multimodal.pad_value` of its hash from ``extra_keys``
      (``>= vocab_size``), named ``"img 61906b"`` in :attr:`images`; without them the tokens
      stay as published and the fork shows only in the hashes.

    Ids, names and captions depend only on the event sequence, so a recording replays to
    the same frames. Limits: a late subscriber cannot count the copies stored before it
    joined, so it drops a block at its first removal. Assumes vLLM's default
    ``kv_cache_report_mode`` ("incremental"): the "full" mode re-sends reused blocks as
    BlockStored without a matching BlockRemoved. Hashes are ints (vLLM's
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, its default). One view follows one cache: with
    data parallelism, one view per ``data_parallel_rank``.

    Args:
        bus: where the minirad events go (a new bus if None).
        image_token_id: the model's image placeholder id (3 for the shipped tiny LLaVA).
        vocab_size: the text vocabulary size (1024 there); pad ids are at or above it.
        images: more ``{pad id: name}`` entries for :attr:`images` (e.g. our engine's pad
            ids, when the events come from :class:`RadixBlockEvents`).

    Raises:
        InvalidArgumentError: only one of ``image_token_id`` / ``vocab_size`` is given.
    """

    def __init__(
        self,
        bus: EventBus | None = None,
        *,
        image_token_id: int | None = None,
        vocab_size: int | None = None,
        images: Mapping[int, str] | None = None,
    ) -> None:
        if image_token_id is not None and vocab_size is None:
            raise InvalidArgumentError("image_token_id needs vocab_size (pad ids start there)")
        self.bus = bus if bus is not None else EventBus()
        self.image_token_id = image_token_id
        self.vocab_size = vocab_size
        # {pad id: name}; FrameBuilder needs this very dict (see frame_settings), since names
        # are added as images arrive.
        self.images: dict[int, str] = dict(images or {})
        self._blocks: dict[int, _Block] = {}
        self._children: dict[int, dict[int, None]] = {}  # parent hash -> child hashes, ordered
        self._next_id = 1

    # ------------------------------------------------------------------ input
    def apply(self, event: Any) -> None:
        """Take one vLLM event (:class:`~minirad.kv_events.BlockStored`, ``BlockRemoved`` or
        ``AllBlocksCleared``) and emit the minirad events it implies.

        Raises:
            KVEventError: an unknown event type, or a BlockStored whose ``token_ids`` are not
                ``len(block_hashes) * block_size``, whose ``extra_keys`` do not have one entry
                per block, or whose chain repeats a hash. Nothing changes then.
        """
        if isinstance(event, BlockStored):
            self._on_stored(event)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self._on_removed(h)
        elif isinstance(event, AllBlocksCleared):
            self._reset()
        else:
            raise KVEventError(f"not a vLLM KV event: {type(event).__name__}")

    def extend(self, events: Iterable[Any]) -> None:
        """:meth:`apply` each event in order (a ``KVEventBatch``'s ``events``). A bad event is
        skipped and the rest still apply.

        Raises:
            KVEventError: after the batch, if some events were skipped (the message names
                them); the view is consistent with the others.
        """
        errors = []
        for i, event in enumerate(events):
            try:
                self.apply(event)
            except KVEventError as e:
                errors.append(f"event {i}: {e}")
        if errors:
            raise KVEventError("skipped " + "; ".join(errors))

    def restart(self) -> None:
        """The publisher restarted (a subscriber saw ``seq`` go backwards): it starts with an
        empty cache, so the view empties too (a ResetEvent)."""
        self._reset()

    # ------------------------------------------------------------------ state
    def stored_blocks(self) -> dict[int, tuple[int | None, tuple[int, ...]]]:
        """``{block hash: (parent_block_hash, token_ids as published)}`` of every block the
        events say vLLM holds (hidden ones included, placeholders excluded)."""
        return {
            h: (b.parent, b.token_ids) for h, b in self._blocks.items() if b.token_ids is not None
        }

    def node_ids(self) -> dict[int, int]:
        """``{block hash: node id}`` of the drawn nodes (placeholders included)."""
        return {h: b.node_id for h, b in self._blocks.items() if b.node_id is not None}

    def frame_settings(self) -> dict[str, Any]:
        """The ``FrameBuilder`` arguments for this source: ``vocab_size`` and ``images``
        (this view's own dict). FrameBuilder copies ``images``, so a caller that builds one
        must also set ``builder.images = view.images``: the names of images seen later then
        reach the labels."""
        return {"vocab_size": self.vocab_size, "images": self.images}

    # ------------------------------------------------------------------ events
    def _emit_insert(self, b: _Block, path: tuple[int, ...], prefix_len: int) -> None:
        b.node_id = self._next_id
        self._next_id += 1
        parent = path[-1] if path else 0
        event = InsertEvent(
            self.bus.tick(), path, prefix_len, b.node_id, parent, b.key, (), _hex(b.block_hash)
        )
        self.bus.emit(event)

    def _reset(self) -> None:
        self._blocks.clear()
        self._children.clear()
        self._next_id = 1
        self.bus.emit(ResetEvent(self.bus.tick(), RESET_SOURCE))

    # ------------------------------------------------------------------ BlockStored
    def _on_stored(self, e: BlockStored) -> None:
        hashes, bs, tokens = list(e.block_hashes), e.block_size, e.token_ids
        if not isinstance(bs, int) or bs <= 0:
            raise KVEventError(f"BlockStored with block_size {bs!r}")
        if len(tokens) != len(hashes) * bs:
            raise KVEventError(
                f"BlockStored of {len(hashes)} blocks of {bs} tokens has {len(tokens)} token ids"
            )
        extra = e.extra_keys
        if extra is not None and len(extra) != len(hashes):
            raise KVEventError(f"BlockStored has {len(extra)} extra_keys for {len(hashes)} blocks")
        parent = e.parent_block_hash
        if len(set(hashes)) != len(hashes) or parent in hashes:
            raise KVEventError("BlockStored whose chain repeats a block hash")
        drew = False
        for i, h in enumerate(hashes):
            ids = tuple(tokens[i * bs : (i + 1) * bs])
            b = self._blocks.get(h)
            if b is not None and b.token_ids is not None:  # another copy of a known block
                b.copies += 1
            else:
                if b is not None:  # a placeholder: now we know its tokens and parent
                    self._undraw(h)
                if parent is not None and parent not in self._blocks:  # only for block 0
                    self._add_placeholder(parent)
                b = self._blocks[h] = _Block(h, parent, ids, self._draw_key(ids, extra, i), 1)
                if parent is not None:
                    self._children.setdefault(parent, {})[h] = None
                if self._reachable(b):
                    self._draw(h)
                    drew = True
            parent = h
        last = self._blocks[hashes[-1]] if hashes else None
        if not drew and last is not None and last.node_id is not None:
            path, prefix = self._path_to(last)
            path += (last.node_id,)
            prefix += len(last.key)
            self.bus.emit(InsertEvent(self.bus.tick(), path, prefix, None, None))

    def _add_placeholder(self, h: int) -> None:
        self._blocks[h] = _Block(h, None, None, ())
        self._draw(h)

    def _draw_key(self, ids: tuple[int, ...], extra: Sequence | None, i: int) -> tuple[int, ...]:
        """The block's tokens with each image's placeholders as its pad id."""
        keys = extra[i] if extra is not None else None
        if self.image_token_id is None or not isinstance(keys, list | tuple):
            return ids
        key = list(ids)
        for item in keys:
            # An image is (mm identifier, offset of its start from the block's start); the
            # other extra keys (a LoRA name, a cache salt) are plain values.
            if not (isinstance(item, list | tuple) and len(item) == 2):
                continue
            ident, offset = item
            if not isinstance(ident, str) or not isinstance(offset, int):
                continue
            pad = self._image_pad(ident)
            j = max(offset, 0)
            while j < len(key) and key[j] == self.image_token_id:
                key[j] = pad
                j += 1
        return tuple(key)

    def _image_pad(self, ident: str) -> int:
        digest = ident
        if not ident or not set(ident) <= _HEX_DIGITS:  # a user-given uuid, not a hash
            digest = hashlib.sha256(ident.encode()).hexdigest()
        pad = pad_value(digest, self.vocab_size)
        self.images.setdefault(pad, f"img {ident[:6]}")
        return pad

    # ------------------------------------------------------------------ BlockRemoved
    def _on_removed(self, h: int) -> None:
        b = self._blocks.get(h)
        if b is None:  # stored before this view joined, or already hidden and forgotten
            return
        if b.token_ids is not None:
            b.copies -= 1
            if b.copies > 0:
                return
        self._undraw(h)
        del self._blocks[h]
        if b.parent is None:
            return
        siblings = self._children[b.parent]
        del siblings[h]
        if not siblings:
            del self._children[b.parent]
            p = self._blocks.get(b.parent)
            if p is not None and p.token_ids is None:  # a placeholder holding nothing now
                self._undraw(b.parent)
                del self._blocks[b.parent]

    # ------------------------------------------------------------------ the drawing
    def _reachable(self, b: _Block) -> bool:
        if b.token_ids is None or b.parent is None:
            return True
        p = self._blocks.get(b.parent)
        return p is not None and p.node_id is not None

    def _path_to(self, b: _Block) -> tuple[tuple[int, ...], int]:
        """Node ids above a drawn block (root excluded) and their tokens."""
        ids, tokens = [], 0
        while b.token_ids is not None and b.parent is not None:
            b = self._blocks[b.parent]
            ids.append(b.node_id)
            tokens += len(b.key)
        return tuple(reversed(ids)), tokens

    def _hidden_children(self, h: int) -> list[int]:
        return [c for c in self._children.get(h, ()) if self._blocks[c].node_id is None]

    def _draw(self, h: int) -> None:
        """Draw block ``h`` (reachable, not drawn) and its hidden subtree, parents first."""
        path, prefix = self._path_to(self._blocks[h])
        stack = [(h, path, prefix)]
        while stack:
            h, path, prefix = stack.pop()
            b = self._blocks[h]
            if b.node_id is not None:  # garbage hashes can chain in a cycle
                continue
            self._emit_insert(b, path, prefix)
            below = (path + (b.node_id,), prefix + len(b.key))
            stack.extend((c, *below) for c in reversed(self._hidden_children(h)))

    def _undraw(self, h: int) -> None:
        """Take block ``h`` and its drawn subtree out of the drawing, leaves first."""
        if self._blocks[h].node_id is None:
            return
        order, stack = [], [h]
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(
                c for c in self._children.get(x, ()) if self._blocks[c].node_id is not None
            )
        for x in reversed(order):  # a reversed pre-order puts every child before its parent
            b = self._blocks[x]
            self.bus.emit(EvictEvent(self.bus.tick(), b.node_id, len(b.key)))
            b.node_id = None


# ====================================================================== blocks -> radix nodes
@dataclass(slots=True, eq=False)
class _Chain:
    """Blocks drawn as one node: each block the only child of the one before it."""

    parent: int  # the parent chain's id (0: the root)
    blocks: list[int]  # BlockHashTree node ids, in order
    keys: list[tuple[int, ...]]  # their tokens (as drawn)
    children: list[int] = field(default_factory=list)
    cut: int = 0  # blocks removed from its end whose removal is not drawn yet


class BlockChains:
    """A block tree drawn as a radix tree: the events of a :class:`BlockHashTree` (one node per
    block) re-published on :attr:`bus` with each run of blocks stored together as one node.

    SGLang publishes its radix tree page by page: at ``--page-size 1`` every token is a block,
    so :class:`BlockHashTree` alone draws a prompt as a column of one-token nodes. Here the
    blocks of one BlockStored (SGLang sends one per radix node it caches, chained ones merged)
    become one node, as SGLang's own tree holds them, and the tree changes as a radix tree
    does, in the minirad events a ``FrameBuilder`` draws:

    - a block stored under a block inside a node splits that node there
      (:class:`~minirad.events.SplitEvent`), then comes in as a new node; blocks that come
      in one after another, each under the one before, join that new node until
      :meth:`flush` (the end of a batch) or another kind of change;
    - removed blocks leave from a node's end (a removal takes leaves first): the whole node
      is evicted when its first block goes; if only its tail goes, the node is split there at
      :meth:`flush` and the tail evicted;
    - an access (a BlockStored of blocks already drawn) marks the path to the node of the
      last block; a reset resets.

    Node ids count from 1 in drawing order (from 1 again after a reset) and ``extra_key`` is
    None (a block's hash names one block, not a node). A 0-token placeholder (a parent hash
    the view never saw) stays a node of its own.

    Args:
        source: the block tree's bus (``BlockHashTree.bus``).
        bus: where the radix events go (a new bus if None).
    """

    def __init__(self, source: EventBus, bus: EventBus | None = None) -> None:
        self.bus = bus if bus is not None else EventBus()
        self._clear()
        self._unsubscribe: Callable[[], None] | None = source.subscribe(self._on_event)

    def _clear(self) -> None:
        self._chains: dict[int, _Chain] = {0: _Chain(0, [], [])}
        self._owner: dict[int, int] = {}  # block node id -> chain id
        self._next_id = 1
        self._open: int | None = None  # a chain not drawn yet: the next block may join it

    def close(self) -> None:
        """Flush, then stop listening to the source."""
        self.flush()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def node_ids(self) -> dict[int, int]:
        """``{block node id (BlockHashTree's): node id here}`` for the blocks drawn."""
        return dict(self._owner)

    def flush(self) -> None:
        """Draw what waits: the node being built, and the tails removed from nodes."""
        self._draw_open()
        for cid in [c for c, ch in self._chains.items() if ch.cut]:
            ch = self._chains[cid]
            live = len(ch.blocks) - ch.cut
            tail = self._new_id()
            self.bus.emit(SplitEvent(self.bus.tick(), cid, tail, _size(ch.keys[:live])))
            self.bus.emit(EvictEvent(self.bus.tick(), tail, _size(ch.keys[live:])))
            del ch.blocks[live:], ch.keys[live:]
            ch.cut = 0

    # ------------------------------------------------------------------ the block events
    def _on_event(self, e: Event) -> None:
        if isinstance(e, InsertEvent):
            if e.node_id is None:
                self._on_access(e)
            else:
                self._on_insert(e)
        elif isinstance(e, EvictEvent):
            self._on_evict(e)
        elif isinstance(e, ResetEvent) and e.source == RESET_SOURCE:
            self._clear()
            self.bus.emit(ResetEvent(self.bus.tick(), RESET_SOURCE))

    def _on_insert(self, e: InsertEvent) -> None:
        block, parent, key = e.node_id, e.parent_id or 0, tuple(e.key)
        if self._open is not None:
            ch = self._chains[self._open]
            if parent == ch.blocks[-1] and key and ch.keys[-1]:  # the next block of the run
                ch.blocks.append(block)
                ch.keys.append(key)
                self._owner[block] = self._open
                return
        self.flush()
        pc = self._owner[parent] if parent else 0
        if pc:
            self._split_after(pc, parent)
        cid = self._new_id()
        self._chains[cid] = _Chain(pc, [block], [key])
        self._chains[pc].children.append(cid)
        self._owner[block] = cid
        self._open = cid

    def _on_access(self, e: InsertEvent) -> None:
        self.flush()
        if not e.path:
            return
        cid = self._owner[e.path[-1]]
        path, _ = self._above(cid)
        self.bus.emit(InsertEvent(self.bus.tick(), (*path, cid), e.prefix_len, None, None))

    def _on_evict(self, e: EvictEvent) -> None:
        cid = self._owner.pop(e.node_id)
        if cid == self._open:
            self._draw_open()
        ch = self._chains[cid]
        live = len(ch.blocks) - ch.cut
        if ch.blocks[live - 1] != e.node_id:
            raise KVEventError(f"block node {e.node_id} left from the middle of node {cid}")
        ch.cut += 1
        if ch.cut == len(ch.blocks):  # its first block went: the whole node goes now
            self.bus.emit(EvictEvent(self.bus.tick(), cid, _size(ch.keys)))
            self._chains[ch.parent].children.remove(cid)
            del self._chains[cid]

    # ------------------------------------------------------------------ the drawing
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _above(self, cid: int) -> tuple[tuple[int, ...], int]:
        """The chain ids above ``cid`` (root excluded) and their tokens."""
        ids, tokens = [], 0
        while (cid := self._chains[cid].parent) != 0:
            ids.append(cid)
            tokens += _size(self._chains[cid].keys)
        return tuple(reversed(ids)), tokens

    def _draw_open(self) -> None:
        if self._open is None:
            return
        cid, self._open = self._open, None
        ch = self._chains[cid]
        path, prefix = self._above(cid)
        key = tuple(t for k in ch.keys for t in k)
        self.bus.emit(InsertEvent(self.bus.tick(), path, prefix, cid, ch.parent, key, (), None))

    def _split_after(self, cid: int, block: int) -> None:
        """Make ``block`` the last of its node: the blocks after it become a node of their
        own (with the children)."""
        ch = self._chains[cid]
        i = ch.blocks.index(block) + 1
        if i == len(ch.blocks):
            return
        tail = self._new_id()
        self._chains[tail] = _Chain(cid, ch.blocks[i:], ch.keys[i:], ch.children)
        for c in ch.children:
            self._chains[c].parent = tail
        for b in ch.blocks[i:]:
            self._owner[b] = tail
        self.bus.emit(SplitEvent(self.bus.tick(), cid, tail, _size(ch.keys[:i])))
        del ch.blocks[i:], ch.keys[i:]
        ch.children = [tail]


def _size(keys: Sequence[tuple[int, ...]]) -> int:
    return sum(len(k) for k in keys)


# ====================================================================== minirad -> vLLM
class RadixBlockEvents:
    """Our radix tree's cached paths as vLLM KV events: the minirad side of
    ``EngineConfig(kv_events_endpoint=...)``.

    Subscribes to ``bus`` and rebuilds the tree from its events
    (:class:`~minirad.kv_events.event_tree.EventTree`). Every root-to-node path is cut into full
    ``block_size``-token blocks from its first token; each such block is published once, as
    vLLM's BlockPool would cache it:

    - a new leaf -> one :class:`~minirad.kv_events.BlockStored` with the blocks that end in
      it (none if its tokens complete no block: at page size 1 a leaf is any number of
      tokens, and only whole blocks are published). ``block_hashes`` are
      :func:`~minirad.kvcache.block_pool.hash_block_tokens` chained from
      ``none_hash(hash_seed)``, with the namespace ``extra_key`` of the insert in the first
      block's extra keys (:func:`~minirad.kvcache.multimodal.block_extra_keys`), masked to 64 bits
      (:func:`block_hash_u64`); ``parent_block_hash`` is the previous block's (None for
      the first block); ``token_ids`` and ``extra_keys`` are what vLLM publishes: given
      ``image_token_id`` and ``vocab_size``, each image pad id of the key (``>= vocab_size``)
      goes back to the placeholder id, and the image into the extra keys of every block it
      overlaps as ``(mm_hash, offset - block start)``, its hash read back from the pad id
      (:func:`~minirad.kvcache.multimodal.pad_value` keeps the whole digest);
      ``medium`` is ``"CPU"``, since our KV pool is CPU memory (vLLM's CPU backend says
      ``"GPU"``: its block pool always does).
    - a split -> nothing: the path, its blocks and their hashes are unchanged.
    - an evicted leaf -> one :class:`~minirad.kv_events.BlockRemoved` with every block that
      lost a token (those that end in the leaf), last block first.
    - a ``radix_cache`` reset -> :class:`~minirad.kv_events.AllBlocksCleared`.

    Events wait in :attr:`pending` and go to ``sink`` as one list (a ``KVEventBatch``'s
    events) at the end of every engine step (:class:`~minirad.events.StepEvent`), on a reset,
    and on :meth:`flush`: one batch per step, as vLLM publishes. Without a sink, collect
    them with :meth:`take_events`. Attach before the first insert: blocks cached earlier
    are unknown to it.

    Args:
        bus: the radix tree's bus (``engine.bus``, ``cache.bus``).
        sink: called with each batch, e.g. ``KVEventPublisher.publish``; None: keep them.
        block_size: tokens per published block (vLLM's ``block_size``; 32 on its CPU
            backend, :data:`~minirad.peers.vllm_env.VLLM_BLOCK_SIZE`).
        hash_seed: seeds the hash chain (:func:`~minirad.kvcache.block_pool.none_hash`).
        medium: the ``medium`` of the device tier's events.
        host_medium: the ``medium`` of the host tier's (a HiRadixCache's backups, host
            evictions and prefetches; its disk backups say ``"STORAGE"``). With tiers, give
            the device ``"GPU"``, as vLLM's offloading does, so that the two differ.
        image_token_id: the model's image placeholder id, with ``vocab_size``. Without them
            the key's ids go out as they are, pad ids included: fine in-process, but a pad id
            has more than 64 bits and msgpack, so the ZMQ wire, carries 64.

    Raises:
        InvalidArgumentError: ``block_size`` is not a positive int; only one of
            ``image_token_id`` / ``vocab_size`` is given.
    """

    def __init__(
        self,
        bus: EventBus,
        sink: Callable[[list], object] | None = None,
        *,
        block_size: int = VLLM_BLOCK_SIZE,
        hash_seed: int | str = 0,
        medium: str = "CPU",
        host_medium: str = "CPU",
        image_token_id: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
        if (image_token_id is None) != (vocab_size is None):
            raise InvalidArgumentError("give both image_token_id and vocab_size, or neither")
        self.image_token_id, self.vocab_size = image_token_id, vocab_size
        self.sink = sink
        self.block_size = block_size
        self.medium, self.host_medium = medium, host_medium
        self.pending: list = []
        self._root_hash = none_hash(hash_seed)
        self._clear()
        self._unsubscribe: Callable[[], None] | None = bus.subscribe(self._on_event)

    def _clear(self) -> None:
        self.tree = EventTree()
        # Per tree node: the path's length at its end, the digest of the last full block
        # ending at or above its end (the parent hash of the next block), and the blocks
        # that end inside its edge as (end position, digest).
        self._end: dict[int, int] = {0: 0}
        self._chain: dict[int, bytes] = {0: self._root_hash}
        self._owned: dict[int, list[tuple[int, bytes]]] = {0: []}

    def take_events(self) -> list:
        """The pending events, oldest first; :attr:`pending` is empty afterwards."""
        events, self.pending = self.pending, []
        return events

    def flush(self) -> None:
        """Send the pending events to ``sink`` as one batch (nothing if none is pending)."""
        if self.pending and self.sink is not None:
            self.sink(self.take_events())

    def close(self) -> None:
        """Flush, then stop listening to the bus."""
        self.flush()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    # ------------------------------------------------------------------ the tree's events
    def _on_event(self, e: Event) -> None:
        if isinstance(e, InsertEvent):
            if e.node_id is not None:
                self.tree.apply(e)
                self._on_insert(e)
        elif isinstance(e, SplitEvent):
            self.tree.apply(e)
            self._on_split(e)
        elif isinstance(e, EvictEvent | HostEvictEvent):
            self.tree.apply(e)
            self.tree.release()  # evicted nodes are kept for drawing; we never draw them
            host = isinstance(e, HostEvictEvent)
            self._on_evict(e.node_id, self.host_medium if host else self.medium)
        elif isinstance(e, BackupEvent):
            self.tree.apply(e)
            medium = self.host_medium if e.medium == "CPU" else e.medium
            for node in e.node_ids:
                self._store(node, medium)
        elif isinstance(e, DemoteEvent):
            self.tree.apply(e)
            self._remove(e.node_id, self.medium)
        elif isinstance(e, LoadBackEvent):
            self.tree.apply(e)
            for node in e.node_ids:
                self._store(node, self.medium)
        elif isinstance(e, PrefetchEvent):
            self.tree.apply(e)
            self._add(e.node_id, e.parent_id, len(e.key), self.host_medium)
        elif isinstance(e, ResetEvent) and e.source == RESET_SOURCE:
            self._clear()
            self.pending.append(AllBlocksCleared())
            self.flush()
        elif isinstance(e, StepEvent):
            self.flush()

    def _on_insert(self, e: InsertEvent) -> None:
        self._add(e.node_id, e.parent_id, len(e.key), self.medium)

    def _add(self, node: int, parent: int, length: int, medium: str) -> None:
        """A new node of ``length`` tokens under ``parent``: its blocks, stored in ``medium``."""
        self._end[node] = self._end[parent] + length
        self._owned[node] = owned = self._blocks(node)[0]
        self._chain[node] = owned[-1][1] if owned else self._chain[parent]
        self._store(node, medium)

    def _blocks(self, node: int) -> tuple[list[tuple[int, bytes]], list[int], list]:
        """The blocks that end inside ``node``'s edge: (end position, digest) pairs, vLLM's
        token ids for them, and their extra keys (None where a block has none)."""
        bs, v = self.block_size, self.tree.nodes[node]
        end = self._end[node]
        start = end - len(v.key)
        first, stop = start // bs, end // bs  # blocks first .. stop-1 end inside this edge
        if stop <= first:
            return [], [], []
        # Plain ints: a numpy scalar in a key pickles, so hashes, differently (tokens.py).
        tokens = [int(t) for t in self._tail(v.parent, start - first * bs) + list(v.key)]
        tokens, images = self._unpad(tokens[: (stop - first) * bs], first * bs, v.parent)
        digest, owned, extra_keys = self._chain[v.parent], [], []
        for j in range(first, stop):
            extra = block_extra_keys(j * bs, (j + 1) * bs, images, v.extra_key)
            block = tokens[(j - first) * bs : (j - first + 1) * bs]
            digest = hash_block_tokens(digest, block, extra)
            owned.append(((j + 1) * bs, digest))
            extra_keys.append(list(extra) if extra else None)
        return owned, tokens, extra_keys

    def _store(self, node: int, medium: str) -> None:
        """Publish the blocks that end in ``node`` as stored in ``medium``."""
        owned, tokens, extra_keys = self._blocks(node)
        if not owned:
            return
        v = self.tree.nodes[node]
        first = (self._end[node] - len(v.key)) // self.block_size
        self.pending.append(
            BlockStored(
                block_hashes=[block_hash_u64(d) for _, d in owned],
                parent_block_hash=None if first == 0 else block_hash_u64(self._chain[v.parent]),
                token_ids=tokens,
                block_size=self.block_size,
                medium=medium,
                extra_keys=extra_keys if any(extra_keys) else None,
            )
        )

    def _remove(self, node: int, medium: str) -> None:
        """Publish the blocks that end in ``node`` as removed from ``medium``, last first."""
        if owned := self._owned[node]:
            hashes = [block_hash_u64(d) for _, d in reversed(owned)]
            self.pending.append(BlockRemoved(block_hashes=hashes, medium=medium))

    def _unpad(
        self, ids: list[int], start: int, parent: int
    ) -> tuple[list[int], list[MultiModalItem]]:
        """vLLM's tokens and images for the path's tokens ``ids`` from position ``start``
        (the path above them ends at ``parent``): each run of one pad id becomes placeholders
        and a :class:`~minirad.kvcache.multimodal.MultiModalItem` at its offset in the path (a run
        at ``start`` may have begun above it, so its start is looked up there)."""
        if self.vocab_size is None:
            return ids, []
        tokens, images, i = list(ids), [], 0
        for pad, run in itertools.groupby(ids):
            n = len(list(run))
            if pad >= self.vocab_size:
                offset = start + i
                if i == 0:  # the image may have begun in an earlier block
                    above = self._tail(parent, self._end[parent])  # the whole path
                    while offset > 0 and above[offset - 1] == pad:
                        offset -= 1
                images.append(
                    MultiModalItem(offset, start + i + n - offset, _pad_hash(pad, self.vocab_size))
                )
                tokens[i : i + n] = [self.image_token_id] * n
            i += n
        return tokens, images

    def _tail(self, node: int, n: int) -> list[int]:
        """The last ``n`` tokens of the path from the root to ``node``."""
        parts: list[Sequence[int]] = []
        while n > 0:
            v = self.tree.nodes[node]
            part = v.key[max(len(v.key) - n, 0) :]
            parts.append(part)
            n -= len(part)
            node = v.parent
        return [t for part in reversed(parts) for t in part]

    def _on_split(self, e: SplitEvent) -> None:
        prefix, suffix = e.node_id, e.new_node_id
        self._end[suffix] = end = self._end[prefix]
        cut = end - len(self.tree.nodes[suffix].key)  # where the prefix now ends
        self._end[prefix] = cut
        owned = self._owned[prefix]
        self._owned[prefix] = [b for b in owned if b[0] <= cut]
        self._owned[suffix] = [b for b in owned if b[0] > cut]
        self._chain[suffix] = self._chain[prefix]
        kept = self._owned[prefix]
        self._chain[prefix] = kept[-1][1] if kept else self._chain[self.tree.nodes[prefix].parent]

    def _on_evict(self, leaf: int, medium: str) -> None:
        self._remove(leaf, medium)
        del self._owned[leaf], self._end[leaf], self._chain[leaf]
