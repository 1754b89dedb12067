"""How to sample each next token and when to stop: vLLM's ``SamplingParams``
(``vllm/sampling_params.py``), SGLang's ``SamplingParams``.

Torch-free on purpose: the CLI checks a request's sampling flags and JSONL fields with this
class before it imports the engine (which takes seconds), so there is one set of rules.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from minirad.errors import GrammarError, RequestError

__all__ = ["SAMPLING_EPS", "SamplingParams"]

# Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``).
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop (vLLM / SGLang ``SamplingParams``).

    Attributes:
        temperature: 0 means greedy (argmax), and so does any value below
            :data:`SAMPLING_EPS` (vLLM's rule: dividing by a temperature that float32 holds as
            0, such as 1e-46, would give NaN probabilities); otherwise logits are divided by
            it before sampling.
        top_k: keep only the ``top_k`` most likely tokens (0: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches
            ``top_p`` (nucleus sampling; 1.0: all).
        seed: seeds this request's own ``torch.Generator``, so its samples do not depend on
            the other requests in the batch. None: the engine draws a seed from its own.
        max_new_tokens: stop after this many generated tokens (>= 1).
        stop_token_ids: stop after generating one of these (the stop token is kept in the
            output ids, as HF ``generate`` does, and left out of the text unless
            ``include_stop_str_in_output``, as vLLM does). None: the model's EOS
            (``generation_config.eos_token_id``); ``()``: never stop on a token.
        stop: stop when the output text contains one of these strings (vLLM's ``stop``). The
            text is cut before it (``include_stop_str_in_output``: after it); the token ids
            end with the token that completed it, in the step that completed it. A str is one
            stop string.
        include_stop_str_in_output: keep the stop string, or the stop token's text, at the
            end of the text.
        json_schema: constrain the output to JSON valid against this schema (a dict, or its
            JSON text), written compactly (:data:`minirad.engine.grammar.JSON_DEFAULTS`).
        regex: constrain the output to a full match of this regular expression (Rust
            ``regex`` syntax, as vLLM's and SGLang's backends read it).
        choice: constrain the output to exactly one of these strings.
            At most one of ``json_schema``, ``regex`` and ``choice`` (SGLang's names; vLLM's
            ``StructuredOutputsParams`` has ``json``, ``regex``, ``choice``). The grammar is
            compiled when the engine takes the request (:mod:`minirad.engine.grammar`); its
            end-of-sequence tokens are the stop tokens, and with ``stop_token_ids=()`` the
            request stops when the grammar is complete.

    Raises:
        RequestError: a parameter is out of range, or ``stop`` is not a list of non-empty
            strings.
        GrammarError: more than one constraint, a schema that is not a JSON object, an empty
            regex, or an empty or non-string choice list.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 16
    stop_token_ids: Sequence[int] | None = None
    stop: str | Sequence[str] | None = None
    include_stop_str_in_output: bool = False
    json_schema: Mapping[str, Any] | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if type(self.max_new_tokens) is not int or self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        t = self.temperature
        if not isinstance(t, int | float) or isinstance(t, bool) or not 0 <= t < math.inf:
            raise RequestError(f"temperature must be a finite number >= 0, got {t!r}")
        if type(self.top_k) is not int or self.top_k < 0:
            raise RequestError(f"top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise RequestError(f"seed must be an int or None, got {self.seed!r}")
        if self.stop_token_ids is not None:
            ids = tuple(self.stop_token_ids)
            if not all(isinstance(t, int) and t >= 0 for t in ids):
                raise RequestError(f"stop_token_ids must be ints >= 0, got {ids!r}")
            object.__setattr__(self, "stop_token_ids", ids)
        if self.stop is not None:
            stops = (self.stop,) if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, list | tuple) or not all(
                isinstance(x, str) and x for x in stops
            ):
                raise RequestError(f"stop must be a list of non-empty strings, got {self.stop!r}")
            object.__setattr__(self, "stop", tuple(stops))
        self._check_constraint()

    def _check_constraint(self) -> None:
        given = [n for n in ("json_schema", "regex", "choice") if getattr(self, n) is not None]
        if len(given) > 1:
            raise GrammarError(f"give at most one of json_schema, regex, choice; got {given}")
        schema = self.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(
                    f"json_schema, given as a str, must be the JSON text of a schema object; "
                    f"it is not valid JSON: {e}"
                ) from None
        if schema is not None:
            if not isinstance(schema, Mapping):
                raise GrammarError(f"json_schema must be a JSON object, got {schema!r}")
            try:
                json.dumps(schema, allow_nan=False)  # NaN and Infinity are not JSON
            except (TypeError, ValueError) as e:
                raise GrammarError(f"json_schema is not JSON-serializable: {e}") from None
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise GrammarError(f"regex must be a non-empty string, got {self.regex!r}")
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple):  # ordered: a set's order varies
                raise GrammarError(
                    f"choice must be a list of strings, got {type(self.choice).__name__}"
                )
            choices = tuple(self.choice)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise GrammarError(
                    f"choice must be a non-empty list of non-empty strings: {choices}"
                )
            object.__setattr__(self, "choice", choices)

    @property
    def structured_output_kind(self) -> str | None:
        """``"json_schema"``, ``"regex"``, ``"choice"``, or None (unconstrained)."""
        for name in ("json_schema", "regex", "choice"):
            if getattr(self, name) is not None:
                return name
        return None

    @property
    def grammar_key(self) -> tuple[str, str] | None:
        """``(kind, text)`` that identifies the constraint (the grammar cache's key), or None.
        A schema's key is its JSON text with its own key order: property order is part of the
        grammar."""
        kind = self.structured_output_kind
        if kind is None:
            return None
        value = getattr(self, kind)
        if kind == "json_schema" and not isinstance(value, str):
            value = json.dumps(value)
        elif kind == "choice":
            value = json.dumps(list(value))
        return kind, value

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature below :data:`SAMPLING_EPS`, or
        top_k 1)."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1
