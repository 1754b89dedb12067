"""A grammar's state machine over tokens (``viz.token_fsm``), on the shipped tokenizer.

The reference is the language itself, as plain strings: a choice grammar's states are the
prefixes of its choices, its end states the choices, and every token the walk follows must
extend the text towards some choice (the grammar's mask, read here independently of the walk).
"""

from __future__ import annotations

import functools

import pytest
from transformers import AutoTokenizer

from minirad.engine.grammar import GrammarCompiler, allocate_token_bitmask
from minirad.engine.sampling_params import SamplingParams
from minirad.errors import InvalidArgumentError
from minirad.models import DEFAULT_MODEL_DIR
from viz.token_fsm import allowed_token_ids, explore_grammar, token_fsm_graph

CHOICES = ["red", "green", "blue"]
STOP = [2]


@functools.cache
def compiler() -> GrammarCompiler:
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)
    return GrammarCompiler(tokenizer, len(tokenizer))


def test_allowed_token_ids_reads_bits_little_endian_with_the_sign_bit():
    row = [-(2**31) | 1, 4]  # word 0: bits 0 and 31; word 1: bit 2
    assert allowed_token_ids(row, 64) == [0, 31, 34]
    assert allowed_token_ids(row, 32) == [0, 31]


def test_a_choice_grammar_has_the_prefixes_of_its_choices_as_states():
    c = compiler()
    fsm = explore_grammar(c, SamplingParams(choice=CHOICES), STOP)
    assert fsm.complete and fsm.texts[0] == ""
    assert all(any(w.startswith(t) for w in CHOICES) for t in fsm.texts)
    ends = {fsm.texts[s] for s, t, to in fsm.edges if to == -1}
    assert ends == set(CHOICES)  # the stop token only after a whole word
    decode = c.tokenizer.decode
    for s, t, to in fsm.edges:
        if to != -1:
            assert fsm.texts[to] == fsm.texts[s] + decode([t])
    # Each state's arrows are exactly its mask, replayed independently along its path.
    for state, path in enumerate(fsm.paths):
        grammar = c.compile(SamplingParams(choice=CHOICES), STOP)
        grammar.accept_tokens(path)
        bitmask = allocate_token_bitmask(1, c.vocab_size)
        grammar.fill_bitmask(bitmask, 0)
        row = bitmask[0].tolist()
        mask = [t for t in range(c.vocab_size) if (row[t // 32] >> (t % 32)) & 1]
        assert fsm.allowed(state) == mask
    assert set(fsm.forced_states) == {s for s in range(len(fsm.texts)) if len(fsm.allowed(s)) == 1}
    assert fsm.texts.index("red") in fsm.forced_states  # only the stop token is left


def test_the_walk_stops_at_max_states_and_says_so():
    fsm = explore_grammar(compiler(), SamplingParams(choice=CHOICES), STOP, max_states=3)
    assert len(fsm.texts) == 3 and not fsm.complete
    with pytest.raises(InvalidArgumentError):
        explore_grammar(compiler(), SamplingParams(choice=CHOICES), STOP, max_states=0)


def test_the_drawing_has_a_node_per_state_and_bold_canonical_arrows():
    c = compiler()
    fsm = explore_grammar(c, SamplingParams(choice=CHOICES), STOP)
    dot = token_fsm_graph(fsm, c.tokenizer, canonical=CHOICES).source
    for i in range(len(fsm.texts)):
        assert f"\t{i} [" in dot
    assert dot.count("penwidth") == sum(
        len(c.tokenizer.encode(w, add_special_tokens=False)) for w in CHOICES
    )
    assert "doublecircle" in dot and dot.count("style=dashed") == len(CHOICES)
