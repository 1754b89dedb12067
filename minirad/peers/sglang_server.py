"""The real SGLang server on a text model, as a context manager: start, generate, flush, stop.

SGLang 0.5.23 lives in its own venv (``make sglang``, :mod:`minirad.peers.sglang_env`) and runs
as ``python -m sglang.launch_server`` on 127.0.0.1 and free ports, with the settings its CPU
backend needs here (``--device cpu``, no CUDA graphs, a small static memory fraction) and its KV
events on ZMQ. It serves a text model only (:mod:`minirad.peers.text_model` says why). By
default an idle SGLang busy-loops a whole core (its scheduler polls); ``--sleep-on-idle`` makes
it sleep instead (4.0 -> 0.05 CPU-s per idle 4 s). A ``with`` block starts it and stops it.

Example::

    with SGLangServer(text_model_dir()) as server:  # starts SGLang: 1 to 4 minutes on 2 cores
        out = server.generate([1, 17, 42, 99], max_new_tokens=8)
        out["output_ids"], out["cached_tokens"]  # [...], 0
        server.flush_cache()
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minirad.errors import InvalidArgumentError, PeerError
from minirad.peers.server_process import ServerProcess, free_port
from minirad.peers.sglang_env import sglang_python

__all__ = ["EVICTION_POLICIES", "SGLangServer"]

# SGLang's --radix-eviction-policy choices (sglang/srt/mem_cache/evict_policy.py).
EVICTION_POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru", "tlru")


def _vocab_size(model_dir: Path) -> int | None:
    """The model's vocabulary size from its config (a text model's, or a VLM's text_config)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(f"cannot read {model_dir / 'config.json'}: {e}") from e
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if type(size) is int and size > 0 else None


def _token_id(t: object) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


