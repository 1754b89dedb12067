"""A request's life in the radix cache: :class:`Req` and the ``*_req`` methods.

SGLang's scheduler drives the tree through three calls per request, which
:class:`RadixRequestsMixin` provides as SGLang names them:

1. :meth:`~RadixRequestsMixin.match_prefix_for_req` when the request is admitted (or resumed):
   match its tokens, all but the last, and lock the matched prefix;
2. :meth:`~RadixRequestsMixin.cache_unfinished_req` after a chunk of chunked prefill: insert
   what it has computed, free its slots that duplicate the tree's, and move its lock down;
3. :meth:`~RadixRequestsMixin.cache_finished_req` when it finishes: insert, free the
   duplicates and the unaligned tail, release the lock.

The tree owns exactly one copy of each cached prefix; a request owns its slots past
``cache_protected_len`` until an insert hands them to the tree.

Component seams (SGLang 0.5.23's ``UnifiedRadixCache``): the match goes through the tree's
``_match`` (where a component validator cuts it) and the inserts through
:meth:`~RadixRequestsMixin._insert_req`, where SGLang inserts only up to the SWA branching
point and makes tombstones of the tokens whose SWA slots the request already freed (out of the
window); the lock is taken and released in :meth:`~RadixRequestsMixin._hold`, where a request
will hold its SWA window lock too; the slots a request gives back go through
:meth:`~RadixRequestsMixin._free`, one pool per component.
"""

from __future__ import annotations

import numbers
from array import array
from dataclasses import dataclass, field

import numpy as np

from minirad.errors import InvalidArgumentError, InvalidKeyError, LockError
from minirad.kvcache.radix_node import TreeNode
from minirad.kvcache.radix_slots import _as_slots
from minirad.kvcache.radix_tree import _check_extra_key, _check_priority
from minirad.kvcache.tokens import checked_token_ids

__all__ = ["RadixRequestsMixin", "Req"]


@dataclass(eq=False)
class Req:
    """The request state the lifecycle helpers need (a subset of SGLang's ``Req``).

    The engine's :class:`minirad.engine.Request` extends it (one object per request, as
    nano-vllm's ``Sequence``). Compared by identity.

    Attributes:
        rid: request id.
        origin_input_ids: prompt token ids (image placeholders already replaced by pad ids).
        output_ids: generated token ids so far.
        extra_key: cache namespace of the request.
        kv_indices: KV slots of every token that has KV, in order (SGLang's
            ``req_to_token`` row). The last sampled token has no KV yet and has no slot here.
        prefix_indices: the slots that came from the tree at the last match or insert.
        last_node: the locked node that ends the request's cached prefix.
        cache_protected_len: how many leading ``kv_indices`` belong to the tree.
        priority: the request's priority (SGLang's ``Req.priority``, 0 when unset): its
            inserts raise the ``priority`` of the nodes they walk or create to at least this.
        cache_inserted_len: how many leading tokens this request has inserted into the tree
            (SGLang's ``cache_inserted_len``): its later inserts do not count them again in
            ``insert_count``.
        host_hit_length, storage_hit_length: of the matched tokens, those a hierarchical
            cache loaded back from its host tier, and from its disk tier (SGLang's names).
    """

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    extra_key: str | None = None
    kv_indices: list[int] = field(default_factory=list)
    prefix_indices: list[int] = field(default_factory=list)
    last_node: TreeNode | None = None
    cache_protected_len: int = 0
    priority: int = 0
    cache_inserted_len: int = 0
    host_hit_length: int = 0
    storage_hit_length: int = 0
    # What checked_fill_ids last checked, to check only what changed since.
    _checked: tuple | None = field(default=None, init=False, repr=False)

    @property
    def fill_ids(self) -> list[int]:
        """Prompt plus output tokens, as a new list of ints (arrays and tensors accepted: `+`
        on numpy arrays would add element-wise rather than concatenate).

        Raises:
            InvalidKeyError: a token id is not an int >= 0.
        """
        return list(self.checked_fill_ids()[0])

    def checked_fill_ids(self) -> tuple[list[int], array | None]:
        """:attr:`fill_ids` (do not modify it) and the same ids as an ``array("Q")`` (None if
        one needs 64 bits or more).

        Validated once per request (the engine asks for ``fill_ids`` ~10 times a request):
        lists are compared with copies of what was checked, and the ``output_ids`` that an
        engine appends to are checked only past that. Any other change (an edit in place, a
        pop, a new list) checks them again; arrays and tensors are checked every time.

        Raises:
            InvalidKeyError: a token id is not an int >= 0.
        """
        origin, out = self.origin_input_ids, self.output_ids
        lists = type(origin) is list and type(out) is list
        c = self._checked if lists else None  # (origin copy, output copy, ids, their array)
        # list == runs in C and short-cuts on identical ints: a fraction of a new check.
        if c is None or origin != c[0] or out[: len(c[1])] != c[1]:
            ids, buf = checked_token_ids(origin, "origin_input_ids", plain=True)
            c = (origin[:] if lists else None, [], ids, buf)
        seen = len(c[1])
        if seen < len(out):
            new, new_buf = checked_token_ids(out[seen:], "output_ids", plain=True)
            buf = c[3] + new_buf if c[3] is not None and new_buf is not None else None
            c = (c[0], out[:] if lists else None, c[2] + new, buf)
        self._checked = c if lists else None
        return c[2], c[3]


