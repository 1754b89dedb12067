"""The prompt and image checks every front end shares: chat templates, images named by URL.

``minirad generate`` / ``batch`` and ``minirad serve`` build a model's prompt with the same
:func:`chat_template`, so the same messages give the same tokens from the command line and over
HTTP (vLLM's ``chat_utils`` has the same role).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from PIL import Image

from minirad.engine.media import MediaFolder, decode_data_url, open_image
from minirad.errors import ImageError, RequestError

# A URL's scheme (RFC 3986: a letter, then letters, digits, "+", "-", "."), then "://".
URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")

__all__ = ["chat_prompt", "chat_template", "image_from_url"]


def chat_prompt(processor, prompt: str, num_images: int) -> str:
    """``prompt`` as the user turn of the processor's chat template: ``num_images`` image
    items, then the text, then the assistant header (``add_generation_prompt``).

    Raises:
        RequestError: the processor has no chat template (use ``--raw``).
    """
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": prompt}]
    return chat_template(processor, [{"role": "user", "content": content}])


def chat_template(processor, messages: Sequence[dict]) -> str:
    """``messages`` rendered by the processor's chat template, with the assistant header
    (``add_generation_prompt``). Each message is HF's chat format: ``{"role": ..., "content":
    text}`` or a content list of ``{"type": "image"}`` and ``{"type": "text", "text": ...}``
    items (one ``<image>`` placeholder per image item, in order).

    Raises:
        RequestError: no messages; the processor has no chat template (``minirad generate`` /
            ``batch``: pass ``--raw``; ``minirad serve``: use ``/v1/completions``); or the
            template refuses the messages (its ``raise_exception``, a role it does not know).
    """
    if getattr(processor, "chat_template", None) is None:
        raise RequestError(
            "the model's processor has no chat template; pass --raw (minirad serve: use "
            "/v1/completions with a templated prompt)"
        )
    if not messages:
        raise RequestError("give at least one message")
    try:
        return processor.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=False
        )
    except Exception as e:  # Jinja's TemplateError, or what the template's code raised
        raise RequestError(f"the chat template cannot render these messages: {e}") from e


def image_from_url(url: str, media: MediaFolder) -> Image.Image:
    """An image part's URL as a decoded, checked PIL image: a ``data:`` URL, or a file in the
    media folder (a path, plain or ``file://``, relative to the server's working folder).
    ``minirad serve`` calls it on an input thread, never the engine's.

    Raises:
        ImageError: a malformed data URL, a network URL, a path outside the folder, or no
            readable picture (:mod:`minirad.engine.media`).
    """
    if url.startswith("data:"):
        return open_image(decode_data_url(url), "in the data URL")
    if not url:
        raise ImageError("an image_url must not be empty: send a data: URL or a local path")
    scheme = URL_SCHEME.match(url)
    if scheme and scheme[1].lower() != "file":  # http, https, ftp, s3...: never fetched
        raise ImageError(
            f"this server fetches no images over the network ({scheme[0]}): send a data: URL"
            " or a local path"
        )
    name = url.removeprefix("file://")
    return open_image(media.read(name), media.shown(name))
