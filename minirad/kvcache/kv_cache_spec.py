"""What one attention layer keeps in the KV cache: vLLM's ``KVCacheSpec`` family, cut down.

A hybrid model (Gemma 3: five sliding-window layers for each full-attention layer) has layers
that need different amounts of KV. A full-attention layer reads every earlier token, so it
keeps them all. A sliding-window layer with window ``W`` reads only the ``W`` keys ending at
the query, the query included (HF's ``sliding_window`` counts that way), so it needs the last
``W - 1`` earlier tokens and nothing before them. The cache records this per layer as a
*spec*; the block manager groups layers with equal specs and runs one manager per group
(vLLM's ``FullAttentionManager`` and ``SlidingWindowManager``).

Names and fields follow vLLM 0.32's ``vllm/v1/kv_cache_interface.py``: ``block_size``,
``num_kv_heads``, ``head_size``, ``dtype``, ``sliding_window``, ``page_size_bytes``, and the
event field ``kv_cache_spec_kind`` ("full_attention", "sliding_window").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minirad.errors import InvalidArgumentError

__all__ = ["AttentionSpec", "FullAttentionSpec", "KVCacheSpec", "SlidingWindowSpec"]


@dataclass(frozen=True)
class AttentionSpec:
    """The KV one attention layer keeps per token, in blocks of ``block_size`` tokens.

    Attributes:
        block_size: tokens per block (page).
        num_kv_heads, head_size: K and V are ``[num_kv_heads, head_size]`` per token.
        dtype: the KV dtype.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    kind = "attention"

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidArgumentError(f"dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: K and V for ``block_size`` tokens."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

    def tokens_needed(self, num_tokens: int) -> int:
        """How many of the last ``num_tokens`` tokens the next query attends to (all of them
        for full attention)."""
        return num_tokens


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """A full-attention layer: every token's KV is needed as long as the request runs."""

    kind = "full_attention"


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """A sliding-window layer: a query at position ``p`` attends to keys ``p - W + 1 .. p``.

    Attributes:
        sliding_window: ``W``, HF's count: the query's own key included. The next query,
            at position ``n``, needs the ``W - 1`` tokens before it (SGLang stores that
            ``W - 1``); vLLM skips the first ``n - W + 1`` tokens. All three agree.
    """

    sliding_window: int = 0

    kind = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        w = self.sliding_window
        if not isinstance(w, int) or isinstance(w, bool) or w <= 0:
            raise InvalidArgumentError(f"sliding_window must be a positive int, got {w!r}")

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no later query can attend to once ``num_computed_tokens`` are in
        the cache: vLLM's ``get_num_skipped_tokens``, ``max(0, n - W + 1)``."""
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def tokens_needed(self, num_tokens: int) -> int:
        return num_tokens - self.num_skipped_tokens(num_tokens)


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec
