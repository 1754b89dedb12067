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

Which rows are placeholders is known from the prompt's segments, not from the token values:
a *generated* token that happens to equal ``image_token_id`` (recomputed after a preemption)
is an ordinary token, as it is in HF's decode steps.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import ImageError
from ..models import ForwardBatch, PagedVLM
from .encoder_cache import EncoderCache
from .processing import ImageItem
from .scheduler import SchedulerOutput

__all__ = ["ModelRunner"]


class ModelRunner:
    """Runs scheduled steps on a :class:`~minirad.models.PagedVLM`.

    Args:
        vlm: the model, over the engine's KV cache.
        encoder_cache: image features by hash (the vision tower runs on a miss).
    """

    def __init__(self, vlm: PagedVLM, encoder_cache: EncoderCache) -> None:
        self.vlm = vlm
        self.encoder_cache = encoder_cache
        self.device = vlm.kv_cache.k_cache.device

    def image_features(self, image: ImageItem) -> torch.Tensor:
        """``[image.num_tokens, hidden]`` features of one image, from the cache or the tower.

        Raises:
            ImageError: the tower returned another number of rows than the processor's
                placeholder count (a processor that does not fit the model).
        """

        def encode() -> torch.Tensor:
            inputs = {k: v.to(self.device) for k, v in image.pixel_inputs.items()}
            feats = torch.cat(self.vlm.encode_images(inputs))
            if feats.shape[0] != image.num_tokens:
                raise ImageError(
                    f"vision tower gave {feats.shape[0]} feature rows for an image with "
                    f"{image.num_tokens} placeholders"
                )
            return feats

        return self.encoder_cache.get_or_compute(image.mm_hash, encode)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> torch.Tensor:
        """One forward pass over every scheduled request.

        Returns:
            ``[len(out.scheduled), vocab]`` next-token logits, one row per scheduled request
            (the logits after its last new token; only rows with ``sample`` are used).
        """
        token_ids, kv_slots, feats, rows = [], [], [], []
        base = 0  # row of this request's first new token in the flat batch
        for s in out.scheduled:
            request = s.request
            token_ids.append(request.all_token_ids[s.start : s.end])
            kv_slots.append(request.req.kv_indices[: s.end])
            per_image: dict[int, torch.Tensor] = {}  # one cache lookup per image, not per run
            for seg in request.segments:
                lo, hi = max(s.start, seg.offset), min(s.end, seg.offset + seg.length)
                if lo >= hi:
                    continue
                if seg.image_index not in per_image:
                    image = request.images[seg.image_index]
                    per_image[seg.image_index] = self.image_features(image)
                image_feats = per_image[seg.image_index]
                first = seg.row + lo - seg.offset
                feats.append(image_feats[first : first + hi - lo])
                rows.extend(range(base + lo - s.start, base + hi - s.start))
            base += s.num_tokens
        batch = ForwardBatch.build(token_ids, kv_slots, device=self.device)
        if feats:
            batch = replace(
                batch,
                mm_features=torch.cat(feats).to(self.device),
                mm_token_indices=torch.tensor(rows, dtype=torch.int64, device=self.device),
            )
        return self.vlm(batch)
