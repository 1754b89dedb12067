"""The third tier of a hierarchical KV cache: pages of KV kept outside the engine's memory, here
on disk, found again by chained page hashes.

SGLang's HiCache puts a storage backend under its host pool (``--hicache-storage-backend
file``, ``mem_cache/hicache_storage.py``): when a page is backed up to host it is also written
to storage, behind the request; when a prompt misses both device and host, the cache asks
storage how many *leading* pages it holds and reads them into host slots instead of running
the model over them. The pages outlive the engine: a new engine on the same folder (after a
restart, SGLang issue #27619) starts warm.

A page's key is :func:`page_hashes`'s chained hash: page ``j``'s digest covers every token
before it, so a stored page is only ever found again behind the same prefix, and a run of
leading pages is a prefix match. The hashes are those of vLLM's block cache
(:func:`~minirad.kvcache.block_pool.hash_block_tokens` from
:func:`~minirad.kvcache.block_pool.none_hash`), so both caches name a page the same way.

Two backends implement :class:`HiCacheStorage`:

- :class:`HiCacheFile`: one safetensors file per page, ``<folder>/<hash>.safetensors``, written
  atomically by a background thread (write-behind). Every read is checked (format version,
  fingerprint of the model and layout, page hash, a digest of the bytes): a file that fails is a
  miss with a notice, never an exception and never wrong KV.
- :class:`HiCacheMemoryStorage`: a dict with an optional LRU capacity, for benchmarks and for
  caches without tensors.

Simplifications, on purpose: no batch API (SGLang's ``batch_get`` / ``batch_set``), no
zero-copy reads into host memory, no fsync (a file cut short by a crash fails the checks and is
a miss), and no eviction of files: the folder grows until someone empties it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import numbers
import os
import queue
import re
import stat
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import suppress
from typing import Protocol, runtime_checkable

import safetensors.torch as _st
import torch

from minirad.errors import InvalidArgumentError
from minirad.kvcache.block_pool import hash_block_tokens, none_hash
from minirad.kvcache.tokens import as_token_ids

__all__ = [
    "FORMAT_VERSION",
    "HiCacheFile",
    "HiCacheMemoryStorage",
    "HiCacheStorage",
    "page_hashes",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = "1"  # bump when the file layout or the digest changes: old files become misses
_FORMAT_NAME = "minirad-hicache-page"
_SUFFIX = ".safetensors"
_EMPTY = "__minirad_empty__"  # the placeholder tensor of a page without tensors
_HASH_RE = re.compile(r"[0-9a-f]{64}")
# Dtypes safetensors can store: its own table when it has one (private), else the common ones.
_STORABLE = frozenset(getattr(_st, "_TYPES", {}).values()) or frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)


def page_hashes(
    token_ids: Sequence[int],
    page_size: int,
    extra_key: str | None = None,
    parent: bytes | None = None,
) -> list[str]:
    """Hex digests of every *full* page of ``token_ids``, chained: page ``j``'s hash is
    ``hash_block_tokens(hash of page j-1, tokens of page j, extra)``, so it covers every page
    before it and equal hashes mean an equal prefix. A partial last page has no hash: it is
    never stored.

    The chain starts at ``parent`` (the digest of the page just before ``token_ids``, to hash a
    key piece by piece) or at ``none_hash(0)``. ``extra_key`` (a namespace: a LoRA adapter, a
    cache salt, an image set) goes into the first page's extra keys, as vLLM's block hashes do,
    and the chain carries it to every later page; with a ``parent`` it is not added again, the
    parent already carries it. So ``page_hashes(a + b)`` equals ``page_hashes(a) +
    page_hashes(b, parent=bytes.fromhex(page_hashes(a)[-1]))`` when ``len(a)`` is a multiple
    of ``page_size``; and the hashes are, in hex, the ``block_hashes`` of a
    :class:`~minirad.kvcache.kv_cache_manager.KVCacheManager` (text only, seed 0).

    Raises:
        InvalidArgumentError: ``page_size`` is not a positive int, ``parent`` is not a 32-byte
            digest, or ``extra_key`` is not a str.
        InvalidKeyError: ``token_ids`` is not a sequence of ints >= 0.
    """
    _check_positive_int(page_size, "page_size")
    if extra_key is not None and not isinstance(extra_key, str):
        raise InvalidArgumentError(f"extra_key must be a str or None, got {extra_key!r}")
    if parent is not None and (not isinstance(parent, bytes) or len(parent) != 32):
        hint = " (use bytes.fromhex on a hex digest)" if isinstance(parent, str) else ""
        raise InvalidArgumentError(f"parent must be a 32-byte digest or None{hint}, got {parent!r}")
    ids = as_token_ids(token_ids, "token_ids", plain=True)  # plain ints: numpy ints hash apart
    prev = none_hash(0) if parent is None else parent
    first_extra = (extra_key,) if extra_key is not None and parent is None else None
    out: list[str] = []
    for start in range(0, len(ids) - page_size + 1, page_size):
        prev = hash_block_tokens(prev, ids[start : start + page_size], first_extra)
        first_extra = None
        out.append(prev.hex())
    return out


@runtime_checkable
class HiCacheStorage(Protocol):
    """What the hierarchical cache needs from its third tier: pages of tensors keyed by
    :func:`page_hashes` digests. ``set`` may return before the page is durable; ``flush``
    waits for it."""

    def exists(self, page_hashes: Sequence[str]) -> int:
        """How many *leading* pages of ``page_hashes`` are stored (stops at the first miss)."""
        ...

    def get(self, page_hash: str) -> dict[str, torch.Tensor] | None:
        """The tensors of a page, or None on a miss (absent or unusable)."""
        ...

    def set(self, page_hash: str, tensors: dict[str, torch.Tensor]) -> None:
        """Store a page (a page already stored is kept: equal hashes mean equal KV)."""
        ...

    def flush(self) -> None:
        """Wait until every page passed to ``set`` is stored."""
        ...

    def close(self) -> None:
        """Flush and release the backend's resources."""
        ...


