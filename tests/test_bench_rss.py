"""Peak RSS over a block (:mod:`minirad.bench.rss`), as the engine benchmark and the vLLM worker
measure each run: it sees what the block touches, not what was touched before it, sums over
the processes it is given, and says None where it cannot measure.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import minirad.bench.rss
from minirad.bench.peer import WORKER
from minirad.bench.rss import peak_rss, rss

MiB = 2**20
TOUCHED = 200 * MiB

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/PID/clear_refs"
)


def test_peak_grows_by_what_the_block_touches():
    with peak_rss() as mem:
        block = b"\x01" * TOUCHED  # every page written
        del block
    assert mem.start > 0
    assert mem.peak - mem.start >= TOUCHED - 10 * MiB


def test_peak_does_not_grow_without_allocation_nor_keep_an_earlier_peak():
    block = b"\x01" * TOUCHED  # freed before the block: the reset forgets it
    del block
    with peak_rss() as mem:
        sum(range(1000))
    assert mem.start > 0
    assert 0 <= mem.peak - mem.start < 20 * MiB
    assert abs(rss() - mem.start) < 20 * MiB


def test_peak_sums_the_processes_listed():
    """A child that touches 200 MB inside the block counts; this process's own peak is not
    raised by it."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; sys.stdin.readline(); b = b'\\x01' * int(sys.argv[1]); del b;"
            " print('done', flush=True); sys.stdin.readline()",
            str(TOUCHED),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        with peak_rss(lambda: [os.getpid(), child.pid]) as both:
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline() == "done\n"
        with peak_rss() as alone:
            pass
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert both.start > alone.start  # the child's resident memory too
    assert both.peak - both.start >= TOUCHED - 10 * MiB
    assert alone.peak - alone.start < 20 * MiB


def test_no_measure_where_a_process_cannot_be_read():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process
    with peak_rss(lambda: [os.getpid(), gone.pid]) as mem:
        pass
    assert (mem.start, mem.peak) == (None, None)
    assert rss([gone.pid]) is None


def test_the_vllm_worker_loads_the_same_helper_by_its_path():
    """vllm_worker.py cannot import minirad; it loads rss.py beside it (its module level is
    standard library only, so it loads here too) and reports each process's RSS."""
    spec = importlib.util.spec_from_file_location("vllm_worker_under_test", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    assert Path(worker.rss.__file__) == Path(minirad.bench.rss.__file__)
    assert worker._process(os.getpid())["rss"] > 0
    assert worker._engine_pids()[0] == os.getpid()
