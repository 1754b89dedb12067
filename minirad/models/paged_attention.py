"""Paged attention: every sequence reads its keys and values through slot indices into one
shared KV pool, so its context can live in any scattered set of slots.

One decoder layer, one step of a batch of ``B`` sequences. The step brings ``T`` new tokens,
flattened sequence after sequence (``query_lens[b]`` of them for sequence ``b``: a prefill chunk,
or 1 for a decode). For each sequence, ``kv_slots[b, :seq_lens[b]]`` lists the slot of every
context token, the cached prefix first and this step's new tokens last (SGLang's
``req_to_token`` row; with pages of ``block_size`` tokens it is the block table expanded,
:func:`block_table_to_kv_slots`). The layer then

1. writes the new tokens' K/V into the pool at ``slot_mapping`` (vLLM's ``reshape_and_cache``,
   SGLang's ``set_kv_buffer`` at ``out_cache_loc``);
2. gathers each sequence's whole context through ``kv_slots`` into a padded
   ``[B, max_seq_len]`` batch;
3. runs ONE ``scaled_dot_product_attention`` call over the padded batch, with a mask that is
   causal (query ``i`` of sequence ``b`` sits at context index
   ``seq_lens[b] - query_lens[b] + i``) and hides the padding.

Step 3 is what a GPU kernel (FlashAttention's varlen path, vLLM's ``PagedAttention``,
FlashInfer) does without materialising the padded copy. On a CPU, one batched SDPA call
instead of a Python loop over sequences is what keeps a decode step cheap: per-op overhead, not
FLOPs, dominates at this size.

The index tensors (:class:`AttentionMetadata`) depend only on the batch and on the layer's
kind of attention (its sliding window, if any, and the KV group whose slots it reads), so they
are built once per forward for each kind and shared by every layer of that kind.

A decode batch whose sequences begin with the same slots (the radix tree hands every request
that shares a prefix the very same slots) attends to that prefix once for all of them
(:mod:`minirad.models.cascade_attention`): the prefix's K/V are gathered once instead of
once per sequence, and the two partial softmaxes are merged by their log-sum-exps, as
FlashInfer's cascade attention and Hydragen do on a GPU.

A sliding-window layer (Gemma 3's local layers; window ``W``, HF's count) lets the query at
position ``p`` see keys ``p - W + 1 .. p`` only. Its metadata (``sliding_window`` in
:meth:`AttentionMetadata.build` and :func:`split_batch`) gathers each sequence from the first
key its first new query sees, so a decode reads at most ``W`` keys however long the sequence,
and the slots of earlier positions are never read: an engine may free them, or point them at
a null block of garbage. Its padding reads the sequence's newest key (written this step), so it
never touches a slot that may have been dropped either.

The engine splits a step that mixes decodes and prefills in two such calls
(:func:`split_batch`, :func:`varlen_paged_attention`): one for its decodes, one for its prefills.
With one call, a step of one 77-token prompt and seven decodes would pad every decode to 77
query rows (a FlashAttention varlen kernel walks the ragged lengths instead). Long decodes are
cut further, into groups whose padded copy of K/V stays small enough to be read from the
cores' caches (:data:`ATTENTION_CHUNK_BYTES`): past that, a step slows by more than its size.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

from minirad.errors import InvalidArgumentError
from minirad.models.cascade_attention import SharedPrefix, cascade_decode

__all__ = [
    "ATTENTION_CHUNK_BYTES",
    "AttentionGroup",
    "AttentionMetadata",
    "block_table_to_kv_slots",
    "paged_attention",
    "reference_attention",
    "split_batch",
    "varlen_paged_attention",
]


@dataclass(frozen=True)
class AttentionMetadata:
    """Index tensors of one batch, shared by every layer of a forward pass.

    Attributes:
        slot_mapping: ``[T]`` int64, the slot each new token's K/V is written to.
        kv_slots: ``[B, max_seq_len]`` int64, the slot of every context token of each
            sequence; entries past ``seq_lens[b]`` are padding: any valid slot, read and masked
            out (its values must be finite, as in the zero-initialised pool: a masked weight
            of 0 times NaN is still NaN).
        mask: ``[B, 1, max_query_len, max_seq_len]`` bool, True where a query may attend.
        query_index: ``[B, max_query_len]`` int64, the token (row of ``q``) of each padded query
            row; None when every sequence has ``max_query_len`` new tokens (then ``q`` is a plain
            reshape, the common all-decode case).
        output_index: ``[T]`` int64, the padded output row of each token; None with
            ``query_index``.
        shared_prefix: for a decode batch, the prefix its sequences share
            (:meth:`~minirad.models.cascade_attention.SharedPrefix.find`), else None.
        sliding_window: the window ``W`` these tensors were built for, or None (full
            attention). With a window, ``kv_slots`` holds each sequence's window only (see
            :func:`_window`) and the mask hides keys older than ``W - 1`` positions.
    """

    slot_mapping: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor
    query_index: torch.Tensor | None
    output_index: torch.Tensor | None
    shared_prefix: SharedPrefix | None = None
    sliding_window: int | None = None

    @property
    def batch_size(self) -> int:
        return self.kv_slots.shape[0]

    @property
    def max_query_len(self) -> int:
        return self.mask.shape[2]

    @classmethod
    def build(
        cls,
        slot_mapping: torch.Tensor,
        kv_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        query_lens: torch.Tensor,
        max_query_len: int,
        kv_row_bytes: int | None = None,
        sliding_window: int | None = None,
        bidirectional_spans: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """Index tensors for a batch.

        Args:
            slot_mapping: ``[T]`` int64, ``T = query_lens.sum()``.
            kv_slots: ``[B, max_seq_len]`` int64 (see the module docstring).
            seq_lens: ``[B]`` int64, context tokens per sequence *including* this step's.
            query_lens: ``[B]`` int64, new tokens per sequence, each in ``1 .. seq_lens[b]``.
            max_query_len: ``max(query_lens)``, passed as an int so that no device sync is
                needed to size the padding.
            kv_row_bytes: bytes of one context token's K and V in one layer: with it, a
                decode batch whose sequences share a long enough prefix attends to it once
                (:meth:`~minirad.models.cascade_attention.SharedPrefix.find`); None: never.
            sliding_window: ``W`` for a sliding-window layer: query ``p`` sees keys
                ``p - W + 1 .. p``, and ``kv_slots`` entries of older positions are never read
                (any value will do); None: full attention. A window turns the cascade off:
                each decode reads at most ``W`` keys anyway, and sequences of different
                lengths see different parts of a shared prefix.
            bidirectional_spans: ``[T, 2]`` int64, per new token a span ``lo, hi`` of context
                positions it sees *besides* the causal ones, later positions included (Gemma
                3's image tokens see their whole image): ``(0, 0)`` for none. A span must lie
                inside the sequence's context of this step (``hi <= seq_lens[b]``); a window
                still hides keys older than ``W - 1`` positions. None: causal only.

        Raises:
            InvalidArgumentError: the shapes disagree, or the window is not a positive int.
                (Values are not checked here: that would cost a device sync per step;
                :class:`~minirad.models.ForwardBatch` checks them when it builds a batch from
                Python lists.)
        """
        B, S = kv_slots.shape
        T = slot_mapping.shape[0]
        if seq_lens.shape != (B,) or query_lens.shape != (B,):
            raise InvalidArgumentError(
                f"seq_lens {tuple(seq_lens.shape)} and query_lens {tuple(query_lens.shape)} "
                f"must both be [{B}] (one entry per row of kv_slots)"
            )
        if not B <= T <= B * max_query_len:
            raise InvalidArgumentError(
                f"{T} tokens cannot come from {B} sequences of 1..{max_query_len} new tokens"
            )
        if sliding_window is not None:
            if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
                raise InvalidArgumentError(f"sliding_window must be an int, got {sliding_window!r}")
            if sliding_window <= 0:
                raise InvalidArgumentError(f"sliding_window must be positive, got {sliding_window}")
        dev = kv_slots.device
        rows = torch.arange(max_query_len, device=dev)
        # Context index of each padded query row. The causal mask "key <= q_pos" also hides
        # the padding: a real query's q_pos is below seq_lens[b], and the padded keys sit at or
        # past it. A padding row (i >= query_lens[b]) keeps at least key 0, so SDPA returns no
        # NaN for it; its output is dropped.
        q_pos = (seq_lens - query_lens)[:, None] + rows[None, :]  # [B, Q]
        ragged = T != B * max_query_len
        spans = token = None
        if ragged or bidirectional_spans is not None:
            valid = rows[None, :] < query_lens[:, None]  # [B, Q]
            starts = torch.cumsum(query_lens, 0) - query_lens
            token = torch.where(valid, starts[:, None] + rows[None, :], 0)  # q row per query
        if bidirectional_spans is not None:  # [B, Q, 2]; padding rows see no span
            spans = torch.where(valid[:, :, None], bidirectional_spans[token], 0)
        if sliding_window is None:
            k_pos = torch.arange(S, device=dev)[None, None, :]
            mask = k_pos <= q_pos[:, :, None]  # [B, Q, S]
            if spans is not None:
                mask |= (k_pos >= spans[:, :, :1]) & (k_pos < spans[:, :, 1:])
        else:
            kv_slots, mask = _window(
                kv_slots, seq_lens, q_pos, max_query_len, sliding_window, spans
            )
        query_index = output_index = None
        if ragged:  # gather queries into padded rows and back
            query_index = token
            # Row-major order of the valid cells is token order (sequence after sequence).
            output_index = torch.arange(B * max_query_len, device=dev)[valid.flatten()]
        cascade = kv_row_bytes is not None and max_query_len == 1 and sliding_window is None
        shared = SharedPrefix.find(kv_slots, seq_lens, kv_row_bytes) if cascade else None
        return cls(
            slot_mapping,
            kv_slots,
            mask.unsqueeze(1),
            query_index,
            output_index,
            shared,
            sliding_window,
        )


def _window(
    kv_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    q_pos: torch.Tensor,
    max_query_len: int,
    window: int,
    spans: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The part of each ``kv_slots`` row a sliding-window layer reads, and its mask.

    Sequence ``b``'s first new query sits at ``seq_lens[b] - query_lens[b]`` and sees keys from
    ``first = max(0, that - W + 1)`` on; later queries see later keys, so the gather starts at
    ``first`` and ends at the newest key: ``min(seq_len, query_len + W - 1)`` keys, at most
    ``W`` for a decode. Rows are padded to ``min(S, max_query_len + W - 1)`` with the slot of
    the sequence's newest key (written this step, so finite), never with an older slot.

    Args:
        kv_slots: ``[B, S]``, the full rows (entries before ``first`` are not read).
        seq_lens: ``[B]``.
        q_pos: ``[B, Q]``, the position of each padded query row (padding rows run past the
            sequence's end).
        max_query_len: ``Q``.
        window: ``W``.
        spans: ``[B, Q, 2]``, keys each query sees besides the causal ones (HF's Gemma 3
            images: ``window AND (causal OR same image)``), inside the gathered range; or None.

    Returns:
        ``[B, width]`` slots and the ``[B, Q, width]`` mask: key position ``k`` is visible to
        query position ``p`` iff ``p - W < k <= p``. A padding query row is masked as the
        sequence's last query, so it keeps at least one key (SDPA gives no NaN for it).
    """
    B, S = kv_slots.shape
    width = min(S, max_query_len + window - 1)
    last = (seq_lens - 1)[:, None]  # [B, 1], the newest key's position
    first = (q_pos[:, :1] - (window - 1)).clamp(min=0)  # [B, 1]
    k_pos = first + torch.arange(width, device=kv_slots.device)[None, :]  # [B, width]
    real = k_pos <= last
    slots = kv_slots.gather(1, torch.where(real, k_pos, last))
    q = torch.minimum(q_pos, last)[:, :, None]  # [B, Q, 1]
    k = k_pos[:, None, :]  # [B, 1, width]
    seen = k <= q  # k <= q <= last: padding keys are hidden too
    if spans is not None:  # a span ends by the newest key: never a padding key
        seen = seen | ((k >= spans[:, :, :1]) & (k < spans[:, :, 1:]))
    return slots, seen & (k > q - window)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store this step's K/V in the pool, then attend over each sequence's paged context.

    Args:
        q: ``[T, num_heads, head_dim]`` queries of the new tokens (RoPE applied).
        k, v: ``[T, num_kv_heads, head_dim]`` keys (RoPE applied) and values of the new tokens.
        k_cache, v_cache: ``[num_slots, num_kv_heads, head_dim]``, one layer's flat slot view
            of the pool (:meth:`minirad.kvcache.kv_pool.KVCache.layer`); written in place.
        metadata: the batch's :class:`AttentionMetadata`.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``[T, num_heads, head_dim]`` attention output, one row per new token.

    Grouped-query attention (``num_heads`` a multiple of ``num_kv_heads``) is handled by SDPA's
    ``enable_gqa``, which shares each KV head with its group of query heads without copying.
    """
    k_cache.index_copy_(0, metadata.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, metadata.slot_mapping, v.to(v_cache.dtype))
    if metadata.shared_prefix is not None:
        return cascade_decode(q, k_cache, v_cache, metadata.shared_prefix, scale)
    # The paged read: [B, S, num_kv_heads, head_dim], padding slots included (masked below).
    # index_select on the flat index rather than advanced indexing with a 2-D index tensor:
    # this gather is the largest memory traffic of a decode step.
    B, S = metadata.kv_slots.shape
    flat_slots = metadata.kv_slots.reshape(-1)
    keys = k_cache.index_select(0, flat_slots).view(B, S, *k_cache.shape[1:]).to(q.dtype)
    values = v_cache.index_select(0, flat_slots).view(B, S, *v_cache.shape[1:]).to(q.dtype)
    Q = metadata.max_query_len
    T, H, D = q.shape
    if metadata.query_index is None:
        queries = q.view(B, Q, H, D)
    else:
        queries = q.index_select(0, metadata.query_index.view(-1)).view(B, Q, H, D)
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),  # SDPA wants [batch, heads, len, head_dim]
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=metadata.mask,
        scale=scale,
        enable_gqa=True,
    )
    out = out.transpose(1, 2).reshape(B * Q, H, D)
    return out if metadata.output_index is None else out.index_select(0, metadata.output_index)


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences of a batch that share one SDPA call.

    Attributes:
        rows: their tokens' rows of the batch's ``q``, ``k`` and ``v``: a slice when they are
            contiguous (the usual case: the scheduler puts running requests before new ones),
            else a ``[n]`` int64 tensor.
        metadata: the group as a batch of its own (its ``slot_mapping`` is the rows' slots).
    """

    rows: slice | torch.Tensor
    metadata: AttentionMetadata


def split_batch(
    slot_mapping: torch.Tensor,
    kv_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    kv_row_bytes: int | None = None,
    cascade: bool = True,
    sliding_window: int | None = None,
    bidirectional_spans: torch.Tensor | None = None,
) -> list[AttentionGroup]:
    """Split a batch (arguments as in :meth:`AttentionMetadata.build`) in attention groups:
    the sequences with one new token (decodes), padded only to their longest context, apart
    from those with more, padded among themselves. A batch of one kind stays one group, except
    that with ``kv_row_bytes`` the decodes are cut into groups whose gathered contexts fit in
    :data:`ATTENTION_CHUNK_BYTES` (:func:`_decode_chunks`), and ``cascade`` lets each decode
    group attend to a shared prefix once. The groups are for layers with ``sliding_window``
    (None: full attention); a decode of a windowed layer gathers at most ``W`` keys, and its
    groups are cut by that. ``bidirectional_spans`` (``[T, 2]``, see
    :meth:`AttentionMetadata.build`) go to the groups of more than one new token; a decode's
    span can only be itself.

    Raises:
        InvalidArgumentError: the batch is empty, or the shapes disagree (see
            :meth:`AttentionMetadata.build`).
    """
    q_lens = query_lens.tolist()
    if not q_lens:
        raise InvalidArgumentError("an empty batch has nothing to attend")
    cascade_bytes = kv_row_bytes if cascade else None
    s_lens, dev = seq_lens.tolist(), kv_slots.device
    # Keys a decode gathers: its whole context, or its window.
    read = s_lens if sliding_window is None else [min(n, sliding_window) for n in s_lens]
    is_decode = [q == 1 for q in q_lens]
    one_kind = all(is_decode) or not any(is_decode)
    if one_kind and (not is_decode[0] or len(_decode_chunks(read, kv_row_bytes)) == 1):
        meta = AttentionMetadata.build(
            slot_mapping,
            kv_slots,
            seq_lens,
            query_lens,
            max(q_lens),
            cascade_bytes,
            sliding_window,
            None if is_decode[0] else bidirectional_spans,
        )
        return [AttentionGroup(slice(0, slot_mapping.shape[0]), meta)]
    if seq_lens.shape != query_lens.shape or sum(q_lens) != slot_mapping.shape[0]:
        raise InvalidArgumentError(
            f"{slot_mapping.shape[0]} tokens, query lengths {q_lens} and seq_lens of shape "
            f"{tuple(seq_lens.shape)} do not describe one batch"
        )
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)

    def group(seqs: list[int]) -> AttentionGroup:
        """The sequences ``seqs`` (indices into the batch) as a batch of their own."""
        if seqs == list(range(seqs[0], seqs[-1] + 1)):
            rows = slice(starts[seqs[0]], starts[seqs[-1] + 1])
            pick = slice(seqs[0], seqs[-1] + 1)
            kv, lens, qs = kv_slots[pick], seq_lens[pick], query_lens[pick]
        else:
            rows = [r for b in seqs for r in range(starts[b], starts[b + 1])]
            rows = torch.tensor(rows, device=dev)
            index = torch.tensor(seqs, device=dev)
            kv = kv_slots.index_select(0, index)
            lens, qs = seq_lens.index_select(0, index), query_lens.index_select(0, index)
        width, max_q = max(s_lens[b] for b in seqs), max(q_lens[b] for b in seqs)
        spans = None if bidirectional_spans is None or max_q == 1 else bidirectional_spans[rows]
        meta = AttentionMetadata.build(
            slot_mapping[rows], kv[:, :width], lens, qs, max_q, cascade_bytes, sliding_window, spans
        )
        return AttentionGroup(rows, meta)

    groups = []
    # The kinds in the order of their first rows (decodes first if row 0 decodes).
    for decode in sorted(set(is_decode), key=is_decode.index):
        seqs = [b for b, d in enumerate(is_decode) if d == decode]
        lens = [read[b] for b in seqs]
        for chunk in _decode_chunks(lens, kv_row_bytes) if decode else [range(len(seqs))]:
            groups.append(group([seqs[i] for i in chunk]))
    return groups


