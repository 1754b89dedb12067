"""Cache keys for images: content hashes, per-image pad ids, and block extra keys.

An image enters a VLM prompt as a run of identical placeholder tokens (``image_token_id``),
which the model replaces by the image's features. Two prompts with different images therefore
have *identical token ids* but different KV from the first image token on, so a token-keyed
cache must be told which image each run stands for.

- Radix tree (SGLang): every placeholder position of an image gets that image's *pad id*, a
  number ``>= vocab_size`` derived from the image hash
  (``sglang/srt/managers/mm_utils.py``: ``MultimodalDataItem.set_pad_value``,
  ``pad_input_ids``). Same text + different image -> the keys differ exactly at the first
  image token, so the tree forks there; the same image -> the same ids, so it is shared.
- Block hashes (vLLM): each block that overlaps an image gets ``(mm_hash, offset - block_start)``
  in its extra keys (``vllm/v1/core/kv_cache_utils.py``: ``_gen_mm_extra_hash_keys``).

The hash covers decoded pixels, mode, size and the preprocessing parameters, never the file
name: the same picture saved under two names is one image, and the same file resized for a
different processor is another.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image

from minirad.errors import ImageError

__all__ = [
    "MultiModalItem",
    "block_extra_keys",
    "hash_image",
    "pad_input_ids",
    "pad_value",
    "placeholder_runs",
]


def hash_image(image: Image.Image, **preprocess: object) -> str:
    """SHA-256 hex digest of an image's decoded pixels, mode, size and ``preprocess``
    parameters (e.g. ``size=32, resample="bicubic"``; values must be JSON-serialisable).

    Raises:
        ImageError: ``image`` is not a PIL image, or its pixels cannot be decoded.
    """
    if not isinstance(image, Image.Image):
        raise ImageError(f"expected a PIL.Image.Image, got {type(image).__name__}")
    try:
        pixels = image.tobytes()
    except OSError as e:  # truncated or corrupt file, decoded lazily
        raise ImageError(f"cannot decode image pixels: {e}") from e
    h = hashlib.sha256()
    header = {"mode": image.mode, "size": list(image.size), "preprocess": preprocess}
    h.update(json.dumps(header, sort_keys=True, default=str).encode())
    h.update(pixels)
    return h.hexdigest()


def pad_value(image_hash: str, vocab_size: int) -> int:
    """The id that stands for every placeholder of this image in radix keys:
    ``vocab_size + int(image_hash, 16)``, the whole digest.

    Always ``>= vocab_size``, so it never equals a real token id, and two images get the same
    pad id only if their SHA-256 digests are equal. SGLang keeps 30 bits of the hash
    (``hash % 2**30``), because its pad ids go into the model's int64 ``input_ids``; two of
    about 2**15 images then share a pad id, and the second is served the first one's KV.
    Here the model reads ``prompt_token_ids`` and the pad ids live only in the radix key, a
    Python list, so nothing is cut. The id has more than 64 bits: it never goes into a tensor,
    a numpy array, or a JSON number read by a browser (show it as hex).

    Raises:
        ImageError: ``image_hash`` is not a hex digest.
    """
    try:
        return vocab_size + int(image_hash, 16)
    except (TypeError, ValueError):
        raise ImageError(f"an image hash is a hex digest, got {image_hash!r}") from None


def placeholder_runs(input_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each maximal run of ``image_token_id`` in ``input_ids``."""
    runs = []
    start = None
    for i, t in enumerate(input_ids):
        if t == image_token_id and start is None:
            start = i
        elif t != image_token_id and start is not None:
            runs.append((start, i - start))
            start = None
    if start is not None:
        runs.append((start, len(input_ids) - start))
    return runs


def pad_input_ids(
    input_ids: Sequence[int], image_token_id: int, image_hashes: Sequence[str], vocab_size: int
) -> list[int]:
    """Replace the i-th run of image placeholders with the pad id of ``image_hashes[i]``.

    Runs are maximal, so two images must be separated by at least one other token (VLM chat
    templates put text or a marker between images).

    Raises:
        ImageError: the number of placeholder runs differs from the number of images.
    """
    runs = placeholder_runs(input_ids, image_token_id)
    if len(runs) != len(image_hashes):
        raise ImageError(
            f"prompt has {len(runs)} image placeholder runs but {len(image_hashes)} images"
        )
    out = list(input_ids)
    for (offset, length), h in zip(runs, image_hashes, strict=True):
        out[offset : offset + length] = [pad_value(h, vocab_size)] * length
    return out


@dataclass(frozen=True)
class MultiModalItem:
    """Where one image sits in a prompt: ``length`` placeholder tokens from ``offset``."""

    offset: int
    length: int
    mm_hash: str


def block_extra_keys(
    start: int, end: int, mm_items: Sequence[MultiModalItem], extra_key: str | None = None
) -> tuple | None:
    """Extra keys of the block holding tokens ``[start, end)``, or None if it has none.

    Each image overlapping the block contributes ``(mm_hash, offset - start)``: the offset is
    negative when the block holds the middle or tail of the image. ``extra_key`` (the cache's
    namespace, in the place of vLLM's ``cache_salt``) is added to the first block only, after
    the images, in vLLM 0.32's order (``generate_block_hash_extra_keys``: LoRA name, images,
    cache salt; its events publish the keys in that order, untagged); the hash chain carries it
    to every later block.
    """
    keys: list = [
        (item.mm_hash, item.offset - start)
        for item in mm_items
        if item.offset < end and start < item.offset + item.length
    ]
    if extra_key is not None and start == 0:
        keys.append(extra_key)
    return tuple(keys) if keys else None
