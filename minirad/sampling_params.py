"""How to sample each next token and when to stop: vLLM's ``SamplingParams``
(``vllm/sampling_params.py``), SGLang's ``SamplingParams``.

Torch-free on purpose: the CLI checks a request's sampling flags and JSONL fields with this
class before it imports the engine (which takes seconds), so there is one set of rules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import RequestError

__all__ = ["SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop (vLLM / SGLang ``SamplingParams``).

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it before
            sampling.
        top_k: keep only the ``top_k`` most likely tokens (0: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches
            ``top_p`` (nucleus sampling; 1.0: all).
        seed: seeds this request's own ``torch.Generator``, so its samples do not depend on
            the other requests in the batch. None: the engine draws a seed from its own.
        max_new_tokens: stop after this many generated tokens (>= 1).
        stop_token_ids: stop after generating one of these (the stop token is kept in the
            output ids, as HF ``generate`` does). None: the model's EOS
            (``generation_config.eos_token_id``); ``()``: never stop on a token.

    Raises:
        RequestError: a parameter is out of range.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 16
    stop_token_ids: Sequence[int] | None = None

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

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1
