"""``minirad serve`` against what once took it down: hostile input, faults, shutdown, races.

A production engineer tried the server with load, faults, fuzzing and path escapes; each test
here sends what broke it then, the way it was found, and checks the server's rule: a request
it cannot serve gets a 400 with OpenAI's error body (never a 500, a hang or a dead engine), a
failure inside a step ends only the requests it belongs to, and the engine goes on answering
correctly. Answers are checked against a second engine on the same model, never against
written-down strings. One server (in a thread of this process) serves the module, over a media
folder made for it; the shutdown test starts ``minirad serve`` itself.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import httpx
import pytest
from PIL import Image, PngImagePlugin
from servers import serving

from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.entrypoints.chat_utils import chat_prompt
from minirad.entrypoints.openai.api_server import build_app
from minirad.entrypoints.openai.protocol import INTERNAL_ERROR
from minirad.models import DEFAULT_MODEL_DIR

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / "data" / "images"
SQUARE = IMAGES / "orange_square.png"
OTHER = IMAGES / "blue_square_left_of_red_circle.png"
NAME = "tiny"
QUESTION = "What colour is the square?"
# A bound on a hang, not a timing assertion: every answer here comes in milliseconds, and the
# rule under test is that none takes more than this.
HANG_S = 10.0
PATIENCE_S = 60.0


# ------------------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    """The server's media folder: a picture, and every kind of name that is no picture."""
    root = tmp_path_factory.mktemp("media")
    shutil.copy(SQUARE, root / "square.png")
    (root / "notes.png").write_text("not a picture")
    (root / "folder.png").mkdir()
    os.mkfifo(root / "fifo.png")
    (root / "loop.png").symlink_to(root / "loop.png")
    outside = tmp_path_factory.mktemp("outside") / "other.png"
    shutil.copy(OTHER, outside)
    (root / "escape.png").symlink_to(outside)
    return root


@pytest.fixture(scope="module")
def served(media):
    """``(url, engine)``: a server on a free port, in a thread, over ``media``."""
    if not DEFAULT_MODEL_DIR.is_dir():
        pytest.skip("the shipped model is not there")
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL_DIR)
    app = build_app(engine, NAME, allowed_local_media_path=media)
    with serving(app, log_level="critical") as base:
        yield base, engine


@pytest.fixture(scope="module")
def url(served) -> str:
    return served[0]


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    return LLMEngine.from_pretrained(DEFAULT_MODEL_DIR)


def expected(engine: LLMEngine, image: Path | None, question: str = QUESTION, n: int = 8) -> str:
    prompt = chat_prompt(engine.processor, question, 0 if image is None else 1)
    images = [] if image is None else [str(image)]
    params = SamplingParams(max_new_tokens=n)
    return engine.generate([GenerateRequest(prompt, images, params)])[0].text


def chat(image: str | None = None, question: str = QUESTION, **fields) -> dict:
    content = [{"type": "text", "text": question}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8}
    return body | {"temperature": 0} | fields


def post(url: str, path: str, body: dict | bytes, timeout: float = HANG_S) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"content-type": "application/json"}
        return httpx.post(url + path, content=body, headers=headers, timeout=timeout)
    return httpx.post(url + path, json=body, timeout=timeout)


def assert_refused(resp: httpx.Response, status: int = 400) -> str:
    """An OpenAI error body with ``status``; its message."""
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["message"]
    return error["message"]


def assert_serving(url: str, reference: LLMEngine) -> None:
    """Healthy, and still the engine's answers."""
    assert httpx.get(f"{url}/health", timeout=HANG_S).status_code == 200
    resp = post(url, "/v1/chat/completions", chat(SQUARE_URL))
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == expected(reference, SQUARE)


