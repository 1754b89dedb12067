"""``minirad serve`` (minirad/entrypoints/openai/api_server.py): a real uvicorn server on the
shipped tiny model, asked with the real ``openai`` client and plain HTTP.

Every answer is checked against a second :class:`~minirad.engine.LLMEngine` on the same model
(greedy), never against written-down strings; the counters against the engine's own counts.
One server (in a thread of this process) serves the module; the last test starts ``minirad
serve`` itself, with KV events, as a user would.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import serving

from minirad.course.scenes import JSON_PROMPT, SHAPES_JSON_SCHEMA
from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.entrypoints.chat_utils import chat_prompt
from minirad.entrypoints.openai.api_server import build_app
from minirad.entrypoints.openai.protocol import MAX_N
from minirad.kv_events import BlockStored, KVEventSubscriber, Notice
from minirad.models import DEFAULT_MODEL_DIR

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / "data" / "images"
SQUARE = IMAGES / "orange_square.png"
SHAPES = IMAGES / "purple_circle_green_square_red_triangle.png"
NAME = "tiny"
# How long a poll for the server's state may take before the test fails: a bound on a hang,
# not a timing assertion (the state is reached in milliseconds).
PATIENCE_S = 60.0


def shipped_model() -> Path:
    if not DEFAULT_MODEL_DIR.is_dir():
        pytest.skip("the shipped model is not there (being retrained?)")
    return DEFAULT_MODEL_DIR


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    """The engine the server's answers are compared with (its own, separate instance)."""
    return LLMEngine.from_pretrained(shipped_model())


@pytest.fixture(scope="module")
def url():
    """A server on a free 127.0.0.1 port, in a thread; its base URL."""
    engine = LLMEngine.from_pretrained(shipped_model())
    with serving(build_app(engine, NAME, model_path="tiny-path")) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def user_turn(question: str, image: str) -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": image}}]
    return [{"role": "user", "content": [*content, {"type": "text", "text": question}]}]


def expected(engine: LLMEngine, question: str, image: Path, **params):
    """The reference engine's output for the chat request of ``question`` about ``image``."""
    prompt = chat_prompt(engine.processor, question, 1)
    return engine.generate([GenerateRequest(prompt, [str(image)], SamplingParams(**params))])[0]


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus_client, by name and labels (except the
    model and engine labels every sample carries)."""
    text = httpx.get(f"{url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.pop("model_name") == NAME and s.labels.pop("engine") == "0"
            samples[s.name + "".join(f"{{{v}}}" for v in s.labels.values())] = s.value
    return samples


def wait_until(url: str, condition) -> dict[str, float]:
    deadline = time.monotonic() + PATIENCE_S
    while not condition(m := metrics(url)):
        assert time.monotonic() < deadline, f"the server never got there: {m}"
        time.sleep(0.02)
    return m


def idle(m: dict[str, float]) -> bool:
    return m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of a server-sent-event stream, in order."""
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line.removeprefix("data: ") for line in lines]


# ----------------------------------------------------------------------------------- answers
@pytest.mark.parametrize("image", ["data URL", "file path"])
def test_chat_answer_is_the_engines(client, reference, image):
    url = data_url(SQUARE) if image == "data URL" else str(SQUARE)
    resp = client.chat.completions.create(
        model=NAME,
        messages=user_turn("What colour is the square?", url),
        max_tokens=24,
        temperature=0,
    )
    want = expected(reference, "What colour is the square?", SQUARE, max_new_tokens=24)
    assert resp.choices[0].message.content == want.text and want.text
    assert resp.choices[0].finish_reason == want.finish_reason
    assert resp.model == NAME and resp.object == "chat.completion"
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    assert resp.usage.completion_tokens == len(want.token_ids)
    assert resp.usage.prompt_tokens_details.cached_tokens is not None


