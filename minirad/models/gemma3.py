"""Gemma 3's text decoder (``Gemma3ForCausalLM``, model type ``gemma3_text``) as a
:class:`~minirad.models.layer_plan.DecoderPlan`.

What a Gemma 3 layer adds to Llama's (``transformers/models/gemma3/modeling_gemma3.py``)::

    h = RMSNorm(x);  q, k, v = h Wq, h Wk, h Wv
    q, k = RMSNorm(q), RMSNorm(k)                  # per head, before RoPE
    q, k = RoPE_local(q), RoPE_local(k)             # or RoPE_global on full-attention layers
    x = x + RMSNorm(paged_attention(q, k, v; W) Wo) # W on sliding layers; scale 1/sqrt(qpas)
    x = x + RMSNorm(gelu_tanh(h' Wgate) * (h' Wup)) Wdown),  h' = RMSNorm(x)

- ``layer_types`` marks each layer ``sliding_attention`` (window ``sliding_window``, HF's
  count: query ``p`` sees keys ``p - W + 1 .. p``) or ``full_attention``; the two kinds take
  RoPE from two tables (local base 10k, global base 1M with any scaling), which HF's rotary
  module holds as ``sliding_attention_inv_freq`` and ``full_attention_inv_freq``.
- Every RMSNorm scales by ``1 + w`` and casts back to the input dtype *after* scaling
  (Llama casts first): :func:`gemma_rms_norm`.
- The softmax scale is ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``.
- The embedding is multiplied by ``sqrt(hidden_size)`` cast to the weights' dtype: HF's
  ``Gemma3TextScaledWordEmbedding`` does it, and the decoder calls that module as it is.
- ``Gemma3ForCausalLM`` soft-caps the final logits, ``c * tanh(logits / c)`` with the
  config's ``final_logit_softcapping``: a property of that head, not of the text model (a
  LLaVA around it does not cap), so the caller passes it
  (:meth:`~minirad.models.PagedDecoder.for_causal_lm` reads it from the config).

Refused (:func:`check_config`): attention-logit softcapping (Gemma 2's, not Gemma 3's) and
bidirectional attention (an embedding model's).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from minirad.errors import UnsupportedModelError
from minirad.models.layer_plan import DecoderPlan, LayerPlan, RopeTable

__all__ = ["LAYER_TYPES", "MODEL_TYPES", "check_config", "gemma_rms_norm", "plan"]

MODEL_TYPES = ("gemma3_text",)
LAYER_TYPES = ("sliding_attention", "full_attention")


def check_config(config) -> None:
    """Refuse the Gemma 3 text features :func:`plan` does not compute.

    Raises:
        UnsupportedModelError: attention-logit softcapping, bidirectional attention, or a
            layer type other than ``sliding_attention`` / ``full_attention``.
    """
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError(
            f"attention logit softcapping (attn_logit_softcapping="
            f"{config.attn_logit_softcapping}) is not supported: paged attention runs SDPA, "
            "which cannot cap the scores before the softmax"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            "bidirectional attention (use_bidirectional_attention) is not supported: "
            "a paged decoder attends causally"
        )
    unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(
            f"layer types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}"
        )


def gemma_rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """HF's ``Gemma3RMSNorm``: normalise in fp32, scale by ``1 + w`` in fp32, then cast back.

    (Llama casts before it scales, by ``w``: in bf16 the two round differently.) Bit for bit
    HF's result, in fp32 and bf16 (tests/test_gemma_parity.py).
    """
    normed = F.rms_norm(x.float(), x.shape[-1:], eps=norm.eps)
    return (normed * (1.0 + norm.weight.float())).to(x.dtype)


def layer_plan(layer: nn.Module, rms_norm=None, **extra) -> LayerPlan:
    """One Gemma decoder layer's plan: its four norms, q/k norms, window and RoPE table, with
    ``rms_norm`` (Gemma 3's ``(1 + w)`` norm by default; Gemma 4 passes its own) and
    ``extra`` fields (Gemma 4: ``v_norm``, ``layer_scalar``)."""
    attn = layer.self_attn

    def norm(module: nn.Module) -> partial:
        return partial(rms_norm or gemma_rms_norm, norm=module)

    return LayerPlan(
        input_norm=norm(layer.input_layernorm),
        pre_mlp_norm=norm(layer.pre_feedforward_layernorm),
        act=layer.mlp.act_fn,
        scale=attn.scaling,
        head_dim=attn.head_dim,
        rope=attn.layer_type,
        sliding_window=attn.sliding_window,
        q_norm=norm(attn.q_norm),
        k_norm=norm(attn.k_norm),
        post_attn_norm=norm(layer.post_attention_layernorm),
        post_mlp_norm=norm(layer.post_feedforward_layernorm),
        **extra,
    )


def plan(text_model: nn.Module, layer=layer_plan, rms_norm=gemma_rms_norm) -> DecoderPlan:
    """The plan of a ``Gemma3TextModel`` (its config checked by :func:`check_config`): one
    RoPE table per layer type, read from HF's rotary module. Gemma 4 passes its own ``layer``
    plan and ``rms_norm``."""
    config, rotary = text_model.config, text_model.rotary_emb
    ropes = {
        t: RopeTable(getattr(rotary, f"{t}_inv_freq"), getattr(rotary, f"{t}_attention_scaling"))
        for t in sorted(set(config.layer_types))
    }
    return DecoderPlan(
        layers=[layer(m) for m in text_model.layers],
        ropes=ropes,
        final_norm=partial(rms_norm, norm=text_model.norm),
    )
