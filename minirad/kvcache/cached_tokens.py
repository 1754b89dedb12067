"""What SGLang finds cached, request by request: its request lifecycle on our :class:`RadixCache`.

SGLang reports ``cached_tokens`` for every request: prompt tokens whose KV came from its radix
tree. Requests sent to SGLang 0.5.23 one at a time, replayed here in the same order, get the
same count, request for request (``tests/test_sglang_cache.py`` checks it on the real server):

1. **Match** at most ``len(prompt) - 1`` tokens, in whole pages: the last prompt token is
   always computed, since its logits give the first output token.
2. **Allocate** the KV the request computes (:func:`kv_len`) past the match, in whole pages;
   when the pool is short, evict whole unlocked leaves, in the policy's order, until it fits
   (with pages > 1, until a spare page is free as well: :func:`_peak_free`).
3. **Insert** when it finishes: the tokens that have KV, in whole pages (a partial last page
   is freed). If that goes a page past the prompt's last whole page, the path is cut there
   and the prompt's nodes get the request's priority + 1, so that eviction can drop an answer
   and keep its prompt (SGLang inserts the prompt again after the whole sequence,
   ``UnifiedRadixCache.checkpoint_into_tree``; we insert it first, as a chunked prefill would:
   the same tree).

The insert rule, :func:`kv_len`. A token's KV is computed when the token is fed to the model:
the prompt in prefill, each output token in the decode step that samples the next one. The
last output token is sampled but never fed back, since the request ends there: so SGLang caches
``prompt + output[:-1]``. With the **overlap scheduler** (SGLang's default) the CPU prepares step
``n + 1`` while step ``n`` runs, before it knows what step ``n`` samples. A request whose step
``n`` samples a stop token (EOS) is already in step ``n + 1``, which feeds that token and
computes its KV: SGLang caches the stop token too. Unless step ``n`` was the request's last by
length: the scheduler knows in advance when a request reaches ``max_new_tokens`` and leaves it
out of the next step (``Scheduler._reqs_finishing_inflight``), so a stop token sampled as the
last allowed token is not cached, and neither is the last token of a length finish.
``--disable-overlap-schedule``: ``output[:-1]`` always.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from minirad.errors import InvalidArgumentError
from minirad.kvcache.eviction import EvictionPolicy
from minirad.kvcache.kv_pool import TokenToKVPoolAllocator
from minirad.kvcache.radix_cache import RadixCache, Req
from minirad.kvcache.tokens import as_token_ids

__all__ = ["ServedRequest", "kv_len", "replay_cached_tokens"]


class ServedRequest(NamedTuple):
    """A request as a server answered it: its ``max_new_tokens``, and ``stopped`` if it ended
    on a stop token (EOS or a ``stop_token_ids`` entry, which ``output`` includes)."""

    prompt: Sequence[int]
    output: Sequence[int]
    max_new_tokens: int
    stopped: bool


def kv_len(
    prompt_len: int, output_len: int, max_new_tokens: int, stopped: bool, overlap: bool = True
) -> int:
    """Tokens of ``prompt + output`` whose KV a finished request computed, which SGLang caches:
    all but the last output token; all of them, under the overlap scheduler, after a stop token
    sampled before ``max_new_tokens`` (module docstring).

    Raises:
        InvalidArgumentError: lengths that no finished request has (a prompt and an output of
            at least one token each, the output at most ``max_new_tokens``).
    """
    _check_lengths(prompt_len, output_len, max_new_tokens)
    fed_last = overlap and stopped and output_len < max_new_tokens
    return prompt_len + output_len - (0 if fed_last else 1)


def _check_lengths(prompt_len: object, output_len: object, max_new_tokens: object) -> None:
    if not all(type(n) is int for n in (prompt_len, output_len, max_new_tokens)):
        raise InvalidArgumentError(
            "prompt_len, output_len and max_new_tokens must be ints, got "
            f"{prompt_len!r}, {output_len!r}, {max_new_tokens!r}"
        )
    if prompt_len < 1 or not 1 <= output_len <= max_new_tokens:
        raise InvalidArgumentError(
            f"a finished request has a prompt and 1 .. max_new_tokens ({max_new_tokens}) output "
            f"tokens, got prompt_len={prompt_len}, output_len={output_len}"
        )


def _checked(request: object, i: int) -> ServedRequest:
    """Request ``i`` as a ServedRequest of token ids, or a typed error naming it."""
    try:
        prompt, output, max_new_tokens, stopped = request
        served = ServedRequest(
            as_token_ids(prompt, "prompt"), as_token_ids(output, "output"), max_new_tokens, stopped
        )
    except (TypeError, ValueError, InvalidArgumentError) as e:
        raise InvalidArgumentError(
            f"request {i} must be (prompt ids, output ids, max_new_tokens, stopped): {e}"
        ) from e
    if not isinstance(stopped, bool):
        raise InvalidArgumentError(f"request {i}: stopped must be a bool, got {stopped!r}")
    _check_lengths(len(served.prompt), len(served.output), max_new_tokens)
    return served


def _peak_free(prefill: int, total: int, page_size: int) -> int:
    """The most free slots SGLang asks for while a request computes ``prefill`` prompt tokens
    then decodes up to ``total`` KV tokens; it evicts until the pool has them. Page size 1:
    exactly what it allocates. Pages: one spare page more, at prefill and at every decode step
    (``alloc_paged_token_slots_extend`` / ``_decode`` over-estimate), the last step's peak on
    top of the pages that hold the tokens before it."""
    if page_size == 1:
        return total
    last_decode = -(-(total - 1) // page_size) * page_size + page_size if total > prefill else 0
    return max(prefill + page_size, last_decode)


def replay_cached_tokens(
    requests: Iterable[ServedRequest],
    max_total_tokens: int,
    page_size: int = 1,
    eviction_policy: str | EvictionPolicy = "lru",
    overlap: bool = True,
) -> list[int]:
    """Replay ``requests``, served one at a time in this order, as SGLang serves them (module
    docstring), through a :class:`RadixCache` over a pool of ``max_total_tokens`` slots.
    Returns each request's ``cached_tokens``.

    Raises:
        InvalidArgumentError: a request that is not (prompt ids, output ids, max_new_tokens,
            stopped) of a finished request.
        OutOfMemoryError: a request needs more than the pool holds with everything evicted.
    """
    alloc = TokenToKVPoolAllocator(max_total_tokens, page_size)
    cache = RadixCache(page_size, eviction_policy, alloc)
    cached = []
    for i, request in enumerate(requests):
        prompt, output, max_new_tokens, stopped = _checked(request, i)
        req = Req(f"r{i}", list(prompt))
        cache.match_prefix_for_req(req)  # 1
        cached.append(len(req.prefix_indices))
        n = kv_len(len(prompt), len(output), max_new_tokens, stopped, overlap)
        computed = len(prompt) - len(req.kv_indices)  # 2
        short = _peak_free(computed, n - len(req.kv_indices), page_size) - alloc.available_size()
        if short > 0:
            cache.evict(short)
        slots = alloc.alloc(n - len(req.kv_indices), owner=req.rid)
        # 3: the prompt (at priority 0 + 1 if the answer adds a page past it), then all of it.
        cut = len(prompt) - len(prompt) % page_size
        req.priority = 1 if 0 < cut < n - n % page_size else 0
        req.kv_indices += slots[:computed]
        cache.cache_unfinished_req(req)
        req.priority = 0
        req.kv_indices += slots[computed:]
        req.output_ids = list(output)
        cache.cache_finished_req(req)
    return cached
