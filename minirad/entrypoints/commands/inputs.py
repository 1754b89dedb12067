"""What the commands read, checked before the model loads (which takes seconds): images, the
model folder, prompts and their image placeholders, a requests JSONL file, a JSON schema.

The rules are in ``docs/serving.md`` ("What the commands check"). Every check raises a typed
:class:`~minirad.errors.MiniradError`, which the ``minirad`` command prints as one line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NamedTuple

from minirad.engine.sampling_params import SamplingParams
from minirad.errors import GrammarError, ImageError, InvalidArgumentError, RequestError
from minirad.peers.vllm_server import DEFAULT_MODEL_DIR

__all__ = [
    "JSONL_FIELDS",
    "NO_IMAGE_WARNING",
    "SAMPLING_FIELDS",
    "STRUCTURED_FIELDS",
    "RequestLine",
    "check_image",
    "check_model_dir",
    "check_prompt",
    "image_token",
    "images_note",
    "load_requests",
    "load_schema",
    "warn",
]

# The per-request fields a JSONL line may set (besides "prompt" and "images").
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")
# The structured-output constraints (SamplingParams' names, at most one per request).
STRUCTURED_FIELDS = ("json_schema", "regex", "choice")
# What each JSONL field holds, for `minirad batch --help` and the unknown-field message.
JSONL_FIELDS = {
    "prompt": "the question (required; a non-space character; no '<image>' without --raw)",
    "images": "list of image paths, relative to the JSONL file, placed before the question",
    "max_new_tokens": "int >= 1 (default: --max-new-tokens)",
    "temperature": "float >= 0 (0: greedy, the default)",
    "top_k": "int >= 0 (0: off)",
    "top_p": "float in (0, 1] (1: off)",
    "seed": "int: this request's own sampling seed",
    "json_schema": "JSON schema object: the answer is compact JSON valid against it",
    "regex": "string: the answer fully matches this regex (Rust regex syntax)",
    "choice": "list of strings: the answer is one of them",
}
# The shipped model's training prompts hold one image each (minirad.course.train: the user turn is
# one image item, then the question), so several images are outside what it learned.
ONE_IMAGE_MODEL = DEFAULT_MODEL_DIR.resolve()
NO_IMAGE_WARNING = (
    "no image given: the model answers from the text alone (minirad's models are VLMs; "
    "the course's tiny model was trained on image questions only)"
)


def check_image(path: Path, where: str = "", written: str | None = None) -> None:
    """Refuse an image that the engine could not read, before the model loads (seconds).

    Only the header is read (:func:`minirad.engine.media.probe_image`). The message starts with
    ``where`` (``"requests.jsonl:3: "``) and shows the path as ``written`` (default
    ``str(path)``) and, if that differs, as resolved.

    Raises:
        ImageError: ``path`` is missing, a directory or another non-regular file (a FIFO
            would block the reader), not a PNG, JPEG, WebP, GIF or BMP image, or refused by
            :func:`minirad.engine.media.check_image_size` (too many pixels, too thin).
    """
    from minirad.engine.media import (
        probe_image,  # Pillow: only the commands that read images need it
    )

    written = str(path) if written is None else written
    shown = repr(written)
    if str(path.resolve()) != written:
        shown += f" (resolved: {str(path.resolve())!r})"
    if path.is_dir():
        raise ImageError(f"{where}image {shown} is a directory, not an image file")
    if not path.exists():
        raise ImageError(f"{where}image {shown} not found")
    if not path.is_file():
        raise ImageError(f"{where}image {shown} is not a regular file")
    try:
        probe_image(path, shown).close()
    except ImageError as e:
        raise ImageError(f"{where}{e}") from e


def check_model_dir(model: str | Path) -> Path:
    """The model folder ``model``, checked before the engine import (seconds).

    Raises:
        InvalidArgumentError: ``model`` is not a folder, or has no ``config.json`` (not a
            Hugging Face model folder).
    """
    path = Path(model)
    if not path.is_dir():
        raise InvalidArgumentError(f"model folder {str(model)!r} not found")
    if not (path / "config.json").is_file():
        raise InvalidArgumentError(
            f"model folder {str(model)!r} has no config.json: not a Hugging Face model folder "
            "(pass --model a folder saved with save_pretrained)"
        )
    return path


def image_token(model_dir: Path) -> str | None:
    """The processor's image placeholder (``"<image>"``) as saved in ``model_dir``, read from
    its JSON files rather than by loading the processor (which imports transformers)."""
    for name in ("processor_config.json", "tokenizer_config.json"):
        try:
            token = json.loads((model_dir / name).read_text(encoding="utf-8")).get("image_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(token, str) and token:
            return token
    return None


def check_prompt(
    prompt: str, num_images: int, raw: bool, placeholder: str | None, where: str = ""
) -> None:
    """Refuse a prompt whose placeholders do not fit its images, before the model loads.

    A plain prompt must not hold ``placeholder`` (the chat template adds one per image); a
    ``raw`` one must hold exactly ``num_images`` of them. No check when ``placeholder`` is
    None (a model folder without it saved). ``where`` prefixes the message.

    Raises:
        RequestError: the prompt breaks the rule for its mode.
    """
    if placeholder is None:
        return
    count = prompt.count(placeholder)
    if not raw and count:
        raise RequestError(
            f"{where}the prompt contains {placeholder!r}: without --raw the images go "
            f"before the question, one per image; remove it, or pass --raw with a "
            f"fully templated prompt"
        )
    if raw and count != num_images:
        raise RequestError(
            f"{where}the prompt has {count} {placeholder!r} placeholder(s) but {num_images} "
            f"image(s) were given: with --raw the prompt needs one {placeholder!r} per image"
        )


def images_note(command: str, model_dir: Path, num_images: int, where: str = "") -> None:
    """Say on stderr how several images of a plain prompt are placed (and, for the shipped
    model, that it learned one image per prompt)."""
    note = (
        f"{where}{num_images} images go before the question, in the order given (first image first)"
    )
    if model_dir.resolve() == ONE_IMAGE_MODEL:
        note += f"; {ONE_IMAGE_MODEL.name} was trained on one image per prompt"
    print(f"minirad {command}: note: {note}", file=sys.stderr)


def warn(command: str, message: str) -> None:
    """Print ``minirad COMMAND: warning: MESSAGE`` on stderr (the command goes on)."""
    print(f"minirad {command}: warning: {message}", file=sys.stderr)


class RequestLine(NamedTuple):
    """One request of a JSONL file: where it is (``"requests.jsonl:3"``) and what it asks."""

    where: str
    prompt: str
    images: list[Path]
    params: SamplingParams


def load_requests(path: str | Path, max_new_tokens: int = 32) -> list[RequestLine]:
    """Parse a requests JSONL file: one :class:`RequestLine` per non-blank line, image paths
    resolved against the file's folder, ``max_new_tokens`` unless the line sets it.

    Raises:
        RequestError: unreadable file, or a line that is not a JSON object with a ``prompt``
            string holding a non-space character, a list of string ``images`` and only valid
            sampling fields (the message names the line).
        GrammarError: a line with two constraints, a ``json_schema`` that is not an object,
            an empty ``regex`` or ``choice`` (the message names the line; the grammar itself
            is compiled by the engine).
        ImageError: an image :func:`check_image` refuses (the message names the line).

    The whole file is checked before the engine is imported (which takes seconds).
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise RequestError(f"cannot read {str(path)!r}: {e.strerror}") from e
    checked = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise RequestError(f"{where}: not valid JSON ({e.msg})") from e
        if not isinstance(obj, dict):
            raise RequestError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if unknown := set(obj) - set(JSONL_FIELDS):
            raise RequestError(
                f"{where}: unknown fields {sorted(unknown)}; a line may hold "
                f"{', '.join(JSONL_FIELDS)}"
            )
        prompt, images = obj.get("prompt"), obj.get("images", [])
        if not isinstance(prompt, str) or not prompt.strip():
            raise RequestError(f"{where}: 'prompt' must be a string with a non-space character")
        if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
            raise RequestError(f"{where}: 'images' must be a list of paths")
        fields = {"max_new_tokens": max_new_tokens} | {
            k: obj[k] for k in (*SAMPLING_FIELDS, *STRUCTURED_FIELDS) if k in obj
        }
        try:
            params = SamplingParams(**fields)
        except RequestError as e:  # GrammarError included: the same type, the line named
            raise type(e)(f"{where}: {e}") from None
        paths = [path.parent / p for p in images]
        for written, p in zip(images, paths, strict=True):
            check_image(p, f"{where}: ", written)
        checked.append(RequestLine(where, prompt, paths, params))
    if not checked:
        raise RequestError(f"{path}: no requests")
    return checked


def load_schema(path: str | Path) -> dict:
    """The JSON schema in the file ``path`` (for ``--json-schema``), read before the model
    loads.

    Raises:
        RequestError: the file cannot be read (missing, a directory, not UTF-8).
        GrammarError: the file is not JSON, or its JSON is not an object (a schema is one).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise RequestError(f"cannot read JSON schema file {str(path)!r}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise RequestError(f"cannot read JSON schema file {str(path)!r}: not UTF-8") from e
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(
            f"JSON schema file {str(path)!r} is not JSON: {e.msg} at line {e.lineno} "
            f"column {e.colno}"
        ) from e
    if not isinstance(schema, dict):
        raise GrammarError(
            f"JSON schema file {str(path)!r} holds a {type(schema).__name__}, not a schema object"
        )
    return schema
