"""The argument groups several ``minirad`` commands share, each defined once, and the help
formatters.

- :func:`add_model_options`, :func:`add_threads_option`, :func:`add_device_options`: the model
  folder, ``--raw``, ``--threads``, ``--device``, ``--dtype`` (every command that loads the
  model);
- :func:`add_engine_options`: the engine's settings (``batch`` and ``serve``): the KV pool, the
  prefix strategy, both policies and the hierarchical cache; :func:`engine_settings` turns them
  into :class:`~minirad.engine.EngineConfig` fields;
- :func:`add_schedule_policy_option`, :func:`add_eviction_policy_option`: SGLang's
  ``--schedule-policy`` and ``--radix-eviction-policy``, their choices read from the registries
  (:data:`~minirad.engine.schedule_policy.SCHEDULE_POLICIES`,
  :data:`~minirad.kvcache.eviction.EVICTION_POLICIES`). The old ``--policy`` stays as a hidden
  alias that warns (:class:`DeprecatedAlias`): it meant the scheduling order in ``batch`` and
  ``serve``, the eviction policy in ``explain``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from minirad.engine.schedule_policy import PREFIX_STRATEGIES, SCHEDULE_POLICIES
from minirad.entrypoints.argtypes import DTYPES, positive_float, positive_int, thread_count
from minirad.errors import InvalidArgumentError
from minirad.kvcache.eviction import EVICTION_POLICIES
from minirad.kvcache.tiers import DEFAULT_HICACHE_RATIO, WRITE_POLICIES
from minirad.peers.vllm_server import DEFAULT_MODEL_DIR

__all__ = [
    "DefaultsHelpFormatter",
    "DeprecatedAlias",
    "add_device_options",
    "add_engine_options",
    "add_eviction_policy_option",
    "add_model_options",
    "add_schedule_policy_option",
    "add_threads_option",
    "check_pool",
    "engine_settings",
]


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the flags' help, except None: those flags' help says what unset means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


class DeprecatedAlias(argparse.Action):
    """A hidden old flag that still works: it warns on stderr, ``minirad COMMAND: warning:
    --old is deprecated: use --new (note)``, then sets the new flag's ``dest`` to its value,
    checked against the new flag's ``choices`` (after the warning, so that a user who meant the
    other policy reads which flag that is)."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        *,
        use: str,
        choices: Sequence[str],
        note: str = "",
        **kwargs: Any,
    ) -> None:
        kwargs.update(help=argparse.SUPPRESS, default=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)
        self.use, self.allowed, self.note = use, tuple(choices), note

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        note = f" ({self.note})" if self.note else ""
        print(
            f"{parser.prog}: warning: {option_string} is deprecated: use {self.use}{note}",
            file=sys.stderr,
        )
        if values not in self.allowed:
            allowed = ", ".join(map(repr, self.allowed))
            raise argparse.ArgumentError(
                self, f"invalid choice: {values!r} (choose from {allowed})"
            )
        setattr(namespace, self.dest, values)


def add_model_options(p: argparse.ArgumentParser) -> None:
    """``--model``, ``--raw``, ``--threads`` and the device options (``generate``, ``batch``)."""
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="local model folder")
    p.add_argument(
        "--raw",
        action="store_true",
        help="send prompts as written (already templated, with image placeholders)",
    )
    add_threads_option(p)
    add_device_options(p)


def add_threads_option(p: argparse.ArgumentParser) -> None:
    """``--threads``: torch's intra-op threads (every command that loads the model)."""
    p.add_argument("--threads", type=thread_count, default=1, help="torch intra-op threads")


