"""The model side of the engine: our paged decoder over Hugging Face weights, and VLM adapters.

- :class:`ForwardBatch` (``forward_batch.py``): one step's tokens, positions and KV slots.
- :class:`PagedDecoder` (``decoder.py``): Llama / Qwen2 layers over HF weights, attention
  through :mod:`minirad.paged_attention`.
- :class:`VLMFamily`, :func:`get_family`, :func:`load_model` (``families.py``): which VLMs we
  run and where their parts live.
- :class:`PagedVLM`, :func:`image_features_for_chunk` (``vlm.py``): images into a prefill.
"""

from .decoder import SUPPORTED_TEXT_MODELS, PagedDecoder, check_text_config, kv_cache_dims
from .families import DEFAULT_MODEL_DIR, FAMILIES, VLMFamily, get_family, load_model
from .forward_batch import ForwardBatch
from .vlm import PagedVLM, image_features_for_chunk

__all__ = [
    "DEFAULT_MODEL_DIR",
    "FAMILIES",
    "SUPPORTED_TEXT_MODELS",
    "ForwardBatch",
    "PagedDecoder",
    "PagedVLM",
    "VLMFamily",
    "check_text_config",
    "get_family",
    "image_features_for_chunk",
    "kv_cache_dims",
    "load_model",
]
