"""Sampling: next-token ids from logits, per request.

Greedy rows take the argmax (the whole batch in one call). Other rows go, one by one, through
temperature, top-k and top-p (nucleus) filtering, then one draw from the request's own seeded
``torch.Generator``: a request's samples depend only on its seed and its logits, never on
which other requests share the batch, or on whether it was preempted and recomputed.
Follows vLLM's ``v1/sample/sampler.py`` / ``ops/topk_topp_sampler.py`` (filters) and HF's
``TopKLogitsWarper`` / ``TopPLogitsWarper`` (semantics: ties at the k-th logit are kept, the
most likely token always survives top-p).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minirad.engine.sampling_params import SamplingParams

__all__ = ["apply_top_k", "apply_top_p", "sample", "sample_one"]


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits`` ``[V]`` with every token below the k-th largest set to ``-inf``
    (``k`` = 0 or >= V: unchanged)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """``logits`` ``[V]`` restricted to the smallest set of most likely tokens whose total
    probability is at least ``p`` (``p`` = 1: unchanged)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.softmax(-1)
    # Drop a token if the tokens before it already reach p; the first one always stays, also
    # when p is below float32's smallest number (1e-46 is 0 there, and 0 >= 0).
    drop = (probs.cumsum(-1) - probs) >= p
    drop[0] = False
    return logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))


def sample_one(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> int:
    """One token id from ``logits`` ``[V]`` (any dtype; computed in fp32)."""
    if params.greedy:
        return int(logits.argmax())
    x = logits.float().cpu()  # the generators live on the CPU
    # Shifted so the largest logit is 0 before dividing: a tiny temperature then sends the
    # others to -inf instead of the largest to inf (inf - inf: NaN probabilities).
    x = (x - x.max()) / params.temperature
    x = apply_top_p(apply_top_k(x, params.top_k), params.top_p)
    return int(torch.multinomial(x.softmax(-1), 1, generator=generator))


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """Next token of each row of ``logits`` ``[B, V]``, row ``i`` with ``params[i]`` and
    ``generators[i]``."""
    tokens = logits.argmax(-1).tolist()
    for i, (p, g) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            tokens[i] = sample_one(logits[i], p, g)
    return tokens
