"""The subprocess lifecycle every local server shares (minirad.peers.server_process), on a real
``minirad serve`` worker: start from any thread, a taken port, bad cores, nothing left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from minirad.cluster.replicas import MiniradWorker
from minirad.errors import InvalidArgumentError, PeerError
from minirad.peers import server_process
from minirad.peers.server_process import ServerProcess, usable_cpus


@pytest.mark.parametrize("cpus", [[], [True], 0, "0", [max(usable_cpus()) + 1]])
def test_cpus_must_be_cores_this_process_may_use(cpus):
    with pytest.raises(InvalidArgumentError, match="cpus must be a list of cores"):
        MiniradWorker(cpus=cpus)


def test_a_worker_started_from_a_thread_outlives_the_thread():
    """The parent-death signal belongs to the thread that forked: a server started from a
    thread that then ends must not die with it."""
    worker = MiniradWorker(cpus=usable_cpus()[:1])
    thread = threading.Thread(target=worker.start, kwargs={"timeout_s": 120})
    thread.start()
    thread.join()
    try:
        assert worker.running and worker.healthy()
        log_dir = worker.log_path.parent
        threading.Event().wait(1.0)  # a signal from the thread's exit would have landed
        assert worker.running and worker.healthy()
    finally:
        worker.stop()
    assert not worker.running and not log_dir.exists()  # its log went with it


def test_a_taken_port_is_refused_not_mistaken_for_our_server():
    first = MiniradWorker().start(timeout_s=120)
    try:
        second = MiniradWorker(port=first.port)
        with pytest.raises(PeerError, match=f"port {first.port} is in use"):
            second.start(timeout_s=30)
        assert not second.running
    finally:
        first.stop()
    restarted = first.restart(timeout_s=120)  # its own port again, right after it closed
    restarted.stop()


def test_a_restart_waits_out_a_port_held_for_a_moment():
    """Between stop and start another process may hold the port briefly (an outgoing
    connection's local port): the restart tries again rather than failing at once."""
    worker = MiniradWorker().start(timeout_s=120)
    worker.stop()
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the TIME_WAIT it left
    holder.bind(("127.0.0.1", worker.port))
    holder.listen()
    threading.Timer(1.0, holder.close).start()
    try:
        assert worker.restart(timeout_s=120).healthy()
    finally:
        worker.stop()
        holder.close()


# A server that logs two milestones, falls silent, then answers /health: what
# start(progress=...) must say about it, from its log alone.
FAKE_SERVER = """
import http.server, sys, time
print("loading: alpha", flush=True)
time.sleep(0.5)
print("noise\\nbeta reached", flush=True)
time.sleep(2.0)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


class Milestones(ServerProcess):
    name = "fake"
    stages = ((r"alpha", "doing alpha"), (r"beta", "doing beta"), (r"gamma", "never"))

    def command(self) -> list[str]:
        return [sys.executable, "-c", FAKE_SERVER, str(self.port)]


def test_a_start_says_each_stage_its_log_reaches_and_that_it_is_still_at_it(monkeypatch):
    """A real engine starts for one to four minutes on 2 cores; a chapter's live cell printed
    nothing meanwhile. ``start(progress=...)`` says each stage as its log line arrives, then,
    after HEARTBEAT_S of silence, that the server is still at the last one."""
    monkeypatch.setattr(server_process, "HEARTBEAT_S", 0.8)
    said: list[str] = []
    server = Milestones().start(timeout_s=60, progress=said.append)
    server.stop()
    texts = [line.split(" s  ", 1)[1] for line in said]
    assert texts[0].startswith(f"starting at {server.base_url}")
    assert texts[1:3] == ["doing alpha", "doing beta"]
    assert "... still doing beta" in texts[3:-1]
    assert texts[-1] == "ready: /health answers"
    assert all(line.startswith("fake ") for line in said)
    assert "never" not in texts


def test_a_silent_start_says_nothing():
    server = Milestones().start(timeout_s=60)  # progress=None: as before
    server.stop()
    assert server.startup_s > 0


# A server that ignores SIGTERM: stopping it takes the finalizer's whole grace period.
STUBBORN = (
    """
import signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
"""
    + FAKE_SERVER
)


class Stubborn(Milestones):
    def command(self) -> list[str]:
        return [sys.executable, "-c", STUBBORN, str(self.port)]


def test_a_server_left_running_takes_its_log_with_it_even_if_python_is_killed_stopping_it():
    """A Jupyter kernel shut down with a live vLLM cell gets 5 s to exit, then is killed; the
    finalizer spent them waiting for vLLM to stop, and /tmp/minirad-server-* stayed. The log
    goes first now."""
    script = (
        "import sys, time; sys.path.insert(0, sys.argv[1])\n"
        "from test_server_process import Stubborn\n"
        "server = Stubborn().start(timeout_s=60)\n"
        "print(server.log_path.parent, flush=True)\n"
        "print(server._proc.pid, flush=True)\n"
    )  # then it exits with the server running: the finalizer stops it
    here = str(Path(__file__).parent)
    python = subprocess.Popen(
        [sys.executable, "-c", script, here], stdout=subprocess.PIPE, text=True
    )
    logdir = Path(python.stdout.readline().strip())
    pid = int(python.stdout.readline())
    try:
        time.sleep(1.5)  # inside the finalizer's 5 s wait for the server
        assert python.poll() is None, "the finalizer did not wait"
        python.kill()
        python.wait()
        assert not logdir.exists(), f"{logdir} was left behind"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
