"""Reading pictures safely: a file, a client's data URL, or a file in the server's media folder.

Every image minirad takes goes through here before the model's processor sees it (vLLM's
``MediaConnector`` does the same job). Three rules, each from an attack that worked:

- **A short list of formats**: PNG, JPEG, WebP, GIF and BMP (:data:`ALLOWED_IMAGE_FORMATS`).
  Pillow recognises dozens; an EPS payload made it try to run Ghostscript.
- **Sizes checked from the header, before decoding**: at most Pillow's decompression-bomb
  limit of pixels, at most :data:`MAX_ASPECT_RATIO` between the long and the short side
  (a 100000x1 picture resized to the model's short side is 4.8 M pixels wide), and at most
  :data:`MAX_IMAGE_BYTES` of file or data URL.
- **A file in the media folder is found without opening anything outside it**: its name is
  walked one name at a time beneath the folder, as Linux's ``openat2`` walks it with
  ``RESOLVE_BENEATH`` (:meth:`MediaFolder.open_beneath`). Each folder on the way is opened
  relative to the one above it, never through a link; a link is read, not followed: its
  target is walked in its place, where ``..`` never goes above the folder and an absolute
  target must lie in it. Opening is an effect in itself (a device acts when opened, an audit
  log records it): a link to ``/dev/zero`` or ``/etc/passwd`` used to be opened, then refused.
  The last name is looked at before it is opened, and only a regular file is opened (a FIFO
  would block the reader forever), then only if it is still the file that was looked at (a
  link swapped in between is refused). Every way a name can fail (missing, a folder, a FIFO,
  a link out of the folder, unreadable, not a picture) gives the same message, so a client
  learns nothing about what lies in the folder.
"""

from __future__ import annotations

import base64
import binascii
import errno
import io
import os
import stat
import warnings
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from PIL import Image

from minirad.errors import ImageError

__all__ = [
    "ALLOWED_IMAGE_FORMATS",
    "MAX_ASPECT_RATIO",
    "MAX_IMAGE_BYTES",
    "MAX_LINKS",
    "MediaFolder",
    "check_image_size",
    "decode_data_url",
    "open_image",
    "probe_image",
]

