"""The real vLLM OpenAI server on our model, as a context manager: start, ask, reset, restart, stop.

vLLM cannot be imported in the course venv (:mod:`minirad.peers.vllm_env`), so the server runs as
``python -m vllm.entrypoints.openai.api_server`` from the vLLM venv, on 127.0.0.1 and free
ports, with the settings vLLM's CPU backend needs here (32-token blocks, float32, eager mode, a
1 GiB KV cache) and its KV events on ZMQ. The client side uses only the standard library.

Example::

    with VLLMServer() as server:  # starts vLLM: 1 to 2 minutes on 2 cores
        sub = KVEventSubscriber(server.kv_events_endpoint, server.replay_endpoint)
        answer = server.chat("Describe the image.", image="data/images/red_circle.png")
        answer["token_ids"], answer["cached_tokens"]  # [68, 334, ...], 0
        server.reset_prefix_cache()  # AllBlocksCleared, with the next request's events
"""

from __future__ import annotations

import base64
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minirad.errors import InvalidArgumentError, PeerError
from minirad.kv_events.block_events import VLLM_BLOCK_SIZE
from minirad.peers.server_process import ServerProcess, free_port
from minirad.peers.vllm_env import REPO_ROOT, vllm_python

__all__ = ["DEFAULT_MODEL_DIR", "VLLMServer"]

# Not imported from minirad.models, which imports torch and transformers: this module must not.
DEFAULT_MODEL_DIR = REPO_ROOT / "data" / "models" / "minirad-tiny-llava"


