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

The index tensors (:class:`AttentionMetadata`) depend only on the batch, not on the layer, so
they are built once per forward and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import InvalidArgumentError

__all__ = [
    "AttentionMetadata",
    "block_table_to_kv_slots",
    "paged_attention",
    "reference_attention",
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
    """

    slot_mapping: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor
    query_index: torch.Tensor | None
    output_index: torch.Tensor | None

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
    ) -> AttentionMetadata:
        """Index tensors for a batch.

        Args:
            slot_mapping: ``[T]`` int64, ``T = query_lens.sum()``.
            kv_slots: ``[B, max_seq_len]`` int64 (see the module docstring).
            seq_lens: ``[B]`` int64, context tokens per sequence *including* this step's.
            query_lens: ``[B]`` int64, new tokens per sequence, each in ``1 .. seq_lens[b]``.
            max_query_len: ``max(query_lens)``, passed as an int so that no device sync is
                needed to size the padding.

        Raises:
            InvalidArgumentError: the shapes disagree. (Values are not checked here: that
                would cost a device sync per step; :class:`~minirad.models.ForwardBatch`
                checks them when it builds a batch from Python lists.)
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
        dev = kv_slots.device
        rows = torch.arange(max_query_len, device=dev)
        # Context index of each padded query row. The causal mask "key <= q_pos" also hides
        # the padding: a real query's q_pos is below seq_lens[b], and the padded keys sit at or
        # past it. A padding row (i >= query_lens[b]) keeps at least key 0, so SDPA returns no
        # NaN for it; its output is dropped.
        q_pos = (seq_lens - query_lens)[:, None] + rows[None, :]  # [B, Q]
        mask = torch.arange(S, device=dev)[None, None, :] <= q_pos[:, :, None]  # [B, Q, S]
        query_index = output_index = None
        if T != B * max_query_len:  # ragged: gather queries into padded rows and back
            valid = rows[None, :] < query_lens[:, None]  # [B, Q]
            starts = torch.cumsum(query_lens, 0) - query_lens
            query_index = torch.where(valid, starts[:, None] + rows[None, :], 0)
            # Row-major order of the valid cells is token order (sequence after sequence).
            output_index = torch.arange(B * max_query_len, device=dev)[valid.flatten()]
        return cls(slot_mapping, kv_slots, mask.unsqueeze(1), query_index, output_index)


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
            of the pool (:meth:`minirad.kv_pool.KVCache.layer`); written in place.
        metadata: the batch's :class:`AttentionMetadata`.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``[T, num_heads, head_dim]`` attention output, one row per new token.

    Grouped-query attention (``num_heads`` a multiple of ``num_kv_heads``) is handled by SDPA's
    ``enable_gqa``, which shares each KV head with its group of query heads without copying.
    """
    k_cache.index_copy_(0, metadata.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, metadata.slot_mapping, v.to(v_cache.dtype))
    # The paged read: [B, S, num_kv_heads, head_dim], padding slots included (masked below).
    # index_select on the flat index is ~5x faster on CPU than advanced indexing with a 2-D
    # index tensor, and this gather is the largest memory traffic of a decode step.
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


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense causal attention of one sequence, written out op by op (the textbook formula).

    Args:
        q: ``[n, num_heads, head_dim]``, the last ``n`` tokens of the sequence.
        k, v: ``[S, num_kv_heads, head_dim]``, the whole context (``S >= n``), contiguous.
        scale: softmax scale.

    Returns:
        ``[n, num_heads, head_dim]``: query ``i`` (context index ``S - n + i``) attends to keys
        ``0 .. S - n + i``.
    """
    n, H, _ = q.shape
    S, KV, _ = k.shape
    k = k.repeat_interleave(H // KV, dim=1)  # GQA: each KV head serves H // KV query heads
    v = v.repeat_interleave(H // KV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    future = torch.arange(S)[None, :] > torch.arange(S - n, S)[:, None]  # [n, S]
    scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)


def block_table_to_kv_slots(
    block_tables: torch.Tensor, block_size: int, max_seq_len: int
) -> torch.Tensor:
    """Expand vLLM block tables into per-token slots (SGLang ``req_to_token`` rows).

    ``slot[b, j] = block_tables[b, j // block_size] * block_size + j % block_size``, the
    tensor form of :func:`minirad.kv_pool.slot_mapping` over positions ``0 .. max_seq_len-1``.

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