def wait_idle(url: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while True:
        text = httpx.get(f"{url}/metrics", timeout=HANG_S).text
        busy = [
            line
            for line in text.splitlines()
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
            and not line.endswith(" 0.0")
        ]
        if not busy:
            return
        assert time.monotonic() < deadline, busy
        time.sleep(0.02)


SQUARE_URL = "data:image/png;base64," + base64.b64encode(SQUARE.read_bytes()).decode()


def png(image: Image.Image, **save) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG", **save)
    return out.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


# -------------------------------------------------------------- 1. no request ends the engine
@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_value_float32_holds_as_zero_is_greedy_and_the_engine_lives(url, reference, field):
    """1e-46 is 0 in float32: it killed the engine thread for good (every later request 503)."""
    body = chat(SQUARE_URL, temperature=1.0, seed=1) | {field: 1e-46}
    resp = post(url, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == expected(reference, SQUARE)
    assert_serving(url, reference)


POISON = [7, 7, 7, 7, 7, 7, 7, 7, 9, 11]  # a completion prompt no other test sends


class Fault:
    """Makes ``engine.model_runner.execute_model`` raise on any batch holding a request whose
    prompt ends with :data:`POISON` (fault injection: the engine's own code runs as is)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.runner = engine.model_runner
        self.real = self.runner.execute_model
        self.raised = 0

    def __enter__(self) -> Fault:
        def execute_model(out, upcoming=()):
            if any(s.request.prompt_token_ids[-len(POISON) :] == POISON for s in out.scheduled):
                self.raised += 1
                raise RuntimeError("injected fault <secret internals>")
            return self.real(out, upcoming)

        self.runner.execute_model = execute_model
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.execute_model  # the class's method again


def test_a_forward_pass_that_raises_ends_its_request_only(served, reference):
    """A fault inside the step: the request it belongs to gets a 500 that shows no internals;
    the requests it shared the batch with, streamed or not, get their engine's answers; the
    engine keeps its invariants and goes on."""
    url, engine = served
    prompt = chat_prompt(reference.processor, "Describe the image.", 0)
    ids = reference.processor.tokenizer(prompt)["input_ids"]
    long = SamplingParams(max_new_tokens=200, stop_token_ids=())  # = ignore_eos
    want = reference.generate([GenerateRequest(ids, (), long)])
    results = {}
    with Fault(engine) as fault:

        def stream() -> None:
            body = {"prompt": ids, "max_tokens": 200, "temperature": 0, "stream": True}
            body["ignore_eos"] = True
            text = ""
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=HANG_S) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, chunk
                        text += chunk["choices"][0]["text"]
            results["stream"] = text

        innocent = threading.Thread(target=stream)
        innocent.start()
        poisoned = [post(url, "/v1/completions", {"prompt": ids + POISON}) for _ in range(3)]
        innocent.join(PATIENCE_S)
        assert fault.raised >= 3
    for resp in poisoned:
        assert assert_refused(resp, 500) == INTERNAL_ERROR
        assert "injected" not in resp.text and "RuntimeError" not in resp.text
    assert results["stream"] == want[0].text
    wait_idle(url)
    engine.check_invariants()  # idle: the engine thread waits on its inbox
    assert_serving(url, reference)


def test_a_step_that_raises_ends_the_requests_in_flight_and_the_engine_goes_on(served, reference):
    """A failure outside any one request (here the scheduler, once): the requests in flight end
    with a 500, the engine's invariants hold, and it answers the next requests correctly."""
    url, engine = served
    scheduler = engine.scheduler
    real = scheduler.schedule
    raised = []

    def schedule():
        if not raised:
            raised.append(1)
            raise RuntimeError("injected scheduler fault")
        return real()

    scheduler.schedule = schedule
    try:
        resp = post(url, "/v1/chat/completions", chat(SQUARE_URL))
    finally:
        del scheduler.schedule
    assert raised and assert_refused(resp, 500) == INTERNAL_ERROR
    wait_idle(url)
    engine.check_invariants()
    assert_serving(url, reference)


# -------------------------------------------- 2. pictures are checked, and read off the thread
@pytest.mark.parametrize("size", [(100_000, 1), (2_000_000, 1), (1, 30_000)])
def test_an_absurdly_thin_picture_is_refused_from_its_header(url, reference, size):
    """A 100000x1 picture held every client up for seconds (the processor resized it to 4.8 M
    x 48 pixels on the engine thread); 2000000x1 raised MemoryError."""
    image = Image.new("1", size)
    resp = post(url, "/v1/chat/completions", chat(data_url(png(image))))
    assert "differ by more than 200 times" in assert_refused(resp)
    assert_serving(url, reference)


class Latch:
    """The model's Hugging Face processor, held at a picture of :attr:`SIZE` until released:
    while one request's picture is being preprocessed, is anyone else held up?"""

    SIZE = (77, 77)  # no other test sends a picture of this size

    def __init__(self, processor) -> None:
        self.processor = processor
        self.entered, self.release = threading.Event(), threading.Event()

    def _hold(self, images) -> None:
        if any(getattr(im, "size", None) == self.SIZE for im in images or ()):
            self.entered.set()
            assert self.release.wait(PATIENCE_S)

    def __call__(self, *args, images=None, **kwargs):
        self._hold(images)
        return self.processor(*args, images=images, **kwargs)

    def __getattr__(self, name):
        return getattr(self.processor, name)


def test_one_requests_picture_holds_up_nobody_else(served, reference):
    """Pictures are read and preprocessed on input threads, never on the engine thread: while
    one is stuck in the processor, a text-only request is answered."""
    url, engine = served
    latch = Latch(engine.input_processor.processor)
    engine.input_processor.processor = latch
    slow = {}
    try:
        picture = Image.open(SQUARE).convert("RGB").resize(Latch.SIZE)
        body = chat(data_url(png(picture)))
        waiter = threading.Thread(
            target=lambda: slow.update(resp=post(url, "/v1/chat/completions", body, PATIENCE_S))
        )
        waiter.start()
        assert latch.entered.wait(PATIENCE_S)
        text = post(url, "/v1/chat/completions", chat(None, "What is red?"))
        assert text.status_code == 200, text.text
        assert text.json()["choices"][0]["message"]["content"] == expected(
            reference, None, "What is red?"
        )
        assert "resp" not in slow  # still in the processor
    finally:
        latch.release.set()
        engine.input_processor.processor = latch.processor
    waiter.join(PATIENCE_S)
    assert slow["resp"].status_code == 200, slow["resp"].text


# ------------------------------------------------------------------- 3. a FIFO hangs nothing
def test_a_fifo_in_the_media_folder_is_refused_at_once(url, media, reference):
    """A FIFO hung chat forever; after six, every chat hung (the input threads were stuck)."""
    for _ in range(8):
        resp = post(url, "/v1/chat/completions", chat(str(media / "fifo.png")))
        assert "not a readable image" in assert_refused(resp)
    assert_serving(url, reference)


# ------------------------------------------------- 4. SIGTERM and Ctrl-C within their timeout
SHUTDOWN_S = 5.0  # minirad serve's default --shutdown-timeout
# What the exit may take past it (the engine's last step, the lifespan's end): it took 0.3-0.5
# s on 2 cores; Ctrl-C took 1-12 s more (the interpreter's shutdown).
EXIT_MARGIN_S = 3.0
BIG_SIZE = (5700, 5700)  # 32 M pixels, under the processor's limit: 1-2.5 s each to read


@pytest.fixture(scope="module")
def big_picture() -> str:
    """A data URL of :data:`BIG_SIZE` pixels: a request with six of them keeps both input
    threads busy for seconds."""
    return data_url(png(Image.new("RGB", BIG_SIZE, "orange"), compress_level=1))


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_sigterm_or_ctrl_c_under_load_exits_within_the_graceful_timeout(how, big_picture):
    """A client that sent half a request kept ``minirad serve`` from ever exiting; Ctrl-C
    under load took 6-21 s and ended with a KeyboardInterrupt traceback (the interpreter's
    shutdown waited for the input threads), where SIGTERM took 5 s. Both end it within
    ``--shutdown-timeout`` (default 5 s) now, killed by their own signal, with no traceback:
    the streams still running then get a 503 event, the request whose pictures are still
    being read a 503, and so does the half-sent one. Ctrl-C is sent as a terminal sends it,
    to the whole process group."""
    signum = signal.SIGTERM if how == "SIGTERM" else signal.SIGINT
    port = _free_port()
    cmd = [sys.executable, "-m", "minirad", "serve", "--port", str(port)]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + PATIENCE_S
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "no server"
            time.sleep(0.1)
        info = httpx.get(f"{base}/server_info").json()  # 9: no folder of the server's
        assert not os.path.isabs(info["model_path"]), info
        assert (info["device"], info["dtype"]) == ("cpu", "float32"), info
        half = socket.create_connection(("127.0.0.1", port))
        half.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": '
        )
        # Six pictures of 64 tokens, and 100 more: under 512. Sent whole before the streams
        # start, so it is in (its pictures being read) by the time they are under way.
        pictures = chat(big_picture, max_tokens=100, ignore_eos=True)
        pictures["messages"][0]["content"][:1] *= 6
        body = json.dumps(pictures).encode()
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        streams: list[list[str]] = [[] for _ in range(4)]

        def stream(i: int) -> None:
            # 16 choices of 500 tokens: long enough to be running when the grace period ends
            body = {"prompt": f"a red circle {i}", "max_tokens": 500, "ignore_eos": True}
            body |= {"stream": True, "n": 4}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line:
                        streams[i].append(line)

        clients = [threading.Thread(target=stream, args=(i,)) for i in range(len(streams))]
        for client in clients:
            client.start()
        while not all(streams):  # every stream under way
            assert time.monotonic() < deadline, "no stream started"
            time.sleep(0.05)
        if how == "Ctrl-C":
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        start = time.monotonic()
        proc.wait(timeout=SHUTDOWN_S + HANG_S)  # a bound on a hang; the limit is below
        took = time.monotonic() - start
        for client in clients:
            client.join(HANG_S)
        half.settimeout(HANG_S)
        cut = half.recv(65536)  # what the half-sent request got
        half.close()
        slow.settimeout(HANG_S)
        answer = b""
        while chunk := slow.recv(65536):  # the server closes the connection after it
            answer += chunk
        slow.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    log = proc.stderr.read()
    said = f"{how}: exit {took:.1f} s after it, status {proc.returncode}\n{log[-3000:]}"
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, said
    assert took < SHUTDOWN_S + EXIT_MARGIN_S, said
    assert proc.returncode == -signum, said  # killed by it, as a shell expects: 143 or 130
    for got in (cut, answer):  # the half-sent request, the one whose pictures were read
        head, _, reply = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), got[:300]
        assert json.loads(reply)["error"] == {
            "message": "the server is shutting down",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
    for events in streams:
        assert events[-1] == "data: [DONE]", events[-3:]
        errors = [json.loads(e[6:]) for e in events if e.startswith('data: {"error"')]
        assert [e["error"]["code"] for e in errors] == [503], events[-3:]


def test_ctrl_c_while_the_model_loads_says_one_line():
    """Before uvicorn takes over the signals, Ctrl-C raised KeyboardInterrupt wherever the
    load was, and printed its traceback. Now one line, and the shell's status for SIGINT."""
    port = _free_port()
    cmd = [sys.executable, "-m", "minirad", "serve", "--port", str(port)]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        time.sleep(1.5)  # past the command's own imports (0.4 s), into torch's and the model's
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    log = proc.stderr.read()
    assert "Uvicorn running" not in log, "the server was up: the load was too fast to test"
    assert "Traceback" not in log, log[-3000:]
    assert log.strip().splitlines()[-1] == "minirad serve: interrupted", log[-3000:]
    assert proc.returncode == 130, (proc.returncode, log[-3000:])


def test_a_schema_with_integers_past_64_bits_is_a_400_or_followed_not_a_500(url, reference):
    """llguidance's conversion of a schema object refused an int outside 64 bits anywhere in
    it (a bound, an enum, an unknown key): a 500 with a traceback. Given as text, as the str
    form always was, a bound it cannot meet is a 400 that says so, and the rest is followed."""
    big_bound = {"type": "integer", "minimum": 2**64}
    big_elsewhere = {"type": "integer", "x-note": 2**80, "description": -(2**70)}
    for schema, followed in ((big_bound, False), (big_elsewhere, True)):
        for fields in (
            {"guided_json": schema},
            {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
        ):
            resp = post(url, "/v1/completions", {"prompt": "a number:", "max_tokens": 4} | fields)
            if followed:
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["text"].lstrip("-").isdigit(), resp.text
            else:
                assert "invalid json_schema" in assert_refused(resp)
    assert_serving(url, reference)


# --------------------------------------------- bodies too big to parse on the event loop
def test_a_body_of_ten_million_numbers_is_refused_before_it_is_parsed(url, reference):
    """Ten million ints (20 MB, under the byte limit), in an ignored field or as a token-id
    prompt, held the event loop (JSON parsing and checking) for 15-20 s: /health and every
    client waited. Counted, not parsed, they are refused at once."""
    numbers = b"[" + b"1," * 10_000_000 + b"1]"
    for path, body in (
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "x": '),
        ("/v1/completions", b'{"prompt": '),
        ("/detokenize", b'{"tokens": '),
    ):
        resp = httpx.post(
            url + path,
            content=body + numbers + b"}",
            headers={"content-type": "application/json"},
            timeout=HANG_S,
        )
        assert "JSON values" in assert_refused(resp)
    assert_serving(url, reference)


def test_a_body_declared_too_big_gets_the_error_body(url, reference):
    """A Content-Length over the limit got Starlette's plain-text 413; chunked, the JSON
    one. Both are OpenAI's body now, before a byte of the body is read."""
    with socket.create_connection(urllib.parse.urlsplit(url)[1].split(":")) as conn:
        conn.settimeout(HANG_S)
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 70000000\r\n\r\n"
        )
        answer = b""
        while chunk := conn.recv(65536):  # the server closes the connection after it
            answer += chunk
        head, _, reply = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert json.loads(reply)["error"]["code"] == 413
    assert_serving(url, reference)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------ 5. what a client got wrong is a 400, never a 500
def _zip_png(kind: str) -> bytes:
    """A PNG whose text or ICC chunk unpacks past Pillow's limit (a zip bomb in a chunk)."""
    image = Image.new("RGB", (8, 8), "red")
    if kind == "text":
        info = PngImagePlugin.PngInfo()
        info.add_text("comment", "a" * 2 * 2**20, zip=True)
        return png(image, pnginfo=info)
    return png(image, icc_profile=b"\0" * 3 * 2**20)


SURROGATE = b'"\\ud800"'  # valid JSON, no Unicode text


def _raw(template: str) -> bytes:
    return template.encode().replace(b'"@"', SURROGATE)


CLIENT_ERRORS = {
    # a lone surrogate, wherever text goes
    "surrogate prompt": ("/v1/completions", _raw('{"prompt": "@"}')),
    "surrogate prompt list": ("/v1/completions", _raw('{"prompt": ["@"]}')),
    "surrogate message": (
        "/v1/chat/completions",
        _raw('{"messages": [{"role": "user", "content": "@"}]}'),
    ),
    "surrogate text part": (
        "/v1/chat/completions",
        _raw('{"messages": [{"role": "user", "content": [{"type": "text", "text": "@"}]}]}'),
    ),
    "surrogate role": (
        "/v1/chat/completions",
        _raw('{"messages": [{"role": "@", "content": "hi"}]}'),
    ),
    "surrogate model (chat)": (
        "/v1/chat/completions",
        _raw('{"model": "@", "messages": [{"role": "user", "content": "hi"}]}'),
    ),
    "surrogate model (completions)": ("/v1/completions", _raw('{"model": "@", "prompt": "hi"}')),
    "surrogate regex": ("/v1/completions", _raw('{"prompt": "hi", "guided_regex": "@"}')),
    "surrogate choice": ("/v1/completions", _raw('{"prompt": "hi", "guided_choice": ["@"]}')),
    "surrogate schema value": (
        "/v1/completions",
        _raw('{"prompt": "hi", "guided_json": {"type": "string", "pattern": "@"}}'),
    ),
    "surrogate schema key": (
        "/v1/completions",
        b'{"prompt": "hi", "guided_json": {"type": "object", "properties": {"\\udfff": {}}}}',
    ),
    "surrogate response_format": (
        "/v1/chat/completions",
        _raw(
            '{"messages": [{"role": "user", "content": "hi"}], "response_format": '
            '{"type": "json_schema", "json_schema": {"name": "@", "schema": {"enum": ["@"]}}}}'
        ),
    ),
    "surrogate structured_outputs": (
        "/v1/completions",
        _raw('{"prompt": "hi", "structured_outputs": {"regex": "@"}}'),
    ),
    "surrogate stop": ("/v1/completions", _raw('{"prompt": "hi", "stop": ["@"]}')),
    "surrogate field name": ("/v1/completions", b'{"prompt": "hi", "\\ud800": 1}'),
    "surrogate image URL": (
        "/v1/chat/completions",
        _raw(
            '{"messages": [{"role": "user", "content": [{"type": "image_url", '
            '"image_url": {"url": "@"}}]}]}'
        ),
    ),
    "surrogate tokenize": ("/tokenize", _raw('{"prompt": "@"}')),
    "surrogate tokenize messages": (
        "/tokenize",
        _raw('{"messages": [{"role": "user", "content": "@"}]}'),
    ),
    "surrogate detokenize model": ("/detokenize", _raw('{"model": "@", "tokens": [5]}')),
    "nested too deep": (
        "/v1/completions",
        b'{"prompt": "hi", "guided_json": ' + b'{"a": ' * 200 + b"1" + b"}" * 201,
    ),
    # image paths that are no picture in the folder
    "path with a NUL": ("/v1/chat/completions", chat("square\x00.png")),
    "300-character name": ("/v1/chat/completions", chat("a" * 300 + ".png")),
    "symlink loop": ("/v1/chat/completions", "media:loop.png"),
    "a folder": ("/v1/chat/completions", "media:folder.png"),
    "not a picture": ("/v1/chat/completions", "media:notes.png"),
    "missing": ("/v1/chat/completions", "media:missing.png"),
    "a link out of the folder": ("/v1/chat/completions", "media:escape.png"),
    "outside the folder": ("/v1/chat/completions", chat("/etc/hostname")),
    "dot-dot out of the folder": ("/v1/chat/completions", chat("../" * 12 + "etc/hostname")),
    # data URLs
    "non-ASCII base64": ("/v1/chat/completions", chat("data:image/png;base64,\u00fc\u00fc==")),
    "not base64": ("/v1/chat/completions", chat("data:image/png;base64,@@@")),
    "no base64 marker": ("/v1/chat/completions", chat("data:image/png,abc")),
    "empty data": ("/v1/chat/completions", chat("data:image/png;base64,")),
    "text chunk bomb": ("/v1/chat/completions", chat(data_url(_zip_png("text")))),
    "ICC chunk bomb": ("/v1/chat/completions", chat(data_url(_zip_png("icc")))),
    "truncated PNG": (
        "/v1/chat/completions",
        chat(data_url(png(Image.effect_noise((64, 64), 64).convert("RGB"))[:2000])),
    ),
    # token ids
    "stop_token_ids outside the vocabulary with a grammar": (
        "/v1/completions",
        {"prompt": "hi", "stop_token_ids": [10**6], "guided_choice": ["a", "b"]},
    ),
    "stop_token_ids outside the vocabulary": (
        "/v1/completions",
        {"prompt": "hi", "stop_token_ids": [10**6]},
    ),
    "detokenize outside the vocabulary": ("/detokenize", {"tokens": [10**6]}),
}


@pytest.mark.parametrize("case", list(CLIENT_ERRORS))
def test_what_the_client_got_wrong_is_a_400(url, media, reference, case):
    path, body = CLIENT_ERRORS[case]
    if isinstance(body, str) and body.startswith("media:"):
        body = chat(str(media / body.removeprefix("media:")))
    message = assert_refused(post(url, path, body))
    assert str(media) not in message and str(REPO) not in message  # 9: no server folders
    assert httpx.get(f"{url}/health", timeout=HANG_S).status_code == 200


def test_every_unreadable_name_in_the_folder_gets_the_same_message(url, media):
    """Missing, a folder, a FIFO, a link out, a loop, not a picture: one message, so that a
    client learns nothing about what the folder holds (9); the name as the client wrote it,
    relative to the folder."""
    said = set()
    for name in ("missing.png", "folder.png", "fifo.png", "escape.png", "loop.png", "notes.png"):
        message = assert_refused(post(url, "/v1/chat/completions", chat(str(media / name))))
        said.add(message.replace(name, "NAME"))
    assert said == {"image 'NAME' is not a readable image (PNG, JPEG, WebP, GIF or BMP)"}


# ------------------------------------------------------------------- 6. grammars off the thread
def test_a_choice_of_5000_items_is_served(url):
    """It met llguidance's 2000 items per parser row at the first token and said "token 90 is
    not allowed"."""
    choices = [f"w{i}" for i in range(5000)]
    body = {"prompt": "hi", "guided_choice": choices, "max_tokens": 8, "temperature": 0}
    resp = post(url, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] in choices


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"guided_regex": "a{1000000}"}, "too complex to enforce: lexer error"),
        ({"guided_regex": "a" * 200_000}, "characters long; the server compiles at most"),
        ({"guided_choice": ["x" * 50] * 5000}, "characters long"),
    ],
)
def test_a_grammar_too_big_says_so(url, reference, fields, said):
    resp = post(url, "/v1/completions", {"prompt": "hi"} | fields)
    message = assert_refused(resp)
    assert said in message and "is not allowed" not in message, message
    assert_serving(url, reference)


