"""The encoder cache: image features keyed by image hash, so the vision tower runs once per
distinct image (vLLM's ``EncoderCacheManager``, ``vllm/v1/core/encoder_cache_manager.py``).

The radix tree saves the *decoder's* work on an image (its KV); this cache saves the *vision
tower's* work. They are complementary: a new request whose prompt shares an image with an
earlier one but not the text before it (``A <img>`` vs ``B <img>``) cannot reuse KV (the
positions and context differ) but reuses the features. And a request whose cached prefix
already covers an image needs no features for it at all: the engine asks this cache only for
images that overlap the tokens it computes.

Capacity is in feature rows (= placeholder tokens), least recently used out first.

The cache also remembers which images it has ever encoded (:meth:`EncoderCache.was_encoded`):
an image never encoded cannot have KV in the radix tree, so the first request that computes it
will need its features; the model runner uses that to encode such images ahead of time.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from minirad.errors import InvalidArgumentError

__all__ = ["EncoderCache"]


class EncoderCache:
    """Image features by ``mm_hash``, LRU, at most ``capacity`` rows in total.

    Args:
        capacity: feature rows (tokens) kept; 0 keeps nothing (every use runs the encoder).

    Attributes:
        num_encoder_calls: times the encoder ran (misses).
        num_hits: times features came from the cache (encoder calls saved).
        num_evictions: entries dropped to make room.
    """

    def __init__(self, capacity: int = 4096) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise InvalidArgumentError(f"capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._rows = 0
        self._encoded: set[str] = set()  # every hash ever put
        self._ahead: set[str] = set()  # encoded ahead and not used yet: its first get is no hit
        self.num_encoder_calls = 0
        self.num_hits = 0
        self.num_evictions = 0

    def get(self, mm_hash: str) -> torch.Tensor | None:
        """The cached features of image ``mm_hash`` (counted as a hit), or None."""
        feats = self._entries.get(mm_hash)
        if feats is not None:
            self._entries.move_to_end(mm_hash)
            if mm_hash in self._ahead:  # the use it was encoded for: no run saved
                self._ahead.discard(mm_hash)
            else:
                self.num_hits += 1
        return feats

    def put(self, mm_hash: str, feats: torch.Tensor, ahead: bool = False) -> None:
        """Store freshly encoded ``[num_tokens, hidden]`` features (counted as one encoder
        call), evicting least recently used entries to make room. Features larger than the
        whole capacity are not kept. ``ahead``: encoded before any request asked for them;
        the first :meth:`get` then counts as the use they were encoded for, not as a hit."""
        self.num_encoder_calls += 1
        self._encoded.add(mm_hash)
        rows = feats.shape[0]
        if rows > self.capacity or mm_hash in self._entries:
            return
        while self._rows + rows > self.capacity:
            evicted, old = self._entries.popitem(last=False)
            self._ahead.discard(evicted)
            self._rows -= old.shape[0]
            self.num_evictions += 1
        self._entries[mm_hash] = feats
        self._rows += rows
        if ahead:
            self._ahead.add(mm_hash)

    def was_encoded(self, mm_hash: str) -> bool:
        """Whether :meth:`put` was ever given these features (stored or not)."""
        return mm_hash in self._encoded

    @property
    def free_rows(self) -> int:
        """Rows that can be stored without evicting anything."""
        return self.capacity - self._rows

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_rows(self) -> int:
        """Feature rows held now."""
        return self._rows

    def clear(self) -> None:
        """Drop every entry (counters and the record of encoded images stay: the tree may
        still hold their KV)."""
        self._entries.clear()
        self._ahead.clear()
        self._rows = 0

    def __repr__(self) -> str:
        return (
            f"EncoderCache(entries={len(self)}, rows={self._rows}/{self.capacity}, "
            f"calls={self.num_encoder_calls}, hits={self.num_hits})"
        )
