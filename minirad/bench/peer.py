"""The real vLLM as a peer of our engine: one long-lived worker process in the vLLM venv.

vLLM cannot be imported in the course venv (``minirad/peers/vllm_env.py``), so :class:`VLLMPeer`
starts ``minirad/bench/vllm_worker.py`` with the vLLM venv's Python once, waits until its
offline ``vllm.LLM`` is up (tens of seconds: started once), and then sends it workloads over a pipe
(length-prefixed msgpack frames; the protocol is in the worker's docstring). Timings are taken
inside the worker, around ``LLM.generate``, so the pipe and the PNG encoding are not counted.

Example::

    with VLLMPeer(max_num_seqs=8) as vllm:
        run = vllm.generate(workload, max_new_tokens=16)   # a bench.engine.RunResult
        vllm.reset_prefix_cache()
"""

from __future__ import annotations

import io
import math
import os
import select
import signal
import struct
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from minirad.bench.common import KVMemory, RunResult, Workload, thread_settings
from minirad.bench.rss import RSSPeak
from minirad.errors import InvalidArgumentError, PeerError
from minirad.kv_events.block_events import VLLM_BLOCK_SIZE
from minirad.models import DEFAULT_MODEL_DIR
from minirad.peers.vllm_env import vllm_python

__all__ = [
    "WORKER",
    "VLLMPeer",
    "WorkerPeer",
    "describe_threads",
    "kv_memory",
    "process_lines",
    "report_threads",
]

WORKER = Path(__file__).with_name("vllm_worker.py")
_FRAME = struct.Struct(">I")
_LOG_TAIL = 4000  # characters of the worker's log quoted in errors


