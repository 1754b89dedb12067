"""Exercises of chapter 09 (structured output: token bitmasks, jump-forward, retokenisation).

The answers are computed here with the real ``minirad`` code on the shipped model's tokenizer:
:func:`minirad.engine.grammar.apply_token_bitmask` for q1, the JSON-schema grammar of
:data:`minirad.course.scenes.SHAPES_JSON_SCHEMA` walked with jump-forward for q2 (a request samples
where its grammar leaves a choice and appends what the grammar forces, as
:meth:`minirad.engine.request.Request.jump_forward` does), a choice grammar's bitmask for q3,
and the grammar's masks along a forced run for q4. No check needs the model's weights: what
the questions ask depends on the grammar and the tokenizer only. Every ``Qn_SOLUTION`` is
runnable code that sets ``answer``; the tests run it and check it with ``qn``, and compute the
answers another way (a bit-by-bit loop, the schema's choice points counted by hand, the
tokenizer's vocabulary read as plain strings).

Usage in the notebook::

    from minirad.exercises.ch09 import q1
    answer = ...
    q1.check(answer)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from minirad.course.scenes import COLOURS, SHAPES_JSON_SCHEMA
from minirad.engine.grammar import (
    Grammar,
    GrammarCompiler,
    allocate_token_bitmask,
    apply_token_bitmask,
)
from minirad.engine.sampling_params import SamplingParams
from minirad.exercises import Exercise, is_int, is_int_list, wrong_type
from minirad.models import DEFAULT_MODEL_DIR

__all__ = [
    "Q2_ANSWER_TEXT",
    "Q3_CHOICES",
    "Q4_PREFIX",
    "Q4_RUN",
    "STOP_TOKEN_IDS",
    "q1",
    "q2",
    "q3",
    "q4",
]

STOP_TOKEN_IDS = (2,)  # <|im_end|>: the course model's stop token, the grammars' end
# q2: the JSON answer for green_triangle_above_yellow_circle.png (two shapes).
Q2_ANSWER_TEXT = (
    '{"shapes": [{"colour": "green", "shape": "triangle"}, '
    '{"colour": "yellow", "shape": "circle"}]}'
)
# q3: a choice grammar over the shape names.
Q3_CHOICES = ("circle", "square", "triangle")
# q4: the forced run after the first colour, and the text before it.
Q4_PREFIX = '{"shapes": [{"colour": "red'
Q4_RUN = '", "shape": "'


@functools.cache
def _tokenizer() -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)


@functools.cache
def _compiler() -> GrammarCompiler:
    tokenizer = _tokenizer()
    return GrammarCompiler(tokenizer, len(tokenizer))


def _vocab_size() -> int:
    return _compiler().vocab_size


def _allowed(grammar: Grammar) -> list[int]:
    bitmask = allocate_token_bitmask(1, _vocab_size())
    grammar.fill_bitmask(bitmask, 0)
    row = bitmask[0].tolist()
    return [t for t in range(_vocab_size()) if (row[t // 32] >> (t % 32)) & 1]


def _grammar(params: SamplingParams, prefix_ids: list[int] = ()) -> Grammar:
    grammar = _compiler().compile(params, STOP_TOKEN_IDS)
    grammar.accept_tokens(prefix_ids)
    return grammar


# ----------------------------------------------------------------------------------------- q1
def _cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(what, logits, bitmask)``: a real grammar's mask (and an all-allowed row), words with
    the sign bit set, and a vocabulary that is not a multiple of 32."""
    gen = torch.Generator().manual_seed(9)
    vocab = _vocab_size()
    grammar_mask = allocate_token_bitmask(2, vocab)
    _grammar(SamplingParams(choice=list(COLOURS))).fill_bitmask(grammar_mask, 0)
    sign = torch.tensor([[-(2**31), -(2**31) | 1]], dtype=torch.int32)  # tokens 31; 32 and 63
    tail = torch.randint(-(2**31), 2**31, (3, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    return [
        (
            "a grammar's mask over the whole vocabulary",
            torch.randn(2, vocab, generator=gen),
            grammar_mask,
        ),
        ("words with bit 31 (the sign bit) set", torch.randn(1, 64, generator=gen), sign),
        (
            "70 tokens in 3 words (the last word only partly used)",
            torch.randn(3, 70, generator=gen),
            tail,
        ),
    ]


def _masked(
    fn: Callable, logits: torch.Tensor, bitmask: torch.Tensor
) -> tuple[torch.Tensor, object]:
    mine = logits.clone()
    returned = fn(mine, bitmask.clone())
    return mine, returned


def _big_endian(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    bits = 31 - torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, : logits.shape[1]]
    logits.masked_fill_(allowed == 0, float("-inf"))


def _check_q1(answer: object) -> str | None:
    if not callable(answer):
        return wrong_type("a function apply_mask(logits, bitmask)", answer)
    for what, logits, bitmask in _cases():
        expected = logits.clone()
        apply_token_bitmask(expected, bitmask)
        try:
            mine, returned = _masked(answer, logits, bitmask)
        except Exception as e:  # a learner's function may fail on one case only
            return f"on {what}, apply_mask raised {type(e).__name__}: {e}"
        if torch.equal(mine, expected):
            continue
        if isinstance(returned, torch.Tensor) and torch.equal(returned, expected):
            return (
                "the engine masks its logits in place and reads no return value: change the "
                "logits tensor itself (masked_fill_, or an indexed assignment)"
            )
        if torch.equal(mine, logits):
            return f"on {what}, the logits came back unchanged: nothing was masked"
        allowed = expected != float("-inf")
        if torch.equal(torch.isinf(mine) & (mine < 0), allowed):
            return "a set bit allows its token; you masked the allowed ones and kept the others"
        if torch.equal(mine[allowed], expected[allowed]) and not torch.isinf(mine[~allowed]).all():
            return (
                "forbidden tokens must get -inf (probability 0 after softmax, even at a high "
                "temperature), not a finite value"
            )
        big = logits.clone()
        _big_endian(big, bitmask)
        if torch.equal(mine, big):
            return "bit k of word w is token 32 * w + k: the lowest bit is the first token"
        unsigned = logits.clone()
        apply_token_bitmask(unsigned, bitmask & 0x7FFFFFFF)
        if what.startswith("words with bit 31") or torch.equal(mine, unsigned):
            return (
                "bit 31 of an int32 word is its sign bit: the word -2147483648 allows token 31 "
                "(shift the signed word, then & 1)"
            )
        if what.startswith("70 tokens"):
            return "the last word has bits past the vocabulary: mask only the first V tokens"
        return f"on {what}, the masked logits differ from the library's"
    return None


Q1_SOLUTION = """\
import torch

def apply_mask(logits, bitmask):
    # Word w, bit k -> token 32 * w + k; a set bit allows the token.
    bits = torch.arange(32, dtype=torch.int32)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1  # [B, W, 32]; >> keeps the sign, & 1 the bit
    allowed = allowed.flatten(1)[:, : logits.shape[1]]  # [B, 32 W] -> [B, V]
    logits.masked_fill_(allowed == 0, float("-inf"))  # in place, like the engine's

answer = apply_mask"""

q1 = Exercise(
    "q1 apply a token bitmask",
    _check_q1,
    "Expand each int32 word into its 32 bits (shift right by 0..31, then & 1), flatten the "
    "bits of a row in word order, keep the first V, and fill -inf where the bit is 0.",
    Q1_SOLUTION,
)


# ----------------------------------------------------------------------------------------- q2
def _written_with_jump_forward(text: str) -> tuple[int, int]:
    """``(sampled, forced)`` tokens when a request writes ``text`` then its stop token under
    the shapes schema with jump-forward: what the grammar forces is appended, and elsewhere the
    model writes the longest allowed token that continues ``text``."""
    tokenizer = _tokenizer()
    grammar = _grammar(SamplingParams(json_schema=SHAPES_JSON_SCHEMA))
    written, sampled, forced = "", 0, 0
    while not grammar.stopped:
        run = grammar.jump_forward_tokens()
        grammar.accept_tokens(run)
        forced += len(run)
        written += tokenizer.decode(run)
        allowed = _allowed(grammar)
        if written == text:
            token = next(t for t in allowed if t in STOP_TOKEN_IDS)
        else:
            fits = [t for t in allowed if text.startswith(tokenizer.decode([t]), len(written))]
            token = max(fits, key=lambda t: len(tokenizer.decode([t])))
            written += tokenizer.decode([token])
        grammar.accept_token(token)
        sampled += 1
    return sampled, forced


def _check_q2(answer: object) -> str | None:
    if not is_int(answer):
        return wrong_type("one int (engine steps)", answer)
    sampled, forced = _written_with_jump_forward(Q2_ANSWER_TEXT)
    if answer == sampled:
        return None
    tokens = len(_tokenizer().encode(Q2_ANSWER_TEXT, add_special_tokens=False))
    if answer == tokens + 1:
        return "that is the steps without jump-forward: one per token, the stop token included"
    if answer == sampled - 1:
        return "the stop token <|im_end|> is sampled too: the mask allows only it, but it is a step"
    if answer in (sampled + 1, sampled + 2):
        return (
            "the first forced run joins the prompt's prefill, and the prefill step samples the "
            "first colour: no step of its own for either"
        )
    if answer == forced:
        return "that counts the forced tokens; count the tokens the model still has to choose"
    return (
        f"{answer} steps is not it: one step per token the grammar leaves to the model (where "
        "does it offer a choice?), and none for the forced runs"
    )


Q2_SOLUTION = """\
# One step per sampled token; forced runs ride along in the next step's prefill chunk.
# The grammar leaves a choice at: each colour and each shape (their first letters differ, so
# one token decides each value, and the rest of the word is forced), the separator after each
# object (", " for another one, or "]" to end: after the third only "]" is possible, forced),
# and the stop token at the end (the only token allowed, but sampled).
shapes = 2  # fewer than maxItems (3): after each object the model chooses ", " or "]"
answer = 2 * shapes + shapes + 1  # 4 values, 2 separators, the stop: 7 steps"""

q2 = Exercise(
    "q2 the steps of a JSON answer",
    _check_q2,
    "The engine samples one token per step. Walk the schema: where does the grammar allow more "
    "than one token? Everything else is forced and costs no step.",
    Q2_SOLUTION,
)


# ----------------------------------------------------------------------------------------- q3
@functools.cache
def _q3_allowed() -> frozenset[int]:
    return frozenset(_allowed(_grammar(SamplingParams(choice=list(Q3_CHOICES)))))


def _check_q3(answer: object) -> str | None:
    if not isinstance(answer, set | frozenset | list | tuple) or not is_int_list(list(answer)):
        return wrong_type("a set of token ids, e.g. {70, 86}", answer)
    got, expected = set(answer), set(_q3_allowed())
    if got == expected:
        return None
    tokenizer = _tokenizer()
    first = {tokenizer.encode(c, add_special_tokens=False)[0] for c in Q3_CHOICES}
    if got == first:
        return (
            "those are the tokenizer's first tokens; the mask allows every token that starts "
            "some choice (a longer token is allowed where the tokenizer would split)"
        )
    if got & set(STOP_TOKEN_IDS):
        return "the empty text is no choice: the stop token is allowed only once a word is complete"
    if extra := sorted(got - expected):
        return f"token {extra[0]} ({tokenizer.decode([extra[0]])!r}) does not start any choice"
    missing = sorted(expected - got)[0]
    return f"the mask also allows token {missing} ({tokenizer.decode([missing])!r})"


Q3_SOLUTION = """\
from minirad.engine.grammar import GrammarCompiler, allocate_token_bitmask
from minirad.models import DEFAULT_MODEL_DIR
from minirad.engine.sampling_params import SamplingParams
from transformers import AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
compiler = GrammarCompiler(tokenizer, len(tokenizer))
grammar = compiler.compile(SamplingParams(choice=["circle", "square", "triangle"]), [2])
bitmask = allocate_token_bitmask(1, len(tokenizer))
grammar.fill_bitmask(bitmask, 0)
row = bitmask[0].tolist()
answer = {t for t in range(len(tokenizer)) if (row[t // 32] >> (t % 32)) & 1}
# {70, 86, 87, 653}: 'c', 's', 't' (the tokenizer's first tokens) and 'ci', a token that starts
# "circle" although the tokenizer splits it 'c' 'ircle'."""

q3 = Exercise(
    "q3 the mask of a choice",
    _check_q3,
    "Compile SamplingParams(choice=[...]) with stop token 2, fill a one-row bitmask and read "
    "the set bits (bit t % 32 of word t // 32).",
    Q3_SOLUTION,
)


# ----------------------------------------------------------------------------------------- q4
@functools.cache
def _q4_expected() -> tuple[int, int]:
    """``(spellings of Q4_RUN in the vocabulary, spellings the grammar's masks allow)``."""
    tokenizer = _tokenizer()
    texts = {t: tokenizer.decode([t]) for t in range(len(tokenizer))}
    special = set(tokenizer.all_special_ids)
    prefix = tokenizer.encode(Q4_PREFIX, add_special_tokens=False)
    params = SamplingParams(json_schema=SHAPES_JSON_SCHEMA)

    @functools.cache
    def spellings(i: int) -> int:
        if i == len(Q4_RUN):
            return 1
        fits = (t for t, s in texts.items() if s and t not in special and Q4_RUN.startswith(s, i))
        return sum(spellings(i + len(texts[t])) for t in fits)

    def allowed(path: tuple[int, ...], i: int) -> int:
        if i == len(Q4_RUN):
            return 1
        grammar = _grammar(params, [*prefix, *path])
        fits = [t for t in _allowed(grammar) if texts[t] and Q4_RUN.startswith(texts[t], i)]
        return sum(allowed((*path, t), i + len(texts[t])) for t in fits)

    return spellings(0), allowed((), 0)


def _check_q4(answer: object) -> str | None:
    if not is_int_list(answer) or len(answer) != 2:
        return wrong_type("two ints (vocabulary spellings, mask spellings), e.g. (5, 2)", answer)
    got, expected = tuple(answer), _q4_expected()
    if got == expected:
        return None
    canonical = len(_tokenizer().encode(Q4_RUN, add_special_tokens=False))
    if got == expected[::-1]:
        return "the first number is the vocabulary's spellings, the second the mask's"
    if canonical in got:
        return f"{canonical} is the number of tokens in one spelling; count the spellings"
    if got[0] != expected[0]:
        return (
            "count every sequence of tokens whose texts join to the run exactly (special tokens "
            "aside): a dynamic program over the run's positions does it"
        )
    return (
        "replay the run into the grammar token by token: at each position, which of the tokens "
        "that fit the text does the mask allow?"
    )


Q4_SOLUTION = """\
import functools
from minirad.engine.grammar import GrammarCompiler, allocate_token_bitmask
from minirad.models import DEFAULT_MODEL_DIR
from minirad.engine.sampling_params import SamplingParams
from minirad.course.scenes import SHAPES_JSON_SCHEMA
from transformers import AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
compiler = GrammarCompiler(tokenizer, len(tokenizer))
params = SamplingParams(json_schema=SHAPES_JSON_SCHEMA)
prefix = tokenizer.encode('{"shapes": [{"colour": "red', add_special_tokens=False)
run = '", "shape": "'
texts = {t: tokenizer.decode([t]) for t in range(len(tokenizer))}
special = set(tokenizer.all_special_ids)

@functools.cache
def spellings(i):  # ways to write run[i:] with vocabulary tokens
    if i == len(run):
        return 1
    fits = [t for t, s in texts.items() if s and t not in special and run.startswith(s, i)]
    return sum(spellings(i + len(texts[t])) for t in fits)

def allowed(path, i):  # ways the masks allow, from the state after prefix + path
    if i == len(run):
        return 1
    grammar = compiler.compile(params, [2])
    grammar.accept_tokens(prefix + path)
    bitmask = allocate_token_bitmask(1, len(tokenizer))
    grammar.fill_bitmask(bitmask, 0)
    row = bitmask[0].tolist()
    ok = [t for t in range(len(tokenizer)) if (row[t // 32] >> (t % 32)) & 1]
    fits = [t for t in ok if texts[t] and run.startswith(texts[t], i)]
    return sum(allowed(path + [t], i + len(texts[t])) for t in fits)

answer = (spellings(0), allowed([], 0))
# (12, 1): the vocabulary spells the run 12 ways, but inside forced text llguidance's mask
# allows only the tokenizer's own tokenization, the one jump-forward appends."""

q4 = Exercise(
    "q4 spellings of a forced run",
    _check_q4,
    "First count how the vocabulary can spell the run (tokens whose texts join to it exactly). "
    "Then replay it into the grammar after the prefix and, at each position, keep only the "
    "tokens the mask allows.",
    Q4_SOLUTION,
)
