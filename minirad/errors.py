"""Typed errors raised by minirad.

Every check that rejects bad input raises one of these, before any state changes, so a
caller can catch :class:`MiniradError` and keep using the cache, pool or engine.
"""

from __future__ import annotations


class MiniradError(Exception):
    """Base class of every error minirad raises on purpose."""


class InvalidKeyError(MiniradError, ValueError):
    """A token key or a KV value does not fit the operation.

    Examples: a negative or non-integer token id, a value whose length differs from its key,
    slot indices that are already owned by the tree.
    """


class InvalidArgumentError(MiniradError, ValueError):
    """An argument other than a key is out of range (a negative size, an unknown policy name...)."""


class InvariantError(MiniradError, AssertionError):
    """``check_invariants()`` found a broken invariant: a bug in minirad or a caller's misuse."""


class LockError(MiniradError, RuntimeError):
    """A lock count would go below zero, or a lock targets a node no longer in the tree."""


class OutOfMemoryError(MiniradError, RuntimeError):
    """An allocation asks for more KV slots or blocks than are free."""


class UnknownBlockError(MiniradError, ValueError):
    """A free or reference change names a slot or block that is not currently allocated."""


class ImageError(MiniradError, ValueError):
    """An image is missing, unreadable, or does not match the placeholders of a prompt."""


class UnsupportedModelError(MiniradError, ValueError):
    """A model's architecture, or a feature of its config, is not one minirad's paged decoder
    implements (the message names the supported ones)."""


class RequestError(MiniradError, ValueError):
    """A generation request the engine cannot serve: an empty prompt, a prompt longer than
    the model's context, ``max_new_tokens < 1``, bad sampling parameters, or a request that
    could never fit in the KV pool. Raised by the engine before the request is queued."""


class GrammarError(RequestError):
    """A structured-output constraint the engine cannot serve: a JSON schema that is not JSON or
    that no value satisfies, a regex that does not parse, an empty choice list, or a token the
    grammar does not allow (:mod:`minirad.engine.grammar`)."""


class PeerError(MiniradError, RuntimeError):
    """A real peer engine (vLLM in its own venv, see ``make vllm``) is missing, did not start,
    or answered something minirad cannot read."""


class KVEventError(MiniradError, ValueError):
    """A KV-event frame (vLLM's ZMQ wire format) is malformed or truncated; the subscriber
    skips it and keeps running."""
