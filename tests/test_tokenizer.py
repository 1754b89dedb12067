"""The shipped tokenizer (data/tokenizer/) loads offline, round-trips text, and is reproducible."""

from functools import cache

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minirad.models.tokenizer import (
    DEFAULT_TOKENIZER_DIR,
    DEFAULT_VOCAB_SIZE,
    EOS_TOKEN,
    IM_END,
    IM_START,
    IMAGE_TOKEN,
    SPECIAL_TOKENS,
    load_tokenizer,
    read_corpus,
    train_tokenizer,
)

shipped_tokenizer = cache(load_tokenizer)


@pytest.fixture
def tok():
    return shipped_tokenizer()


def test_loads_offline_from_the_repository(tok, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert load_tokenizer(DEFAULT_TOKENIZER_DIR).get_vocab() == tok.get_vocab()


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m minirad.models.tokenizer"):
        load_tokenizer(tmp_path)


def test_vocab_size(tok):
    assert len(tok) == tok.vocab_size == DEFAULT_VOCAB_SIZE


@pytest.mark.parametrize(
    "text",
    [
        "",
        "You are a helpful assistant.",
        "Hello! How many shapes are there?",
        "  two leading spaces, a\ttab,\r\na CRLF and trailing spaces  ",
        "\n\n\n",
        "héllo wörld, naïve café, Straße",
        "日本語のテキスト 🙂👍🏽 ✓ ∑ x² — “quotes”",
        "e\u0301 (decomposed) vs \u00e9 (composed)",  # no normalizer: both kept as they are
        f"{IM_START}user\n{IMAGE_TOKEN}\nWhat colour is the star?{IM_END}\n",
        f"text{EOS_TOKEN}{EOS_TOKEN} more",
        "<|im_start",
        "<imag",
        "< image >",  # near misses are ordinary text
    ],
)
def test_round_trip_exact(tok, text):
    assert tok.decode(tok.encode(text)) == text


@given(st.text(max_size=200))
def test_round_trip_any_unicode(text):
    tok = shipped_tokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_encode_adds_no_special_tokens(tok):
    assert tok.encode("Hi!") == tok.encode("Hi!", add_special_tokens=False)


@pytest.mark.parametrize("token", SPECIAL_TOKENS)
def test_special_tokens_are_single_ids(tok, token):
    ids = tok.encode(f"a {token} b")
    assert ids.count(tok.convert_tokens_to_ids(token)) == 1
    assert tok.encode(token) == [tok.convert_tokens_to_ids(token)]


def test_special_token_ids_and_roles(tok):
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tok.eos_token == tok.pad_token == EOS_TOKEN
    assert tok.image_token == IMAGE_TOKEN and tok.image_token_id == 3
    assert set(SPECIAL_TOKENS) <= set(tok.all_special_tokens)
    assert tok.decode(tok.encode(f"{IM_START}hi{IM_END}"), skip_special_tokens=True) == "hi"


@pytest.mark.parametrize(
    "word",
    [
        "Hello",
        "You",
        " assistant",
        " helpful",
        " circle",
        " square",
        " triangle",
        " star",
        " red",
        " green",
        " blue",
        " yellow",
        " orange",
        " purple",
        " white",
        " black",
        " left",
        " right",
        " above",
        " below",
        " small",
        " large",
        " shapes",
        " colour",
        "yes",
        "no",
        "user",
        "assistant",
        "system",
        " image",
        " story",
        " problem",
    ],
)
def test_common_words_are_single_tokens(tok, word):
    assert len(tok.encode(word)) == 1, tok.tokenize(word)


def test_chat_template_renders_chatml(tok):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": f"{IMAGE_TOKEN}\nHow many shapes are there?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<image>\nHow many shapes are there?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tok.apply_chat_template(messages, tokenize=False)
    assert without == text.removesuffix("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert ids["input_ids"] == tok.encode(text)


def test_retraining_reproduces_the_committed_tokenizer(tmp_path):
    retrained = train_tokenizer(read_corpus())
    retrained.save_pretrained(str(tmp_path))
    committed = (DEFAULT_TOKENIZER_DIR / "tokenizer.json").read_text()
    assert (tmp_path / "tokenizer.json").read_text() == committed, (
        "data/tokenizer/tokenizer.json is stale: run `python -m minirad.models.tokenizer`"
    )


def test_too_small_corpus_is_rejected():
    with pytest.raises(ValueError, match="corpus too small"):
        train_tokenizer(["tiny corpus"], vocab_size=400)
