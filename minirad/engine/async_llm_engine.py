"""An :class:`~minirad.engine.LLMEngine` on its own thread, for asyncio callers (``minirad serve``).

Only the engine thread touches the engine, and nothing a client sends is read, decoded or
compiled there: inputs are processed on worker threads, so one request's big picture or grammar
holds up nobody's step. No request ends the thread: a failure in a step ends the requests it
belongs to, and the engine goes on. ``docs/architecture.md`` draws the threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from minirad.engine import EngineCoreRequest, EngineStats, GenerateRequest, LLMEngine, RequestOutput
from minirad.errors import RequestError

__all__ = [
    "INPUT_QUEUE_TIMEOUT_S",
    "INPUT_TIMEOUT_S",
    "AsyncLLMEngine",
    "EngineDeadError",
    "EngineSnapshot",
    "RequestFailedError",
    "RequestStream",
    "ServerBusyError",
]

log = logging.getLogger(__name__)


# Longest a request's inputs may take to process (pictures read and preprocessed, grammar
# compiled), on the input threads: past it the request gets a 400 and the server goes on.
INPUT_TIMEOUT_S = 10.0
# Longest a request may wait for an input thread, behind others' inputs: past it, a 503.
INPUT_QUEUE_TIMEOUT_S = 60.0


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (or the server is shutting down); the server answers
    503."""


class ServerBusyError(EngineDeadError):
    """The input threads stayed busy with other requests for ``INPUT_QUEUE_TIMEOUT_S``: a
    503 as well, and the client may try again (the engine goes on)."""


class RequestFailedError(RuntimeError):
    """A request the engine ended with finish reason ``"error"`` (its ``error`` is the
    cause): the engine goes on, the request's client gets the error."""

    def __init__(self, error: BaseException | None) -> None:
        super().__init__(repr(error))
        self.error = error


@dataclass(frozen=True)
class EngineSnapshot:
    """What ``/metrics`` reports, taken by the engine thread after each step.

    ``prompt_tokens``: prompt tokens of the requests that got their first output token
    (vLLM's ``vllm:prompt_tokens``, cached ones included); ``generation_tokens``: tokens
    handed out; ``finished``: finished requests by finish reason.
    """

    stats: EngineStats
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prompt_tokens: int
    generation_tokens: int
    finished: Mapping[str, int]