def test_streamed_chunks_concatenate_to_the_answer(url, client, reference):
    body = {
        "messages": user_turn("What shapes are in the picture?", data_url(SHAPES)),
        "max_tokens": 20,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    want = expected(reference, "What shapes are in the picture?", SHAPES, max_new_tokens=20)
    assert text == want.text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == (
        want.finish_reason
    )
    usage = chunks[-1]["usage"]  # the last chunk: no choices, the usage
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == len(want.token_ids)

    # The OpenAI client reads the same stream.
    stream = client.chat.completions.create(
        model=NAME,
        messages=body["messages"],
        max_tokens=20,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text


def test_stop_strings_end_the_answer_as_the_engines(url, client, reference):
    """``stop``: the answer ends before the first stop string, streamed or not, as the engine
    ends it (tests/test_engine.py holds the engine to vLLM's rule)."""
    question = "What shapes are in the picture?"
    full = expected(reference, question, SHAPES, max_new_tokens=20).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # mid-answer, likely across tokens
    want = expected(reference, question, SHAPES, max_new_tokens=20, stop=[stop])
    assert want.finish_reason == "stop" and len(want.text) < len(full)
    messages = user_turn(question, str(SHAPES))
    resp = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=20, temperature=0, stop=[stop, "never said"]
    )
    assert resp.choices[0].message.content == want.text
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == len(want.token_ids)
    stream = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=20, temperature=0, stop=stop, stream=True
    )
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    resp = client.chat.completions.create(  # vLLM's extension, through extra_body
        model=NAME,
        messages=messages,
        max_tokens=20,
        temperature=0,
        stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    )
    assert resp.choices[0].message.content == want.text + stop


def test_n_choices_are_the_engines_requests_seeded_one_apart(url, client, reference):
    """``n``: one engine request per choice (vLLM's parallel sampling), choice ``i`` seeded
    ``seed + i``; streamed, each choice's chunks carry its index."""
    question = "What shapes are in the picture?"
    messages = user_turn(question, str(SHAPES))
    sampled = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 12, "seed": 7}
    resp = client.chat.completions.create(
        model=NAME, messages=messages, n=3, extra_body={"top_k": 0}, **sampled
    )
    want = [
        expected(reference, question, SHAPES, max_new_tokens=12, seed=7 + i, temperature=1.0)
        for i in range(3)
    ]
    assert len({w.text for w in want}) > 1, "the seeds should sample different answers"
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.message.content for c in resp.choices] == [w.text for w in want]
    assert [c.finish_reason for c in resp.choices] == [w.finish_reason for w in want]
    assert resp.usage.prompt_tokens == len(want[0].prompt_token_ids)
    assert resp.usage.completion_tokens == sum(len(w.token_ids) for w in want)

    body = {"messages": messages, "n": 3, "stream": True, "top_k": 0, **sampled}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    texts, reasons = ["", "", ""], [None, None, None]
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
        reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
    assert texts == [w.text for w in want] and reasons == [w.finish_reason for w in want]
    assert chunks[-1]["usage"]["completion_tokens"] == resp.usage.completion_tokens

    greedy = client.completions.create(
        model=NAME,
        prompt=chat_prompt(reference.processor, "What is red?", 0),
        n=2,
        max_tokens=8,
        temperature=0,
    )
    assert greedy.choices[0].text == greedy.choices[1].text  # argmax twice
    assert wait_until(url, idle)


def test_a_tiny_temperature_samples_the_greedy_answer(client, reference):
    """1e-40 divides the logits past float32's range: the sampler must still give the argmax
    (and the engine thread must survive it)."""
    resp = client.chat.completions.create(
        model=NAME,
        messages=user_turn("What colour is the square?", str(SQUARE)),
        max_tokens=8,
        temperature=1e-40,
        seed=3,
    )
    want = expected(reference, "What colour is the square?", SQUARE, max_new_tokens=8)
    assert resp.choices[0].message.content == want.text


