"""The real SGLang as a peer of our engine: one long-lived worker process in the SGLang venv.

SGLang cannot be imported in the course venv (``minirad/peers/sglang_env.py``), so
:class:`SGLangPeer` starts ``minirad/bench/sglang_worker.py`` with the SGLang venv's Python once,
waits until its offline ``sglang.Engine`` is up (about 20 s), and then sends it workloads over a
pipe, as :class:`~minirad.bench.peer.VLLMPeer` does with vLLM. Timings are taken inside the
worker, around the batch it hands SGLang.

SGLang 0.5.23 serves no LLaVA on CPU (``minirad/peers/text_model.py``): the peer loads the
LLaVA's text half and takes text requests only.

Example::

    with SGLangPeer(text_model_dir(), max_running_requests=8) as sglang:
        run = sglang.generate(workload, max_new_tokens=16)   # a bench.common.RunResult
        sglang.reset_prefix_cache()
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

from minirad.bench.common import KVMemory, Workload
from minirad.bench.peer import WorkerPeer, process_lines
from minirad.errors import InvalidArgumentError, PeerError
from minirad.peers.server_process import usable_cpus
from minirad.peers.sglang_env import sglang_python
from minirad.peers.text_model import text_model_dir
from minirad.peers.vllm_env import die_with_parent

__all__ = [
    "NO_IMAGES",
    "SCHEDULE_POLICIES",
    "WORKER",
    "SGLangPeer",
    "cpu_list",
    "describe_threads",
    "kv_memory",
    "text_model_for",
]

WORKER = Path(__file__).with_name("sglang_worker.py")
# SGLang 0.5.23's --schedule-policy choices (srt/arg_groups/fields/schedule.py) but "priority" and
# "routing-key", which need per-request fields.
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "hrrn", "shortest-prefill-first", "lof", "random")
NO_IMAGES = (
    "SGLang 0.5.23 cannot serve LLaVA on CPU (it has no CLIP tower class there): the SGLang "
    "peer runs text workloads only"
)


def text_model_for(model: str | os.PathLike) -> Path:
    """The folder SGLang loads for ``model``: a LLaVA's text half
    (:func:`~minirad.peers.text_model.text_model_dir`, built once under ``build/``), or
    ``model`` itself if it is a text model already.

    Raises:
        InvalidArgumentError: no ``config.json``, or a VLM other than a LLaVA over a Llama.
    """
    path = Path(model)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(f"no readable config.json in {path}: {e}") from e
    if "text_config" in config or "vision_config" in config:
        return text_model_dir(path)  # raises for a VLM that is not a LLaVA over a Llama
    return path


class SGLangPeer(WorkerPeer):
    """A real SGLang (offline ``sglang.Engine`` on CPU, radix cache on, float32) in a worker
    process, started once and reused; a context manager that stops it on exit.

    Args:
        model: a text model folder, or a LLaVA whose text half it loads
            (:func:`text_model_for`).
        max_running_requests: requests SGLang runs at once.
        max_total_tokens: its KV pool, in tokens.
        page_size: tokens per KV page (its radix tree matches whole pages).
        schedule_policy: SGLang's ``--schedule-policy`` (:data:`SCHEDULE_POLICIES`); None:
            its default, ``fcfs`` in 0.5.23. Only its cache-aware policies (``lpm``,
            ``dfs-weight``, ``hrrn``, ``shortest-prefill-first``) match the waiting requests
            and move one whose prefix another waiting request shares to the back (in-batch
            prefix caching), which our engine does under ``fcfs`` too.
        omp_threads_bind: pin SGLang's processes to these CPUs (``"0-1"``, ``"0,1"``) with one
            OpenMP thread per CPU in its scheduler, where the model runs; None: unpinned, one
            OpenMP thread unless ``OMP_NUM_THREADS`` is set here.
        dtype: the dtype SGLang computes in (``"float32"``, ``"bfloat16"``).
        start_timeout: seconds to wait for the engine to come up.
        timeout: seconds to wait for any other answer.
        python: the SGLang venv's Python (default
            :func:`~minirad.peers.sglang_env.sglang_python`).

    Attributes:
        info: what the worker reported when it came up (see :func:`describe_threads`).
        model_dir: the text model folder SGLang loaded.

    Raises:
        PeerError: the SGLang venv is missing (the message says how to build it), or the
            worker died or did not answer in time (the message quotes its log's tail).
        InvalidArgumentError: a model SGLang cannot load here, a size below 1, an unknown
            schedule policy, or ``omp_threads_bind`` not a list of CPUs this process may use.
    """

    name = "SGLang"
    idle_s = 0.0  # sleep_on_idle: its scheduler sleeps as soon as it has nothing to run

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        max_running_requests: int = 8,
        max_total_tokens: int = 4096,
        page_size: int = 1,
        schedule_policy: str | None = None,
        omp_threads_bind: str | None = None,
        dtype: str = "float32",
        start_timeout: float = 600.0,
        timeout: float = 600.0,
        python: str | os.PathLike | None = None,
    ) -> None:
        for arg, value in (
            ("max_running_requests", max_running_requests),
            ("max_total_tokens", max_total_tokens),
            ("page_size", page_size),
        ):
            if type(value) is not int or value < 1:
                raise InvalidArgumentError(f"{arg} must be a positive int, got {value!r}")
        if omp_threads_bind is not None:
            cpu_list(omp_threads_bind)
        if schedule_policy is not None and schedule_policy not in SCHEDULE_POLICIES:
            raise InvalidArgumentError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {schedule_policy!r}"
            )
        python = Path(python) if python is not None else sglang_python()
        self.model_dir = text_model_for(model)
        cmd = [str(python), "-P", str(WORKER), "--model", str(self.model_dir)]
        cmd += ["--max-running-requests", str(max_running_requests)]
        cmd += ["--max-total-tokens", str(max_total_tokens), "--page-size", str(page_size)]
        cmd += ["--dtype", dtype]
        if schedule_policy is not None:
            cmd += ["--schedule-policy", schedule_policy]
        if omp_threads_bind is not None:
            cmd += ["--omp-threads-bind", omp_threads_bind]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DO_NOT_TRACK="1")
        env.pop("VIRTUAL_ENV", None)  # the course venv's; the worker runs in SGLang's
        # The kernel's parent-death signal belongs to the thread that started the child: only
        # from the main thread (see minirad.peers.server_process).
        on_main = threading.current_thread() is threading.main_thread()
        self._start(cmd, env, start_timeout, timeout, die_with_parent if on_main else None)

    @property
    def max_num_seqs(self) -> int:
        """Requests SGLang runs at once (``max_running_requests``)."""
        return self.info["max_running_requests"]

    def generate(self, workload: Workload, max_new_tokens: int, ignore_eos: bool = False):
        """Run every request of ``workload`` greedy, all handed to SGLang at once.

        Args:
            workload: text requests as ``(templated prompt, [])``; SGLang tokenizes them with
                the same tokenizer.
            max_new_tokens: SGLang's ``max_new_tokens``.
            ignore_eos: never stop on the end-of-sequence token.

        Returns:
            a :class:`~minirad.bench.common.RunResult`: outputs through the stop token,
            ``seconds`` of the call inside the worker, SGLang's per-request TTFT,
            ``num_cached_tokens`` per request (its radix tree's hits), ``prefill_tokens`` =
            prompt tokens minus cached ones, ``encoder_calls`` None (no images), ``kv`` from
            :func:`kv_memory`, ``rss`` of SGLang's processes around the call.

        Raises:
            InvalidArgumentError: a request has images (:data:`NO_IMAGES`).
            PeerError: the worker failed, died or timed out.
        """
        if any(images for _, images in workload.requests):
            raise InvalidArgumentError(f"{NO_IMAGES}; workload {workload.name!r} has images")
        requests = [{"prompt": text} for text, _ in workload.requests]
        reply = self._call(
            {
                "op": "generate",
                "requests": requests,
                "max_tokens": max_new_tokens,
                "ignore_eos": ignore_eos,
            }
        )
        return self._run_result(
            reply, len(requests), f"SGLang {self.info['sglang_version']}", kv_memory(self.info)
        )

    def reset_prefix_cache(self) -> bool:
        """Drop SGLang's whole radix tree (``Engine.flush_cache``), so that the next run starts
        as cold as a fresh engine. Returns False if SGLang refused (requests in flight).

        Raises:
            PeerError: the worker failed, died or timed out.
        """
        return bool(self._call({"op": "reset_prefix_cache"})["reset"])

    def describe(self) -> tuple[str, str]:
        """The peer's entry in a report's threads section, read now."""
        info = self.thread_settings()
        return f"SGLang {info['sglang_version']}", describe_threads(info)


def cpu_list(text: str) -> list[int]:
    """``"0-1"``, ``"0,2"``, ``"0-3,6"`` as CPUs (``sglang_worker.parse_cpus``'s format), all
    of which this process may use.

    Raises:
        InvalidArgumentError: not such a list (vLLM's ``auto`` and ``nobind`` included), or a
            CPU this process may not use.
    """
    if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", text):
        raise InvalidArgumentError(
            f"SGLang's threads bind to a list of CPUs (0-1, 0,1), not {text!r}"
        )
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        if last and int(last) < int(first):
            raise InvalidArgumentError(f"bad CPU range {part!r} in {text!r}")
        cpus.update(range(int(first), int(last or first) + 1))
    if not cpus <= set(usable_cpus()):
        raise InvalidArgumentError(f"CPUs {text!r}: this process may use {usable_cpus()} only")
    return sorted(cpus)


def kv_memory(info: dict) -> KVMemory:
    """SGLang's pool as a :class:`~minirad.bench.common.KVMemory`: ``token_capacity`` usable
    tokens of ``kv_bytes_per_token`` (K and V over all layers), and the bytes of its K and V
    buffers, which hold one page more (SGLang's padding slot). No peaks: SGLang reports no
    per-step KV usage to an offline engine.

    Raises:
        PeerError: those bytes are not what SGLang itself reports (``kv_cache_gb``, rounded
            to 1 MB), i.e. its pool is not laid out as this assumes.
    """
    per_token, tokens, page = info["kv_bytes_per_token"], info["token_capacity"], info["page_size"]
    pool_bytes = (tokens + page) * per_token
    if abs(pool_bytes / 2**30 - info["kv_cache_gb"]) > 0.0006:
        raise PeerError(
            f"SGLang reports a {info['kv_cache_gb']} GB KV pool, not the {pool_bytes} bytes of "
            f"{tokens} + {page} tokens of {per_token} bytes"
        )
    return KVMemory(
        bytes_per_token=per_token,
        pool_tokens=tokens,
        pool_bytes=pool_bytes,
        block_size=page,
        peak_usage=None,
        peak_held=None,
    )


def describe_threads(info: dict) -> str:
    """SGLang's pool and scheduling settings, then one line per process of the worker (its
    tokenizer manager first, then the scheduler, which runs the model, and the detokenizer):
    threads, the CPUs they may run on, the OpenMP variables in its environment and its
    resident memory as the info was read (``info`` as in :attr:`SGLangPeer.info`)."""
    bind = info["omp_threads_bind"] or "unpinned"
    overlap = "on" if info["overlap_schedule"] else "off"
    lines = [
        f"{info['token_capacity']} tokens in pages of {info['page_size']}, "
        f"max_running_requests {info['max_running_requests']}, schedule_policy "
        f"{info['schedule_policy']}, overlap scheduler {overlap}, "
        f"{info['attention_backend']} attention, sleep_on_idle, CPUs {bind}, "
        f"OMP_NUM_THREADS={info['omp_num_threads']}; its processes:"
    ]
    return "\n".join(lines + process_lines(info["processes"], ", tokenizer manager"))