class WorkerPeer:
    """A peer engine in a worker process of its own venv, driven over a pipe (the frames and
    commands of ``vllm_worker.py``'s docstring): started once, reused, and a context manager
    that stops it on exit. Subclasses build the command line and read the replies.

    Attributes:
        name: the peer's name in messages (``"vLLM"``).
        idle_s: seconds to wait after the peer's runs before another system runs, while the
            peer stops polling.
        info: what the worker reported when it came up.
        log_path: the worker's stdout and stderr (the peer's logs).
    """

    name = "peer"
    idle_s = 0.0

    def _start(
        self,
        cmd: list[str],
        env: dict[str, str],
        start_timeout: float,
        timeout: float,
        preexec_fn=None,
    ) -> None:
        """Start ``cmd`` and wait for its ready message (sets :attr:`info`).

        Raises:
            PeerError: the worker could not start, died or did not answer in time.
        """
        self.timeout = timeout
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder()
        fd, self.log_path = tempfile.mkstemp(prefix=f"minirad-{self.name.lower()}-", suffix=".log")
        os.close(fd)
        # O_APPEND: the worker's writes land at the end even while the tail is being read.
        try:
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env=env,
                    bufsize=0,
                    start_new_session=True,  # its own group: close() stops the peer's children
                    preexec_fn=preexec_fn,
                )
        except OSError as e:
            os.unlink(self.log_path)
            raise PeerError(f"cannot start the {self.name} worker with {cmd[0]}: {e}") from e
        try:
            ready = self._receive(time.monotonic() + start_timeout, "start")
            if not ready.get("ready"):
                raise PeerError(
                    f"the {self.name} worker sent {ready!r} instead of its ready message"
                )
        except BaseException:
            self.close()
            raise
        self.info: dict = ready["info"]

    def thread_settings(self) -> dict:
        """The worker's info, read now (threads and CPU affinity change once the peer's
        processes bind theirs)."""
        self.info = self._call({"op": "info"})["info"]
        return self.info

    def close(self) -> None:
        """Ask the worker to quit, then stop its whole process group if it lingers.
        Idempotent."""
        proc = self._proc
        if proc.poll() is None:
            try:
                self._send({"op": "quit"})
                self._receive(time.monotonic() + 30, "quit")
                proc.wait(timeout=30)
            except (PeerError, OSError, subprocess.TimeoutExpired):
                pass
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            if not _group_alive(proc.pid):
                break
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while _group_alive(proc.pid) and time.monotonic() < deadline:
                if proc.poll() is None:
                    try:
                        proc.wait(timeout=0.2)
                    except subprocess.TimeoutExpired:
                        pass
                else:
                    time.sleep(0.2)
        if proc.poll() is None:
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
        if os.path.exists(self.log_path):
            os.unlink(self.log_path)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def log_tail(self, chars: int = _LOG_TAIL) -> str:
        """The end of the worker's log (the peer's stdout and stderr)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - chars))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    # ------------------------------------------------------------------ the pipe
    def _call(self, message: dict) -> dict:
        self._send(message)
        reply = self._receive(time.monotonic() + self.timeout, message["op"])
        if not reply.get("ok"):
            raise PeerError(f"{self.name} worker, {message['op']}: {reply.get('error', reply)!r}")
        return reply

    def _send(self, message: dict) -> None:
        payload = self._encoder.encode(message)
        try:
            self._proc.stdin.write(_FRAME.pack(len(payload)) + payload)
        except (BrokenPipeError, ValueError) as e:  # dead worker, or closed by close()
            raise self._died() from e

    def _receive(self, deadline: float, what: str) -> dict:
        (size,) = _FRAME.unpack(self._read_exact(_FRAME.size, deadline, what))
        try:
            reply = self._decoder.decode(self._read_exact(size, deadline, what))
        except msgspec.DecodeError as e:
            raise PeerError(f"the {self.name} worker sent an unreadable frame: {e}") from e
        if not isinstance(reply, dict):
            raise PeerError(f"the {self.name} worker sent {type(reply).__name__}, not a map")
        return reply

    def _read_exact(self, n: int, deadline: float, what: str) -> bytes:
        fd = self._proc.stdout.fileno()
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(
                    f"the {self.name} worker did not answer {what!r} in time; its log ends:\n"
                    + self.log_tail()
                )
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not ready:
                if self._proc.poll() is not None:
                    raise self._died()
                continue
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise self._died()
            buf += chunk
        return bytes(buf)

    def _run_result(self, reply: dict, n_requests: int, name: str, kv: KVMemory) -> RunResult:
        """A worker's ``generate`` reply (its docstring's per-request dicts) as a RunResult;
        TTFTs only where the peer timed every request."""
        outs = reply["outputs"]
        if len(outs) != n_requests:
            raise PeerError(f"{self.name} answered {len(outs)} of {n_requests} requests")
        prompts = [o["prompt_token_ids"] for o in outs]
        cached = [o["num_cached_tokens"] for o in outs]
        timed = all(o["ttft"] is not None and o["ttft_from_start"] is not None for o in outs)
        return RunResult(
            name=name,
            outputs=[o["token_ids"] for o in outs],
            seconds=reply["seconds"],
            ttft=[o["ttft"] for o in outs] if timed else [],
            ttft_from_start=[o["ttft_from_start"] for o in outs] if timed else [],
            prefill_tokens=sum(map(len, prompts)) - sum(cached),
            encoder_calls=None,
            cached_tokens=sum(cached),
            prompt_token_ids=prompts,
            num_cached_tokens=cached,
            kv=kv,
            rss=RSSPeak(**reply["rss"]),
        )

    def _died(self) -> PeerError:
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return PeerError(
            f"the {self.name} worker exited (code {code}); its log ends:\n{self.log_tail()}"
        )


class VLLMPeer(WorkerPeer):
    """A real vLLM (offline ``LLM``, block size 32, float32, eager, prefix caching) in a
    worker process, started once and reused; a context manager that stops it on exit.

    Args:
        model: model folder (default: the shipped tiny LLaVA).
        max_num_seqs: requests vLLM runs at once.
        num_gpu_blocks_override: KV pool size in blocks; vLLM keeps block 0 as its null
            block, so ``N`` gives ``N - 1`` usable blocks. None: what 1 GiB holds
            (``VLLM_CPU_KVCACHE_SPACE=1``).
        structured_outputs_backend: vLLM's grammar backend for structured outputs
            (``structured_outputs_config.backend``: ``"guidance"`` is llguidance, as ours);
            None: vLLM's default (``"auto"``).
        omp_threads_bind: the CPUs of the model worker's OpenMP threads, one per CPU
            (``VLLM_CPU_OMP_THREADS_BIND`` in the worker's environment: ``"0-1"``, ``"0,1"``,
            ``"auto"``, ``"nobind"``); None: as in this environment (unset: vLLM's
            ``"auto"``, which on a small machine keeps a core for the front end).
        dtype: the dtype vLLM computes in (``"float32"``, ``"bfloat16"``).
        start_timeout: seconds to wait for the engine to come up.
        timeout: seconds to wait for any other answer.
        python: the vLLM venv's Python (default :func:`~minirad.peers.vllm_env.vllm_python`).

    Attributes:
        info: what the worker reported when it came up (see :func:`describe_threads`).

    Raises:
        PeerError: the vLLM venv is missing (the message says how to build it), or the
            worker died or did not answer in time (the message quotes its log's tail).
    """

    name = "vLLM"
    # vLLM's model worker busy-polls its shared-memory queue for 1 s after its last read
    # before it sleeps (SpinCondition.busy_loop_s, vllm/distributed/device_communicators/
    # shm_broadcast.py): the next system waits that out rather than share a core with it.
    idle_s = 1.5

    def __init__(
        self,
        model: str | os.PathLike = DEFAULT_MODEL_DIR,
        *,
        max_num_seqs: int = 8,
        num_gpu_blocks_override: int | None = None,
        structured_outputs_backend: str | None = None,
        omp_threads_bind: str | None = None,
        dtype: str = "float32",
        start_timeout: float = 600.0,
        timeout: float = 600.0,
        python: str | os.PathLike | None = None,
    ) -> None:
        if num_gpu_blocks_override is not None and num_gpu_blocks_override < 2:
            raise InvalidArgumentError("num_gpu_blocks_override must be >= 2 (one is vLLM's null)")
        python = Path(python) if python is not None else vllm_python()
        cmd = [str(python), "-P", str(WORKER), "--model", str(model)]
        cmd += ["--max-num-seqs", str(max_num_seqs), "--block-size", str(VLLM_BLOCK_SIZE)]
        cmd += ["--dtype", dtype]
        if num_gpu_blocks_override is not None:
            cmd += ["--num-gpu-blocks-override", str(num_gpu_blocks_override)]
        if structured_outputs_backend is not None:
            cmd += ["--structured-outputs-backend", structured_outputs_backend]
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM refuses to start without
        if omp_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind
        self._start(cmd, env, start_timeout, timeout)

    @property
    def max_num_seqs(self) -> int:
        """Requests vLLM runs at once."""
        return self.info["max_num_seqs"]

    # ------------------------------------------------------------------ commands
    def generate(
        self,
        workload: Workload,
        max_new_tokens: int,
        ignore_eos: bool = False,
        structured: dict | None = None,
    ) -> RunResult:
        """Run every request of ``workload`` greedy in one ``LLM.generate`` call.

        Args:
            workload: requests as ``(templated prompt, PIL images)`` (sent as PNG).
            max_new_tokens: vLLM's ``max_tokens``.
            ignore_eos: never stop on the end-of-sequence token (exactly
                ``max_new_tokens`` tokens, as ``stop_token_ids=()`` in our engine).
            structured: every request's structured output, as the fields of vLLM's
                ``StructuredOutputsParams`` (``{"json": schema}``, ``{"regex": ...}``,
                ``{"choice": [...]}``); None: free.

        Returns:
            a :class:`~minirad.bench.engine.RunResult`: outputs through the stop token,
            ``seconds`` of the call inside the worker, vLLM's per-request TTFT (empty lists
            if it kept no metrics), ``num_cached_tokens`` per request, ``prefill_tokens`` =
            prompt tokens minus cached ones, ``encoder_calls`` None (vLLM does not report
            vision-tower runs), ``kv`` from :func:`kv_memory` (``peak_held`` None: vLLM
            counts free cached blocks as free and reports no count of them), ``rss`` of
            vLLM's processes around the call (the worker's front end, engine core and model
            worker; see :func:`~minirad.bench.rss.peak_rss`).

        Raises:
            PeerError: the worker failed, died or timed out.
        """
        requests = [
            {"prompt": text, "images": [_png(im) for im in images]}
            for text, images in workload.requests
        ]
        reply = self._call(
            {
                "op": "generate",
                "requests": requests,
                "max_tokens": max_new_tokens,
                "ignore_eos": ignore_eos,
                "structured": structured,
            }
        )
        return self._run_result(
            reply,
            len(requests),
            f"vLLM {self.info['vllm_version']}",
            kv_memory(self.info, reply["kv_cache_usage"]["peak"]),
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, preprocessed image and encoder output (the next run
        starts as cold as a fresh engine). Returns False if vLLM refused (requests in flight).

        Raises:
            PeerError: the worker failed, died or timed out.
        """
        return bool(self._call({"op": "reset_prefix_cache"})["reset"])

    def describe(self) -> tuple[str, str]:
        """The peer's entry in a report's threads section, read now: its name and version,
        and :func:`describe_threads`."""
        info = self.thread_settings()
        return f"vLLM {info['vllm_version']}", describe_threads(info)


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")  # lossless: vLLM decodes the very pixels we feed our engine
    return buf.getvalue()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of the group exists but is not ours to signal
        return True
    return True