# --------------------------------------------- 7. a file is opened once, checked, then read
def test_a_symlink_swapped_under_the_server_is_never_followed_out(url, media, reference):
    """``swap.png`` flips between a picture in the folder and one outside it while 300
    requests ask about it: each answer is about the inside picture, or a 400 (it was checked
    by name, then opened again by name: 73 of 300 opened the outside file)."""
    inside, outside = expected(reference, SQUARE), expected(reference, OTHER)
    assert inside != outside  # else the answers could not tell the files apart
    link, flipping = media / "swap.png", True
    link.symlink_to(media / "square.png")

    targets = [next(media.parent.glob("outside*/other.png")), media / "square.png"]

    def flip() -> None:
        i = 0
        while flipping:
            tmp = media / f".swap{i % 2}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(targets[i % 2])
            os.replace(tmp, link)
            i += 1

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        answers = []
        for _ in range(300):
            resp = post(url, "/v1/chat/completions", chat(str(link)))
            if resp.status_code == 200:
                answers.append(resp.json()["choices"][0]["message"]["content"])
            else:
                assert "not a readable image" in assert_refused(resp)
    finally:
        flipping = False
        flipper.join()
        link.unlink()
    assert answers and set(answers) == {inside}, set(answers)


# ----------------------------------------------------------------- 8. a short list of formats
@pytest.mark.parametrize("kind", ["TIFF", "EPS", "ICO", "PPM"])
def test_only_png_jpeg_webp_gif_and_bmp_are_decoded(url, kind):
    """An EPS payload made the server try to run Ghostscript; TIFF and the others decoded."""
    if kind == "EPS":
        data = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n"
    else:
        out = io.BytesIO()
        Image.open(SQUARE).convert("RGB").save(out, format=kind)
        data = out.getvalue()
    message = assert_refused(post(url, "/v1/chat/completions", chat(data_url(data, "png"))))
    assert "(PNG, JPEG, WebP, GIF or BMP)" in message and "Ghostscript" not in message


