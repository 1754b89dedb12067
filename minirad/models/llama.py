"""Llama and Qwen2 as a :class:`~minirad.models.layer_plan.DecoderPlan`.

One Llama layer (Qwen2 is the same plus biases on q/k/v, which the linears pick up from the
modules)::

    h = RMSNorm(x);  q, k, v = h Wq, h Wk, h Wv;  q, k = RoPE(q), RoPE(k)
    x = x + paged_attention(q, k, v) Wo
    h = RMSNorm(x);  x = x + (act(h Wgate) * (h Wup)) Wdown

so its plan has the two RMSNorms and one RoPE table, and no q/k norms, sandwich norms or
window. Follows ``transformers/models/llama/modeling_llama.py``.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from minirad.models.layer_plan import DecoderPlan, LayerPlan, RopeTable

__all__ = ["plan", "rms_norm"]


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """HF's Llama RMSNorm: normalise in fp32, cast back, then scale by the weight."""
    return F.rms_norm(x.float(), x.shape[-1:], eps=norm.variance_epsilon).to(x.dtype) * norm.weight


def plan(text_model: nn.Module) -> DecoderPlan:
    """The plan of a ``LlamaModel`` / ``Qwen2Model`` (its config already checked)."""
    rotary = text_model.rotary_emb
    layers = [
        LayerPlan(
            input_norm=partial(rms_norm, norm=layer.input_layernorm),
            pre_mlp_norm=partial(rms_norm, norm=layer.post_attention_layernorm),
            act=layer.mlp.act_fn,
            scale=layer.self_attn.scaling,
            head_dim=layer.self_attn.head_dim,
        )
        for layer in text_model.layers
    ]
    ropes = {"default": RopeTable(rotary.inv_freq, rotary.attention_scaling)}
    return DecoderPlan(layers, ropes, partial(rms_norm, norm=text_model.norm))