def add_device_options(p: argparse.ArgumentParser) -> None:
    """Where the engine runs and in which dtype (every command that loads the model)."""
    p.add_argument(
        "--device",
        default="cpu",
        help="where the model and the KV pool live: cpu, cuda, cuda:1, mps (checked before "
        "the model loads)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="the model's dtype, and so the KV pool's: bfloat16 halves their memory (answers "
        "may then differ from float32's where two tokens are nearly tied)",
    )


def add_schedule_policy_option(p: argparse.ArgumentParser) -> None:
    """SGLang's ``--schedule-policy`` (dest ``schedule_policy``), and the old ``--policy``."""
    _add_policy_option(
        p,
        "--schedule-policy",
        SCHEDULE_POLICIES,
        "fcfs",
        "the order waiting requests are admitted in (SGLang's flag; "
        "minirad/engine/schedule_policy.py says what each policy does)",
        old_policy_flag=True,
        note="--radix-eviction-policy chooses the eviction policy",
    )


def add_eviction_policy_option(
    p: argparse.ArgumentParser, *, old_policy_flag: bool = False, applies: str = "KV pool"
) -> None:
    """SGLang's ``--radix-eviction-policy`` (dest ``radix_eviction_policy``), for a radix tree
    over the ``applies`` (named in the help); with ``old_policy_flag``, also the old
    ``--policy`` (``explain``'s name for it)."""
    _add_policy_option(
        p,
        "--radix-eviction-policy",
        EVICTION_POLICIES,
        "lru",
        f"which unlocked leaf of the radix tree is evicted first when the {applies} is full "
        "(SGLang's flag; minirad/kvcache/eviction.py says what each policy does)",
        old_policy_flag=old_policy_flag,
    )


def _add_policy_option(
    p: argparse.ArgumentParser,
    flag: str,
    registry: Mapping[str, object],
    default: str,
    help_text: str,
    *,
    old_policy_flag: bool,
    note: str = "",
) -> None:
    """``flag``, its choices the ``registry``'s names; with ``old_policy_flag``, the hidden
    ``--policy`` that sets it too (:class:`DeprecatedAlias`)."""
    p.add_argument(flag, choices=tuple(registry), default=default, help=help_text)
    if old_policy_flag:
        p.add_argument(
            "--policy",
            action=DeprecatedAlias,
            dest=flag.removeprefix("--").replace("-", "_"),
            choices=tuple(registry),
            use=flag,
            note=note,
        )


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The engine settings that ``batch`` and ``serve`` share."""
    p.add_argument(
        "--prefix-strategy",
        choices=PREFIX_STRATEGIES,
        default="radix",
        help="reuse of cached prompt KV: radix (the longest cached prefix, images included, "
        "SGLang's RadixAttention), truncate (only the text before the first image), none",
    )
    p.add_argument("--page-size", type=positive_int, default=1, help="tokens per KV page")
    p.add_argument("--num-kv-slots", type=positive_int, default=4096, help="KV pool in tokens")
    add_schedule_policy_option(p)
    add_eviction_policy_option(p)
    tiers = p.add_argument_group("hierarchical cache (SGLang's HiCache: device -> host -> disk)")
    tiers.add_argument(
        "--enable-hierarchical-cache",
        action="store_true",
        help="back the radix tree's KV up to a host pool and load it back on a match",
    )
    tiers.add_argument(
        "--hicache-ratio",
        type=positive_float,
        default=None,
        help=f"host pool size over the device pool (default {DEFAULT_HICACHE_RATIO:g})",
    )
    tiers.add_argument(
        "--hicache-write-policy",
        choices=WRITE_POLICIES,
        default=None,
        help="when the host gets a copy (default write_through)",
    )
    tiers.add_argument(
        "--hicache-storage-dir",
        default=None,
        help="a folder for the disk tier: one safetensors file per page, found again by the "
        "next engine of the same model",
    )


def check_pool(args: argparse.Namespace) -> None:
    """Raises InvalidArgumentError if ``--num-kv-slots`` is not whole ``--page-size`` pages."""
    if args.num_kv_slots % args.page_size:
        raise InvalidArgumentError(
            f"--num-kv-slots {args.num_kv_slots} is not a multiple of --page-size "
            f"{args.page_size}: the pool is whole pages"
        )


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~minirad.engine.EngineConfig` fields of :func:`add_engine_options`' flags.

    Raises:
        InvalidArgumentError: a ``--hicache-*`` option without ``--enable-hierarchical-cache``.
    """
    settings: dict[str, Any] = {
        "prefix_strategy": args.prefix_strategy,
        "page_size": args.page_size,
        "num_kv_slots": args.num_kv_slots,
        "policy": args.schedule_policy,
        "eviction_policy": args.radix_eviction_policy,
    }
    tier_flags = (args.hicache_ratio, args.hicache_write_policy, args.hicache_storage_dir)
    if not args.enable_hierarchical_cache:
        if any(v is not None for v in tier_flags):
            raise InvalidArgumentError("the --hicache-* options need --enable-hierarchical-cache")
        return settings
    ratio, policy, folder = tier_flags
    settings["hicache_ratio"] = DEFAULT_HICACHE_RATIO if ratio is None else ratio
    settings["hicache_write_policy"] = policy or "write_through"
    if folder is not None:
        settings["hicache_storage_dir"] = folder
    return settings
