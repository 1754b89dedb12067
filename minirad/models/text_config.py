"""Which text decoders the paged decoder runs, and the KV each of their layers keeps.

Everything here reads an HF config only, never weights, so an engine can size and lay out its
KV pools before it builds the model: :func:`check_text_config` refuses what
:class:`~minirad.models.PagedDecoder` would not compute exactly as HF does,
:func:`kv_cache_dims` gives the pool's dimensions, :func:`layer_specs` each layer's
:class:`~minirad.kvcache.kv_cache_spec.KVCacheSpec` (full attention, or a sliding window),
and :func:`layer_groups` puts layers with equal specs in one KV group (one slot space).
"""

from __future__ import annotations

import torch

from minirad.errors import UnsupportedModelError
from minirad.kvcache.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from minirad.models import gemma3, gemma4

__all__ = [
    "SUPPORTED_TEXT_MODELS",
    "check_text_config",
    "kv_cache_dims",
    "layer_groups",
    "layer_specs",
    "layer_windows",
]

SUPPORTED_TEXT_MODELS = ("llama", "qwen2", *gemma3.MODEL_TYPES, *gemma4.MODEL_TYPES)
# RoPE variants whose frequencies are fixed at load time. "dynamic" and "longrope" rescale
# inv_freq with the sequence length inside HF's forward, which a paged cache cannot follow.
_STATIC_ROPE = ("default", "linear", "llama3", "yarn", "proportional")


def _rope_types(config) -> list[str]:
    """The config's RoPE types: one, or one per layer type (Gemma's ``rope_parameters`` is a
    dict of dicts keyed by layer type)."""
    params = getattr(config, "rope_parameters", None) or {}
    if any(isinstance(v, dict) for v in params.values()):
        return [(p or {}).get("rope_type", "default") for p in params.values()]
    return [params.get("rope_type", "default")]


def check_text_config(config) -> None:
    """Check that :class:`~minirad.models.PagedDecoder` computes exactly what HF computes for
    this text config.

    Raises:
        UnsupportedModelError: not a Llama/Qwen2/Gemma 3/Gemma 4 text decoder, a
            sequence-length-dependent RoPE, sliding-window attention in a Llama or Qwen2
            (Qwen2's ``use_sliding_window``), or a Gemma feature
            :func:`minirad.models.gemma3.check_config` or
            :func:`minirad.models.gemma4.check_config` refuses.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_TEXT_MODELS:
        raise UnsupportedModelError(
            f"text model type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_TEXT_MODELS)}"
        )
    for rope in _rope_types(config):
        if rope not in _STATIC_ROPE:
            raise UnsupportedModelError(
                f"rope_type {rope!r} is not supported; supported: {', '.join(_STATIC_ROPE)}"
            )
    if model_type in gemma3.MODEL_TYPES:
        gemma3.check_config(config)
        return
    if model_type in gemma4.MODEL_TYPES:
        gemma4.check_config(config)
        return
    layer_types = getattr(config, "layer_types", None) or ()
    if getattr(config, "use_sliding_window", False) or any(
        t != "full_attention" for t in layer_types
    ):
        raise UnsupportedModelError(
            f"sliding-window attention is not supported in {model_type}; "
            "only full attention layers (sliding windows: gemma3_text, gemma4_text)"
        )


def _layer_dims(c) -> list[tuple[int, int]]:
    """``(num_kv_heads, head_dim)`` of each layer of text config ``c``: the config's, or
    the layer's own where HF's ``per_layer_config`` overrides them (Gemma 4's global layers)."""
    # Through the layers' views where HF has them: it refuses to read a global value that
    # layers override. A Qwen2 config has no head_dim: hidden_size // num_attention_heads.
    n, per_layer = c.num_hidden_layers, getattr(c, "per_layer_config", None)
    views = [c] * n if per_layer is None else [per_layer[i] for i in range(n)]
    return [
        (
            v.num_key_value_heads,
            getattr(v, "head_dim", None) or v.hidden_size // v.num_attention_heads,
        )
        for v in views
    ]


def kv_cache_dims(config) -> dict[str, int]:
    """``num_layers``, ``num_kv_heads`` and ``head_dim`` of a model's text decoder: the
    model-given dimensions of a :class:`~minirad.kvcache.kv_pool.KVCache` (the caller picks
    ``num_blocks`` and ``block_size``). ``config`` is a VLM config or a text config (HF's
    ``get_text_config()`` finds the text part).

    Raises:
        UnsupportedModelError: the layers' K/V differ in shape (Gemma 4 with a
            ``global_head_dim`` of its own): no one pool holds them; :func:`layer_specs`
            says what each layer keeps, for one pool per KV group.
    """
    c = config.get_text_config()
    dims = _layer_dims(c)
    if len(set(dims)) > 1:
        raise UnsupportedModelError(
            f"the layers keep K/V of different shapes ((kv heads, head dim): {sorted(set(dims))})"
            ": one KV pool cannot hold them; use layer_specs() and one KVCache per KV group"
        )
    return dict(num_layers=c.num_hidden_layers, num_kv_heads=dims[0][0], head_dim=dims[0][1])


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window ``W`` (HF's count, the query's own key included), or None
    for a full-attention layer. ``config`` is checked by :func:`check_text_config`."""
    c = config.get_text_config()
    check_text_config(c)
    types = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    return [c.sliding_window if t == "sliding_attention" else None for t in types]


def layer_specs(config, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
    """What each layer keeps in the KV cache, in blocks of ``block_size`` tokens of ``dtype``:
    a :class:`~minirad.kvcache.kv_cache_spec.SlidingWindowSpec` for a sliding-window layer,
    a :class:`~minirad.kvcache.kv_cache_spec.FullAttentionSpec` for the others.

    Raises:
        UnsupportedModelError: see :func:`check_text_config`.
        InvalidArgumentError: ``block_size`` or ``dtype`` is not valid for a spec.
    """
    windows = layer_windows(config)
    specs = []
    for w, (kv_heads, head_dim) in zip(windows, _layer_dims(config.get_text_config()), strict=True):
        kw = dict(block_size=block_size, num_kv_heads=kv_heads, head_size=head_dim, dtype=dtype)
        specs.append(
            FullAttentionSpec(**kw) if w is None else SlidingWindowSpec(**kw, sliding_window=w)
        )
    return specs


def layer_groups(specs: list[KVCacheSpec]) -> list[int]:
    """The KV group of each layer: layers with equal specs share one (one slot space, one
    block table per request), as vLLM groups them. Full-attention layers are group 0 (the
    slots a :class:`~minirad.models.ForwardBatch` carries first); the other specs follow in
    the order of their first layer. All zeros when every layer keeps the same KV."""
    order = sorted(
        dict.fromkeys(specs), key=lambda s: (not isinstance(s, FullAttentionSpec), specs.index(s))
    )
    return [order.index(s) for s in specs]