class SGLangServer(ServerProcess):
    """The real SGLang (``make sglang``) serving ``model_dir`` over HTTP on 127.0.0.1.

    Args:
        model_dir: a text model folder SGLang loads (for instance
            :func:`~minirad.peers.text_model.text_model_dir`, the shipped LLaVA's text half).
        port: the HTTP port (default: a free one).
        kv_events: publish KV events on ZMQ: a PUB socket (``kv_events_endpoint``) and a
            replay ROUTER (``replay_endpoint``), both bound on 127.0.0.1 and free ports.
        max_total_tokens: the KV pool's size in tokens (``--max-total-tokens``): small values
            make it evict.
        page_size: tokens per KV page (``--page-size``); the radix tree then matches and
            caches whole pages only.
        eviction_policy: ``--radix-eviction-policy``, one of :data:`EVICTION_POLICIES`.
        eviction_policy_config: ``--radix-eviction-policy-config`` (``tlru``'s threshold...).
        overlap_schedule: SGLang's default overlap scheduler; False passes
            ``--disable-overlap-schedule`` (it changes what a finished request caches).
        dtype: ``--dtype`` (float32: our engine's, the same greedy tokens).
        extra_args: more command-line arguments for the server.
        python: the SGLang venv's Python (default :func:`~minirad.peers.sglang_env.sglang_python`).
        cpus: pin the server to these cores (default None: the last usable core, so that the
            server takes one core, not all); ``cpus=()`` pins nothing.

    Attributes:
        base_url, kv_events_endpoint, replay_endpoint, model_name, log_path, startup_s: as
            :class:`~minirad.peers.vllm_server.VLLMServer`'s.

    Raises:
        PeerError: the SGLang venv is missing (the message says how to build it).
        InvalidArgumentError: no such model folder, a bad size, policy or ``cpus``.
    """

    name = "SGLang"
    # Its log's milestones (0.5.23), for start(progress=...). Importing SGLang in the
    # scheduler process takes most of the start: 50 s of 75 here, on a loaded 2-core machine.
    stages = (
        (r"server_args=", "importing SGLang in its scheduler process (the longest stage)"),
        (r"Init parallel begin", "setting up the scheduler"),
        (r"Load weight begin", "loading the weights"),
        (r"KV Cache is allocated", "allocating the KV cache and building the radix tree"),
        (r"Uvicorn running on", "listening; a first request goes through the model"),
    )

    def __init__(
        self,
        model_dir: str | os.PathLike,
        port: int | None = None,
        kv_events: bool = True,
        max_total_tokens: int = 8192,
        page_size: int = 1,
        eviction_policy: str = "lru",
        eviction_policy_config: dict | None = None,
        overlap_schedule: bool = True,
        dtype: str = "float32",
        extra_args: Sequence[str] = (),
        python: str | os.PathLike | None = None,
        cpus: Sequence[int] | None = None,
    ) -> None:
        if not isinstance(model_dir, str | os.PathLike):
            raise InvalidArgumentError(f"model_dir must be a path, got {model_dir!r}")
        self.model_dir = Path(model_dir).resolve()
        if not (self.model_dir / "config.json").is_file():
            raise InvalidArgumentError(f"no model folder (config.json) at {self.model_dir}")
        for name, value in (("max_total_tokens", max_total_tokens), ("page_size", page_size)):
            if type(value) is not int or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        if eviction_policy not in EVICTION_POLICIES:
            raise InvalidArgumentError(
                f"eviction_policy must be one of {EVICTION_POLICIES}, got {eviction_policy!r}"
            )
        if port is not None and (type(port) is not int or not 0 < port < 65536):
            raise InvalidArgumentError(f"port must be an int in 1 .. 65535, got {port!r}")
        if eviction_policy_config is not None:
            try:
                json.dumps(eviction_policy_config)
            except (TypeError, ValueError) as e:
                raise InvalidArgumentError(f"eviction_policy_config must be JSON: {e}") from e
            if not isinstance(eviction_policy_config, dict):
                raise InvalidArgumentError(
                    f"eviction_policy_config must be a dict, got {eviction_policy_config!r}"
                )
        if isinstance(extra_args, str | bytes):
            raise InvalidArgumentError(
                f"extra_args must be a list of arguments, got {extra_args!r}"
            )
        self.vocab_size = _vocab_size(self.model_dir)
        self.python = Path(python) if python is not None else sglang_python()
        self.model_name = self.model_dir.name
        if cpus is None:
            from minirad.peers.server_process import usable_cpus

            cpus = usable_cpus()[-1:]
        super().__init__(port, cpus or None)
        self.kv_events_endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self._kv_events_config: dict | None = None
        if kv_events:
            self.kv_events_endpoint = f"tcp://127.0.0.1:{free_port()}"
            self.replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
            self._kv_events_config = {
                "publisher": "zmq",
                "endpoint": self.kv_events_endpoint,
                "bind": True,
                "replay_endpoint": self.replay_endpoint,
                "topic": "",
            }
        self.max_total_tokens = max_total_tokens
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self.eviction_policy_config = eviction_policy_config
        self.overlap_schedule = overlap_schedule
        self.dtype = dtype
        self.extra_args = tuple(extra_args)

    # ------------------------------------------------------------------ lifecycle
    def command(self) -> list[str]:
        """The server's command line."""
        cmd = [
            str(self.python),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model_dir),
            "--served-model-name",
            self.model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--dtype",
            self.dtype,
            "--disable-cuda-graph",
            "--mem-fraction-static",
            "0.1",
            "--max-total-tokens",
            str(self.max_total_tokens),
            "--page-size",
            str(self.page_size),
            "--radix-eviction-policy",
            self.eviction_policy,
            "--enable-cache-report",  # usage.prompt_tokens_details.cached_tokens
            "--skip-server-warmup",
            "--sleep-on-idle",  # else an idle scheduler busy-loops a whole core
        ]
        if self.eviction_policy_config is not None:
            cmd += ["--radix-eviction-policy-config", json.dumps(self.eviction_policy_config)]
        if not self.overlap_schedule:
            cmd.append("--disable-overlap-schedule")
        if self._kv_events_config is not None:
            cmd += ["--kv-events-config", json.dumps(self._kv_events_config)]
        return cmd + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = super().env()
        env.update(SGLANG_DISABLE_REQUEST_LOGGING="1")
        return env

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"SGLangServer({self.base_url}, events={self.kv_events_endpoint}, {state})"

    # ------------------------------------------------------------------ requests
    def generate(self, input_ids: Sequence[int], max_new_tokens: int = 16) -> dict[str, Any]:
        """One greedy request on token ids (SGLang's native ``POST /generate``).

        Returns:
            ``{"output_ids", "text", "cached_tokens" (prompt tokens served from the radix
            tree), "prompt_tokens", "finish_reason"}``.

        Raises:
            InvalidArgumentError: ``input_ids`` is not a non-empty list of token ids of the
                model's vocabulary, or ``max_new_tokens`` is not a positive int (checked here:
                SGLang 0.5.23 dies on an id outside its embedding table).
            PeerError: the server failed (if it died, the message ends with its log's tail)
                or answered something unexpected.
        """
        ids = list(input_ids) if isinstance(input_ids, Sequence | range) else None
        bad = ids is None or not ids or isinstance(input_ids, str | bytes)
        vocab = self.vocab_size
        if bad or any(not _token_id(t) or t < 0 or (vocab and t >= vocab) for t in ids):
            raise InvalidArgumentError(
                f"input_ids must be a non-empty list of ints in 0 .. {vocab - 1 if vocab else 'N'}"
                f", got {str(input_ids)[:200]}"
            )
        if type(max_new_tokens) is not int or max_new_tokens < 1:
            raise InvalidArgumentError(
                f"max_new_tokens must be a positive int, got {max_new_tokens!r}"
            )
        body = {
            "input_ids": [int(t) for t in ids],
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
        }
        try:
            reply = self.post("/generate", body)
        except PeerError as e:
            if self._proc is not None and self._proc.poll() is not None:
                code = self._proc.returncode
                raise PeerError(
                    f"{self.name} died (exit code {code}): {e}{self._log_tail()}"
                ) from e
            raise
        try:
            meta = reply["meta_info"]
            return {
                "output_ids": list(reply["output_ids"]),
                "text": reply.get("text"),
                "cached_tokens": int(meta.get("cached_tokens") or 0),
                "prompt_tokens": int(meta["prompt_tokens"]),
                "finish_reason": meta.get("finish_reason"),
            }
        except (KeyError, TypeError, ValueError) as e:
            raise PeerError(f"unexpected /generate reply from SGLang: {str(reply)[:500]}") from e

    def flush_cache(self) -> bool:
        """Drop the whole radix tree (``GET /flush_cache``). SGLang refuses while requests
        run or wait: then False (retry when they finish).

        Raises:
            PeerError: the server failed.
        """
        try:
            self.get_text("/flush_cache")
        except PeerError as e:
            if "HTTP 400" in str(e):
                return False
            raise
        return True
