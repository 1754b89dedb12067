"""A local HTTP server in a subprocess: start it, wait for ``/health``, ask it, stop it all.

The real vLLM, ``minirad serve`` workers and the real routers (sglang-router, vllm-router) are
other programs, often in other venvs. Tests, benchmarks and chapters start them on 127.0.0.1,
talk to them over HTTP, and must leave nothing running: each server is started in its own
process group (vLLM spawns an engine-core process; a router may spawn helpers), stopped with
SIGTERM to the whole group and SIGKILL after a grace period, and tied to the Python that
started it (:func:`~minirad.peers.vllm_env.die_with_parent`, a finalizer).

A real engine takes a minute or more to start on a loaded 2-core machine:
``start(progress=print)`` says each stage as the server's log reaches it (:attr:`stages`:
importing, loading the weights, allocating the KV cache, listening), with the seconds since
the start, and that it is still at it after every :data:`HEARTBEAT_S` seconds of silence, so a
notebook cell never sits mute.

``cpus`` pins a server's whole process tree to some cores (``taskset -c``), the way replicas
share a machine in chapter 10: on 2 cores, one worker per core.

The kernel's parent-death signal belongs to the *thread* that started the child: a server
started from a worker thread would be killed when that thread ends. So only servers started
from the main thread get it; the others rely on the finalizer (run at interpreter exit).

Only the standard library is used: the module loads without torch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from minirad.errors import InvalidArgumentError, PeerError
from minirad.peers.vllm_env import die_with_parent

__all__ = ["ServerProcess", "StartProgress", "free_port", "usable_cpus"]

RESTART_TRIES = 3  # restart(): starts refused for a port in use, before the error stands
HEARTBEAT_S = 20.0  # start(progress=...): a line after this long with no new stage


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colour codes in the routers' logs


def usable_cpus() -> list[int]:
    """The cores this process may run on (its affinity mask, which a container may narrow)."""
    return sorted(os.sched_getaffinity(0))


def _port_in_use(port: int) -> bool:
    """Something listens on 127.0.0.1:``port`` (a closed server's TIME_WAIT sockets do not
    count: the servers bind with SO_REUSEADDR, and so does this probe)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


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


def _stop_and_clean(proc: subprocess.Popen, logdir: Path) -> None:
    """The finalizer: a server nobody stopped goes, and so does its log. The log goes first
    (a server may write to its unlinked file until it ends): a Jupyter kernel shut down gets 5
    s to exit before it is killed, and vLLM may take them all to stop."""
    shutil.rmtree(logdir, ignore_errors=True)
    _stop_group(proc, 5.0)


class StartProgress:
    """Says how a server's start goes, from its log: each stage of ``stages`` (``(pattern,
    doing)``: a regular expression, and what the server does from the log line that matches
    it on) when a new log line first matches it, and, after :data:`HEARTBEAT_S` seconds with
    no new stage, that it is still at it.

    Args:
        say: where the lines go (``print`` in a notebook).
        name: the server's name, at the start of each line.
        stages: the patterns, tried on every new line of the log.
    """

    def __init__(self, say: Callable[[str], None], name: str, stages) -> None:
        self.say, self.name = say, name
        self.stages = [(re.compile(p), doing) for p, doing in stages]
        self.doing = "starting"
        self.offset = 0  # bytes of the log read so far
        self.last_said = time.monotonic()

    def line(self, elapsed: float, text: str) -> None:
        self.say(f"{self.name} {elapsed:4.0f} s  {text}")
        self.last_said = time.monotonic()

    def poll(self, log_path: Path, elapsed: float) -> None:
        """Read the lines the log gained since the last call and say what they reached."""
        try:
            with open(log_path, "rb") as log:
                log.seek(self.offset)
                new = log.read()
        except OSError:
            return
        complete = new[: new.rfind(b"\n") + 1]  # a line still being written waits
        self.offset += len(complete)
        for text in complete.decode(errors="replace").splitlines():
            for i, (pattern, doing) in enumerate(self.stages):
                if pattern.search(text):
                    del self.stages[: i + 1]  # stages come in order: none goes back
                    self.doing = doing
                    self.line(elapsed, doing)
                    break
        if time.monotonic() - self.last_said >= HEARTBEAT_S:
            self.line(elapsed, f"... still {self.doing}")


