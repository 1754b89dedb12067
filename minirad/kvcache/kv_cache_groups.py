"""Layers into KV-cache groups: vLLM 0.32's uniform-page-size grouping, cut down.

A block table is per *group* of layers, not per layer: every layer of a group reads its KV
through the same block ids (each layer has its own KV tensor, indexed the same way). A group
holds layers of one spec, and every group has the same number of layers, so that one block id
means the same amount of memory in every group and one :class:`BlockPool` serves them all.

The group size is the smallest number of layers of one spec (the "1" of an n:1 pattern):

- Gemma 3's 5 sliding : 1 full, 6 layers: group size 1, so five sliding groups and one full
  group, each of one layer.
- 52 sliding + 10 full (Gemma-3-27B): group size 10, so one full group and
  ``cdiv(52, 10) = 6`` sliding groups, 60 layer slots for 52 layers: 8 are padding. vLLM deals
  the layers out round robin (``layers[i::6]``, so that pipeline stages split evenly), giving
  sliding groups of 9, 9, 9, 9, 8 and 8 layers: the last two are padded.
- When the largest count is under 1.5 times the smallest (12 sliding + 13 full), the group
  size is the largest count instead, so that nothing is split into many padded groups.

Follows ``_get_kv_cache_groups_uniform_page_size`` and ``unify_hybrid_kv_cache_specs`` in
``vllm/v1/core/kv_cache_utils.py``; ``disable_hybrid=True`` is vLLM's
``--disable-hybrid-kv-cache-manager``: every sliding layer is treated as full attention (one
group; the window is still applied by the attention kernel, but no KV is ever dropped).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from minirad.errors import InvalidArgumentError
from minirad.kvcache.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

__all__ = ["KVCacheGroupSpec", "get_kv_cache_groups", "unify_hybrid_kv_cache_specs"]


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group: the layers (by index in the model) that share a block table.

    Attributes:
        layer_ids: the group's layers, in model order.
        spec: their common spec.
    """

    layer_ids: tuple[int, ...]
    spec: KVCacheSpec


def unify_hybrid_kv_cache_specs(layer_specs: Sequence[KVCacheSpec]) -> list[KVCacheSpec]:
    """Every sliding-window spec as the full-attention spec of the same shape, when the
    model mixes both (vLLM's ``--disable-hybrid-kv-cache-manager``); otherwise unchanged."""
    specs = list(layer_specs)
    if not any(isinstance(s, FullAttentionSpec) for s in specs):
        return specs  # an all-sliding model stays a one-type model
    return [
        FullAttentionSpec(s.block_size, s.num_kv_heads, s.head_size, s.dtype)
        if isinstance(s, SlidingWindowSpec)
        else s
        for s in specs
    ]


def get_kv_cache_groups(
    layer_specs: Sequence[KVCacheSpec], *, disable_hybrid: bool = False
) -> list[KVCacheGroupSpec]:
    """Group the layers of a model, given each layer's spec in model order.

    Specs are bucketed by equality (in the order each first appears); each bucket is dealt
    out round robin into groups of the common size (module docstring).

    Raises:
        InvalidArgumentError: no layers, a spec that is not a full or sliding-window spec,
            or specs whose page sizes or block sizes differ (vLLM would then resize pages;
            minirad does not).
    """
    specs = list(layer_specs)
    if not specs:
        raise InvalidArgumentError("a model needs at least one layer spec")
    for i, s in enumerate(specs):
        if not isinstance(s, FullAttentionSpec | SlidingWindowSpec):
            raise InvalidArgumentError(f"layer {i}: not a KV-cache spec: {s!r}")
    if disable_hybrid:
        specs = unify_hybrid_kv_cache_specs(specs)
    if len({s.page_size_bytes for s in specs}) > 1 or len({s.block_size for s in specs}) > 1:
        raise InvalidArgumentError(
            "every layer must have the same page size and block size, got "
            f"{sorted({(s.block_size, s.page_size_bytes) for s in specs})} (block, bytes)"
        )
    buckets: dict[KVCacheSpec, list[int]] = {}
    for layer_id, s in enumerate(specs):
        buckets.setdefault(s, []).append(layer_id)
    sizes = [len(layers) for layers in buckets.values()]
    group_size = min(sizes)
    if max(sizes) < 1.5 * group_size:
        group_size = max(sizes)
    groups = []
    for s, layers in buckets.items():
        num_groups = -(-len(layers) // group_size)
        groups += [KVCacheGroupSpec(tuple(layers[i::num_groups]), s) for i in range(num_groups)]
    return groups
