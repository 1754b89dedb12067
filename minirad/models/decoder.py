"""PagedDecoder: our own forward pass of a Llama / Qwen2 / Gemma 3 / Gemma 4 text decoder, over
the Hugging Face model's weights, with attention through the paged KV cache.

Why not call the HF module? HF's attention keeps a contiguous per-sequence cache and a padded
``[batch, seq]`` layout. A serving engine needs the opposite: many sequences at different
stages (prefill chunks next to single-token decodes) in ONE flat batch of tokens, with K/V in a
shared pool of slots (:mod:`minirad.models.paged_attention`). So we rewrite the dozen lines of
the layer loop and keep everything else from HF: the weights (the modules' own tensors, plus on a
CPU a copy prepacked for steps of a few rows: :mod:`minirad.models.linear`), the embedding
module (Gemma's scales its output), the RoPE frequencies and ``attention_scaling`` of HF's
rotary module (so scaled variants such as llama3 or YaRN come out as HF computes them), the
norm epsilons, the MLP activation and the softmax scale.

There is one layer loop for every family. What differs between them (which norms a layer has
and how they compute, which RoPE table and sliding window it uses) is
a :class:`~minirad.models.layer_plan.DecoderPlan` that the family's module builds from the HF
model: :mod:`minirad.models.llama` (Llama, Qwen2), :mod:`minirad.models.gemma3`,
:mod:`minirad.models.gemma4`.

KV groups: a hybrid model may keep its sliding-window layers' K/V in a slot space of their own
(see :mod:`minirad.models.forward_batch`). ``layer_groups[i]`` says which of the batch's slot
groups layer ``i`` reads, and the pools hold the layers: one :class:`KVCache` for all layers
(each layer indexes its own tensor with its group's slots, as vLLM's groups share one block
pool), or one per group holding that group's layers in order (SGLang's separate SWA pool).

Follows ``transformers/models/llama/modeling_llama.py`` and ``gemma3/modeling_gemma3.py``
(HF), vLLM's ``vllm/model_executor/models/llama.py`` and nano-vllm's ``models/qwen3.py`` for
the flat-token layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import torch
from torch import nn

from minirad.errors import InvalidArgumentError, UnsupportedModelError
from minirad.kvcache.kv_pool import KVCache
from minirad.models import gemma3, gemma4, llama
from minirad.models.forward_batch import ForwardBatch
from minirad.models.layer_plan import DecoderPlan, RopeTable
from minirad.models.linear import Linear
from minirad.models.paged_attention import split_batch, varlen_paged_attention
from minirad.models.text_config import SUPPORTED_TEXT_MODELS, check_text_config, kv_cache_dims

__all__ = ["SUPPORTED_TEXT_MODELS", "PagedDecoder", "check_text_config", "kv_cache_dims"]


def decoder_plan(text_model: nn.Module) -> DecoderPlan:
    """The family-specific parts of an HF text decoder whose config passed
    :func:`check_text_config`."""
    model_type = text_model.config.model_type
    if model_type in gemma3.MODEL_TYPES:
        return gemma3.plan(text_model)
    if model_type in gemma4.MODEL_TYPES:
        return gemma4.plan(text_model)
    return llama.plan(text_model)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` on the two halves of the last dim (HF's RoPE layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(
    positions: torch.Tensor, table: RopeTable, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[T, 1, head_dim]`` for positions ``[T]`` (HF's formula)."""
    freqs = positions[:, None].float() * table.inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    scale = table.attention_scaling
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def _layer_linears(layer: nn.Module, prepack: bool) -> SimpleNamespace:
    """A decoder layer's seven projections as :class:`~minirad.models.linear.Linear`, by
    their HF names (``q_proj`` ... ``down_proj``)."""
    attn, mlp = layer.self_attn, layer.mlp
    modules = {n: getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    modules |= {n: getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")}
    return SimpleNamespace(**{n: Linear(m, prepack) for n, m in modules.items()})


def _kv_views(
    pools: Sequence[KVCache], layer_groups: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's flat ``[num_slots, num_kv_heads, head_dim]`` K and V views: from the one
    pool, or from its group's pool, where it is the group's n-th layer.

    Raises:
        InvalidArgumentError: the pools do not hold the layers.
    """
    n = len(layer_groups)
    if len(pools) == 1:
        if pools[0].num_layers != n:
            raise InvalidArgumentError(f"the KV pool holds {pools[0].num_layers} layers, not {n}")
        return [pools[0].layer(i) for i in range(n)]
    per_group = [layer_groups.count(g) for g in range(len(pools))]
    if sum(per_group) != n or [p.num_layers for p in pools] != per_group:
        raise InvalidArgumentError(
            f"{len(pools)} KV pools of {[p.num_layers for p in pools]} layers cannot hold "
            f"KV groups of {per_group} layers (layer_groups={layer_groups})"
        )
    seen = [0] * len(pools)
    views = []
    for g in layer_groups:
        views.append(pools[g].layer(seen[g]))
        seen[g] += 1
    return views


class PagedDecoder:
    """A text decoder stack (Llama, Qwen2, Gemma 3 and 4) running flat varlen batches against
    paged KV pools.

    Args:
        text_model: the HF text decoder module (``LlamaModel`` / ``Qwen2Model`` /
            ``Gemma3TextModel`` / ``Gemma4TextModel``: has ``embed_tokens``, ``layers``,
            ``norm``, ``rotary_emb``), e.g. ``model.model.language_model`` of a LLaVA, or
            ``model.model`` of a ``*ForCausalLM``.
        lm_head: the output projection (``model.lm_head``; tied to ``embed_tokens`` or not).
        kv_cache: the pool K/V are written to and read from: one :class:`KVCache` of all the
            layers, or one per KV group, each of its group's layers in order. Each layer's
            ``num_kv_heads`` and ``head_dim`` must match the model (:func:`kv_cache_dims`).
        prepack: on a CPU, keep a oneDNN-packed copy of each weight matrix for steps of a
            few rows (:mod:`minirad.models.linear`).
        cascade: decodes that share a prefix attend to it once
            (:mod:`minirad.models.cascade_attention`); full-attention layers only.
        layer_groups: the KV group (the batch's slot space,
            :meth:`~minirad.models.ForwardBatch.kv_group`) each layer reads and writes, e.g.
            from :func:`~minirad.models.text_config.layer_groups`; None: all in group 0.
        logit_softcap: ``c`` to soft-cap the logits as HF's Gemma heads do,
            ``c * tanh(logits / c)``; None: as they come. It belongs to the head HF wraps
            around the text model (``Gemma3ForCausalLM`` caps with its config's
            ``final_logit_softcapping``, a ``LlavaForConditionalGeneration`` around the same
            text model does not), so the caller says: :meth:`for_causal_lm` reads it.

    Raises:
        UnsupportedModelError: see :func:`check_text_config`.
        InvalidArgumentError: ``kv_cache`` does not fit the model, or ``layer_groups`` does
            not name a group for each layer.
    """

    def __init__(
        self,
        text_model: nn.Module,
        lm_head: nn.Linear,
        kv_cache: KVCache | Sequence[KVCache],
        prepack: bool = True,
        cascade: bool = True,
        layer_groups: Sequence[int] | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        config = text_model.config
        check_text_config(config)
        pools = (kv_cache,) if isinstance(kv_cache, KVCache) else tuple(kv_cache)
        n = len(text_model.layers)
        groups = [0] * n if layer_groups is None else list(layer_groups)
        if len(groups) != n or not all(isinstance(g, int) and g >= 0 for g in groups):
            raise InvalidArgumentError(f"layer_groups must be {n} group numbers, got {groups}")
        if len(pools) == 1:  # the pool's dims against the config's, as a whole
            dims = kv_cache_dims(config)
            got = dict(
                num_layers=pools[0].num_layers,
                num_kv_heads=pools[0].num_kv_heads,
                head_dim=pools[0].head_dim,
            )
            if got != dims:
                raise InvalidArgumentError(f"KV cache dims {got} do not match the model's {dims}")
        self.text_model, self.lm_head = text_model, lm_head
        self.kv_caches: tuple[KVCache, ...] = pools
        self.kv_cache = pools[0]  # the one pool of a single-group model
        self.layer_groups = groups
        self.plan = decoder_plan(text_model)
        # Flat [num_slots, num_kv_heads, head_dim] views of each layer, made once: views share
        # the pool's storage, so writes through them land in kv_cache.k_cache / v_cache.
        self.kv_views = _kv_views(pools, groups)
        # Each layer's projections by HF's names: linears[i].q_proj(h) is h Wq of layer i.
        self.linears = [_layer_linears(layer, prepack) for layer in text_model.layers]
        self.lm_head_linear = Linear(lm_head, prepack)
        self.cascade = cascade
        self.logit_softcap = logit_softcap
        # The attention kinds: the layers that share a slot group and a window share one
        # split of each batch. kv_row_bytes: one token's K and V in one such layer.
        self.layer_kinds = [
            (g, p.sliding_window) for g, p in zip(groups, self.plan.layers, strict=True)
        ]
        self.kv_row_bytes: dict[tuple[int, int | None], int] = {}
        for kind, p, w, (k_cache, _) in zip(
            self.layer_kinds, self.plan.layers, self.linears, self.kv_views, strict=True
        ):
            kv_heads = w.k_proj.weight.shape[0] // p.head_dim
            if tuple(k_cache.shape[1:]) != (kv_heads, p.head_dim):
                raise InvalidArgumentError(
                    f"a layer of {kv_heads} KV heads of {p.head_dim} reads a pool of "
                    f"{tuple(k_cache.shape[1:])}"
                )
            if self.plan.ropes[p.rope].inv_freq.numel() * 2 != p.head_dim:
                raise UnsupportedModelError("partial rotary embeddings are not supported")
            self.kv_row_bytes[kind] = 2 * k_cache[0].numel() * k_cache.itemsize

    @classmethod
    def for_causal_lm(
        cls, model: nn.Module, kv_cache: KVCache | Sequence[KVCache], **kwargs
    ) -> PagedDecoder:
        """The decoder of an HF ``*ForCausalLM`` (``model.model``, ``model.lm_head``), with
        the logit softcap its forward applies (``config.final_logit_softcapping``, if any).
        ``kwargs`` as for the constructor."""
        cap = getattr(model.config, "final_logit_softcapping", None)
        return cls(model.model, model.lm_head, kv_cache, logit_softcap=cap, **kwargs)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, hidden]`` embeddings (HF's module: Gemma's scales them)."""
        return self.text_model.embed_tokens(input_ids)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step: write every new token's K/V into the cache, return next-token logits.
        ``embeds`` (``[T, hidden]``, a VLM's, with images) replaces the token lookup.

        Returns:
            ``[len(batch.logits_indices), vocab_size]`` logits, in the dtype of the model.

        Raises:
            InvalidArgumentError: a layer reads a KV group the batch carries no slots for.
        """
        x = self.embed(batch.input_ids) if embeds is None else embeds
        T = x.shape[0]
        ropes = {key: rope(batch.positions, t, x.dtype) for key, t in self.plan.ropes.items()}
        # Per attention kind, decodes and prefills in separate calls, so no decode is padded to
        # a prompt's length; a windowed kind gathers each sequence's window only.
        attention = {}
        for (group, window), row_bytes in self.kv_row_bytes.items():
            slots = batch.kv_group(group)
            attention[group, window] = split_batch(
                slots.slot_mapping,
                slots.kv_slots,
                batch.seq_lens,
                batch.query_lens,
                row_bytes,
                self.cascade,
                window,
                batch.bidirectional_spans,
            )
        layers = zip(self.plan.layers, self.linears, self.kv_views, self.layer_kinds, strict=True)
        for p, w, (k_cache, v_cache), kind in layers:
            h = p.input_norm(x)
            q = w.q_proj(h).view(T, -1, p.head_dim)
            k = w.k_proj(h).view(T, -1, p.head_dim)
            v = w.v_proj(h).view(T, -1, p.head_dim)
            if p.q_norm is not None:  # Gemma: each head normed before RoPE
                q, k = p.q_norm(q), p.k_norm(k)
                if p.v_norm is not None:  # Gemma 4: the values too
                    v = p.v_norm(v)
            cos, sin = ropes[p.rope]
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            o = varlen_paged_attention(q, k, v, k_cache, v_cache, attention[kind], p.scale)
            o = w.o_proj(o.reshape(T, -1))
            x = x + (o if p.post_attn_norm is None else p.post_attn_norm(o))
            h = p.pre_mlp_norm(x)
            m = w.down_proj(p.act(w.gate_proj(h)) * w.up_proj(h))  # SwiGLU / GeGLU
            x = x + (m if p.post_mlp_norm is None else p.post_mlp_norm(m))
            if p.layer_scalar is not None:  # Gemma 4
                x *= p.layer_scalar
        # The final norm is per token, so only the rows that need logits go through it.
        x = x.index_select(0, batch.logits_indices)
        logits = self.lm_head_linear(self.plan.final_norm(x))
        cap = self.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    __call__ = forward
