"""What a model family puts into the decoder's one layer loop: its norms, RoPE tables and windows.

Llama, Qwen2 and Gemma 3 layers are one skeleton (:class:`~minirad.models.PagedDecoder`)::

    h = input_norm(x);  q, k, v = h Wq, h Wk, h Wv
    q, k, v = q_norm(q), k_norm(k), v_norm(v)    # per head
    q, k = RoPE(q), RoPE(k)                      # the layer's table: local or global bases
    a = paged_attention(q, k, v) Wo              # full, or over the layer's sliding window
    x = x + post_attn_norm(a)
    h = pre_mlp_norm(x);  m = (act(h Wgate) * (h Wup)) Wdown
    x = (x + post_mlp_norm(m)) * layer_scalar

and the logits are ``final_norm(x) Wout``. A family says which of these parts a layer
has (a missing norm is the identity: Llama has no q/k norms and no "sandwich" norms around
attention and MLP) and how each computes (Llama's RMSNorm scales by ``w``, Gemma 3's by
``1 + w``). Each family's module (:mod:`minirad.models.llama`, :mod:`minirad.models.gemma3`,
:mod:`minirad.models.gemma4`) turns an HF text model into a :class:`DecoderPlan`; the decoder
runs any plan with the same loop, so there is one place for attention, RoPE and the residual
stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["DecoderPlan", "LayerPlan", "Norm", "RopeTable"]

Norm = Callable[[torch.Tensor], torch.Tensor]
"""A norm over the last dim: ``[..., d] -> [..., d]`` (bound to its HF module's weight)."""


@dataclass(frozen=True)
class RopeTable:
    """One set of RoPE frequencies, read from HF's rotary module (so a scaled variant such as
    llama3, linear or YaRN comes out as HF computes it).

    Attributes:
        inv_freq: ``[head_dim // 2]`` inverse frequencies.
        attention_scaling: the factor HF multiplies cos and sin by (1 unless YaRN and kin).
    """

    inv_freq: torch.Tensor
    attention_scaling: float


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer's family-specific parts (see the module docstring).

    Attributes:
        input_norm: before attention.
        pre_mlp_norm: before the MLP (Llama's ``post_attention_layernorm``, Gemma's
            ``pre_feedforward_layernorm``).
        act: the MLP's activation (SiLU, GELU-tanh...), HF's ``mlp.act_fn``.
        scale: the softmax scale, HF's ``self_attn.scaling`` (Gemma:
            ``query_pre_attn_scalar ** -0.5``).
        head_dim: of this layer's queries, keys and values.
        rope: the key of this layer's :class:`RopeTable` in :attr:`DecoderPlan.ropes`.
        sliding_window: ``W`` (query ``p`` sees keys ``p - W + 1 .. p``), or None.
        q_norm, k_norm: per-head norms of the queries and keys before RoPE, or None.
        v_norm: a per-head norm of the values (Gemma 4; only with ``q_norm``), or None.
        post_attn_norm, post_mlp_norm: norms of the attention and MLP outputs before they
            join the residual stream, or None.
        layer_scalar: a tensor the residual stream is multiplied by (in place, as HF does)
            at the end of the layer (Gemma 4), or None.
    """

    input_norm: Norm
    pre_mlp_norm: Norm
    act: Callable[[torch.Tensor], torch.Tensor]
    scale: float
    head_dim: int
    rope: str = "default"
    sliding_window: int | None = None
    q_norm: Norm | None = None
    k_norm: Norm | None = None
    v_norm: Norm | None = None
    post_attn_norm: Norm | None = None
    post_mlp_norm: Norm | None = None
    layer_scalar: torch.Tensor | None = None


@dataclass(frozen=True)
class DecoderPlan:
    """A whole text decoder's family-specific parts.

    Attributes:
        layers: one :class:`LayerPlan` per HF decoder layer, in order.
        ropes: the RoPE tables the layers name (one for Llama; local and global for Gemma).
        final_norm: before the output projection.

    (A final logit softcap is not the text model's: HF's ``Gemma3ForCausalLM`` applies it,
    a LLaVA around the same text model does not. The decoder takes it from the caller.)
    """

    layers: list[LayerPlan]
    ropes: dict[str, RopeTable]
    final_norm: Norm