def kv_memory(info: dict, peak_usage: float | None) -> KVMemory:
    """vLLM's pool as a :class:`~minirad.bench.engine.KVMemory`: bytes from the KV tensors its
    model worker allocated (``info["kv_cache_tensors"]``, ``num_gpu_blocks`` blocks each),
    usable tokens without the null block, and ``peak_usage`` (the most
    ``SchedulerStats.kv_cache_usage`` sampled, a fraction of the usable blocks; None: no
    sample) in tokens of whole blocks.

    Raises:
        PeerError: a tensor has no dimension of ``num_gpu_blocks``, or the tensors do not
            divide into ``num_gpu_blocks`` blocks of ``block_size`` tokens.
    """
    blocks, block_size = info["num_gpu_blocks"], info["block_size"]
    tensors = info["kv_cache_tensors"]
    pool_bytes = sum(math.prod(t["shape"]) * t["element_size"] for t in tensors)
    bytes_per_token, rest = divmod(pool_bytes, blocks * block_size)
    if rest or not tensors or any(blocks not in t["shape"] for t in tensors):
        raise PeerError(f"vLLM's KV tensors {tensors} are not {blocks} blocks of {block_size}")
    usable = blocks - 1  # block 0 is vLLM's null block
    return KVMemory(
        bytes_per_token=bytes_per_token,
        pool_tokens=usable * block_size,
        pool_bytes=pool_bytes,
        block_size=block_size,
        peak_usage=None if peak_usage is None else round(peak_usage * usable) * block_size,
        peak_held=None,
    )


