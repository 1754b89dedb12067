"""Structured output: a grammar as a state machine over tokens, its bitmask, and jump-forward.

A JSON schema, a regular expression or a list of choices defines a language of strings. Over a
tokenizer's vocabulary it becomes a state machine whose state is "the text so far": in each
state a *token bitmask* says which next tokens keep the text inside the language (one bit per
token, 32 tokens per ``int32`` word). Constrained decoding sets the logits of every other token
to ``-inf`` before sampling. When a state allows exactly one continuation (the quotes, keys and
braces a schema fixes), the engine need not decode it token by token: it appends the whole
forced run in one step, as a prefill chunk. That is *jump-forward decoding*, the compressed
finite-state machine of the SGLang paper (Zheng et al. 2024, §4).

The backend is llguidance (https://github.com/guidance-ai/llguidance), one of the three that
vLLM and SGLang use (with xgrammar and outlines-core): small, no runtime dependency, and offline
with a local tokenizer. The layout follows vLLM's ``v1/structured_output`` (a manager that
compiles and caches grammars, one ``Grammar`` object per request) and its ``backend_guidance.py``.

Three choices, and why:

- JSON is compact: the separators are ``", "`` and ``": "`` (``json.dumps``' defaults, and
  xgrammar's with ``any_whitespace=False``) and no other whitespace is allowed. With free
  whitespace the course's tiny model writes ``"{\\n\\n\\n..."`` until the length limit, in HF and
  vLLM alike. A schema's own ``"x-guidance"`` options override these defaults.
- The grammar's end-of-sequence tokens are the request's stop tokens (``<|im_end|>``, id 2, for
  the course model), not the tokenizer's ``eos_token`` (id 0): with id 0 the model, once the
  JSON is complete, may only emit ``<|endoftext|>`` and never stops on its own.
- Forced runs come from llguidance's ``compute_ff_tokens``: the forced *bytes* tokenized the
  way the tokenizer would tokenize them, minus any tail token that the next, free bytes could
  merge with. See :meth:`Grammar.jump_forward_tokens` for what that means for outputs.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence

import llguidance
import llguidance.hf
import torch
import transformers

from minirad.engine.sampling_params import SamplingParams
from minirad.errors import GrammarError, InvalidArgumentError

__all__ = [
    "JSON_DEFAULTS",
    "MAX_GRAMMAR_CHARS",
    "Grammar",
    "GrammarCompiler",
    "GrammarLogitsProcessor",
    "allocate_token_bitmask",
    "apply_token_bitmask",
]

# The longest constraint compiled, in characters of its JSON schema, regex or choice list
# (JSON): a grammar's size bounds its compile time and memory.
MAX_GRAMMAR_CHARS = 100_000
# llguidance's JSON options (``JsonCompileOptions``): compact JSON, as json.dumps writes it.
JSON_DEFAULTS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
_BITS = torch.arange(32, dtype=torch.int32)


def allocate_token_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask ``[batch_size, ceil(vocab_size / 32)]`` of ``int32`` (every bit
    set): bit ``t % 32`` of word ``t // 32`` allows token ``t``."""
    return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[b, t] = -inf`` wherever ``bitmask`` ``[B, W]`` forbids token ``t``, in place.

    Args:
        logits: ``[B, V]``, any float dtype, with ``V <= 32 * W``.
        bitmask: ``[B, W]`` ``int32`` words (:func:`allocate_token_bitmask`).

    Raises:
        InvalidArgumentError: the shapes or the dtype do not fit.
    """
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or logits.dim() != 2:
        raise InvalidArgumentError("apply_token_bitmask takes [B, V] logits and [B, W] int32")
    if not logits.is_floating_point():
        raise InvalidArgumentError(f"logits must be floating point (-inf), got {logits.dtype}")
    batch, vocab = logits.shape
    if bitmask.shape[0] != batch or vocab > 32 * bitmask.shape[1]:
        raise InvalidArgumentError(
            f"bitmask {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}"
        )
    # Word w, bit k -> token 32 w + k (little-endian bit order, as the backends write it).
    # Unpacked on the logits' device: the packed words (a bit per token) move, not the mask
    # (the matchers fill the bitmask on the CPU).
    dev = logits.device
    bits = _BITS if dev.type == "cpu" else _BITS.to(dev)
    allowed = ((bitmask.to(dev).unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))


class Grammar:
    """One request's grammar state (vLLM's ``StructuredOutputGrammar``): the text generated so far
    as a position in the grammar's state machine.

    Made by :meth:`GrammarCompiler.compile`. The engine calls :meth:`fill_bitmask` before
    sampling, :meth:`accept_token` after, and :meth:`jump_forward_tokens` to find a forced run.
    """

    def __init__(
        self, matcher: llguidance.LLMatcher, kind: str, stop_token_ids: Sequence[int]
    ) -> None:
        self._matcher = matcher
        self.kind = kind  # "json_schema", "regex" or "choice"
        self.stop_token_ids = frozenset(stop_token_ids)
        self.num_accepted = 0  # tokens accepted so far
        self.stopped = False  # a stop token was accepted (the grammar's end-of-sequence)
        # Stop tokens accepted once the matcher had already stopped: llguidance's consume_token
        # returns True for them without recording them, so its rollback must skip them.
        self._num_unrecorded = 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (``int32``, contiguous, CPU)."""
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        self._raise_if_error()

    def accept_token(self, token_id: int) -> None:
        """Advance by one generated token.

        Raises:
            GrammarError: the grammar does not allow the token (the matcher is then unusable).
        """
        was_stopped = self._matcher.is_stopped()
        if not self._matcher.consume_token(token_id):
            why = f" ({_one_line(self._matcher.get_error())})" if self._matcher.is_error() else ""
            raise GrammarError(f"token {token_id} is not allowed by the {self.kind} grammar{why}")
        self.num_accepted += 1
        self._num_unrecorded += was_stopped
        self.stopped = token_id in self.stop_token_ids

    def accept_tokens(self, token_ids: Sequence[int]) -> None:
        """Advance by several tokens (:meth:`accept_token` each)."""
        for t in token_ids:
            self.accept_token(t)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (for an engine that discards tokens;
        minirad's preemption keeps them, see :mod:`minirad.engine.scheduler`).

        Raises:
            GrammarError: more tokens than were accepted.
        """
        if not 0 <= num_tokens <= self.num_accepted:
            raise GrammarError(f"cannot roll back {num_tokens} of {self.num_accepted} tokens")
        unrecorded = min(num_tokens, self._num_unrecorded)  # the last accepted ones
        if not self._matcher.rollback(num_tokens - unrecorded):
            raise GrammarError(f"cannot roll back {num_tokens} of {self.num_accepted} tokens")
        self._num_unrecorded -= unrecorded
        self.num_accepted -= num_tokens
        self.stopped = False

    def jump_forward_tokens(self) -> list[int]:
        """The tokens the grammar forces next, or ``[]`` (nothing is accepted here).

        They tokenize the forced text as the tokenizer would tokenize it in one piece
        (``'", "shape": "'`` -> ``'"' ',' ' "' 's' 'ha' 'p' 'e' '"' ':' ' "'`` here). Token by
        token the model could have spelled the same text another way wherever the mask allows
        several splits (``'"'`` then ``' '``, where the run's tokenization has ``' "'``); its
        next free choice then sees other tokens, and may differ. Held back: a tail token that
        the free text after it could merge with, so the run is always a prefix of the canonical
        tokenization (llguidance's ``compute_ff_tokens``; SGLang instead retokenizes the whole
        text after a jump and recomputes what changed).
        """
        return self._matcher.compute_ff_tokens()

    @property
    def is_terminated(self) -> bool:
        """True when no token but an end-of-sequence token may follow (the text is complete)."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """True when the text so far is a complete member of the language."""
        return self._matcher.is_accepting()

    def _raise_if_error(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"{self.kind} grammar: {_one_line(self._matcher.get_error())}")


def _one_line(message: str) -> str:
    """llguidance's error without its echo of the grammar source (the lines from ``1 | ...``
    or its parser state from ``<state>`` on), on one line: what the user wrote and what is
    wrong with it."""
    lines = [line.strip() for line in message.splitlines()]
    end = next(
        (
            i
            for i, line in enumerate(lines)
            if line[:1].isdigit() and " | " in line or line.startswith("<state>")
        ),
        None,
    )
    return " ".join(line for line in lines[:end] if line and set(line) != {"^"})[:300]


class GrammarCompiler:
    """Compiles a request's ``json_schema`` / ``regex`` / ``choice`` into a :class:`Grammar`, each
    distinct grammar once (vLLM's ``StructuredOutputManager`` with its grammar cache).

    Args:
        tokenizer: the model's Hugging Face fast tokenizer.
        vocab_size: the model's vocabulary (logit columns), >= the tokenizer's.

    Compiling builds an llguidance matcher and checks the grammar: a schema that no value can
    satisfy, a regex that does not parse, or an unsupported keyword is a :class:`GrammarError`.
    The compiled matcher is kept by its key (kind, text, stop tokens); each request gets a copy.
    """

    def __init__(self, tokenizer: transformers.PreTrainedTokenizerFast, vocab_size: int) -> None:
        if not isinstance(tokenizer, transformers.PreTrainedTokenizerFast):
            raise InvalidArgumentError("structured output needs a fast Hugging Face tokenizer")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        # compile() runs on any thread (a server compiles off its engine thread): the caches
        # are read and written under this lock; the compiling itself runs outside it.
        self._lock = threading.Lock()
        self._ll_tokenizers: dict[tuple[int, ...], llguidance.LLTokenizer] = {}
        self._compiled: dict[tuple, llguidance.LLMatcher] = {}
        self.num_compiled = 0  # distinct grammars compiled
        self.num_cache_hits = 0  # compiles answered from the cache

    def compile(self, params: SamplingParams, stop_token_ids: Sequence[int]) -> Grammar:
        """A fresh :class:`Grammar` for ``params``' constraint, ending on ``stop_token_ids``.

        Raises:
            InvalidArgumentError: ``params`` has no constraint.
            GrammarError: the grammar is invalid or unsatisfiable (the message names why).
        """
        kind = params.structured_output_kind
        if kind is None:
            raise InvalidArgumentError("these sampling parameters have no grammar")
        stop = tuple(stop_token_ids)
        if bad := [t for t in stop if not 0 <= t < self.vocab_size]:
            raise GrammarError(f"stop token ids {bad} are outside the vocabulary")
        key = (*params.grammar_key, stop)
        if len(key[1]) > MAX_GRAMMAR_CHARS:
            raise GrammarError(
                f"the {kind} is {len(key[1]):,} characters long; the server compiles at most "
                f"{MAX_GRAMMAR_CHARS:,}"
            )
        with self._lock:
            template = self._compiled.get(key)
            self.num_cache_hits += template is not None
        if template is None:
            template = self._build(params, kind, stop)
            with self._lock:
                self._compiled[key] = template
                self.num_compiled += 1
        return Grammar(template.deep_copy(), kind, stop)

    def _build(
        self, params: SamplingParams, kind: str, stop: tuple[int, ...]
    ) -> llguidance.LLMatcher:
        """A checked matcher for ``params``' constraint.

        Raises:
            GrammarError: the grammar does not compile, allows no text, or is too complex for
                llguidance's limits (found by a trial of its first token, on a copy).
        """
        template = llguidance.LLMatcher(
            self._ll_tokenizer(stop), _grammar_text(params), log_level=0
        )
        if template.is_error():
            error = _one_line(template.get_error())
            if "limits." in error:  # llguidance's advice names its own settings, not the client's
                raise GrammarError(f"the {kind} is too large to compile: {error.split(';')[0]}")
            raise GrammarError(f"invalid {kind}: {error}")
        # A grammar whose first state allows no token (a regex of an empty character class)
        # would leave a request nothing to sample: refuse it here, not mid-step.
        start = allocate_token_bitmask(1, self.vocab_size)
        template.unsafe_compute_mask_ptr(start.data_ptr(), start.numel() * 4)
        if template.is_error() or not start.any():
            raise GrammarError(f"the {kind} allows no text: no token can start it")
        # Some limits (parser items per row, lexer states) are met only when a token is taken:
        # take the first forced or allowed one on a copy, so that such a grammar is refused
        # now, with its reason, rather than failing its request at the first step.
        trial = template.deep_copy()
        first = trial.compute_ff_tokens()[:1] or [_first_allowed(start)]
        if not trial.consume_token(first[0]) and trial.is_error():
            error = _one_line(trial.get_error())
            if "forced bytes" in error:  # the text it forces has no spelling in our tokens
                raise GrammarError(
                    f"the {kind} forces text this model cannot write as text (a special "
                    f"token's name, such as <|im_end|>, is not text): {error}"
                )
            raise GrammarError(f"the {kind} is too complex to enforce: {error}")
        return template

    def _ll_tokenizer(self, stop: tuple[int, ...]) -> llguidance.LLTokenizer:
        with self._lock:
            found = self._ll_tokenizers.get(stop)
        if found is None:
            # With no stop token the grammar still needs an end token; a request without
            # stop tokens finishes when its grammar terminates (Request.append_output_token_id).
            eos = list(stop) or [self.tokenizer.eos_token_id or 0]
            found = llguidance.hf.from_tokenizer(
                self.tokenizer, n_vocab=self.vocab_size, eos_token=eos
            )
            with self._lock:
                self._ll_tokenizers[stop] = found
        return found


def _grammar_text(params: SamplingParams) -> str:
    """The llguidance grammar of ``params``' constraint (a JSON string)."""
    matcher = llguidance.LLMatcher
    if params.json_schema is not None:
        # As text: llguidance's own conversion of a dict refuses an int outside 64 bits (a
        # 500 for `"minimum": 2**64`); JSON text carries any integer, as the str form did.
        schema = params.json_schema
        schema = schema if isinstance(schema, str) else json.dumps(schema)
        return matcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    if params.regex is not None:
        return matcher.grammar_from_regex(params.regex)
    # One lexeme whose alternatives are the choices (Lark string literals are JSON strings):
    # the lexer takes any number of them, where one grammar rule of N alternatives meets
    # llguidance's limit of 2000 items per parser row.
    return matcher.grammar_from_lark(
        "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in params.choice)
    )


def _first_allowed(bitmask: torch.Tensor) -> int:
    """The lowest token id a one-row bitmask allows."""
    words = bitmask[0]
    w = int(torch.nonzero(words).flatten()[0])
    word = int(words[w]) & 0xFFFFFFFF
    return 32 * w + ((word & -word).bit_length() - 1)


class GrammarLogitsProcessor(transformers.LogitsProcessor):
    """The same constraint for Hugging Face ``generate()`` (``logits_processor=[...]``): a
    :class:`Grammar` per batch row, advanced by each row's last token, masks the scores.

    Args:
        grammars: one fresh grammar per batch row (:meth:`GrammarCompiler.compile`).
        prompt_length: the (padded) prompt length; tokens after it are the generated ones.

    A row that has emitted a stop token is left alone: ``generate`` pads it from then on.
    """

    def __init__(self, grammars: Sequence[Grammar], prompt_length: int) -> None:
        self.grammars = list(grammars)
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[0] != len(self.grammars):
            raise InvalidArgumentError(
                f"{input_ids.shape[0]} rows, but the processor has {len(self.grammars)} grammars"
            )
        bitmask = allocate_token_bitmask(len(self.grammars), scores.shape[-1])
        for row, grammar in enumerate(self.grammars):
            if grammar.stopped:
                continue  # generate() pads this row; its mask stays all-allowed
            if input_ids.shape[1] > self.prompt_length:
                grammar.accept_token(int(input_ids[row, -1]))
            if not grammar.stopped:
                grammar.fill_bitmask(bitmask, row)
        scores = scores.clone()
        apply_token_bitmask(scores, bitmask)
        return scores