# Bytes of K and V one decode group gathers per layer, at most: a padded copy small enough to
# stay in the cores' caches while SDPA reads it (2-core Xeon, 4 MiB of L2 in all).
ATTENTION_CHUNK_BYTES = 4 << 20


def _decode_chunks(seq_lens: list[int], kv_row_bytes: int | None) -> list[range]:
    """Consecutive groups of the decodes whose contexts ``seq_lens`` are, as few and as even
    as allow each to gather at most :data:`ATTENTION_CHUNK_BYTES` (``kv_row_bytes``: one
    token's K and V in one layer) or one sequence; one group without ``kv_row_bytes``."""
    n = len(seq_lens)
    if kv_row_bytes is None:
        return [range(n)]
    fits = max(1, ATTENTION_CHUNK_BYTES // (max(seq_lens) * kv_row_bytes))
    size = -(-n // -(-n // fits))  # ceil(n / number of groups)
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def varlen_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    groups: list[AttentionGroup],
    scale: float,
) -> torch.Tensor:
    """:func:`paged_attention` over a batch split by :func:`split_batch`, one call per group
    (shapes as there). The groups hold different sequences, so each stores its own tokens'
    K/V just before it reads: no group reads a slot that another one writes. A layer's
    sliding window is in its groups (``split_batch(..., sliding_window=W)``): the decoder
    splits a batch once per window (and KV group) and hands each layer its own."""
    outs = [
        paged_attention(q[g.rows], k[g.rows], v[g.rows], k_cache, v_cache, g.metadata, scale)
        for g in groups
    ]
    slices = all(isinstance(g.rows, slice) for g in groups)
    if slices and all(a.rows.stop == b.rows.start for a, b in pairwise(groups)):
        return torch.cat(outs) if len(outs) > 1 else outs[0]  # the groups tile q in order
    out = torch.empty_like(q)
    for g, o in zip(groups, outs, strict=True):
        out[g.rows] = o
    return out


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Dense causal attention of one sequence, written out op by op (the textbook formula).

    Args:
        q: ``[n, num_heads, head_dim]``, the last ``n`` tokens of the sequence.
        k, v: ``[S, num_kv_heads, head_dim]``, the whole context (``S >= n``), contiguous.
        scale: softmax scale.
        sliding_window: ``W``: query ``p`` attends to keys ``p - W + 1 .. p`` only.

    Returns:
        ``[n, num_heads, head_dim]``: query ``i`` (context index ``S - n + i``) attends to keys
        ``0 .. S - n + i`` (the last ``W`` of them with a window).
    """
    n, H, _ = q.shape
    S, KV, _ = k.shape
    k = k.repeat_interleave(H // KV, dim=1)  # GQA: each KV head serves H // KV query heads
    v = v.repeat_interleave(H // KV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    pos = torch.arange(S, device=q.device)
    hidden = pos[None, :] > pos[S - n :, None]  # [n, S]: the future
    if sliding_window is not None:
        hidden |= pos[None, :] <= pos[S - n :, None] - sliding_window  # before the window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)


def block_table_to_kv_slots(
    block_tables: torch.Tensor, block_size: int, max_seq_len: int
) -> torch.Tensor:
    """Expand vLLM block tables into per-token slots (SGLang ``req_to_token`` rows).

    ``slot[b, j] = block_tables[b, j // block_size] * block_size + j % block_size``, the
    tensor form of :func:`minirad.kvcache.kv_pool.slot_mapping` over positions ``0 ..
    max_seq_len-1``.

    Args:
        block_tables: ``[B, max_blocks]`` int64 block ids. Rows shorter than ``max_blocks``
            must be padded with a valid block id (0 will do): padding is gathered, then masked.
        block_size: tokens per block.
        max_seq_len: tokens per output row, at most ``max_blocks * block_size``.

    Returns:
        ``[B, max_seq_len]`` int64 slots.

    Raises:
        InvalidArgumentError: ``max_seq_len`` does not fit in the block tables.
    """
    if max_seq_len > block_tables.shape[1] * block_size:
        raise InvalidArgumentError(
            f"max_seq_len={max_seq_len} exceeds {block_tables.shape[1]} blocks of {block_size}"
        )
    j = torch.arange(max_seq_len, device=block_tables.device)
    return block_tables[:, j // block_size] * block_size + j % block_size
