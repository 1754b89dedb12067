"""The server's input threads (``AsyncLLMEngine.run_off_thread``): pictures are read and
prompts processed there, off the engine thread, each within ``input_timeout_s`` of its own.

Thirty requests with big pictures once kept both threads busy for over 10 s, and a text
prompt queued behind them got "processing the prompt and images took longer than 10 s; send
less": the clock ran while it waited. The clock starts when a thread takes the work now; a
wait for a thread has its own limit, past which the answer is a 503 to try again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from minirad.engine import LLMEngine
from minirad.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError, ServerBusyError
from minirad.errors import RequestError
from minirad.models import DEFAULT_MODEL_DIR

LIMIT_S = 0.5  # input_timeout_s here


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_pretrained(DEFAULT_MODEL_DIR)


def run(coroutine):
    """``asyncio.run(coroutine)`` in a thread of its own: a test of the same worker may have
    left an event loop running in this one (playwright's)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def busy_threads(inputs, release: threading.Event) -> list:
    """Both input threads taken by work that ends when ``release`` is set."""
    return [inputs.submit(release.wait, 30) for _ in range(AsyncLLMEngine.input_workers)]


def test_a_queued_input_has_its_own_time_not_the_others(engine):
    runner = AsyncLLMEngine(engine, input_timeout_s=LIMIT_S)
    release = threading.Event()
    busy_threads(runner.inputs, release)
    threading.Timer(3 * LIMIT_S, release.set).start()  # the others take longer than the limit

    async def quick() -> str:
        return await runner.run_off_thread(lambda: "done", what="processing the prompt")

    start = time.monotonic()
    assert run(quick()) == "done"
    assert time.monotonic() - start >= 3 * LIMIT_S  # it did wait behind them
    runner.shutdown()


def test_an_input_past_its_own_time_is_a_400_and_a_wait_past_the_queues_a_503(engine):
    runner = AsyncLLMEngine(engine, input_timeout_s=LIMIT_S, input_queue_timeout_s=LIMIT_S)

    async def slow() -> None:
        await runner.run_off_thread(time.sleep, 3 * LIMIT_S, what="reading the images")

    with pytest.raises(RequestError, match="reading the images took longer than 0.5 s"):
        run(slow())
    release = threading.Event()
    held = busy_threads(runner.inputs, release)
    with pytest.raises(ServerBusyError, match="no input thread was free for 0.5 s; try again"):
        run(slow())
    assert isinstance(ServerBusyError("x"), EngineDeadError)  # the server's 503
    release.set()
    for f in held:
        f.result(timeout=30)
    runner.shutdown()