@pytest.mark.parametrize("kind", ["JPEG", "WEBP", "GIF", "BMP"])
def test_the_allowed_formats_are_read(url, reference, kind):
    out = io.BytesIO()
    Image.open(SQUARE).convert("RGB").save(out, format=kind, quality=100, lossless=True)
    resp = post(url, "/v1/chat/completions", chat(data_url(out.getvalue(), kind.lower())))
    assert resp.status_code == 200, resp.text


# ---------------------------------------------------------- 13. detokenize what tokenize gave
def test_detokenize_gives_back_the_text_of_a_chat_with_a_picture(url, reference):
    """vLLM returns the text; ours answered 400 ("image placeholder tokens and no image")."""
    messages = chat(SQUARE_URL)["messages"]
    ids = post(url, "/tokenize", {"messages": messages}).json()["tokens"]
    resp = post(url, "/detokenize", {"tokens": ids})
    assert resp.status_code == 200, resp.text
    assert resp.json()["prompt"] == reference.tokenizer.decode(ids)
    assert resp.json()["prompt"].count("<image>") == ids.count(reference.vlm.image_token_id)


# ------------------------------------------------------------------------------- the fuzzer
HOSTILE = [
    None, True, -1, 0, 1, 2**63, 10**30, -(10**30), 1e-46, -1e-46, 1e308, 0.5, "", " ",
    "\u202e\u0000", "a" * 10_000, [], [None], [[[]]], {}, {"a": {"b": {}}}, [1, "a", None],
    ["w"] * 300, {"type": "text"}, "<image>", "<|im_end|>",
]  # fmt: skip
IMAGE_URLS = [
    "", "http://127.0.0.1:1/a.png", "file:///etc/passwd", "/dev/zero", "/proc/self/environ",
    "data:image/png;base64,", "data:,", "data:image/png;base64,====", "../../etc/passwd",
    "media:fifo.png", "media:loop.png", "media:escape.png", "media:notes.png",
    "media:square.png", "data:" + "A" * 5000,
]  # fmt: skip
FIELDS = {
    "/v1/chat/completions": [
        "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p",
        "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "n", "stream",
        "stream_options", "response_format", "structured_outputs", "guided_json",
        "guided_regex", "guided_choice", "include_stop_str_in_output", "logprobs",
        "presence_penalty", "tools", "tool_choice", "echo",
    ],
    "/v1/completions": [
        "prompt", "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
        "stop_token_ids", "ignore_eos", "n", "stream", "guided_regex", "guided_choice",
        "guided_json", "echo", "suffix", "logit_bias", "best_of",
    ],
    "/tokenize": ["prompt", "messages", "model"],
    "/detokenize": ["tokens", "model"],
}  # fmt: skip


