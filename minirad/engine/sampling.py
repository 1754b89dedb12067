"""Sampling: next-token ids from logits, per request.

Greedy rows take the argmax (the whole batch in one call). Other rows go, one by one, through
temperature, top-k and top-p (nucleus) filtering, then one draw from the request's own seeded
``torch.Generator``: a request's samples depend only on its seed and its logits, never on
which other requests share the batch, or on whether it was preempted and recomputed.
Follows vLLM's ``v1/sample/sampler.py`` / ``ops/topk_topp_sampler.py`` (filters) and HF's
``TopKLogitsWarper`` / ``TopPLogitsWarper`` (semantics: ties at the k-th logit are kept, the
most likely token always survives top-p).

Devices: the logits may be on any device (the engine's), in any float dtype. Greedy rows take
their argmax where the logits are. Sampled rows are copied to the CPU in fp32, and drawn there
with the request's CPU generator. Why on the CPU and not with a generator on the device:

- a seed then names the same stream on every machine: CUDA's generator (Philox) and the
  CPU's (Mersenne Twister) draw different numbers from one seed, so a seeded request would
  answer differently on a GPU than on a laptop, and the engine's tests, on the CPU, would not
  pin down what a GPU run does;
- a generator belongs to its request: made when the request is added (``add_request``), before
  any step, and kept through preemption and recomputation, it needs no device of its own;
- the cost is one copy of the sampled rows, ``[rows, vocab]`` fp32 (a few hundred KB for a
  50k vocabulary) per step, small beside the forward pass. (vLLM makes seeded requests'
  generators on the GPU instead, to sample big batches without that copy.)
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
    """One token id from ``logits`` ``[V]`` (any dtype, any device; drawn in fp32 on the CPU,
    where ``generator`` lives: the module docstring says why)."""
    if params.greedy:
        return int(logits.argmax())
    x = logits.float().cpu()
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
    ``generators[i]``: the argmax on the logits' device for greedy rows, the others drawn on
    the CPU (one copy of those rows for the batch)."""
    tokens = logits.argmax(-1).tolist()
    drawn = [i for i, (p, _) in enumerate(zip(params, generators, strict=True)) if not p.greedy]
    if drawn:
        rows = logits[drawn].float().cpu()
        for i, row in zip(drawn, rows, strict=True):
            tokens[i] = sample_one(row, params[i], generators[i])
    return tokens
