"""The real SGLang server on a text model, as a context manager: start, generate, flush, stop.

SGLang 0.5.23 lives in its own venv (``make sglang``, :mod:`minirad.peers.sglang_env`) and runs
as ``python -m sglang.launch_server`` on 127.0.0.1 and free ports, with the settings its CPU
backend needs here (``--device cpu``, no CUDA graphs, a small static memory fraction) and its KV
events on ZMQ. It serves a text model only (:mod:`minirad.peers.text_model` says why). By
default an idle SGLang busy-loops a whole core (its scheduler polls); ``--sleep-on-idle`` makes
it sleep instead (4.0 -> 0.05 CPU-s per idle 4 s). A ``with`` block starts it and stops it.

Example::

    with SGLangServer(text_model_dir()) as server:  # starts SGLang: about 30 s
        out = server.generate([1, 17, 42, 99], max_new_tokens=8)
        out["output_ids"], out["cached_tokens"]  # [...], 0
        server.flush_cache()
"""

from __future__ import annotations

import json
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
        cpus: pin the server to these cores (default: the last usable core, so that an idle
            server's busy loop takes one core, not all); None pins nothing only if passed as
            ``cpus=()``.

    Attributes:
        base_url, kv_events_endpoint, replay_endpoint, model_name, log_path, startup_s: as
            :class:`~minirad.peers.vllm_server.VLLMServer`'s.

    Raises:
        PeerError: the SGLang venv is missing (the message says how to build it).
        InvalidArgumentError: no such model folder, a bad size, policy or ``cpus``.
    """

    name = "SGLang"

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
            PeerError: the server failed or answered something unexpected.
        """
        reply = self.post(
            "/generate",
            {
                "input_ids": [int(t) for t in input_ids],
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
            },
        )
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
        """Drop the whole radix tree (``POST /flush_cache``). SGLang refuses while requests
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
