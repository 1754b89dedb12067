"""Gemma 4's text decoder (``Gemma4ForCausalLM``, model type ``gemma4_text``), the parts a small
dense config uses, as a :class:`~minirad.models.layer_plan.DecoderPlan`.

A Gemma 4 layer is a Gemma 3 layer (:mod:`minirad.models.gemma3`: four norms around attention
and MLP, q/k norms, local and global RoPE tables, sliding windows, scaled embedding; the
head's final logit softcap) with these differences
(``transformers/models/gemma4/modeling_gemma4.py``):

- RMSNorm scales by ``w`` itself (HF initialises it to ones), in fp32, then casts back:
  :func:`gemma4_rms_norm`;
- the values are RMS-normed per head too, without a weight (``v_norm``);
- the softmax scale is 1 (the q/k norms set the scores' size);
- each layer ends by multiplying the residual stream by its ``layer_scalar``;
- the full-attention layers may have their own head size and KV head count
  (``global_head_dim``, ``num_global_key_value_heads``): HF's ``per_layer_config``. Their K/V
  then need a pool of their own shape: one :class:`~minirad.kvcache.kv_pool.KVCache` per KV
  group (:func:`~minirad.models.text_config.layer_specs`);
- the global RoPE is "proportional": only a fraction of each head rotates. HF writes it as
  zero frequencies for the rest (cos 1, sin 0), so the full-width formula computes it as is.

Refused (:func:`check_config`), as the big checkpoints use them and a small dense one does not:
per-layer input embeddings (``hidden_size_per_layer_input``), KV sharing between layers
(``num_kv_shared_layers``), mixture-of-experts blocks, keys reused as values
(``attention_k_eq_v``) and bidirectional attention.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from minirad.errors import UnsupportedModelError
from minirad.models import gemma3
from minirad.models.gemma3 import LAYER_TYPES, layer_plan
from minirad.models.layer_plan import DecoderPlan, LayerPlan

__all__ = ["MODEL_TYPES", "check_config", "gemma4_rms_norm", "plan"]

MODEL_TYPES = ("gemma4_text",)

# Config fields that switch on a part :func:`plan` does not compute, and the value that
# leaves it off.
_OFF = {
    "hidden_size_per_layer_input": (0, None),  # per-layer input embeddings (PLE)
    "num_kv_shared_layers": (0,),  # layers that reuse an earlier layer's K/V
    "enable_moe_block": (False,),  # mixture-of-experts blocks
    "attention_k_eq_v": (False,),  # keys reused as values
    "use_bidirectional_attention": (None,),
}


def check_config(config) -> None:
    """Refuse the Gemma 4 text features :func:`plan` does not compute.

    Raises:
        UnsupportedModelError: one of per-layer input embeddings, KV sharing, MoE blocks,
            ``attention_k_eq_v``, bidirectional attention, or a layer type other than
            ``sliding_attention`` / ``full_attention``.
    """
    for name, off in _OFF.items():
        value = getattr(config, name, off[0])
        if value not in off:
            raise UnsupportedModelError(
                f"gemma4_text with {name}={value!r} is not supported (only {off[0]!r}): "
                "the paged decoder runs dense Gemma 4 layers without it"
            )
    unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(
            f"layer types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}"
        )


def gemma4_rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """HF's ``Gemma4RMSNorm``: normalise in fp32, scale by ``w`` in fp32 (if the norm has a
    weight), then cast back. Bit for bit HF's result (tests/test_gemma_parity.py)."""
    normed = F.rms_norm(x.float(), x.shape[-1:], eps=norm.variance_epsilon)
    if norm.with_scale:
        normed = normed * norm.weight.float()
    return normed.to(x.dtype)


def _layer(layer: nn.Module) -> LayerPlan:
    """One ``Gemma4TextDecoderLayer``'s plan: Gemma 3's, with its own norm, a norm on the
    values and a scalar on the layer's output."""
    v_norm = partial(gemma4_rms_norm, norm=layer.self_attn.v_norm)
    return layer_plan(layer, gemma4_rms_norm, v_norm=v_norm, layer_scalar=layer.layer_scalar)


def plan(text_model: nn.Module) -> DecoderPlan:
    """The plan of a ``Gemma4TextModel`` (its config checked by :func:`check_config`)."""
    return gemma3.plan(text_model, _layer, gemma4_rms_norm)