def test_completions_with_token_ids_and_text(client, reference):
    prompt = chat_prompt(reference.processor, "What is red?", 0)
    ids = reference.processor.tokenizer(prompt)["input_ids"]
    params = SamplingParams(max_new_tokens=8)
    want = reference.generate([GenerateRequest(ids, (), params)])[0]
    assert want.text == reference.generate([GenerateRequest(prompt, (), params)])[0].text
    for p in (ids, prompt):
        resp = client.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0)
        assert resp.choices[0].text == want.text and resp.object == "text_completion"
        assert resp.usage.prompt_tokens == len(ids)
        assert resp.usage.completion_tokens == len(want.token_ids)
    stream = client.completions.create(
        model=NAME, prompt=ids, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == want.text


def test_tokenize_gives_the_ids_a_completion_is_computed_from(url, client, reference):
    """vLLM's /tokenize and /detokenize: the ids of a text prompt are the tokenizer's, those
    of chat messages with an image have the image's placeholders expanded, and both counts
    are the prompt_tokens of the completion of the same prompt."""
    prompt = chat_prompt(reference.processor, "What is red?", 0)
    ids = reference.processor.tokenizer(prompt)["input_ids"]
    got = httpx.post(f"{url}/tokenize", json={"model": NAME, "prompt": prompt}).json()
    assert got == {"count": len(ids), "max_model_len": reference.max_model_len, "tokens": ids}
    back = httpx.post(f"{url}/detokenize", json={"model": NAME, "tokens": ids}).json()
    assert back == {"prompt": prompt}
    messages = user_turn("What colour is the square?", str(SQUARE))
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    answer = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=1, temperature=0
    )
    assert chat["count"] == answer.usage.prompt_tokens == len(chat["tokens"])
    image_id = reference.vlm.image_token_id
    assert chat["tokens"].count(image_id) == 64  # the image's placeholders, expanded
    for body, status, words in [
        ({"prompt": prompt, "messages": messages}, 400, "a prompt or messages"),
        ({}, 400, "a prompt or messages"),
        ({"prompt": [1, 10**6]}, 400, "token ids must be in"),
        ({"prompt": prompt, "model": "other"}, 404, "does not exist"),
    ]:
        r = httpx.post(f"{url}/tokenize", json=body)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/detokenize", json={"tokens": [-1]})
    assert r.status_code == 400 and "token ids must be in" in r.json()["error"]["message"]


def test_cached_tokens_of_a_repeated_prompt_are_the_engines(client, reference):
    question = "Is the square orange? Answer in one word."
    ask = dict(model=NAME, messages=user_turn(question, str(SQUARE)), max_tokens=4, temperature=0)
    client.chat.completions.create(**ask)
    again = client.chat.completions.create(**ask)
    expected(reference, question, SQUARE, max_new_tokens=4)
    want = expected(reference, question, SQUARE, max_new_tokens=4)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == want.stats.cached_tokens > 0


def test_reset_prefix_cache_empties_the_tree_but_not_under_a_running_request(url, client):
    ask = dict(model=NAME, messages=user_turn("Describe the image.", str(SQUARE)), temperature=0)

    def cached() -> int:
        answer = client.chat.completions.create(**ask, max_tokens=2)
        return answer.usage.prompt_tokens_details.cached_tokens

    cached()
    assert cached() > 0
    # A request that runs until the context is full; a reset between two readings that both
    # see it running happened while it ran, and must be refused.
    body = {"model": NAME, "prompt": "a red circle", "max_tokens": 500, "ignore_eos": True}
    body["stream"] = True
    refused = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=PATIENCE_S) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)
        while refused is None and metrics(url)["vllm:num_requests_running"] == 1:
            reply = httpx.post(f"{url}/reset_prefix_cache").json()
            if metrics(url)["vllm:num_requests_running"] == 1:
                refused = reply == {"success": False}
    assert refused, "no reset landed while the request ran"
    wait_until(url, idle)
    assert httpx.post(f"{url}/reset_prefix_cache").json() == {"success": True}
    assert cached() == 0


