"""Cascade attention: decodes that share a prefix attend to it once.

The radix tree gives every request that shares a prefix the very same KV slots: a system prompt,
or a picture many questions are asked about, is stored once. Paged attention
(:mod:`minirad.models.paged_attention`) still reads it once per sequence: a decode step of
``B`` requests that share ``P`` tokens gathers ``B * P`` rows of K and V to attend to ``P``
distinct ones. Here the step attends in two parts and merges them:

1. every query of the batch against the shared prefix, gathered once: one attention call in
   which the prefix is a single sequence with ``B * group`` queries per KV head;
2. each query against its own suffix (the rest of its context, its newest token at least);
3. the two softmaxes merged by their log-sum-exps (``lse``): the softmax over a whole context
   is the two parts' softmaxes, each weighted by its share of ``sum(exp(score))``, so
   ``out = w * out_prefix + (1 - w) * out_suffix`` with ``w = sigmoid(lse_prefix - lse_suffix)``.

FlashInfer's cascade attention and Hydragen do this on a GPU; vLLM's cascade attention does it
for a prefix shared by a whole batch, as here. On a CPU the log-sum-exps come from
``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``, the kernel behind SDPA there.
The longer the shared prefix and the more requests share it, the more it saves
(docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MIN_SAVED_BYTES", "SharedPrefix", "cascade_decode"]

# Copies a shared prefix must save, per layer, to pay for its own attention call and the merge
# (measured: at 8 requests, 400 shared tokens of the shipped model, 200 of a 193 M one).
MIN_SAVED_BYTES = 1 << 20


@dataclass(frozen=True)
class SharedPrefix:
    """The slots every sequence of a decode batch begins with, and what follows them.

    Attributes:
        slots: ``[P]`` int64, the shared prefix's slots (the same at the same positions).
        suffix_slots: ``[B, S - P]`` int64, each sequence's remaining slots, padded.
        suffix_real: ``[B, S - P]`` bool, True for a real slot, False for padding (each row
            keeps at least its newest token).
    """

    slots: torch.Tensor
    suffix_slots: torch.Tensor
    suffix_real: torch.Tensor

    @classmethod
    def find(
        cls, kv_slots: torch.Tensor, seq_lens: torch.Tensor, kv_row_bytes: int
    ) -> SharedPrefix | None:
        """The shared prefix of a decode batch's slot rows, or None where there is none worth
        a second attention call: one sequence, a prefix whose gathers would copy fewer than
        :data:`MIN_SAVED_BYTES` more (``kv_row_bytes``: one token's K and V in one layer),
        or not on a CPU (the merge needs the CPU flash kernel's log-sum-exp). Costs one host
        sync per step."""
        B = kv_slots.shape[0]
        if B < 2 or kv_slots.device.type != "cpu":
            return None
        lens = seq_lens.tolist()
        limit = min(lens) - 1  # the newest token is never shared
        if (B - 1) * limit * kv_row_bytes < MIN_SAVED_BYTES:
            return None  # too short even if all of it were shared
        same = (kv_slots[:, :limit] == kv_slots[:1, :limit]).all(0)
        shared = int(same.cumprod(0).sum())  # leading columns that every row holds alike
        if (B - 1) * shared * kv_row_bytes < MIN_SAVED_BYTES:
            return None
        suffix = kv_slots[:, shared : max(lens)]
        real = torch.arange(suffix.shape[1])[None, :] < (seq_lens - shared)[:, None]
        return cls(kv_slots[0, :shared], suffix.contiguous(), real)


def _gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V at ``slots`` (shape ``[..., len]``) as attention reads them:
    ``[..., num_kv_heads, len, head_dim]``, in ``dtype``."""
    out = cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])
    return out.transpose(-3, -2).to(dtype)


def cascade_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix: SharedPrefix,
    scale: float,
) -> torch.Tensor:
    """Decode attention of ``B`` sequences that share ``prefix``: all of them against the
    prefix, gathered once, each against its own suffix, and the two merged.

    A softmax over the whole context is the softmaxes over two parts, weighted by each part's
    share of the total mass: with ``lse`` the log of a part's sum of ``exp(score)``,
    ``out = w * out_prefix + (1 - w) * out_suffix``, ``w = sigmoid(lse_prefix - lse_suffix)``.

    Args:
        q: ``[B, num_heads, head_dim]``, one query per sequence (RoPE applied).
        k_cache, v_cache: ``[num_slots, num_kv_heads, head_dim]``, the new K/V already in.
        prefix: the batch's :class:`SharedPrefix`.
        scale: softmax scale.

    Returns:
        ``[B, num_heads, head_dim]``, as :func:`paged_attention` returns it.
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # returns the lse
    B, H, D = q.shape
    kv_heads = k_cache.shape[1]
    group = H // kv_heads
    q = q.view(B, kv_heads, group, D)  # query head h reads KV head h // group (HF's GQA)
    # The prefix as ONE sequence with B * group queries per KV head.
    q_all = q.transpose(0, 1).reshape(1, kv_heads, B * group, D)
    keys, values = (_gather(c, prefix.slots, q.dtype)[None] for c in (k_cache, v_cache))
    out_p, lse_p = flash(q_all, keys, values, scale=scale)
    out_p = out_p.view(kv_heads, B, group, D).transpose(0, 1)
    lse_p = lse_p.view(kv_heads, B, group).transpose(0, 1)
    # Each suffix (the newest token at least), padded and masked.
    keys, values = (_gather(c, prefix.suffix_slots, q.dtype) for c in (k_cache, v_cache))
    mask = torch.zeros(prefix.suffix_real.shape, dtype=q.dtype)  # the kernel adds it
    mask = mask.masked_fill_(~prefix.suffix_real, float("-inf"))[:, None, None, :]
    out_s, lse_s = flash(q, keys, values, attn_mask=mask, scale=scale)
    w = torch.sigmoid(lse_p - lse_s)[..., None]
    out = w * out_p.float() + (1 - w) * out_s.float()
    return out.to(q.dtype).reshape(B, H, D)
