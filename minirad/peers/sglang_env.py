"""Where the real SGLang lives: its own venv, built by ``make sglang``
(``tools/make_sglang_venv.sh``).

SGLang 0.5.23 pins a CUDA torch and transformers 5.19 (the course needs >= 5.24), so it is never
imported here: every use of it runs that venv's Python in a subprocess and talks to it over HTTP
or ZMQ, as with vLLM (:mod:`minirad.peers.vllm_env`).
"""

from __future__ import annotations

import os
from pathlib import Path

from minirad.errors import PeerError
from minirad.peers.vllm_env import REPO_ROOT

__all__ = ["SGLANG_VENV", "sglang_python"]

# ``MINIRAD_SGLANG_VENV`` points elsewhere (a venv shared between clones, say).
SGLANG_VENV = Path(os.environ.get("MINIRAD_SGLANG_VENV", REPO_ROOT / ".venv-sglang"))


def sglang_python(venv: str | os.PathLike | None = None) -> Path:
    """The Python of the SGLang venv.

    Raises:
        PeerError: the venv is not built (the message says how to build it).
    """
    venv = Path(venv) if venv is not None else SGLANG_VENV
    python = venv / "bin" / "python"
    if not (venv / ".installed").exists() or not python.exists():
        build = (
            "run `make sglang`"
            if venv == REPO_ROOT / ".venv-sglang"
            else f"build it with `tools/make_sglang_venv.sh {venv}` and `touch {venv}/.installed`"
            ", or unset MINIRAD_SGLANG_VENV to use `make sglang`'s .venv-sglang"
        )
        raise PeerError(
            f"the real SGLang is not installed in {venv}: {build} (an isolated CPU venv with "
            "sglang 0.5.23, about 3.4 GB, two minutes)"
        )
    return python