def test_metrics_move_by_each_requests_counts(url, client):
    before = wait_until(url, idle)
    resp = client.chat.completions.create(
        model=NAME,
        messages=user_turn("What colour is the circle?", str(SHAPES)),
        max_tokens=6,
        temperature=0,
    )
    after = metrics(url)
    usage = resp.usage

    def moved(name: str) -> float:
        return after[name] - before[name]

    assert moved("vllm:prefix_cache_queries_total") == usage.prompt_tokens
    assert moved("vllm:prefix_cache_hits_total") == usage.prompt_tokens_details.cached_tokens
    assert moved("sglang:cached_tokens_total{device}") == usage.prompt_tokens_details.cached_tokens
    assert moved("vllm:prompt_tokens_total") == usage.prompt_tokens
    assert moved("vllm:generation_tokens_total") == usage.completion_tokens
    reason = resp.choices[0].finish_reason
    assert moved(f"vllm:request_success_total{{{reason}}}") == 1
    # Idle, every cached slot is unlocked: counted free, as vLLM counts its cached blocks.
    assert idle(after) and after["vllm:kv_cache_usage_perc"] == 0
    assert after["vllm:num_preemptions_total"] == 0


def test_structured_output_follows_the_schema(client, reference):
    resp = client.chat.completions.create(
        model=NAME,
        messages=user_turn(JSON_PROMPT, str(SHAPES)),
        max_tokens=120,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "shapes", "schema": SHAPES_JSON_SCHEMA},
        },
    )
    text = resp.choices[0].message.content
    jsonschema.validate(json.loads(text), SHAPES_JSON_SCHEMA)
    want = expected(
        reference, JSON_PROMPT, SHAPES, max_new_tokens=120, json_schema=SHAPES_JSON_SCHEMA
    )
    assert text == want.text

    choices = ["red", "green", "blue"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        resp = client.chat.completions.create(
            model=NAME,
            messages=user_turn("What colour is the triangle?", str(SHAPES)),
            max_tokens=8,
            temperature=0,
            extra_body=extra,
        )
        assert resp.choices[0].message.content in choices


# ------------------------------------------------------------------------------------ errors
def chat_body(**fields) -> dict:
    return {"messages": user_turn("What colour is the square?", str(SQUARE))} | fields


BAD_REQUESTS = {
    "malformed JSON": ("chat", b'{"messages": [', 400),
    "unknown model": ("chat", chat_body(model="gpt-4"), 404),
    "empty messages": ("chat", {"messages": []}, 400),
    "no messages": ("chat", {}, 400),
    "image not base64": (
        "chat",
        chat_body(messages=user_turn("Hi", "data:image/png;base64,@@")),
        400,
    ),
    "image not an image": (
        "chat",
        chat_body(
            messages=user_turn("Hi", "data:image/png;base64," + base64.b64encode(b"no").decode())
        ),
        400,
    ),
    "image missing": ("chat", chat_body(messages=user_turn("Hi", "/no/such.png")), 400),
    "image over http": ("chat", chat_body(messages=user_turn("Hi", "http://x/a.png")), 400),
    "a placeholder too many": (
        "chat",
        chat_body(messages=user_turn("<image> Hi", str(SQUARE))),
        400,
    ),
    "unknown part": (
        "chat",
        chat_body(messages=[{"role": "user", "content": [{"type": "audio"}]}]),
        400,
    ),
    "max_tokens 0": ("chat", chat_body(max_tokens=0), 400),
    "max_tokens -1": ("chat", chat_body(max_tokens=-1), 400),
    "max_tokens text": ("chat", chat_body(max_tokens="many"), 400),
    "temperature -1": ("chat", chat_body(temperature=-1), 400),
    "n 0": ("chat", chat_body(n=0), 400),
    "presence_penalty": ("chat", chat_body(presence_penalty=0.5), 400),
    "min_tokens": ("chat", chat_body(min_tokens=5), 400),
    "logit_bias": ("completions", {"prompt": "Hi", "logit_bias": {"5": 100}}, 400),
    "tools": ("chat", chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), 400),
    "suffix": ("completions", {"prompt": "Hi", "suffix": "!"}, 400),
    "logprobs": ("chat", chat_body(logprobs=True), 400),
    "echo": ("completions", {"prompt": "Hi", "echo": True}, 400),
    "chat echo": ("chat", chat_body(echo=True), 400),
    "tool_choice required": ("chat", chat_body(tool_choice="required"), 400),
    "n too many": ("completions", {"prompt": "Hi", "n": MAX_N + 1}, 400),
    "empty stop string": ("chat", chat_body(stop=[""]), 400),
    "two constraints": ("chat", chat_body(guided_regex="a+", guided_choice=["a"]), 400),
    "regex that does not parse": ("chat", chat_body(guided_regex="(unclosed"), 400),
    "grammar kind we lack": ("chat", chat_body(structured_outputs={"grammar": "root ::= x"}), 400),
    "token id out of vocab": ("completions", {"prompt": [1, 10**6]}, 400),
    "empty prompt": ("completions", {"prompt": ""}, 400),
    "two prompts": ("completions", {"prompt": ["a", "b"]}, 400),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_openai_error_bodies(url, case):
    endpoint, body, status = BAD_REQUESTS[case]
    kwargs = {"content": body, "headers": {"content-type": "application/json"}}
    if not isinstance(body, bytes):
        kwargs = {"json": body}
    resp = httpx.post(f"{url}/v1/{endpoint.replace('chat', 'chat/completions')}", **kwargs)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert error["message"]
    assert httpx.get(f"{url}/health").status_code == 200


@pytest.mark.parametrize(
    ("content", "content_type", "endpoint", "said", "param"),
    [
        (b'{"messages": [', "application/json", "chat/completions", "not valid JSON", None),
        (json.dumps(chat_body()).encode(), "text/plain", "chat/completions", "a JSON object", None),
        (
            b'{"prompt": [1, 3, 5]}',
            "application/json",
            "completions",
            "(id 3) and no image",
            "prompt",
        ),
        # Refused before it is tokenized (which took the engine thread 30 s for 20 MB).
        (
            json.dumps({"prompt": "a" * 2_000_000}).encode(),
            "application/json",
            "completions",
            "2,000,000 characters",
            None,
        ),
    ],
)
def test_error_messages_say_what_is_wrong(url, content, content_type, endpoint, said, param):
    """The messages a user reads: not pydantic's locations, not an arithmetic of counts; the
    ``param`` is the field the message names first, when it names one."""
    headers = {"content-type": content_type}
    resp = httpx.post(f"{url}/v1/{endpoint}", content=content, headers=headers)
    assert resp.status_code == 400, resp.text
    assert said in resp.json()["error"]["message"]
    assert resp.json()["error"]["param"] == param


JSON = {"content-type": "application/json"}


def test_unknown_paths_and_methods_get_openai_error_bodies(url):
    """Starlette's refusals too: no such path, a wrong method, JSON nested too deep to parse."""
    for resp, status in (
        (httpx.get(f"{url}/v1/nothing"), 404),
        (httpx.get(f"{url}/v1/chat/completions"), 405),
        (httpx.post(f"{url}/v1/completions", content=b"[" * 100_000, headers=JSON), 400),
    ):
        assert resp.status_code == status, resp.text
        error = resp.json()["error"]
        assert error["code"] == status and error["message"] and error["type"].endswith("Error")


def test_fields_we_lack_are_accepted_when_off(url):
    """A client that sends vLLM's or OpenAI's defaults explicitly gets its answer."""
    off = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    off |= {"logit_bias": {}, "min_tokens": 0, "tools": [], "top_logprobs": 0, "bogus": 1}
    off |= {"tool_choice": "auto", "echo": False}
    resp = httpx.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=4, **off))
    assert resp.status_code == 200, resp.text


