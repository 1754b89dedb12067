"""Why a request's generation stopped, in words, as ``generate`` and ``batch`` print it."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from minirad.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine imports torch
    from minirad.engine import RequestOutput

__all__ = ["cut_note", "finish_note"]


def finish_note(
    out: RequestOutput,
    max_new_tokens: int,
    max_model_len: int,
    params: SamplingParams | None = None,
) -> str:
    """Why a request's generation stopped, in words: ``"finish_reason: stop (...)"`` or
    ``"finish_reason: length (...)"`` (vLLM's and OpenAI's names), with the token counts.

    ``length`` names its cause: ``max_new_tokens`` reached, or the context full
    (prompt + output tokens == ``max_model_len``) before it. With a constraint in ``params``
    (the request's sampling parameters), a ``length`` note also says what the cut answer is
    (:func:`cut_note`).
    """
    n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
    if out.finish_reason == "length" and n_out < max_new_tokens:
        why = (
            f"the context is full: {n_prompt} prompt + {n_out} output tokens = max_model_len "
            f"{max_model_len}, before max_new_tokens {max_new_tokens}"
        )
    elif out.finish_reason == "length":
        why = f"max_new_tokens {max_new_tokens} reached"
    elif out.finish_reason == "stop":
        why = f"stop token after {n_out} tokens"
    else:
        why = f"{n_out} tokens"
    note = f"finish_reason: {out.finish_reason} ({why})"
    if out.finish_reason == "length" and params is not None:
        if cut := cut_note(out.text, params):
            note += f"; {cut}"
    return note


def cut_note(text: str, params: SamplingParams) -> str | None:
    """What an answer cut at the length limit is with respect to its constraint, or None
    (no constraint).

    The grammar only ever allowed prefixes of valid answers, so a cut answer is usually
    incomplete: JSON that does not parse, or a word that is not (yet) one of the choices.
    A cut answer may also be complete, with only its stop token cut off (the limit fell
    right after the last character); the note then says so. A regex answer is not checked
    here (Python's ``re`` is not the grammar's Rust syntax): the note says it may be partial.
    """
    kind = params.structured_output_kind
    if kind == "json_schema":
        try:
            json.loads(text)
        except ValueError:
            return "the output is cut: it is not valid JSON (raise --max-new-tokens)"
        return "the JSON is complete, only its stop token was cut"
    if kind == "choice":
        if text in params.choice:
            return "the choice is complete, only its stop token was cut"
        return "the output is cut: it is not one of the choices (raise --max-new-tokens)"
    if kind == "regex":
        return "the output is cut: it may be only a prefix of a regex match"
    return None