# --- argument checks -----------------------------------------------------------------------


def _check_positive_int(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")


def _check_hash(page_hash: object) -> str:
    """``page_hash`` in lower case, if it is a 64-hex-digit string (a SHA-256 hex digest)."""
    if isinstance(page_hash, str):
        h = page_hash.lower()
        if _HASH_RE.fullmatch(h):
            return h
    raise InvalidArgumentError(f"a page hash must be a 64-digit hex string, got {page_hash!r}")


def _check_hashes(hashes: object) -> list[str]:
    if isinstance(hashes, str | bytes) or not isinstance(hashes, Sequence):
        raise InvalidArgumentError(f"page_hashes must be a sequence of hex strings, got {hashes!r}")
    return [_check_hash(h) for h in hashes]


def _check_tensors(tensors: object) -> dict[str, torch.Tensor]:
    if not isinstance(tensors, dict):
        raise InvalidArgumentError(
            f"tensors must be a dict of str -> torch.Tensor, got {tensors!r}"
        )
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name.startswith("__"):
            raise InvalidArgumentError(
                f"tensor names must be non-empty str not starting with '__', got {name!r}"
            )
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"tensors[{name!r}] must be a torch.Tensor, got {t!r}")
        if t.layout is not torch.strided:
            raise InvalidArgumentError(f"tensors[{name!r}] must be dense, got layout {t.layout}")
        if t.dtype not in _STORABLE:
            raise InvalidArgumentError(f"tensors[{name!r}]: dtype {t.dtype} cannot be stored")
    return tensors


def _cpu_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies: the caller may reuse its (host-slot) tensors once ``set``
    returns, while the write is still queued."""
    return {
        name: torch.empty(t.shape, dtype=t.dtype).copy_(t.detach()) for name, t in tensors.items()
    }


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """BLAKE2b of every tensor's name, dtype, shape and bytes: catches a flipped bit in the data
    region, which the safetensors header alone cannot see."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# --- the in-memory backend -----------------------------------------------------------------


