"""Request bodies read whole before the app sees them, within limits checked in microseconds.

A body is refused before any parsing when it is too big (413) or holds too many JSON values
(400): parsing and checking millions of numbers would hold the event loop, and with it every
client and ``/health``. A body still arriving when the server's grace period ends gets a 503,
so a client that never finishes sending holds up nobody's shutdown.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from minirad.entrypoints.openai.protocol import MAX_JSON_VALUES, error_response

__all__ = ["MAX_BODY_BYTES", "BodyIntake", "Shutdown"]

# The largest request body read (413 past it): a data URL of MAX_IMAGE_BYTES, base64'd, fits.
MAX_BODY_BYTES = 64 * 2**20


class Shutdown:
    """Set when a server's grace period is over (``run_server`` calls :meth:`close`):
    :class:`BodyIntake` then answers every body still arriving with a 503."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None  # made on the server's event loop

    @property
    def event(self) -> asyncio.Event:
        if self._event is None:
            self._event = asyncio.Event()
        return self._event

    def close(self) -> None:
        self.event.set()


class BodyIntake:
    """ASGI middleware: reads a request's whole body before the app sees it, within limits
    checked on the event loop in microseconds: at most :data:`MAX_BODY_BYTES` (413, whether
    declared by Content-Length or not), at most :data:`MAX_JSON_VALUES` commas (400). A body
    still arriving when the grace period ends (``shutdown``) gets a 503, so a client that
    never finishes sending holds up nobody's shutdown."""

    def __init__(self, app: Callable, shutdown: Shutdown) -> None:
        self.app = app
        self.shutdown = shutdown

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return await self._refuse(413, scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await self._receive(receive)
            if message is None:  # the grace period is over
                response = error_response(
                    503, "the server is shutting down", "ServiceUnavailableError"
                )
                response.headers["connection"] = "close"
                return await response(scope, receive, send)
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > MAX_BODY_BYTES:
                return await self._refuse(413, scope, receive, send)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if body.count(b",") >= MAX_JSON_VALUES:
            return await self._refuse(400, scope, receive, send)
        delivered = False

        async def replay() -> dict:
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _receive(self, receive: Callable) -> dict | None:
        """The next message of the body, or None once the server is shutting down."""
        message = asyncio.ensure_future(receive())
        closing = asyncio.ensure_future(self.shutdown.event.wait())
        await asyncio.wait({message, closing}, return_when=asyncio.FIRST_COMPLETED)
        closing.cancel()
        if message.done():
            return message.result()
        message.cancel()
        return None

    @staticmethod
    async def _refuse(status: int, scope: dict, receive: Callable, send: Callable) -> None:
        message = (
            f"the request body is over {MAX_BODY_BYTES // 2**20} MiB"
            if status == 413
            else f"the request body holds {MAX_JSON_VALUES} or more JSON values (commas)"
        )
        response = error_response(status, message, "BadRequestError")
        response.headers["connection"] = "close"  # the rest of the body is not read
        await response(scope, receive, send)
