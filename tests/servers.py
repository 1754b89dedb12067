"""An ASGI app served by uvicorn in a thread of the test process, on a free 127.0.0.1 port:
the server tests talk to it over real HTTP while holding the engine it wraps."""

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
