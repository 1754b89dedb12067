"""An ASGI app served by uvicorn in a thread of the test process, on a free 127.0.0.1 port:
the server tests talk to it over real HTTP while holding the engine it wraps. And what a real
engine's start must have said (:func:`check_start_lines`)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

PATIENCE_S = 60.0


@contextmanager
def serving(app, log_level: str = "warning") -> Iterator[str]:
    """Serve ``app`` until the block ends; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + PATIENCE_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join()
        sock.close()


def check_start_lines(server) -> None:
    """Every stage of the server's start was said, in order, then that it was ready: the log
    lines :attr:`stages` looks for are the ones this version prints."""
    texts = [line.split(" s  ", 1)[1] for line in server.start_lines]
    stages = [t for t in texts if not t.startswith(("starting at", "... still"))]
    assert stages == [doing for _, doing in server.stages] + ["ready: /health answers"], texts
