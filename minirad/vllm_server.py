"""The real vLLM OpenAI server on our model, as a context manager: start, ask, reset, restart, stop.

vLLM cannot be imported in the course venv (:mod:`minirad.vllm_env`), so the server runs as
``python -m vllm.entrypoints.openai.api_server`` from the vLLM venv, on 127.0.0.1 and free
ports, with the settings vLLM's CPU backend needs here (32-token blocks, float32, eager mode, a
1 GiB KV cache) and its KV events on ZMQ. The client side uses only the standard library.

Example::

    with VLLMServer() as server:  # 30-70 s on 2 cores
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
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import InvalidArgumentError, PeerError
from .vllm_env import REPO_ROOT, VLLM_BLOCK_SIZE, die_with_parent, vllm_python

__all__ = ["DEFAULT_MODEL_DIR", "VLLMServer"]

# Not imported from minirad.models, which imports torch and transformers: this module must not.
DEFAULT_MODEL_DIR = REPO_ROOT / "data" / "models" / "minirad-tiny-llava"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user took the id: ours are gone
        return False
    return True


def _stop_group(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM to the process group that ``proc`` leads, SIGKILL to what is left after
    ``timeout_s``; reaps ``proc`` (its children are reparented and reaped by init)."""
    if _group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    # vLLM's engine-core and worker processes may outlive the API server by a moment.
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


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


class VLLMServer:
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
        python: the vLLM venv's Python (default :func:`~minirad.vllm_env.vllm_python`).

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
        InvalidArgumentError: no such model folder.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike = DEFAULT_MODEL_DIR,
        port: int | None = None,
        kv_events: bool = True,
        num_gpu_blocks: int | None = None,
        max_num_seqs: int = 8,
        extra_args: Sequence[str] = (),
        python: str | os.PathLike | None = None,
    ) -> None:
        self.model_dir = Path(model_dir).resolve()
        if not (self.model_dir / "config.json").is_file():
            raise InvalidArgumentError(f"no model folder (config.json) at {self.model_dir}")
        self.python = Path(python) if python is not None else vllm_python()
        self.model_name = self.model_dir.name
        self.port = port if port is not None else _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.kv_events_endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self._kv_events_config: dict | None = None
        if kv_events:
            pub_port, replay_port = _free_port(), _free_port()
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
        self._logdir = Path(tempfile.mkdtemp(prefix="minirad-vllm-"))
        self.log_path = self._logdir / "server.log"
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None
        self.startup_s: float | None = None

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

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE="1",  # GiB; by default it wants most of a NUMA node's memory
            VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache
            VLLM_NO_USAGE_STATS="1",  # no network at run time
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        env.pop("VIRTUAL_ENV", None)
        return env

    @property
    def running(self) -> bool:
        """The server process is alive (it may still be loading)."""
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 300.0) -> VLLMServer:
        """Start the server and wait until ``GET /health`` answers; ``startup_s`` says how long
        it took. Returns the server.

        Raises:
            PeerError: the server exited, or did not answer within ``timeout_s`` (it is then
                stopped); the message ends with the tail of its log.
        """
        if self.running:
            raise PeerError(f"the vLLM server at {self.base_url} is already running")
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            # Its own process group, so stop() reaches the engine-core process it spawns.
            self._proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env(),
                cwd=self._logdir,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        # A server left running (no stop(), a notebook closed) still goes when Python exits.
        self._finalizer = weakref.finalize(self, _stop_group, self._proc, 5.0)
        while True:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self.stop()  # its children, if any
                raise PeerError(f"vLLM exited with code {code} while starting{self._log_tail()}")
            if self._healthy():
                self.startup_s = time.monotonic() - t0
                return self
            if time.monotonic() - t0 > timeout_s:
                self.stop()
                raise PeerError(
                    f"vLLM did not answer {self.base_url}/health within {timeout_s:g} s"
                    f"{self._log_tail()}"
                )
            time.sleep(0.5)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``timeout_s``; reaps it.
        Does nothing if it is not running."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self._finalizer.detach()
        _stop_group(proc, timeout_s)

    def restart(self, timeout_s: float = 300.0) -> VLLMServer:
        """Stop, then start again on the same ports (its event seq starts at 0 again, its cache
        empty). Returns the server."""
        self.stop()
        return self.start(timeout_s)

    def __enter__(self) -> VLLMServer:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"VLLMServer({self.base_url}, events={self.kv_events_endpoint}, {state})"

    def _log_tail(self, chars: int = 3000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return f"; log {self.log_path}, last lines:\n{text[-chars:]}"

    # ------------------------------------------------------------------ HTTP
    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _post(self, path: str, body: dict | None = None, timeout_s: float = 120.0) -> Any:
        data = json.dumps(body if body is not None else {}).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            raise PeerError(f"vLLM answered {path} with HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, OSError) as e:
            raise PeerError(f"no answer from vLLM at {self.base_url}{path}: {e}") from e
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError as e:
            raise PeerError(f"vLLM answered {path} with something not JSON: {text[:200]!r}") from e

    def chat(
        self,
        question: str,
        image: Any = None,
        max_tokens: int = 16,
        system: str | None = None,
    ) -> dict:
        """One greedy chat completion (``POST /v1/chat/completions``), the image first, then the
        question, as the model's chat template lays them out.

        Args:
            image: a PIL image or an image file path, sent as a PNG data URL; None: text only.

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
        reply = self._post(
            "/v1/chat/completions",
            {
                "model": self.model_name,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "return_token_ids": True,  # vLLM's extension: choices[0].token_ids, prompt ids
            },
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
        reply = self._post("/reset_prefix_cache")
        return bool(reply.get("success")) if isinstance(reply, dict) else True
