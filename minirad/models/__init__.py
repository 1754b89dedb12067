"""The model side of the engine: our paged decoder over Hugging Face weights, and VLM adapters.

- :class:`ForwardBatch` (``forward_batch.py``): one step's tokens, positions and KV slots.
- :class:`PagedDecoder` (``decoder.py``): one layer loop over HF weights for Llama / Qwen2
  (``llama.py``) and the sliding-window hybrids Gemma 3 and Gemma 4 text (``gemma3.py``,
  ``gemma4.py``), each family a per-layer plan (``layer_plan.py``); attention through
  :mod:`minirad.models.paged_attention` (a window per layer; :mod:`minirad.models.cascade_attention`
  for decodes that share a prefix), matmuls through :mod:`minirad.models.linear`.
- ``text_config.py``: which text decoders we run (:func:`check_text_config`), their KV
  dimensions, and each layer's KV-cache spec and group (:func:`layer_specs`,
  :func:`layer_groups`).
- :class:`VLMFamily`, :func:`get_family`, :func:`load_model` (``families.py``): which VLMs we
  run and where their parts live.
- :class:`PagedVLM`, :func:`image_features_for_chunk`, :func:`image_spans` (``vlm.py``): images
  into a prefill.
"""

from __future__ import annotations

from minirad.lazy import lazy_exports

# Public name -> the module of this package that defines it, imported on first use (so
# ``minirad.models.sampling_params`` and the other light modules never pull in torch).
_EXPORTS: dict[str, str] = {
    "PagedDecoder": "decoder",
    "SUPPORTED_TEXT_MODELS": "text_config",
    "check_text_config": "text_config",
    "kv_cache_dims": "text_config",
    "layer_groups": "text_config",
    "layer_specs": "text_config",
    "layer_windows": "text_config",
    "DEFAULT_MODEL_DIR": "families",
    "FAMILIES": "families",
    "VLMFamily": "families",
    "get_family": "families",
    "load_model": "families",
    "ForwardBatch": "forward_batch",
    "KVGroupSlots": "forward_batch",
    "PagedVLM": "vlm",
    "image_features_for_chunk": "vlm",
    "image_spans": "vlm",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