def _bodies(media: Path, n: int, seed: int = 0) -> list[tuple[str, object]]:
    """``n`` malformed (and some well-formed) bodies over every field of every endpoint:
    each field set to hostile values, image parts with hostile URLs, structures broken."""
    rng = random.Random(seed)
    base = {
        "/v1/chat/completions": chat(str(media / "square.png"), max_tokens=4),
        "/v1/completions": {"prompt": "hi", "max_tokens": 4, "temperature": 0},
        "/tokenize": {"prompt": "hi"},
        "/detokenize": {"tokens": [5, 6]},
    }
    out: list[tuple[str, object]] = []
    while len(out) < n:
        path = rng.choice(list(FIELDS))
        body = json.loads(json.dumps(base[path]))
        for _ in range(rng.randint(1, 3)):
            if not isinstance(body, dict):
                break
            what = rng.random()
            if what < 0.6:
                body[rng.choice(FIELDS[path])] = rng.choice(HOSTILE)
            elif what < 0.8 and path == "/v1/chat/completions":
                url = rng.choice(IMAGE_URLS)
                if url.startswith("media:"):
                    url = str(media / url.removeprefix("media:"))
                part = {"type": "image_url", "image_url": {"url": url}}
                body["messages"] = [{"role": "user", "content": [part, {"type": "text"}]}]
                if rng.random() < 0.5:
                    body["messages"][0]["content"][1]["text"] = "Hi"
            elif what < 0.9 and body:
                body.pop(rng.choice(list(body)))
            else:
                body = rng.choice([[body], "body", 7, None, {"x": body}])
        out.append((path, body))
    return out


def test_hundreds_of_malformed_bodies_get_no_500_no_hang_and_no_dead_engine(
    served, media, reference
):
    url, engine = served
    bodies = _bodies(media, 400)
    statuses, broken = {}, []
    for path, body in bodies:
        shown = f"{path} {json.dumps(body)[:300]}"
        try:
            resp = httpx.post(url + path, json=body, timeout=HANG_S)
        except httpx.TimeoutException:
            broken.append(f"{shown}: no answer in {HANG_S} s")
            continue
        if resp.status_code >= 500:
            broken.append(f"{shown}: {resp.text[:200]}")
        elif resp.status_code >= 400:
            assert resp.json()["error"]["code"] == resp.status_code
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
    assert not broken, "\n".join(broken)
    assert statuses.get(400, 0) > 100 and statuses.get(200, 0) > 20, statuses  # both kinds
    wait_idle(url)
    engine.check_invariants()
    assert_serving(url, reference)