def _image_data_url(image: Any) -> str:
    """A PIL image or an image file as a ``data:image/png;base64,...`` URL (PNG is lossless:
    vLLM decodes the pixels we have)."""
    from PIL import Image  # only a request with an image needs it

    if not isinstance(image, Image.Image):
        try:
            image = Image.open(image)
            image.load()
        except (OSError, TypeError, ValueError) as e:
            raise InvalidArgumentError(f"cannot read image {image!r}: {e}") from e
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class VLLMServer(ServerProcess):
    """The real vLLM (``make vllm``) serving ``model_dir`` over HTTP on 127.0.0.1.

    Args:
        model_dir: a model folder vLLM loads (default: the course's shipped tiny LLaVA).
        port: the HTTP port (default: a free one).
        kv_events: publish KV events on ZMQ: a PUB socket (``kv_events_endpoint``) and a
            replay ROUTER (``replay_endpoint``), both on free ports.
        num_gpu_blocks: cap the KV pool at this many blocks (``--num-gpu-blocks-override``;
            vLLM keeps block 0 as its null block, so N - 1 hold KV); None: vLLM sizes it from
            ``VLLM_CPU_KVCACHE_SPACE`` (1 GiB here).
        max_num_seqs: requests running at once.
        extra_args: more command-line arguments for the server.
        python: the vLLM venv's Python (default :func:`~minirad.peers.vllm_env.vllm_python`).
        cpus: pin the server (its engine-core process and OpenMP threads included) to these
            cores; None: no pinning.

    Attributes:
        base_url: ``"http://127.0.0.1:PORT"``.
        kv_events_endpoint, replay_endpoint: where a
            :class:`~minirad.kv_events.KVEventSubscriber` connects (None without kv_events).
        model_name: the name requests use (the folder's name).
        log_path: the server's stdout and stderr.
        startup_s: seconds the last :meth:`start` took until ``/health`` answered (None before).

    The ports are picked once, so :meth:`restart` brings the server back where subscribers
    already listen. vLLM binds its event PUB socket only for an endpoint containing ``*``, so
    that socket listens on all interfaces (``tcp://*:PORT``); the replay socket is always bound,
    on 127.0.0.1. ``VLLM_SERVER_DEV_MODE=1`` is set for ``POST /reset_prefix_cache``.

    Raises:
        PeerError: the vLLM venv is missing (the message says how to build it).
        InvalidArgumentError: no such model folder, or bad ``cpus``.
    """

    name = "vLLM"
    # Its log's milestones (0.32.0), for start(progress=...): three processes (the API
    # server, the engine core, the worker) each import vLLM before they do anything.
    stages = (
        (r"non-default args", "reading the model's config"),
        (r"Resolved architecture", "starting the engine-core process (importing vLLM again)"),
        (r"Initializing a V1 LLM engine", "starting the worker process"),
        (r"Starting to load model", "loading the model"),
        (r"KV cache size", "allocating the KV cache and warming up"),
        (r"Starting vLLM server on", "listening"),
    )

    def __init__(
        self,
        model_dir: str | os.PathLike = DEFAULT_MODEL_DIR,
        port: int | None = None,
        kv_events: bool = True,
        num_gpu_blocks: int | None = None,
        max_num_seqs: int = 8,
        extra_args: Sequence[str] = (),
        python: str | os.PathLike | None = None,
        cpus: Sequence[int] | None = None,
    ) -> None:
        self.model_dir = Path(model_dir).resolve()
        if not (self.model_dir / "config.json").is_file():
            raise InvalidArgumentError(f"no model folder (config.json) at {self.model_dir}")
        self.python = Path(python) if python is not None else vllm_python()
        self.model_name = self.model_dir.name
        super().__init__(port, cpus)
        self.kv_events_endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self._kv_events_config: dict | None = None
        if kv_events:
            pub_port, replay_port = free_port(), free_port()
            self.kv_events_endpoint = f"tcp://127.0.0.1:{pub_port}"
            self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
            self._kv_events_config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{pub_port}",
                "replay_endpoint": self.replay_endpoint,
                "topic": "",
            }
        self.num_gpu_blocks = num_gpu_blocks
        self.max_num_seqs = max_num_seqs
        self.extra_args = tuple(extra_args)

    # ------------------------------------------------------------------ lifecycle
    def command(self) -> list[str]:
        """The server's command line."""
        cmd = [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--block-size",
            str(VLLM_BLOCK_SIZE),  # CPU attention: a multiple of 32
            "--dtype",
            "float32",  # our engine's dtype: the same greedy tokens
            "--max-model-len",
            "512",
            "--enforce-eager",  # no graph capture: starts ~10 s sooner
            "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
            "--max-num-seqs",
            str(self.max_num_seqs),
        ]
        if self.num_gpu_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if self._kv_events_config is not None:
            cmd += ["--kv-events-config", json.dumps(self._kv_events_config)]
        return cmd + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = super().env()
        env.update(
            VLLM_CPU_KVCACHE_SPACE="1",  # GiB; by default it wants most of a NUMA node's memory
            VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache
            VLLM_NO_USAGE_STATS="1",  # no network at run time
        )
        if self.cpus is not None:
            # taskset pins the process tree; this binds vLLM's OpenMP threads to the same
            # cores (by default vLLM also keeps one core of its set for itself).
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, self.cpus))
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        return env

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"VLLMServer({self.base_url}, events={self.kv_events_endpoint}, {state})"

    def chat(
        self,
        question: str,
        image: Any = None,
        max_tokens: int = 16,
        system: str | None = None,
        cache_salt: str | None = None,
    ) -> dict:
        """One greedy chat completion (``POST /v1/chat/completions``), the image first, then the
        question, as the model's chat template lays them out.

        Args:
            image: a PIL image or an image file path, sent as a PNG data URL; None: text only.
            cache_salt: vLLM's ``cache_salt``: the request's blocks hash apart from unsalted
                ones (the salt is the first block's last extra key).

        Returns:
            ``{"text", "token_ids" (output, the stop token included), "prompt_token_ids",
            "cached_tokens" (prompt tokens served from the prefix cache),
            "finish_reason"}``.

        Raises:
            PeerError: the server failed or answered something unexpected.
            InvalidArgumentError: an unreadable image.
        """
        content: list[dict] = []
        if image is not None:
            content.append({"type": "image_url", "image_url": {"url": _image_data_url(image)}})
        content.append({"type": "text", "text": question})
        messages = [{"role": "user", "content": content}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        reply = self.post(
            "/v1/chat/completions",
            {
                "model": self.model_name,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "return_token_ids": True,  # vLLM's extension: choices[0].token_ids, prompt ids
            }
            | ({"cache_salt": cache_salt} if cache_salt is not None else {}),
        )
        try:
            choice = reply["choices"][0]
            details = reply["usage"].get("prompt_tokens_details") or {}
            return {
                "text": choice["message"]["content"],
                "token_ids": list(choice["token_ids"]),
                "prompt_token_ids": list(reply["prompt_token_ids"]),
                "cached_tokens": int(details.get("cached_tokens") or 0),
                "finish_reason": choice.get("finish_reason"),
            }
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise PeerError(f"unexpected chat reply from vLLM: {str(reply)[:500]}") from e

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (``POST /reset_prefix_cache``). vLLM publishes events after
        an engine step, so ``AllBlocksCleared`` reaches subscribers with the next request's
        batch. Returns False if vLLM refused because running requests hold blocks (retry when
        they finish).

        Raises:
            PeerError: the server failed (a 404 means it runs without ``VLLM_SERVER_DEV_MODE``).
        """
        reply = self.post("/reset_prefix_cache")
        return bool(reply.get("success")) if isinstance(reply, dict) else True