class _Channel:
    """One request's outputs, from the engine thread to the handler's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass


def _settle(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


class RequestStream:
    """The outputs of one API request's engine requests (one per choice: ``n``), as an async
    iterator of ``(index, output)`` in the order the engine produced them; it ends when each
    request has had its last output (``finished`` set).

    :meth:`abort` stops the unfinished ones in the engine (their KV stays cached, unlocked);
    it does nothing once every last output arrived, so a handler calls it however it ends.
    """

    def __init__(self, engine: AsyncLLMEngine, rids: Sequence[str], channel: _Channel) -> None:
        self.engine, self._channel = engine, channel
        self._index = {rid: i for i, rid in enumerate(rids)}
        self._unfinished = set(rids)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._channel.queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.rid)
        return self._index[item.rid], item

    def abort(self) -> None:
        for rid in self._unfinished:
            self.engine.abort(rid)
        self._unfinished.clear()


class AsyncLLMEngine:
    """An :class:`~minirad.engine.LLMEngine` run by its own thread, for asyncio callers
    (vLLM v0's ``AsyncLLMEngine``: a background loop over the engine's ``step``).

    :meth:`start` starts the thread; :meth:`add_request` (from an event loop) processes the
    requests' inputs on a worker thread (:meth:`LLMEngine.process_inputs`: tokens, pictures,
    grammar; never on the engine thread, whose steps every client waits on) and returns a
    :class:`RequestStream`; :meth:`shutdown` stops the thread after its current step and
    closes the engine's KV-event sockets. :attr:`snapshot` is an :class:`EngineSnapshot`.

    No request can stop the thread: what fails inside a step ends the requests it belongs to
    (:meth:`LLMEngine.step`), and should the step itself raise, every request in flight ends
    with the error and the thread goes on once the engine's invariants hold
    (:meth:`_recover`).

    Args:
        engine: the engine; only the engine thread touches it from :meth:`start` on.
        input_timeout_s: longest an input may take to process (a 400 after that).
        input_queue_timeout_s: longest an input may wait for an input thread (a 503 after).
    """

    input_workers = 2  # threads processing inputs: the machine's cores, for our 2

    def __init__(
        self,
        engine: LLMEngine,
        input_timeout_s: float = INPUT_TIMEOUT_S,
        input_queue_timeout_s: float = INPUT_QUEUE_TIMEOUT_S,
    ) -> None:
        self.engine = engine
        self.input_timeout_s = input_timeout_s
        self.input_queue_timeout_s = input_queue_timeout_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # commands; None: stop
        self._thread = threading.Thread(target=self._run, name="minirad-engine", daemon=True)
        self.inputs: Executor = ThreadPoolExecutor(self.input_workers, "minirad-inputs")
        self._channels: dict[str, _Channel] = {}  # the engine thread's only
        self._processing: set[asyncio.Future] = set()  # run_off_thread's, for fail_in_flight
        self._closing: str | None = None  # fail_in_flight's message
        self._prompt_tokens = self._generation_tokens = 0
        self._finished: Counter[str] = Counter()
        self.error: BaseException | None = None
        self.snapshot = self._snapshot()

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._inbox.put(None)
            self._thread.join()
        self.inputs.shutdown(wait=False, cancel_futures=True)

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self.error is None

    async def run_off_thread(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        """``fn(*args)`` on an input thread, within :attr:`input_timeout_s` from when a thread
        takes it: a request queued behind others' pictures is not charged their time (a text
        prompt got "took longer than 10 s; send less" behind thirty big pictures).

        Raises:
            ServerBusyError: no input thread took it within :attr:`input_queue_timeout_s`
                (a 503: try again).
            RequestError: it took longer (``what`` names it in the message; the thread
                finishes it and the result is dropped).
            EngineDeadError: :meth:`fail_in_flight` was called meanwhile (the same).
            Exception: what ``fn`` raised.
        """
        loop = asyncio.get_running_loop()
        started = loop.create_future()

        def run() -> Any:
            with contextlib.suppress(RuntimeError):  # a loop closed since: nobody waits
                loop.call_soon_threadsafe(lambda: started.done() or started.set_result(None))
            return fn(*args)

        future = loop.run_in_executor(self.inputs, run)
        failed = loop.create_future()  # fail_in_flight sets it to its message
        self._processing.add(failed)
        try:
            first = asyncio.FIRST_COMPLETED
            done, _ = await asyncio.wait(
                (started, future, failed), timeout=self.input_queue_timeout_s, return_when=first
            )
            taken = started.done()
            if done == {started}:  # running now: its own time starts
                done, _ = await asyncio.wait(
                    (future, failed), timeout=self.input_timeout_s, return_when=first
                )
        except asyncio.CancelledError:  # the client left
            future.cancel()
            raise
        finally:
            self._processing.discard(failed)
            started.cancel()
        if future in done:
            return future.result()
        future.cancel()  # still queued: it never runs; running: it finishes, the result dropped
        if failed in done:
            raise EngineDeadError(failed.result())
        if not taken:
            raise ServerBusyError(
                f"the server is busy: no input thread was free for "
                f"{self.input_queue_timeout_s:g} s; try again"
            )
        raise RequestError(f"{what} took longer than {self.input_timeout_s:g} s; send less")

    async def add_request(self, requests: Sequence[GenerateRequest]) -> RequestStream:
        """Process ``requests`` (their ``rid`` set: one API request's choices) off the engine
        thread, then queue them in the engine, in one go between two steps; returns their
        outputs.

        Raises:
            MiniradError: what :meth:`LLMEngine.process_inputs` or
                :meth:`LLMEngine.add_request` raised for one of them (then none is queued);
                a RequestError if processing took longer than :attr:`input_timeout_s`.
            EngineDeadError: the engine thread has stopped.
        """
        if self.error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")

        def process() -> list[EngineCoreRequest]:
            return [self.engine.process_inputs(r) for r in requests]

        processed = await self.run_off_thread(process, what="processing the prompt and images")
        channel = _Channel(asyncio.get_running_loop())
        self._inbox.put(("add", processed, channel))
        try:
            ack = await channel.queue.get()
        except asyncio.CancelledError:  # the client left before the engine took them
            for request in requests:
                self.abort(request.rid)
            raise
        if isinstance(ack, BaseException):
            raise ack
        return RequestStream(self, [r.rid for r in requests], channel)

    def abort(self, rid: str) -> None:
        """Abort request ``rid`` (thread-safe; nothing happens if it has finished)."""
        self._inbox.put(("abort", rid))

    def fail_in_flight(self, message: str) -> None:
        """End every request in flight now with an :class:`EngineDeadError` of ``message``
        (thread-safe): their clients get a 503 (a stream, an error event) instead of waiting,
        those whose inputs are still being processed too, and so does every request after
        it. A server shutting down calls it when its grace period is over."""
        self._closing = message
        self._inbox.put(("fail", message))
        for failed in list(self._processing):
            failed.get_loop().call_soon_threadsafe(_settle, failed, message)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """``fn(engine)`` run on the engine thread between two steps (only that thread
        touches the engine); returns what it returned.

        Raises:
            Exception: what ``fn`` raised.
            EngineDeadError: the engine thread has stopped.
        """
        if self.error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        channel = _Channel(asyncio.get_running_loop())
        self._inbox.put(("call", fn, channel))
        reply = await channel.queue.get()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache between two steps (vLLM's ``POST /reset_prefix_cache``).
        Returns False, and changes nothing, while requests are in flight.

        Raises:
            EngineDeadError: the engine thread has stopped.
        """

        def reset(engine: LLMEngine) -> bool:
            idle = not engine.has_unfinished_requests()
            if idle:
                engine.reset_prefix_cache()
            return idle

        return await self.call(reset)

    # -------------------------------------------------------------- on the engine thread
    def _run(self) -> None:
        engine = self.engine
        replies: list[tuple[_Channel, object]] = []  # this round's answers, sent after it
        try:
            while True:
                # Block while idle; with requests in flight take only what has arrived.
                commands = [] if engine.has_unfinished_requests() else [self._inbox.get()]
                while True:
                    try:
                        commands.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                replies = []
                for command in commands:
                    if command is None:
                        return
                    self._handle(command, replies)
                if engine.has_unfinished_requests():
                    try:
                        outs = engine.step()
                    except Exception as e:
                        outs = self._recover(e)
                    for out in outs:
                        self._count(out)
                        channel = self._channels.get(out.rid)
                        if out.finished:
                            self._channels.pop(out.rid, None)
                        if channel is not None:
                            replies.append((channel, out))
                self.snapshot = self._snapshot()
                for channel, item in replies:
                    channel.put(item)
        except Exception as e:  # the engine cannot go on: fail every request, stay answering
            log.exception("the engine thread failed")
            self.error = EngineDeadError(f"the engine has stopped: {e!r}")
            for channel, _ in replies:  # acks and refusals of this round never went out
                channel.put(self.error)
            self._fail_all()
        finally:
            for channel in self._channels.values():  # shut down with requests in flight
                channel.put(EngineDeadError("the server is shutting down"))
            engine.close()

    def _recover(self, error: Exception) -> list[RequestOutput]:
        """After a step raised: every request in flight ends with ``error`` (their new KV is
        dropped, not cached), then the engine's invariants are checked.

        Raises:
            Exception: ``error`` again, if the engine is not whole after that (the thread
                then stops, and the server answers 503).
        """
        log.exception("a step failed; every request in flight ends with its error")
        outs = self.engine.fail_unfinished(error)
        try:
            self.engine.check_invariants()
        except Exception:
            log.exception("the engine is not whole after the failed step")
            raise error from None
        return outs

    def _handle(self, command: tuple, replies: list) -> None:
        kind, *args = command
        if kind == "add":
            requests, channel = args
            if self._closing is not None:  # after fail_in_flight: none is queued
                replies.append((channel, EngineDeadError(self._closing)))
                return
            added = []
            try:
                for request in requests:
                    added.append(self.engine.add_request(request))
            except Exception as e:  # the handler answers with it, and nothing stays queued
                for rid in added:
                    self.engine.abort_request(rid)
                replies.append((channel, e))
                return
            for rid in added:
                self._channels[rid] = channel
            replies.append((channel, added))
        elif kind == "call":
            fn, channel = args
            try:
                replies.append((channel, fn(self.engine)))
            except Exception as e:  # the handler raises it
                replies.append((channel, e))
        elif kind == "fail":
            error = EngineDeadError(args[0])
            for rid, channel in list(self._channels.items()):
                out = self.engine.abort_request(rid)
                if out is not None:
                    self._finished[out.finish_reason] += 1
                replies.append((channel, error))
            self._channels.clear()
        elif self._channels.pop(args[0], None) is not None:  # "abort" of an unfinished request
            out = self.engine.abort_request(args[0])
            if out is not None:
                self._finished[out.finish_reason] += 1

    def _count(self, out: RequestOutput) -> None:
        if len(out.new_token_ids) == len(out.token_ids) and out.token_ids:  # its first output
            self._prompt_tokens += out.stats.prompt_tokens
        self._generation_tokens += len(out.new_token_ids)
        if out.finished:
            self._finished[out.finish_reason] += 1

    def _snapshot(self) -> EngineSnapshot:
        e = self.engine
        held = e.allocator.used_size() - e.tree_cache.evictable_size()
        return EngineSnapshot(
            stats=e.stats,
            num_running=len(e.scheduler.running),
            num_waiting=len(e.scheduler.waiting),
            kv_cache_usage=held / e.allocator.size,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            finished=dict(self._finished),
        )

    def _fail_all(self) -> None:
        """After a failure: every waiting handler gets the error, and so does every later
        command, until :meth:`shutdown` (no handler waits forever)."""
        for channel in self._channels.values():
            channel.put(self.error)
        self._channels.clear()
        while (command := self._inbox.get()) is not None:
            if command[0] in ("add", "call"):  # the ones whose handler awaits a reply
                command[-1].put(self.error)