class RadixRequestsMixin:
    """The request lifecycle over the tree. A part of RadixCache: it uses the tree's
    attributes and methods (``radix_tree.py``) and its locks (``radix_locks.py``)."""

    def match_prefix_for_req(self, req: Req, max_prefix_len: int | None = None) -> list[int]:
        """Match a new (or resumed) request and lock its prefix.

        At most ``len(req.fill_ids) - 1`` tokens may match: the last token is always computed
        again so the model produces logits for it (SGLang ``_compute_max_prefix_len``, vLLM's
        last-token rule). Sets ``req.prefix_indices``, ``req.kv_indices`` (a copy),
        ``req.last_node`` (locked) and ``req.cache_protected_len``.

        Args:
            max_prefix_len: a tighter cap on the matched tokens (the scheduler's prefix
                strategies: 0 reuses nothing, the first image's offset only the text before it).

        Returns:
            the matched slots.

        Raises:
            LockError: the request already holds a lock.
            InvalidArgumentError: ``max_prefix_len`` is not an int >= 0 (or None).
        """
        if req.last_node is not None:
            raise LockError(f"request {req.rid} already holds a lock; finish it first")
        if max_prefix_len is not None and (
            type(max_prefix_len) is bool
            or not isinstance(max_prefix_len, numbers.Integral)
            or max_prefix_len < 0
        ):  # a negative cap would slice from the end and match nearly everything
            raise InvalidArgumentError(
                f"max_prefix_len must be an int >= 0 or None, got {max_prefix_len!r}"
            )
        _check_extra_key(req.extra_key)
        fill, buf = req.checked_fill_ids()
        cap = max(len(fill) - 1, 0)
        if max_prefix_len is not None:
            cap = min(cap, max_prefix_len)
        indices, node = self._match(self._aligned(fill[:cap]), buf, req.extra_key, hit=True)
        self._hold(req, node, indices, list(indices))
        req.cache_inserted_len = 0  # a new (or resumed: SGLang resets it) request
        return indices

    def _hold(self, req: Req, node: TreeNode | None, indices: list[int], kv: list[int]) -> None:
        """Move the request's lock to ``node`` (None: release it), the end of its tree prefix
        ``indices``; ``kv`` becomes its slots. Component seam: the SWA window lock moves too."""
        if node is not None:
            self.inc_lock_ref(node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.last_node, req.prefix_indices, req.kv_indices = node, indices, kv
        req.cache_protected_len = len(indices)

    def _check_req(self, req: Req) -> tuple[list[int], array | None, list[int], np.ndarray]:
        """The request's tokens that have KV (a list and its array, or None) and their slots
        (a list and an array), validated before the tree changes: the slots past the tree's
        prefix must be the request's, allocated."""
        if req.last_node is None:
            raise LockError(f"request {req.rid} holds no lock; call match_prefix_for_req first")
        _check_priority(req.priority, f"request {req.rid}'s priority")
        done = req.cache_inserted_len
        if type(done) is bool or not isinstance(done, int) or done < 0:
            raise InvalidArgumentError(
                f"request {req.rid}'s cache_inserted_len must be an int >= 0, got {done!r}"
            )
        fill, buf = req.checked_fill_ids()
        kv, slots = _as_slots(req.kv_indices, "kv_indices")
        if len(kv) > len(fill):
            raise InvalidKeyError(
                f"request {req.rid} has {len(kv)} KV slots for {len(fill)} tokens"
            )
        if self.token_to_kv_pool_allocator is not None:  # its own: allocated, not the tree's
            self.token_to_kv_pool_allocator.check_allocated(slots[req.cache_protected_len :])
        req.kv_indices = kv
        return fill[: len(kv)], buf, kv, slots

    def cache_unfinished_req(self, req: Req) -> None:
        """Insert what a running request has computed so far and move its lock down.

        After a chunk of chunked prefill (or to share a long decode), the request's computed
        tokens go into the tree. Slots it computed for tokens that another request inserted in
        the meantime are duplicates: they are freed and the request switches to the tree's
        slots (SGLang's dedupe contract: the tree owns exactly one copy of each prefix).
        The partial last page stays private to the request.
        """
        token_ids, buf, kv, slots = self._check_req(req)
        n = len(token_ids) - len(token_ids) % self.page_size
        prefix_len = self._insert_req(req, token_ids[:n], buf, kv, slots)
        self._free(kv[req.cache_protected_len : prefix_len])
        new_indices, new_node = self._match(token_ids[:n], buf, req.extra_key, hit=False)
        kv[: len(new_indices)] = new_indices
        self._hold(req, new_node, new_indices, kv)

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """Insert a finished request's tokens, free its duplicate and unaligned slots, and
        release its lock (SGLang's ``cache_finished_req``).

        Only tokens with KV are cached: ``req.kv_indices`` must not include the last sampled
        token (it was never fed back to the model).

        Args:
            is_insert: False frees the request's own slots instead of caching them (a request
                deferred or refused at admission, or a cache that reuses nothing).

        Raises:
            LockError: the request holds no lock.
            InvalidKeyError, UnknownBlockError: its slots are not its own (checked first).
        """
        token_ids, buf, kv, slots = self._check_req(req)
        n = prefix_len = req.cache_protected_len
        if is_insert:
            n = len(token_ids) - len(token_ids) % self.page_size
            prefix_len = self._insert_req(req, token_ids[:n], buf, kv, slots)
        self._free(kv[req.cache_protected_len : prefix_len] + kv[n:])
        self._hold(req, None, [], [])

    def _insert_req(self, req: Req, key: list[int], buf, kv: list[int], slots) -> int:
        """Insert a request's aligned computed tokens ``key`` (slots ``kv``, also as the array
        ``slots``) with its priority, counting it once per node (``cache_inserted_len``)."""
        prio, done = int(req.priority), req.cache_inserted_len
        prefix_len = self._insert(key, buf, kv, slots, req.extra_key, prio, done, allocated=True)
        req.cache_inserted_len = max(done, len(key))
        return prefix_len

    def _free(self, slots: list[int]) -> None:
        if self.token_to_kv_pool_allocator is not None and slots:
            self.token_to_kv_pool_allocator.free(slots)
