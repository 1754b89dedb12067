"""PagedVLM: a Hugging Face VLM served through our paged decoder.

Prefill with images, as HF does it: embed the prompt's token ids, then overwrite the image
placeholder positions (``input_ids == image_token_id``) with the image features, in order
(HF's ``inputs_embeds.masked_scatter(special_image_mask, image_features)``). An engine adds one
twist: a prefill *chunk* may start in the middle of an image (chunked prefill, or a cached
prefix that ends inside an image), so a chunk gets only its own slice of the features:
:func:`image_features_for_chunk`. SGLang does the same in
``sglang/srt/managers/mm_utils.py`` (``get_embedding_chunk``, from the chunk's
``extend_prefix_len``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from minirad.errors import ImageError
from minirad.kvcache.kv_pool import KVCache
from minirad.models.decoder import PagedDecoder
from minirad.models.families import VLMFamily, get_family
from minirad.models.forward_batch import ForwardBatch

__all__ = ["PagedVLM", "image_features_for_chunk"]


def image_features_for_chunk(
    input_ids: Sequence[int],
    start: int,
    end: int,
    image_token_id: int,
    image_features: torch.Tensor | Sequence[torch.Tensor],
) -> torch.Tensor | None:
    """The rows of a prompt's image features that belong to the chunk ``input_ids[start:end]``.

    Args:
        input_ids: the whole prompt, with image placeholders as ``image_token_id``.
        start, end: the chunk, in tokens.
        image_token_id: the placeholder id.
        image_features: the prompt's features in placeholder order: ``[n, hidden]``, or a
            list of per-image tensors (as :meth:`PagedVLM.encode_images` returns them).

    Returns:
        ``[placeholders in the chunk, hidden]``, or None when the chunk has none.

    Raises:
        ImageError: the prompt's placeholder count differs from the number of feature rows.
    """
    if not isinstance(image_features, torch.Tensor):
        image_features = torch.cat(list(image_features))
    is_image = [t == image_token_id for t in input_ids]
    if sum(is_image) != image_features.shape[0]:
        raise ImageError(
            f"prompt has {sum(is_image)} image placeholders but {image_features.shape[0]} "
            f"feature rows"
        )
    before, inside = sum(is_image[:start]), sum(is_image[start:end])
    return image_features[before : before + inside] if inside else None


class PagedVLM:
    """A supported HF VLM whose text decoder runs through :class:`PagedDecoder`.

    Args:
        model: a ``*ForConditionalGeneration`` of a family in
            :data:`~minirad.models.FAMILIES` (e.g. from :func:`~minirad.models.load_model`).
        kv_cache: the KV pool (dims from :func:`~minirad.models.kv_cache_dims` of
            ``model.config``).
        prepack: keep oneDNN-packed copies of the text weights on a CPU
            (:mod:`minirad.models.linear`).
        cascade: decodes that share a prefix attend to it once
            (:mod:`minirad.models.cascade_attention`).

    Raises:
        UnsupportedModelError: the model's family or text decoder is not supported.
        InvalidArgumentError: ``kv_cache`` does not fit the model.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        prepack: bool = True,
        cascade: bool = True,
    ) -> None:
        self.model = model
        self.family: VLMFamily = get_family(model.config)
        self.image_token_id: int = model.config.image_token_id
        text_model = self.family.text_model(model)
        self.decoder = PagedDecoder(text_model, model.lm_head, kv_cache, prepack, cascade)

    @property
    def kv_cache(self) -> KVCache:
        return self.decoder.kv_cache

    @torch.inference_mode()
    def encode_images(self, image_inputs: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Image features of one prompt, through the model's own vision tower and projector.

        Args:
            image_inputs: the processor's output for the prompt (extra keys such as
                ``input_ids`` are ignored); e.g. ``pixel_values``.

        Returns:
            HF's ``pooler_output``: a list of ``[tokens, hidden]`` tensors in placeholder order
            (LLaVA: one per image; Idefics3: one per prompt, all its tiles and images).
        """
        kwargs = {k: image_inputs[k] for k in self.family.image_input_names if k in image_inputs}
        out = self.model.model.get_image_features(**kwargs, return_dict=True)
        return list(out.pooler_output)

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """``[T, hidden]`` input embeddings of a batch: the token embeddings, with the rows at
        ``batch.mm_token_indices`` replaced by ``batch.mm_features``."""
        embeds = self.decoder.embed(batch.input_ids)
        if batch.mm_features is not None:
            embeds.index_copy_(0, batch.mm_token_indices, batch.mm_features.to(embeds.dtype))
        return embeds

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """One engine step (see :meth:`PagedDecoder.forward`): ``[num_logits, vocab]``."""
        return self.decoder.forward(batch, self.embed(batch))

    __call__ = forward