def test_the_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=user_turn("Hi", str(SQUARE)))
    with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1"):
        client.completions.create(model=NAME, prompt="Hi", max_tokens=0)


# ---------------------------------------------------------------------- disconnects and load
def long_body(stream: bool) -> dict:
    # ignore_eos and no max_tokens: the request runs until the context is full, long after the
    # client has gone.
    return chat_body(temperature=0, ignore_eos=True, stream=stream)


def test_a_client_that_leaves_mid_stream_aborts_its_request(url, client, reference):
    before = wait_until(url, idle)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=long_body(True)) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")  # it runs; then the connection closes
    after = wait_until(url, idle)
    assert (
        after["vllm:request_success_total{abort}"]
        == before["vllm:request_success_total{abort}"] + 1
    )

    # Without streaming: the request is running when the socket closes.
    body = json.dumps(long_body(False)).encode()
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(url, lambda m: m["vllm:num_requests_running"] == 1)
    after2 = wait_until(url, idle)
    assert (
        after2["vllm:request_success_total{abort}"]
        == after["vllm:request_success_total{abort}"] + 1
    )

    # n choices: leaving aborts every one of them.
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=long_body(True) | {"n": 3}) as r:
        assert next(r.iter_lines()).startswith("data: ")
    after3 = wait_until(url, idle)
    assert (
        after3["vllm:request_success_total{abort}"]
        == after2["vllm:request_success_total{abort}"] + 3
    )

    # The server still answers, correctly.
    resp = client.chat.completions.create(
        model=NAME,
        messages=user_turn("What colour is the square?", str(SQUARE)),
        max_tokens=8,
        temperature=0,
    )
    want = expected(reference, "What colour is the square?", SQUARE, max_new_tokens=8)
    assert resp.choices[0].message.content == want.text


