"""ForwardBatch: what one model step computes, as flat tensors.

A scheduler picks, for each running sequence, the tokens to run this step: a whole prompt, a
chunk of one (chunked prefill), the part of a prompt after a cached prefix (radix / prefix
reuse), or the one token sampled last step (decode). All of them go into one flattened,
variable-length batch (SGLang's ``ForwardBatch`` in ``EXTEND``/``MIXED`` mode, vLLM v1's
``InputBatch`` + ``CommonAttentionMetadata``), so the model runs every linear layer once per
step for all sequences.

Per sequence the scheduler knows two lists:

- ``token_ids``: the new tokens of this step (``query_len`` of them);
- ``kv_slots``: the KV slot of every context token, the cached prefix followed by the new
  tokens (``seq_len`` of them; its tail of ``query_len`` slots is where the new K/V go).

With the radix cache the prefix slots are ``RadixCache.match_prefix(...).indices`` and the new
ones come from ``TokenToKVPoolAllocator.alloc`` (together: ``Req.kv_indices``, SGLang's
``req_to_token`` row); with vLLM's block pool, expand the block table with
:func:`minirad.kvcache.kv_pool.slot_mapping` (or
:func:`minirad.models.paged_attention.block_table_to_kv_slots`).

A hybrid model (Gemma 3: sliding-window layers beside full-attention ones) may keep its layers
in several *KV groups*, each with its own slot space: the sliding layers keep only a window of
recent tokens, so an engine gives them slots of their own that it can free as the window moves
on (vLLM's KV-cache groups, one block table per group in one block pool; SGLang's separate SWA
pool). A batch then carries one ``slot_mapping`` and one ``kv_slots`` per group, all
positional: entry ``j`` of a sequence's row is the slot of its token at position ``j`` in that
group's space (for a windowed group, entries before the window are never read and may hold
anything). Group 0 is the batch's own ``slot_mapping`` / ``kv_slots``; a model with one group
(every Llama) never sees the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from minirad.errors import ImageError, InvalidArgumentError

__all__ = ["ForwardBatch", "KVGroupSlots"]


@dataclass(frozen=True)
class KVGroupSlots:
    """The slots of one KV group in a batch (see the module docstring).

    Attributes:
        slot_mapping: ``[T]`` int64, where each new token's K/V go in this group's layers.
        kv_slots: ``[B, max_seq_len]`` int64, the group's slot of every context position per
            sequence, padded with slot 0.
    """

    slot_mapping: torch.Tensor
    kv_slots: torch.Tensor


@dataclass(frozen=True)
class ForwardBatch:
    """One step of ``B`` sequences with ``T`` new tokens in total.

    Attributes:
        input_ids: ``[T]`` int64, the new tokens, sequence after sequence. Image placeholders
            keep ``image_token_id`` here (not the radix cache's pad values).
        positions: ``[T]`` int64, each token's index in its sequence (its RoPE position).
        slot_mapping: ``[T]`` int64, the KV slot each token's K/V is written to (SGLang's
            ``out_cache_loc``).
        kv_slots: ``[B, max_seq_len]`` int64, the slot of every context token per sequence,
            padded with slot 0 (SGLang's ``req_to_token[req_pool_indices]``).
        seq_lens: ``[B]`` int64, context length after this step (cached + new tokens).
        query_lens: ``[B]`` int64, new tokens per sequence (SGLang's ``extend_seq_lens``).
        logits_indices: ``[num_logits]`` int64, rows of the ``T`` tokens whose next-token
            logits are computed (vLLM's ``logits_indices``): by default the last token of each
            sequence.
        max_query_len: ``max(query_lens)`` as a Python int.
        mm_features: optional ``[n, hidden]`` image features that replace the embeddings of
            the tokens at ``mm_token_indices`` (:meth:`minirad.models.PagedVLM.embed`).
        mm_token_indices: optional ``[n]`` int64, rows of the ``T`` tokens that take
            ``mm_features``, in order.
        extra_kv_groups: the slots of KV groups 1, 2, ... of a model that keeps its layers in
            several slot spaces (group 0's are ``slot_mapping`` and ``kv_slots``); empty for
            one group. :meth:`kv_group` reads any of them.
        bidirectional_spans: optional ``[T, 2]`` int64, per new token the positions
            ``lo .. hi - 1`` of its sequence it sees in every layer besides the causal ones,
            later positions included, ``(0, 0)`` for none: a Gemma 3 image token sees its whole
            image (:meth:`minirad.models.PagedVLM.forward` fills them). A span must lie within
            the step's new tokens of its sequence; prefill queries only (a decode's is itself).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    kv_slots: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor
    logits_indices: torch.Tensor
    max_query_len: int
    mm_features: torch.Tensor | None = None
    mm_token_indices: torch.Tensor | None = None
    extra_kv_groups: tuple[KVGroupSlots, ...] = ()
    bidirectional_spans: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_kv_groups(self) -> int:
        """How many KV groups (slot spaces) the batch carries slots for."""
        return 1 + len(self.extra_kv_groups)

    def kv_group(self, group: int) -> KVGroupSlots:
        """The slots of KV group ``group`` (0: the batch's own ``slot_mapping``, ``kv_slots``).

        Raises:
            InvalidArgumentError: the batch carries no such group.
        """
        if group == 0:
            return KVGroupSlots(self.slot_mapping, self.kv_slots)
        if not 0 < group < self.num_kv_groups:
            raise InvalidArgumentError(
                f"KV group {group} asked of a batch with {self.num_kv_groups} KV group(s)"
            )
        return self.extra_kv_groups[group - 1]

    @classmethod
    def build(
        cls,
        token_ids: Sequence[Sequence[int]],
        kv_slots: Sequence[Sequence[int]],
        *,
        mm_features: torch.Tensor | None = None,
        mm_token_indices: Sequence[int] | None = None,
        all_logits: bool = False,
        device: str | torch.device = "cpu",
        extra_kv_slots: Sequence[Sequence[Sequence[int]]] = (),
    ) -> ForwardBatch:
        """Build a batch from per-sequence Python lists.

        Args:
            token_ids: per sequence, the new tokens of this step (at least one).
            kv_slots: per sequence, the slots of all its context tokens, prefix then new
                (``len(kv_slots[b]) >= len(token_ids[b])``; the last ``len(token_ids[b])``
                slots receive the new K/V).
            mm_features: ``[n, hidden]`` image features for this step's placeholders, e.g.
                a chunk's rows from :func:`minirad.models.image_features_for_chunk`.
            mm_token_indices: the ``n`` rows of the flattened new tokens that take them, in
                order (row ``r`` of sequence ``b`` is ``sum(len(token_ids[:b])) + r``). Rows,
                not token values: a generated token equal to the placeholder id is text.
            all_logits: compute logits for every token (parity tests, scoring) instead of the
                last token of each sequence (sampling).
            device: where the tensors go.
            extra_kv_slots: per further KV group (groups 1, 2, ...), per sequence, the slot
                of every context position in that group's space, as ``kv_slots`` holds
                group 0's: the same lengths, and the last ``len(token_ids[b])`` receive the
                new K/V. A windowed group's entries before the window may be anything.

        Raises:
            InvalidArgumentError: the lists disagree in length, a sequence has no new token,
                or its context is shorter than its new tokens; only one of ``mm_features``
                and ``mm_token_indices``, or an index outside the batch; a group's rows
                differ in number or length from ``kv_slots``.
            ImageError: the feature rows and the indices differ in number.
        """
        _check_inputs(token_ids, kv_slots, mm_features, mm_token_indices)
        _check_groups(kv_slots, extra_kv_slots)
        query_lens = [len(t) for t in token_ids]
        seq_lens = [len(s) for s in kv_slots]
        ids, positions, slots, logits_indices = [], [], [], []
        for b, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
            ids.extend(token_ids[b])
            positions.extend(range(s - q, s))
            slots.extend(kv_slots[b][s - q :])
            end = len(ids)
            logits_indices.extend(range(end - q, end) if all_logits else (end - 1,))

        def t(x: Sequence[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        def group(rows: Sequence[Sequence[int]]) -> KVGroupSlots:
            new = [s for row, q in zip(rows, query_lens, strict=True) for s in row[len(row) - q :]]
            return KVGroupSlots(t(new), _padded(rows, max(seq_lens)).to(device))

        return cls(
            input_ids=t(ids),
            positions=t(positions),
            slot_mapping=t(slots),
            kv_slots=_padded(kv_slots, max(seq_lens)).to(device),
            seq_lens=t(seq_lens),
            query_lens=t(query_lens),
            logits_indices=t(logits_indices),
            max_query_len=max(query_lens),
            mm_features=None if mm_features is None else mm_features.to(device),
            mm_token_indices=None if mm_token_indices is None else t(mm_token_indices),
            extra_kv_groups=tuple(group(rows) for rows in extra_kv_slots),
        )


def _check_inputs(
    token_ids: Sequence[Sequence[int]],
    kv_slots: Sequence[Sequence[int]],
    mm_features: torch.Tensor | None,
    mm_token_indices: Sequence[int] | None,
) -> None:
    """:meth:`ForwardBatch.build`'s argument checks (its Raises section)."""
    B = len(token_ids)
    if B == 0 or len(kv_slots) != B:
        raise InvalidArgumentError(
            f"need one kv_slots row per sequence and at least one sequence, "
            f"got {B} token lists and {len(kv_slots)} kv_slots rows"
        )
    if (mm_features is None) != (mm_token_indices is None):
        raise InvalidArgumentError("give mm_features and mm_token_indices together")
    for b, (tokens, slots) in enumerate(zip(token_ids, kv_slots, strict=True)):
        q, s = len(tokens), len(slots)
        if not 1 <= q <= s:
            raise InvalidArgumentError(
                f"sequence {b}: {q} new tokens with {s} context slots (need 1 <= new <= ctx)"
            )
    if mm_features is not None:
        if len(mm_token_indices) != mm_features.shape[0]:
            raise ImageError(
                f"{len(mm_token_indices)} image rows but {mm_features.shape[0]} feature rows"
            )
        num_tokens = sum(len(t) for t in token_ids)
        if not all(0 <= r < num_tokens for r in mm_token_indices):
            raise InvalidArgumentError(f"mm_token_indices must be in 0..{num_tokens - 1}")


def _check_groups(
    kv_slots: Sequence[Sequence[int]], extra_kv_slots: Sequence[Sequence[Sequence[int]]]
) -> None:
    """Each further group has a row per sequence, as long as its ``kv_slots`` row."""
    lens = [len(row) for row in kv_slots]
    for g, rows in enumerate(extra_kv_slots, start=1):
        if [len(row) for row in rows] != lens:
            raise InvalidArgumentError(
                f"KV group {g}: rows of lengths {[len(row) for row in rows]}, but the "
                f"sequences' contexts are {lens} long (one slot per position in every group)"
            )


def _padded(kv_slots: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    """``[B, width]`` int64 rows padded with slot 0, filled row by row into a zeroed array:
    per-step Python work, cheaper than ``torch.tensor`` on padded lists (an engine can keep
    the rows in a tensor, SGLang's ``ReqToTokenPool``, and index it instead)."""
    padded = np.zeros((len(kv_slots), width), dtype=np.int64)
    for b, row in enumerate(kv_slots):
        padded[b, : len(row)] = row
    return torch.from_numpy(padded)