def describe_threads(info: dict) -> str:
    """vLLM's pool, then one line per process of the worker (its front end first, then the
    engine core and the model worker vLLM started): threads, the CPUs they may run on, the
    OpenMP / vLLM thread variables vLLM set in its environment, and its resident memory as
    the info was read (``info`` as in :attr:`VLLMPeer.info`)."""
    lines = [
        f"{info['num_gpu_blocks']} blocks of {info['block_size']} tokens (vLLM logs "
        f"{info['kv_cache_size_tokens']} tokens), max_num_seqs "
        f"{info['max_num_seqs']}, VLLM_CPU_OMP_THREADS_BIND={info['omp_threads_bind']}; "
        "its processes:"
    ]
    role = f", front end, torch {info['frontend_torch_threads']} threads"
    return "\n".join(lines + process_lines(info["processes"], role))


def process_lines(processes: Sequence[dict], first_role: str) -> list[str]:
    """A worker's processes (its ``info``'s), one line each: threads, CPUs, environment and
    memory; ``first_role`` tells what the first one is (the front end)."""
    lines = []
    for i, p in enumerate(processes):
        role = first_role if i == 0 else ""
        cpus = ", ".join(f"{n} on cpus {c}" for c, n in sorted(p["cpus"].items()))
        env = "".join(f" {k}={v}" for k, v in sorted(p["env"].items()))
        mem = "" if p.get("rss") is None else f", RSS {p['rss'] / 2**20:.0f} MiB"
        lines.append(
            f"  {p['name']} (pid {p['pid']}{role}): {p['threads']} threads, {cpus}{env}{mem}"
        )
    return lines


def report_threads(peers: WorkerPeer | Sequence[WorkerPeer] | None) -> dict[str, str]:
    """The threads section of a benchmark report: this process's torch settings, then each
    peer's processes (its ``describe()``: :func:`describe_threads` for vLLM)."""
    threads = {"HF and minirad (this process)": thread_settings()}
    if isinstance(peers, WorkerPeer):
        peers = [peers]
    for peer in peers or ():
        name, text = peer.describe()
        threads[name] = text
    return threads
