"""What the peer workers share: the pipe's frames, the engine's process tree, and each process's
threads, CPUs, thread variables and resident memory.

``vllm_worker.py`` and ``sglang_worker.py`` run in the peers' own venvs and cannot import
minirad: each loads this file by its path (:func:`load_beside`), and this file loads ``rss.py``
beside it the same way, so every side measures memory as the engine benchmark does. Standard
library only (msgspec, which every peer venv has, is imported when a :class:`Channel` is made).
"""

from __future__ import annotations

import importlib.util
import os
import struct
import sys
from collections import Counter
from pathlib import Path

__all__ = [
    "FRAME",
    "Channel",
    "descendants",
    "engine_pids",
    "load_beside",
    "process",
    "processes",
    "reply_channel",
    "rss",
]

FRAME = struct.Struct(">I")


def load_beside(filename: str, name: str):
    """The module in ``filename`` beside this file, loaded by its path as ``name`` (this folder
    is not on the workers' ``sys.path``: ``-P`` keeps it off, as its ``trace.py`` would shadow
    the standard library's), once per process."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(filename))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass looks its module up while it is defined
    spec.loader.exec_module(module)
    return module


rss = load_beside("rss.py", "minirad_bench_rss")


class Channel:
    """Length-prefixed msgpack frames (a 4-byte big-endian length, then that many bytes):
    commands from ``rfile``, replies to the fd ``wfd``."""

    def __init__(self, rfile, wfd: int) -> None:
        import msgspec

        self.rfile = rfile
        self.wfd = wfd
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder()

    def send(self, message: dict) -> None:
        payload = self.encoder.encode(message)
        data = memoryview(FRAME.pack(len(payload)) + payload)
        while data:
            data = data[os.write(self.wfd, data) :]

    def receive(self) -> dict | None:
        """The next command, or None at the end of the input."""
        head = self.rfile.read(FRAME.size)
        if len(head) < FRAME.size:
            return None
        (size,) = FRAME.unpack(head)
        payload = self.rfile.read(size)
        if len(payload) < size:
            return None
        return self.decoder.decode(payload)


def reply_channel() -> Channel:
    """Before the peer is imported (it logs to stdout): keep the original stdout as the reply
    channel, point file descriptor 1 at stderr, and close the channel's descriptor in every
    forked child (a child holding the pipe open would hide this process's death from the
    client). Returns the channel, commands on stdin."""
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    held = [reply_fd]

    def drop_reply_fd() -> None:
        if held[0] is not None:  # only once: a grandchild must not close a reused number
            os.close(held[0])
            held[0] = None

    os.register_at_fork(after_in_child=drop_reply_fd)
    return Channel(sys.stdin.buffer, reply_fd)


def descendants(pid: int) -> list[int]:
    """``pid``'s child processes, their children, and so on (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in sorted(children.get(todo.pop(), [])):
            out.append(child)
            todo.append(child)
    return out


def engine_pids() -> list[int]:
    """This process (the peer's front end) and its descendants (its engine's processes)."""
    return [os.getpid(), *descendants(os.getpid())]


THREAD_VARS = (
    "OMP_NUM_THREADS",
    "OMP_PLACES",
    "OMP_PROC_BIND",
    "GOMP_CPU_AFFINITY",
    "KMP_AFFINITY",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "SGLANG_CPU_OMP_THREADS_BIND",
)


def process(pid: int) -> dict:
    """One process: name, thread count, how many threads may run on which CPUs, the
    OpenMP / vLLM / SGLang thread variables in its environment (what the peer set for its
    workers) and its resident memory now (bytes; None if unreadable)."""
    with open(f"/proc/{pid}/comm") as f:
        name = f.read().strip()
    cpus: Counter[str] = Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list:"):
                        cpus[line.split(":", 1)[1].strip()] += 1
        except OSError:
            continue
    env = {}
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                key, _, value = item.decode(errors="replace").partition("=")
                if key in THREAD_VARS:
                    env[key] = value
    except OSError:
        pass
    return {
        "pid": pid,
        "name": name,
        "threads": sum(cpus.values()),
        "cpus": dict(cpus),
        "env": env,
        "rss": rss.rss([pid]),
    }


def processes() -> list[dict]:
    """:func:`process` of every process of :func:`engine_pids` still there."""
    out = []
    for pid in engine_pids():
        try:
            out.append(process(pid))
        except OSError:
            continue
    return out