class HiCacheMemoryStorage:
    """A dict of pages, least recently used dropped first when ``capacity_pages`` is set.

    For benchmarks (a storage tier with no disk cost) and for caches that keep no tensors. Pages
    are copied in and out, so neither the caller's later writes to its tensors nor its writes to
    what ``get`` returned change a stored page. ``get`` and ``set`` refresh a page's recency;
    ``exists`` is a probe and does not.

    Raises:
        InvalidArgumentError: ``capacity_pages`` is neither None nor a positive int.
    """

    def __init__(self, capacity_pages: int | None = None) -> None:
        if capacity_pages is not None:
            _check_positive_int(capacity_pages, "capacity_pages")
        self.capacity_pages = capacity_pages
        self._pages: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self.notices: list[str] = []  # never written: a dict has no bad files
        self.hits = 0
        self.misses = 0
        self.pages_written = 0
        self.bytes_written = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._pages)

    def exists(self, page_hashes: Sequence[str]) -> int:
        """How many leading pages of ``page_hashes`` are stored."""
        hashes = _check_hashes(page_hashes)
        n = 0
        with self._lock:
            for h in hashes:
                if h not in self._pages:
                    break
                n += 1
        return n

    def get(self, page_hash: str) -> dict[str, torch.Tensor] | None:
        """Copies of the page's tensors, or None."""
        h = _check_hash(page_hash)
        with self._lock:
            page = self._pages.get(h)
            if page is None:
                self.misses += 1
                return None
            self._pages.move_to_end(h)
            self.hits += 1
        return {name: t.clone() for name, t in page.items()}

    def set(self, page_hash: str, tensors: dict[str, torch.Tensor]) -> None:
        """Store copies of ``tensors`` (a page already stored is only refreshed), then drop the
        least recently used pages beyond the capacity."""
        h = _check_hash(page_hash)
        _check_tensors(tensors)
        with self._lock:
            if h in self._pages:
                self._pages.move_to_end(h)
                return
        page = _cpu_copies(tensors)
        with self._lock:
            if h in self._pages:  # another thread stored it meanwhile
                self._pages.move_to_end(h)
                return
            self._pages[h] = page
            self.pages_written += 1
            self.bytes_written += _tensor_bytes(page)
            while self.capacity_pages is not None and len(self._pages) > self.capacity_pages:
                self._pages.popitem(last=False)
                self.evictions += 1

    def flush(self) -> None:
        """Nothing to wait for: ``set`` stores at once."""

    def close(self) -> None:
        """Nothing to release; the pages stay readable."""


# --- the file backend ----------------------------------------------------------------------

_FileSig = tuple[int, int, int, int]  # (device, inode, size, mtime_ns): one version of a file


def _sig(st: os.stat_result) -> _FileSig:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class _BadFile(Exception):
    """A page file we cannot use. ``remove``: it is damaged (nobody can use it), as opposed to
    foreign (another model's, another format version's), which is left in place."""

    def __init__(self, reason: str, remove: bool) -> None:
        super().__init__(reason)
        self.remove = remove