def test_eight_concurrent_clients_get_the_engines_answers(url, client, reference):
    questions = ["What colour is the square?", "What shapes are in the picture?"]
    images = [SQUARE, SHAPES, *sorted(IMAGES.glob("*_left_of_*.png"))[:2]]
    pairs = [(q, im) for q in questions for im in images]
    cases = [(q, im, i % 2 == 1) for i, (q, im) in enumerate(pairs)]  # every other one streams
    assert len(cases) == 8

    def ask(case) -> str:
        question, image, stream = case
        kwargs = dict(
            model=NAME, messages=user_turn(question, data_url(image)), max_tokens=12, temperature=0
        )
        if stream:
            chunks = client.chat.completions.create(**kwargs, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return client.chat.completions.create(**kwargs).choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, cases))
    prompts = [
        GenerateRequest(
            chat_prompt(reference.processor, q, 1), [str(im)], SamplingParams(max_new_tokens=12)
        )
        for q, im, _ in cases
    ]
    assert answers == [o.text for o in reference.generate(prompts)]
    wait_until(url, idle)


def test_models_and_health(url, reference):
    models = httpx.get(f"{url}/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == NAME and card["root"] == "tiny-path" and card["object"] == "model"
    assert card["max_model_len"] == reference.max_model_len
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200


# ------------------------------------------------------------------------------ the command
def test_minirad_serve_answers_and_publishes_kv_events(reference):
    """``minirad serve`` as a user starts it, KV events on: the chat answer is the engine's,
    the served name is the --model string, and the prompt's full blocks are published."""
    port = free_port()
    model = os.path.relpath(DEFAULT_MODEL_DIR, REPO)  # as a user types it, from the repo
    cmd = [sys.executable, "-m", "minirad", "serve", "--model", model, "--port", str(port)]
    cmd += ["--kv-events-endpoint", "tcp://127.0.0.1:*"]
    cmd += ["--kv-events-replay-endpoint", "tcp://127.0.0.1:*"]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    try:
        endpoints = None
        while True:  # its startup log: the KV-event sockets, then uvicorn's "running" line
            line = lines.get(timeout=PATIENCE_S)
            if line.startswith("minirad serve: KV events on "):
                pub, _, replay = line.removeprefix("minirad serve: KV events on ").partition(
                    ", replay on "
                )
                endpoints = pub.strip(), replay.strip()
            if "Uvicorn running" in line:
                break
        assert endpoints is not None
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == model
        with KVEventSubscriber(*endpoints) as sub:
            question = "What colour is the square?"
            body = {
                "model": model,
                "messages": user_turn(question, str(SQUARE)),
                "max_tokens": 8,
                "temperature": 0,
            }
            answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=PATIENCE_S).json()
            want = expected(reference, question, SQUARE, max_new_tokens=8)
            assert answer["choices"][0]["message"]["content"] == want.text
            outside = body | {"messages": user_turn(question, "/etc/hostname")}
            refused = httpx.post(f"{base}/v1/chat/completions", json=outside, timeout=PATIENCE_S)
            assert refused.status_code == 400 and "outside" in refused.json()["error"]["message"]
            stored: list[int] = []
            deadline = time.monotonic() + PATIENCE_S
            full = len(want.prompt_token_ids) // 32 * 32
            while len(stored) < full:
                assert time.monotonic() < deadline, f"no events for the prompt: {stored}"
                for item in sub.recv(timeout_s=0.1):
                    if not isinstance(item, Notice):
                        for event in item[1].events:
                            if isinstance(event, BlockStored):
                                stored += event.token_ids
            assert stored[:full] == want.prompt_token_ids[:full]
    finally:
        proc.terminate()
        proc.wait(PATIENCE_S)


