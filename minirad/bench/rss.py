"""Peak resident memory (RSS) of processes over a stretch of code, from Linux's ``/proc``.

``VmHWM`` in ``/proc/PID/status`` is a process's peak resident set since it started, or since
``5`` was last written to ``/proc/PID/clear_refs`` (Linux >= 4.0), which sets it to the current
``VmRSS``. :func:`peak_rss` resets the marks, runs its block and reads them back: the block's
peak. Where that is impossible (no ``/proc``, a mark that cannot be reset) it measures nothing
(None) rather than a peak from before the block.

Standard library only: the engine benchmark imports it, and the vLLM worker
(``vllm_worker.py``, which cannot import minirad) loads this file by its path, so both sides
measure the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

__all__ = ["RSSPeak", "peak_rss", "rss"]


@dataclass
class RSSPeak:
    """What :func:`peak_rss` measured, in bytes, summed over the processes (None: not measured).

    Attributes:
        start: resident memory as the block began (after the reset): what the processes
            held going in (weights, libraries, caches kept from earlier work).
        peak: the most resident memory of each process during the block, summed.
    """

    start: int | None = None
    peak: int | None = None


def _status_bytes(pid: int, field: str) -> int | None:
    """``field`` (``VmRSS``, ``VmHWM``) of ``/proc/PID/status`` in bytes; None if unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _sum(pids: Iterable[int], field: str) -> int | None:
    values = [_status_bytes(p, field) for p in pids]
    return None if not values or None in values else sum(values)


def rss(pids: Sequence[int] | None = None) -> int | None:
    """Resident memory now of ``pids`` (default: this process), summed, in bytes; None if
    unreadable."""
    return _sum(pids or [os.getpid()], "VmRSS")


@contextlib.contextmanager
def peak_rss(pids: Callable[[], Sequence[int]] | None = None) -> Iterator[RSSPeak]:
    """Measure the peak RSS of a block::

        with peak_rss() as mem:
            run()
        mem.peak  # bytes, or None

    First collects garbage and returns the C heap's free memory to the kernel
    (``malloc_trim``, glibc only), so that the block starts from what this process really
    holds, not from what an earlier run freed; then resets the high-water mark of every
    process ``pids()`` lists (default: this process). After the block, ``peak`` sums
    ``VmHWM`` over those processes and any that ``pids()`` lists then (started during the
    block: their whole life is in it). A process that ended meanwhile, or any mark that could
    not be reset or read, leaves ``start`` / ``peak`` None. Per-process peaks need not
    coincide, and pages that processes share count once in each, so over several processes
    ``peak`` is an upper bound of their joint peak.
    """
    listed = pids or (lambda: [os.getpid()])
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # no glibc: nothing to trim
        ctypes.CDLL(None).malloc_trim(0)
    before = list(listed())
    reset = True
    for pid in before:
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            reset = False
    mem = RSSPeak(start=_sum(before, "VmRSS") if reset else None)
    yield mem
    if reset:
        mem.peak = _sum([*before, *(p for p in listed() if p not in before)], "VmHWM")
