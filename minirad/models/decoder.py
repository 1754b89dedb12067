"""PagedDecoder: our own forward pass of a Llama / Qwen2 text decoder, over the Hugging Face
model's weights, with attention through the paged KV cache.

Why not call the HF module? HF's attention keeps a contiguous per-sequence cache and a padded
``[batch, seq]`` layout. A serving engine needs the opposite: many sequences at different
stages (prefill chunks next to single-token decodes) in ONE flat batch of tokens, with K/V in a
shared pool of slots (:mod:`minirad.models.paged_attention`). So we rewrite the dozen lines of
the layer loop and keep everything else from HF: the weights (the modules' own tensors, plus on a
CPU a copy prepacked for steps of a few rows: :mod:`minirad.models.linear`), the RoPE
frequencies ``rotary_emb.inv_freq`` and ``attention_scaling`` (so scaled variants such as
llama3 or YaRN come out as HF computes them), the norm epsilons, the MLP activation and the
softmax scale.

One decoder layer (Llama; Qwen2 is the same plus biases on q/k/v, which the linears pick up
from the modules)::

    h = RMSNorm(x);  q, k, v = h Wq, h Wk, h Wv;  q, k = RoPE(q), RoPE(k)
    x = x + paged_attention(q, k, v) Wo
    h = RMSNorm(x);  x = x + (act(h Wgate) * (h Wup)) Wdown

Follows ``transformers/models/llama/modeling_llama.py`` (HF), vLLM's
``vllm/model_executor/models/llama.py`` and nano-vllm's ``models/qwen3.py`` for the flat-token
layout.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from minirad.errors import InvalidArgumentError, UnsupportedModelError
from minirad.kvcache.kv_pool import KVCache
from minirad.models.forward_batch import ForwardBatch
from minirad.models.linear import Linear
from minirad.models.paged_attention import split_batch, varlen_paged_attention

__all__ = ["SUPPORTED_TEXT_MODELS", "PagedDecoder", "check_text_config", "kv_cache_dims"]

SUPPORTED_TEXT_MODELS = ("llama", "qwen2")  # config.model_type of the text decoder
# RoPE variants whose frequencies are fixed at load time. "dynamic" and "longrope" rescale
# inv_freq with the sequence length inside HF's forward, which a paged cache cannot follow.
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def check_text_config(config) -> None:
    """Check that :class:`PagedDecoder` computes exactly what HF computes for this text config.

    Raises:
        UnsupportedModelError: not a Llama/Qwen2 decoder, a sequence-length-dependent RoPE,
            or sliding-window attention (Qwen2's ``use_sliding_window``).
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_TEXT_MODELS:
        raise UnsupportedModelError(
            f"text model type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_TEXT_MODELS)}"
        )
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in _STATIC_ROPE:
        raise UnsupportedModelError(
            f"rope_type {rope!r} is not supported; supported: {', '.join(_STATIC_ROPE)}"
        )
    layer_types = getattr(config, "layer_types", None) or ()
    if getattr(config, "use_sliding_window", False) or any(
        t != "full_attention" for t in layer_types
    ):
        raise UnsupportedModelError(
            "sliding-window attention is not supported; only full attention layers"
        )


def kv_cache_dims(config) -> dict[str, int]:
    """``num_layers``, ``num_kv_heads`` and ``head_dim`` of a model's text decoder: the
    model-given dimensions of a :class:`~minirad.kvcache.kv_pool.KVCache` (the caller picks
    ``num_blocks`` and ``block_size``). ``config`` is a VLM config or a text config (HF's
    ``get_text_config()`` finds the text part)."""
    c = config.get_text_config()
    return dict(
        num_layers=c.num_hidden_layers,
        num_kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
    )


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """HF's RMSNorm: normalise in fp32, cast back, then scale by the weight."""
    return F.rms_norm(x.float(), x.shape[-1:], eps=norm.variance_epsilon).to(x.dtype) * norm.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` on the two halves of the last dim (HF's RoPE layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _layer_linears(layer: nn.Module, prepack: bool) -> SimpleNamespace:
    """A decoder layer's seven projections as :class:`~minirad.models.linear.Linear`, by
    their HF names (``q_proj`` ... ``down_proj``)."""
    attn, mlp = layer.self_attn, layer.mlp
    modules = {n: getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    modules |= {n: getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")}
    return SimpleNamespace(**{n: Linear(m, prepack) for n, m in modules.items()})


class PagedDecoder:
    """A Llama/Qwen2 decoder stack running flat varlen batches against a :class:`KVCache`.

    Args:
        text_model: the HF text decoder module (``LlamaModel`` / ``Qwen2Model``: has
            ``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``), e.g.
            ``model.model.language_model`` of a LLaVA.
        lm_head: the output projection (``model.lm_head``; tied to ``embed_tokens`` or not).
        kv_cache: the pool K/V are written to and read from; its ``num_layers``,
            ``num_kv_heads`` and ``head_dim`` must match the model (:func:`kv_cache_dims`).
        prepack: on a CPU, keep a oneDNN-packed copy of each weight matrix for steps of a
            few rows (:mod:`minirad.models.linear`).
        cascade: decodes that share a prefix attend to it once
            (:mod:`minirad.models.cascade_attention`).

    Raises:
        UnsupportedModelError: see :func:`check_text_config`.
        InvalidArgumentError: ``kv_cache`` does not fit the model.
    """

    def __init__(
        self,
        text_model: nn.Module,
        lm_head: nn.Linear,
        kv_cache: KVCache,
        prepack: bool = True,
        cascade: bool = True,
    ) -> None:
        config = text_model.config
        check_text_config(config)
        dims = kv_cache_dims(config)
        got = dict(
            num_layers=kv_cache.num_layers,
            num_kv_heads=kv_cache.num_kv_heads,
            head_dim=kv_cache.head_dim,
        )
        if got != dims:
            raise InvalidArgumentError(f"KV cache dims {got} do not match the model's {dims}")
        self.text_model, self.lm_head, self.kv_cache = text_model, lm_head, kv_cache
        self.num_heads = config.num_attention_heads
        self.num_kv_heads, self.head_dim = dims["num_kv_heads"], dims["head_dim"]
        rotary = text_model.rotary_emb
        if rotary.inv_freq.numel() * 2 != self.head_dim:
            raise UnsupportedModelError("partial rotary embeddings are not supported")
        self.inv_freq, self.attention_scaling = rotary.inv_freq, rotary.attention_scaling
        # Flat [num_slots, num_kv_heads, head_dim] views of each layer, made once: views share
        # the pool's storage, so writes through them land in kv_cache.k_cache / v_cache.
        self.kv_views = [kv_cache.layer(i) for i in range(kv_cache.num_layers)]
        # Each layer's projections by HF's names: linears[i].q_proj(h) is h Wq of layer i.
        self.linears = [_layer_linears(layer, prepack) for layer in text_model.layers]
        self.lm_head_linear = Linear(lm_head, prepack)
        self.cascade = cascade
        self.kv_row_bytes = 2 * self.num_kv_heads * self.head_dim * kv_cache.k_cache.itemsize

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``cos, sin`` of shape ``[T, 1, head_dim]`` for positions ``[T]`` (HF's formula)."""
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        scale = self.attention_scaling
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, hidden]`` embeddings."""
        return self.text_model.embed_tokens(input_ids)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step: write every new token's K/V into the cache, return next-token logits.
        ``embeds`` (``[T, hidden]``, a VLM's, with images) replaces the token lookup.

        Returns:
            ``[len(batch.logits_indices), vocab_size]`` logits, in the dtype of the model.
        """
        x = self.embed(batch.input_ids) if embeds is None else embeds
        T = x.shape[0]
        cos, sin = self.rope(batch.positions, x.dtype)
        # Decodes and prefills in separate calls, so no decode is padded to a prompt's length.
        groups = split_batch(
            batch.slot_mapping,
            batch.kv_slots,
            batch.seq_lens,
            batch.query_lens,
            self.kv_row_bytes,
            self.cascade,
        )
        layers = zip(self.text_model.layers, self.linears, self.kv_views, strict=True)
        for layer, w, (k_cache, v_cache) in layers:
            h = rms_norm(x, layer.input_layernorm)
            q = w.q_proj(h).view(T, self.num_heads, self.head_dim)
            k = w.k_proj(h).view(T, self.num_kv_heads, self.head_dim)
            v = w.v_proj(h).view(T, self.num_kv_heads, self.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            o = varlen_paged_attention(q, k, v, k_cache, v_cache, groups, layer.self_attn.scaling)
            x = x + w.o_proj(o.reshape(T, -1))
            h = rms_norm(x, layer.post_attention_layernorm)
            x = x + w.down_proj(layer.mlp.act_fn(w.gate_proj(h)) * w.up_proj(h))  # SwiGLU
        # The final norm is per token, so only the rows that need logits go through it.
        x = x.index_select(0, batch.logits_indices)
        return self.lm_head_linear(rms_norm(x, self.text_model.norm))

    __call__ = forward