def test_serve_checks_its_flags_before_loading_anything():
    """Bad flags are one line and status 2, before torch, FastAPI or the model load."""
    code = textwrap.dedent(
        """
        import contextlib, io, sys
        from minirad.entrypoints.cli import main
        import socket
        err, out = io.StringIO(), io.StringIO()
        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            with contextlib.suppress(SystemExit):
                main(["serve", "--help"])
            assert main(["serve", "--num-kv-slots", "10", "--page-size", "4"]) == 2
            assert main(["serve", "--kv-events-block-size", "16"]) == 2
            assert main(["serve", "--model", "/no/such/model"]) == 2
            assert main(["serve", "--port", str(busy.getsockname()[1])]) == 2
        assert "(default: None)" not in out.getvalue()
        lines = err.getvalue().splitlines()
        assert [line.split(":")[:2] for line in lines] == [["minirad serve", " error"]] * 4, lines
        assert "cannot listen on 127.0.0.1:" in lines[-1], lines
        heavy = {"torch", "fastapi", "uvicorn"} & set(sys.modules)
        assert not heavy, heavy
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


# ------------------------------------------------------------------- a hierarchical cache
def test_usage_and_metrics_say_where_cached_tokens_came_from(reference):
    """With a host tier on a device pool that holds one conversation, the first question
    comes back from the host after the second pushed it off the device: usage and /metrics
    count those tokens under ``host`` (sglang #11668: yes, they are cached tokens)."""
    engine = LLMEngine.from_pretrained(shipped_model(), num_kv_slots=96, hicache_ratio=4)
    question = "What colour is the circle?"
    with serving(build_app(engine, NAME, model_path="tiny-path")) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        answers = []
        for image in (SQUARE, SHAPES, SQUARE):
            before = metrics(base)
            resp = client.chat.completions.create(
                model=NAME, messages=user_turn(question, str(image)), max_tokens=6, temperature=0
            )
            after = metrics(base)
            answers.append(resp)
            details = resp.usage.prompt_tokens_details.model_dump()
            by_source = details["cached_tokens_by_source"]
            assert sum(by_source.values()) == details["cached_tokens"]
            for source, n in by_source.items():
                name = f"sglang:cached_tokens_total{{{source}}}"
                assert after[name] - before.get(name, 0) == n
    first, last = answers[0], answers[-1]
    assert last.usage.prompt_tokens_details.model_dump()["cached_tokens_by_source"]["host"] > 0
    want = expected(reference, question, SQUARE, max_new_tokens=6)
    assert first.choices[0].message.content == last.choices[0].message.content == want.text
