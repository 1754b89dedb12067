"""Which Hugging Face VLMs the engine runs, where their parts live, and how to load one.

A VLM is a vision tower, a projector that maps patch features to the text model's hidden size,
and a text decoder whose input embeddings have image placeholders replaced by those features.
Families differ in module paths and image inputs, not in the decoder: every supported family
has a text decoder :class:`~minirad.models.PagedDecoder` runs (Llama, Qwen2, or the hybrid
Gemma 3 text with its sliding-window layers; :func:`~minirad.models.check_text_config`).

Module map for ``transformers`` 5.24 (see the project's VLM notes, §3.1):

=========  ==============================  ======================  ===========================
family     text decoder                    vision tower            projector
=========  ==============================  ======================  ===========================
llava      ``model.language_model``        ``model.vision_tower``  ``model.multi_modal_projector``
idefics3   ``model.text_model``            ``model.vision_model``  ``model.connector``
gemma3     ``model.language_model``        ``model.vision_tower``  ``model.multi_modal_projector``
=========  ==============================  ======================  ===========================

Gemma 3 (``Gemma3ForConditionalGeneration``: a SigLIP tower, a projector that average-pools the
patches to ``mm_tokens_per_image`` rows, RMS-norms and projects them, and the Gemma 3 text
model) differs in one more way: its image tokens attend *bidirectionally* within their image.
HF builds the mask from ``token_type_ids`` (``create_masks_for_vision_model``): a maximal run of
image tokens is one block, and a query in a block sees every key of that block, later ones
included; full layers ``causal OR same block``, sliding layers ``window AND (causal OR same
block)`` (``window``: the key is less than ``sliding_window`` positions back). The family says
so (``bidirectional_images``) and :class:`~minirad.models.PagedVLM` passes each image's span
to attention (``ForwardBatch.bidirectional_spans``).

Images always go through the model's own ``model.get_image_features(...).pooler_output``
(tower + projector), so feature selection (CLS dropping, pixel shuffle) is HF's. The KV cache
dimensions come from the text config alone (:func:`~minirad.models.kv_cache_dims`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from minirad.errors import InvalidArgumentError, UnsupportedModelError
from minirad.models.text_config import check_text_config

__all__ = ["DEFAULT_MODEL_DIR", "FAMILIES", "VLMFamily", "get_family", "load_model"]

# The course's shipped model (trained by ``python -m minirad.course.train``): the offline default of
# the CLI, the benchmarks and the chapters.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "data" / "models" / "minirad-tiny-llava"


@dataclass(frozen=True)
class VLMFamily:
    """Where one VLM family keeps its parts (dotted module paths from the top-level model).

    Attributes:
        model_type: ``config.model_type`` (the registry key).
        architecture: the ``*ForConditionalGeneration`` class name (``config.architectures``).
        text_model_path, vision_tower_path, projector_path: module paths.
        image_input_names: the processor outputs ``get_image_features`` takes.
        bidirectional_images: an image's tokens see each other, later ones included (Gemma
            3); False: causal, as text.
    """

    model_type: str
    architecture: str
    text_model_path: str
    vision_tower_path: str
    projector_path: str
    image_input_names: tuple[str, ...]
    bidirectional_images: bool = False

    def text_model(self, model: nn.Module) -> nn.Module:
        return model.get_submodule(self.text_model_path)

    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.get_submodule(self.vision_tower_path)

    def projector(self, model: nn.Module) -> nn.Module:
        return model.get_submodule(self.projector_path)


FAMILIES: dict[str, VLMFamily] = {
    f.model_type: f
    for f in (
        VLMFamily(
            model_type="llava",
            architecture="LlavaForConditionalGeneration",
            text_model_path="model.language_model",
            vision_tower_path="model.vision_tower",
            projector_path="model.multi_modal_projector",
            image_input_names=("pixel_values",),
        ),
        VLMFamily(  # SmolVLM
            model_type="idefics3",
            architecture="Idefics3ForConditionalGeneration",
            text_model_path="model.text_model",
            vision_tower_path="model.vision_model",
            projector_path="model.connector",
            image_input_names=("pixel_values", "pixel_attention_mask"),
        ),
        VLMFamily(
            model_type="gemma3",
            architecture="Gemma3ForConditionalGeneration",
            text_model_path="model.language_model",
            vision_tower_path="model.vision_tower",
            projector_path="model.multi_modal_projector",
            image_input_names=("pixel_values",),
            bidirectional_images=True,
        ),
    )
}


def _supported() -> str:
    return ", ".join(f"{f.architecture} ({f.model_type})" for f in FAMILIES.values())


def get_family(config) -> VLMFamily:
    """The family of a VLM config, after checking its text decoder is one we run exactly.

    Raises:
        UnsupportedModelError: unknown ``model_type`` or ``architectures``, or an unsupported
            text decoder (:func:`~minirad.models.decoder.check_text_config`); the message names
            the supported families.
    """
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    archs = getattr(config, "architectures", None) or []
    if family is None or (archs and family.architecture not in archs):
        raise UnsupportedModelError(
            f"unsupported model (model_type={model_type!r}, architectures={archs}); "
            f"supported: {_supported()}"
        )
    try:
        check_text_config(config.text_config)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{family.architecture}: {e}") from e
    return family


def load_model(
    path: str | os.PathLike,
    *,
    allow_hub: bool = False,
    dtype: torch.dtype = torch.float32,
    load_processor: bool = True,
):
    """Load a supported VLM (and its processor) from a local directory, in eval mode.

    Weights are read from safetensors only (``use_safetensors=True``: a pickle checkpoint can
    run code when loaded) and no code from the checkpoint is ever run
    (``trust_remote_code=False``). The config is checked before any weight is read.

    Args:
        path: a directory written by ``save_pretrained`` (or a Hub repo id if ``allow_hub``).
        allow_hub: let Hugging Face download missing files; off by default (offline course).
        dtype: parameter dtype (fp32 for exact parity with HF on CPU).
        load_processor: also load the ``AutoProcessor`` (tokenizer + image processor).

    Returns:
        ``(model, processor)``; ``processor`` is None when ``load_processor`` is False.

    Raises:
        InvalidArgumentError: ``path`` is not a directory and ``allow_hub`` is False.
        UnsupportedModelError: the config is not a supported family (see :func:`get_family`).
    """
    if not allow_hub and not os.path.isdir(path):
        raise InvalidArgumentError(f"{path!s} is not a model directory (and allow_hub is False)")
    offline = dict(local_files_only=not allow_hub, trust_remote_code=False)
    config = AutoConfig.from_pretrained(path, **offline)
    get_family(config)
    model = AutoModelForImageTextToText.from_pretrained(
        path, config=config, dtype=dtype, use_safetensors=True, **offline
    ).eval()
    processor = AutoProcessor.from_pretrained(path, **offline) if load_processor else None
    return model, processor
