"""The course: what the chapters draw, replay and train, and their one-call setup.

``scenes.py`` draws the tiny VLM's pictures, ``train.py`` trains it, ``scenario.py`` replays
scripted requests through a real cache, ``dot.py`` draws trees with Graphviz, and
``recordings.py`` keeps chapter 08's real-vLLM session.

:func:`setup` makes a chapter reproducible, quiet, and small.

Every chapter starts with ``from minirad.course import setup; setup()``. Outputs are committed
and compared by nbval, so every source of run-to-run noise is pinned here: random seeds,
torch's thread count (reduction order depends on it), print precision, and library warnings
that would land in stderr (nbval compares stderr too).
"""

from __future__ import annotations

import os
import random
import warnings

__all__ = ["setup"]


def setup(seed: int = 0, threads: int = 1) -> None:
    """Seed Python, NumPy and torch with ``seed``; use ``threads`` torch threads; silence
    progress bars, tokenizer fork warnings and transformers' info logs."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    torch.set_printoptions(precision=4, sci_mode=False)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # "Loading weights" bars would land in stderr
