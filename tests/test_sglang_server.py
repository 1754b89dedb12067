"""The real SGLang (``make sglang``) as a peer, before it starts: the LLaVA's text half it serves,
and the arguments and venv it needs. The live server (token-id requests, cached tokens, a flush,
nothing left running) is tested on tests/test_sglang_events.py's server, to start one less."""

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


def test_constructor_refuses_bad_types(tmp_path):
    model = text_model_dir()
    for kwargs, match in (
        ({"port": "abc"}, "port"),
        ({"port": 70000}, "port"),
        ({"eviction_policy_config": {1, 2}}, "eviction_policy_config"),
        ({"eviction_policy_config": "threshold=64"}, "eviction_policy_config"),
        ({"extra_args": "--foo"}, "extra_args"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            SGLangServer(model, python="python3", **kwargs)
    with pytest.raises(InvalidArgumentError, match="model_dir"):
        SGLangServer(None, python="python3")


def test_generate_refuses_ids_outside_the_vocabulary_before_sending():
    """SGLang 0.5.23 dies on an id outside its embedding table: the ids are checked here, so
    these raise without a server (none is started)."""
    server = SGLangServer(text_model_dir(), python="python3")
    vocab = server.vocab_size
    assert vocab == json.loads((text_model_dir() / "config.json").read_text())["vocab_size"]
    for ids in ([1, -5, 3], [1, vocab, 3], [1.7, 2.2], ["1", "2"], [], None, "abc", [True]):
        with pytest.raises(InvalidArgumentError, match="input_ids"):
            server.generate(ids)
    with pytest.raises(InvalidArgumentError, match="max_new_tokens"):
        server.generate([1, 2], max_new_tokens=0)
