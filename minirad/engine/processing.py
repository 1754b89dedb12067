"""Input processing: a prompt and its images -> token ids, radix key, per-image inputs.

What SGLang's tokenizer manager and vLLM's input processor do before a request reaches the
scheduler:

1. Each image is loaded, hashed (:func:`minirad.kvcache.multimodal.hash_image`: pixels + the image
   processor's parameters) and preprocessed on its own by the model's Hugging Face processor,
   which also says what one image placeholder (``"<image>"``) becomes in the prompt: as many
   placeholder tokens as the image has features (LLaVA), with tile markers around them
   (Idefics3). Its pixel inputs wait for the vision tower, which runs only when a prefill
   chunk needs the features (and only once per hash: :mod:`.encoder_cache`). Both are kept
   by hash, so a picture asked about many times is preprocessed once.
2. The text is tokenized by the processor's tokenizer and each ``<image>`` id is replaced by
   its image's expansion. This gives the ids ``processor(text, images)`` gives (the tokenizer
   cuts text at special tokens such as ``<image>``, so the pieces tokenize alone), without
   preprocessing every image a second time for the text.
3. Placeholders are assigned to images in order, and the radix key gets each image's pad id
   (>= vocab size, :func:`minirad.kvcache.multimodal.pad_value`) at its placeholders, as SGLang's
   ``pad_input_ids`` does. One image may own several placeholder runs (Idefics3 splits a large
   image into tiles, each a run), so assignment is per position, not per run.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from minirad.engine.media import check_image_size, open_image
from minirad.errors import ImageError, RequestError
from minirad.kvcache.multimodal import hash_image, pad_value

__all__ = ["ImageItem", "ImageSegment", "InputProcessor", "ProcessedPrompt", "load_image"]


@dataclass(frozen=True, eq=False)
class ImageItem:
    """One image of a prompt.

    Attributes:
        mm_hash: :func:`~minirad.kvcache.multimodal.hash_image` of the pixels and preprocessing.
        pad_value: the id its placeholders get in the radix key.
        num_tokens: its placeholder tokens (= rows of its features).
        pixel_inputs: the processor's tensors for this image alone (``pixel_values``, ...).
        expansion_ids: the ids that replace its one ``<image>`` id in the tokenized prompt
            (``num_tokens`` placeholders, plus any markers the processor puts around them).
    """

    mm_hash: str
    pad_value: int
    num_tokens: int
    pixel_inputs: dict[str, torch.Tensor]
    expansion_ids: tuple[int, ...]


@dataclass(frozen=True)
class ImageSegment:
    """A maximal run of one image's placeholders: prompt positions
    ``offset .. offset + length - 1`` take feature rows ``row .. row + length - 1`` of image
    ``image_index``."""

    offset: int
    length: int
    image_index: int
    row: int


@dataclass
class ProcessedPrompt:
    """The result of :meth:`InputProcessor.process`."""

    prompt_token_ids: list[int]
    key_ids: list[int]
    images: list[ImageItem]
    segments: list[ImageSegment]


def load_image(image: Image.Image | str | os.PathLike) -> Image.Image:
    """A decoded PIL image from an image or a file path (:func:`minirad.engine.media.open_image`:
    PNG, JPEG, WebP, GIF or BMP, of a sane size).

    Raises:
        ImageError: not an image or a path; a missing, unreadable or truncated file, or one
            :func:`~minirad.engine.media.open_image` refuses.
    """
    if isinstance(image, Image.Image):
        check_image_size(*image.size, "given")
        return image
    if not isinstance(image, str | os.PathLike):
        raise ImageError(f"expected a PIL image or a path, got {type(image).__name__}")
    shown = repr(os.fspath(image))
    if not os.path.isfile(image):
        raise ImageError(f"image {shown} not found (or not a file)")
    return open_image(image, shown)


class InputProcessor:
    """Turns ``(prompt, images)`` into a :class:`ProcessedPrompt`.

    Args:
        processor: the model's HF processor (``AutoProcessor``, from
            :func:`~minirad.models.load_model`), or None to accept only token-id prompts
            without images.
        image_token_id: the placeholder id (``model.config.image_token_id``).
        vocab_size: the text model's vocabulary size: prompt ids must be below it, pad ids
            are at or above it.
        image_input_names: the processor outputs the vision tower takes
            (:attr:`~minirad.models.VLMFamily.image_input_names`).
        max_prompt_tokens: the context, in tokens, if text longer than it could ever be should
            be refused before it is tokenized (a server must not spend seconds tokenizing a
            20 MB prompt while its other clients wait); None: no such check.
    """

    max_cached_images = 256  # preprocessed images kept by hash
    # Most pixels one image may have once the processor resized it (a 200:1 picture resized
    # to a 336-pixel short side is 22 M pixels before the crop): refused above this.
    max_processed_pixels = 2**25

    def __init__(
        self,
        processor,
        image_token_id: int,
        vocab_size: int,
        image_input_names: Sequence[str] = ("pixel_values",),
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.processor = processor
        self.image_token_id = image_token_id
        self.vocab_size = vocab_size
        self.image_input_names = tuple(image_input_names)
        image_processor = getattr(processor, "image_processor", None)
        # Part of every image hash: the same file preprocessed differently is another image.
        self.preprocess_params = image_processor.to_dict() if image_processor else {}
        self.image_token = getattr(processor, "image_token", "<image>")
        # process() runs on any thread (a server processes requests off its engine thread):
        # the two caches below are shared, and read and written under this lock.
        self._lock = threading.Lock()
        self._items: OrderedDict[str, ImageItem] = OrderedDict()  # by mm_hash, LRU
        # Expansion of one "<image>" by image (size, mode), and the tokenizer's ids for it.
        self._expansions: dict[tuple, tuple[int, ...]] = {}
        self._bare = processor.tokenizer(self.image_token)["input_ids"] if processor else []
        # A fast tokenizer's Rust backend gives the ids tokenizer(text) gives, without its
        # per-call argument handling (per-prompt overhead on the input threads).
        self._backend = getattr(getattr(processor, "tokenizer", None), "backend_tokenizer", None)
        # No token covers more characters than the vocabulary's longest entry; 4 times that
        # per token leaves room for normalizers that shrink the text (NFC composes accents).
        self.max_prompt_chars = None
        if processor is not None and max_prompt_tokens is not None:
            longest = max(map(len, processor.tokenizer.get_vocab()))
            self.max_prompt_chars = 4 * longest * max_prompt_tokens

    def process(
        self, prompt: str | Sequence[int], images: Sequence[Image.Image | str | os.PathLike] = ()
    ) -> ProcessedPrompt:
        """Token ids, radix key and image items of one prompt.

        Raises:
            RequestError: empty prompt, ids outside the vocabulary, text without a processor,
                text too long for any tokenization of it to fit ``max_prompt_tokens``.
            ImageError: an image cannot be read, or the images do not match the prompt's
                placeholders (too many, too few).
        """
        if isinstance(images, Image.Image | str | os.PathLike):
            images = [images]  # one image passed bare
        pil_images = [load_image(im) for im in images]
        if pil_images and self.processor is None:
            raise RequestError("images need the model's processor (engine built without one)")
        items = [self._process_image(im) for im in pil_images]
        ids = self._prompt_ids(prompt, items)
        segments = self._assign_placeholders(ids, items)
        key = list(ids)
        for seg in segments:  # SGLang's pad_input_ids, per image rather than per run
            pad = items[seg.image_index].pad_value
            key[seg.offset : seg.offset + seg.length] = [pad] * seg.length
        return ProcessedPrompt(ids, key, items, segments)

    def _prompt_ids(self, prompt, items: list[ImageItem]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("empty prompt")
            if self.processor is None:
                raise RequestError("a text prompt needs the model's processor")
            if self.max_prompt_chars is not None and len(prompt) > self.max_prompt_chars:
                raise RequestError(
                    f"the prompt has {len(prompt):,} characters, more than the model's context "
                    f"could hold as tokens (at most {self.max_prompt_chars:,} characters)"
                )
            if self._backend is not None:
                text_ids = self._backend.encode(prompt).ids
            else:
                text_ids = self.processor.tokenizer(prompt)["input_ids"]
            where = [i for i, t in enumerate(text_ids) if t == self.image_token_id]
            if len(where) != len(items):
                raise ImageError(
                    f"the prompt has {len(where)} {self.image_token!r} placeholder(s) but "
                    f"{len(items)} image(s) were given"
                )
            ids: list[int] = []
            start = 0
            for pos, item in zip(where, items, strict=True):
                ids += text_ids[start:pos]
                ids += item.expansion_ids
                start = pos + 1
            return ids + text_ids[start:]
        try:
            ids = [int(t) for t in (prompt.tolist() if hasattr(prompt, "tolist") else prompt)]
        except (TypeError, ValueError) as e:
            raise RequestError(f"prompt must be a str or a sequence of token ids: {e}") from e
        if not ids:
            raise RequestError("empty prompt")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise RequestError(f"prompt token ids must be in 0..{self.vocab_size - 1}")
        return ids

    def _process_image(self, image: Image.Image) -> ImageItem:
        """Hash one image and preprocess it alone; the processor says how many placeholder
        tokens it expands to (the count depends on the image size for some families). The
        result is kept by hash (vLLM's processor cache): a course asks many questions about
        one picture."""
        mm_hash = hash_image(image, **self.preprocess_params)
        with self._lock:
            item = self._items.get(mm_hash)
            if item is not None:
                self._items.move_to_end(mm_hash)
                return item
            # The expansion depends on the image's size only (LLaVA: fixed; Idefics3: the
            # tiling), so the full processor runs once per size; later images of that size need
            # only the image processor (the text side of a processor call costs as much as the
            # pixels).
            expansion = self._expansions.get((image.size, image.mode))
        self._check_processed_size(image)
        try:
            if expansion is None:
                out = self.processor(text=self.image_token, images=[image], return_tensors="pt")
                expansion = self._expansion(out["input_ids"][0].tolist())
                with self._lock:
                    self._expansions[(image.size, image.mode)] = expansion
            else:
                out = self.processor.image_processor(images=[image], return_tensors="pt")
        except (ValueError, OSError) as e:
            raise ImageError(f"the processor cannot preprocess an image: {e}") from e
        num_tokens = expansion.count(self.image_token_id)
        pixel_inputs = {k: out[k] for k in self.image_input_names if k in out}
        item = ImageItem(
            mm_hash, pad_value(mm_hash, self.vocab_size), num_tokens, pixel_inputs, expansion
        )
        with self._lock:
            self._items[mm_hash] = item
            if len(self._items) > self.max_cached_images:
                self._items.popitem(last=False)
        return item

    def _check_processed_size(self, image: Image.Image) -> None:
        """Refuse an image the processor would resize to more than
        :attr:`max_processed_pixels` (a short side scaled up to the processor's
        ``shortest_edge`` takes the long side with it).

        Raises:
            ImageError: the resized image would be that large.
        """
        size = getattr(getattr(self.processor, "image_processor", None), "size", None) or {}
        width, height = image.size
        if isinstance(size, dict) and size.get("shortest_edge"):
            scale = size["shortest_edge"] / min(width, height)
            width, height = round(width * scale), round(height * scale)
        if width * height > self.max_processed_pixels:
            resized = "" if (width, height) == image.size else f", {width}x{height} once resized,"
            raise ImageError(
                f"a {image.size[0]}x{image.size[1]} image{resized} is more than "
                f"{self.max_processed_pixels:,} pixels for the model's processor: crop it first"
            )

    def _expansion(self, expanded: list[int]) -> tuple[int, ...]:
        """The ids one ``<image>`` became in ``expanded`` (the processor's ids for the text
        ``"<image>"`` alone): what the tokenizer adds around a lone ``<image>`` (e.g. a BOS)
        is not the image's.

        Raises:
            ImageError: the processor expanded the image into no placeholder tokens.
        """
        if self.image_token_id not in expanded:
            raise ImageError("the processor expanded an image into no placeholder tokens")
        before = self._bare.index(self.image_token_id)
        after = len(self._bare) - before - 1
        return tuple(expanded[before : len(expanded) - after])

    def _assign_placeholders(self, ids: list[int], items: list[ImageItem]) -> list[ImageSegment]:
        """Give the first ``items[0].num_tokens`` placeholders to image 0, the next ones to
        image 1, and so on; cut each image's positions into maximal runs.

        Raises:
            ImageError: the placeholder count differs from what the images need.
        """
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        need = sum(it.num_tokens for it in items)
        if positions and not items:
            raise ImageError(
                f"prompt holds {len(positions)} image placeholder token(s) (id "
                f"{self.image_token_id}) and no image: send the image, or leave the id out"
            )
        if len(positions) != need:
            raise ImageError(
                f"prompt has {len(positions)} image placeholder tokens but its {len(items)} "
                f"image(s) need {need}"
            )
        segments: list[ImageSegment] = []
        start = 0
        for index, item in enumerate(items):
            mine = positions[start : start + item.num_tokens]
            start += item.num_tokens
            run = 0  # index in `mine` (= feature row) where the current run began
            for i in range(1, len(mine) + 1):
                if i == len(mine) or mine[i] != mine[i - 1] + 1:
                    segments.append(ImageSegment(mine[run], i - run, index, run))
                    run = i
        return segments