class ServerProcess:
    """One HTTP server on 127.0.0.1, run as a subprocess. Subclasses give :meth:`command`
    (and may extend :meth:`env`); :attr:`name` names it in messages; :attr:`stages` are the
    log lines that mark its start's stages (:class:`StartProgress`).

    Args:
        port: the HTTP port (default: a free one, picked once, so :meth:`restart` comes back
            where clients already point).
        cpus: pin the server's process tree to these cores (``taskset -c``), a subset of
            :func:`usable_cpus`; None: no pinning.

    Attributes:
        base_url: ``"http://127.0.0.1:PORT"``.
        log_path: the server's stdout and stderr; :meth:`stop` removes it, unless the server
            failed to start (the error names it).
        startup_s: seconds the last :meth:`start` took until ``GET /health`` answered 200
            (None before).

    Raises:
        InvalidArgumentError: ``cpus`` is not a non-empty list of cores this process may use,
            or ``taskset`` is missing.
    """

    name = "server"
    stages: tuple[tuple[str, str], ...] = ()
    start_timeout_s = 300.0  # the default of start(), and what a ``with`` block waits

    def __init__(self, port: int | None = None, cpus: Sequence[int] | None = None) -> None:
        if cpus is not None:
            usable = usable_cpus()
            bad = not isinstance(cpus, Sequence) or isinstance(cpus, str) or not cpus
            if bad or any(type(c) is not int or c not in usable for c in cpus):
                raise InvalidArgumentError(
                    f"cpus must be a list of cores this process may use {usable}, got {cpus!r}"
                )
            if shutil.which("taskset") is None:
                raise InvalidArgumentError("pinning to cores needs `taskset` (util-linux)")
            cpus = tuple(cpus)
        self.cpus = cpus
        self.port = port if port is not None else free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._logdir: Path | None = None  # made by start()
        self.log_path: Path | None = None
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None
        self.startup_s: float | None = None

    def command(self) -> list[str]:
        """The server's command line (without the ``taskset`` prefix)."""
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        """The server's environment: ours, offline, outside our venv."""
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DO_NOT_TRACK="1")
        env.pop("VIRTUAL_ENV", None)
        return env

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        """The server process is alive (it may still be loading)."""
        return self._proc is not None and self._proc.poll() is None

    def start(
        self, timeout_s: float | None = None, progress: Callable[[str], None] | None = None
    ) -> ServerProcess:
        """Start the server and wait until it is ready (:meth:`healthy`). Returns the server.

        Args:
            timeout_s: how long to wait (default :attr:`start_timeout_s`).
            progress: called with a line per stage of the start (:class:`StartProgress`),
                and when it is ready; None: silent.

        Raises:
            PeerError: it is already running, its port is taken, it exited, or it was not
                ready within ``timeout_s`` (it is then stopped); the message ends with its
                log's tail.
        """
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        if self.running:
            raise PeerError(f"{self.name} at {self.base_url} is already running")
        if _port_in_use(self.port):  # else another server's /health would answer for it
            raise PeerError(f"port {self.port} is in use: {self.name} cannot listen there")
        command = self.command()
        if self.cpus is not None:
            command = ["taskset", "-c", ",".join(map(str, self.cpus)), *command]
        if self._logdir is None:
            self._logdir = Path(tempfile.mkdtemp(prefix="minirad-server-"))
            self.log_path = self._logdir / "server.log"
        on_main_thread = threading.current_thread() is threading.main_thread()
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env(),
                cwd=self._logdir,
                start_new_session=True,  # its own group: stop() reaches what it spawns
                preexec_fn=die_with_parent if on_main_thread else None,
            )
        # A server left running (no stop(), a notebook closed) still goes when Python exits.
        self._finalizer = weakref.finalize(self, _stop_and_clean, self._proc, self._logdir)
        said = StartProgress(progress, self.name, self.stages) if progress else None
        if said:
            said.line(0, f"starting at {self.base_url}; its log: {self.log_path}")
        while True:
            if said:
                said.poll(self.log_path, time.monotonic() - t0)
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self.stop(keep_log=True)  # its children, if any
                raise PeerError(
                    f"{self.name} exited with code {code} while starting{self._log_tail()}"
                )
            if self.healthy():
                self.startup_s = time.monotonic() - t0
                if said:
                    said.line(self.startup_s, "ready: /health answers")
                return self
            if time.monotonic() - t0 > timeout_s:
                why = self.not_ready()
                self.stop(keep_log=True)
                raise PeerError(
                    f"{self.name} at {self.base_url} {why} after {timeout_s:g} s{self._log_tail()}"
                )
            time.sleep(0.2)

    def stop(self, timeout_s: float = 15.0, keep_log: bool = False) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``timeout_s``; reaps it, and
        removes its log unless ``keep_log``. Does nothing if it is not running."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self._finalizer.detach()
        _stop_group(proc, timeout_s)
        if not keep_log:
            shutil.rmtree(self._logdir, ignore_errors=True)
            self._logdir = self.log_path = None

    def restart(self, timeout_s: float | None = None) -> ServerProcess:
        """Stop, then start again on the same ports. Returns the server.

        Between the stop and the start another process may hold one of those ports for a
        moment (an outgoing connection gets its local port from the same range that free
        ports come from): a start refused for a port in use is tried again, twice, two
        seconds apart, before the error stands.
        """
        self.stop()
        for attempt in range(RESTART_TRIES):
            try:
                return self.start(timeout_s)
            except PeerError as e:
                if "in use" not in str(e) or attempt == RESTART_TRIES - 1:
                    raise
                time.sleep(2.0)
        raise AssertionError("unreachable")

    def __enter__(self):
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"{type(self).__name__}({self.base_url}, {state})"

    def _log_tail(self, chars: int = 3000) -> str:
        if self.log_path is None:
            return ""
        try:
            text = _ANSI.sub("", self.log_path.read_text(errors="replace"))
        except OSError:
            return ""
        return f"; log {self.log_path}, last lines:\n{text[-chars:]}"

    # ------------------------------------------------------------------ HTTP
    def not_ready(self) -> str:
        """Why :meth:`healthy` is False, for the start-up error."""
        return "did not answer /health"

    def healthy(self) -> bool:
        """``GET /health`` answers 200 now."""
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def get_text(self, path: str, timeout_s: float = 30.0) -> str:
        """The body of ``GET path``.

        Raises:
            PeerError: no answer, or an HTTP error status.
        """
        return self._request(urllib.request.Request(self.base_url + path), path, timeout_s)

    def post(self, path: str, body: dict | None = None, timeout_s: float = 120.0) -> Any:
        """``POST path`` with a JSON body; the decoded JSON answer (None for an empty one).

        Raises:
            PeerError: no answer, an HTTP error status (its body in the message), or an
                answer that is not JSON.
        """
        data = json.dumps(body if body is not None else {}).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, headers={"Content-Type": "application/json"}
        )
        text = self._request(request, path, timeout_s)
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError as e:
            raise PeerError(
                f"{self.name} answered {path} with something not JSON: {text[:200]!r}"
            ) from e

    def _request(self, request: urllib.request.Request, path: str, timeout_s: float) -> str:
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as r:
                return r.read().decode()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            raise PeerError(f"{self.name} answered {path} with HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, OSError) as e:
            raise PeerError(f"no answer from {self.name} at {self.base_url}{path}: {e}") from e
