"""The real SGLang (``make sglang``) as a peer: it starts on CPU from its lean venv, serves the
shipped LLaVA's text half, answers token-id requests with its cached tokens, and leaves nothing
running. Skipped without the venv, except under CI=true."""

from __future__ import annotations

import json

import pytest

from minirad.errors import InvalidArgumentError, PeerError
from minirad.peers.sglang_env import sglang_python
from minirad.peers.sglang_server import SGLangServer
from minirad.peers.text_model import save_text_model, text_model_dir


def test_text_model_is_the_llavas_language_model(tmp_path):
    from safetensors import safe_open

    from minirad.peers.text_model import DEFAULT_LLAVA_DIR

    out = save_text_model(DEFAULT_LLAVA_DIR, tmp_path / "llama")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    llava = safe_open(str(DEFAULT_LLAVA_DIR / "model.safetensors"), framework="numpy")
    llama = safe_open(str(out / "model.safetensors"), framework="numpy")
    assert sorted(llama.keys()) == sorted(
        k.removeprefix("language_model.") for k in llava.keys() if k.startswith("language_model.")
    )
    for key in llama.keys():
        assert (llama.get_tensor(key) == llava.get_tensor("language_model." + key)).all()


def test_text_model_refuses_a_folder_that_is_not_a_llava(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(InvalidArgumentError, match="not a LLaVA"):
        save_text_model(tmp_path, tmp_path / "out")


def test_missing_venv_says_how_to_build_it(tmp_path):
    with pytest.raises(PeerError, match="tools/make_sglang_venv.sh"):
        sglang_python(tmp_path / "no-venv")


def test_bad_arguments_are_refused_before_anything_starts(tmp_path):
    model = text_model_dir()
    with pytest.raises(InvalidArgumentError, match="config.json"):
        SGLangServer(tmp_path, python="python3")
    with pytest.raises(InvalidArgumentError, match="eviction_policy"):
        SGLangServer(model, eviction_policy="random", python="python3")
    with pytest.raises(InvalidArgumentError, match="page_size"):
        SGLangServer(model, page_size=0, python="python3")


def test_serves_token_ids_and_reports_cached_tokens(sglang_python):
    prompt = list(range(10, 40))
    with SGLangServer(text_model_dir(), python=sglang_python) as server:
        first = server.generate(prompt, max_new_tokens=4)
        again = server.generate(prompt + [7, 8], max_new_tokens=4)
        assert server.flush_cache()
        flushed = server.generate(prompt, max_new_tokens=4)
        pid = server._proc.pid
    assert first["prompt_tokens"] == 30 and len(first["output_ids"]) == 4
    assert first["cached_tokens"] == 0
    assert again["cached_tokens"] >= len(prompt)  # the whole first prompt was cached
    assert flushed["cached_tokens"] == 0 and flushed["output_ids"] == first["output_ids"]
    with pytest.raises(ProcessLookupError):  # the server and its children are gone
        import os

        os.killpg(pid, 0)
