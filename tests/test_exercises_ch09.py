"""Chapter 09 exercises, held to the shared contract of ``exercise_contract.py``: the
oracle's answer passes, near misses fail, typical mistakes get their reason, the stub is
"not attempted", and the printed solution computes the answer.

``minirad.exercises.ch09`` computes its answers with ``minirad.engine.grammar``. The oracles use no
minirad class: q1 masks bit by bit in a Python loop; q2 counts the schema's choice points by
hand; q3 reads the tokenizer's vocabulary as strings (a token is allowed where it starts a
choice); q4 counts spellings by dynamic programming over the vocabulary, and the mask's
spellings with llguidance's own matcher, built here from the schema without ``minirad``.
"""

from __future__ import annotations

import functools

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from exercise_contract import ExerciseContract, near_misses
from transformers import AutoTokenizer

from minirad.course.scenes import SHAPES_JSON_SCHEMA
from minirad.exercises import ch09
from minirad.models import DEFAULT_MODEL_DIR


@functools.cache
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)


def loop_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The oracle of q1: one token at a time, in place."""
    words = bitmask.tolist()
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not (words[b][t // 32] >> (t % 32)) & 1:
                logits[b, t] = float("-inf")


# q1's typical mistakes, as functions a learner could write.
def big_endian(logits, bitmask):
    bits = 31 - torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, : logits.shape[1]]
    logits.masked_fill_(allowed == 0, float("-inf"))


def inverted(logits, bitmask):
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, : logits.shape[1]]
    logits.masked_fill_(allowed == 1, float("-inf"))


def returns_a_copy(logits, bitmask):
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, : logits.shape[1]]
    return logits.masked_fill(allowed == 0, float("-inf"))


def fills_zero(logits, bitmask):
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, : logits.shape[1]]
    logits.masked_fill_(allowed == 0, 0.0)


def drops_the_sign_bit(logits, bitmask):
    bits = torch.arange(32, dtype=torch.int32)
    words = bitmask & 0x7FFFFFFF
    allowed = ((words.unsqueeze(-1) >> bits) & 1).flatten(1)[:, : logits.shape[1]]
    logits.masked_fill_(allowed == 0, float("-inf"))


def ignores_the_vocabulary_size(logits, bitmask):
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)
    logits.masked_fill_(allowed == 0, float("-inf"))


def does_nothing(logits, bitmask):
    return None


BUGGY = [
    big_endian,
    inverted,
    returns_a_copy,
    fills_zero,
    drops_the_sign_bit,
    ignores_the_vocabulary_size,
    does_nothing,
]


def oracle_q1():
    return loop_mask


def shapes_of(text: str) -> int:
    return text.count('"colour"')


def oracle_q2() -> int:
    """Steps = tokens the model chooses: per shape its colour and its shape (the values' first
    letters differ: one token decides each), a separator after each shape but the last one of
    a full list (maxItems 3: then "]" is forced), and the stop token."""
    k = shapes_of(ch09.Q2_ANSWER_TEXT)
    max_items = SHAPES_JSON_SCHEMA["properties"]["shapes"]["maxItems"]
    separators = k if k < max_items else k - 1
    return 2 * k + separators + 1


def vocabulary() -> dict[int, str]:
    tok = tokenizer()
    special = set(tok.all_special_ids)
    return {t: tok.decode([t]) for t in range(len(tok)) if t not in special}


def oracle_q3() -> set[int]:
    return {
        t for t, s in vocabulary().items() if s and any(c.startswith(s) for c in ch09.Q3_CHOICES)
    }


def llguidance_mask_spellings() -> int:
    """The spellings of ``Q4_RUN`` that llguidance's own matcher allows after ``Q4_PREFIX``."""
    tok = tokenizer()
    ll_tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[2])
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SHAPES_JSON_SCHEMA,
        defaults={"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False},
    )
    start = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    assert start.consume_tokens(tok.encode(ch09.Q4_PREFIX, add_special_tokens=False))
    texts, run = vocabulary(), ch09.Q4_RUN

    def count(matcher, i: int) -> int:
        if i == len(run):
            return 1
        # The mask, not validate_tokens: llguidance's mask is narrower inside forced text.
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)
        total = 0
        for t, s in texts.items():
            if s and run.startswith(s, i) and (int(words[t // 32]) >> (t % 32)) & 1:
                child = matcher.deep_copy()
                child.consume_token(t)
                total += count(child, i + len(s))
        return total

    return count(start, 0)


def vocabulary_spellings() -> int:
    texts, run = vocabulary(), ch09.Q4_RUN

    @functools.cache
    def ways(i: int) -> int:
        if i == len(run):
            return 1
        return sum(ways(i + len(s)) for s in texts.values() if s and run.startswith(s, i))

    return ways(0)


def oracle_q4() -> tuple[int, int]:
    return vocabulary_spellings(), llguidance_mask_spellings()


CASES = [
    (ch09.q1, oracle_q1, ch09.Q1_SOLUTION),
    (ch09.q2, oracle_q2, ch09.Q2_SOLUTION),
    (ch09.q3, oracle_q3, ch09.Q3_SOLUTION),
    (ch09.q4, oracle_q4, ch09.Q4_SOLUTION),
]


@functools.cache
def diagnosed() -> list:
    tok = tokenizer()
    first = {tok.encode(c, add_special_tokens=False)[0] for c in ch09.Q3_CHOICES}
    tokens = len(tok.encode(ch09.Q2_ANSWER_TEXT, add_special_tokens=False))
    spell, mask = oracle_q4()
    canonical = len(tok.encode(ch09.Q4_RUN, add_special_tokens=False))
    return [
        (ch09.q1, big_endian, "lowest bit"),
        (ch09.q1, inverted, "a set bit allows"),
        (ch09.q1, returns_a_copy, "in place"),
        (ch09.q1, fills_zero, "-inf"),
        (ch09.q1, drops_the_sign_bit, "sign bit"),
        (ch09.q1, ignores_the_vocabulary_size, "raised"),
        (ch09.q1, does_nothing, "unchanged"),
        (ch09.q1, 3, "expected a function apply_mask(logits, bitmask), got int 3"),
        (ch09.q2, tokens + 1, "without jump-forward"),
        (ch09.q2, oracle_q2() - 1, "stop token"),
        (ch09.q2, oracle_q2() + 1, "prefill"),
        (ch09.q2, 57, "forced tokens"),
        (ch09.q2, 3, "not it"),
        (ch09.q3, first, "first tokens"),
        (ch09.q3, oracle_q3() | {2}, "stop token"),
        (ch09.q3, oracle_q3() | {5}, "does not start any choice"),
        (ch09.q3, oracle_q3() - {min(oracle_q3())}, "also allows"),
        (ch09.q3, 70, "expected a set of token ids"),
        (ch09.q4, (mask, spell), "the first number"),
        (ch09.q4, (canonical, mask), "one spelling"),
        (ch09.q4, (spell - 1, mask), "dynamic program"),
        (ch09.q4, (spell, spell), "replay the run"),
    ]


def wrong_answers(right):
    if callable(right):
        return [*BUGGY, None, "x", 3]
    return near_misses(right)


class TestExerciseContract(ExerciseContract):
    chapter = ch09
    cases = CASES
    diagnosed = diagnosed
    wrong_answers = staticmethod(wrong_answers)

    def test_printed_solution_computes_the_answer(self, exercise, oracle, solution, capsys):
        if exercise is not ch09.q1:
            super().test_printed_solution_computes_the_answer(exercise, oracle, solution, capsys)
            return
        # A function is compared by what it does: the oracle's loop on the checker's cases.
        exercise.solution()
        assert capsys.readouterr().out == f"[{exercise.name}] solution:\n{solution}\n"
        answer = self.run_solution(solution)
        assert exercise.is_correct(answer)
        gen = torch.Generator().manual_seed(1)
        for vocab in (1, 31, 32, 33, 100):
            logits = torch.randn(3, vocab, generator=gen)
            words = torch.randint(-(2**31), 2**31, (3, -(-vocab // 32)), generator=gen)
            bitmask = words.to(torch.int32)
            mine, expected = logits.clone(), logits.clone()
            answer(mine, bitmask)
            oracle()(expected, bitmask)
            assert torch.equal(mine, expected)


def test_q2_the_steps_do_not_depend_on_the_model():
    """The shipped model's own JSON answer, served alone: one engine step per token it chose,
    as counted by hand for its number of shapes, and the rest forced."""
    from minirad.course.scenes import JSON_PROMPT
    from minirad.engine import GenerateRequest, LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(DEFAULT_MODEL_DIR)
    content = [{"type": "image"}, {"type": "text", "text": JSON_PROMPT}]
    prompt = engine.processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    params = SamplingParams(max_new_tokens=120, json_schema=SHAPES_JSON_SCHEMA)
    image = DEFAULT_MODEL_DIR.parents[1] / "images" / "green_triangle_above_yellow_circle.png"
    [out] = engine.generate([GenerateRequest(prompt, [image], params)])
    k = shapes_of(out.text)
    max_items = SHAPES_JSON_SCHEMA["properties"]["shapes"]["maxItems"]
    assert engine.stats.num_steps == 2 * k + (k if k < max_items else k - 1) + 1
    assert engine.stats.num_steps == len(out.token_ids) - out.stats.forced_tokens


def test_q4_the_two_counts_differ():
    """The vocabulary could spell the run several ways; the mask allows fewer."""
    spell, mask = oracle_q4()
    assert spell > mask >= 1


@pytest.mark.parametrize("kind", [list, tuple, frozenset])
def test_q3_accepts_any_collection(kind):
    assert ch09.q3.is_correct(kind(sorted(oracle_q3())))
