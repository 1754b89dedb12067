"""Loading the engine for a command, and turning a command's prompt into an engine request.

Only here do the commands import torch, transformers and the engine, and only when they run:
``minirad --help`` and a bad argument never load them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minirad.engine.sampling_params import SamplingParams
from minirad.entrypoints.chat_utils import chat_prompt
from minirad.errors import InvalidArgumentError, MiniradError

if TYPE_CHECKING:  # the engine imports torch and transformers
    from minirad.engine import GenerateRequest, LLMEngine

__all__ = ["engine_request", "load_engine"]


def load_engine(args: argparse.Namespace, **settings: Any) -> LLMEngine:
    """The engine over ``args.model`` (a folder :func:`.inputs.check_model_dir` accepted), on
    ``args.device`` in ``args.dtype``, torch at ``args.threads`` threads; ``settings`` are
    :class:`~minirad.engine.EngineConfig` fields.

    Raises:
        InvalidArgumentError: no loadable model in the folder; a ``--device`` this machine
            cannot use.
    """
    import torch
    from transformers.utils import logging as hf_logging

    from minirad.engine import LLMEngine, resolve_device

    try:  # before the weights load: a device this machine lacks is refused at once
        resolve_device(args.device)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"--device: {e}") from None
    # The course's models are tiny: a second intra-op thread only adds synchronisation.
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # "Loading weights" bars would bury the answer
    try:
        return LLMEngine.from_pretrained(
            args.model, dtype=getattr(torch, args.dtype), device=args.device, **settings
        )
    except MiniradError:
        raise
    except (OSError, ValueError) as e:  # transformers: no config, weights or processor files
        raise InvalidArgumentError(f"cannot load a model from {str(args.model)!r}: {e}") from e


def engine_request(
    engine: LLMEngine,
    prompt: str,
    images: Sequence[Path],
    raw: bool,
    params: SamplingParams,
) -> GenerateRequest:
    """The engine request for a CLI prompt (templated unless ``raw``;
    :func:`.inputs.check_prompt` has checked its placeholders)."""
    from minirad.engine import GenerateRequest

    if not raw:
        prompt = chat_prompt(engine.processor, prompt, len(images))
    return GenerateRequest(prompt, [str(p) for p in images], params)
