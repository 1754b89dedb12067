"""What a refusal tells the client: the field it is about (``param``, as the client wrote it),
a message that names what was sent, and nothing that leaks the validator's internals.

Found by a new user's hostile pass over ``minirad serve``; each case sends what they sent.
"""

from __future__ import annotations

import argparse

import httpx
import pytest
from servers import serving

from minirad.engine import LLMEngine
from minirad.entrypoints.argtypes import port
from minirad.entrypoints.openai.api_server import build_app
from minirad.models import DEFAULT_MODEL_DIR

NAME = "tiny"


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    if not DEFAULT_MODEL_DIR.is_dir():
        pytest.skip("the shipped model is not there")
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL_DIR)
    media = tmp_path_factory.mktemp("media")
    with serving(build_app(engine, NAME, allowed_local_media_path=media), "critical") as base:
        yield base


def chat(**fields) -> dict:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    return body | fields


def refusal(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": None, "max_completion_tokens": -5}, "max_completion_tokens"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": True}, "logprobs"),
        ({"stop": 5}, "stop"),
        ({"guided_json": 5}, "guided_json"),
    ],
)
def test_a_refusal_names_the_field_as_the_client_wrote_it(url, fields, param):
    error = refusal(httpx.post(url + "/v1/chat/completions", json=chat(**fields), timeout=30))
    assert error["param"] == param
    assert param in error["message"]
    assert "[" not in error["param"]  # no pydantic union member names (str, dict[any,any])


def test_a_bad_message_names_its_place_without_type_names(url):
    body = chat(messages=[{"role": "user", "content": 5}])
    error = refusal(httpx.post(url + "/v1/chat/completions", json=body, timeout=30))
    assert error["param"] == "messages.0.content"
    assert "union" not in error["message"] and ".str:" not in error["message"]


def test_a_network_url_of_any_scheme_is_refused_as_one(url):
    for image in ("ftp://x/y.png", "s3://bucket/y.png", "HTTPS://x/y.png"):
        content = [{"type": "image_url", "image_url": {"url": image}}]
        body = chat(messages=[{"role": "user", "content": content}])
        error = refusal(httpx.post(url + "/v1/chat/completions", json=body, timeout=30))
        assert "network" in error["message"] and image.split("://")[0] in error["message"]


def test_a_huge_model_name_is_not_echoed_whole(url):
    name = "m" * 1_000_000
    resp = httpx.post(url + "/v1/chat/completions", json=chat(model=name), timeout=30)
    error = refusal(resp, 404)
    assert error["param"] == "model" and len(error["message"]) < 400


def test_a_body_that_is_not_utf8_is_called_so(url):
    raw = b'{"messages": [{"role": "user", "content": "\xff\xfe hi"}]}'
    resp = httpx.post(
        url + "/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert "UTF-8" in refusal(resp)["message"]


@pytest.mark.parametrize(
    "fields", [{"guided_choice": ["<|im_end|>"]}, {"guided_regex": "<\\|im_start\\|>"}]
)
def test_a_grammar_that_forces_a_special_tokens_name_says_so(url, fields):
    body = chat(**fields, max_tokens=20)
    error = refusal(httpx.post(url + "/v1/chat/completions", json=body, timeout=30))
    assert "special token" in error["message"] and "too complex" not in error["message"]


@pytest.mark.parametrize("text", ["0", "65536", "99999", "-1", "x"])
def test_a_port_out_of_range_is_an_argument_error(text):
    with pytest.raises(argparse.ArgumentTypeError):
        port(text)
    assert port("65535") == 65535 and port("1") == 1


def test_a_grammar_too_large_to_compile_says_so_not_the_backends_settings(url):
    body = chat(guided_regex="(a|b)*" * 1000)
    error = refusal(httpx.post(url + "/v1/chat/completions", json=body, timeout=60))
    assert "too large to compile" in error["message"] and "limits." not in error["message"]