class HiCacheFile:
    """Pages on disk, one safetensors file each: ``<folder>/<hash>.safetensors``.

    Args:
        folder: the directory of the pages (created if missing). Another instance, in this
            process or a later one, on the same folder shares its pages.
        fingerprint: what the KV depends on besides the tokens: model, dtype, page layout,
            tensor-parallel rank. It is written into every file, and a file with another
            fingerprint is a miss, so a second model never reads the first's KV. ``""`` is a
            fingerprint like any other. (Two models in one folder overwrite each other's pages,
            whose names are their token hashes: give each model its own folder.)
        write_behind: ``set`` queues the page and returns; one daemon thread writes the queue in
            order. ``flush`` waits for it, ``close`` flushes and stops the thread. Until written,
            a queued page is served from memory. False writes in ``set``.
        max_page_bytes: a file larger than this is a miss, never read (a page's size is
            known: a 4 GB file named like one must not be loaded into memory). None: no cap.

    The folder must be trusted: its files are checked against damage (a digest), not against
    someone who writes a well-formed page of other KV there. The files are the user's own
    (mode 0600): a server running as another user does not read them.

    Each file is written to a temporary name in the folder and renamed into place
    (``os.replace``), so a reader sees a whole file or none. The file's metadata holds the
    format version, the fingerprint, the page hash and a digest of the tensors; ``get`` checks
    all four. A file that fails (unparsable, truncated, a flipped bit, another fingerprint or
    version, a page saved under another page's name) is a miss: ``get`` returns None, adds a
    line to :attr:`notices` and logs a warning, and ``exists`` stops counting it. A damaged
    file is deleted; a foreign one is left, ignored by this instance until it changes (a later
    ``set`` of ours replaces it).

    ``exists`` looks only at file names (one ``stat`` per page), so it may count a foreign or
    damaged file that no ``get`` has opened yet: the caller must take a miss from ``get``
    anyway (a file can also vanish in between).

    Counters: ``hits`` / ``misses`` (calls of ``get``), ``pages_written`` / ``bytes_written``
    (files written by this instance, bytes on disk). Use it as a context manager, or call
    :meth:`close`: queued pages are lost if the process exits first.

    Raises:
        InvalidArgumentError: ``folder`` is not a str or path, or not a usable directory;
            ``fingerprint`` is not a str; ``write_behind`` is not a bool.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        fingerprint: str = "",
        *,
        write_behind: bool = True,
        max_page_bytes: int | None = None,
    ) -> None:
        if not isinstance(folder, str | os.PathLike):
            raise InvalidArgumentError(f"folder must be a str or os.PathLike, got {folder!r}")
        path = os.fspath(folder)
        if not isinstance(path, str) or not path:
            raise InvalidArgumentError(f"folder must be a non-empty str path, got {folder!r}")
        if not isinstance(fingerprint, str):
            raise InvalidArgumentError(f"fingerprint must be a str, got {fingerprint!r}")
        if not isinstance(write_behind, bool):
            raise InvalidArgumentError(f"write_behind must be a bool, got {write_behind!r}")
        if max_page_bytes is not None and (type(max_page_bytes) is not int or max_page_bytes <= 0):
            raise InvalidArgumentError(
                f"max_page_bytes must be a positive int or None, got {max_page_bytes!r}"
            )
        if "\0" in path:
            raise InvalidArgumentError(f"folder {path!r} holds a NUL character")
        try:
            os.makedirs(path, exist_ok=True)
            # A write probe: a folder we cannot write to is refused now, not page by page.
            fd, probe = tempfile.mkstemp(prefix=".probe", dir=path)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise InvalidArgumentError(f"folder {path!r} is not a usable directory: {e}") from e
        self.folder = path
        self.fingerprint = fingerprint
        self.max_page_bytes = max_page_bytes
        self._write_failures = 0
        self.write_behind = write_behind
        self.notices: list[str] = []
        self.hits = 0
        self.misses = 0
        self.pages_written = 0
        self.bytes_written = 0
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, torch.Tensor]] = {}  # queued, not yet on disk
        self._rejected: dict[str, _FileSig] = {}  # page -> the version of its file found bad
        self._closed = False
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if write_behind:
            self._thread = threading.Thread(
                target=self._writer, name="minirad-hicache-writer", daemon=True
            )
            self._thread.start()

    def __repr__(self) -> str:
        return (
            f"HiCacheFile({self.folder!r}, fingerprint={self.fingerprint!r}, "
            f"pending={len(self._pending)}, pages_written={self.pages_written})"
        )

    def __enter__(self) -> HiCacheFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def path(self, page_hash: str) -> str:
        """The file of a page (whether or not it exists)."""
        return os.path.join(self.folder, _check_hash(page_hash) + _SUFFIX)

    # -- reads --

    def exists(self, page_hashes: Sequence[str]) -> int:
        """How many leading pages of ``page_hashes`` are stored: queued, or a regular file not
        already found bad. Stops at the first that is not."""
        hashes = _check_hashes(page_hashes)
        n = 0
        for h in hashes:
            with self._lock:
                if h in self._pending:
                    n += 1
                    continue
                rejected = self._rejected.get(h)
            try:
                st = os.stat(os.path.join(self.folder, h + _SUFFIX))
            except OSError:
                break
            if not stat.S_ISREG(st.st_mode) or _sig(st) == rejected:
                break
            n += 1
        return n

    def get(self, page_hash: str) -> dict[str, torch.Tensor] | None:
        """The tensors of a page (fresh CPU tensors), or None: not stored, or its file failed a
        check (then a notice is recorded). Never raises for a bad file."""
        h = _check_hash(page_hash)
        with self._lock:
            page = self._pending.get(h)
            if page is not None:
                self.hits += 1
                return {name: t.clone() for name, t in page.items()}
            rejected = self._rejected.get(h)
        path = os.path.join(self.folder, h + _SUFFIX)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                sig = _sig(st)
                if sig == rejected:  # the same bad file as before: no second notice
                    return self._miss()
                cap = self.max_page_bytes
                if cap is not None and st.st_size > cap:
                    self._reject(h, path, sig, _BadFile(f"{st.st_size} bytes, over {cap}", False))
                    return self._miss()
                data = f.read()
        except FileNotFoundError:
            return self._miss()
        except OSError as e:  # a directory, no permission, an I/O error
            self._notice(f"page {h[:12]}: cannot read {path}: {e}; treated as a miss")
            return self._miss()
        try:
            tensors = self._decode(h, data)
        except _BadFile as bad:
            self._reject(h, path, sig, bad)
            return self._miss()
        with self._lock:
            self.hits += 1
        return tensors

    def _miss(self) -> None:
        with self._lock:
            self.misses += 1
        return None

    def _decode(self, page_hash: str, data: bytes) -> dict[str, torch.Tensor]:
        """The tensors of a file's bytes, after every check; raises :class:`_BadFile`."""
        # The header (8-byte little-endian length, then JSON) is parsed here for the metadata:
        # safetensors.torch.load returns only the tensors.
        if len(data) < 8:
            raise _BadFile(f"file too short ({len(data)} bytes)", remove=True)
        n = int.from_bytes(data[:8], "little")
        if n > len(data) - 8:
            raise _BadFile(f"header of {n} bytes in a file of {len(data)}", remove=True)
        try:
            header = json.loads(data[8 : 8 + n])
        except ValueError as e:
            raise _BadFile(f"unreadable header ({e})", remove=True) from None
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT_NAME:
            raise _BadFile("not a minirad page file (no format in its metadata)", remove=True)
        if meta.get("version") != FORMAT_VERSION:
            raise _BadFile(
                f"format version {meta.get('version')!r}, expected {FORMAT_VERSION!r}",
                remove=False,
            )
        if meta.get("fingerprint") != self.fingerprint:
            raise _BadFile(
                f"fingerprint {meta.get('fingerprint')!r}, expected {self.fingerprint!r} "
                "(another model or layout)",
                remove=False,
            )
        if meta.get("page_hash") != page_hash:
            raise _BadFile(f"holds page {str(meta.get('page_hash'))[:12]}", remove=True)
        try:
            tensors = _st.load(data)
        except Exception as e:  # safetensors raises its own SafetensorError (an Exception)
            raise _BadFile(f"unreadable tensors ({e})", remove=True) from None
        tensors.pop(_EMPTY, None)
        if _digest(tensors) != meta.get("digest"):
            raise _BadFile("digest mismatch (damaged data)", remove=True)
        return tensors

    def _notice(self, message: str) -> None:
        message = f"hicache storage {self.folder}: {message}"
        with self._lock:
            self.notices.append(message)
        logger.warning("%s", message)

    def _reject(self, page_hash: str, path: str, sig: _FileSig, bad: _BadFile) -> None:
        """Record a bad file: a notice, and ``exists``/``get`` skip this version of it. A
        damaged one is deleted if it is still the file we read (another writer may have
        replaced it since; a race lost here costs a miss, never wrong data)."""
        action = "deleted" if bad.remove else "ignored"
        self._notice(f"page {page_hash[:12]}: {path}: {bad}; treated as a miss, file {action}")
        with self._lock:
            self._rejected[page_hash] = sig
        if bad.remove:
            with suppress(OSError):
                if _sig(os.stat(path)) == sig:
                    os.remove(path)

    # -- writes --

    def set(self, page_hash: str, tensors: dict[str, torch.Tensor]) -> None:
        """Store a page. A page that is queued, or on disk and not found bad, is kept as is
        (equal hashes mean equal tokens, so equal KV). With write-behind the tensors are
        copied and queued, and ``set`` returns before the file exists; after :meth:`close` it
        writes at once."""
        h = _check_hash(page_hash)
        _check_tensors(tensors)
        if self._stored(h):
            return
        if not self.write_behind or self._closed:
            self._write_or_notice(h, {n: t.detach().cpu().contiguous() for n, t in tensors.items()})
            return
        page = _cpu_copies(tensors)
        with self._lock:
            if not self._closed:  # checked under the lock: close() queues its stop under it
                if h not in self._pending:  # else another thread queued it meanwhile
                    self._pending[h] = page
                    self._queue.put(h)
                return
        self._write_or_notice(h, page)  # closed while we copied

    def _stored(self, h: str) -> bool:
        """Queued, or on disk and not found bad."""
        with self._lock:
            if h in self._pending:
                return True
        return self._on_disk(h)

    def _on_disk(self, h: str) -> bool:
        with self._lock:
            rejected = self._rejected.get(h)
        try:
            st = os.stat(os.path.join(self.folder, h + _SUFFIX))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and _sig(st) != rejected

    def _writer(self) -> None:
        """The write-behind thread: writes queued pages until it takes a None."""
        while True:
            h = self._queue.get()
            try:
                if h is None:
                    return
                with self._lock:
                    page = self._pending.get(h)
                try:
                    # on disk already: a set that raced with an earlier write of this page
                    if page is not None and not self._on_disk(h):
                        self._write_or_notice(h, page)
                finally:
                    with self._lock:  # only now: until the file exists, get serves the page
                        self._pending.pop(h, None)
            finally:
                self._queue.task_done()

    def _write_or_notice(self, h: str, tensors: dict[str, torch.Tensor]) -> None:
        """:meth:`_write`, a failure (a full disk, a removed folder) becoming a notice: storage
        is a cache, a page it could not keep is only a later miss."""
        try:
            self._write(h, tensors)
        except Exception as e:
            with self._lock:
                self._write_failures += 1
                n = self._write_failures
            if n == 1 or n & (n - 1) == 0:  # 1, 2, 4, 8...: a full disk does not flood the log
                self._notice(f"page {h[:12]}: write failed: {e!r}; page dropped ({n} so far)")

    def _write(self, h: str, tensors: dict[str, torch.Tensor]) -> None:
        """Serialize a page and move it into place atomically."""
        meta = {
            "format": _FORMAT_NAME,
            "version": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "page_hash": h,
            "digest": _digest(tensors),
        }
        # safetensors takes an empty dict today; a placeholder keeps the format independent of
        # that (and of the version installed).
        body = tensors if tensors else {_EMPTY: torch.zeros(0, dtype=torch.uint8)}
        data = _st.save(body, metadata=meta)
        self._write_file(os.path.join(self.folder, h + _SUFFIX), data)
        with self._lock:
            self._rejected.pop(h, None)
            self.pages_written += 1
            self.bytes_written += len(data)

    def _write_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to a temporary file beside ``path``, then rename it over ``path``: a
        reader sees the old file, no file, or the whole new one."""
        fd, tmp = tempfile.mkstemp(
            prefix="." + os.path.basename(path)[:16], suffix=".tmp", dir=self.folder
        )
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp)
            raise

    def flush(self) -> None:
        """Block until every queued page has been written (or has failed, with a notice)."""
        self._queue.join()  # every put has its task_done, the stop included

    def close(self) -> None:
        """Flush, then stop the writer thread. Reads still work; a later ``set`` writes at
        once. Calling it again does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._thread is not None:
                self._queue.put(None)  # behind every page queued so far: they are written first
        if self._thread is not None:
            self._thread.join()
            self._thread = None