ALLOWED_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Longest side over shortest side (Qwen2-VL's processor refuses the same above 200).
MAX_ASPECT_RATIO = 200
MAX_IMAGE_BYTES = 32 * 2**20  # an image file or a data URL's decoded bytes
_FORMATS = "PNG, JPEG, WebP, GIF or BMP"
MAX_LINKS = 40  # links one name may go through (Linux's MAXSYMLINKS)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# O_NONBLOCK: a FIFO swapped in after the look opens at once (then is refused) rather than
# waiting for a writer; O_NOFOLLOW: a link swapped in is not followed.
_FILE = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY


def _unreadable(shown: str) -> ImageError:
    """The one message for a picture that cannot be read, whatever the reason."""
    return ImageError(f"image {shown} is not a readable image ({_FORMATS})")


def check_image_size(width: int, height: int, shown: str) -> None:
    """Refuse a picture too large or too thin to preprocess, from its size alone.

    Raises:
        ImageError: more pixels than Pillow's ``MAX_IMAGE_PIXELS``, a side of 0, or an
            aspect ratio above :data:`MAX_ASPECT_RATIO`.
    """
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and width * height > limit:
        raise ImageError(
            f"image {shown} is {width}x{height} ({width * height:,} pixels): downscale it "
            f"first; minirad reads images up to {limit:,} pixels"
        )
    if min(width, height) < 1 or max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise ImageError(
            f"image {shown} is {width}x{height}: its sides differ by more than "
            f"{MAX_ASPECT_RATIO} times; crop or pad it first"
        )


def probe_image(source: str | os.PathLike | BinaryIO, shown: str) -> Image.Image:
    """Open a picture lazily (its header only) and check its format and size.

    Raises:
        ImageError: not one of :data:`ALLOWED_IMAGE_FORMATS`, unreadable, or refused by
            :func:`check_image_size`.
    """
    try:
        with warnings.catch_warnings():
            # Pillow warns above its pixel limit and raises above twice it: both refused below.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(source, formats=ALLOWED_IMAGE_FORMATS)
    except Image.DecompressionBombError as e:
        limit = Image.MAX_IMAGE_PIXELS
        raise ImageError(
            f"image {shown} has over {2 * limit:,} pixels: downscale it first; minirad reads "
            f"images up to {limit:,} pixels"
        ) from e
    except Exception as e:  # Pillow's plugins raise many kinds on malformed headers
        raise _unreadable(shown) from e
    try:
        check_image_size(*image.size, shown)
    except ImageError:
        image.close()  # the file Pillow opened by name
        raise
    return image


def open_image(source: str | os.PathLike | BinaryIO | bytes, shown: str) -> Image.Image:
    """A decoded picture: :func:`probe_image`, then its pixels (a truncated file fails here,
    not in the middle of an engine step).

    Raises:
        ImageError: what :func:`probe_image` refuses, or pixels that do not decode.
    """
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    image = probe_image(source, shown)
    try:
        image.load()
    except Exception as e:  # truncated data, a chunk past Pillow's limits, a bad palette...
        image.close()
        raise _unreadable(shown) from e
    return image


def decode_data_url(url: str) -> bytes:
    """The bytes of a ``data:image/<format>;base64,<data>`` URL.

    Raises:
        ImageError: not that form, not base64 (ASCII only), or over :data:`MAX_IMAGE_BYTES`.
    """
    header, comma, payload = url.partition(",")
    if not comma or not header.startswith("data:") or not header.endswith(";base64"):
        raise ImageError("an image data URL must be data:image/<format>;base64,<data>")
    if len(payload) // 4 * 3 > MAX_IMAGE_BYTES:
        raise ImageError(f"the image data URL holds over {MAX_IMAGE_BYTES // 2**20} MiB")
    try:
        return base64.b64decode(payload.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as e:
        raise ImageError("the image data URL is not valid base64") from e


class MediaFolder:
    """The folder a server reads image files from (vLLM's ``--allowed-local-media-path``).

    The folder is opened once, here, and every name is walked from that handle: a folder
    moved away and replaced by a link to another one after the server started is not
    followed (the names are still read beneath the folder that was opened). Relative names
    are taken from the working folder the server had then, so a working folder removed since
    changes nothing.

    Args:
        path: the folder; file names given to :meth:`read` are relative to the server's
            working folder (or absolute) and must lie in it.

    Raises:
        ImageError: ``path`` is not a folder.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.cwd = os.getcwd()
        self.path = self._full(os.fspath(path))
        self.real = Path(os.path.realpath(path))
        try:
            self._fd = os.open(self.real, _DIR)
        except (OSError, ValueError):
            raise ImageError(f"the media folder {os.fspath(path)!r} is not a folder") from None
        weakref.finalize(self, os.close, self._fd)

    def _full(self, name: str) -> Path:
        """``name`` made absolute from the working folder of the start, lexically (no
        file-system access)."""
        return Path(os.path.normpath(os.path.join(self.cwd, name)))

    def shown(self, name: str) -> str:
        """``name`` as messages show it: relative to the folder when inside it, never the
        server's own folders; cut to 100 characters."""
        if "\x00" not in name:
            full = self._full(name)
            if full.is_relative_to(self.path):
                name = str(full.relative_to(self.path))
        return repr(name if len(name) <= 100 else name[:100] + "...")

    def read(self, name: str, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
        """The bytes of the regular file ``name`` inside the folder, read from the handle
        :meth:`open_beneath` gave (module docstring).

        Raises:
            ImageError: ``name`` lies outside the folder (said as such, from the name alone);
                anything else that keeps it from being a readable file in the folder (one
                message for all of it), or a file over ``max_bytes``.
        """
        shown = self.shown(name)
        unreadable = _unreadable(shown)  # the message open_image gives a file of other bytes
        if "\x00" in name:
            raise unreadable
        full = self._full(name)  # lexical: no file-system access yet
        if not full.is_relative_to(self.path):
            raise ImageError(f"image {shown} is outside the media folder this server reads")
        try:
            fd = self.open_beneath(full.relative_to(self.path).parts)
        except (OSError, ValueError) as e:  # missing, a link out, a loop, a FIFO, too long...
            raise unreadable from e
        with open(fd, "rb") as f:
            if os.fstat(fd).st_size > max_bytes:
                raise ImageError(f"image {shown} is over {max_bytes // 2**20} MiB")
            os.set_blocking(fd, True)
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:  # it grew since the fstat
            raise ImageError(f"image {shown} is over {max_bytes // 2**20} MiB")
        return data

    def open_beneath(self, names: Sequence[str]) -> int:
        """A file descriptor of the regular file at ``names`` (a path under the folder, cut at
        its slashes), found beneath the folder without opening anything outside it: each name
        is looked at (``lstat``) before anything is opened; a folder is opened relative to the
        one above it, never through a link; a link is read and its target walked instead.

        Raises:
            OSError: anything else: missing, not a regular file, a link out of the folder
                (``..`` above it, an absolute target outside it), over :data:`MAX_LINKS`
                links, or a name swapped between its look and its open.
        """
        dirs = [self._fd]  # the folders walked down, the media folder's own handle first
        todo = list(reversed(names))  # the names still to walk, the next one last
        links = 0
        try:
            while todo:
                name = todo.pop()
                if name in ("", "."):
                    continue
                if name == "..":
                    if len(dirs) == 1:
                        raise OSError(errno.EXDEV, "above the media folder")
                    os.close(dirs.pop())
                    continue
                seen = os.stat(name, dir_fd=dirs[-1], follow_symlinks=False)
                if stat.S_ISLNK(seen.st_mode):
                    links += 1
                    if links > MAX_LINKS:
                        raise OSError(errno.ELOOP, "too many links")
                    target = os.readlink(name, dir_fd=dirs[-1])
                    if os.path.isabs(target):  # walked from the folder's top, if it is in it
                        target = self._inside(target)
                        while len(dirs) > 1:
                            os.close(dirs.pop())
                    todo.extend(reversed(target.split("/")))
                elif todo:  # a folder on the way (O_NOFOLLOW: not a link swapped in since)
                    dirs.append(os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=dirs[-1]))
                elif stat.S_ISREG(seen.st_mode):  # the file: is it the one looked at?
                    fd = os.open(name, _FILE, dir_fd=dirs[-1])
                    opened = os.fstat(fd)
                    if (opened.st_dev, opened.st_ino) == (seen.st_dev, seen.st_ino):
                        return fd
                    os.close(fd)
                    raise OSError(errno.ESTALE, "swapped since it was looked at")
                else:  # a folder, a FIFO, a device, a socket: never opened
                    raise OSError(errno.EINVAL, "not a regular file")
            raise OSError(errno.EISDIR, "a folder")
        finally:
            for d in dirs[1:]:  # the media folder's own stays open
                os.close(d)

    def _inside(self, target: str) -> str:
        """An absolute link target, relative to the folder (its real path or the one it was
        given as), read as written.

        Raises:
            OSError: it does not lie in the folder.
        """
        for top in (self.real, self.path):
            if Path(target).is_relative_to(top):
                return str(Path(target).relative_to(top))
        raise OSError(errno.EXDEV, "a link out of the media folder")

    def __repr__(self) -> str:
        return f"MediaFolder({str(self.path)!r})"
