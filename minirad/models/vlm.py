"""PagedVLM: a Hugging Face VLM served through our paged decoder.

Prefill with images, as HF does it: embed the prompt's token ids, then overwrite the image
placeholder positions (``input_ids == image_token_id``) with the image features, in order
(HF's ``inputs_embeds.masked_scatter(special_image_mask, image_features)``). An engine adds one
twist: a prefill *chunk* may start in the middle of an image (chunked prefill, or a cached
prefix that ends inside an image), so a chunk gets only its own slice of the features:
:func:`image_features_for_chunk`. SGLang does the same in
``sglang/srt/managers/mm_utils.py`` (``get_embedding_chunk``, from the chunk's
``extend_prefix_len``).

Gemma 3's image tokens attend bidirectionally within their image (HF's ``token_type_ids``
mask; see :mod:`minirad.models.families`). :func:`image_spans` finds each image in a step
from its placeholder rows and hands attention its span (``ForwardBatch.bidirectional_spans``).
An image token's K/V then depend on the *later* tokens of its image, so an image must be
computed whole, in one step: a chunk that holds part of an image (a prefill chunk cut inside
it, or a cached prefix ending inside it) cannot be computed as HF does, and the model refuses
it (:class:`~minirad.errors.ImageError`) rather than answer something else. A scheduler that
serves this family must therefore cut chunks at image boundaries (vLLM's
``disable_chunked_mm_input``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from minirad.errors import ImageError
from minirad.kvcache.kv_pool import KVCache
from minirad.models.decoder import PagedDecoder
from minirad.models.families import VLMFamily, get_family
from minirad.models.forward_batch import ForwardBatch

__all__ = ["PagedVLM", "image_features_for_chunk", "image_spans"]


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


def image_spans(batch: ForwardBatch, tokens_per_image: int) -> torch.Tensor | None:
    """Each image token's span, for a family whose image tokens see their whole image.

    An image is a maximal run of placeholder rows (``batch.mm_token_indices``) of one
    sequence at consecutive positions (HF's blocks: consecutive image tokens, which a Gemma 3
    prompt always brackets with ``<start_of_image>`` and ``<end_of_image>``). Every image has
    ``tokens_per_image`` placeholders, so a run of another length is part of an image whose
    other part is in another step.

    Returns:
        ``[T, 2]`` int64: per token, the positions ``lo, hi`` of its image (``hi``
        exclusive), ``(0, 0)`` for a text token; None when the step has no image token.

    Raises:
        ImageError: a run is not a whole number of images: the step holds only part of an
            image, whose tokens must see the rest (a chunk boundary inside the image).
    """
    if batch.mm_token_indices is None:
        return None
    rows = batch.mm_token_indices.tolist()
    positions = batch.positions.tolist()
    ends = torch.cumsum(batch.query_lens, 0).tolist()  # one past each sequence's last row
    spans = [[0, 0] for _ in positions]
    seq, run = 0, []

    def close(run: list[int]) -> None:
        if len(run) % tokens_per_image:
            first, last = positions[run[0]], positions[run[-1]]
            raise ImageError(
                f"positions {first}..{last} of sequence {seq} are {len(run)} image tokens, "
                f"not a whole image of {tokens_per_image}: this family's image tokens attend "
                "to their whole image, so an image must be computed in one step (do not cut a "
                "prefill chunk, or end a cached prefix, inside an image)"
            )
        for r in run:
            spans[r] = [positions[run[0]], positions[run[-1]] + 1]

    for r in rows:
        if run and (r != run[-1] + 1 or r >= ends[seq]):  # a gap, or the next sequence
            close(run)
            run = []
        while r >= ends[seq]:
            seq += 1
        run.append(r)
    if run:
        close(run)
    return torch.tensor(spans, dtype=torch.int64, device=batch.positions.device)


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
        bidirectional_images: let an image's tokens see each other (:func:`image_spans`);
            None: as the family does (Gemma 3 only). False on Gemma 3 computes the causal
            variant, which is not HF's model (a lesson, and what some engines serve).

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
        bidirectional_images: bool | None = None,
    ) -> None:
        self.model = model
        self.family: VLMFamily = get_family(model.config)
        self.image_token_id: int = model.config.image_token_id
        if bidirectional_images is None:
            bidirectional_images = self.family.bidirectional_images
        # Placeholders per image, for a family whose image tokens see their whole image.
        self.tokens_per_image: int | None = (
            model.config.mm_tokens_per_image if bidirectional_images else None
        )
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
        """One engine step (see :meth:`PagedDecoder.forward`): ``[num_logits, vocab]``.

        Raises:
            ImageError: Gemma 3 and the step holds part of an image only (:func:`image_spans`).
        """
        if self.tokens_per_image is not None and batch.bidirectional_spans is None:
            spans = image_spans(batch, self.tokens_per_image)
            if spans is not None:
                batch = replace(batch, bidirectional_spans=spans)
        return self.decoder.forward(batch, self.embed(batch))

    __call__ = forward
