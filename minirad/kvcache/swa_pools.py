"""The two slot pools of a hybrid-SWA model (SGLang 0.5.23's ``SWATokenToKVPoolAllocator``).

Full-attention layers keep every token's KV; sliding-window layers keep only the last window's.
So the SWA pool is smaller, ``swa_full_tokens_ratio`` (SGLang's default 0.8) of the full one.
A token allocated for a request gets one slot in each pool; the full slot is the token's name
everywhere (the radix tree's value, the request's row), and ``full_to_swa`` maps it to its SWA
slot (SGLang's ``full_to_swa_index_mapping`` / ``translate_loc_from_full_to_swa``). Freeing a
token's SWA slot early (out of the window, or a tombstone) clears its mapping to ``-1``.
"""

from __future__ import annotations

from collections.abc import Sequence

from minirad.errors import InvalidArgumentError, OutOfMemoryError, UnknownBlockError

__all__ = ["NO_SWA", "SWASlotPools"]

NO_SWA = -1  # full_to_swa of a slot whose SWA KV is gone (or never allocated)


class SWASlotPools:
    """A full pool of ``full_size`` slots and an SWA pool of ``int(full_size * ratio)``.

    Args:
        full_size: slots in the full-attention pool.
        swa_full_tokens_ratio: SWA pool size over full pool size, in (0, 1].
    """

    def __init__(self, full_size: int, swa_full_tokens_ratio: float = 0.8) -> None:
        if type(full_size) is bool or not isinstance(full_size, int) or full_size < 1:
            raise InvalidArgumentError(f"full_size must be an int >= 1, got {full_size!r}")
        if not 0 < swa_full_tokens_ratio <= 1:
            raise InvalidArgumentError(
                f"swa_full_tokens_ratio must be in (0, 1], got {swa_full_tokens_ratio!r}"
            )
        self.full_size = full_size
        self.swa_size = max(1, int(full_size * swa_full_tokens_ratio))
        self.free_full: list[int] = list(range(full_size))
        self.free_swa: list[int] = list(range(self.swa_size))
        self.full_to_swa: list[int] = [NO_SWA] * full_size

    def available(self) -> tuple[int, int]:
        """Free slots: ``(full, swa)``."""
        return len(self.free_full), len(self.free_swa)

    def alloc(self, n: int) -> list[int]:
        """``n`` tokens' slots, one in each pool; returns the full slots (mapped to the SWA
        ones). Raises OutOfMemoryError (and takes nothing) when either pool is short."""
        if len(self.free_full) < n or len(self.free_swa) < n:
            raise OutOfMemoryError(f"need {n} slots, free (full, swa) = {self.available()}")
        full, self.free_full = self.free_full[:n], self.free_full[n:]
        swa, self.free_swa = self.free_swa[:n], self.free_swa[n:]
        for f, s in zip(full, swa, strict=True):
            self.full_to_swa[f] = s
        return full

    def translate(self, full: Sequence[int]) -> list[int]:
        """The SWA slots of full slots (``NO_SWA`` where freed)."""
        return [self.full_to_swa[f] for f in full]

    def free_swa_of(self, full: Sequence[int]) -> int:
        """Free the SWA slots of these tokens (those still mapped); return how many."""
        freed = 0
        for f in full:
            s = self.full_to_swa[f]
            if s != NO_SWA:
                self.free_swa.append(s)
                self.full_to_swa[f] = NO_SWA
                freed += 1
        return freed

    def free(self, full: Sequence[int]) -> None:
        """Free these tokens' slots in both pools."""
        self.free_swa_of(full)
        for f in full:
            if not 0 <= f < self.full_size:
                raise UnknownBlockError(f"full slot {f} is not in this pool")
        self.free_full.extend(full)

    def move_swa(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Give ``dst``'s tokens the SWA slots of ``src``'s (SGLang's ``_set_swa``): a tree
        node keeping its full slots adopts an incoming request's SWA KV."""
        for a, b in zip(src, dst, strict=True):
            self.full_to_swa[b], self.full_to_swa[a] = self.full_to_swa[a], NO_SWA
