"""The model runner: one :class:`~minirad.engine.scheduler.SchedulerOutput` -> one forward pass.

nano-vllm's ``engine/model_runner.py`` / vLLM's ``GPUModelRunner``, reduced to what a CPU
needs: gather every scheduled request's new tokens and KV slots into one
:class:`~minirad.models.ForwardBatch`, put image features in place of the placeholder tokens
the step computes, run :class:`~minirad.models.PagedVLM`, return one logits row per request.

Image features per chunk. A step computes tokens ``start .. end - 1`` of a request; the
placeholders among them may be the middle of an image, because a prefill chunk or a cached
prefix ended inside it. Each image segment overlapping the chunk contributes exactly its
rows ``row + (lo - offset) .. row + (hi - offset) - 1`` of *its own* image's features
(SGLang's ``get_embedding_chunk``; :func:`minirad.models.image_features_for_chunk` does the
same for a whole prompt's features). Images the chunk does not touch are never encoded.

Encoding ahead. A tower call has a fixed cost beyond its per-image one, and continuous
batching admits one or two new requests per step, so a step that encodes an image also
encodes the images of the next waiting requests that were never encoded (at most
:data:`PREFETCH_IMAGES` from the first :data:`PREFETCH_LOOKAHEAD` requests, only into free
encoder-cache rows). A never-encoded image has no KV in the tree, so its first request
would encode it anyway: the counts of encoder runs and hits do not change, only the number of
calls (an aborted request's image may have been encoded for nothing).

Which rows are placeholders is known from the prompt's segments, not from the token values:
a *generated* token that happens to equal ``image_token_id`` (recomputed after a preemption)
is an ordinary token, as it is in HF's decode steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from minirad.engine.encoder_cache import EncoderCache
from minirad.engine.processing import ImageItem
from minirad.engine.scheduler import SchedulerOutput
from minirad.errors import ImageError
from minirad.models import ForwardBatch, PagedVLM

__all__ = ["PREFETCH_IMAGES", "PREFETCH_LOOKAHEAD", "ModelRunner"]

PREFETCH_IMAGES = 8  # waiting requests' images one tower call may take on top of its own
PREFETCH_LOOKAHEAD = 64  # waiting requests the engine offers them from (queue order)


class ModelRunner:
    """Runs scheduled steps on a :class:`~minirad.models.PagedVLM`.

    Args:
        vlm: the model, over the engine's KV cache.
        encoder_cache: image features by hash (the vision tower runs on a miss).
    """

    def __init__(self, vlm: PagedVLM, encoder_cache: EncoderCache) -> None:
        self.vlm = vlm
        self.encoder_cache = encoder_cache
        # The engine's device (its KV pool's): the batch tensors and image inputs of every
        # step are made or moved there.
        self.device = vlm.kv_cache.k_cache.device

    def image_features(
        self, images: Sequence[ImageItem], upcoming: Iterable[ImageItem] = ()
    ) -> dict[str, torch.Tensor]:
        """``{mm_hash: [num_tokens, hidden]}`` features of ``images``: from the encoder cache,
        and the rest through the vision tower, one call per group of images whose inputs have
        the same shapes (vLLM's model runner batches a step's encoder inputs the same way).
        Never-encoded ``upcoming`` images (the waiting requests') join those calls, into the
        encoder cache only (module docstring).

        Raises:
            ImageError: the tower returned another number of rows than the processor's
                placeholder count (a processor that does not fit the model).
        """
        found: dict[str, torch.Tensor] = {}
        groups: dict[tuple, dict[str, ImageItem]] = {}  # missing images, deduplicated by hash
        repeats: list[str] = []  # later uses of a missing image: encoded once, then hits
        for image in images:
            if any(image.mm_hash in g for g in groups.values()):
                repeats.append(image.mm_hash)
                continue
            feats = self.encoder_cache.get(image.mm_hash)
            if feats is not None:
                found[image.mm_hash] = feats
                continue
            groups.setdefault(_shapes(image), {})[image.mm_hash] = image
        # Encoding ahead (module docstring): fewer, larger tower calls.
        free = self.encoder_cache.free_rows
        free -= sum(im.num_tokens for g in groups.values() for im in g.values())
        ahead: set[str] = set()
        for image in upcoming if groups else ():
            group = groups.get(_shapes(image))
            if len(ahead) == PREFETCH_IMAGES or free < image.num_tokens:
                break
            if group is None or image.mm_hash in group:
                continue  # no call to join, or in it already
            if not self.encoder_cache.was_encoded(image.mm_hash):
                group[image.mm_hash] = image
                free -= image.num_tokens
                ahead.add(image.mm_hash)
        for group in groups.values():
            batch = list(group.values())
            for image, feats in zip(batch, self._encode(batch), strict=True):
                self.encoder_cache.put(image.mm_hash, feats, ahead=image.mm_hash in ahead)
                if image.mm_hash not in ahead:
                    found[image.mm_hash] = feats
        for mm_hash in repeats:
            self.encoder_cache.get(mm_hash)  # counts the hit (when the cache could keep it)
        return found

    def _encode(self, images: list[ImageItem]) -> list[torch.Tensor]:
        """One vision-tower call over images with same-shaped inputs, stacked along the batch.
        The tower returns every image's rows in order (LLaVA: one tensor per image; Idefics3:
        one per tile), so the rows are cut by each image's placeholder count."""
        names = images[0].pixel_inputs
        # To the engine's device; the dtype stays the processor's (fp32): the tower casts
        # pixels to its weights' dtype itself, as in HF's generate() (CLIP / SigLIP embeddings).
        inputs = {
            k: torch.cat([im.pixel_inputs[k] for im in images]).to(self.device) for k in names
        }
        rows = torch.cat(self.vlm.encode_images(inputs))
        counts = [im.num_tokens for im in images]
        if rows.shape[0] != sum(counts):
            raise ImageError(
                f"vision tower gave {rows.shape[0]} feature rows for {len(images)} image(s) "
                f"with {sum(counts)} placeholders"
            )
        return list(rows.split(counts))

    @torch.inference_mode()
    def execute_model(
        self, out: SchedulerOutput, upcoming: Iterable[ImageItem] = ()
    ) -> torch.Tensor:
        """One forward pass over every scheduled request (``upcoming``: the next waiting
        requests' images, see :meth:`image_features`).

        Returns:
            ``[len(out.scheduled), vocab]`` next-token logits, one row per scheduled request
            (the logits after its last new token; only rows with ``sample`` are used).
        """
        # The image segments each request's new tokens overlap, as (segment, lo, hi), and
        # their images: all encoded together, before the forward pass.
        overlaps, needed = [], []
        for s in out.scheduled:
            spans = []
            for seg in s.request.segments:
                lo, hi = max(s.start, seg.offset), min(s.end, seg.offset + seg.length)
                if lo < hi:
                    spans.append((seg, lo, hi))
            overlaps.append(spans)
            # One use per image of the request, however many runs (tiles) the chunk touches.
            for index in dict.fromkeys(seg.image_index for seg, _, _ in spans):
                needed.append(s.request.images[index])
        features = self.image_features(needed, upcoming)
        token_ids, kv_slots, feats, rows = [], [], [], []
        base = 0  # row of this request's first new token in the flat batch
        for s, spans in zip(out.scheduled, overlaps, strict=True):
            request = s.request
            token_ids.append(request.all_token_ids[s.start : s.end])
            kv_slots.append(request.kv_indices[: s.end])
            for seg, lo, hi in spans:
                image_feats = features[request.images[seg.image_index].mm_hash]
                first = seg.row + lo - seg.offset
                feats.append(image_feats[first : first + hi - lo])
                rows.extend(range(base + lo - s.start, base + hi - s.start))
            base += s.num_tokens
        batch = ForwardBatch.build(
            token_ids,
            kv_slots,
            mm_features=torch.cat(feats) if feats else None,
            mm_token_indices=rows if feats else None,
            device=self.device,
        )
        return self.vlm(batch)


def _shapes(image: ImageItem) -> tuple:
    """What must match for images to share one tower call: their inputs' shapes and dtypes."""
    return tuple((k, v.shape, v.dtype) for k, v in sorted(image.pixel_inputs.items()))
